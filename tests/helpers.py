"""Shared test utilities: devices, tolerances, a comparison that explains itself, a subprocess
held to a timeout and a memory limit, and the turns of the tests that need most of a GPU."""
import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SANITIZING = os.environ.get("QWEN_SANITIZER") == "1"
"""Set by bench/gpu_sanitize.sh: under compute-sanitizer, which intercepts every launch, tests skip
their float64 token-by-token references (thousands of tiny PyTorch launches) and only check that
the kernels' outputs are finite; the plain `cuda` run compares them."""

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]

# ||out - ref|| / ||ref|| ceilings of the kernels against their references. bf16 is looser on CPU
# because the Triton interpreter truncates (rather than rounds) when it converts to bf16.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5, torch.float64: 1e-12}


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel_tol: float | None = None, what: str = ""):
    """Relative-norm check; on failure print shape, max/mean abs diff and where the largest one is."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    tol = REL_TOL[ref.dtype] if rel_tol is None else rel_tol
    o, r = out.double(), ref.double()
    assert not torch.isnan(o).any(), f"{what}: NaN in output of shape {tuple(out.shape)} (an unwritten element?)"
    diff = (o - r).abs()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    if not rel <= tol:
        where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: rel err {rel:.3e} > {tol:.1e}; shape {tuple(out.shape)} {out.dtype}, "
            f"max_abs_diff {diff.max().item():.4e} at {where} (out {o[where].item():.5g}, ref {r[where].item():.5g}), "
            f"mean_abs_diff {diff.mean().item():.4e}")


def hf_greedy(hf_model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] of ids [B, T] by a transformers model, no cache."""
    out = ids
    for _ in range(new_tokens):
        out = torch.cat([out, hf_model(out).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return out[:, ids.shape[1]:]


def require_tma(device: str):
    """Skip where the TMA prefill GEMM cannot run: GPUs without Hopper-class shared memory
    (`linear.tma_supported`), whose GEMMs take the strided kernel the other linear tests cover."""
    from csrc_free_ops.linear import tma_supported

    if not tma_supported(torch.device(device)):
        pytest.skip("this GPU cannot run the TMA GEMM (see linear.tma_supported)")


def poison_allocator(device: str):
    """Fill recently freed CUDA memory with NaN so an output element a kernel forgets to write shows up."""
    if device == "cuda":
        torch.full((64 << 20,), float("nan"), device="cuda")
        torch.cuda.synchronize()


def isolated(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python *args`` in the repository root, killed after ``timeout`` seconds and held to 2 GiB of
    data: a reader that blocks on a FIFO or reads /dev/zero without end fails the test, it does not
    hang it or exhaust the machine's memory."""
    import resource

    limit = 2 << 30
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)))


needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"),
                                reason="needs FIFOs and /dev/zero")


@contextlib.contextmanager
def gpu_memory_lock():
    """Around a test that needs most of a GPU's memory: under ``bench.cuda_suite``, which runs several
    pytest processes on each GPU and names a lock file per GPU in ``QWEN_GPU_LOCK``, such tests take
    turns on their GPU (an exclusive ``flock``); elsewhere it does nothing."""
    path = os.environ.get("QWEN_GPU_LOCK")
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def opcheck_without_schema_test(op, args):
    """``torch.library.opcheck`` without ``test_schema``, whose check that no input was mutated
    compares the inputs with ``torch.allclose``, which PyTorch does not implement for float8 tensors:
    the bytes of the inputs the schema does not let the op write are compared here instead."""
    written = {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    kept = [(a, a.clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in written]
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))
    for a, before in kept:
        assert torch.equal(a.view(torch.uint8), before.view(torch.uint8)), f"{op}: an input changed"


def padded(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A NaN tensor of ``shape`` that is a view of a longer storage (one row more on each side): a
    kernel reading or writing the row before or after it (a slot or a length a check should have
    refused) stays inside the allocation, so a test fails by assertion, not by crashing the
    interpreter."""
    return torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=dtype, device=device)[1:-1]


def randn(*shape, dtype, device, scale: float = 1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)  # shape () too


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def prompt(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """Random token ids [batch, length] from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def engine_greedy(model, ids: torch.Tensor, new_tokens: int, **engine_args) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] of ids [B, T] through the engine (the rows as one
    continuous batch, EOS ignored); ``engine_args`` for ``Engine`` (e.g. ``decode_kernels``)."""
    from modeling import Engine, SamplingParams

    args = dict(max_num_seqs=ids.shape[0], max_model_len=ids.shape[1] + new_tokens) | engine_args
    engine = Engine(model, **args)
    return torch.tensor(engine.generate(ids.tolist(), SamplingParams(), new_tokens))


def add_word_tokenizer(path, vocab_size: int):
    """Give a transformers ``save_pretrained`` directory the tokenizer.json ``LLM`` needs: a
    word-level vocabulary of exactly ``vocab_size`` entries (no special tokens). Returns ``path``."""
    from modeling.model.random_checkpoint import build_word_tokenizer

    build_word_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    return path


def llm_greedy(llm, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] of ids [B, T] through ``LLM.generate`` (EOS ignored)."""
    from modeling import SamplingParams

    outs = llm.generate([{"prompt_token_ids": row} for row in ids.tolist()],
                        SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return torch.tensor([o.token_ids for o in outs])


def forced_logits(engine, prompt, tokens) -> torch.Tensor:
    """Teacher forcing through the engine: one sequence of ``prompt`` whose sampled tokens are
    replaced by ``tokens``; the logits [len(tokens), V] (fp32) each step computed: row 0 after the
    prompt, row i of the decode step fed tokens[i - 1] (row i chose tokens[i])."""
    from unittest import mock

    import modeling.engine.engine as engine_module
    from modeling import SamplingParams
    from modeling.engine.sampler import SampledTokens

    seen = []

    def forced(logits, seqs, positions=None):
        seen.append(logits[:1].float().clone())
        return SampledTokens(torch.tensor([tokens[len(seen) - 1]], device=logits.device), None, [], [])

    with mock.patch.object(engine_module, "sample_sequences", forced):
        engine.generate([list(prompt)], SamplingParams(), len(tokens))
    return torch.cat(seen)


def greedy_logits(engine, prompt, new_tokens: int):
    """Greedy decoding of one sequence of ``prompt`` through the engine: (tokens, logits
    [new_tokens, V] fp32), row i the logits that chose tokens[i]."""
    from unittest import mock

    import modeling.engine.engine as engine_module
    from modeling import SamplingParams

    seen, sample = [], engine_module.sample_sequences

    def recorded(logits, seqs, positions=None):
        seen.append(logits[:1].float().clone())
        return sample(logits, seqs, positions)

    with mock.patch.object(engine_module, "sample_sequences", recorded):
        tokens = engine.generate([list(prompt)], SamplingParams(), new_tokens)[0]
    return tokens, torch.cat(seen)


def assert_same_greedy_but_near_ties(got, want, rel_tol: float, tie: float):
    """Two decode paths' ``greedy_logits`` of one prompt: the tokens equal, except that the first
    that differs may follow a near-tie (in ``want``'s logits, the two tokens within ``tie`` times the
    row's largest magnitude; random weights give nearly flat logits), and the logits of the steps
    with the same history (up to that one) within ``rel_tol``."""
    (tokens, logits), (want_tokens, want_logits) = got, want
    differ = [i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b]
    same = differ[0] + 1 if differ else len(tokens)
    assert rel_err(logits[:same], want_logits[:same]) < rel_tol
    if differ:
        row = want_logits[differ[0]]
        gap = (row[want_tokens[differ[0]]] - row[tokens[differ[0]]]).abs()
        assert gap <= tie * row.abs().max(), f"token {differ[0]} differs without a near-tie (gap {float(gap):.3g})"


def recompute_greedy(model, prompts, new_tokens: int):
    """Each prompt's (a list of token ids) greedy continuation of ``new_tokens`` by the model's
    forward without a cache, every position recomputed for every token: the engine tests' oracle."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            for _ in range(new_tokens):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
            out.append(ids[0, len(p):].tolist())
    return out


@torch.no_grad()
def randomize_(model, std=0.2):
    """A transformers model's weights at random, logits spread out (routing far from uniform):
    matrices ~ N(0, std^2); norm weights as each norm reads them: 1 + N(0, std^2) for a plain weight
    (Qwen3, Qwen2 and their MoE, Qwen3.5's gated norm), N(0, std^2) for Qwen3.5's zero-centred ones;
    Qwen3.5's A_log ~ U(-4, 1) and dt_bias ~ N(-1, 1), so heads range from a long memory to a short
    one."""
    zero_centred = model.config.model_type.startswith("qwen3_5")
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(-4.0, 1.0)
        elif name.endswith("dt_bias"):
            p.normal_(-1.0, 1.0)
        else:
            p.normal_(0.0, std)
            if name.endswith("linear_attn.norm.weight") or ("norm" in name and not zero_centred):
                p.add_(1.0)
    return model


def assert_persistent_decode_matches_ops(shape: dict, batch: int) -> None:
    """The engine's decode steps through the persistent kernel (``decode_kernels="persistent"``)
    against the op-by-op steps, on the GPU, ``shape`` with 4 layers of random weights: fp32 greedy
    tokens of ``batch`` sequences equal over 48 steps; bf16 logits of teacher-forced steps within
    the fused path's bound; no wait of the kernel timed out."""
    from csrc_free_ops.decode_layers import error_flag
    from modeling import Engine, QwenConfig, SamplingParams
    from modeling.model.random_checkpoint import random_model

    config = QwenConfig.from_dict(dict(shape, num_hidden_layers=4))
    model = random_model(config, dtype=torch.float32, device="cuda", std=0.05)
    prompts = [list(range(3 + 5 * b, 20 + 7 * b)) for b in range(batch)]
    tokens = {k: Engine(model, max_num_seqs=batch, max_model_len=128, decode_kernels=k).generate(
        prompts, SamplingParams(), 48) for k in ("ops", "persistent")}
    assert tokens["persistent"] == tokens["ops"]
    model = random_model(config, dtype=torch.bfloat16, device="cuda", std=0.05)
    logits = {k: forced_logits(Engine(model, max_num_seqs=1, max_model_len=64, decode_kernels=k), list(range(5, 45)),
                               [7, 9, 11, 13]) for k in ("ops", "persistent")}
    assert_close(logits["persistent"], logits["ops"], 3 * REL_TOL[torch.bfloat16], "bf16 teacher-forced logits")
    assert error_flag(torch.device("cuda")).item() == 0, "a wait of the persistent kernel timed out"
