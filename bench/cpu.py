"""CPU speed side by side, one process: ours (the PyTorch reference ops, the path a machine without
CUDA runs) and transformers' own CPU forward, on the same random Qwen3-shaped weights, fp32.

    python -m bench.cpu [--shape qwen3-0.6b|small] [--layers N] [--context 256] [--steps 4]
                        [--prompt 128] [--cache-lens 512 4096] [--rounds 3] [--threads N] [--profile K] [--out DIR]

- decode: ms per token, batch 1, greedy, continuing a prefill of ``--context`` tokens for
  ``--steps`` steps. Ours: the engine's decode steps (what ``LLM`` runs without CUDA: the fused
  decode ops' references at batch 1, the engine's host work and sampling included) in an engine
  of each ``--cache-lens`` ``max_model_len`` (default: what ``LLM`` sizes for the call, at least
  256 positions, then powers of two; and 4096); transformers: ``model(token,
  past_key_values=DynamicCache)``, its cache cropped back to the context after each round.
- prefill: a ``--prompt``-token prompt to its first token (ours: the engine's prefill step and
  sampling; transformers: a forward with ``logits_to_keep=1``).

The machine's cores may be shared, so each round measures every row back to back (drift reaches
them alike; the odd rounds run the rows in reverse order). Each row is timed twice: wall time and
this process's CPU time. On a busy machine ``--threads 1`` gives steadier numbers: with several
threads every parallel op waits for its slowest thread, and a thread that lost its core makes a
microsecond op cost a scheduler slice; with one thread the CPU time leaves out the slices other
processes take of the core (not their share of the caches and memory bandwidth). The table gives
each row's medians and best over ``--rounds`` and its ratio to transformers' row of the same
round: the median over the rounds and the lowest and highest. Before timing, the prefill logits
of both are compared (max |ours - transformers|), so the rows compute the same thing.
``--profile K``: one decode step and one prefill of each under torch.profiler, the K ops with the
most self CPU time and their input shapes, to see where the time goes.
``--shape small`` (a 4-layer, hidden-256 model) is a quick check of the plumbing. Run it without
TRITON_INTERPRET: with it set, ours runs the Triton interpreter (the header names the path).
"""
import argparse
import datetime
import inspect
import os
import statistics
import time

import torch

from modeling import Engine, QwenConfig, QwenForCausalLM, SamplingParams
from modeling.api.llm import MIN_AUTO_MODEL_LEN
from modeling.model.device import backend_name
from modeling.model.loader import load_plan
from modeling.model.random_checkpoint import QWEN3_0_6B, config_dict

PEER_ROWS = {"decode": "decode, transformers (DynamicCache)", "prefill": "prefill, transformers"}
SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B,
    "small": dict(QWEN3_0_6B, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


def build_models(fields: dict, seed: int = 0):
    """A transformers Qwen3ForCausalLM (its own random init, fp32, SDPA attention) and ours holding
    the same weights (fused as our loader fuses them; a tensor made of one source is shared)."""
    import transformers

    d = config_dict(**fields)
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    hf = transformers.Qwen3ForCausalLM(hf_config).float().eval().requires_grad_(False)
    hf_state = hf.state_dict()
    config = QwenConfig.from_dict(d)
    state = {}
    for target, sources in load_plan(config).items():
        parts = [hf_state[name] for name, _ in sources]
        state[target] = parts[0] if len(parts) == 1 else torch.cat(parts)
    with torch.device("meta"):
        ours = QwenForCausalLM(config)
    ours.load_state_dict(state, strict=True, assign=True)
    return ours.requires_grad_(False), hf


def llm_cache_len(need: int) -> int:
    """The ``max_model_len`` ``LLM`` sizes its engine to for ``need`` positions (``max_model_len=None``)."""
    return max(MIN_AUTO_MODEL_LEN, 1 << (need - 1).bit_length())


def timed(fn, per: int = 1) -> tuple[float, float]:
    """(wall, CPU time of this process) in seconds that fn() takes, divided by ``per``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) / per, (time.process_time() - cpu) / per


class Ours:
    """The engine's decode steps in engines of the given ``max_model_len``s, and its prefill step."""

    def __init__(self, model: QwenForCausalLM, context_ids, cache_lens, prompt_len: int):
        self.context = context_ids[0].tolist()
        self.engines = {n: Engine(model, max_num_seqs=1, max_model_len=n, prefix_caching=False) for n in cache_lens}
        self.prefill_engine = Engine(model, max_num_seqs=1, max_model_len=prompt_len + 1, prefix_caching=False,
                                     max_num_batched_tokens=max(prompt_len, 8192))
        self.seq = None

    def start(self, cache_len: int, steps: int) -> None:
        """The context prefilled (not timed): its first token sampled, ``steps`` more to go."""
        engine = self.engines[cache_len]
        self.seq = engine.add(self.context, SamplingParams(), steps + 1)
        while self.seq.num_output == 0:
            engine.step()

    def decode(self, cache_len: int) -> None:
        """The started sequence's remaining steps (the same positions every round)."""
        engine = self.engines[cache_len]
        while engine.has_work():
            engine.step()

    def prefill(self, ids) -> None:
        engine = self.prefill_engine
        engine.generate([ids[0].tolist()], SamplingParams(), 1)


class Peer:
    """transformers' prefill and decode steps (DynamicCache)."""

    def __init__(self, model, context_ids):
        import transformers

        self.model = model
        # the cache argument's name: `cache` from transformers 5.x, `past_key_values` before
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = transformers.DynamicCache(config=model.config)
        model(context_ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache})

    def decode(self, steps: int) -> None:
        """``steps`` steps after the context; ``crop`` takes the cache back to it."""
        token = torch.zeros(1, 1, dtype=torch.int64)
        for _ in range(steps):
            logits = self.model(token, use_cache=True, **{self.cache_arg: self.cache}).logits
            token = logits[:, -1].argmax(-1, keepdim=True)

    def crop(self, steps: int) -> None:
        self.cache.crop(-steps)

    def prefill(self, ids) -> torch.Tensor:
        return self.model(ids, use_cache=False, logits_to_keep=1).logits[:, -1]


def profile_table(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                              max_name_column_width=40, max_shapes_column_width=80)


def parse_args():
    p = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--context", type=int, default=256, help="positions before the decode steps")
    p.add_argument("--steps", type=int, default=4, help="decode steps per round")
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens")
    p.add_argument("--cache-lens", type=int, nargs="+", default=None,
                   help="our engines' max_model_len (default: LLM's for context + steps, and 4096)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch's CPU threads (default: torch's own; 1 is steadier on a shared machine)")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="print the K costliest ops of each path")
    p.add_argument("--out", default=None, help="also write cpu.md there")
    a = p.parse_args()
    a.cache_lens = sorted(set(a.cache_lens or [llm_cache_len(a.context + a.steps), 4096]))
    if min(a.cache_lens) < a.context + a.steps:
        p.error(f"--cache-lens must hold the context and the steps ({a.context + a.steps} positions)")
    return a


def measure(a, ours: Ours, peer: Peer, prompt_ids) -> dict:
    """(wall, CPU) seconds per row (per token for decode, per prefill), one entry per round; every
    row in each round, the odd rounds in reverse order (no row always runs first or after another)."""
    decode = [(f"decode, ours, max_model_len {n}", lambda n=n: ours.start(n, a.steps), lambda n=n: ours.decode(n))
              for n in a.cache_lens]
    decode.append((PEER_ROWS["decode"], lambda: None, lambda: peer.decode(a.steps)))
    prefill = [("prefill, ours", lambda: ours.prefill(prompt_ids)),
               (PEER_ROWS["prefill"], lambda: peer.prefill(prompt_ids))]
    rows = {row[0]: [] for row in decode + prefill}
    for r in range(a.rounds):
        order = -1 if r % 2 else 1
        for name, start, fn in decode[::order]:
            start()
            rows[name].append(timed(fn, a.steps))
        peer.crop(a.steps)
        for name, fn in prefill[::order]:
            rows[name].append(timed(fn))
        print(f"round {r + 1} (wall / CPU ms): " + ", ".join(f"{k} {v[-1][0] * 1e3:.0f} / {v[-1][1] * 1e3:.0f}"
                                                             for k, v in rows.items()), flush=True)
    return rows


def print_profiles(a, ours: Ours, peer: Peer, prompt_ids) -> None:
    n = a.cache_lens[0]
    ours.start(n, 1)
    for name, fn in [(f"ours, decode step, max_model_len {n}", lambda: ours.decode(n)),
                     ("transformers, decode step", lambda: (peer.decode(1), peer.crop(1))),
                     ("ours, prefill", lambda: ours.prefill(prompt_ids)),
                     ("transformers, prefill", lambda: peer.prefill(prompt_ids))]:
        print(f"\n## {name}\n{profile_table(fn, a.profile)}", flush=True)


def ratios(times: list, peer: list, clock: int) -> str:
    """A row's time over transformers' row of the same round, on one clock (0 wall, 1 CPU): the
    median over the rounds [lowest, highest]."""
    r = [t[clock] / p[clock] for t, p in zip(times, peer)]
    return f"{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]"


def render(a, rows: dict, path: str, diff: float) -> str:
    """The markdown table: each row's wall and CPU medians and best, and its ratios to transformers'."""
    shape = (a.shape + (f", {a.layers} layers" if a.layers else "") + f", fp32, batch 1, context {a.context}"
             f" + {a.steps} steps, prompt {a.prompt}")
    lines = [f"# bench/cpu.py, {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
             "", f"{shape}; ours: {path}; {a.rounds} rounds, every row in each round; max |logit diff| {diff:.1e}",
             "", "| row | wall ms, median | CPU ms, median | CPU ms, best | CPU / transformers, median [range] "
                 "| wall / transformers, median [range] |", "|---|---|---|---|---|---|"]
    for name, times in rows.items():
        peer = rows[PEER_ROWS[name.split(",")[0]]]
        lines.append(f"| {name} | {statistics.median(t[0] for t in times) * 1e3:.1f} | "
                     f"{statistics.median(t[1] for t in times) * 1e3:.1f} | {min(t[1] for t in times) * 1e3:.1f} | "
                     f"{ratios(times, peer, 1)} | {ratios(times, peer, 0)} |")
    return "\n".join(lines) + "\n"


def main():
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    fields = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
    torch.manual_seed(0)
    context_ids = torch.randint(0, fields["vocab_size"], (1, a.context))
    prompt_ids = torch.randint(0, fields["vocab_size"], (1, a.prompt))
    t0 = time.perf_counter()
    model, hf = build_models(fields)
    path = backend_name(model.device, model.dtype)
    print(f"built both models in {time.perf_counter() - t0:.1f} s; ours runs the {path}; "
          f"{torch.get_num_threads()} threads", flush=True)
    with torch.inference_mode():
        ours, peer = Ours(model, context_ids, a.cache_lens, a.prompt), Peer(hf, context_ids)
        diff = (model(prompt_ids)[:, -1] - peer.prefill(prompt_ids)).abs().max().item()
        print(f"max |logit ours - transformers|, prefill of {a.prompt} tokens: {diff:.2e}", flush=True)
        rows = measure(a, ours, peer, prompt_ids)
        if a.profile:
            print_profiles(a, ours, peer, prompt_ids)
    text = render(a, rows, path, diff)
    print("\n" + text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
