"""modeling.chat.template: the checkpoint's chat template rendered like transformers' apply_chat_template,
within its RenderLimits, and generation_config.json defaults.

tests/data holds Qwen3-, Qwen2.5- and Qwen3.5-style templates (tools, <think> handling,
enable_thinking; content blocks and XML tool calls for Qwen3.5); every conversation below is
rendered by ChatTemplate and by transformers' PreTrainedTokenizerFast.apply_chat_template(
tokenize=False) from the same text: the strings must be identical.

Hostile templates (endless loops, gigabyte strings) run in a separate process with a timeout and
512 MiB of data, so that a bound that no longer holds fails its test instead of hanging the run.
"""

import importlib.metadata
import json
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from modeling.chat.template import (CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, GenerationDefaults, RenderLimitError,
                           RenderLimits, format_chat, generation_defaults)

DATA = Path(__file__).parent / "data"
# transformers 5 drops None-valued message keys and aliases reasoning fields before rendering, as
# ChatTemplate does; transformers 4 passes messages through unchanged.
TRANSFORMERS_4 = int(importlib.metadata.version("transformers").split(".")[0]) < 5
QWEN3 = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
QWEN_TEMPLATES = {name: (DATA / f"{name}_chat_template.jinja").read_text(encoding="utf-8")
                  for name in ("qwen3", "qwen2_5", "qwen3_5")}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville <b>now</b> & \"quoted\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "东京"}},
                       "required": ["city"]},
    },
}]
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Name three primes."}],
    "system_user": [SYSTEM, {"role": "user", "content": "Name three primes."}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Say both in French, ünïcödé and 🙂 allowed."},
    ],
    "continues_after_last_query": [  # assistant turns after the last query keep their reasoning
        {"role": "user", "content": "Plan a trip."},
        {"role": "assistant", "content": "Step one.", "reasoning_content": "Think about step one."},
        {"role": "assistant", "content": "<think>\nmore\n</think>\nStep two."},
    ],
    "reasoning_aliases": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "Greet back."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!", "reasoning": "Wave.", "tool_calls": None},
    ],
    "tools": [
        SYSTEM,
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
        ]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 25}"},
        {"role": "assistant", "content": "Paris 21, Tokyo 25."},
        {"role": "user", "content": "<tool_response>\nnot a real query\n</tool_response>"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_render(tokenizer_file, template, messages, special_tokens=None, **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), chat_template=template,
                                  **(special_tokens or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def checkpoint(tmp_path, tokenizer_file, template=None, where="jinja", **tokenizer_config) -> Path:
    """A directory with tokenizer.json, tokenizer_config.json and the template in chat_template.jinja
    (``where="jinja"``), in tokenizer_config.json (``"config"``), or nowhere (``template=None``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, **tokenizer_config}
    if template is not None and where == "config":
        config["chat_template"] = template
    elif template is not None:
        (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("where", ["jinja", "config"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_template_matches_transformers(tmp_path, tokenizer_file, name, where):
    if TRANSFORMERS_4 and name == "reasoning_aliases":
        pytest.skip("transformers 4 does not alias reasoning fields")
    messages = CONVERSATIONS[name]
    template = ChatTemplate.from_pretrained(checkpoint(tmp_path, tokenizer_file, QWEN3, where))
    assert template.origin == ("chat_template.jinja" if where == "jinja" else "tokenizer_config.json")
    tools = TOOLS if name == "tools" else None
    for add_generation_prompt in (True, False):
        for thinking in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            ours = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **thinking)
            theirs = hf_render(tokenizer_file, QWEN3, messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, **thinking)
            assert ours == theirs, (add_generation_prompt, thinking)


VISION = [  # content blocks, as the Qwen3.5 template reads them
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "video"},
                                 {"type": "image_url", "image_url": "x"}]},
    {"role": "assistant", "content": "A cat.", "tool_calls": [{"type": "function", "function": {
        "name": "look", "arguments": {"where": "here", "n": 3, "opts": {"a": [1, 2]}, "seen": ["x"]}}}]},
    {"role": "tool", "content": "ok"},
    {"role": "user", "content": "thanks"},
]


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3_5"])
def test_qwen2_5_and_qwen3_5_templates_match_transformers(tokenizer_file, template):
    source = QWEN_TEMPLATES[template]
    conversations = {**CONVERSATIONS, **({"vision": VISION} if template == "qwen3_5" else {})}
    ours = ChatTemplate(source)
    for name, messages in conversations.items():
        if TRANSFORMERS_4 and name == "reasoning_aliases":
            continue
        for tools in (None, TOOLS):
            for thinking in ({}, {"enable_thinking": False}):
                expected = hf_render(tokenizer_file, source, messages, tools=tools, add_generation_prompt=True,
                                     **thinking)
                assert ours.render(messages, tools=tools, **thinking) == expected, (name, tools is None, thinking)


def test_qwen3_rendering(tmp_path, tokenizer_file):
    """What the Qwen3 template produces: enable_thinking=False opens an empty think block; the
    reasoning of earlier turns is dropped; tool schemas are JSON without HTML escaping."""
    t = ChatTemplate.from_pretrained(checkpoint(tmp_path, tokenizer_file, QWEN3))
    convo = CONVERSATIONS["system_user"]
    head = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nName three primes.<|im_end|>\n")
    assert t.render(convo) == head + "<|im_start|>assistant\n"
    assert t.render(convo, enable_thinking=True) == head + "<|im_start|>assistant\n"
    assert t.render(convo, enable_thinking=False) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert t.render(convo, add_generation_prompt=False) == head
    multi = t.render(CONVERSATIONS["multi_turn"])
    assert "Two plus two" not in multi and "<|im_start|>assistant\n4<|im_end|>" in multi
    tools = t.render(CONVERSATIONS["tools"], tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in tools and "<b>now</b>" in tools and "東京" in tools
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        t.render([{"role": "robot", "content": "beep"}])


def test_no_template_falls_back_to_chatml(tmp_path, tokenizer_file):
    t = ChatTemplate.from_pretrained(checkpoint(tmp_path, tokenizer_file))
    assert t.is_default and t.source == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert t.render(messages, add_generation_prompt=False) == expected
    assert t.render(messages) == expected + "<|im_start|>assistant\n"
    assert t.render(messages) == hf_render(tokenizer_file, CHATML_TEMPLATE, messages, add_generation_prompt=True)
    for add in (True, False):  # format_chat (no jinja2: the trainer's dialogue) writes the same text
        assert format_chat(messages, add_generation_prompt=add) == t.render(messages, add_generation_prompt=add)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path, tokenizer_file):
    path = checkpoint(tmp_path, tokenizer_file, "config says {{ messages[0].content }}", where="config")
    (path / "chat_template.jinja").write_text("file says {{ messages[0].content }}")
    assert ChatTemplate.from_pretrained(path).render([{"role": "user", "content": "x"}]) == "file says x"
    (path / "chat_template.jinja").unlink()
    assert ChatTemplate.from_pretrained(path).render([{"role": "user", "content": "x"}]) == "config says x"


def test_named_templates(tmp_path, tokenizer_file):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
    t = ChatTemplate.from_pretrained(checkpoint(tmp_path / "a", tokenizer_file, named, where="config"))
    msg = [{"role": "user", "content": "x"}]
    assert t.render(msg) == "plain" and t.render(msg, tools=TOOLS) == "tools: 1"
    assert t.render(msg, tools=TOOLS) == hf_render(tokenizer_file, {d["name"]: d["template"] for d in named}, msg,
                                                   tools=TOOLS)
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate.from_pretrained(checkpoint(tmp_path / "b", tokenizer_file, named[1:], where="config"))


# A template that uses every helper transformers defines, and {% generation %}.
HELPERS = """{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}
{%- generation %}{{ m.content }}{% endgeneration %}
{% else %}{{ m.content | tojson }} {{ m | tojson(indent=2, sort_keys=true) }}
{% endif %}{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}
{%- set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ eos_token }} [{{ pad_token }}] [{{ unk_token is defined }}] {{ custom }}
"""


def test_helpers_match_transformers(tmp_path, tokenizer_file):
    first = {"role": "user", "content": "<b>'quote' & \"double\" ü</b>"}
    if not TRANSFORMERS_4:
        first["extra"] = None  # dropped before rendering
    messages = [first, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "never shown"}]
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    t = ChatTemplate.from_pretrained(checkpoint(tmp_path, tokenizer_file, HELPERS, bos_token="<|endoftext|>",
                                                pad_token={"content": "<|endoftext|>", "special": True}))
    ours = t.render(messages, custom="value")
    theirs = hf_render(tokenizer_file, HELPERS, messages, {**specials, "pad_token": "<|endoftext|>"},
                       add_generation_prompt=True, custom="value")
    assert ours == theirs
    assert ours.startswith("<|endoftext|>\"<b>'quote' & \\\"double\\\" ü</b>\" {\n  \"content\"")
    assert '"extra"' not in ours and "never shown" not in ours and "[False]" in ours


def test_strftime_now_and_raise_exception(tmp_path, tokenizer_file):
    t = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", t.render([{"role": "user", "content": "x"}]))
    assert t.render([{"role": "user", "content": "x"}])[:4] == str(datetime.now().year)
    t = ChatTemplate("{{ raise_exception('only user and assistant roles') }}", origin="chat_template.jinja")
    with pytest.raises(ChatTemplateError, match=r"^chat template \(chat_template.jinja\): TemplateError: only user"):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ messages.append({'role': 'x'}) }}",  # immutable sandbox: no mutation of the inputs
    "{{ ''.__class__.__mro__ }}",
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ '{0.__class__.__mro__}'.format('x') }}",  # str.format runs with the sandbox's (bounded) formatter
    "{{ ('{0.__class__.__mro__}'|safe).format('x') }}",
    "{{ '{a.__class__.__mro__}'.format_map({'a': 'x'}) }}",
])
def test_sandbox(source):
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_bad_templates_and_messages(tmp_path, tokenizer_file):
    with pytest.raises(ChatTemplateError, match=r"chat template \(<string>\) line 2: "):
        ChatTemplate("ok\n{% for m in messages %}")
    path = checkpoint(tmp_path, tokenizer_file, 42, where="config")
    with pytest.raises(ChatTemplateError, match="must be a string"):
        ChatTemplate.from_pretrained(path)
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="unreadable tokenizer_config.json"):
        ChatTemplate.from_pretrained(path)
    t = ChatTemplate.chatml()
    for bad in ([], "hello", [["user", "hi"]]):
        with pytest.raises(ChatTemplateError):
            t.render(bad)
    assert issubclass(ChatTemplateError, ValueError)


class Secret:
    """Not a JSON value: a template must see no more of it than its type's name."""

    token = "t0ken"

    def __str__(self):
        return "leaked"


class Shout(str):
    def shout(self):
        return self.upper()


def test_only_json_values_reach_the_template(tokenizer_file):
    """Anything but dict / list / tuple / str / int / float / bool / None becomes "<TypeName>", at
    any depth of the messages, tools and keyword variables; a str subclass arrives as a plain str,
    a numpy scalar as its value (as transformers 5 does): no object's attributes or methods."""
    import numpy as np

    source = ("{% for m in messages %}{{ m.content }}|{{ m.content.token }}|{{ m.meta.nested[0] }}|"
              "{{ m.meta.nested[0].token }};{% endfor %}{{ extra }}|{{ extra.token }}|{{ word }}|"
              "{{ word.shout is defined }}|{{ count + 1 }}|{{ tools[0].fn }}")
    messages = [{"role": "user", "content": Secret(), "meta": {"nested": (Secret(),)}}]
    variables = dict(extra=Secret(), word=Shout("hi"), count=np.int64(41), tools=[{"fn": Secret()}])
    ours = ChatTemplate(source).render(messages, **variables)
    assert ours == "<Secret>||<Secret>|;<Secret>||hi|False|42|<Secret>"
    if not TRANSFORMERS_4:
        assert ours == hf_render(tokenizer_file, source, messages, add_generation_prompt=True, **variables)


def test_reasoning_is_visible_as_thinking_and_as_reasoning_content(tokenizer_file):
    """Qwen templates read ``reasoning_content``, gpt-oss ones ``thinking``: a message's reasoning,
    under any of the three names, is visible under both, as transformers 5 passes it."""
    source = "{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}]{% endfor %}"
    messages = [{"role": "assistant", "content": "a", "reasoning_content": "r1"},
                {"role": "assistant", "content": "b", "reasoning": "r2"},
                {"role": "assistant", "content": "c", "thinking": "r3"},
                {"role": "assistant", "content": "d", "thinking": None}]
    ours = ChatTemplate(source).render(messages)
    assert ours == "[r1|r1][r2|r2][r3|r3][|]"
    if not TRANSFORMERS_4:
        assert ours == hf_render(tokenizer_file, source, messages, add_generation_prompt=True)


# The constructs the bounds route through their checks ({% for %} and recursive loops, ~ (escaping
# in an autoescape block), literals, *args, macros with varargs, captured blocks, str.format and %,
# the string methods, operators and filters that check their arguments): rendered as transformers
# renders them.
BOUNDED_CONSTRUCTS = r"""
{%- macro row(label) -%}
{{ label ~ ': ' ~ varargs|join(',') ~ (kwargs|tojson) }}{{ caller() if caller is defined }}
{%- endmacro -%}
{%- set ns = namespace(items=[], n=0) -%}
{%- for m in messages -%}
  {%- set ns.items = ns.items + [m.role ~ '/' ~ loop.index] -%}
  {%- set ns.n = ns.n + loop.length -%}
{%- endfor -%}
{{ ns.items|join('|') }} {{ ns.n }} {{ ns }}
{{ [messages[0].role, {'k': messages|length}] }} {{ (messages[0].role, 2) }}
{{ {'a': [1, messages|length]}|tojson(indent=2) }}
{{ row('r', 1, 2, x=3) }} {% call row('c') %}inside{% endcall %} {{ row('all', *range(3)) }}
{% for x in [[1, [2, 3]], 4] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}{% endfor %}
{% for s in messages|map(attribute='role')|map('upper') %}{{ s }}{{ loop.length }}{{ '' if loop.last else ',' }}
{%- endfor %}
{% set block %}{% for i in range(3) %}<{{ i }}>{% endfor %}{% endset %}{{ block }}
{% filter upper %}shout{% endfilter %}
{{ '%s=%05.1f|%-4d|' % ('a', 2.5, 7) }}{{ '%(x)s' % {'x': 'y'} }}
{{ '{0}-{1:>6}-{k}'.format('a', 'b', k=3) }} {{ '{a}'.format_map({'a': 1}) }}
{{ 'ab'.ljust(5, '.') }}{{ 'ab'.center(6, '*') }}{{ '7'.zfill(3) }}{{ 'a\tb'.expandtabs(4) }}
{{ 'a-b-c'.replace('-', '+', 1) }}{{ ', '.join(['x', 'y']) }}{{ 'abc'.translate({97: 'A'}) }}
{{ 'x' * 3 }}{{ [1, 2] * 2 }}{{ 2 ** 10 }}{{ 7 % 3 }}{{ 'a' + 'b' }}{{ [1] + [2] }}{{ 'a' ~ 1 ~ none }}
{{ range(5)|batch(2, 0)|list }}{{ range(5)|slice(2)|list }}{{ [[1], [2]]|sum(start=[]) }}
{{ 'a\nb'|indent(2, true) }}{{ 'ab'|center(6) }}{{ 'one two three four'|wordwrap(7) }}
{{ 'x-y'|replace('-', '=') }}{{ '%s!'|format('hi') }}{{ range(3)|join('-') }}
{{ 'see www.example.com'|urlize }} {{ {'a': 1}|pprint }} {{ 'long sentence here'|truncate(9) }}
{{ dict.fromkeys(['a', 'b'], 0) }}{{ cycler('x', 'y').next() }}{{ (5).to_bytes(2, 'big') }}
{{ lipsum(1, false, 5, 6)|length > 0 }}
{% autoescape true %}{{ '<a>' ~ messages[0].content ~ ('<b>'|safe) }}{% endautoescape %} {{ '<a>' ~ ('<b>'|safe) }}
"""


def test_bounded_constructs_render_as_in_transformers(tokenizer_file):
    messages = [{"role": "system", "content": "s&"}, {"role": "user", "content": "u"}]
    ours = ChatTemplate(BOUNDED_CONSTRUCTS).render(messages)
    assert ours == hf_render(tokenizer_file, BOUNDED_CONSTRUCTS, messages, add_generation_prompt=True)
    assert "system/1|user/2 4" in ours and "[1[23]]4" in ours and "SYSTEM2,USER2" in ours
    assert "&lt;a&gt;s&amp;<b> <a><b>" in ours


# Render limits ---------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
S3M = "{% set s = 'x' * 3000000 %}"
ATTACKS = {  # name: (template, the bound it must hit, RenderLimits fields other than the defaults)
    "nested loops": (NESTED_LOOPS, "max_loop_iterations", {}),
    "recursive loop": ("{% for x in range(10) recursive %}{{ loop(range(10)) if loop.depth < 8 }}{% endfor %}",
                       "max_loop_iterations", {"max_loop_iterations": 20000}),
    "loop.length of a lazy sequence": (
        "{% for s in range(1000000)|map('center', 4000) %}{{ loop.length }}{% endfor %}", "max_chars", {}),
    "indent": (r"{{ 'a\nb'|indent(10**9) }}", "max_chars", {}),
    "center": ("{{ 'x'|center(10**9) }}", "max_chars", {}),
    "tojson indent 1e8": ("{{ messages|tojson(indent=1e8) }}", "max_chars", {}),
    "tojson indent 10**8": ("{{ messages|tojson(indent=10**8) }}", "max_chars", {}),
    "string repeat": ("{{ 'x' * 10**9 }}", "max_chars", {}),
    "list repeat of a long string": (S3M + "{{ [s] * 1000 }}", "max_chars", {}),
    "range list": ("{{ range(10**10)|list }}", "max_items", {}),
    "join filter": ("{{ range(100000)|join('x' * 100000) }}", "max_chars", {}),
    "str.join of a lazy sequence": ("{{ ('x' * 100000).join(range(100000)|map('string')) }}", "max_chars", {}),
    "format filter width": ('{{ "%1000000000s"|format(1) }}', "max_chars", {}),
    "% width": ('{{ "%1000000000s" % 1 }}', "max_chars", {}),
    "% star width": ("{{ '%*s' % (10**9, 'x') }}", "max_chars", {}),
    "% precision": ("{{ '%.1000000000f' % 1.5 }}", "max_chars", {}),
    "% one key many times": (S3M + "{{ '%(a)s%(a)s' % {'a': s} }}", "max_chars", {}),
    "str.format width": ("{{ '{:1000000000}'.format(1) }}", "max_chars", {}),
    "str.format nested width": ("{{ '{:{w}}'.format(1, w=10**9) }}", "max_chars", {}),
    "str.format one field many times": (S3M + "{{ '{0}{0}'.format(s) }}", "max_chars", {}),
    "Markup.format width": ("{{ ('{:1000000000}'|safe).format(1) }}", "max_chars", {}),
    "str.ljust": ("{{ 'x'.ljust(10**9) }}", "max_chars", {}),
    "str.zfill": ("{{ '1'.zfill(10**9) }}", "max_chars", {}),
    "str.expandtabs": (r"{{ ('\t' * 1000).expandtabs(10**6) }}", "max_chars", {}),
    "str.replace": ("{{ ('x' * 1000).replace('x', 'y' * 1000000) }}", "max_chars", {}),
    "str.translate": ("{{ ('a' * 1000).translate({97: 'x' * 100000}) }}", "max_chars", {}),
    "int.to_bytes": ("{{ (5).to_bytes(10**9, 'big') }}", "max_chars", {}),
    "wordwrap wrapstring": ("{{ ('a ' * 1000)|wordwrap(1, wrapstring='x' * 100000) }}", "max_chars", {}),
    "wordwrap of a long word": ("{{ ('a' * 400000)|wordwrap(1) }}", "max_chars", {}),  # textwrap is quadratic
    "replace filter": ("{{ ('x' * 1000)|replace('x', 'y' * 1000000) }}", "max_chars", {}),
    "urlize target": ("{{ ('a.com ' * 1000)|urlize(target='x' * 100000) }}", "max_chars", {}),
    "batch fill": ("{{ [1]|batch(10**9, 'x')|list }}", "max_items", {}),
    "slice": ("{{ [1]|slice(10**9)|list }}", "max_items", {}),
    "sum of lists": ("{{ ([[0]] * 500000)|sum(start=[]) }}", "max_items", {}),  # quadratic copying
    "pprint of a deep list": ("{% set pad = [0] * 3000 %}{% set ns = namespace(x=[]) %}{% for i in range(300) %}"
                              "{% set ns.x = [ns.x, pad] %}{% endfor %}{{ ns.x|pprint }}", "max_chars", {}),
    "lipsum": ("{{ lipsum(10**7) }}", "max_chars", {}),
    "dict.fromkeys": ("{{ dict.fromkeys(range(100000), 'x' * 1000) }}", "max_chars", {}),
    "namespace written out": (S3M + "{% set ns = namespace() %}{% set ns.a = s %}{% set ns.b = s %}{{ ns }}",
                              "max_chars", {}),
    "~ doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                   "max_chars", {}),
    "+ doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                   "max_chars", {}),
    "list + doubling": ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
                        "{% endfor %}", "max_items", {}),
    "shared list doubling": ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                             "{% endfor %}{{ ns.l == ns.l }}", "max_items", {}),
    "shared tuple doubling": ("{% set ns = namespace(t=(1,)) %}{% for i in range(40) %}{% set ns.t = (ns.t, ns.t) %}"
                              "{% endfor %}{{ ns.t in {} }}", "max_items", {}),
    "macro varargs doubling": ("{% macro keep() %}{% set ns.v = varargs %}{% endmacro %}{% set ns = namespace(v=[1]) %}"
                               "{% for i in range(40) %}{{ keep(ns.v, ns.v) }}{% endfor %}", "max_items", {}),
    "*args of a lazy sequence": ("{% macro f() %}{% endmacro %}{{ f(*(range(1000000)|map('center', 4000))) }}",
                                 "max_chars", {}),
    "captured block": (S3M + "{% set t %}{% for i in range(1000000) %}{{ s ~ i }}{% endfor %}{% endset %}",
                       "max_chars", {}),
    "output": ("{% for i in range(1000) %}{{ 'x' * 10000 }}{% endfor %}", "max_chars", {}),
    "power": ("{{ 10 ** 100000 }}", "MAX_INT_BITS", {}),
    "squaring": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
                 "MAX_INT_BITS", {}),
    "deadline": (NESTED_LOOPS, "max_seconds", {"max_seconds": 0.3, "max_loop_iterations": 10**12}),
    "deadline in long calls": ("{% set x = range(300000)|list %}{% for i in range(100000) %}{{ (x|sort)|length }}"
                               "{% endfor %}", "max_seconds", {"max_seconds": 0.3}),
}
ATTACK_RUNNER = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))  # a gigabyte string fails to be made
from modeling.chat.template import ChatTemplate, RenderLimitError, RenderLimits
for name, source, limits in json.loads(sys.argv[1]):
    start = time.monotonic()
    try:
        template = ChatTemplate(source, origin="attack.jinja", limits=RenderLimits(**limits))
        template.render([{"role": "user", "content": "hi"}])
        said = "rendered"
    except RenderLimitError as e:
        said = str(e)
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    print(json.dumps([name, said, time.monotonic() - start]), flush=True)
"""


@pytest.fixture(scope="module")
def attack_results():
    """What rendering each of ATTACKS said and how long it took, in one separate process with a
    timeout and 512 MiB of data: a bound that no longer holds leaves its attack out, or says
    MemoryError (a check that runs only after the gigabyte string is made), not a hung run."""
    import subprocess

    from tests.test_loading_errors import isolated

    cases = [[name, source, limits] for name, (source, _, limits) in ATTACKS.items()]
    try:
        out = isolated("-c", ATTACK_RUNNER, json.dumps(cases), timeout=60).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    return {name: (said, seconds) for name, said, seconds in map(json.loads, out.splitlines())}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_template_fails_fast_naming_the_bound(attack_results, name):
    """Each hostile template stops within seconds with one line naming the template and the bound."""
    assert name in attack_results, f"{name!r} did not finish: it hung or ran out of memory"
    said, seconds = attack_results[name]
    bound = ATTACKS[name][1]
    assert said.startswith("chat template (attack.jinja): ") and bound in said and "\n" not in said, said
    assert seconds < 4, f"{name!r} took {seconds:.1f} s"


def test_limits_allow_exactly_their_value():
    small = RenderLimits(max_loop_iterations=10, max_chars=100, max_items=10)

    def render(source):
        return ChatTemplate(source, limits=small).render(USER)

    assert render("{% for i in range(10) %}.{% endfor %}") == "." * 10
    with pytest.raises(RenderLimitError, match=r"^chat template \(<string>\): the loops would run more than "
                                               r"RenderLimits.max_loop_iterations \(10\) iterations$"):
        render("{% for i in range(5) %}{% for j in range(2) %}.{% endfor %}{% endfor %}.{% for k in [1] %}{% endfor %}")
    assert render("{{ 'x' * 100 }}") == "x" * 100
    with pytest.raises(RenderLimitError, match=r"'\*' would make 101 characters, past RenderLimits.max_chars \(100\)$"):
        render("{{ 'x' * 101 }}")
    assert render("{% for i in range(10) %}{{ 'x' * 10 }}{% endfor %}") == "x" * 100
    with pytest.raises(RenderLimitError, match=r"rendered text would be longer than RenderLimits.max_chars \(100\)"):
        render("{% for i in range(10) %}{{ 'x' * 10 }}{% endfor %}!")
    assert render("{{ range(10)|list|length }}") == "10"
    with pytest.raises(RenderLimitError, match=r"range would hold more than RenderLimits.max_items \(10\) values$"):
        render("{{ range(11)|list|length }}")


def test_render_limits_are_positive_finite_numbers():
    assert RenderLimits() == RenderLimits(1_000_000, 4_000_000, 1_000_000, 5.0)
    for field in ("max_loop_iterations", "max_chars", "max_items", "max_seconds"):
        for bad in (0, -1, float("nan"), float("inf"), True, "5"):
            with pytest.raises(ValueError, match=f"^RenderLimits.{field} must be a positive finite number"):
                RenderLimits(**{field: bad})


def test_bounds_hold_in_any_thread_each_rendering_with_its_own_budget():
    """An HTTP server renders templates off the main thread: there the deadline holds too (no
    signals), and renderings at the same time keep their own budgets: the hostile one in the thread
    does not use up the loop iterations of the ones rendered meanwhile on the main thread."""
    hostile = ChatTemplate(NESTED_LOOPS, origin="hostile.jinja",
                           limits=RenderLimits(max_seconds=0.5, max_loop_iterations=10**12))
    busy = ChatTemplate("{% for i in range(20000) %}{% endfor %}ok", limits=RenderLimits(max_loop_iterations=20000))
    said = []

    def render_hostile():
        try:
            hostile.render(USER)
        except RenderLimitError as e:
            said.append(str(e))

    thread = threading.Thread(target=render_hostile, daemon=True)
    start = time.monotonic()
    thread.start()
    while thread.is_alive() and time.monotonic() - start < 30:
        assert busy.render(USER) == "ok"
    thread.join(timeout=1)
    assert not thread.is_alive(), "the rendering in the thread did not stop"
    assert said == ["chat template (hostile.jinja): the rendering ran longer than RenderLimits.max_seconds (0.5 s)"]
    assert time.monotonic() - start < 5


def python_calls(fn) -> int:
    """Python function calls made while ``fn`` runs (a count of operations, not a time: the same on a
    loaded machine), after one run to warm up caches."""
    fn()
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_bounds_cost_little_on_real_templates():
    """The checks at every call, loop iteration and operator, on the Qwen templates and a long
    conversation: within a small factor of the Python calls the same template makes in an unbounded
    sandbox (1.4x, 3.3x and 1.6x for the Qwen3, Qwen2.5 and Qwen3.5 templates: Qwen2.5's renders
    the tools in few operations, where rebuilding the inputs as JSON types weighs more). Counted,
    not timed: a time ratio on a loaded machine failed at 0.0097 s against 4 x 0.0021 s."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from modeling.chat.template import _alias_reasoning

    plain_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[jinja2.ext.loopcontrols])
    plain_env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    messages = [dict(m) for m in CONVERSATIONS["multi_turn"][1:]] * 20
    prepared = [_alias_reasoning(m) for m in messages]
    for name, source in QWEN_TEMPLATES.items():
        ours, plain = ChatTemplate(source), plain_env.from_string(source)
        expected = plain.render(messages=prepared, tools=TOOLS, add_generation_prompt=True)
        assert ours.render(messages, tools=TOOLS) == expected
        bounded = python_calls(lambda: ours.render(messages, tools=TOOLS))
        unbounded = python_calls(lambda: plain.render(messages=prepared, tools=TOOLS, add_generation_prompt=True))
        assert bounded < 4 * unbounded, (name, bounded, unbounded)


def test_command_line_exits_2_on_a_template_past_its_limits(tmp_path, capsys):
    """``python -m modeling.generate --chat``: the template renders before the weights load; one
    that passes a bound is a one-line error, exit status 2, no traceback."""
    from tests.test_generate_cli import build_chat_checkpoint, run_main

    path = build_chat_checkpoint(tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text(NESTED_LOOPS, encoding="utf-8")
    code, out, err = run_main(capsys, "--model", path, "--prompt", "hi", "--chat", "--device", "cpu")
    assert (code, out) == (2, "")
    *notes, error = err.splitlines()
    assert error == ("error: chat template (chat_template.jinja): the loops would run more than "
                     "RenderLimits.max_loop_iterations (1000000) iterations")
    assert all(line.startswith("note: ") for line in notes), err


def test_rendered_chat_tokenizes_with_special_tokens():
    """The rendered text goes through QwenTokenizer.encode, which matches the special tokens."""
    from modeling.model.random_checkpoint import build_tokenizer

    tok = build_tokenizer()
    text = ChatTemplate(QWEN3).render(CONVERSATIONS["system_user"], enable_thinking=False)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


# generation_config.json ----------------------------------------------------------------------


def write_generation_config(tmp_path, **fields) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], **fields}))
    return tmp_path


def test_generation_defaults(tmp_path):
    qwen3 = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, bos_token_id=0, pad_token_id=0)
    assert generation_defaults(write_generation_config(tmp_path, **qwen3)) == GenerationDefaults(0.6, 20, 0.95, None)
    # do_sample false or absent: greedy, whatever the other fields say (as transformers)
    for fields in (dict(qwen3, do_sample=False), dict(temperature=0.7, top_p=0.8), {}):
        d = generation_defaults(write_generation_config(tmp_path, **fields))
        assert d == GenerationDefaults(0.0, 0, 1.0, None)
    # sampling with fields left out (or null): GenerationConfig's defaults
    d = generation_defaults(write_generation_config(tmp_path, do_sample=True, top_p=None, max_new_tokens=512))
    assert d == GenerationDefaults(1.0, 50, 1.0, 512)
    assert generation_defaults(tmp_path / "generation_config.json") == d  # a file path works too
    (tmp_path / "generation_config.json").unlink()
    assert generation_defaults(tmp_path) == GenerationDefaults()  # no file: greedy


@pytest.mark.parametrize("fields, field", [
    (dict(do_sample=True, temperature=-1), "temperature"),
    (dict(do_sample=True, temperature="hot"), "temperature"),
    (dict(do_sample=True, top_k=-5), "top_k"),
    (dict(do_sample=True, top_k=2.5), "top_k"),
    (dict(do_sample=True, top_p=0), "top_p"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(do_sample="false", temperature=0.7), "do_sample"),  # not read as true: a string is no flag
    (dict(do_sample=1), "do_sample"),
])
def test_generation_defaults_bad_values(tmp_path, fields, field):
    with pytest.raises(ValueError, match=f"generation_config.json: {field} must "):
        generation_defaults(write_generation_config(tmp_path, **fields))


def test_tool_call_arguments_sent_as_a_json_string_render_as_the_object():
    """An assistant turn's ``tool_calls`` as OpenAI clients send them back, ``arguments`` a JSON
    string, reach the template as the object (vLLM's rule): Qwen3.5's XML template writes each
    parameter of it, as for an object, and the caller's messages are left as they were."""
    from modeling.chat.messages import template_messages

    def convo(arguments):
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    sent = convo('{"city": "Paris", "days": 3}')
    for name in ("qwen3_5", "qwen3"):
        template = ChatTemplate(QWEN_TEMPLATES[name])
        assert template.render(template_messages(sent)) == template.render(convo({"city": "Paris", "days": 3}))
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>" in \
        ChatTemplate(QWEN_TEMPLATES["qwen3_5"]).render(template_messages(sent))
    assert sent == convo('{"city": "Paris", "days": 3}')
    not_an_object = template_messages(convo("not json"))[1]["tool_calls"][0]["function"]["arguments"]
    assert not_an_object == "not json"  # left for the template as it is
