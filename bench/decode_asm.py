"""Where the fused decode GEMVs' weight loads land: compiled for sm_90 on any machine, no GPU.

    python -m bench.decode_asm        # one line per kernel shape (needs TRITON_INTERPRET unset)

Each Qwen3-0.6B decode kernel is compiled for Hopper as the launcher would launch it at batch 1 on
an H200 (``fused_decode._launch_shape`` with the H200's tuning tables and 132 SMs:
``csrc_free_ops.devices.assume``) with the launch's specialization
(pointers 16-byte aligned, sizes and strides divisible by 16); the SASS (cuobjdump, shipped with
Triton) is read for the global loads (LDG) issued before the grid-dependency wait (ACQBULK, PTX's
griddepcontrol.wait). A prefetching program must issue its whole weight slice there, 16 bytes a
load: slice bytes / (threads x 16) LDG.E.128 ahead of the wait. Two more take FP8 weights (the
e4m3 tiles and their scales, compiled only where the weights are FP8): the QKV kernel, whose
slices are one scale block deep and prefetch, and gate_up's, whose 256-deep slices take the loop.
tests/test_decode_asm.py runs this.
"""
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from csrc_free_ops import devices, fused_decode

HOPPER = GPUTarget("cuda", 90, 32)


class Shape(NamedTuple):
    name: str
    kernel: str
    constexprs: dict
    weight_bytes: int  # one program's weight slice
    prefetch: bool
    num_warps: int
    num_stages: int


def launched(gpu: torch.device, name: str, op: str, n: int, k: int, fp8: bool = False, **fixed) -> Shape:
    """The kernel the launcher runs on ``gpu`` for a batch-1 call of ``op`` (bf16 activations) on an
    [n, k] weight in bf16 or (``fp8``) FP8 (its ``_launch_shape`` decision: tile, split, prefetch)."""
    silu, qkv = op == "norm_gate_up_silu", op == "norm_qkv_rope_store"
    block_n = fixed["D"] if qkv else None
    itemsize = 1 if fp8 else 2
    bm, _, cfg, k_per_split, split, prefetch = fused_decode._launch_shape(
        op, 1, n, k, gpu, torch.bfloat16, None, block_n, halves=2 if silu else 1, fp8=fp8)
    c = dict(SPLIT_K=split, BLOCK_M=bm, BLOCK_K=cfg.block_k, PREFETCH=prefetch, USE_PDL=True, FP8=fp8, **fixed)
    if not qkv:
        c.update(NORM=op != "linear_residual", HAS_BIAS=False, RESIDUAL=op == "linear_residual", SILU=silu,
                 BLOCK_N=cfg.block_n)
    rows = block_n or cfg.block_n
    return Shape(name, "_qkv_kernel" if qkv else "_gemv_kernel", c,
                 (2 if silu else 1) * rows * k_per_split * itemsize, prefetch, cfg.num_warps, cfg.num_stages)


def shapes(gpu: torch.device) -> list:
    """Qwen3-0.6B's fused decode kernels as launched on ``gpu``, two of them with FP8 weights."""
    return [
        launched(gpu, "norm + qkv + rope + store", "norm_qkv_rope_store", 4096, 1024, HQ=16, HK=8, GATED=False,
                 D=128, ROT=128, HAS_BIAS=False, HAS_QK_NORM=True),
        launched(gpu, "o_proj + residual", "linear_residual", 1024, 2048),
        launched(gpu, "norm + gate_up + silu", "norm_gate_up_silu", 3072, 1024),
        launched(gpu, "down + residual", "linear_residual", 1024, 3072),
        launched(gpu, "norm + lm_head", "norm_linear", 151936, 1024),
        launched(gpu, "FP8 norm + qkv + rope + store", "norm_qkv_rope_store", 4096, 1024, fp8=True, HQ=16, HK=8,
                 GATED=False, D=128, ROT=128, HAS_BIAS=False, HAS_QK_NORM=True),
        launched(gpu, "FP8 norm + gate_up + silu", "norm_gate_up_silu", 3072, 1024, fp8=True),
    ]


PREFETCHED = {"norm + qkv + rope + store", "o_proj + residual", "norm + gate_up + silu", "down + residual",
              "FP8 norm + qkv + rope + store"}
"""The kernels that must prefetch (the lm_head's 2374 tiles stream in waves: the loop serves it)."""
POINTERS = {"_gemv_kernel": {"part_ptr": "*fp32", "ss_ptr": "*fp32", "sem_ptr": "*i32"},
            "_qkv_kernel": {"part_ptr": "*fp32", "ss_ptr": "*fp32", "sem_ptr": "*i32", "pos_ptr": "*i64",
                            "slot_ptr": "*i64"}}
FP8_POINTERS = {"w_ptr": "*fp8e4nv", "sw_ptr": "*fp32"}
"""An FP8 kernel's weight and its scales (a bf16 kernel never reads sw_ptr)."""
FLOATS = ("eps", "offset", "log2_theta")
UNALIGNED = ("M",)  # the row count: not divisible by 16 at decode


def compile_shape(shape: Shape):
    fn = getattr(fused_decode, shape.kernel).fn
    sig = {}
    for n in fn.arg_names:
        if n in shape.constexprs:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            fp8 = FP8_POINTERS if shape.constexprs["FP8"] else {}
            sig[n] = fp8.get(n) or POINTERS[shape.kernel].get(n, "*bf16")
        else:
            sig[n] = "fp32" if n in FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in UNALIGNED}
    return triton.compile(ASTSource(fn, sig, shape.constexprs, attrs=attrs), target=HOPPER,
                          options=dict(num_warps=shape.num_warps, num_stages=shape.num_stages))


def sass_of(compiled) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loads_before_wait(sass: str) -> tuple:
    """(16-byte loads before the first ACQBULK, all 16-byte loads, ACQBULK count)."""
    lines = sass.splitlines()
    waits = [i for i, line in enumerate(lines) if "ACQBULK" in line]
    wide = [i for i, line in enumerate(lines) if re.search(r"\bLDG\.E\.128\b", line)]
    first = waits[0] if waits else len(lines)
    return sum(i < first for i in wide), len(wide), len(waits)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench.decode_asm compiles for the GPU: run it with TRITON_INTERPRET unset")
        return 2
    ok = True
    for shape in shapes(devices.assume(SimpleNamespace(name="NVIDIA H200", multi_processor_count=132))):
        before, wide, waits = loads_before_wait(sass_of(compile_shape(shape)))
        want = shape.weight_bytes // (shape.num_warps * 32 * 16) if shape.prefetch else 0
        good = waits == 1 and (before == want if shape.prefetch else before == 0) and \
            shape.prefetch == (shape.name in PREFETCHED)
        ok &= good
        print(f"{shape.name:30s} {'prefetch' if shape.prefetch else 'loop    '} 16-byte loads before the wait: "
              f"{before:3d} of {wide:3d} (want {want}) {'ok' if good else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
