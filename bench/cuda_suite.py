"""The `cuda` test suite in one device call: its tests dealt into groups file by file and by the
seconds an earlier run recorded (`deal`, `--times`: by default the newest
bench/results/*-cuda-suite-times.tsv), several pytest processes per GPU at once (Triton compiles
on the host's cores while the GPUs run).

    python -m bench.cuda_suite [--per-gpu N] [--gpus N] [--timeout 540] [-k EXPR] [--marker cuda] [--out DIR]
                               [--times TSV]

Without --per-gpu the processes per GPU come from its free memory and the host's cores
(``processes_per_gpu``): each test process gives its allocator's cache back after every test
(tests/conftest.py), so it holds about ``PROCESS_BYTES`` at most, and the tests that need most of a
GPU take turns on it (``QWEN_GPU_LOCK``, ``tests.helpers.gpu_memory_lock``), one ``HEAVY_BYTES`` at a
time. Four processes on one 80 GB H100 with neither ran out of memory in three such tests at once.

Prints one row per group (its GPU, pytest's summary line, time), the failures and the slowest
tests, and writes each group's `pytest -v` log and every finished test's seconds (``times.tsv``,
from tests/conftest.py's QWEN_TEST_TIMES) under --out/cuda_suite. Exit status 1 if a test failed or errored or a group ran past
--timeout (the tests it had not reached are then counted as not run). On two GPUs, eight
groups run the whole suite within one device call, where one process needed several.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench import require_cuda

ROOT = Path(__file__).resolve().parents[1]
RUN_IDS = "import sys, pytest; sys.exit(pytest.main(open(sys.argv[1]).read().splitlines() + sys.argv[2:]))"
GIB = 1 << 30
PROCESS_BYTES = 6 * GIB
"""GPU memory one test process may hold at once: its CUDA context and one ordinary test's tensors
(the largest unlocked ones compare a full-size fp32 model with transformers': two copies of
Qwen3.5-0.8B's 3.4 GB of weights)."""
HEAVY_BYTES = 32 * GIB
"""GPU memory of the largest test (a training step's ops compiled at Qwen3-0.6B shapes, in a
subprocess); such tests run one at a time on a GPU."""
CORES_PER_PROCESS = 2
"""Host cores per test process (Triton and Inductor compile on the host)."""
FREE_MEMORY = ("import sys, torch; print(*(torch.cuda.mem_get_info(i)[0] for i in range(int(sys.argv[1])))"
               " if torch.cuda.is_available() else '')")
"""Prints each GPU's free bytes, nothing without CUDA (in a process of its own: this one keeps no
CUDA context)."""


def processes_per_gpu(free_bytes: Optional[int], cores: int) -> int:
    """Test processes for one GPU with ``free_bytes`` free (None: no GPU, the cores alone decide)
    and ``cores`` host cores of its own: one running a heavy test (``HEAVY_BYTES``) beside others of
    ``PROCESS_BYTES`` each, as many as the memory and ``CORES_PER_PROCESS`` allow, at least one."""
    by_cores = cores // CORES_PER_PROCESS
    by_memory = by_cores if free_bytes is None else 1 + max(0, free_bytes - HEAVY_BYTES) // PROCESS_BYTES
    return max(1, min(by_memory, by_cores))


def collect(marker: str, kexpr: str | None) -> list[str]:
    """The node ids pytest selects with `-m marker` (and `-k kexpr`)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, "tests"]
    out = subprocess.run(cmd + (["-k", kexpr] if kexpr else []), cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode not in (0, 5):  # 5: nothing collected
        sys.exit(f"collection failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def deal(ids: list[str], n: int, seconds: Optional[dict] = None) -> list[list[str]]:
    """`ids` (in collection order) into n groups of about equal time: each test weighs its recorded
    seconds (``seconds``: id -> seconds, from an earlier run's times.tsv; the median of them for a
    test not recorded, 1 each without any). A file's tests stay together, so a process compiles a
    file's kernels once (dealt round-robin, every process compiled nearly every kernel, all at the
    same time); a file weighing more than total / 2n is cut into contiguous pieces of at most that
    (a test weighing more is a piece alone). Pieces go heaviest first to the lightest group; each
    group keeps collection order."""
    known = sorted((seconds or {}).values())
    default = known[len(known) // 2] if known else 1.0
    weight = [(seconds or {}).get(node, default) for node in ids]
    limit = sum(weight) / (2 * n)
    runs: list[list[int]] = []
    for i, node in enumerate(ids):
        if (runs and node.split("::")[0] == ids[runs[-1][0]].split("::")[0]
                and sum(weight[j] for j in runs[-1]) + weight[i] <= limit):
            runs[-1].append(i)
        else:
            runs.append([i])
    groups: list[list[int]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for run in sorted(runs, key=lambda r: (-sum(weight[j] for j in r), r[0])):
        g = min(range(n), key=lambda k: (loads[k], len(groups[k])))
        groups[g].extend(run)
        loads[g] += sum(weight[j] for j in run)
    return [[ids[i] for i in sorted(g)] for g in groups]


def recorded_seconds(path: Optional[Path]) -> dict:
    """test id -> seconds of a ``times.tsv`` (seconds, group, test id); {} without a file."""
    if path is None or not path.exists():
        return {}
    rows = (line.split("\t") for line in path.read_text().splitlines() if line.count("\t") == 2)
    return {node: float(sec) for sec, _, node in rows}


def latest_times() -> Optional[Path]:
    """The newest committed times of a whole-suite run (bench/results/*-cuda-suite-times.tsv)."""
    found = sorted((ROOT / "bench" / "results").glob("*-cuda-suite-times.tsv"))
    return found[-1] if found else None


def slowest(times: Path, k: int = 15) -> list[str]:
    """The k slowest lines of a ``times.tsv`` (seconds, group, test id), as table rows."""
    rows = [line.split("\t") for line in times.read_text().splitlines() if line.count("\t") == 2]
    rows.sort(key=lambda r: -float(r[0]))
    return [f"| {float(sec):.1f} | {group} | {node} |" for sec, group, node in rows[:k]]


def counts(log: str) -> dict:
    """PASSED / FAILED / SKIPPED / ERROR lines of a `pytest -v` log."""
    return {k: len(re.findall(rf" {k}( |$)", log, re.M)) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}


def main():
    p = argparse.ArgumentParser(prog="python -m bench.cuda_suite", description=__doc__.splitlines()[0])
    p.add_argument("--per-gpu", type=int, default=None,
                   help="pytest processes per GPU at once (default: from the GPUs' free memory and the cores)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run")
    p.add_argument("-k", dest="kexpr", default=None, help="a pytest -k expression")
    p.add_argument("--marker", default="cuda", help="the pytest -m expression (default: cuda)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--times", type=Path, default=latest_times(),
                   help="an earlier run's times.tsv, to deal the tests by time (default: the newest "
                        "bench/results/*-cuda-suite-times.tsv)")
    a = p.parse_args()
    if a.gpus is None:
        import torch

        require_cuda("bench.cuda_suite", "--gpus N runs the selected tests without one")
        a.gpus = torch.cuda.device_count()
    if a.per_gpu is None and a.gpus >= 1:
        free = [int(b) for b in subprocess.run([sys.executable, "-c", FREE_MEMORY, str(a.gpus)], capture_output=True,
                                               text=True, check=True).stdout.split()]
        a.per_gpu = processes_per_gpu(min(free, default=None), (os.cpu_count() or 1) // a.gpus)
        print(f"{a.per_gpu} processes per GPU" + (f" ({min(free) / GIB:.1f} GiB free on the fullest GPU)" if free
                                                   else " (no CUDA: by the cores)"), flush=True)
    if a.gpus < 1 or a.per_gpu < 1:
        sys.exit("no GPU to run on (--gpus and --per-gpu must be at least 1)")
    ids = collect(a.marker, a.kexpr)
    if not ids:
        sys.exit(f"no tests selected by -m {a.marker!r}" + (f" -k {a.kexpr!r}" if a.kexpr else ""))
    out = Path(a.out) / "cuda_suite"
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cuda_suite-"))  # id lists, locks, per-process times
    n = min(len(ids), a.gpus * a.per_gpu)
    groups = deal(ids, n, recorded_seconds(a.times))
    procs, t0 = [], time.time()
    for g in range(n):
        (scratch / f"group{g}.ids").write_text("\n".join(groups[g]) + "\n")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(g % a.gpus), "PYTHONUNBUFFERED": "1",
               "QWEN_GPU_LOCK": str(scratch / f"gpu{g % a.gpus}.lock"),
               "QWEN_TEST_TIMES": str(scratch / f"group{g}.times"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        log = open(out / f"group{g}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-c", RUN_IDS, str(scratch / f"group{g}.ids"), "-v", "-p",
                                        "no:cacheprovider", "-rfE", "--tb=short"], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log, time.time()))
    print(f"{len(ids)} tests in {n} groups over {a.gpus} GPU(s), dealt by "
          + (f"the seconds in {a.times}" if a.times else "count") + f"; logs under {out}", flush=True)
    rows, total, bad = [], dict.fromkeys(("PASSED", "FAILED", "SKIPPED", "ERROR", "not run"), 0), False
    for g, (proc, log, started) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
            status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = "TIMEOUT"
        log.close()
        text = (out / f"group{g}.log").read_text(errors="replace")
        c = counts(text)
        c["not run"] = max(0, len(groups[g]) - sum(c.values())) if status == "TIMEOUT" else 0
        for k in total:
            total[k] += c[k]
        bad |= status == "TIMEOUT" or c["FAILED"] > 0 or c["ERROR"] > 0 or proc.returncode not in (0, 5)
        summary = (f"cut: {c['PASSED']} passed, {c['FAILED']} failed, {c['not run']} not run" if status == "TIMEOUT" else
                   next((ln.strip("= ") for ln in reversed(text.splitlines()) if re.search(r" in [0-9.]+s", ln)), status))
        rows.append(f"| {g} | {g % a.gpus} | {summary} | {status} |")
    print("\n| group | GPU | result | status |\n|---|---|---|---|", *rows, sep="\n")
    print(f"\n{len(ids)} tests: " + ", ".join(f"{v} {k.lower()}" for k, v in total.items())
          + f"; {time.time() - t0:.0f} s of wall time")
    for g in range(n):
        for line in (out / f"group{g}.log").read_text(errors="replace").splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                print(line)
    times = out / "times.tsv"
    with open(times, "w") as f:
        for g in range(n):
            path = scratch / f"group{g}.times"
            for line in path.read_text().splitlines() if path.exists() else []:
                sec, node = line.split("\t", 1)
                f.write(f"{sec}\t{g}\t{node}\n")
    print("\n| seconds | group | slowest tests |\n|---|---|---|", *slowest(times), sep="\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
