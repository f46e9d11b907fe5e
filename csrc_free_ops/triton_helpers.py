"""Small pieces shared by the kernels: interpreter detection and the matrix product."""
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton runs kernels through its CPU interpreter (read once at import, as Triton does)."""

TARGET_PROGRAMS = 264
"""Programs that make about two waves on an H200 (132 SMs): the grid size the launchers aim for."""

_DOT_IN_FP32 = tl.constexpr(INTERPRET)


@triton.jit
def dot(a, b, acc):
    """acc + a @ b with fp32 accumulation.

    fp32 operands use exact fp32 products (`ieee`), not tf32, so fp32 models keep
    fp32 accuracy. The Triton interpreter (3.9) returns garbage for a bf16
    `tl.dot`, so under the interpreter the operands are widened to fp32 first.
    """
    if _DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`, visiting output tiles in GROUP_M-row groups so that
    neighbouring programs share operand tiles in L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel over `block` elements."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16
