"""The benchmarks' entry points without a GPU: each one that needs CUDA says so in one line
(exit status 2, no traceback); ``bench.cpu`` measures on the CPU (a tiny shape here)."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = ("cuda_suite", "decode", "fused_decode", "gated_delta_rule", "generate", "host", "loss", "ops",
             "prefill", "train")


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_benchmarks_say_they_need_a_gpu(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py"])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: python -m bench.{name} needs a CUDA GPU") and err.count("\n") == 1, err


def test_cpu_benchmark_runs_a_small_shape(tmp_path):
    """bench.cpu on a 2-layer model, on the path it measures (the reference ops: no TRITON_INTERPRET):
    every row measured, the same logits as transformers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "bench.cpu", "--shape", "small", "--layers", "2", "--context", "8", "--steps", "1",
           "--prompt", "4", "--cache-lens", "16", "32", "--rounds", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "cpu.md").read_text()
    assert "ours: PyTorch reference ops (CPU)" in table
    for row in ("decode, ours, cache of 16", "decode, ours, cache of 32", "decode, transformers (DynamicCache)",
                "prefill, ours", "prefill, transformers"):
        assert f"| {row} |" in table
    diff = float(re.search(r"max \|logit diff\| ([0-9.e+-]+)", table).group(1))
    assert diff < 1e-3, table
