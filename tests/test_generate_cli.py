"""``python -m modeling.generate`` and ``modeling.random_checkpoint``: happy paths on a tiny random
checkpoint, streaming of multi-byte text, the batch file, and every bad-input path (a one-line
``error:`` on stderr, exit status 2, no traceback)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling import QwenForCausalLM, QwenTokenizer
from modeling.generate import main
from modeling.generator import Generator
from modeling.random_checkpoint import build_random_checkpoint, ensure_random_checkpoint, is_complete

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "random-qwen3", seed=1, **TINY)


def run_main(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_random_checkpoint_loads(ckpt):
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = QwenTokenizer.from_pretrained(ckpt)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == tok.vocab_size
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tok.eos_token_ids == (2, 0)
    text = "héllo 世界 🙂 and some unseen wørds"
    assert tok.decode(tok.encode(text)) == text
    assert is_complete(ckpt)
    stamp = (ckpt / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_checkpoint(ckpt) == ckpt
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == stamp  # built once, then reused


def test_streamed_text_equals_decoded_tokens(ckpt, capsys):
    """Greedy on the CPU: stdout is exactly the detokenized completion (streamed piece by piece)."""
    prompt = "Once upon a time, 世界 🙂"
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", prompt, "--max-new-tokens", 12,
                              "--device", "cpu", "--dtype", "fp32")
    assert code == 0, err
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = QwenTokenizer.from_pretrained(ckpt)
    r = Generator(model, max_seq_len=64).generate([tok.encode(prompt)], 12, stop_token_ids=tok.eos_token_ids)
    assert out == tok.decode(r.tokens[0], skip_special_tokens=True) + "\n"
    stats = err.strip().splitlines()[-1]
    assert stats.startswith(f"prompt tokens {len(tok.encode(prompt))} | prefill ")
    assert "ms/token" in stats and "tokens/s" in stats and "cuda graph: no" in stats


def test_batch_file_and_chat(ckpt, capsys, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("The quick brown fox\n\nHello world\nWhat is the capital of France?\n")
    code, out, err = run_main(capsys, "--model", ckpt, "--batch-file", batch, "--max-new-tokens", 5, "--chat",
                              "--temperature", 0.8, "--top-k", 20, "--top-p", 0.9, "--seed", 3, "--device", "cpu")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert sorted(line[:4] for line in lines) == ["[0] ", "[1] ", "[2] "]
    code2, out2, _ = run_main(capsys, "--model", ckpt, "--batch-file", batch, "--max-new-tokens", 5, "--chat",
                              "--temperature", 0.8, "--top-k", 20, "--top-p", 0.9, "--seed", 3, "--device", "cpu")
    assert code2 == 0 and out2 == out  # same seed, same text


def test_prompt_longer_than_cache_lowers_or_fails(ckpt, capsys):
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "The quick brown fox jumps over the lazy dog",
                              "--max-seq-len", 4, "--device", "cpu")
    assert code == 2 and "error: the prompt has" in err and "--max-seq-len" in err
    code, out, err = run_main(capsys, "--model", ckpt, "--prompt", "Hello", "--max-seq-len", 8,
                              "--max-new-tokens", 50, "--device", "cpu")
    assert code == 0 and "--max-new-tokens lowered to" in err


@pytest.fixture
def bad_model_type(tmp_path, ckpt):
    d = tmp_path / "llama"
    d.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    (d / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    return d


@pytest.mark.parametrize("args, message", [
    (["--model", "{missing}", "--prompt", "hi"], "no such directory"),
    (["--model", "{file}", "--prompt", "hi"], "is not a directory"),
    (["--model", "{empty}", "--prompt", "hi"], "has no config.json"),
    (["--model", "{llama}", "--prompt", "hi"], "unsupported model_type 'llama'"),
    (["--model", "{garbled}", "--prompt", "hi"], "unreadable config.json"),
    (["--model", "{ckpt}", "--prompt", ""], "the prompt is empty"),
    (["--model", "{ckpt}", "--prompt", "   "], "the prompt is empty"),
    (["--model", "{ckpt}"], "give a prompt"),
    (["--model", "{ckpt}", "--prompt", "hi", "--batch-file", "{file}"], "not both"),
    (["--model", "{ckpt}", "--batch-file", "{missing}"], "cannot read --batch-file"),
    (["--model", "{ckpt}", "--batch-file", "{blank}"], "holds no prompt"),
    (["--model", "{ckpt}", "--prompt", "hi", "--temperature", "-0.5"], "temperature must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--temperature", "nan"], "temperature must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-p", "0"], "top_p must lie in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-p", "1.5"], "top_p must lie in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", "hi", "--top-k", "-1"], "top_k must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--model", "{ckpt}", "--prompt", "hi", "--seed", "-1"], "seed must be"),
    (["--model", "{ckpt}", "--prompt", "hi", "--max-seq-len", "1"], "--max-seq-len must be >= 2"),
    (["--model", "{ckpt}", "--prompt", "hi", "--device", "tpu"], "--device must be cuda or cpu"),
])
def test_bad_input_exits_2_with_message(args, message, capsys, tmp_path, ckpt, bad_model_type):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    (tmp_path / "garbled" / "tokenizer.json").write_text("{}")
    paths = dict(missing=tmp_path / "nope", file=tmp_path / "file.txt", empty=tmp_path / "empty", ckpt=ckpt,
                 llama=bad_model_type, blank=tmp_path / "blank.txt", garbled=tmp_path / "garbled")
    code, out, err = run_main(capsys, *[a.format(**paths) for a in args])
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_broken_weights_and_argparse_errors(ckpt, capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (broken / f).write_text((ckpt / f).read_text())
    code, _, err = run_main(capsys, "--model", broken, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and "error:" in err and "model.safetensors" in err
    code, _, err = run_main(capsys, "--prompt", "hi", "--dtype", "int8")
    assert code == 2 and "invalid choice" in err
    code, _, err = run_main(capsys, "--prompt", "hi", "--top-k", "1.5")
    assert code == 2 and "invalid int value" in err


def _cli(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: the reference ops
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "modeling.generate", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_command_line_without_model_builds_random_checkpoint(tmp_path):
    """The README command: no --model, a random checkpoint is built into the cache dir once."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    p = _cli("--prompt", "The meaning of life is", "--max-new-tokens", 8, env_extra=env)
    assert p.returncode == 0, p.stderr
    assert "built a random tiny Qwen3 checkpoint" in p.stderr and "no CUDA device" in p.stderr
    assert is_complete(tmp_path / "cache" / "qwen-triton-ops" / "random-qwen3-tiny")
    assert "cuda graph: no" in p.stderr.strip().splitlines()[-1]
    p = _cli("--prompt", "Hi", "--max-new-tokens", 2, "--top-p", "2", env_extra=env)
    assert p.returncode == 2 and p.stderr.startswith("error: top_p must lie in (0, 1]")
    assert "Traceback" not in p.stderr
