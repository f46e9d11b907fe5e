"""The benchmarks' entry points without a GPU: each one that needs CUDA says so in one line
(exit status 2, no traceback); ``bench.cpu`` measures on the CPU (a tiny shape here)."""

import importlib
import sys

import pytest
import torch

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
