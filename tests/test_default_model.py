"""The shipped default model (modeling/default_model/): transformers and our decoder agree, its
validation bits per character, recomputed on held-out text, is the one docs/training.md reports,
and `python -m modeling.generate --chat` replies end with EOS by themselves."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling import QwenForCausalLM, QwenTokenizer
from modeling.train import Evaluator, speeches, split_text
from tests.helpers import engine_greedy, hf_greedy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "modeling" / "default_model"
DATA = ROOT / "modeling" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def model():
    return QwenForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def test_files_fit_and_load_in_transformers(model):
    transformers = pytest.importorskip("transformers")
    assert all(f.stat().st_size < 16 << 20 for f in MODEL.iterdir())
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 20 << 20
    hf = transformers.Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tok = QwenTokenizer.from_pretrained(MODEL)
    ids = torch.tensor([tok.encode("ROMEO:\nWhat light")])
    with torch.no_grad():
        expected = hf_greedy(hf, ids, 8)
    assert engine_greedy(model, ids, 8).tolist() == expected.tolist()


def test_validation_bits_per_char_matches_the_docs():
    """The whole validation split is too long for a CPU test: docs/training.md also reports the
    bits/char of its first 12,000 characters (256-token windows), which this recomputes. In
    float64, which runs the PyTorch references (the interpreter would take minutes here)."""
    model = QwenForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
    doc = (ROOT / "docs" / "training.md").read_text()
    reported = float(re.search(r"\*\*(\d\.\d+) bits/char\*\*", doc).group(1))
    reported_slice = float(re.search(r"first 12,000 characters.*?(\d\.\d+) bits/char", doc, re.S).group(1))
    log = json.loads((MODEL / "training_log.json").read_text())
    assert abs(log["best"]["val_bits_per_char"] - reported) < 1e-3
    _, val = split_text(DATA.read_text(encoding="utf-8"), 0.1)
    text = val[:12000]
    ids = torch.tensor(QwenTokenizer.from_pretrained(MODEL).encode(text))
    _, bits = Evaluator(ids, len(text), seq_len=256, batch_size=8)(model)
    assert abs(bits - reported_slice) < 5e-3, bits


def test_chat_replies_end_by_themselves(tmp_path):
    """Four held-out speeches (the user turns of the validation split's dialogue, one line each)
    through the command line's --chat, greedy: each reply ends with EOS (<|im_end|>) by itself,
    well before 200 tokens. A subprocess on the PyTorch references (the interpreter would take
    minutes); docs/training.md has the rate over 50 sampled replies."""
    _, val = split_text(DATA.read_text(encoding="utf-8"), 0.1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(" ".join(s.split()) + "\n" for s in speeches(val)[:8:2]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "modeling.generate", "--model", str(MODEL), "--chat", "--batch-file",
                        str(prompts), "--max-new-tokens", "200", "--temperature", "0", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    replies = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(replies) == 4
    for r in replies:
        assert r["finish_reason"] == "stop" and r["stop_reason"] is None and r["text"].strip(), r
        assert len(r["token_ids"]) < 100, r
