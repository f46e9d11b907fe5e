"""qwen_ops.plans: a replayed call starts exactly the launches its launcher would start, and a call
of another shape, strides or aliasing never replays a plan recorded for another (CPU, in a
subprocess with the C launch stubbed); signatures tell apart everything launches depend on; what
cannot be replayed exactly gets no plan; the table is bounded; on a GPU replayed calls match the
references."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import (add_rms_norm_reference, kv_cache_store_slots_reference, linear_reference,
                      paged_attention_reference, rms_norm_reference, rope_reference, silu_mul_reference)
from qwen_ops import plans
from qwen_ops.registry import plan_tables
from tests.helpers import assert_close, randn

# CPU tensors stand in for CUDA ones: the CUDA queries are patched and each kernel's compiled launch
# is a stub that logs its arguments. Without TRITON_INTERPRET, as on a GPU, so the launches take
# launch.py's cached path, which plans record.
SCRIPT = r'''
import torch
torch._C._cuda_getDevice = lambda: -1
torch._C._cuda_getCurrentRawStream = lambda device: 0
from csrc_free_ops import launch

LOG = []


def stub_compile(self, key, grid, args, meta):
    specialization = f"{self.fn.__name__} #{len(self.compiled)}"  # one compiled kernel per launch key

    def run(gx, gy, gz, stream, function, metadata, *rest):
        LOG.append((specialization, (gx, gy, gz), rest[3:]))
    self.compiled[key] = (run, None, None, tuple(meta[n] for n in self.names[len(args):]), None)


launch.Kernel._launch_through_triton = stub_compile
import qwen_ops  # noqa: E402,F401
from qwen_ops import registry  # noqa: E402

bf = torch.bfloat16


def r(*shape, dtype=bf):
    return torch.randn(*shape).to(dtype)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


CASES = {  # op -> (make fresh arguments of one signature, whether a plan must be made)
    "rms_norm": (lambda: (r(3, 96), r(96), 1e-6, 0.0), True),
    # x 2 bytes past a 16-byte boundary: another signature, and another compiled kernel
    "rms_norm, misaligned x": (lambda: (r(3 * 96 + 1)[1:].view(3, 96), r(96), 1e-6, 0.0), True),
    "add_rms_norm": (lambda: (r(1, 96), r(1, 96), r(96), 1e-6, 1.0), True),
    "linear": (lambda: (r(1, 256), r(320, 256), r(320)), True),
    "silu_mul": (lambda: (r(2, 1, 128),), True),
    "rope": (lambda: (r(1, 2, 4, 32), r(1, 2, 2, 32), torch.tensor([[5, 6]]), 1e6, 32, r(32), r(32), 1e-6, 0.0),
             True),
    "kv_cache_store_slots": (lambda: (r(1, 2, 32), r(1, 2, 32), r(4, 16, 2, 32), r(4, 16, 2, 32), torch.tensor([9])),
                             True),
    # two decode rows over paged caches of 6 blocks of 16, tables reaching 80 positions: two KV
    # splits, then the combine
    "paged_attention": (lambda: (r(2, 4, 32), r(6, 16, 2, 32), r(6, 16, 2, 32), i32(0, 1, 2), i32(7, 70),
                                 torch.tensor([[2, 0, 0, 0, 0], [3, 1, 5, 4, 0]], dtype=torch.int32), 0.2, 1),
                        True),
    "rms_norm_backward": (lambda: (r(3, 96), r(3, 96), r(96), 1e-6, 0.0, None), True),
    # positions expanded over the batch: the launcher copies them to one stride (an aten copy), so no plan
    "rope, expanded positions": (lambda: (r(2, 1, 4, 32), r(2, 1, 2, 32), torch.tensor([[5]]).expand(2, 1), 1e6, 32,
                                          None, None, 1e-6, 0.0), False),
    # no queries: the launcher zeroes dK and dV with aten ops and launches nothing, so no plan
    "attention_backward, no queries": (lambda: (r(1, 0, 4, 32), r(1, 0, 4, 32), r(1, 8, 2, 32), r(1, 8, 2, 32),
                                                r(1, 0, 4, 32), None, 0.2, False, None), False),
}


def normalized(log, args, out):
    """The logged launches with each tensor replaced by the input or output it is (by address)."""
    names = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            names.setdefault(a.data_ptr(), f"input {i}")
    for j, t in enumerate(out if isinstance(out, tuple) else (out,)):
        if isinstance(t, torch.Tensor):
            names.setdefault(t.data_ptr(), f"output {j}")
    rows = []
    for name, grid, kernel_args in log:
        rows.append((name, grid, tuple(names.setdefault(a.data_ptr(), f"scratch {len(names)}")
                                       if isinstance(a, torch.Tensor) else a for a in kernel_args)))
    return rows


for case, (make, planned) in CASES.items():
    op = case.split(",")[0]
    on_cuda = registry._impls[op]["CUDA"]
    for _ in range(2):  # the first call compiles (here: installs the stub), the second records
        on_cuda(*make())
    args = make()
    key = on_cuda.__closure__[on_cuda.__code__.co_freevars.index("key")].cell_contents
    entry = registry.plan_tables[op][key(*args)]
    assert callable(entry) == planned, (case, entry)
    LOG.clear()
    replayed = normalized(LOG, args, on_cuda(*args))
    launcher = on_cuda.__closure__[on_cuda.__code__.co_freevars.index("kernel")].cell_contents
    LOG.clear()
    direct = normalized(LOG, args, launcher(*args))
    assert replayed == direct and (replayed or not planned), (case, replayed, direct)
    print(case, "ok", len(direct), "launches")

# A call after another call's plan was recorded: its own launches, never a replay of the other's.
ALIASED = r(1, 96)
AFTER = {  # case -> (op, the recorded call's arguments, the later call's)
    "rms_norm, 64 rows after 4": ("rms_norm", lambda: (r(4, 96), r(96), 1e-6, 0.0),
                                  lambda: (r(64, 96), r(96), 1e-6, 0.0)),
    "rms_norm, strided rows after contiguous": ("rms_norm", lambda: (r(3, 96), r(96), 1e-6, 0.0),
                                                lambda: (r(3, 192)[:, :96], r(96), 1e-6, 0.0)),
    # one tensor as x and residual: a plan could not tell the two apart, so none may be made
    "add_rms_norm, x and residual apart after one tensor as both": (
        "add_rms_norm", lambda: (ALIASED, ALIASED, r(96), 1e-6, 1.0), lambda: (r(1, 96), r(1, 96), r(96), 1e-6, 1.0)),
}
for case, (op, recorded, later) in AFTER.items():
    on_cuda = registry._impls[op]["CUDA"]
    launcher = on_cuda.__closure__[on_cuda.__code__.co_freevars.index("kernel")].cell_contents
    registry.plan_tables[op].clear()
    launcher(*later())  # the later call's kernels compiled (here: stubbed), its signature not recorded
    for _ in range(2):
        on_cuda(*recorded())
    args = later()
    LOG.clear()
    out = on_cuda(*args)
    got = [t.shape for t in (out if isinstance(out, tuple) else (out,))], normalized(LOG, args, out)
    LOG.clear()
    direct_out = launcher(*args)
    want = [t.shape for t in (direct_out if isinstance(direct_out, tuple) else (direct_out,))]
    want = want, normalized(LOG, args, direct_out)
    assert got == want, (case, got, want)
    print(case, "ok", len(want[1]), "launches")
'''


def test_replayed_launches_are_the_launchers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=Path(__file__).resolve().parents[1], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(" ok ") == 14, result.stdout


def test_record_keeps_only_what_a_replay_reproduces(monkeypatch):
    """Launchers without kernels, recorded directly: allocating the output is replayable; computing
    it with an aten op, returning a view of an allocation or returning an input is not."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    x = torch.randn(4, 8)
    _, replay = plans.record(lambda x: torch.empty_like(x), (x,))
    assert callable(replay)
    y = replay(torch.randn(4, 8))
    assert y.shape == (4, 8) and y.stride() == (8, 1) and y.dtype == x.dtype
    for launcher in (lambda x: torch.empty_like(x).zero_(), lambda x: torch.empty(8, 4).t(), lambda x: x,
                     lambda x: x.clone()):
        out, replay = plans.record(launcher, (x,))
        assert replay is False, out


class _OnDevice:
    """A CPU tensor as the signature sees it, but reporting CUDA device `index`."""

    def __init__(self, t, index):
        self.t, self.index, self.shape, self.dtype = t, index, t.shape, t.dtype

    def stride(self):
        return self.t.stride()

    def data_ptr(self):
        return self.t.data_ptr()

    def get_device(self):
        return self.index


def test_signature_tells_apart_what_launches_depend_on(monkeypatch):
    """rms_norm's signature changes with each input's shape, strides, dtype, alignment and device,
    a scalar's value and the current device: a call differing in any of them never replays the
    plan of another (a 64-row call replaying a 4-row plan would return 4 rows)."""
    current = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    key = plans.key_function(torch.ops.qwen.rms_norm.default._schema)
    x, w = torch.randn(4, 96), torch.randn(96)
    base = key(x, w, 1e-6, 0.0)
    assert key(torch.randn(4, 96), torch.randn(96), 1e-6, 0.0) == base
    others = {
        "rows": key(torch.randn(64, 96), w, 1e-6, 0.0),
        "strides": key(torch.randn(4, 192)[:, :96], w, 1e-6, 0.0),
        "dtype": key(x.half(), w, 1e-6, 0.0),
        "alignment": key(torch.randn(4 * 96 + 1)[1:].view(4, 96), w, 1e-6, 0.0),
        "an input's device": key(_OnDevice(x, 1), w, 1e-6, 0.0),
        "eps": key(x, w, 1e-5, 0.0),
    }
    current[0] = 1
    others["the current device"] = key(x, w, 1e-6, 0.0)
    for what, other in others.items():
        assert other != base, f"the signature ignores {what}"


def test_record_refuses_two_allocations_at_one_address(monkeypatch):
    """A launcher whose scratch is freed and whose next allocation reuses the block (as CUDA's caching
    allocator does): by address the two are one, and a replay would hand the first kernel the second,
    smaller buffer, so no plan is made. Here a dispatch mode serves both from one block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from csrc_free_ops import launch

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    block = torch.empty(64)

    class OneBlock(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.empty.memory_format:
                return block[:args[0][0]]
            return func(*args, **(kwargs or {}))

    def launcher(x):
        for size in (64, 8):  # a scratch launched on, then the output
            t = torch.empty(size)
            launch._state.recording.append(((lambda *a: None, None, None, (), None), (1,), (t,)))
        return t

    with OneBlock():
        out, replay = plans.record(launcher, (torch.randn(2),))
    assert out.data_ptr() == block.data_ptr() and replay is False


def test_plan_table_keeps_at_most_512_signatures(monkeypatch):
    """Eager prefill brings a new signature per prompt length: the table starts over when full."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    table, x = plans.PlanTable(), torch.randn(2)
    for signature in range(513):
        table.record(signature, lambda x: torch.empty_like(x), (x,))
        assert len(table) <= 512
    assert list(table) == [512]


def test_plan_table_gives_up_on_recordings_cut_short():
    """A signature whose recordings keep launching through Triton is retried twice, then kept as
    unplannable, so its calls stop paying for a recording; clearing the table forgets the tries."""
    from csrc_free_ops import launch

    def through_triton(x):
        launch._state.recording.append(None)  # what a launch that is not cached records
        return torch.empty_like(x)

    table, x = plans.PlanTable(), torch.randn(2)
    for _ in range(3):
        assert "signature" not in table
        table.record("signature", through_triton, (x,))
    assert table["signature"] is False
    table.clear()
    assert not table and not table.attempts


@pytest.mark.cuda
def test_replayed_calls_match_the_references():
    """Three calls per op with fresh inputs of one signature: the first compiles, the second records
    a plan, the third replays it; each matches the reference."""
    dev, bf = "cuda", torch.bfloat16
    ops = torch.ops.qwen
    for _ in range(3):
        x, r, w = randn(1, 1024, dtype=bf, device=dev), randn(1, 1024, dtype=bf, device=dev), randn(1024, dtype=bf,
                                                                                                       device=dev)
        assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), what="rms_norm")
        for got, want in zip(ops.add_rms_norm(x, r, w, 1e-6), add_rms_norm_reference(x, r, w, 1e-6)):
            assert_close(got, want, what="add_rms_norm")
        wq = randn(4096, 1024, dtype=bf, device=dev, scale=1024 ** -0.5)
        assert_close(ops.linear(x, wq), linear_reference(x, wq), what="linear M=1")
        gu = randn(1, 6144, dtype=bf, device=dev)
        assert_close(ops.silu_mul(gu), silu_mul_reference(gu), what="silu_mul")
        qkv = randn(1, 1, 4096, dtype=bf, device=dev)
        q, k = qkv[..., :2048].view(1, 1, 16, 128), qkv[..., 2048:3072].view(1, 1, 8, 128)
        v = qkv[..., 3072:].view(1, 1, 8, 128)
        qn, kn = randn(128, dtype=bf, device=dev), randn(128, dtype=bf, device=dev)
        pos = torch.randint(0, 300, (1, 1), device=dev)
        for got, want in zip(ops.rope(q, k, pos, 1e6, 128, qn, kn), rope_reference(q, k, pos, 1e6, 128, qn, kn)):
            assert_close(got, want, what="rope")
        caches = [randn(19, 16, 8, 128, dtype=bf, device=dev) for _ in range(2)]  # paged: 19 blocks of 16
        table = torch.randperm(19, device=dev).to(torch.int32)[None]
        slots = table[0, pos[0] // 16] * 16 + pos[0] % 16
        expected = [c.clone() for c in caches]
        ops.kv_cache_store_slots(k[0], v[0], *caches, slots)
        kv_cache_store_slots_reference(k[0], v[0], *expected, slots)
        for got, want in zip(caches, expected):
            assert torch.equal(got, want), "kv_cache_store_slots"
        cu, lens = torch.tensor([0, 1], dtype=torch.int32, device=dev), pos[0].to(torch.int32) + 1
        assert_close(ops.paged_attention(q[0], *caches, cu, lens, table, 128 ** -0.5, 1),
                     paged_attention_reference(q[0], *caches, cu, lens, table, 128 ** -0.5, 1), what="paged_attention")
    for op in ("rms_norm", "add_rms_norm", "linear", "silu_mul", "rope", "kv_cache_store_slots", "paged_attention"):
        assert any(map(callable, plan_tables[op].values())), f"{op}: no plan was made"
