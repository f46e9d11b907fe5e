"""csrc_free_ops.private_apis: the version rule that turns the private Triton and PyTorch paths on,
and the public paths they fall back to, run for real: a process with QWEN_PRIVATE_APIS=0 launches
its kernels through Triton and differentiates through torch.library.register_autograd, with the
private process's results."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton

from csrc_free_ops import launch, private_apis

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, tested, forced, expected", [
    ("3.9.0", ((3, 5), (3, 9)), None, True),
    ("3.5.1", ((3, 5), (3, 9)), None, True),
    ("3.4.0", ((3, 5), (3, 9)), None, False),
    ("3.10.0", ((3, 5), (3, 9)), None, False),
    ("4.0", ((3, 5), (3, 9)), None, False),
    ("2.13.0+cpu", ((2, 9), (2, 13)), None, True),
    ("2.14.0.dev20270101+cu130", ((2, 9), (2, 13)), None, False),
    ("3.9.0", ((3, 5), (3, 9)), "0", False),
    ("3.10.0", ((3, 5), (3, 9)), "1", True),
    ("3.10.0", ((3, 5), (3, 9)), "yes", False),
])
def test_the_private_paths_are_taken_on_tested_versions_or_when_forced(version, tested, forced, expected):
    assert private_apis.usable(version, tested, forced) is expected


def test_major_minor():
    assert private_apis.major_minor("2.13.0+cpu") == (2, 13)
    assert private_apis.major_minor("3") == (3, 0)


def test_a_compiled_kernel_without_the_c_launcher_is_launched_through_triton(monkeypatch):
    monkeypatch.setattr(private_apis, "TRITON", True)
    full = SimpleNamespace(run=1, function=2, packed_metadata=3)
    assert private_apis.compiled_launcher(full) == (1, 2, 3)
    assert private_apis.compiled_launcher(SimpleNamespace(run=1, function=2)) is None
    monkeypatch.setattr(private_apis, "TRITON", False)
    assert private_apis.compiled_launcher(full) is None


def test_without_the_private_triton_path_every_launch_goes_through_triton(monkeypatch):
    assert not launch._through_triton()
    monkeypatch.setattr(private_apis, "TRITON", False)
    assert launch._through_triton()


def test_the_scratch_allocator_is_set_unless_one_is(monkeypatch):
    """Private path: left alone where an allocator is set; public path: always set."""
    calls = []
    monkeypatch.setattr(triton, "set_allocator", calls.append)
    if private_apis.TRITON:
        from triton.runtime import _allocation
        token = _allocation._allocator.set(lambda size, alignment, stream: None)
        try:
            private_apis.set_allocator_unless_set("ours")
        finally:
            _allocation._allocator.reset(token)
        assert calls == []
        private_apis.set_allocator_unless_set("ours")
        assert calls == ["ours"]
        calls.clear()
    monkeypatch.setattr(private_apis, "TRITON", False)
    private_apis.set_allocator_unless_set("ours")
    assert calls == ["ours"]


SCRIPT = r'''
import torch
import qwen_ops
from csrc_free_ops import private_apis
from qwen_ops import registry

torch.manual_seed(0)
x = torch.randn(5, 48, requires_grad=True)
w = torch.randn(48, requires_grad=True)
y = torch.ops.qwen.rms_norm(x, w, 1e-6)
(y * torch.arange(48.0)).sum().backward()
print("PRIVATE", private_apis.TRITON, private_apis.TORCH, hasattr(registry, "PLAIN_KEYSETS"))
print("KERNEL", registry.kernel_calls["rms_norm"] > 0, registry.kernel_calls["rms_norm_backward"] > 0)
torch.save((y.detach(), x.grad, w.grad), OUT)
'''


def _run(tmp_path, name, **env_extra):
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **env_extra)
    p = subprocess.run([sys.executable, "-c", f"OUT = {str(out)!r}\n" + SCRIPT], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, out


def test_public_paths_give_the_private_paths_results(tmp_path):
    """QWEN_PRIVATE_APIS=0: both flags off, no lean autograd kernel, the kernels still run (forward
    and backward) and give what the private paths give."""
    import torch

    public, public_out = _run(tmp_path, "public", QWEN_PRIVATE_APIS="0")
    private, private_out = _run(tmp_path, "private", QWEN_PRIVATE_APIS="1")
    assert "PRIVATE False False False" in public, public
    assert "PRIVATE True True True" in private, private
    assert "KERNEL True True" in public and "KERNEL True True" in private
    for a, b in zip(torch.load(public_out), torch.load(private_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
