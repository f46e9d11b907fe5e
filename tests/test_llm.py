"""modeling.api.llm: the text API (``LLM(model).generate / chat / stream``) on tiny checkpoints with a real
chat template, in float64 (the PyTorch reference ops: fast and exact on the CPU); stop strings,
EOS, the cache sizing and the memory check; and ``import modeling`` staying light."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling import LLM, QwenForCausalLM, QwenTokenizer, RequestOutput, SamplingParams, TextStream
from modeling.chat.template import ChatTemplate
from modeling.generation.generator import Generator
from modeling.api.checkpoint import Checkpoint, default_model_dir, load_config
from modeling.api.llm import DEFAULT_MAX_TOKENS
from modeling.api.outputs import StopStrings
from modeling.generation.prompts import ContextLengthError
from modeling.generation.runtime import DoesNotFit, check_fits, resolve_device, resolve_dtype
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


def test_generate_matches_the_generator(llm, ckpt):
    prompts = ["The meaning of life is", "Hello world, 世界 🙂", "x"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=7))
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    tok = QwenTokenizer.from_pretrained(ckpt)
    r = Generator(model, max_batch_size=3, max_seq_len=64).generate([tok.encode(p) for p in prompts], 7,
                                                                      stop_token_ids=tok.eos_token_ids)
    assert [o.index for o in outs] == [0, 1, 2] and [o.prompt for o in outs] == prompts
    for o, tokens, reason in zip(outs, r.tokens, r.finish_reasons):
        assert isinstance(o, RequestOutput) and o.outputs[0] is o  # vLLM's out.outputs[0].text works
        assert o.token_ids == tokens and o.finish_reason == reason
        assert o.text == tok.decode(tokens, skip_special_tokens=True)
        assert o.metrics["decode_steps"] >= 0 and "prefill_ms" in o.metrics
    assert llm.generate("x", SamplingParams(max_tokens=7))[0].token_ids == outs[2].token_ids  # a str is one prompt
    assert llm.backend == "PyTorch reference ops (CPU)"


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
    assert out.token_ids == full.token_ids[:4]  # the token that completed the stop string is kept
    assert out.generated_tokens == 4  # a stop string adds no stop token to the count
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
    """vLLM's {"prompt_token_ids": [...]} prompt (alone, in a list, mixed with text, streamed), and
    generate_ids' lists, tuples, NumPy arrays and integer tensors, all the same tokens."""
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
    outs, _ = steered.generate_ids([ids, tuple(ids), np.array(ids), torch.tensor(ids)], params)
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


@pytest.mark.parametrize("prompts, offset, message", [
    ([[1.7, 2.2]], 0, r"prompts\[0\]\[0\] must be an integer token id, got 1.7 \(float\)"),
    ([[5], [5, True]], 0, r"prompts\[1\]\[1\] must be an integer token id, got True \(bool\)"),
    ([[5], [0.5]], 3, r"prompts\[4\]\[0\] must be an integer token id, got 0.5"),
    ([torch.tensor([5.0, 6.0])], 0,
     r"prompts\[0\] must be a 1-D integer tensor of token ids, got a 1-D float32 tensor"),
    ([5, 6], 0, r"prompts\[0\] must be a sequence of token ids, got 5"),
    ("Hello", 0, r"prompts must be a list of prompts \(each a list of token ids\), got a str"),
])
def test_generate_ids_refuses_what_is_not_token_ids(steered, prompts, offset, message):
    with pytest.raises(ValueError, match=message):
        steered.generate_ids(prompts, SamplingParams(max_tokens=2), index_offset=offset)


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
    assert s.output.finish_reason == "abort" and s.output.generated_tokens == len(s.output.token_ids) < 2000
    assert steered.generate("Hello", params)[0].text == "\n世\n世\n世"  # the generator is free again
    for piece in steered.stream("Hello", SamplingParams(max_tokens=2000)):
        break  # dropping the iterator stops it too
    assert steered.generate("Hello", params)[0].text == "\n世\n世\n世"
    messages = [{"role": "user", "content": "Hi"}]
    assert "".join(steered.stream_chat(messages, params)) == steered.chat(messages, params)[0].text
    bad = steered.stream("Hello", SamplingParams(max_tokens=1, stop_token_ids=list(range(20))))
    with pytest.raises(ValueError, match="at most 16"):  # errors in the worker reach the consumer
        list(bad)


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


def test_cache_is_sized_per_call_and_grows(steered):
    fresh = LLM(steered.checkpoint, **F64)
    fresh.generate("Hello", SamplingParams(max_tokens=4))
    assert (fresh.generator.max_batch_size, fresh.generator.max_seq_len) == (1, 256)
    first = fresh.generator
    fresh.generate(["a", "b", "c"], SamplingParams(max_tokens=300, stop="世"))  # sized for 300, stops at 2
    assert (fresh.generator.max_batch_size, fresh.generator.max_seq_len) == (3, 512) and fresh.generator is not first
    grown = fresh.generator
    fresh.generate("Hello", SamplingParams(max_tokens=4))
    assert fresh.generator is grown  # big enough: reused
    fixed = LLM(steered.checkpoint, max_seq_len=8, **F64)
    (out,) = fixed.generate("Hello", SamplingParams(max_tokens=50))
    assert len(out.token_ids) == 8 - len(out.prompt_token_ids) and out.finish_reason == "length"
    with pytest.raises(ContextLengthError, match="no room for a new token"):
        fixed.generate("The quick brown fox jumps over the lazy dog", SamplingParams(max_tokens=1))


def test_memory_check(steered, monkeypatch):
    import modeling.generation.runtime

    config = steered.config
    monkeypatch.setattr(modeling.generation.runtime, "available_memory", lambda device: 10**9)
    check_fits(config, torch.device("cpu"), torch.float32, 1, 10**5, 10)
    with pytest.raises(DoesNotFit, match=r"but cpu has 1.0 GB free: at most [\d,]+ positions") as e:
        check_fits(config, torch.device("cpu"), torch.float32, 4, 10**9, 10)
    assert 0 < e.value.max_seq_len < 10**9 / 4
    check_fits(config, torch.device("cpu"), torch.float32, 4, e.value.max_seq_len, 10)  # what it says fits, fits
    monkeypatch.setattr(modeling.generation.runtime, "backend_name", lambda device, dtype: "PyTorch reference ops (CPU)")
    with pytest.raises(DoesNotFit, match="prompts of at most ~") as e:
        check_fits(config, torch.device("cpu"), torch.float32, 1, 5000, 4000)
    check_fits(config, torch.device("cpu"), torch.float32, 1, 5000, e.value.max_prompt)
    fresh = LLM(steered.checkpoint, **F64)
    monkeypatch.setattr(modeling.generation.runtime, "available_memory", lambda device: 1000)
    with pytest.raises(DoesNotFit, match="KV cache of 1 x 256 positions"):  # checked before it is allocated
        fresh.generate("Hello", SamplingParams(max_tokens=2))
    assert fresh.generator is None
    with pytest.raises(DoesNotFit, match="weights"):  # the weights, before reading them
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
    with pytest.raises(ValueError, match="max_seq_len"):
        LLM(steered.checkpoint, max_seq_len=1, **F64)
    with pytest.raises(ValueError, match="is empty"):
        steered.generate([""])
    with pytest.raises(ValueError, match="not valid UTF-8"):
        steered.generate(["caf\udce9"])
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        steered.generate(["a"], [SamplingParams(), SamplingParams()])
    assert steered.generate([]) == []
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json is not a JSON object \(it holds a list\)"):
        load_config(tmp_path)


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
    for kwargs, message in [(dict(temperature=1e300), "temperature must be a finite number"),
                            (dict(top_k=2**63), r"top_k must be an integer in \[0, 2\*\*63\)"),
                            (dict(max_tokens=0), "max_tokens must be"), (dict(stop=[""]), "non-empty strings"),
                            (dict(stop=["\udcff"]), "not valid Unicode"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                            (dict(top_k=True), "top_k must be")]:
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
