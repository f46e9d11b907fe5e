"""qwen::decode_hybrid_layers (the persistent decode kernel of Qwen3.5's hybrid decoder) against its
reference, the composition of the per-layer ops; the reference against the model's layers run
through the fused decode ops.

On the CPU interpreter one program runs every task in order (its waits are met as it reaches
them); on CUDA the grid is every co-resident program and the waits are real."""
import os
import subprocess
import sys

import pytest
import torch

import qwen_ops
from csrc_free_ops import decode_hybrid_layers as kernels
from csrc_free_ops import decode_layers
from csrc_free_ops.decode_layers import error_flag
from tests.helpers import (DEVICES, DTYPES, REL_TOL, ROOT, assert_close, assert_persistent_decode_matches_ops,
                           randn)

A, G = kernels.ATTENTION, kernels.GATED_DELTANET

# (M, hidden, I, layer kinds, (Hq, Hk, D, rotary dim), (Hk', Hv, Dk, Dv, K), block size, blocks per
# sequence): awkward sizes on the CPU (hidden and I not powers of two, 3 and 6 value heads, head
# dims of 48, partial rotary, GQA groups of 3 and 1, conv kernels of 4 and 3); Qwen3.5-0.8B's layer
# shapes on CUDA
CASES = {"cpu": [(1, 40, 72, (G, G, A), (6, 2, 32, 16), (2, 6, 16, 32, 4), 16, 2),
                 (3, 48, 40, (G, A, G, A), (2, 2, 48, 24), (1, 3, 48, 48, 3), 16, 3)],
         "cuda": [(1, 1024, 3584, (G, G, G, A) * 2, (8, 2, 256, 64), (16, 16, 128, 128, 4), 16, 24),
                  (5, 1024, 3584, (G, G, G, A) * 2, (8, 2, 256, 64), (16, 16, 128, 128, 4), 16, 150)]}

NAMES = ["x", "positions", "cache_seqlens", "block_table", "state_slots", "layer_kinds", "input_norm", "post_norm",
         "gate_up_weight", "down_weight", "qkv_weight", "q_norm", "k_norm", "o_weight", "k_cache", "v_cache",
         "in_proj_weight", "conv_weight", "A_log", "dt_bias", "norm_weight", "out_weight", "conv_states", "ssm_states",
         "eps", "offset", "theta", "rotary_dim", "num_heads", "num_splits"]
CACHES = [NAMES.index(n) for n in ("k_cache", "v_cache", "conv_states", "ssm_states")]


def _args(m, hidden, inter, kinds, attn, gdn, bs, per_seq, dtype, device, splits=3, padding=False, seed=0):
    """The op's arguments: random weights and caches; row 0 a first token (nothing cached), with
    `padding` the last row a padding row (length 0, the pool's last slot, as an engine step pads)."""
    torch.manual_seed(seed)
    f = dict(dtype=dtype, device=device)
    hq, hk, d, rot = attn
    hkl, hv, dk, dv, taps = gdn
    nl, na = len(kinds), kinds.count(A)
    ng = nl - na
    channels, vd = 2 * hkl * dk + hv * dv, hv * dv
    num_blocks, slots = m * per_seq + 3, m + 2
    table = torch.randperm(num_blocks, device=device)[:m * per_seq].view(m, per_seq).to(torch.int32)
    seqlens = torch.randint(2, per_seq * bs + 1, (m,), device=device, dtype=torch.int32)
    seqlens[:1] = 1
    state_slots = torch.randperm(slots - 1, device=device)[:m]
    if padding:
        seqlens[-1] = 0
        state_slots[-1] = slots - 1
    norm = lambda *shape: 0.1 * randn(*shape, **f)  # noqa: E731  (zero-centred: offset 1)
    return [randn(m, hidden, **f), (seqlens - 1).clamp(min=0).long(), seqlens, table, state_slots, list(kinds),
            norm(nl, hidden), norm(nl, hidden), randn(nl, 2 * inter, hidden, **f, scale=hidden ** -0.5),
            randn(nl, hidden, inter, **f, scale=inter ** -0.5),
            randn(na, (2 * hq + 2 * hk) * d, hidden, **f, scale=hidden ** -0.5), norm(na, d), norm(na, d),
            randn(na, hidden, hq * d, **f, scale=(hq * d) ** -0.5),
            randn(na, num_blocks, bs, hk, d, **f), randn(na, num_blocks, bs, hk, d, **f),
            randn(ng, channels + vd + 2 * hv, hidden, **f, scale=hidden ** -0.5),
            randn(ng, channels, taps, **f, scale=taps ** -0.5),
            torch.log(torch.empty(ng, hv, device=device).uniform_(1, 16)).to(dtype),
            randn(ng, hv, **f), 1 + 0.1 * randn(ng, dv, **f), randn(ng, hidden, vd, **f, scale=vd ** -0.5),
            randn(ng, slots, channels, taps - 1, **f),
            randn(ng, slots, hv, dk, dv, dtype=torch.float32, device=device, scale=0.3),
            1e-6, 1.0, 1e4, rot, hq, splits]


def _check(args, dtype, device, what):
    ref_args = list(args)
    for i in CACHES:
        ref_args[i] = args[i].clone()
    ref = qwen_ops.decode_hybrid_layers_reference(*ref_args)
    calls = qwen_ops.kernel_calls["decode_hybrid_layers"]
    out = torch.ops.qwen.decode_hybrid_layers(*args)
    assert qwen_ops.kernel_calls["decode_hybrid_layers"] == calls + 1, "the kernel did not run"
    # Every layer rounds to the model dtype a dozen times; the residual stream carries it on.
    tol = REL_TOL[dtype] * (max(3, len(args[5])) if dtype != torch.float32 else 5)
    assert_close(out, ref, tol, what)
    for i in CACHES:
        assert_close(args[i], ref_args[i], tol, f"{what} {NAMES[i]}")
    if device == "cuda":
        assert error_flag(torch.device(device)).item() == 0, "a wait of the persistent kernel timed out"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_hybrid_layers(device, dtype):
    for i, case in enumerate(CASES[device]):
        splits = 1 + 2 * i
        _check(_args(*case, dtype, device, splits=splits, padding=i == 1), dtype, device, f"{case} S{splits}")


def test_decode_hybrid_layers_head_dim_256():
    """Qwen3.5's attention head dim of 256 and rotary dim of 64, whose attention tasks step over
    the cache 16 positions at a time (`kv_block`), with splits of several steps."""
    assert kernels.kv_block(256) == 16
    args = _args(2, 32, 24, (A, G), (2, 1, 256, 64), (1, 2, 16, 16, 4), 16, 4, torch.float32, "cpu", splits=2)
    _check(args, torch.float32, "cpu", "head dim 256")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_hybrid_layers_padding_rows_write_nothing(device):
    """A padding row (length 0, as a captured engine step pads with, in the pool's last slot) writes
    no key, value, conv state or recurrent state, whatever its block table row and slot hold; a
    slot outside the pool is written by no row either. Every output row is finite."""
    case = CASES[device][0]
    args = _args(*case, torch.float32, device)
    args[2] = torch.zeros_like(args[2])
    before = [args[i].clone() for i in CACHES]
    out = torch.ops.qwen.decode_hybrid_layers(*args)
    assert torch.isfinite(out).all()
    assert all(torch.equal(args[i], b) for i, b in zip(CACHES, before))
    args[2] = torch.full_like(args[2], 2)
    args[4] = torch.full_like(args[4], args[23].shape[1])  # one past the pool
    torch.ops.qwen.decode_hybrid_layers(*args)
    assert all(torch.equal(args[i], b) for i, b in zip(CACHES[2:], before[2:]))


def _small():
    """Two layers (Gated DeltaNet, attention) of hidden 32, two sequences in blocks of 16."""
    return _args(2, 32, 24, (G, A), (2, 1, 16, 8), (1, 2, 16, 16, 4), 16, 2, torch.float32, "cpu", splits=2)


def test_decode_hybrid_layers_opcheck():
    torch.library.opcheck(torch.ops.qwen.decode_hybrid_layers.default, tuple(_small()))


def test_decode_hybrid_layers_errors():
    args = _small()
    rows = qwen_ops.DECODE_LAYERS_MAX_ROWS
    bad = {
        f"x must hold at most {rows} rows": dict(x=randn(rows + 1, 32, dtype=torch.float32, device="cpu")),
        "layer_kinds must list": dict(layer_kinds=[G, 2]),
        r"k_cache .* must both be \[NA = 2": dict(layer_kinds=[A, A]),
        "in_proj_weight must be contiguous with shape": dict(in_proj_weight=args[16][:, :-1]),
        "conv_states must be contiguous with shape": dict(conv_states=args[22][..., :-1]),
        "ssm_states must be float32": dict(ssm_states=args[23].double()),
        "ssm_states is on meta but x is on cpu": dict(ssm_states=args[23].to("meta")),  # another device
        "state_slots must be int64": dict(state_slots=args[4].int()),
        "state_slots must be contiguous": dict(state_slots=torch.stack([args[4], args[4]], 1)[:, 0]),
        "positions must be contiguous": dict(positions=torch.stack([args[1], args[1]], 1)[:, 0]),
        "num_heads": dict(num_heads=0),
        "rotary_dim": dict(rotary_dim=7),
        "block_table must be": dict(block_table=args[3][:, :0]),
        "cache_seqlens must lie in": dict(cache_seqlens=args[2] + 1000),
        "state_slots must differ between the rows": dict(state_slots=torch.zeros_like(args[4])),
    }
    for message, change in bad.items():
        a = list(args)
        for name, value in change.items():
            a[NAMES.index(name)] = value
        with pytest.raises(qwen_ops.QwenOpError, match=message):
            torch.ops.qwen.decode_hybrid_layers(*a)


def test_decode_hybrid_layers_timeline_must_fit_the_step():
    """decode_layers.timeline set to a tensor of the wrong dtype, or one element short of 3 stamps a
    task of the step (`step_tasks`), fails before the launch with a ValueError that says so."""
    args = _small()
    layer_kinds, splits = args[5], args[-1]
    _, tasks = kernels.step_tasks(2, layer_kinds, *(args[NAMES.index(n)] for n in (
        "down_weight", "k_cache", "in_proj_weight", "conv_weight", "ssm_states", "num_heads")), splits)
    need = 3 * sum(map(sum, tasks))
    for wrong in (torch.zeros(need, dtype=torch.int32), torch.zeros(need - 1, dtype=torch.int64)):
        decode_layers.timeline = wrong
        try:
            with pytest.raises(ValueError, match=f"must be an int64 tensor of at least {need} elements on cpu"):
                torch.ops.qwen.decode_hybrid_layers(*args)
        finally:
            decode_layers.timeline = None


TIMELINE_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from csrc_free_ops import decode_hybrid_layers as hybrid

kernel = hybrid._decode_hybrid_layers_kernel
names = kernel.fn.arg_names
const = dict(H=32, I=24, HQ=2, HK=1, D=16, ROT=8, HKL=1, HV=2, DK=16, DV=16, K=4, BLOCK_M=2, RQ=16, RO=8, RP=16, RC=32,
             BV=16, RW=8, RG=8, RD=8, S=2, BLOCK_T=16, HEADROOM=8.0, P_SCALE=2.0 ** -8, SPIN_LIMIT=hybrid.SPIN_LIMIT)
pointers = dict(pos_ptr="*i64", slot_ptr="*i64", seqlens_ptr="*i32", bt_ptr="*i32", plan_ptr="*i32", cnt_ptr="*i32",
                err_ptr="*i32", tl_ptr="*i64", state_ptr="*fp32", po_ptr="*fp32", plse_ptr="*fp32")
floats = {"eps", "offset", "log2_theta", "qk_scale", "dk_scale"}
for timeline in (False, True):
    c = dict(const, TIMELINE=timeline)
    sig = {n: "constexpr" if n in c else pointers.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n in floats
           else "i32" for n in names}
    src = ASTSource(kernel.fn, sig, {(names.index(n),): v for n, v in c.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1)).asm["ptx"]
    print(timeline, ptx.count("%globaltimer"))
"""


def test_timeline_compiles_for_hopper():
    """No GPU needed: the hybrid kernel compiled for sm_90 (small shapes) with TIMELINE reads
    %globaltimer (the start, the waits and the end of a task: `_now` cannot run under the
    interpreter), and without it not at all."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", TIMELINE_PTX], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    counts = dict(line.split() for line in out.stdout.splitlines())
    assert out.returncode == 0 and counts["False"] == "0" and int(counts["True"]) >= 3, out.stdout + out.stderr


# Qwen3.5's layers with awkward sizes: hidden 48, 6 value heads over 2 key heads, partial rotary
SMALL_QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=48, intermediate_size=40,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                     linear_value_head_dim=32, full_attention_interval=2, tie_word_embeddings=True)


def test_reference_is_the_models_fused_decode_step():
    """The reference against the model's layers run as a fused engine decode step (the ops the
    layers call, with LayerContext's pool entries): the same stream and the same pool after."""
    from types import SimpleNamespace

    from modeling import QwenConfig
    from modeling.model.context import LayerContext
    from modeling.model.random_checkpoint import random_model

    config = QwenConfig.from_dict(SMALL_QWEN3_5)
    model = random_model(config, dtype=torch.float32, std=0.2)
    layers = model.layers
    kinds = [G if kind == "linear_attention" else A for kind in config.layer_types]
    attn = [layer for layer, kind in zip(layers, kinds) if kind == A]
    gdn = [layer for layer, kind in zip(layers, kinds) if kind == G]
    stack = lambda group, name: torch.stack([getattr(layer, name) for layer in group])  # noqa: E731
    m, bs, per_seq = 3, 16, 2
    args = _args(m, config.hidden_size, config.intermediate_size, tuple(kinds),
                 (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rotary_dim),
                 (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                  config.linear_value_head_dim, config.linear_conv_kernel_dim), bs, per_seq, torch.float32, "cpu",
                 splits=1)
    weights = {"input_norm": stack(layers, "input_norm"), "post_norm": stack(layers, "post_norm"),
               "gate_up_weight": stack(layers, "gate_up_weight"), "down_weight": stack(layers, "down_weight"),
               "qkv_weight": stack(attn, "qkv_weight"), "q_norm": stack(attn, "q_norm"),
               "k_norm": stack(attn, "k_norm"), "o_weight": stack(attn, "o_weight"),
               "in_proj_weight": stack(gdn, "in_proj_weight"), "conv_weight": stack(gdn, "conv_weight")[:, :, 0],
               "A_log": stack(gdn, "A_log"), "dt_bias": stack(gdn, "dt_bias"), "norm_weight": stack(gdn, "norm_weight"),
               "out_weight": stack(gdn, "out_weight")}
    for name, w in weights.items():
        args[NAMES.index(name)] = w
    args[NAMES.index("eps")], args[NAMES.index("offset")] = config.rms_norm_eps, config.norm_offset
    args[NAMES.index("theta")] = config.rope_theta
    pool = [args[i].clone() for i in CACHES]
    ref = qwen_ops.decode_hybrid_layers_reference(*args)

    positions, seqlens, table, slots = args[1], args[2], args[3], args[4]
    batch = SimpleNamespace(positions=positions, seq_lens=seqlens, block_table=table, state_slots=slots,
                            slot_mapping=table[torch.arange(m), positions // bs].long() * bs + positions % bs,
                            cu_seqlens_q=torch.arange(m + 1, dtype=torch.int32), continues=seqlens > 1,
                            max_query_len=1)
    x, a, g = args[0], 0, 0
    for layer, kind in zip(layers, kinds):
        if kind == A:
            entry, a = (pool[0][a], pool[1][a]), a + 1
        else:
            entry, g = (pool[2][g], pool[3][g]), g + 1
        x, _ = layer(x, None, positions, LayerContext(batch, entry, True))
    assert_close(x, ref, 5 * REL_TOL[torch.float32], "the model's fused step")
    for i, p in zip(CACHES, pool):
        assert_close(p, args[i], 5 * REL_TOL[torch.float32], NAMES[i])


@pytest.mark.cuda
def test_decode_hybrid_layers_replays_in_cuda_graph():
    """The kernel captured once in a CUDA graph (its buffers and plan made by an eager call before),
    replayed with other rows, positions, lengths, block tables and slots, gives what eager calls
    give; no wait timed out."""
    case = CASES["cuda"][1]
    args = _args(*case, torch.bfloat16, "cuda")
    qwen_ops.reserve_decode_buffers("cuda")
    torch.ops.qwen.decode_hybrid_layers(*args)  # compile and make the plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.qwen.decode_hybrid_layers(*args)
    for seed in (1, 2, 3):
        fresh = _args(*case, torch.bfloat16, "cuda", seed=seed, padding=seed == 2)
        for i in range(5):  # x, positions, cache_seqlens, block_table, state_slots
            args[i].copy_(fresh[i])
        caches = [args[i].clone() for i in CACHES]
        graph.replay()
        replayed = [static_out.clone()] + [args[i].clone() for i in CACHES]
        for i, c in zip(CACHES, caches):
            args[i].copy_(c)
        eager = torch.ops.qwen.decode_hybrid_layers(*args)
        assert torch.equal(replayed[0], eager), f"replay {seed}: the output differs from eager"
        for i, r in zip(CACHES, replayed[1:]):
            assert torch.equal(r, args[i]), f"replay {seed}: {NAMES[i]}"
    assert error_flag(torch.device("cuda")).item() == 0, "a wait of the persistent kernel timed out"


def test_engine_decode_steps_through_the_hybrid_kernel_equal_the_default_steps():
    """fp32, a small random Qwen3.5 (a Gated DeltaNet and a gated attention layer): the engine's decode
    steps through the hybrid persistent kernel (``decode_kernels="persistent"``, over the pool's
    stacked caches and state slots, under the interpreter) give the greedy tokens of the default
    steps; three sequences in the 4-row graph shape (a padding row in the pool's padding slot),
    then fewer as they finish. On the CPU the kernel is never the default choice."""
    from modeling import Engine
    from tests.test_engine import GREEDY, model_of, prompts_of

    model = model_of(dict(SMALL_QWEN3_5, num_hidden_layers=2), dtype=torch.float32)
    prompts = prompts_of([3, 7, 4], vocab=SMALL_QWEN3_5["vocab_size"])
    lengths = (3, 2, 3)
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64, block_size=16)
    assert engine.runner.decode_kernels(1) != "persistent"
    seqs = [engine.add(p, GREEDY, n) for p, n in zip(prompts, lengths)]
    while engine.has_work():
        engine.step()
    want = [s.output_ids for s in seqs]
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64, block_size=16,
                    decode_kernels="persistent")
    seqs = [engine.add(p, GREEDY, n) for p, n in zip(prompts, lengths)]
    calls = qwen_ops.kernel_calls["decode_hybrid_layers"]
    while engine.has_work():
        engine.step()
    assert qwen_ops.kernel_calls["decode_hybrid_layers"] > calls, "the hybrid kernel did not run"
    assert [s.output_ids for s in seqs] == want


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_model_decode_hybrid_layers(batch):
    """The engine's steps through the hybrid kernel against op by op, Qwen3.5-0.8B's shape (three
    Gated DeltaNet layers, one gated attention: ``assert_persistent_decode_matches_ops``)."""
    from modeling.model.random_checkpoint import QWEN3_5_0_8B

    assert_persistent_decode_matches_ops(QWEN3_5_0_8B, batch)
