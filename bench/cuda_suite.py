"""The `cuda` test suite in one device call: its tests cut into pieces file by file and by the
seconds an earlier run recorded (`pieces`, `--times`: by default the newest
bench/results/*-cuda-suite-times.tsv), which several pytest processes per GPU take from one queue,
heaviest first (`run_queue`: a process that finishes early takes the next piece, so a wrong
estimate costs little), while Triton compiles on the host's cores and the GPUs run.

    python -m bench.cuda_suite [--per-gpu N] [--gpus N] [--timeout 540] [-k EXPR] [--marker cuda] [--out DIR]
                               [--times TSV]

Without --per-gpu the processes per GPU come from its free memory and the host's cores
(``processes_per_gpu``): each test process gives its allocator's cache back after every test
(tests/conftest.py), so it holds about ``PROCESS_BYTES`` at most, and the tests that need most of a
GPU take turns on it (``QWEN_GPU_LOCK``, ``tests.helpers.gpu_memory_lock``), one ``HEAVY_BYTES`` at a
time. Four processes on one 80 GB H100 with neither ran out of memory in three such tests at once.

Prints one row per process slot (its GPU, the pieces it ran, their tests passed and failed, its busy
seconds), the totals, each failure's report and the slowest tests, and writes under --out/cuda_suite
three files (a device call returns few): suite.log (every piece's `pytest -v` output, in the order
they ended), failures.txt (each failed test's report, written as it fails: a piece cut at --timeout
keeps them) and times.tsv (every finished test's seconds, from tests/conftest.py's
QWEN_TEST_TIMES). Exit status 1 if a test failed or errored or a piece was cut or never started
within --timeout (their tests are counted as not run).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

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


def pieces(ids: list[str], n: int, seconds: Optional[dict] = None) -> list[list[str]]:
    """`ids` (in collection order) cut into the pieces n processes take from one queue, heaviest
    first: each test weighs its recorded seconds (``seconds``: id -> seconds, from an earlier run's
    times.tsv; the median of them for a test not recorded, 1 each without any). A file's tests
    stay together, so a process compiles a file's kernels once; a file weighing more than
    total / 2n is cut into contiguous pieces of at most that (a test weighing more is a piece
    alone). Each piece keeps collection order."""
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
    runs.sort(key=lambda r: (-sum(weight[j] for j in r), r[0]))
    return [[ids[j] for j in r] for r in runs]


class Ran(NamedTuple):
    """A piece's end: its slot, "exit N" or "cut" (killed at the deadline), its seconds."""
    slot: int
    status: str
    seconds: float


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a piece's process and everything it started (its own process group)."""
    os.killpg(proc.pid, 9)
    proc.wait()


def run_queue(start: Callable[[int, int], subprocess.Popen], count: int, slots: int, timeout: float,
              poll: float = 0.2, stop: Callable[[subprocess.Popen], None] = kill_group) -> list[Optional[Ran]]:
    """Run pieces 0..count-1 in order on `slots` slots at once: ``start(piece, slot)`` starts one;
    a slot that frees takes the next. At `timeout` seconds the running pieces are stopped
    (``stop``: "cut") and the rest never start (None)."""
    ran: list[Optional[Ran]] = [None] * count
    running: dict = {}  # slot -> (piece, process, started)
    deadline, nxt = time.time() + timeout, 0
    while nxt < count or running:
        for slot in range(slots):
            if slot not in running and nxt < count and time.time() < deadline:
                running[slot] = (nxt, start(nxt, slot), time.time())
                nxt += 1
        for slot, (piece, proc, t0) in list(running.items()):
            if proc.poll() is not None:
                ran[piece] = Ran(slot, f"exit {proc.returncode}", time.time() - t0)
            elif time.time() >= deadline:
                stop(proc)
                ran[piece] = Ran(slot, "cut", time.time() - t0)
            else:
                continue
            del running[slot]
        if time.time() >= deadline:
            break
        time.sleep(poll)
    return ran


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
    p.add_argument("--timeout", type=float, default=540.0,
                   help="seconds for the whole run: then running pieces are cut and the rest never start")
    p.add_argument("-k", dest="kexpr", default=None, help="a pytest -k expression")
    p.add_argument("--marker", default="cuda", help="the pytest -m expression (default: cuda)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--times", type=Path, default=latest_times(),
                   help="an earlier run's times.tsv, to weigh the pieces by time (default: the newest "
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
    scratch = Path(tempfile.mkdtemp(prefix="cuda_suite-"))  # id lists, locks, logs, times, failures
    slots = min(len(ids), a.gpus * a.per_gpu)
    queue = pieces(ids, slots, recorded_seconds(a.times))
    (scratch / "failures").touch()

    def start(piece: int, slot: int) -> subprocess.Popen:
        (scratch / f"piece{piece}.ids").write_text("\n".join(queue[piece]) + "\n")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(slot % a.gpus), "PYTHONUNBUFFERED": "1",
               "QWEN_GPU_LOCK": str(scratch / f"gpu{slot % a.gpus}.lock"),
               "QWEN_TEST_TIMES": str(scratch / f"slot{slot}.times"), "QWEN_TEST_FAILURES": str(scratch / "failures"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(scratch / f"piece{piece}.log", "w") as log:
            return subprocess.Popen([sys.executable, "-c", RUN_IDS, str(scratch / f"piece{piece}.ids"), "-v", "-p",
                                     "no:cacheprovider", "-rfE", "--tb=short"], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    print(f"{len(ids)} tests in {len(queue)} pieces, {slots} processes over {a.gpus} GPU(s), pieces weighed by "
          + (f"the seconds in {a.times}" if a.times else "count") + f"; logs under {out}", flush=True)
    t0 = time.time()
    ran = run_queue(start, len(queue), slots, a.timeout)
    total = dict.fromkeys(("PASSED", "FAILED", "SKIPPED", "ERROR", "not run"), 0)
    per_slot = {slot: dict(pieces=0, PASSED=0, FAILED=0, seconds=0.0) for slot in range(slots)}
    bad = False
    with open(out / "suite.log", "w") as suite:
        for piece in sorted((p for p in range(len(queue)) if ran[p]), key=lambda p: ran[p].seconds):
            text = (scratch / f"piece{piece}.log").read_text(errors="replace")
            suite.write(f"===== piece {piece} ({len(queue[piece])} tests), slot {ran[piece].slot}: "
                        f"{ran[piece].status} after {ran[piece].seconds:.0f} s\n{text}\n")
            c = counts(text)
            for k in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
                total[k] += c[k]
            total["not run"] += len(queue[piece]) - sum(c.values()) if ran[piece].status == "cut" else 0
            row = per_slot[ran[piece].slot]
            row["pieces"] += 1
            row["PASSED"] += c["PASSED"]
            row["FAILED"] += c["FAILED"] + c["ERROR"]
            row["seconds"] += ran[piece].seconds
            bad |= ran[piece].status not in ("exit 0", "exit 5") or c["FAILED"] > 0 or c["ERROR"] > 0
    unstarted = [p for p in range(len(queue)) if ran[p] is None]
    total["not run"] += sum(len(queue[p]) for p in unstarted)
    bad |= bool(unstarted)
    print("\n| slot | GPU | pieces | passed | failed | busy s |\n|---|---|---|---|---|---|")
    for slot, row in per_slot.items():
        print(f"| {slot} | {slot % a.gpus} | {row['pieces']} | {row['PASSED']} | {row['FAILED']} | "
              f"{row['seconds']:.0f} |")
    cut = sum(r is not None and r.status == "cut" for r in ran)
    print(f"\n{len(ids)} tests: " + ", ".join(f"{v} {k.lower()}" for k, v in total.items())
          + f"; {cut} pieces cut and {len(unstarted)} never started at the deadline; "
          f"{time.time() - t0:.0f} s of wall time")
    failures = (scratch / "failures").read_text(errors="replace")
    (out / "failures.txt").write_text(failures)
    if failures:
        print("\nFailures (each report's last 25 lines; all of it in failures.txt):")
        for report in re.split(r"^===== ", failures, flags=re.M)[1:]:
            lines = report.splitlines()
            print(f"===== {lines[0]}", *lines[1:][-25:], sep="\n")
    times = out / "times.tsv"
    with open(times, "w") as f:
        for slot in range(slots):
            path = scratch / f"slot{slot}.times"
            for line in path.read_text().splitlines() if path.exists() else []:
                sec, node = line.split("\t", 1)
                f.write(f"{sec}\t{slot}\t{node}\n")
    print("\n| seconds | slot | slowest tests |\n|---|---|---|", *slowest(times), sep="\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
