"""modeling.chat: the checkpoint's chat template rendered like transformers' apply_chat_template,
and generation_config.json defaults.

tests/data/qwen3_chat_template.jinja is a Qwen3-style template (tools, <think> handling,
enable_thinking); every conversation below is rendered by ChatTemplate and by transformers'
PreTrainedTokenizerFast.apply_chat_template(tokenize=False) from the same text: the strings must
be identical.
"""

import importlib.metadata
import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from modeling.chat import (CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, GenerationDefaults,
                           generation_defaults)

DATA = Path(__file__).parent / "data"
# transformers 5 drops None-valued message keys and aliases reasoning fields before rendering, as
# ChatTemplate does; transformers 4 passes messages through unchanged.
TRANSFORMERS_4 = int(importlib.metadata.version("transformers").split(".")[0]) < 5
QWEN3 = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
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
    with pytest.raises(ChatTemplateError, match="cannot read tokenizer_config.json"):
        ChatTemplate.from_pretrained(path)
    t = ChatTemplate.chatml()
    for bad in ([], "hello", [["user", "hi"]]):
        with pytest.raises(ChatTemplateError):
            t.render(bad)
    assert issubclass(ChatTemplateError, ValueError)


def test_rendered_chat_tokenizes_with_special_tokens():
    """The rendered text goes through QwenTokenizer.encode, which matches the special tokens."""
    from modeling.random_checkpoint import build_tokenizer

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
        assert d == GenerationDefaults(0.0, 0, 1.0, None) and d.greedy
    # sampling with fields left out (or null): GenerationConfig's defaults
    d = generation_defaults(write_generation_config(tmp_path, do_sample=True, top_p=None, max_new_tokens=512))
    assert d == GenerationDefaults(1.0, 50, 1.0, 512) and not d.greedy
    assert generation_defaults(tmp_path / "generation_config.json") == d  # a file path works too
    (tmp_path / "generation_config.json").unlink()
    assert generation_defaults(tmp_path) == GenerationDefaults()  # no file: greedy


def test_generation_defaults_merged_with_flags(tmp_path):
    d = GenerationDefaults(0.6, 20, 0.95, None)
    assert d.merged() == d
    assert d.merged(temperature=0.0) == GenerationDefaults(0.0, 20, 0.95, None)
    assert d.merged(top_k=0, top_p=1.0, max_new_tokens=64) == GenerationDefaults(0.6, 0, 1.0, 64)


@pytest.mark.parametrize("fields, field", [
    (dict(do_sample=True, temperature=-1), "temperature"),
    (dict(do_sample=True, temperature="hot"), "temperature"),
    (dict(do_sample=True, top_k=-5), "top_k"),
    (dict(do_sample=True, top_k=2.5), "top_k"),
    (dict(do_sample=True, top_p=0), "top_p"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_generation_defaults_bad_values(tmp_path, fields, field):
    with pytest.raises(ValueError, match=f"generation_config.json: {field} must be"):
        generation_defaults(write_generation_config(tmp_path, **fields))
