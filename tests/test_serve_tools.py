"""Tool calls through a real server and the openai client, in both forms: the shipped model with
a template of Qwen3's JSON calls and one of Qwen3.5's XML calls (its prompt opens a think block,
which the call ends). The model would not call a tool by itself: ``tool_choice`` (a named
function, or "required") forces the call through a grammar. Streamed ``tool_calls`` deltas,
joined by index, equal the non-streamed call."""
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_serve import MODEL, NAME, Server, assert_error, post

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]


TEMPLATE = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
            "{{ FORM }}<|im_end|>\n{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{{ OPEN }}{% endif %}")
FORMS = {"json": ("; call as <tool_call>{JSON}</tool_call>", ""),
         "xml": ("; call as <tool_call><function=NAME>...</function></tool_call>", "<think>\n")}
"""Short templates in each form (the real ones' tool preamble outgrows the shipped model's
context): the XML one names ``<function=`` (the server's default parser follows it) and opens a
think block in the prompt, as Qwen3.5's does."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"json": server, "xml": server}: the shipped model with each template."""
    started = {}
    for form, (note, opened) in FORMS.items():
        ckpt = tmp_path_factory.mktemp(form) / "model"
        shutil.copytree(MODEL, ckpt)
        (ckpt / "chat_template.jinja").write_text(TEMPLATE.replace("{{ FORM }}", note).replace("{{ OPEN }}", opened))
        started[form] = Server(ckpt.parent, form, "--model", str(ckpt), "--served-model-name", NAME,
                               "--max-num-seqs", "8")
    try:
        yield {form: s.wait_ready() for form, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def joined(chunks) -> tuple:
    """(tool calls joined from the streamed deltas by index, the last finish_reason, each chunk's
    deltas). A call's first delta holds its id, type and name, the later ones arguments only."""
    calls, finish, deltas = {}, None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or ():
            first = d.index not in calls
            assert (d.id is not None and d.type == "function" and d.function.name) if first else \
                (d.id is None and d.function.name is None), d
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        deltas.append(chunk.choices[0].delta.tool_calls or [])
    return [calls[i] for i in sorted(calls)], finish, deltas


@pytest.mark.parametrize("form", ["json", "xml"])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_calls_parse_and_stream_as_the_whole(servers, form, choice):
    client = servers[form].client()
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    args = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                temperature=1.0, seed=7)
    with ThreadPoolExecutor(2) as pool:  # the two requests share the engine's steps
        whole = pool.submit(client.chat.completions.create, **args)
        streamed, finish, deltas = joined(
            pool.submit(lambda: list(client.chat.completions.create(**args, stream=True))).result())
    reply = whole.result().choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content, reply
    (call,) = reply.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if choice == "named":
        assert call.function.name == "get_time"
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    else:
        assert set(arguments) == {"zone"} and isinstance(arguments["zone"], str)
    assert streamed == [{"name": call.function.name, "arguments": call.function.arguments}]
    assert finish == "tool_calls"
    assert all(len({d.index for d in chunk}) == len(chunk) for chunk in deltas)  # one delta a call a chunk


def test_the_form_follows_the_template_and_tool_choice_errors(servers):
    body = {"messages": MESSAGES, "tools": TOOLS}
    assert_error(post(servers["json"], "/v1/chat/completions", {**body, "tool_choice": {"type": "function",
                                                                 "function": {"name": "nope"}}}),
                 400, "tool_choice", "'nope', which is not among 'tools'")
    assert_error(post(servers["json"], "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}),
                 400, "tool_choice", "no 'tools' are given")
    assert_error(post(servers["json"], "/v1/chat/completions", {**body, "tool_choice": "sometimes"}),
                 400, "tool_choice", "must be")
    assert_error(post(servers["json"], "/v1/chat/completions", {**body, "tool_choice": "required",
                                                                "guided_regex": "a"}),
                 400, "tool_choice", "no 'guided_regex' with it")
    assert_error(post(servers["json"], "/v1/chat/completions", {**body, "tool_choice": {"type": "function",
                                                                 "function": "get_time"}}),
                 400, "tool_choice", "must be")
    unconvertible = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    assert_error(post(servers["json"], "/v1/chat/completions", {"messages": MESSAGES, "tools": unconvertible,
                                                                "tool_choice": "required"}),
                 400, "tools", 'xgrammar cannot take the functions\' parameters: Unsupported type "strin"')
    client = servers["xml"].client()
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize("parameters, part", [
    ("abc", "parameters"),
    ({"type": "object", "properties": {"city": "string"}, "required": ["city"]}, "parameters.properties"),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "required": 5}, "parameters.required"),
])
def test_malformed_tool_parameters_are_a_400(servers, parameters, part):
    """The parts of a tool's schema the server reads itself (the XML form's forced call reads
    ``properties`` and ``required``) are checked, whatever ``tool_choice`` is."""
    bad = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    for choice in ("required", "auto"):
        assert_error(post(servers["xml"], "/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOLS[0], bad],
                                                               "tool_choice": choice}),
                     400, "tools", rf"'tools\[1\]\.function\.{part}' must be")
