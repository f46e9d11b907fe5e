"""The runtime through ``LLM`` beside a baseline tree's, in one run: decode, time to first token,
offline throughput.

    python -m bench.runtime --baseline DIR [--out DIR] [--reps 5] [--tokens 64] [--models ...]  # on the GPU
    python -m bench.runtime --cpu --baseline DIR [--reps 3]                          # on the CPU

Each tree (this checkout, and ``--baseline``: another checkout of the project, e.g. an earlier
commit's files) runs in processes of its own with its packages first on ``PYTHONPATH``, through
what the two share: ``LLM(path).generate`` on ``{"prompt_token_ids": [...]}`` prompts with
``SamplingParams(max_tokens=n, ignore_eos=True)``, and its own ``python -m bench.throughput``.

On the GPU (bf16; random checkpoints written once by this tree under ``--checkpoints``, with a
word-level tokenizer so any ids decode and no EOS exists):

- ``*_b1_ms_per_token``: Qwen3-0.6B, one 256-token prompt: (t(N + 1) - t(1)) / N, t(n) the wall
  time of a ``generate`` call of n new tokens (N = ``--tokens``): the decode steps alone, the
  prefill cancelled out; ``*_qwen3_5_b1_ms_per_token`` the same for Qwen3.5-0.8B;
- ``*_ttft_ms_256``: t(1) for that prompt: the whole call to its first token, ``LLM``'s host work
  included;
- ``*_b8_ms_per_step``: eight 256-token prompts in one call, (t(N + 1) - t(1)) / N;
- from each tree's ``bench.throughput --no-peer``: ``*_throughput_tokens_per_s``,
  ``*_prefix_hit_ttft_ratio``, ``*_qwen3_5_ttft_ms_8x256``.

Each number is the median of ``--reps`` measurements after a warm-up call; the trees alternate
(baseline, this one) and ``runtime_*`` are this tree's. ``--cpu``: the shipped model, 40 prompts
of 16 tokens and 64 new tokens each in one call (``cpu_*_ms``). Writes
``<date>-<gpu>-runtime.json`` (``<date>-cpu-runtime.json``) with ``gpu`` and ``date``, and prints a
table last.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3, QWEN3_5 = "qwen3-0.6b", "qwen3.5-0.8b"
THROUGHPUT_KEYS = ("throughput_tokens_per_s", "prefix_hit_ttft_ratio", "qwen3_5_ttft_ms_8x256")


def worker(a) -> dict:
    """Runs in the tree under test (its ``modeling`` imported): the GPU rows of one checkpoint, or
    the CPU row; a dict of medians."""
    import inspect

    import torch

    from modeling import LLM, SamplingParams

    llm = LLM(a.checkpoint) if a.checkpoint else LLM()
    extra = {"use_tqdm": False} if "use_tqdm" in inspect.signature(llm.generate).parameters else {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    g = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [{"prompt_token_ids": torch.randint(0, llm.config.vocab_size, (length,), generator=g).tolist()}
                for _ in range(n)]

    def t(batch, new):
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True), **extra)
        sync()
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return (time.perf_counter() - t0) * 1e3

    def per_token(batch):
        t(batch, a.tokens + 1), t(batch, 1)  # warm-up: compile, capture
        runs = [(t(batch, a.tokens + 1) - t(batch, 1)) / a.tokens for _ in range(a.reps)]
        return statistics.median(runs)

    if a.worker == "cpu":
        batch = prompts(40, 16)
        t(batch, 64)
        return {"cpu_40x64_ms": statistics.median(t(batch, 64) for _ in range(a.reps))}
    one = prompts(1, 256)
    out = {"b1_ms_per_token": per_token(one)}
    out["ttft_ms_256"] = statistics.median(t(one, 1) for _ in range(a.reps))
    if a.worker == QWEN3:
        out["b8_ms_per_step"] = per_token(prompts(8, 256))
    return out


def run_tree(tree: Path, args) -> dict:
    """``python bench/runtime.py --worker ...`` with ``tree`` first on the path; its printed JSON."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], cwd=tree, env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{tree}: {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def throughput(tree: Path, out_dir: Path) -> dict:
    """The tree's own ``bench.throughput --no-peer``: the keys of THROUGHPUT_KEYS."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "bench.throughput", "--no-peer", "--out", str(out_dir)], cwd=tree,
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{tree}: bench.throughput failed:\n{p.stderr[-3000:]}")
    (result,) = out_dir.glob("*-throughput.json")
    data = json.loads(result.read_text())
    return {k: data[k] for k in THROUGHPUT_KEYS}


def checkpoints(root: Path, names=(QWEN3, QWEN3_5)) -> dict:
    """The random bf16 checkpoints ``names`` of the GPU rows, written once under ``root``."""
    import torch

    from modeling.model.random_checkpoint import QWEN3_0_6B, QWEN3_5_0_8B, build_random_checkpoint, is_complete

    paths = {}
    for name, fields in ((QWEN3, QWEN3_0_6B), (QWEN3_5, QWEN3_5_0_8B)):
        if name not in names:
            continue
        path = root / name
        if not is_complete(path):
            sizes = {k: v for k, v in fields.items() if k != "vocab_size"}
            build_random_checkpoint(path, vocab_size=fields["vocab_size"], tokenizer="words", dtype=torch.bfloat16,
                                    std=0.02, **sizes)
        paths[name] = path
    return paths


def main():
    p = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="the baseline tree (a checkout of the project)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="new tokens of the timed decode")
    p.add_argument("--cpu", action="store_true", help="the CPU row only (the shipped model)")
    p.add_argument("--checkpoints", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qwen-runtime-bench")
    p.add_argument("--no-throughput", action="store_true", help="skip the trees' bench.throughput runs")
    p.add_argument("--models", nargs="+", choices=(QWEN3, QWEN3_5), default=[QWEN3, QWEN3_5],
                   help="the checkpoints of the GPU rows")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    trees = {"baseline": a.baseline.resolve(), "runtime": ROOT} if a.baseline else {"runtime": ROOT}
    common = ["--reps", str(a.reps), "--tokens", str(a.tokens)]
    if a.cpu:
        jobs = [("cpu", ["--worker", "cpu", *common])]
        gpu = "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            print("bench.runtime needs a CUDA GPU (or --cpu)", file=sys.stderr)
            sys.exit(2)
        gpu = torch.cuda.get_device_name()
        paths = checkpoints(a.checkpoints, a.models)
        jobs = [(name, ["--worker", name, "--checkpoint", str(paths[name]), *common]) for name in a.models]
    out = dict(gpu=gpu, date=datetime.date.today().isoformat(), reps=a.reps, tokens=a.tokens,
               trees={k: str(v) for k, v in trees.items()})
    for name, args in jobs:
        for label, tree in trees.items():
            for key, value in run_tree(tree, args).items():
                out[f"{label}_{'qwen3_5_' if name == QWEN3_5 else ''}{key}"] = value
            print(json.dumps({k: v for k, v in out.items() if k.startswith(label)}), flush=True)
    if not (a.cpu or a.no_throughput):
        for label, tree in trees.items():
            for key, value in throughput(tree, a.checkpoints / f"throughput-{label}").items():
                out[f"{label}_{key}"] = value
    from bench import gpu_slug  # not at the top: a worker runs this file with another tree's `bench` first

    os.makedirs(a.out, exist_ok=True)
    slug = gpu_slug(gpu)
    path = os.path.join(a.out, f"{out['date']}-{slug}-runtime.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    keys = sorted({k.split("_", 1)[1] for k in out if k.startswith("runtime_")})
    print(f"\n{gpu}, {out['date']}: median of {a.reps}\n\n| key | baseline | this tree | ratio |\n|---|---|---|---|")
    for k in keys:
        base, ours = out.get(f"baseline_{k}"), out[f"runtime_{k}"]
        ratio = f"{ours / base:.3f}" if base else "-"
        print(f"| {k} | {base if base is None else f'{base:.4g}'} | {ours:.4g} | {ratio} |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
