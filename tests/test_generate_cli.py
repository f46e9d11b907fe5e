"""``python -m modeling.generate`` and ``modeling.model.random_checkpoint``: happy paths on a tiny random
checkpoint with a real (Qwen3) chat template, streaming of multi-byte text, the batch file, chat,
interactive chat, stop strings, JSON output, generation_config.json defaults, Hub ids, and every
bad-input path (a one-line ``error:`` on stderr, exit status 2, no traceback); in subprocesses the
hostile environments: stdout closed, a reader that goes away, an ASCII-only stdout, Ctrl-C early.

``build_steered_checkpoint`` makes the tiny model's output predictable: it alternates between two
chosen tokens (see its doc), so tests can ask for newlines, non-ASCII text or EOS at will.
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modeling import LLM, QwenForCausalLM, QwenTokenizer, SamplingParams
from modeling.chat.template import ChatTemplate
from modeling.cli.args import BATCH_FILE_LIMIT, split_prompts
from modeling.cli.generate import main
from modeling.cli.output import escape_line
from modeling.model.random_checkpoint import build_random_checkpoint, ensure_random_checkpoint, is_complete
from tests.helpers import isolated, needs_fifo, recompute_greedy

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "data" / "qwen3_chat_template.jinja"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def build_chat_checkpoint(path: Path, seed: int = 1) -> Path:
    """The tiny random Qwen3 with the Qwen3 chat template as chat_template.jinja."""
    build_random_checkpoint(path, seed=seed, **TINY)
    shutil.copyfile(TEMPLATE, path / "chat_template.jinja")
    return path


def build_steered_checkpoint(path: Path, first="\n", second="世", amplitude: float = 100.0) -> Path:
    """A tiny checkpoint whose greedy output alternates ``first``, ``second``, ``first``, ... (tokens
    given as text of one token, or as ids), on every path (reference, interpreter, GPU).

    How: the lm_head is untied and zero except ``lm_head[first] = +e0``, ``lm_head[second] = -e0``,
    so only those two tokens have a non-zero logit, +/- the final hidden state's dim 0. Every input
    embedding gets +``amplitude`` in dim 0, except ``first``'s, -``amplitude``: that dominates the
    residual stream, so after ``first`` comes ``second`` and after any other token ``first``."""
    from safetensors.torch import load_file, save_file

    build_chat_checkpoint(path)
    tok = QwenTokenizer.from_pretrained(path)

    def token_id(t):
        if isinstance(t, int):
            return t
        ids = tok.encode(t)
        assert len(ids) == 1, f"{t!r} is {len(ids)} tokens"
        return ids[0]

    a, b = token_id(first), token_id(second)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    tensors = load_file(str(path / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"].clone()
    head = torch.zeros_like(emb)
    emb[:, 0] = amplitude
    emb[a, 0] = -amplitude
    head[a, 0], head[b, 0] = 1.0, -1.0
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = emb, head
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_chat_checkpoint(tmp_path_factory.mktemp("ckpt") / "random-qwen3")


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """Greedy output: '\\n世\\n世...' (after a prompt that does not end in a newline)."""
    return build_steered_checkpoint(tmp_path_factory.mktemp("steered") / "ckpt")


def run_main(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def json_lines(out: str):
    return [json.loads(line) for line in out.splitlines()]


def expected_path(device="cpu", dtype=torch.float32) -> str:
    from modeling.model.device import backend_name

    return backend_name(torch.device(device), dtype)


def test_earlier_flags_work_with_a_note_or_are_refused(steered, capsys):
    """--max-new-tokens, --max-seq-len, --max-batch-size and --no-cuda-graph still work, each with
    a note naming its new name; --prefill-graph means nothing on the engine: refused, saying why."""
    code, out, err = run_main(capsys, "--model", steered, "--prompt", "Hello", "--max-new-tokens", 2, "--max-seq-len",
                              64, "--max-batch-size", 1, "--no-cuda-graph", "--device", "cpu", "--json")
    assert code == 0 and len(json_lines(out)[0]["token_ids"]) == 2, err
    for old, new in [("--max-new-tokens", "--max-tokens"), ("--max-seq-len", "--max-model-len"),
                     ("--max-batch-size", "--max-num-seqs"), ("--no-cuda-graph", "--enforce-eager")]:
        assert f"note: {old} is deprecated: use {new}" in err
    for flag in ("--prefill-graph", "--no-prefill-graph"):
        code, out, err = run_main(capsys, "--model", steered, "--prompt", "Hello", flag, "--device", "cpu")
        assert code == 2 and out == "" and err.startswith(f"error: {flag} no longer means anything: the engine "
                                                          "captures prefill steps"), err


def test_random_checkpoint_loads(ckpt):
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = QwenTokenizer.from_pretrained(ckpt)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == tok.vocab_size
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tok.eos_token_ids == (2, 0)
    text = "héllo 世界 🙂 and some unseen wørds"
    assert tok.decode(tok.encode(text)) == text
    fresh = build_random_checkpoint(ckpt.parent / "fresh", seed=1, **TINY)
    assert is_complete(fresh)
    stamp = (fresh / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_checkpoint(fresh) == fresh
    assert (fresh / "model.safetensors").stat().st_mtime_ns == stamp  # built once, then reused


def test_streamed_text_equals_decoded_tokens(ckpt, capsys):
    """Greedy on the CPU: stdout is exactly the detokenized completion (streamed piece by piece);
    the stats line gives the time to the first token and the decode rate and names the path that ran."""
    prompt = "Once upon a time, 世界 🙂"
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", prompt, "--max-tokens", 12,
                              "--device", "cpu", "--dtype", "fp32")
    assert code == 0, err
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = QwenTokenizer.from_pretrained(ckpt)
    tokens = recompute_greedy(model, [tok.encode(prompt)], 12)[0]
    stop = next((i for i, t in enumerate(tokens) if t in tok.eos_token_ids), len(tokens))
    assert out == tok.decode(tokens[:stop], skip_special_tokens=True) + "\n"
    stats = err.strip().splitlines()[-1]
    assert stats.startswith(f"prompt tokens {len(tok.encode(prompt))} | first token ")
    assert "ms/token" in stats and "tokens/s" in stats and "cuda graph: no" in stats
    path = expected_path()
    assert stats.endswith(f"| {path}, float32")
    notice = err.splitlines()[0]
    assert "running eagerly on the CPU" in notice and path.split(" (")[0] in notice
    if os.environ.get("TRITON_INTERPRET") == "1":  # conftest sets it without a GPU: the interpreter ran
        assert "Triton interpreter (CPU)" in stats and "reference" not in notice


def test_json_logprobs_hold_the_top_k(ckpt, capsys):
    """--json --logprobs K: each token's log-probability and the K most likely tokens', best first
    (a sampled token outside them, which has a rank too, is not among them)."""
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "Hello", "--max-tokens", 8, "--json",
                              "--logprobs", 2, "--temperature", 3, "--seed", 3, "--device", "cpu")
    assert code == 0, err
    (obj,) = json_lines(out)
    assert [e["token_id"] for e in obj["logprobs"]] == obj["token_ids"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
               for e in obj["logprobs"])
    assert any(e["token_id"] not in [t["token_id"] for t in e["top_logprobs"]] for e in obj["logprobs"])


def test_batch_file_and_chat(ckpt, capsys, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("The quick brown fox\n\nHello world\nWhat is the capital of France?\n")
    args = ("--model", ckpt, "--batch-file", batch, "--max-tokens", 5, "--chat", "--temperature", 0.8,
            "--top-k", 20, "--top-p", 0.9, "--seed", 3, "--device", "cpu", "--max-num-seqs", 2)
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    lines = out.splitlines()
    assert sorted(line[:4] for line in lines) == ["[0] ", "[1] ", "[2] "]
    code2, out2, _ = run_main(capsys, *args)
    assert sorted(out2.splitlines()) == sorted(lines)  # same seed, same text (the order they finish in may differ)
    # the command line's prompts sample as LLM's do (a seeded prompt, whatever runs beside it)
    template = ChatTemplate.from_pretrained(ckpt)
    prompts = [template.render([{"role": "user", "content": p}])
               for p in ("The quick brown fox", "Hello world", "What is the capital of France?")]
    outs = LLM(ckpt, device="cpu", dtype=torch.float32).generate(
        prompts, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=5), use_tqdm=False)
    assert sorted(lines) == [f"[{i}] {escape_line(o.text)}" for i, o in enumerate(outs)]


def test_n_completions_a_prompt(ckpt, capsys):
    """--n N: N completions of each prompt, printed [i.j] (or JSON with "completion": j), as LLM's
    n gives them for the same seed; --n 0, or --n with --interactive, is refused."""
    args = ("--model", ckpt, "--prompt", "Hello", "--max-tokens", 4, "--temperature", 1.0, "--seed", 5,
            "--device", "cpu", "--n", 3)
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    (o,) = LLM(ckpt, device="cpu", dtype=torch.float32).generate(
        ["Hello"], SamplingParams(temperature=1.0, seed=5, max_tokens=4, n=3), use_tqdm=False)
    assert sorted(out.splitlines()) == [f"[0.{j}] {escape_line(c.text)}" for j, c in enumerate(o.outputs)]
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    rows = sorted(json_lines(out), key=lambda r: r["completion"])
    assert [(r["index"], r["completion"], r["token_ids"]) for r in rows] == \
        [(0, j, c.token_ids) for j, c in enumerate(o.outputs)]
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "Hello", "--json", "--max-tokens", 2, "--device", "cpu")
    assert code == 0 and "completion" not in json_lines(out)[0]
    for extra, message in ((("--prompt", "Hi", "--n", 0), "error: --n must be an integer in [1, "),
                           (("-i", "--n", 2), "error: --interactive writes one reply a turn: it takes no --n")):
        code, out, err = run_main(capsys, "--model", ckpt, *extra)
        assert code == 2 and err.startswith(message), err


def test_batch_file_splits_on_newline_only(steered, capsys, tmp_path):
    """U+2028 and form feeds stay inside their prompt; CRLF line ends are dropped; completions that
    contain newlines still print one line each, escaped, and --json gives the exact text."""
    prompts = ["a\u2028b c", "x\fy \\z", "plain"]
    batch = tmp_path / "p.txt"
    batch.write_bytes(("\r\n".join(prompts) + "\r\n\n  \n").encode())
    assert split_prompts(batch.read_bytes().decode()) == prompts
    base = ("--model", steered, "--batch-file", batch, "--max-tokens", 6, "--device", "cpu")
    code, out, err = run_main(capsys, *base)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and sorted(line[:4] for line in lines) == ["[0] ", "[1] ", "[2] "]
    code, out_json, err = run_main(capsys, *base, "--json")
    assert code == 0, err
    results = sorted(json_lines(out_json), key=lambda r: r["index"])
    tok = QwenTokenizer.from_pretrained(steered)
    assert [r["prompt_tokens"] for r in results] == [len(tok.encode(p)) for p in prompts]
    for r in results:
        assert r["text"] == "\n世\n世\n世" and r["finish_reason"] == "length" and len(r["token_ids"]) == 6
        assert set(r["timings"]) == {"first_token_ms", "total_ms"}
        assert f"[{r['index']}] {escape_line(r['text'])}" in lines
    assert escape_line("a\\n\nb\r") == "a\\\\n\\nb\\r"


def test_batch_file_from_stdin(steered, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("first\nsecond 世\n".encode())))
    code, out, err = run_main(capsys, "--model", steered, "--batch-file", "-", "--max-tokens", 2,
                              "--device", "cpu", "--json")
    assert code == 0, err
    assert sorted(r["index"] for r in json_lines(out)) == [0, 1]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\xfe bad\n")))
    code, out, err = run_main(capsys, "--model", steered, "--batch-file", "-", "--device", "cpu")
    assert code == 2 and err.startswith("error: --batch-file - (standard input) is not valid UTF-8 (byte 0xff")
    assert out == ""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x\n" * (BATCH_FILE_LIMIT // 2 + 1))))
    code, out, err = run_main(capsys, "--model", steered, "--batch-file", "-", "--device", "cpu")
    assert code == 2 and err == "error: --batch-file -: standard input holds more than the 64 MiB a batch file may have\n"


@needs_fifo
def test_batch_file_reads_only_a_bounded_regular_file(tmp_path):
    """/dev/zero, a FIFO and a file over the limit (sparse: nothing is written) as --batch-file: exit
    status 2 and one line naming it, before any model is read. In a process of its own with a
    timeout and 2 GiB of data: /dev/zero used to be read until the kernel killed the command at
    21 GB, and a FIFO hung it."""
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(BATCH_FILE_LIMIT + 1)
    cases = {"/dev/zero": "zero is not a regular file (a character device)",
             str(tmp_path / "fifo"): "fifo is not a regular file (a FIFO)",
             str(tmp_path / "huge.txt"): "huge.txt is 64 MiB, larger than the 64 MiB this package reads"}
    p = isolated("-c", MAIN_EACH, json.dumps([["--batch-file", path, "--model", str(tmp_path / "none")] for path in cases]))
    assert p.returncode == 0, p.stderr
    for (path, problem), (code, out, err) in zip(cases.items(), json.loads(p.stdout)):
        assert (code, out) == (2, "") and err.startswith(f"error: cannot read --batch-file {path!r}: {problem}"), err
        assert err.count("\n") == 1


MAIN_EACH = """
import contextlib, io, json, sys
from modeling.cli.generate import main

results = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()) as out:
        results.append([main(argv), out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""
"""Runs the command line's main on each command line of its JSON argument; prints each exit status,
stdout and stderr."""


def test_stop_strings(steered, capsys):
    """--stop ends the completion before the first match (and is left out); EOS still stops."""
    base = ("--model", steered, "--prompt", "Hello", "--max-tokens", 8, "--device", "cpu")
    code, out, err = run_main(capsys, *base)
    assert code == 0 and out == "\n世\n世\n世\n世\n", err
    code, out, err = run_main(capsys, *base, "--stop", "世\n", "--stop", "never")
    assert code == 0 and out == "\n\n", err  # the streamed text stops before the stop string
    code, out, err = run_main(capsys, *base, "--stop", "世\n", "--json")
    (r,) = json_lines(out)
    assert r["text"] == "\n" and r["finish_reason"] == "stop" and r["stop_reason"] == "世\n"
    assert len(r["token_ids"]) == 3  # '\n', '世', and the '\n' that completed the stop string
    stats = err.strip().splitlines()[-1]
    assert "3 new tokens" in stats


def test_chat_system_and_thinking_use_the_checkpoint_template(steered, capsys):
    tok = QwenTokenizer.from_pretrained(steered)
    template = ChatTemplate.from_pretrained(steered)
    assert template.origin == "chat_template.jinja"
    user = {"role": "user", "content": "Name three primes."}
    system = {"role": "system", "content": "Be brief."}
    cases = [((), [user], {}),
             (("--system", "Be brief."), [system, user], {}),
             (("--no-thinking",), [user], {"enable_thinking": False})]
    for flags, messages, kwargs in cases:
        code, out, err = run_main(capsys, "--model", steered, "--chat", "--prompt", user["content"], *flags,
                                  "--max-tokens", 1, "--device", "cpu", "--json")
        assert code == 0, err
        (r,) = json_lines(out)
        assert r["prompt_tokens"] == len(tok.encode(template.render(messages, **kwargs))), flags
    assert "<think>\n\n</think>" in template.render([user], enable_thinking=False)


def test_interactive_chat_over_stdin(steered):
    """Two turns (the second sees the first), /reset, a third turn, then end of input."""
    p = _cli("--model", steered, "--interactive", "--max-tokens", 3, "--json", "--system", "S",
             input="Hello\n\nAgain\n/reset\nAgain\n")
    assert p.returncode == 0, p.stderr
    turns = json_lines(p.stdout)
    # the rendered prompt ends in a newline token: the replies start with the other token
    assert len(turns) == 3 and all(t["text"] == "世\n世" and t["finish_reason"] == "length" for t in turns)
    tok = QwenTokenizer.from_pretrained(steered)
    t = ChatTemplate.from_pretrained(steered)
    system = {"role": "system", "content": "S"}
    first = [system, {"role": "user", "content": "Hello"}]
    second = first + [{"role": "assistant", "content": "世\n世"}, {"role": "user", "content": "Again"}]
    third = [system, {"role": "user", "content": "Again"}]
    assert [x["prompt_tokens"] for x in turns] == [len(tok.encode(t.render(m))) for m in (first, second, third)]
    assert "conversation reset" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("prompt tokens ")
    p = _cli("--model", steered, "-i", "--max-tokens", 2, input="Hi\n")  # streamed text, one line a reply
    assert p.returncode == 0 and p.stdout == "世\n\n", p.stderr


def test_generation_config_defaults_unless_flags_override(steered, capsys, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(steered, d)
    gen_config = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(gen_config, do_sample=True, temperature=0.7,
                                                              top_k=2, max_new_tokens=3)))
    code, out, err = run_main(capsys, "--model", d, "--prompt", "Hello", "--device", "cpu", "--json")
    assert code == 0, err
    assert "generation_config.json: temperature 0.7, top-k 2, max-tokens 3" in err
    assert len(json_lines(out)[0]["token_ids"]) == 3
    code, out, err = run_main(capsys, "--model", d, "--prompt", "Hello", "--device", "cpu", "--json",
                              "--max-tokens", 2, "--temperature", 0)
    assert code == 0 and len(json_lines(out)[0]["token_ids"]) == 2
    assert "generation_config.json" not in err  # greedy: the checkpoint's top-k would do nothing


def test_hub_id(ckpt, capsys, tmp_path, monkeypatch):
    from tests.test_hub import add_snapshot

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_snapshot(cache, "org/tiny", ckpt, "a" * 40, refs=("main", "v1"))
    base = ("--prompt", "Hi", "--max-tokens", 2, "--device", "cpu", "--json")
    code, out, err = run_main(capsys, "--model", "org/tiny", *base)
    assert code == 0, err
    code, out2, err = run_main(capsys, "--model", "org/tiny", "--revision", "v1", "--offline", *base)
    assert code == 0 and json_lines(out2)[0]["token_ids"] == json_lines(out)[0]["token_ids"], err
    for args, message in [(("--model", "org/absent"), "error: --model org/absent: not in the local Hub cache"),
                          (("--model", "org/tiny", "--revision", "v9"), "error: --model org/tiny@v9: not in the"),
                          (("--model", ckpt, "--revision", "v1"), "applies to Hub ids only")]:
        code, out, err = run_main(capsys, *args, *base)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == "", err


def test_prompt_longer_than_the_model_len_cuts_or_fails(ckpt, capsys):
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "The quick brown fox jumps over the lazy dog",
                              "--max-model-len", 4, "--device", "cpu")
    assert code == 2 and "error: a prompt of" in err and "no room for a new token" in err and "--max-model-len" in err
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "Hello", "--max-model-len", 8,
                              "--max-tokens", 50, "--device", "cpu", "--json")
    assert code == 0 and "--max-tokens cut to" in err
    (r,) = json_lines(out)
    assert r["prompt_tokens"] + len(r["token_ids"]) <= 8 and r["finish_reason"] in ("length", "stop")
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "Hello", "--max-model-len", 10**6, "--device", "cpu")
    assert code == 2 and "--max-model-len 1000000 exceeds the model's max_position_embeddings (4096)" in err


@pytest.fixture
def bad_checkpoints(tmp_path, ckpt):
    """Copies of the checkpoint with one file made wrong."""
    def variant(name, **files):
        d = tmp_path / name
        shutil.copytree(ckpt, d)
        for f, text in files.items():
            (d / f.replace("__", ".")).write_text(text)
        return d

    config = json.loads((ckpt / "config.json").read_text())
    gen = json.loads((ckpt / "generation_config.json").read_text())
    return dict(
        llama=variant("llama", config__json=json.dumps(dict(config, model_type="llama"))),
        list_config=variant("list", config__json=json.dumps([config])),
        no_vocab=variant("novocab", config__json=json.dumps({k: v for k, v in config.items() if k != "vocab_size"})),
        str_heads=variant("strheads", config__json=json.dumps(dict(config, num_attention_heads="4"))),
        eos_str=variant("eosstr", generation_config__json=json.dumps(dict(gen, eos_token_id="2"))),
        eos_float=variant("eosfloat", config__json=json.dumps(dict(config, eos_token_id=2.5))),
        eos_list=variant("eoslist", generation_config__json=json.dumps(dict(gen, eos_token_id=[2, None]))),
        eos_vocab=variant("eosvocab", generation_config__json=json.dumps(dict(gen, eos_token_id=[2, config["vocab_size"]]))),
        eos_vocab_config=variant("eosvocabconfig", config__json=json.dumps(dict(config, eos_token_id=10**6))),
        gen_list=variant("genlist", generation_config__json="[1, 2]"),
        gen_temp=variant("gentemp", generation_config__json=json.dumps(dict(gen, do_sample=True, temperature=-1))),
        bad_template=variant("badtemplate", chat_template__jinja="{% for m in messages %}"),
        bad_tokenizer=variant("badtok", tokenizer__json="{not json"),
    )


@pytest.mark.parametrize("args, message", [
    (["--model", "{missing}", "--prompt", "hi"], "no such directory"),
    (["--model", "{file}", "--prompt", "hi"], "is not a directory"),
    (["--model", "{empty}", "--prompt", "hi"], "has no config.json"),
    (["--model", "{llama}", "--prompt", "hi"], "unsupported model_type 'llama'"),
    (["--model", "{garbled}", "--prompt", "hi"], "unreadable config.json"),
    (["--model", "{list_config}", "--prompt", "hi"], "config.json is not a JSON object (it holds a list)"),
    (["--model", "{no_vocab}", "--prompt", "hi"], "vocab_size"),
    (["--model", "{str_heads}", "--prompt", "hi"], "num_attention_heads"),
    (["--model", "{eos_str}", "--prompt", "hi"], "generation_config.json: eos_token_id must be a token id"),
    (["--model", "{eos_float}", "--prompt", "hi"], "config.json: eos_token_id must be a token id"),
    (["--model", "{eos_list}", "--prompt", "hi"], "eos_token_id must be a token id"),
    (["--model", "{eos_vocab}", "--prompt", "hi", "--temperature", "0.5", "--seed", "0"],
     "generation_config.json: eos_token_id 512 lies outside the model's vocabulary [0, 512)"),
    (["--model", "{eos_vocab_config}", "--prompt", "hi"],
     "config.json: eos_token_id 1000000 lies outside the model's vocabulary [0, 512)"),
    (["--model", "{gen_list}", "--prompt", "hi"], "generation_config.json is not a JSON object"),
    (["--model", "{gen_temp}", "--prompt", "hi"], "generation_config.json: temperature must be"),
    (["--model", "{bad_template}", "--prompt", "hi", "--chat"], "chat template (chat_template.jinja) line"),
    (["--model", "{bad_tokenizer}", "--prompt", "hi"], "tokenizer.json"),
    (["--model", "{ckpt}", "--prompt", ""], "the prompt is empty"),
    (["--model", "{ckpt}", "--prompt", "   "], "the prompt is empty"),
    (["--model", "{ckpt}", "--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["--model", "{ckpt}", "--prompt", "hi\ud800"], "--prompt holds a lone surrogate U+D800"),
    (["--model", "{ckpt}", "--prompt", "hi", "--chat", "--system", "\udcff"], "--system is not valid UTF-8"),
    (["--model", "{ckpt}", "--prompt", "hi", "--stop", ""], "--stop needs a non-empty string"),
    (["--model", "{ckpt}"], "give a prompt"),
    (["--model", "{ckpt}", "--prompt", "hi", "--batch-file", "{file}"], "not both"),
    (["--model", "{ckpt}", "--interactive", "--batch-file", "{file}"], "takes no --batch-file"),
    (["--model", "{ckpt}", "--batch-file", "{missing}"], "cannot read --batch-file"),
    (["--model", "{ckpt}", "--batch-file", "{tmp}"], "cannot read --batch-file"),
    (["--model", "{ckpt}", "--batch-file", "{blank}"], "holds no prompt"),
    (["--model", "{ckpt}", "--batch-file", "{latin1}"], "is not valid UTF-8 (byte 0xe9 at offset 3)"),
    (["--model", "{ckpt}", "--prompt", "hi", "--system", "S"], "--system applies to chat prompts"),
    (["--model", "{ckpt}", "--prompt", "hi", "--no-thinking"], "--no-thinking applies to chat prompts"),
    (["--prompt", "hi", "--revision", "main"], "--revision needs --model"),
    (["--model", "{ckpt}", "--prompt", "hi", "--temperature", "-0.5"], "temperature must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--temperature", "nan"], "temperature must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--temperature", "1e300"], "temperature must be a finite number"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-p", "0"], "--top-p must lie in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-p", "1.5"], "--top-p must lie in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-k", "-2"], "--top-k must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-k", "99999999999999999999"], "--top-k must be an integer in [0, 2**63)"),
    (["--model", "{ckpt}", "--prompt", "hi", "--min-p", "1.5"], "--min-p must lie in [0, 1]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--presence-penalty", "3"], "--presence-penalty must lie in [-2, 2]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--frequency-penalty", "nan"], "--frequency-penalty must lie in"),
    (["--model", "{ckpt}", "--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be a finite"),
    (["--model", "{ckpt}", "--prompt", "hi", "--json", "--logprobs", "21"], "--logprobs must be an integer in [0, 20]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--logprobs", "2"], "--logprobs needs --json"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--model", "{ckpt}", "--prompt", "hi", "--seed", "-1"], "--seed must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--seed", str(2**64)], "--seed must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-model-len", str(2**31)], "at most 2147483647"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--model", "{ckpt}", "--prompt", "hi", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--model", "{ckpt}", "--prompt", "hi", "--device", "tpu"], "--device must be cuda, cuda:N or cpu"),
    (["--model", "{ckpt}", "--prompt", "hi", "--device", "cuda:abc"], "--device must be cuda, cuda:N or cpu, got 'cuda:abc'"),
    (["--model", "{ckpt}", "--prompt", "hi", "--device", "cpu:1"], "--device cpu:1: the CPU has no index"),
    (["--model", "{ckpt}", "--prompt", "hi", "--device", "cuda:99"], "--device cuda:99: "),
])
def test_bad_input_exits_2_with_message(args, message, capsys, tmp_path, ckpt, bad_checkpoints):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    (tmp_path / "garbled" / "tokenizer.json").write_text("{}")
    paths = dict(missing=tmp_path / "nope", file=tmp_path / "file.txt", empty=tmp_path / "empty", ckpt=ckpt,
                 blank=tmp_path / "blank.txt", garbled=tmp_path / "garbled", latin1=tmp_path / "latin1.txt",
                 tmp=tmp_path, **bad_checkpoints)
    code, out, err = run_main(capsys, *[a.format(**paths) for a in args], "--device" if "--device" not in args
                              else "--max-num-seqs", "cpu" if "--device" not in args else "1")
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert len([line for line in err.splitlines() if not line.startswith("note:")]) == 1 and out == "", err


def test_a_split_the_heads_do_not_take_exits_2(ckpt, capsys):
    """``--tensor-parallel-size`` the model's heads do not split over: one error line, before any
    worker process starts."""
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "hi", "--device", "cpu", "--tensor-parallel-size", "3")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "error: num_attention_heads 4 does not split over tensor_parallel_size 3" in err


def test_broken_weights_and_argparse_errors(ckpt, capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (broken / f).write_text((ckpt / f).read_text())
    code, _, err = run_main(capsys, "--model", broken, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and "error:" in err and "model.safetensors" in err
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    code, _, err = run_main(capsys, "--model", broken, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and "error:" in err and "weights" in err
    code, _, err = run_main(capsys, "--prompt", "hi", "--dtype", "int8")
    assert code == 2 and "invalid choice" in err
    code, _, err = run_main(capsys, "--prompt", "hi", "--top-k", "1.5")
    assert code == 2 and "invalid int value" in err


def test_cache_larger_than_memory_is_refused(ckpt, capsys, monkeypatch):
    """A cache pool that cannot hold one sequence of --max-model-len positions is refused with the
    sizes (here with 1 MB "free": one 4096-position sequence of this tiny fp32 model takes 2 MiB of
    keys and values), exit status 2; a shorter one fits."""
    import modeling.engine.cache_pool

    monkeypatch.setattr(modeling.engine.cache_pool, "available_memory", lambda device: 10**6)
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "hi", "--max-model-len", 4096, "--device", "cpu",
                              "--max-tokens", 1)
    assert code == 2 and out == "", err
    error = err.strip().splitlines()[-1]
    assert error.startswith("error: the cache does not fit: the cache of one 4096-token sequence needs 2 MiB") and \
        "of the 977 KiB free" in error, error
    monkeypatch.setattr(modeling.engine.cache_pool, "available_memory", lambda device: 10**9)
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "hi", "--max-model-len", 1024, "--max-tokens", 1,
                              "--device", "cpu")
    assert code == 0, err


def test_ascii_stdout(steered, capsys, monkeypatch):
    """An ASCII-only stdout gets '?' for what it cannot encode; --json escapes instead (exact)."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    code = main(["--model", str(steered), "--prompt", "Hello", "--max-tokens", "4", "--device", "cpu"])
    sys.stdout.flush()
    assert code == 0 and raw.getvalue() == b"\n?\n?\n"
    raw.seek(0), raw.truncate()
    code = main(["--model", str(steered), "--prompt", "Hello", "--max-tokens", "2", "--device", "cpu", "--json"])
    sys.stdout.flush()
    assert code == 0 and json.loads(raw.getvalue())["text"] == "\n世" and b"\\u4e16" in raw.getvalue()
    assert "Traceback" not in capsys.readouterr().err


def test_help_names_the_program_and_the_families(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/qwen-generate", "--help"])
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qwen-generate ")
    assert all(family in " ".join(out.split())
               for family in ("Qwen3,", "Qwen2/2.5", "Qwen3.5", "qwen3_moe", "qwen2_moe", "qwen3_5_moe"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "modeling" / "generate.py")])
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m modeling.generate ")


# ----------------------------------------------------------------------------------------------
# subprocesses: the real streams and signals


def _env(env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: the reference ops
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return env


def _cli(*args, env_extra=None, input=None):
    return subprocess.run([sys.executable, "-m", "modeling.generate", *map(str, args)], cwd=ROOT,
                          env=_env(env_extra), capture_output=True, text=True, timeout=300, input=input)


def test_command_line_without_model_uses_the_shipped_model(tmp_path):
    """The README command: no --model, the shipped default model writes Shakespeare-like text: most of
    its words are words of the training text. Nothing is written to the cache dir."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    p = _cli("--prompt", "ROMEO:", "--max-tokens", 48, "--seed", 0, env_extra=env)
    assert p.returncode == 0, p.stderr
    assert "shipped default model" in p.stderr and "no CUDA device" in p.stderr
    assert "PyTorch reference ops" in p.stderr and "Failed to initialize NumPy" not in p.stderr
    assert not (tmp_path / "cache").exists()
    corpus = set(re.findall(r"[a-z']+", (ROOT / "modeling" / "data" / "tinyshakespeare.txt").read_text().lower()))
    words = re.findall(r"[a-z']+", p.stdout.lower())
    assert len(words) >= 10 and sum(w in corpus for w in words) >= 0.8 * len(words), p.stdout
    stats = p.stderr.strip().splitlines()[-1]
    assert "cuda graph: no" in stats and stats.endswith("PyTorch reference ops (CPU), float32")
    p = _cli("--prompt", "Hi", "--max-tokens", 2, "--top-p", "2", env_extra=env)
    assert p.returncode == 2 and p.stderr.startswith("error: --top-p must lie in (0, 1]")
    assert "Traceback" not in p.stderr


def test_readme_ops_snippet_runs():
    """The README's "Use the ops" snippet, as written: on this machine's device (the CPU without CUDA)."""
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"^## Use the ops\n+```python\n(.*?)^```", text, re.S | re.M).group(1)
    scope = {}
    exec(snippet, scope)
    x, w, y = scope["x"], scope["w"], scope["y"]
    assert y.device.type == ("cuda" if torch.cuda.is_available() else "cpu") and y.shape == x.shape
    expected = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), 1e-6)
    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)


def test_closed_stdout(steered):
    p = subprocess.run([sys.executable, "-m", "modeling.generate", "--model", str(steered), "--prompt", "Hello"],
                       cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True, timeout=300,
                       preexec_fn=lambda: os.close(1))
    assert p.returncode == 2 and p.stderr == "error: standard output is closed: there is nowhere to write the " \
                                             "completions\n"


def test_reader_goes_away(steered):
    """`| head -c 10`: the completion stops at the broken pipe, exit status 141, nothing on stderr
    but the notes (no traceback, no 'Exception ignored')."""
    cmd = [sys.executable, "-m", "modeling.generate", "--model", str(steered), "--prompt", "Hello",
           "--max-tokens", "3000", "--device", "cpu"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert first == "\n世\n世\n世".encode()[:10]
    assert all(line.startswith("note:") for line in err.splitlines()), err
    shell = subprocess.run(f"{sys.executable} -m modeling.generate --model '{steered}' --prompt Hello "
                           "--max-tokens 3000 --device cpu | head -c 10; echo \" ${PIPESTATUS[0]}\"",
                           shell=True, executable="/bin/bash", cwd=ROOT, env=_env(), capture_output=True,
                           timeout=300)
    assert shell.stdout.endswith(b" 141\n") and b"Traceback" not in shell.stderr


def test_ascii_encoding_environment(steered):
    p = _cli("--model", steered, "--prompt", "Hello", "--max-tokens", 4, env_extra={"PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and p.stdout == "\n?\n?\n", p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch being loaded")
def test_ctrl_c_while_torch_loads(steered):
    """SIGINT as soon as torch's libraries are being mapped (inside `import torch`): one line
    'interrupted', status 130, no traceback."""
    cmd = [sys.executable, "-m", "modeling.generate", "--model", str(steered), "--prompt", "Hello"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{p.pid}/maps")
    while time.monotonic() < deadline and p.poll() is None:
        try:
            if "libtorch" in maps.read_text() or "torch/_C" in maps.read_text():
                break
        except OSError:
            pass
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
