"""The fused decode GEMVs compiled for Hopper (no GPU needed; with FP8 weights too): every
prefetching program issues its whole weight slice, in 16-byte loads, before the grid-dependency
wait (bench/decode_asm.py)."""
import os
import subprocess
import sys

from bench.decode_asm import PREFETCHED


def test_weights_are_loaded_before_the_dependency_wait():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-m", "bench.decode_asm"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in out.stdout.splitlines() if "loads before the wait" in line]  # 5 bf16, 2 FP8
    assert out.returncode == 0 and len(lines) == 7 and all(line.endswith(" ok") for line in lines), \
        out.stdout + out.stderr
    assert sum(" prefetch " in line for line in lines) == len(PREFETCHED)
