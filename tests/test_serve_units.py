"""modeling.serve in process: the reply parsers (Qwen3 <think>, Qwen <tool_call>), a chat choice built
from tokens, per-choice seeds, request parsing, the command line's checks, an engine whose steps
fail (the app stays up, then reports itself unusable), and the streamed fields of a few requests
through TestClient (the ``app`` fixture: the shipped model in float64 on the PyTorch reference ops,
seconds a test)."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from modeling.engine.sampling_params import SamplingParams, choice_seed  # noqa: E402
from modeling.serve.chat_output import ReasoningSplitter, ToolCallParser  # noqa: E402
from modeling.serve.engine_loop import TokenEvent  # noqa: E402
from modeling.serve.errors import APIError  # noqa: E402
from modeling.serve.generation import Generation  # noqa: E402
from modeling.serve.protocol import CompletionRequest, Plan, Prompt, parse  # noqa: E402
from modeling.api.outputs import TokenStrings  # noqa: E402


def split_whole_and_streamed(make, text):
    whole = make()
    a = [x + y for x, y in zip(whole.push(text), whole.finish())]
    streamed = make()
    parts = [streamed.push(ch) for ch in text] + [streamed.finish()]
    return a, ["".join(p[i] for p in parts) for i in range(2)]


@pytest.mark.parametrize("opened, text, reasoning, content", [
    (False, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    (True, "I should add.\n</think>\n\nFour.", "I should add.", "Four."),
    (False, "  Plain reply <think> inside", "", "Plain reply <think> inside"),
    (False, "<think>\ncut off by max_tokens", "cut off by max_tokens", ""),
    (False, "<thin", "", "<thin"),
    (False, "<think>\n\n</think>\n\nNo thoughts.", "", "No thoughts."),
])
def test_reasoning_splitter_whole_equals_streamed(opened, text, reasoning, content):
    whole, streamed = split_whole_and_streamed(lambda: ReasoningSplitter(opened), text)
    assert whole == streamed == [reasoning, content]


def parse_calls(parser, pieces):
    """Feed ``pieces`` to a ToolCallParser: (content, the deltas, the calls the deltas join to)."""
    content, deltas = "", []
    for piece in pieces:
        c, more = parser.push(piece)
        content, deltas = content + c, deltas + more
    tail, more = parser.finish()
    calls = []
    for d in deltas + more:
        if "name" in d:
            assert d["index"] == len(calls)
            calls.append({"name": d["name"], "arguments": ""})
        calls[d["index"]]["arguments"] += d["arguments"]
    assert calls == parser.calls
    return content + tail, deltas + more, calls


def test_tool_call_parser_whole_equals_streamed():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": "{}"}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>'
            '<tool_call>{"name": "unclosed"')
    for pieces in ([text], list(text)):
        content, deltas, calls = parse_calls(ToolCallParser(), pieces)
        assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "time", "arguments": "{}"}]
        assert len(deltas) == 2  # a JSON call goes out whole, when its block closes
        assert content == 'Checking.\n\n\n<tool_call>\nnot json\n</tool_call><tool_call>{"name": "unclosed"'


def test_xml_tool_calls_stream_as_openai_sends_them_with_values_by_type():
    """The name first (arguments ""), then each parameter as it closes, then "}": joined, the
    arguments are json.dumps of the parameters, whole or streamed a character at a time."""
    text = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n95112\n</parameter>\n<parameter=opts>\n"
            '{"metric": true}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n{"name": "json form"}\n</tool_call>'
            "<tool_call><function=now>\n</function></tool_call>")
    types = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}
    for pieces in ([text], list(text)):
        content, deltas, calls = parse_calls(ToolCallParser("xml", types), pieces)
        assert calls == [{"name": "get_weather",
                          "arguments": '{"city": "San Jose", "days": 3, "zip": "95112", "opts": {"metric": true}}'},
                         {"name": "now", "arguments": "{}"}]
        assert [d["arguments"] for d in deltas] == ["", '{"city": "San Jose"', ', "days": 3', ', "zip": "95112"',
                                                    ', "opts": {"metric": true}', "}", "", "{}"]
        assert content == 'Sure.\n\n<tool_call>\n{"name": "json form"}\n</tool_call>'


def test_an_xml_call_cut_short_is_closed():
    """A call whose header went out ends with its arguments closed: at </tool_call> without
    </function>, or at the end of the text (max_tokens)."""
    for text, args in (("<tool_call><function=f><parameter=a>1</parameter></tool_call>", '{"a": 1}'),
                       ("<tool_call><function=f><parameter=a>1</parameter><parameter=b>", '{"a": 1}'),
                       ("<tool_call><function=f>", "{}")):
        content, _, calls = parse_calls(ToolCallParser("xml"), list(text))
        assert calls == [{"name": "f", "arguments": args}] and content == "", text


@pytest.mark.parametrize("form, call", [("json", '{"name": "f", "arguments": {}}'), ("xml", "<function=f>\n</function>")])
def test_a_tool_call_tag_mentioned_in_the_content_leaves_the_next_call_whole(form, call):
    """A <tool_call> that no call follows (``{`` or ``<function=`` after whitespace, by the form) is
    content text: the block the reply opens next is its call, whole or streamed a character at a time."""
    text = f"Use a <tool_call> tag:\n<tool_call>\n{call}\n</tool_call>"
    for pieces in ([text], list(text)):
        content, _, calls = parse_calls(ToolCallParser(form), pieces)
        assert calls == [{"name": "f", "arguments": "{}"}] and content == "Use a <tool_call> tag:\n", len(pieces)


def test_an_xml_parameter_without_its_closing_tag_ends_at_the_next_tag():
    """A parameter whose </parameter> never comes ends where the next <parameter=, </function> or
    </tool_call> starts (vLLM's qwen3_coder rule), whole or streamed a character at a time; one still
    open at the end of the text is dropped."""
    types = {"f": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    for text, args in (("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\ny\n</parameter>\n</function>\n"
                        "</tool_call>", '{"a": 1, "b": "x\\ny"}'),
                       ("<tool_call>\n<function=f>\n<parameter=b>\nx\n</function>\n</tool_call>", '{"b": "x"}'),
                       ("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</tool_call>",
                        '{"a": 1, "b": "x"}'),
                       ("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx", '{"a": 1}')):
        for pieces in ([text], list(text)):
            content, _, calls = parse_calls(ToolCallParser("xml", types), pieces)
            assert calls == [{"name": "f", "arguments": args}] and content == "", (text, len(pieces))


@pytest.mark.parametrize("opened", [True, False])
def test_a_tool_call_ends_the_reasoning(opened):
    text = ("" if opened else "<think>\n") + "I will call it.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    whole, streamed = split_whole_and_streamed(lambda: ReasoningSplitter(opened, tool_calls=True), text)
    assert whole == streamed == ["I will call it.", "<tool_call>\n<function=f>\n</function>\n</tool_call>"]
    without, _ = split_whole_and_streamed(lambda: ReasoningSplitter(opened), text)
    assert without[1] == ""  # without tools, the tag is reasoning text like any other


@pytest.mark.parametrize("call", ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
                                  "<tool_call>\n<function=f>\n</function>\n</tool_call>"], ids=["json", "xml"])
def test_a_tool_call_tag_mentioned_in_the_reasoning_does_not_end_it(call):
    """Only a <tool_call> that a call follows (``{`` or ``<function=``, after whitespace) ends the
    think block, as vLLM's qwen3 parser decides: one the reasoning merely mentions stays reasoning,
    and the call after </think> is the reply's, whole or streamed a character at a time."""
    from modeling.serve.chat_output import ChatOutput

    text = "<think>\nI answer with a <tool_call> block, or <tool_call>\nnot yet.\n</think>\n\n" + call
    form = "xml" if "<function=" in call else "json"
    whole = ChatOutput(True, True, "<|im_start|>assistant\n", form).push(text, final=True)
    streamed = ChatOutput(True, True, "<|im_start|>assistant\n", form)
    pieces = [streamed.push(ch) for ch in text] + [streamed.push("", final=True)]
    for reasoning, content, deltas in (whole, ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces),
                                               [d for p in pieces for d in p[2]])):
        assert reasoning == "I answer with a <tool_call> block, or <tool_call>\nnot yet."
        assert content == "" and [d.get("name") for d in deltas if "name" in d] == ["f"]
    assert streamed.tools.calls == [{"name": "f", "arguments": "{}"}]


@pytest.fixture(scope="module")
def llm():
    from modeling.api.llm import LLM

    return LLM(None, device="cpu", progress=False)


def chat_plan(prompt_text: str, logprobs=None, parallel_tool_calls: bool = True) -> Plan:
    params = SamplingParams(stop_token_ids=(), logprobs=logprobs)
    return Plan([Prompt(prompt_text, [1])], 1, [params], [200], [2], stream=False, include_usage=False,
                return_token_ids=True, logprobs=logprobs, tool_calls=True, parallel_tool_calls=parallel_tool_calls,
                reasoning=True, prompt_text=prompt_text)


def test_chat_choice_from_tokens_has_reasoning_and_tool_calls(llm):
    reply = ('<think>\nThe user wants weather.\n</think>\n\n'
             '<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>')
    tokens = llm.tokenizer.encode(reply) + [2]  # then EOS
    gen = Generation(chat_plan("<|im_start|>assistant\n"), True, None, TokenStrings(llm.tokenizer), 0.0)
    c = gen.choices[0]
    for i, t in enumerate(tokens):
        c.consume([TokenEvent(0, t, None, "stop" if i == len(tokens) - 1 else None, 0.0)])
    out = gen.chat_choice(c)
    assert out["finish_reason"] == "tool_calls" and out["token_ids"] == tokens
    msg = out["message"]
    assert msg["reasoning_content"] == "The user wants weather." and msg["content"] is None
    assert [(t["type"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] \
        == [("function", "w", {"c": 1})]
    assert c.consume([TokenEvent(0, 5, None, None, 0.0)]) is None  # nothing after the end


def test_stop_string_ends_a_choice_and_later_tokens_are_dropped(llm):
    params = SamplingParams(stop=("light",))
    plan = Plan([Prompt("x", [1])], 1, [params], [50], [2], False, False, True, None)
    gen = Generation(plan, False, None, TokenStrings(llm.tokenizer), 0.0)
    c = gen.choices[0]
    tokens = llm.tokenizer.encode("What light through yonder")
    pieces = [c.consume([TokenEvent(0, t, None, None, 0.0)]) for t in tokens]
    assert c.finish_reason == "stop" and c.stop_reason == "light" and gen.completion_choice(c)["text"] == "What "
    assert pieces[-1] is None  # sampled after the match, before the abort landed: dropped
    assert gen.completion_tokens == len(c.token_ids) < len(tokens)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_streamed_choice_names_its_stop_reason_as_the_whole_one_does(llm, chat):
    """vLLM's stream choices carry ``stop_reason`` on both endpoints: null until the choice
    finishes, then the stop string (or stop token id) that ended it, as in the whole response."""
    params = SamplingParams(stop=("light",))
    plan = Plan([Prompt("x", [1])], 1, [params], [50], [2], True, False, False, None)
    gen = Generation(plan, chat, None, TokenStrings(llm.tokenizer), 0.0)
    c = gen.choices[0]
    deltas = [gen.delta(c, p) for t in llm.tokenizer.encode("What light through yonder")
              if (p := c.consume([TokenEvent(0, t, None, None, 0.0)])) is not None]
    deltas = [d for d in deltas if d is not None]
    whole = gen.chat_choice(c) if chat else gen.completion_choice(c)
    assert whole["stop_reason"] == "light" and deltas[-1]["finish_reason"] == "stop"
    assert [d["stop_reason"] for d in deltas] == [None] * (len(deltas) - 1) + ["light"]


@pytest.fixture(scope="module")
def app():
    """The app on an engine of this process, through TestClient: the shipped model in float64 (the
    PyTorch reference ops, not the Triton interpreter: seconds a test), eager."""
    import torch
    from fastapi.testclient import TestClient

    from modeling.api.llm import LLM
    from modeling.engine import Engine
    from modeling.serve.app import ServerState, Settings, create_app
    from modeling.serve.engine_loop import EngineClient, ThreadTransport

    llm = LLM(None, device="cpu", dtype=torch.float64, progress=False)
    engine = Engine(llm.model, max_num_seqs=8, max_model_len=128, enforce_eager=True)
    state = ServerState(llm.checkpoint, EngineClient(ThreadTransport(engine), engine.max_model_len, lambda e: None),
                        Settings("m"))
    with TestClient(create_app(state)) as client:
        yield client


def sse_chunks(client, path: str, body: dict) -> list:
    """The JSON chunks of a stream (``[DONE]`` checked and left out)."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("echo", [False, True])
def test_return_token_ids_gives_the_prompt_ids_where_vllm_does(app, llm, echo):
    """vLLM's places: a completion choice holds its prompt's ids, streamed in its first chunk (the
    echo's, when it echoes); a chat response holds them beside ``choices``, streamed in the first
    chunks (the role's), never per choice."""
    ids = llm.tokenizer.encode("ROMEO:")
    body = {"prompt": "ROMEO:", "max_tokens": 3, "n": 2, "seed": 0, "temperature": 1.0, "return_token_ids": True,
            "echo": echo}
    whole = app.post("/v1/completions", json=body).json()
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [ids, ids]
    chunks = sse_chunks(app, "/v1/completions", body)
    for index in (0, 1):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c.get("token_ids", [])] == whole["choices"][index]["token_ids"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "return_token_ids": True}
    reply = app.post("/v1/chat/completions", json=chat).json()
    prompt = reply["prompt_token_ids"]
    assert prompt[-3:] == llm.tokenizer.encode("<|im_start|>assistant\n")[-3:]
    assert all("prompt_token_ids" not in c and len(c["token_ids"]) == 3 for c in reply["choices"])
    chunks = sse_chunks(app, "/v1/chat/completions", chat)
    assert [c.get("prompt_token_ids") for c in chunks[:2]] == [prompt, prompt]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
    assert all("prompt_token_ids" not in c for c in chunks[2:])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_each_choices_running_usage_in_its_chunks(app, path):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk of a
    choice carries the usage so far, its prompt's tokens and its own tokens; the last chunk the
    request's whole usage. Without it the choices' chunks carry ``usage: null``, as OpenAI's."""
    body = {"max_tokens": 4, "n": 2, "seed": 1, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "ROMEO:"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]})
    chunks = sse_chunks(app, path, body)
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 8
    prompt = final["prompt_tokens"]
    counts = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        counts[choice["index"]] += len(choice.get("token_ids", []))
        n = counts[choice["index"]]
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    assert counts == {0: 4, 1: 4}
    body["stream_options"] = {"include_usage": True}
    assert all(c["usage"] is None for c in sse_chunks(app, path, body)[:-1])


@pytest.mark.parametrize("part, unsupported, message", [
    ({"type": "text"}, False, "'messages[0].content[0].text' must be a string, got NoneType"),
    ({"type": "text", "text": 5}, False, "'messages[0].content[0].text' must be a string, got int"),
    ({"type": "image_url", "image_url": {}}, True, "only text parts"),
    ("hi", True, "only text parts"),
])
def test_a_malformed_text_part_is_invalid_not_unsupported(part, unsupported, message):
    """A text part without a string ``text`` is a malformed message (a 400 naming it), not a kind of
    part the server does not take (``unsupported_parameter``, "only text parts ..., got 'text'")."""
    from modeling.serve.protocol import chat_messages

    with pytest.raises(APIError) as e:
        chat_messages([{"role": "user", "content": [part]}])
    assert e.value.status == 400 and message in e.value.message
    assert (e.value.code, e.value.param) == (("unsupported_parameter", "messages[0].content[0]") if unsupported
                                             else (None, "messages"))


class RecordingLoop:
    """An engine client that takes submits and records aborts."""

    def __init__(self):
        self.aborted = []

    def submit(self, sink, index, *args):
        return 100 + index

    def abort(self, rid):
        self.aborted.append(rid)


def test_a_matched_stop_string_aborts_the_choice_in_the_engine(llm):
    """The step whose text completes a stop string aborts that choice's sequence in the engine at
    once (the engine would otherwise decode up to max_tokens for text nobody gets); the other
    choice runs on."""
    import asyncio

    tokens = llm.tokenizer.encode("What light through yonder window breaks")
    plan = Plan([Prompt("x", [1])], 2, [SamplingParams(stop=("light",)), SamplingParams()], [50], [2], False, False,
                True, None)
    loop = RecordingLoop()

    async def run():
        gen = Generation(plan, False, loop, TokenStrings(llm.tokenizer), 0.0)
        gen.submit()
        aborted = []
        for t in tokens[:3]:
            gen.sink.put([TokenEvent(0, t, None, None, 0.0), TokenEvent(1, t, None, None, 0.0)])
            await gen.next()
            aborted.append(list(loop.aborted))
        return gen, aborted

    gen, aborted = asyncio.run(run())
    assert gen.choices[0].finish_reason == "stop" and gen.choices[1].finish_reason is None
    assert aborted == [[], [100], [100]]  # in the step that matched, once


def test_without_max_tokens_a_prompt_near_the_context_gets_the_room_left(llm):
    """No max_tokens: the default (16 for completions) cut to the room the context leaves, not a 400
    for a prompt a few tokens short of it; chat takes all the room left."""
    from modeling.serve.protocol import ChatCompletionRequest, plan_chat, plan_completion

    near = parse(CompletionRequest, json.dumps({"prompt": [5] * 509}).encode())
    assert plan_completion(near, llm.checkpoint, 512).max_tokens == [3]
    far = parse(CompletionRequest, json.dumps({"prompt": [5] * 9}).encode())
    assert plan_completion(far, llm.checkpoint, 512).max_tokens == [16]
    chat = parse(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode())
    plan = plan_chat(chat, llm.checkpoint, 512)
    assert plan.max_tokens == [512 - len(plan.prompts[0].ids)]


@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000, "1.0", " 1", "-1", "2048"])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(llm, key):
    """A key that is no decimal token id of the vocabulary is a 400 naming logit_bias, never a 500:
    "\u00b2" passes str.isdigit but not int(), and int() refuses a string of more than 4300 digits."""
    from modeling.serve.protocol import plan_completion

    req = parse(CompletionRequest, json.dumps({"prompt": "x", "logit_bias": {key: 1}}).encode())
    with pytest.raises(APIError) as e:
        plan_completion(req, llm.checkpoint, 512)
    assert e.value.status == 400 and e.value.param == "logit_bias" and "token ids in [0, 2048)" in e.value.message
    ok = parse(CompletionRequest, json.dumps({"prompt": "x", "logit_bias": {"0047": 5, "2047": -1}}).encode())
    assert plan_completion(ok, llm.checkpoint, 512).params[0].logit_bias == ((47, 5.0), (2047, -1.0))


def test_top_k_minus_one_is_off_by_sampling_params_rule(llm):
    """vLLM's top_k -1 reaches SamplingParams, which reads it as off (0); below -1 is a 400 naming top_k."""
    from modeling.serve.protocol import plan_completion

    plan = plan_completion(parse(CompletionRequest, b'{"prompt": [5], "top_k": -1}'), llm.checkpoint, 512)
    assert plan.params[0].top_k == 0
    with pytest.raises(APIError) as e:
        plan_completion(parse(CompletionRequest, b'{"prompt": [5], "top_k": -2}'), llm.checkpoint, 512)
    assert e.value.status == 400 and e.value.param == "top_k"


def test_steps_queued_for_a_request_are_merged_into_one_piece(llm):
    """A handler that fell behind the engine takes every queued step at once: one piece per choice
    with all their tokens (and the same text as one step at a time), then waits for the next."""
    import asyncio

    tokens = llm.tokenizer.encode("What light through yonder window breaks")
    plan = Plan([Prompt("x", [1])], 1, [SamplingParams()], [50], [2], False, False, True, None)

    async def run():
        gen = Generation(plan, False, None, TokenStrings(llm.tokenizer), 0.0)
        for t in tokens[:-1]:
            gen.sink.put([TokenEvent(0, t, None, None, 0.0)])
        merged = await gen.next()
        gen.sink.put([TokenEvent(0, tokens[-1], None, "length", 0.0)])
        last = await gen.next()
        return gen, merged, last

    gen, merged, last = asyncio.run(run())
    assert [(c.index, p.token_ids) for c, p in merged] == [(0, tokens[:-1])]
    assert [p.finish_reason for _, p in last] == ["length"] and gen.done
    assert merged[0][1].text + last[0][1].text == llm.tokenizer.decode(tokens) == gen.choices[0].text


def test_choice_seeds():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(8)]
    assert seeds == [choice_seed(7, i) for i in range(8)] and len(set(seeds)) == 8
    assert all(0 <= s < 2**63 for s in seeds) and choice_seed(8, 1) != seeds[1]


@pytest.mark.parametrize("body, param, message", [
    (b'{"prompt": "x", "stream_options": {"include_usage": 1}}', "stream_options",
     "'stream_options.include_usage' input should be a valid boolean"),
    (b'{"prompt": "x", "seed": 1.5}', "seed", "'seed' input should be a valid integer"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "'stream' input should be a valid boolean"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "'temperature' input should be a finite number"),
    (b'{"prompt": "x",}', None, "the request body is not valid JSON"),
])
def test_parse_names_the_field(body, param, message):
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(message)


def test_unknown_fields_are_logged_and_ignored_or_refused_when_strict(caplog):
    """vLLM's way by default (a warning naming each unknown field, nested ones dotted); with
    ``strict`` (``--strict-requests``) OpenAI's 400 naming the first."""
    body = b'{"prompt": "x", "max_token": 5, "stream_options": {"x": 1}}'
    with caplog.at_level("WARNING", logger="modeling.serve"):
        req = parse(CompletionRequest, body)
    assert req.max_tokens is None and req.prompt == "x"
    assert "present in the request but ignored: max_token, stream_options.x" in caplog.text
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, body, strict=True)
    assert (e.value.status, e.value.param) == (400, "max_token")
    assert e.value.message == "Unrecognized request argument supplied: max_token"
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, b'{"prompt": "x", "stream_options": {"x": 1}}', strict=True)
    assert e.value.param == "stream_options" and e.value.message.endswith("stream_options.x")
    caplog.clear()
    with caplog.at_level("WARNING", logger="modeling.serve"):
        parse(CompletionRequest, b'{"prompt": "x", "user": "u1"}', strict=True)
    assert not caplog.text  # a known field: no warning


@pytest.mark.parametrize("argv, problem", [
    (["--port", "70000"], "--port"), (["--max-waiting", "0"], "--max-waiting"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"), (["--memory-fraction", "0"], "--gpu-memory-utilization"), (["--device", "tpu"], "--device"),
    (["--model", "/no/such/dir"], "--model"), (["--max-model-len", "513"], "max_position_embeddings (512)"),
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "inf"], "--body-timeout"),
    (["--body-timeout", "nan"], "--body-timeout"), (["--max-connections", "0"], "--max-connections"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
])
def test_cli_refuses_bad_flags(argv, problem, capsys):
    from modeling.serve.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: ") and problem in err[-1] and len(err) <= 2  # a note, then the error


@pytest.mark.parametrize("argv, problem", [
    (["--drain-timeout", "nan"], "--drain-timeout must be a finite number of seconds >= 0, got nan"),
    (["--drain-timeout", "inf"], "--drain-timeout must be a finite number of seconds >= 0, got inf"),
    (["--device", "cpu:1"], "--device cpu:1: the CPU has no index (use --device cpu)"),
])
def test_flags_are_checked_before_the_model_loads(argv, problem):
    """Values every later check would let through (a NaN drain timeout cuts every running request
    at once; an infinite one fails the exit), and a device the engine's process would refuse only
    once started, are refused by the flags' check, as the other command line does."""
    from modeling.api.commands import UsageError
    from modeling.serve.__main__ import check_args, parse_args

    with pytest.raises(UsageError) as e:
        check_args(parse_args(argv))
    assert str(e.value) == problem


def test_engine_failures_fail_the_requests_then_the_server(llm, monkeypatch):
    from fastapi.testclient import TestClient

    from modeling.engine import Engine
    from modeling.serve.app import ServerState, Settings, create_app
    from modeling.serve.engine_loop import MAX_CONSECUTIVE_FAILURES
    from modeling.serve.engine_loop import EngineClient, ThreadTransport

    engine = Engine(llm.model, max_num_seqs=4, max_model_len=128, enforce_eager=True)

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", broken)  # after scheduling: the blocks are taken
    dead = []
    state = ServerState(llm.checkpoint, EngineClient(ThreadTransport(engine), engine.max_model_len, dead.append), Settings("m"))
    body = {"prompt": "ROMEO:", "max_tokens": 4}
    def errors_500():
        return state.metrics.registry.get_sample_value("qwen_serve_request_errors_total", {"status": "500"})

    with TestClient(create_app(state)) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "device lost" in r.json()["error"]["message"] and engine.blocks.num_free == engine.blocks.num_blocks
        assert errors_500() == 1  # one failed request, counted once
        assert client.get("/health").status_code == 200  # one failed step: still serving
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert s.status_code == 200 and '"engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert errors_500() == 2
        for _ in range(MAX_CONSECUTIVE_FAILURES - 2):
            assert client.post("/v1/completions", json=body).status_code == 500
        assert errors_500() == MAX_CONSECUTIVE_FAILURES
        deadline = 100
        while not dead and deadline:
            deadline -= 1
            __import__("time").sleep(0.01)
        assert [str(e) for e in dead] == ["RuntimeError: device lost"]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
        assert client.get("/metrics").status_code == 200


@pytest.fixture(scope="module")
def qwen3_llm(tmp_path_factory):
    """The shipped model behind Qwen3's own chat template (thinking, tools)."""
    from pathlib import Path

    from modeling.api.llm import LLM

    root = Path(__file__).resolve().parents[1]
    path = tmp_path_factory.mktemp("qwen3_template")
    for f in (root / "modeling" / "default_model").iterdir():
        (path / f.name).symlink_to(f)
    (path / "chat_template.jinja").symlink_to(root / "tests" / "data" / "qwen3_chat_template.jinja")
    return LLM(path, device="cpu", progress=False)


def test_chat_plan_with_qwen3_template_renders_tools_and_thinking(qwen3_llm):
    from modeling.serve.protocol import ChatCompletionRequest, plan_chat

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function",
            "function": {"name": "get_weather", "description": "Weather of a city", "parameters": schema}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool], "max_tokens": 8}
    plan = plan_chat(parse(ChatCompletionRequest, json.dumps(body).encode()), qwen3_llm.checkpoint, 512)
    assert plan.tool_calls and plan.reasoning
    assert "get_weather" in plan.prompt_text and plan.prompt_text.endswith("<|im_start|>assistant\n")
    off = plan_chat(parse(ChatCompletionRequest, json.dumps(
        {**body, "chat_template_kwargs": {"enable_thinking": False}, "tool_choice": "none"}).encode()), qwen3_llm.checkpoint, 512)
    assert not off.reasoning and not off.tool_calls and "get_weather" not in off.prompt_text
    assert off.prompt_text.endswith("<think>\n\n</think>\n\n")
    assert plan.prompts[0].ids == qwen3_llm.tokenizer.encode(plan.prompt_text)


def test_a_forced_call_without_xgrammar_is_a_400_naming_the_package(qwen3_llm, monkeypatch):
    import sys

    from modeling.serve.protocol import ChatCompletionRequest, plan_chat

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
    with pytest.raises(APIError) as e:
        plan_chat(parse(ChatCompletionRequest, json.dumps(body).encode()), qwen3_llm.checkpoint, 512)
    assert (e.value.status, e.value.param) == (400, "tool_choice") and "pip install xgrammar" in e.value.message


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "first-call-only"])
def test_streamed_chat_deltas_add_up_to_the_whole_message(llm, parallel):
    """Token by token through Generation.delta: the reasoning and content deltas concatenate to the
    whole message's, and each tool call arrives once, whole, with its index; with
    parallel_tool_calls false, the first call only, streamed or not."""
    reply = ('<think>\nTwo calls.\n</think>\n\nCalling.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>')
    tokens = llm.tokenizer.encode(reply) + [2]
    gen = Generation(chat_plan("<|im_start|>assistant\n", None, parallel), True, None, TokenStrings(llm.tokenizer), 0.0)
    c = gen.choices[0]
    reasoning = content = ""
    calls, finishes = [], []
    for i, t in enumerate(tokens):
        piece = c.consume([TokenEvent(0, t, None, "stop" if i == len(tokens) - 1 else None, 0.0)])
        d = gen.delta(c, piece)
        if d is None:
            continue
        assert d["token_ids"] == [t]
        reasoning += d["delta"].get("reasoning_content", "")
        content += d["delta"].get("content", "")
        calls += d["delta"].get("tool_calls", [])
        finishes.append(d["finish_reason"])
    whole = gen.chat_choice(c)["message"]
    assert reasoning == whole["reasoning_content"] == "Two calls."
    assert content.strip() == "Calling." == whole["content"]
    expected = [(0, "a", "{}"), (1, "b", '{"x": [1, 2]}')][:2 if parallel else 1]
    assert [(k["index"], k["function"]["name"], k["function"]["arguments"]) for k in calls] == expected
    assert [k["function"]["name"] for k in whole["tool_calls"]] == [name for _, name, _ in expected]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1


def test_bench_serve_says_it_needs_a_gpu(monkeypatch, capsys):
    import sys

    import torch

    import bench.serve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench/serve.py"])
    with pytest.raises(SystemExit) as e:
        bench.serve.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: python -m bench.serve needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------
# the engine loop and its transports, with fake engines (no model runs)


class FakeEngine:
    """What EngineCore uses of an Engine: a sequence holds one KV block from its first step on and
    gets token 7 each step until ``max_tokens``; steps from number ``fail_from`` on raise."""

    def __init__(self, num_blocks: int = 8, fail_from: int = 0):
        from types import SimpleNamespace

        self.blocks = SimpleNamespace(num_blocks=num_blocks, num_free=num_blocks)
        self.seqs, self.steps, self.fail_from = [], 0, fail_from

    def add(self, prompt_ids, params, max_tokens, stop_ids=()):
        from types import SimpleNamespace

        from modeling.engine import Status

        seq = SimpleNamespace(request_id=1000 + len(self.seqs), status=Status.WAITING, tokens=list(prompt_ids),
                              logprobs=None, prompt_logprobs=None, finish_reason=None, max_tokens=max_tokens,
                              num_output=0, error=None)
        self.seqs.append(seq)
        return seq

    def _finish(self, seq, reason=None):
        from modeling.engine import Status

        if seq.status is Status.RUNNING:
            self.blocks.num_free += 1
        seq.status, seq.finish_reason = Status.FINISHED, reason or seq.finish_reason
        self.seqs.remove(seq)

    def abort(self, seq):
        if seq in self.seqs:
            self._finish(seq, "abort")

    def has_work(self):
        return bool(self.seqs)

    def step(self):
        from modeling.engine import Status

        self.steps += 1
        if self.fail_from and self.steps >= self.fail_from:
            raise RuntimeError("device lost")
        out = list(self.seqs)
        for seq in out:
            if seq.status is Status.WAITING:
                seq.status = Status.RUNNING
                self.blocks.num_free -= 1
            seq.tokens.append(7)
            seq.num_output += 1
            if seq.num_output >= seq.max_tokens:
                self._finish(seq, "length")
        return out


class ListTransport:
    """Keeps what the client puts; ``run_core`` then runs an EngineCore on it, in this thread,
    until it would wait for a message (its reports go straight to the client)."""

    def __init__(self):
        self.inbox = []

    def put(self, msg):
        self.inbox.append(msg)


def run_core(engine, client):
    from modeling.serve.engine_loop import EngineCore

    EngineCore(engine, client.on_message).run(
        lambda block: client.transport.inbox.pop(0) if client.transport.inbox else (("stop",) if block else None))


def drain_sink(sink):
    items, sink.items = sink.items, []
    return items


def test_engine_loop_add_abort_order_and_idle_state():
    """An abort that reaches the engine right after its add (before any step) stops it without a
    token; tokens go only to the sequences still running; once idle, counts and KV usage are 0
    (what /metrics shows and tests/test_serve.py's wait_idle waits for)."""
    from modeling.serve.engine_loop import EngineClient, Sink

    engine, client = FakeEngine(), EngineClient(ListTransport(), 100)
    a, b = Sink(), Sink()
    ra = client.submit(a, 0, [1, 2], SamplingParams(), 3, ())
    client.submit(b, 0, [1, 2], SamplingParams(), 2, ())
    assert client.counts() == {"running": 0, "waiting": 2}
    client.abort(ra)
    run_core(engine, client)
    assert drain_sink(a) == []
    steps = drain_sink(b)
    assert [[(e.token, e.finish_reason) for e in s] for s in steps] == [[(7, None)], [(7, "length")]]
    assert client.counts() == {"running": 0, "waiting": 0} and client.kv_usage == 0.0
    assert engine.seqs == [] and engine.blocks.num_free == engine.blocks.num_blocks


def test_failed_step_leaves_no_stale_kv_usage():
    """A step that fails after one that ran frees the blocks of the requests it fails: the KV
    usage the server reports goes back to 0 (it stayed at the last step's until the next request)."""
    from modeling.serve.engine_loop import EngineClient, EngineFailure, Sink

    engine, client = FakeEngine(fail_from=2), EngineClient(ListTransport(), 100)
    sink = Sink()
    client.submit(sink, 0, [1, 2], SamplingParams(), 5, ())
    run_core(engine, client)
    got = drain_sink(sink)
    assert len(got) == 2 and [e.token for e in got[0]] == [7] and isinstance(got[1], EngineFailure)
    assert "device lost" in got[1].message
    assert client.counts() == {"running": 0, "waiting": 0} and client.kv_usage == 0.0


def test_submit_to_a_dead_engine_fails_at_once():
    """A request whose handler was reading its body when the engine died: nothing is sent to the
    dead engine and its sink fails at once (it waited for the drain timeout, then was cut)."""
    from modeling.serve.engine_loop import EngineClient, EngineFailure, Sink

    dead = []
    client = EngineClient(ListTransport(), 100, dead.append)
    client.on_message(("dead", "the engine process exited (code -9)"))
    sink = Sink()
    client.submit(sink, 0, [1, 2], SamplingParams(), 5, ())
    got = drain_sink(sink)
    assert len(got) == 1 and isinstance(got[0], EngineFailure) and "code -9" in got[0].message
    assert client.transport.inbox == [] and client.counts() == {"running": 0, "waiting": 0} and len(dead) == 1


def _engine_child_blocked_in_send(spec, inbox, conn, parent_pid):
    """A fake engine process (ProcessTransport's target): ready, then a report larger than a pipe
    holds (it blocks until the server reads), then it waits for "stop" as EngineCore does."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(("ready", {}))
    conn.send(("status", [], 0.0, b"x" * (1 << 20)))
    while inbox.recv() != ("stop",):
        pass


def _engine_child_hung(spec, inbox, conn, parent_pid):
    """A fake engine process stuck in a step (a hung device): ready, then it reads nothing and
    ignores SIGTERM, until its parent is gone."""
    import os
    import signal
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(("ready", {}))
    while os.getppid() == parent_pid:
        time.sleep(0.1)


def _engine_child_echo(spec, inbox, conn, parent_pid):
    """A fake engine process: ready, then for every request it reads, a report of its kind and
    size, until "stop"."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(("ready", {}))
    while True:
        msg = inbox.recv()
        if msg == ("stop",):
            return
        conn.send(("status", [(msg[1], len(msg[2]))], 0.0))


def test_requests_larger_than_the_pipe_reach_the_engine_whole_and_in_order(monkeypatch):
    """The event loop never blocks on the request pipe (test_a_hung_engine_... would hang): a request
    larger than it holds is written as it drains (add_writer), and the ones after it arrive after
    it, whole."""
    from modeling.serve import engine_process

    monkeypatch.setattr(engine_process, "_child_main", _engine_child_echo)
    t = engine_process.ProcessTransport(engine_process.EngineSpec("unused", None, None))
    sizes = [300_000, 3, 200_000, 1]

    async def run():
        loop = asyncio.get_running_loop()
        got, done = [], asyncio.Event()

        def on_report(msg):
            got.append(msg[1][0])
            if len(got) == len(sizes):
                done.set()

        t.start(on_report, loop)
        for rid, n in enumerate(sizes):
            t.put(("add", rid, [7] * n, None, 1, ()))
        assert t._pending  # the pipe did not take it all: the rest goes as it drains
        await asyncio.wait_for(done.wait(), 60)
        return got

    import asyncio

    try:
        got = asyncio.run(run())
    finally:
        t.stop(10.0)
    assert got == list(enumerate(sizes)) and t.proc.exitcode == 0


def test_stop_reads_what_the_engine_is_blocked_sending(monkeypatch):
    """The lifespan's stop blocks the event loop: an engine blocked sending a report larger than
    the pipe holds must still get to its "stop" and exit cleanly (it was SIGTERMed, which it
    ignores, then died of a broken pipe, after twice the timeout)."""
    from modeling.serve import engine_process

    monkeypatch.setattr(engine_process, "_child_main", _engine_child_blocked_in_send)
    t = engine_process.ProcessTransport(engine_process.EngineSpec("unused", None, None))
    t.stop(10.0)
    assert t.proc.exitcode == 0 and t._conn.closed


def test_interrupted_start_kills_the_engine_process(monkeypatch):
    """Ctrl-C while the engine process loads: it ignores SIGINT and SIGTERM, so unless the server
    kills it, it runs on and the server's exit waits for it for good."""
    import multiprocessing

    from modeling.serve import engine_process

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_process, "_child_main", _engine_child_hung)
    monkeypatch.setattr(engine_process.ProcessTransport, "_wait_ready", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine_process.ProcessTransport(engine_process.EngineSpec("unused", None, None))
        assert [p for p in multiprocessing.active_children() if p.name == "qwen-serve-engine"] == []
    finally:
        for p in multiprocessing.active_children():
            if p.name == "qwen-serve-engine":
                p.kill()
                p.join()


def test_a_hung_engine_is_killed_and_the_server_exits():
    """An engine process stuck in a step, requests queued for it past what a pipe holds: stop
    kills it (it ignores SIGTERM) and the server's process exits (it waited for good at exit, for
    the child and for the queue's feeder thread blocked on the full pipe)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (
        "import test_serve_units as t\n"
        "from modeling.serve import engine_process as ep\n"
        "ep._child_main = t._engine_child_hung\n"
        "tr = ep.ProcessTransport(ep.EngineSpec('unused', None, None))\n"
        "tr.put(('add', 0, [1] * 100000, None, 1, ()))\n"
        "tr.stop(0.5)\n"
        "print('exitcode', tr.proc.exitcode, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root)])}
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "exitcode -9", r.stdout + r.stderr


def test_stop_leaves_an_in_process_engine_empty():
    """The loop stops with sequences in the engine (handlers cancelled after the app's shutdown
    abort nothing): an Engine of this process, given to create_app, outlives it and must not keep
    their blocks or step them for no one."""
    from modeling.serve.engine_loop import EngineClient, Sink

    engine, client = FakeEngine(), EngineClient(ListTransport(), 100)
    for _ in range(2):
        client.submit(Sink(), 0, [1, 2], SamplingParams(), 5, ())
    client.transport.put(("stop",))
    run_core(engine, client)
    assert engine.seqs == [] and not engine.has_work()


def test_tool_call_parser_flag_and_the_form_the_template_implies():
    from types import SimpleNamespace

    from modeling.serve.__main__ import parse_args
    from modeling.serve.protocol import tool_form

    assert parse_args(["--tool-call-parser", "qwen3_coder"]).tool_call_parser == "qwen3_coder"
    assert parse_args([]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "mistral"])

    def frontend(source):
        return SimpleNamespace(chat_template=SimpleNamespace(source=source, named={}))

    xml, plain = frontend("{{ '<tool_call>\\n<function=' }}"), frontend("{{ '<tool_call>' }}")
    assert [tool_form(xml, None), tool_form(plain, None), tool_form(xml, "hermes"), tool_form(plain, "qwen3_xml")] \
        == ["xml", "json", "json", "xml"]
