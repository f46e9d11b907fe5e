"""modeling.api.llm: the text API (``LLM(model).generate / chat / stream``) on the engine, on tiny
checkpoints with a real chat template, in float64 (the PyTorch reference ops: fast and exact on the
CPU); vLLM's output fields, ``n`` and seeds, stop strings, EOS, the engine's sizing and the memory
check, the earlier arguments; and ``import modeling`` staying light."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from modeling import (LLM, CompletionOutput, QwenConfig, QwenForCausalLM, QwenTokenizer, RequestOutput, SamplingParams,
                      TextStream)
from modeling.api.checkpoint import Checkpoint, default_model_dir
from modeling.api.llm import DEFAULT_MAX_TOKENS
from modeling.api.outputs import StopStrings
from modeling.chat.template import ChatTemplate
from modeling.cli.output import generated_tokens
from modeling.engine.prompts import ContextLengthError
from modeling.model.device import DoesNotFit, resolve_device, resolve_dtype
from tests.helpers import recompute_greedy
from tests.test_generate_cli import build_chat_checkpoint, build_steered_checkpoint

ROOT = Path(__file__).resolve().parents[1]
F64 = dict(device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_chat_checkpoint(tmp_path_factory.mktemp("llm") / "tiny")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **F64)


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """Greedy output '\\n世\\n世...' after a prompt that does not end in a newline."""
    return LLM(build_steered_checkpoint(tmp_path_factory.mktemp("steered") / "ckpt"), **F64)


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory):
    """Greedy output: <|im_end|> (an EOS id) first, then '世', <|im_end|>, '世'..."""
    return LLM(build_steered_checkpoint(tmp_path_factory.mktemp("eos") / "ckpt", first=2), **F64)


def test_generate_matches_recomputing(llm, ckpt):
    """Greedy outputs of a call's prompts (one continuous batch in the engine) in vLLM's shapes: the
    model's own greedy tokens without a cache, up to EOS."""
    prompts = ["The meaning of life is", "Hello world, 世界 🙂", "x"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=7))
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    tok = QwenTokenizer.from_pretrained(ckpt)
    want = recompute_greedy(model, [tok.encode(p) for p in prompts], 7)
    assert [o.prompt for o in outs] == prompts and len({o.request_id for o in outs}) == 3
    for o, tokens in zip(outs, want):
        stop = next((i for i, t in enumerate(tokens) if t in tok.eos_token_ids), None)
        assert isinstance(o, RequestOutput) and o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0 and (c.text, c.token_ids) == (o.text, o.token_ids)
        assert c.token_ids == tokens[:stop] and c.finish_reason == ("length" if stop is None else "stop")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is None and c.cumulative_logprob is None
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert m.arrival_time > 1e9  # a Unix timestamp (time.time(), as vLLM's), not a perf_counter reading
    assert llm.generate("x", SamplingParams(max_tokens=7))[0].token_ids == outs[2].token_ids  # a str is one prompt
    assert llm.backend == "PyTorch reference ops (CPU)"


def test_n_completions_and_seeds_do_not_depend_on_the_batch(llm):
    """``n`` completions of a seeded prompt: the first is the ``n=1`` one, the others differ; a seeded
    prompt gives the same text alone, twice in one call, or at index 1 beside other prompts."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = llm.generate("Hello", params)[0].text
    (out,) = llm.generate("Hello", replace(params, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.outputs[0].text == alone
    assert len({c.text for c in out.outputs}) == 3
    twice = llm.generate(["Hello", "Hello"], params)
    assert [o.text for o in twice] == [alone, alone]
    mixed = llm.generate(["The meaning", "Hello", "x"], [replace(params, seed=1), params, SamplingParams(max_tokens=3)])
    assert mixed[1].text == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert len({o.text for o in llm.generate(["Hello"] * 4, unseeded)}) > 1  # no seed: a fresh draw each


def test_logprobs_and_progress_bar(llm, capsys):
    """logprobs in vLLM's shape (a dict a token: the sampled one and the top k, ranked); the
    progress bar (tqdm, on stderr) counts the prompts, and ``use_tqdm=False`` leaves stderr quiet."""
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, entry in zip(c.token_ids, c.logprobs):
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
        assert [r for r, _ in ranked] == [1, 2] and token == ranked[0][1]  # greedy: the sampled one is rank 1
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    capsys.readouterr()
    llm.generate(["a", "b"], SamplingParams(max_tokens=2))
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""
    made = []  # vLLM's use_tqdm may be a callable (a tqdm class) that makes the bar

    def quiet_bar(**kwargs):
        from tqdm import tqdm

        made.append(kwargs)
        return tqdm(**kwargs, disable=True)

    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=quiet_bar)
    assert [m["total"] for m in made] == [2] and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="use_tqdm must be True, False or a callable .* got 'yes'"):
        llm.generate("a", SamplingParams(max_tokens=2), use_tqdm="yes")


def test_sampled_tokens_have_their_rank(llm):
    """A sampled token's ``Logprob.rank`` when it is not among the top logprobs (vLLM's): 1 + the
    vocabulary entries more likely under the raw distribution, recomputed from the model's logits
    (greedy: 1)."""
    (greedy,) = llm.generate("Hello", SamplingParams(max_tokens=4, logprobs=0, ignore_eos=True), use_tqdm=False)
    assert [e[t].rank for t, e in zip(greedy.token_ids, greedy.outputs[0].logprobs)] == [1] * 4
    params = SamplingParams(temperature=3.0, seed=3, max_tokens=8, logprobs=0, ignore_eos=True)
    (drawn,) = llm.generate("Hello", params, use_tqdm=False)
    start = len(drawn.prompt_token_ids)
    with torch.no_grad():
        lp = llm.model(torch.tensor([drawn.prompt_token_ids + drawn.token_ids]))[0, start - 1:-1].log_softmax(-1)
    want = [1 + (row > row[t]).sum().item() for row, t in zip(lp, drawn.token_ids)]
    assert [e[t].rank for t, e in zip(drawn.token_ids, drawn.outputs[0].logprobs)] == want and max(want) > 1


def test_a_bad_word_of_whitespace_is_its_token(steered):
    """bad_words=["\\n"]: the newline token is never generated (only an empty word is refused)."""
    out = steered.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True, bad_words=["\n"]), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and steered.tokenizer.encode("\n")[0] not in out.token_ids


def test_stops_at_eos_by_default(eos_first):
    (out,) = eos_first.generate(["Hello"], SamplingParams(max_tokens=5))
    assert out.finish_reason == "stop" and out.token_ids == [] and out.text == "" and out.stop_reason is None
    (out,) = eos_first.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids[::2] == [2, 2, 2] and out.text == "世世"
    (out,) = eos_first.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True, skip_special_tokens=False))
    assert out.text == "<|im_end|>世<|im_end|>世<|im_end|>"
    world = eos_first.tokenizer.encode("世")[0]
    (out,) = eos_first.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[world]))
    assert out.finish_reason == "stop" and out.token_ids == [2]


def test_stop_strings(steered):
    full = steered.generate("Hello", SamplingParams(max_tokens=8))[0]
    assert full.text == "\n世\n世\n世\n世" and full.finish_reason == "length"
    (out,) = steered.generate("Hello", SamplingParams(max_tokens=8, stop=["世\n世", "never"]))
    assert out.text == "\n" and out.finish_reason == "stop" and out.stop_reason == "世\n世"
    assert not steered.engine.scheduler.has_work()  # the sequence left the engine at its stop string
    assert out.token_ids == full.token_ids[:4]  # the token that completed the stop string is kept
    assert generated_tokens(out.outputs[0]) == 4  # a stop string adds no stop token to the count
    (out,) = steered.generate("Hello", SamplingParams(max_tokens=8, stop="\n"))
    assert out.text == "" and out.token_ids == full.token_ids[:1] and out.stop_reason == "\n"
    (out,) = steered.generate("Hello", SamplingParams(max_tokens=3, stop="世\n世\n"))  # a partial match at the end
    assert out.text == "\n世\n" and out.finish_reason == "length"
    # rows of one batch stop independently; the others run on
    outs = steered.generate(["Hello", "Hi"], [SamplingParams(max_tokens=6, stop="世\n"), SamplingParams(max_tokens=6)])
    assert [o.text for o in outs] == ["\n", "\n世\n世\n世"]


def test_stop_string_matcher():
    s = StopStrings(["abc", "bd"])
    assert s.push("xa") == "x" and s.push("b") == "" and s.push("x") == "abx"  # held back while it could match
    assert s.push("ab") == "" and s.push("d") == "a" and s.matched == "bd"  # the earliest match wins
    assert s.push("more") == "" and s.flush() == ""
    s = StopStrings(["abc"])
    assert s.push("zab") == "z" and s.flush() == "ab" and s.matched is None
    assert StopStrings([]).push("anything") == "anything"
    # found in one piece: the earliest match wins, however short; at the same place, the longest
    for stop in (["abc", "bc"], ["bc", "abc"]):
        s = StopStrings(stop)
        assert s.push("xbcabc") == "x" and s.matched == "bc"
    for stop in (["ab", "abc"], ["abc", "ab"]):
        s = StopStrings(stop)
        assert s.push("xabcd") == "x" and s.matched == "abc"


def reference_stop_strings(stop, pieces):
    """What StopStrings gives for ``pieces``, by its definition: after each push, the earliest
    match (at one place, the longest) in the held-back text and the piece ends the text; else
    the longest end of the text that some stop string starts with is held back."""
    out, pending = [], ""
    for piece in pieces:
        pending += piece
        hits = [(pending.find(s), -len(s), s) for s in stop if s in pending]
        if hits:
            i, _, matched = min(hits)
            return out + [pending[:i]], matched
        keep = max((k for s in stop for k in range(1, min(len(s) - 1, len(pending)) + 1)
                    if pending.endswith(s[:k])), default=0)
        out.append(pending[:len(pending) - keep])
        pending = pending[len(pending) - keep:]
    out[-1] += pending  # flushed at the end
    return out, None


def test_stop_string_matcher_against_its_definition():
    import random

    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        stop = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 5))]
        pieces = ["".join(rng.choices(alphabet + "x", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        s = StopStrings(stop)
        got = []
        for piece in pieces:
            got.append(s.push(piece))
            assert len(s.pending) < max(map(len, stop))  # what is held back could still start a match
            if s.matched is not None:
                break
        got[-1] += s.flush()
        assert (got, s.matched) == reference_stop_strings(stop, pieces), (stop, pieces)


def traced_lines(fn) -> int:
    """Python lines run in modeling/api/outputs.py while ``fn`` runs (a count of operations, not
    a time)."""
    from modeling.api import outputs

    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != outputs.__file__:
            return None
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_stop_strings_cost_the_text_not_their_number():
    """Pushing text through 20,003 stop strings runs exactly the lines it runs through 3 of them
    (the 20,000 others never occur in it): a push costs its piece and the held-back text, never a
    pass over the stop strings. Before, each token cost (stop strings x pending text): one request
    with 700,000 stop strings stalled the server's event loop for half a minute."""
    few = ["Romeo, Romeo", "thou art", "\n\nJULIET"]
    many = few + [f"\u4e00{i}" for i in range(20000)]
    pieces = ["ROMEO:\nBut soft", ", what light", " through yonder", " Romeo, Ro", "se, thou", " ar"] * 30
    matchers = [StopStrings(few), StopStrings(many)]  # built before counting (once per set of stop strings)

    def push_all(s):
        return lambda: [s.push(p) for p in pieces]

    assert traced_lines(push_all(matchers[0])) == traced_lines(push_all(matchers[1]))
    assert matchers[1].matched is None and matchers[1].pending == "thou ar"


def test_token_id_prompts(steered):
    """vLLM's {"prompt_token_ids": [...]} prompt (alone, in a list, mixed with text, streamed) as a
    list, a tuple, a NumPy array or an integer tensor, all the same tokens."""
    import numpy as np

    params = SamplingParams(max_tokens=4)
    ids = steered.tokenizer.encode("Hello")
    (text,) = steered.generate("Hello", params)
    (out,) = steered.generate({"prompt_token_ids": ids}, params)
    assert out.prompt is None and out.prompt_token_ids == ids
    assert (out.token_ids, out.text) == (text.token_ids, text.text)
    outs = steered.generate(["Hello", {"prompt_token_ids": tuple(ids)}], params)
    assert [o.prompt for o in outs] == ["Hello", None] and outs[0].token_ids == outs[1].token_ids
    assert steered.stream({"prompt_token_ids": ids}, params).text == text.text
    outs = steered.generate([{"prompt_token_ids": p} for p in (ids, np.array(ids), torch.tensor(ids))], params)
    assert all(o.token_ids == text.token_ids for o in outs)


@pytest.mark.parametrize("prompts, message", [
    (["Hello", {"prompt": "Hello"}],
     r"prompts\[1\]: a dict prompt holds one key, 'prompt_token_ids', got the keys \['prompt'\]"),
    ({"prompt_token_ids": [5], "extra": 1}, r"prompts\[0\]: a dict prompt holds one key"),
    ([[5, 6]], r"prompts\[0\] must be a str or a \{'prompt_token_ids': \[\.\.\.\]\} dict, got list"),
    ([5], r"prompts\[0\] must be a str or a \{'prompt_token_ids'.*got int"),
    ({"prompt_token_ids": [1.7, 2.2]},
     r"prompts\[0\]\['prompt_token_ids'\]\[0\] must be an integer token id, got 1.7 \(float\)"),
    ({"prompt_token_ids": "Hello"}, r"prompts\[0\]\['prompt_token_ids'\] must be a sequence of token ids, got a str"),
    ({"prompt_token_ids": []}, r"prompts\[0\]\['prompt_token_ids'\] is empty"),
    ({"prompt_token_ids": [10**6]}, r"prompts\[0\]\['prompt_token_ids'\] has token ids outside the model's vocabulary"),
])
def test_bad_prompts_are_refused(steered, prompts, message):
    with pytest.raises(ValueError, match=message):
        steered.generate(prompts, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate(123), r"prompts must be a str, a \{'prompt_token_ids': \[\.\.\.\]\} dict or a list "
                                    "of them, got int"),
    (lambda llm: llm.generate(None), "prompts must be a str.* got NoneType"),
    (lambda llm: llm.generate("x", {"max_tokens": 5}), r"sampling_params must be a SamplingParams .* got dict"),
    (lambda llm: llm.generate(["x", "y"], [SamplingParams(), {"max_tokens": 5}]),
     r"sampling_params\[1\] must be a SamplingParams"),
    (lambda llm: llm.generate({"prompt_token_ids": torch.tensor([5.0, 6.0])}),
     r"prompts\[0\]\['prompt_token_ids'\] must be a 1-D integer tensor of token ids, got a 1-D float32 tensor"),
    (lambda llm: llm.chat("Hi"), r"messages must be a list of \{'role', 'content'\} dicts"),
    (lambda llm: llm.stream("Hi", SamplingParams(n=2)), "stream makes one completion: sampling_params.n must be 1"),
])
def test_arguments_of_the_wrong_type_are_named(steered, call, message):
    with pytest.raises(ValueError, match=message):
        call(steered)


def test_earlier_arguments_warn_or_say_what_to_use(steered):
    """Arguments whose meaning carries over work with a DeprecationWarning naming the new one; those
    that mean nothing on the engine are refused, saying what to use instead."""
    with pytest.warns(DeprecationWarning, match=r"LLM\(max_seq_len=...\) is deprecated: use max_model_len"):
        old = LLM(steered.checkpoint, max_seq_len=64, **F64)
    with pytest.warns(DeprecationWarning, match="max_batch_size=...\\) is deprecated: use max_num_seqs"):
        LLM(steered.checkpoint, max_batch_size=2, **F64)
    assert old.max_model_len == 64 and old.engine.max_model_len == 64
    for name, message in [("use_cuda_graph", "enforce_eager=True runs them eagerly"),
                          ("prefill_graph", "captures prefill steps in CUDA graphs")]:
        with pytest.raises(TypeError, match=f"LLM\\(\\): {name} is no longer an argument: .*{message}"):
            LLM(steered.checkpoint, **{name: False}, **F64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_len'"):
        LLM(steered.checkpoint, max_len=3, **F64)
    with pytest.raises(AttributeError, match=r"LLM.generate_ids is gone: pass token ids as prompts"):
        steered.generate_ids([[1, 2]])
    with pytest.raises(AttributeError, match=r"LLM.warm_up is gone: .*capture_graphs"):
        steered.warm_up([1], SamplingParams())


def test_chat_uses_the_checkpoint_template(steered):
    assert steered.chat_template.origin == "chat_template.jinja"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok = steered.tokenizer
    for kwargs in ({}, {"enable_thinking": False}):
        (out,) = steered.chat(messages, SamplingParams(max_tokens=2), **kwargs)
        assert out.prompt == ChatTemplate.from_pretrained(steered.path).render(messages, **kwargs)
        assert out.prompt_token_ids == tok.encode(out.prompt)
    outs = steered.chat([messages, messages[1:]], SamplingParams(max_tokens=2))  # several conversations
    assert len(outs) == 2 and outs[0].prompt.startswith("<|im_start|>system\nBe brief.")
    (out,) = steered.chat(messages, SamplingParams(max_tokens=2), chat_template_kwargs={"enable_thinking": False})
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    for key in ("messages", "tools", "add_generation_prompt"):  # the renderer's own arguments
        with pytest.raises(ValueError, match=f"chat_template_kwargs may not set '{key}'"):
            steered.chat(messages, SamplingParams(max_tokens=2), chat_template_kwargs={key: []})
    with pytest.raises(ValueError, match=r"stop_token_ids \[4096\] lie outside the model's vocabulary \[0, 512\)"):
        steered.generate("Hello", SamplingParams(max_tokens=2, stop_token_ids=[5, 4096]))


def test_chat_takes_openai_messages(steered):
    """Content as a list of text parts and the "developer" role render as the server renders them;
    a malformed message is a ValueError naming it, in which conversation when there are several."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    (plain,) = steered.chat(messages, SamplingParams(max_tokens=2))
    (joined,) = steered.chat(parts, SamplingParams(max_tokens=2))
    assert joined.prompt == plain.prompt and joined.token_ids == plain.token_ids
    for bad, match in (([{"role": "user"}], r"'messages\[0\].content' is required"),
                       ([{"role": "bot", "content": "x"}], r"'messages\[0\].role' must be one of"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                        r"'messages\[0\].content\[0\]' is not supported: only text parts"),
                       ([messages, [{"content": "x"}]], r"conversation 1: 'messages\[0\].role'")):
        with pytest.raises(ValueError, match=match):
            steered.chat(bad, SamplingParams(max_tokens=2))


def test_stream(steered):
    params = SamplingParams(max_tokens=6)
    stream = steered.stream("Hello", params)
    assert isinstance(stream, TextStream)
    pieces = list(stream)
    assert "".join(pieces) == "\n世\n世\n世" and len(pieces) == 6
    assert stream.output.text == "\n世\n世\n世" and stream.output.finish_reason == "length"
    assert steered.stream("Hello", SamplingParams(max_tokens=6, stop="世\n")).text == "\n"
    with steered.stream("Hello", SamplingParams(max_tokens=2000)) as s:  # leaving early stops the generation
        assert next(s) == "\n"
    assert s.output.finish_reason == "abort" and len(s.output.token_ids) < 2000
    assert not steered.engine.scheduler.has_work()  # its sequence is gone from the engine
    assert steered.generate("Hello", params)[0].text == "\n世\n世\n世"
    for piece in steered.stream("Hello", SamplingParams(max_tokens=2000)):
        break  # dropping the iterator stops it too
    assert not steered.engine.scheduler.has_work()
    messages = [{"role": "user", "content": "Hi"}]
    assert "".join(steered.stream_chat(messages, params)) == steered.chat(messages, params)[0].text
    with pytest.raises(ValueError, match="at most 16"):
        steered.stream("Hello", SamplingParams(max_tokens=1, stop_token_ids=list(range(20))))
    # an open stream advances while another call runs: the steps serve every sequence in the engine
    open_stream = steered.stream("Hello", SamplingParams(max_tokens=6))
    assert steered.generate("Hi", SamplingParams(max_tokens=6))[0].text == "\n世\n世\n世"
    assert "".join(open_stream) == "\n世\n世\n世" and open_stream.output.finish_reason == "length"


def test_defaults_from_generation_config(ckpt, tmp_path):
    llm = LLM(ckpt, **F64)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.max_new_tokens(SamplingParams()) == DEFAULT_MAX_TOKENS
    d = tmp_path / "ckpt"
    import shutil

    shutil.copytree(ckpt, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(gen, do_sample=True, temperature=0.6, top_k=20,
                                                              top_p=0.95, max_new_tokens=3)))
    llm = LLM(d, **F64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 3)
    out = llm.generate("Hello")[0]  # no params: the checkpoint's
    assert len(out.token_ids) == 3 or out.finish_reason == "stop"


def test_engine_is_sized_per_call_and_grows(steered):
    fresh = LLM(steered.checkpoint, **F64)
    fresh.generate("Hello", SamplingParams(max_tokens=4))
    first = fresh.engine
    assert (first.scheduler.max_num_seqs, first.max_model_len) == (1, 256)
    fresh.generate(["a", "b", "c"], SamplingParams(max_tokens=300, stop="世"))  # sized for 300, stops at 2
    grown = fresh.engine
    assert (grown.scheduler.max_num_seqs, grown.max_model_len) == (4, 512) and grown is not first
    fresh.generate("Hello", SamplingParams(max_tokens=4))
    assert fresh.engine is grown  # big enough: reused
    fixed = LLM(steered.checkpoint, max_model_len=8, **F64)
    (out,) = fixed.generate("Hello", SamplingParams(max_tokens=50))
    assert len(out.token_ids) == 8 - len(out.prompt_token_ids) and out.finish_reason == "length"
    with pytest.raises(ContextLengthError, match="no room for a new token"):
        fixed.generate("The quick brown fox jumps over the lazy dog", SamplingParams(max_tokens=1))
    capped = LLM(steered.checkpoint, max_num_seqs=2, **F64)
    outs = capped.generate(["a", "b", "c"], SamplingParams(max_tokens=4))  # the third waits its turn
    assert capped.engine.scheduler.max_num_seqs == 2 and [o.text for o in outs] == ["\n世\n世"] * 3


def test_memory_check(steered, monkeypatch):
    """The weights are checked against the free memory before they are read, the cache pool before
    it is allocated; each ``DoesNotFit`` says what was asked and what is free."""
    import modeling.engine.cache_pool
    import modeling.model.device

    fresh = LLM(steered.checkpoint, **F64)
    monkeypatch.setattr(modeling.engine.cache_pool, "available_memory", lambda device: 1000)
    with pytest.raises(DoesNotFit, match="the cache of one 256-token sequence needs .* of the 1000 bytes free on cpu"):
        fresh.generate("Hello", SamplingParams(max_tokens=2))
    assert fresh._engine is None
    monkeypatch.setattr(modeling.model.device, "available_memory", lambda device: 1000)
    with pytest.raises(DoesNotFit, match="the weights need .* but cpu has 1000 bytes free"):
        LLM(steered.checkpoint, **F64)


def test_devices_dtypes_and_bad_arguments(steered, tmp_path):
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("cpu:0") == torch.device("cpu")
    for bad, message in [("cpu:1", "the CPU has no index"), ("cuda:abc", "must be cuda, cuda:N or cpu"),
                         ("tpu", "must be cuda"), ("cuda:", "must be cuda")]:
        with pytest.raises(ValueError, match=message):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32 and resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[2, 2147483647\]"):
        LLM(steered.checkpoint, max_model_len=1, **F64)
    with pytest.raises(ValueError, match=r"max_model_len 10000 exceeds the model's max_position_embeddings \(4096\)"):
        LLM(steered.checkpoint, max_model_len=10000, **F64)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must lie in \(0, 1\], got True"):
        LLM(steered.checkpoint, gpu_memory_utilization=True, **F64)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM(steered.checkpoint, max_num_seqs=0, **F64)
    with pytest.raises(ValueError, match="is empty"):
        steered.generate([""])
    with pytest.raises(ValueError, match=r"prompts\[0\]: the text is not valid UTF-8"):
        steered.generate(["caf\udce9"])
    with pytest.raises(ValueError, match=r"prompts\[1\]: the text holds a lone surrogate U\+D800 at character 2"):
        steered.generate(["ok", "ab\ud800"])
    with pytest.raises(TypeError, match="model must be a Hub id ORG/NAME or a checkpoint directory .* got int"):
        LLM(123, **F64)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        steered.generate(["a"], [SamplingParams(), SamplingParams()])
    assert steered.generate([]) == []
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json is not a JSON object \(it holds a list\)"):
        QwenConfig.from_pretrained(tmp_path)


def test_hub_id_and_default_model(steered, tmp_path, monkeypatch):
    from tests.test_hub import add_snapshot

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_snapshot(tmp_path / "hub", "org/steered", steered.path, "c" * 40)
    llm = LLM.from_pretrained("org/steered", **F64)
    assert llm.generate("Hello", SamplingParams(max_tokens=3))[0].text == "\n世\n"
    from modeling.model.hub import ModelNotFound

    with pytest.raises(ModelNotFound, match="org/absent: not in the local Hub cache"):
        LLM("org/absent", **F64)
    notes = []
    path = default_model_dir(notes.append)
    assert notes and "shipped default model" in notes[0] and (path / "model.safetensors").is_file()
    llm = LLM(**F64)  # no model: the shipped one
    assert llm.path == path == ROOT / "modeling" / "default_model"
    assert isinstance(Checkpoint.load(path), Checkpoint)


def test_sampling_params_validation():
    p = SamplingParams(temperature=0.7, top_k=5, stop="x", stop_token_ids=[3])
    assert p.stop == ("x",) and p.stop_token_ids == (3,) and hash(p) == hash(SamplingParams(0.7, 5, stop=["x"],
                                                                                          stop_token_ids=(3,)))
    # None is vLLM's default of stop, stop_token_ids and bad_words (code passes a request's None on)
    assert SamplingParams(stop=None, stop_token_ids=None, bad_words=None) == SamplingParams()
    for kwargs, message in [(dict(temperature=1e300), "temperature must be a finite number"),
                            (dict(top_k=2**63), r"top_k must be an integer in \[0, 2\*\*63\)"),
                            (dict(max_tokens=0), "max_tokens must be"), (dict(stop=[""]), "non-empty strings"),
                            (dict(stop=["\udcff"]), "not valid Unicode"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                            (dict(top_k=True), "top_k must be"),
                            (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
                            (dict(skip_special_tokens=1), "skip_special_tokens must be True or False"),
                            (dict(include_stop_str_in_output=None), "include_stop_str_in_output must be True or"),
                            (dict(bad_words=[""]), "bad_words must be a sequence of non-empty strings")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_import_modeling_is_light():
    """`import modeling` (and the command line's module) import no torch: Ctrl-C and argument errors
    are handled from the first instant."""
    code = ("import sys, modeling, modeling.generate; assert 'torch' not in sys.modules, 'torch imported'; "
            "from modeling import LLM, SamplingParams, QwenForCausalLM; assert 'torch' in sys.modules; "
            "assert set(modeling.__all__) <= set(dir(modeling))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
