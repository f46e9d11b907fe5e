"""qwen::decode_layers (the persistent decode kernel) against its reference, the composition of
the per-layer ops; and the model's decode step through it against the fused op-by-op step.

On the CPU interpreter one program runs every task in order (its waits are met as it reaches
them); on CUDA the grid is every co-resident program and the waits are real."""
import pytest
import torch

import qwen_ops
from csrc_free_ops import decode_layers as kernels
from tests.helpers import DEVICES, DTYPES, REL_TOL, assert_close, assert_persistent_decode_matches_ops, randn

# (M, hidden, Hq, Hk, D, I, layers, block_size, blocks per sequence): awkward sizes on the CPU
# (hidden and I not powers of two, a head dim of 48, GQA groups of 1 and 3); Qwen3-0.6B's layer
# shape on CUDA
CASES = {"cpu": [(1, 40, 4, 2, 16, 72, 2, 16, 3), (3, 64, 6, 2, 48, 96, 2, 16, 2), (2, 48, 2, 2, 16, 40, 3, 32, 2)],
         "cuda": [(1, 1024, 16, 8, 128, 3072, 4, 16, 24), (5, 1024, 16, 8, 128, 3072, 3, 16, 150)]}


def _args(m, hidden, hq, hk, d, inter, layers, bs, per_seq, dtype, device, bias=False, qk_norm=True, splits=3,
          seed=0):
    torch.manual_seed(seed)
    f = dict(dtype=dtype, device=device)
    nqkv = (hq + 2 * hk) * d
    num_blocks = m * per_seq + 3
    table = torch.randperm(num_blocks, device=device)[:m * per_seq].view(m, per_seq).to(torch.int32)
    seqlens = torch.randint(1, per_seq * bs + 1, (m,), device=device, dtype=torch.int32)
    seqlens[0] = 1  # a first token: nothing cached before it
    return (randn(m, hidden, **f), (seqlens - 1).long(), seqlens, table,
            1 + 0.1 * randn(layers, hidden, **f), randn(layers, nqkv, hidden, **f, scale=hidden ** -0.5),
            0.1 * randn(layers, nqkv, **f) if bias else None,
            1 + 0.1 * randn(layers, d, **f) if qk_norm else None, 1 + 0.1 * randn(layers, d, **f) if qk_norm else None,
            randn(layers, hidden, hq * d, **f, scale=(hq * d) ** -0.5), 1 + 0.1 * randn(layers, hidden, **f),
            randn(layers, 2 * inter, hidden, **f, scale=hidden ** -0.5),
            randn(layers, hidden, inter, **f, scale=inter ** -0.5),
            randn(layers, num_blocks, bs, hk, d, **f), randn(layers, num_blocks, bs, hk, d, **f),
            1e-6, 0.0, 1e4, d, hq, splits)


def _check(args, dtype, device, what):
    ref_args = list(args)
    ref_args[13], ref_args[14] = args[13].clone(), args[14].clone()
    ref = qwen_ops.decode_layers_reference(*ref_args)
    calls = qwen_ops.kernel_calls["decode_layers"]
    out = torch.ops.qwen.decode_layers(*args)
    assert qwen_ops.kernel_calls["decode_layers"] == calls + 1, "the kernel did not run"
    # Every layer rounds to the model dtype a dozen times; the residual stream carries it on.
    tol = REL_TOL[dtype] * (3 if dtype != torch.float32 else 5)
    assert_close(out, ref, tol, what)
    assert_close(args[13], ref_args[13], tol, what + " k_cache")
    assert_close(args[14], ref_args[14], tol, what + " v_cache")
    if device == "cuda":
        assert kernels.error_flag(torch.device(device)).item() == 0, "a wait of the persistent kernel timed out"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layers(device, dtype):
    for case in CASES[device]:
        for splits in (1, 3):
            _check(_args(*case, dtype, device, splits=splits), dtype, device, f"{case} S{splits}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_layers_bias_no_qk_norm(device):
    """Qwen2's layer: a qkv bias, no per-head norms; a rotary dim below the head dim."""
    case = CASES[device][0]
    args = list(_args(*case, torch.float32, device, bias=True, qk_norm=False))
    args[18] = case[4] // 2
    _check(tuple(args), torch.float32, device, f"{case} bias")


def _fp8(args: tuple) -> tuple:
    """``_args`` with the four linear weights in Qwen's FP8 block format, their scales appended."""
    args, scales = list(args), []
    for i in (5, 9, 11, 12):  # qkv, o, gate_up, down
        parts = [qwen_ops.quantize_weight_fp8_block(w) for w in args[i]]
        args[i] = torch.stack([w for w, _ in parts])
        scales.append(torch.stack([s for _, s in parts]))
    return tuple(args + scales)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_layers_fp8(device):
    """FP8 weights: on the CPU K of 160 and 136 (two scale blocks, the last partial) and 40 rows
    of o_proj's K (one block, narrower than 128); Qwen3-0.6B's layer on CUDA."""
    case = (2, 160, 4, 2, 48, 136, 2, 16, 2) if device == "cpu" else CASES["cuda"][0]
    for splits in (1, 3):
        _check(_fp8(_args(*case, torch.bfloat16, device, splits=splits)), torch.bfloat16, device,
               f"{case} fp8 S{splits}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_layers_reaches_every_position(device):
    """A row writes its new key and value only at a position below its length and within the
    block table's reach: a padding row (length 0, as a captured engine step pads with) and a
    position past the reach write nothing; a padding row reads nothing either."""
    args = list(_args(*CASES[device][0], torch.float32, device))
    k_before, v_before = args[13].clone(), args[14].clone()
    torch.ops.qwen.decode_layers(*args)
    assert not torch.equal(args[13], k_before)  # positions seq_len - 1: written
    args[2] = torch.zeros_like(args[2])
    k_before, v_before = args[13].clone(), args[14].clone()
    out = torch.ops.qwen.decode_layers(*args)
    assert torch.isfinite(out).all()
    assert torch.equal(args[13], k_before) and torch.equal(args[14], v_before)
    args[1] = torch.full_like(args[1], args[3].shape[1] * args[13].shape[2])  # one past the reach
    args[2] = torch.full_like(args[2], args[3].shape[1] * args[13].shape[2])
    torch.ops.qwen.decode_layers(*args)
    assert torch.equal(args[13], k_before) and torch.equal(args[14], v_before)


def test_decode_layers_errors():
    args = _args(*CASES["cpu"][0], torch.float32, "cpu")
    rows = qwen_ops.DECODE_LAYERS_MAX_ROWS
    bad = {
        f"x must hold at most {rows} rows": dict(x=randn(rows + 1, 40, dtype=torch.float32, device="cpu")),
        "layers stacked": dict(qkv_weight=args[5][:, :-1]),
        "num_heads": dict(num_heads=3),
        "num_splits": dict(num_splits=0),
        "block_table must be": dict(block_table=args[3][:, :0]),
        "cache_seqlens must lie in": dict(cache_seqlens=args[2] + 1000),
    }
    names = ["x", "positions", "cache_seqlens", "block_table", "input_norm", "qkv_weight", "qkv_bias", "q_norm",
             "k_norm", "o_weight", "post_norm", "gate_up_weight", "down_weight", "k_cache", "v_cache", "eps",
             "offset", "theta", "rotary_dim", "num_heads", "num_splits"]
    for message, change in bad.items():
        a = list(args)
        for name, value in change.items():
            a[names.index(name)] = value
        with pytest.raises(qwen_ops.QwenOpError, match=message):
            torch.ops.qwen.decode_layers(*a)
    args = _args(*CASES["cpu"][2], torch.float32, "cpu")  # two rows: the kernel reads row m at m
    for i, name in ((1, "positions"), (2, "cache_seqlens")):
        a = list(args)
        a[i] = torch.stack([args[i], args[i]], 1)[:, 0]
        with pytest.raises(qwen_ops.QwenOpError, match=f"{name} must be contiguous"):
            torch.ops.qwen.decode_layers(*a)


def test_tile_rows():
    rows = lambda elems, k: max(1, elems // k)  # noqa: E731
    assert kernels.tile_rows(4096, 1024, 2) == rows(kernels.TILE_ELEMS, 1024)
    assert kernels.tile_rows(1024, 3072, 2) == rows(kernels.TILE_ELEMS, 4096)  # K padded to a power of two
    assert kernels.tile_rows(4, 16, 2) == 4  # never more rows than the matrix
    assert kernels.tile_rows(1024, 1024, 4) == rows(kernels.TILE_ELEMS // 2, 1024)  # fp32: half the elements


@pytest.mark.cuda
def test_decode_layers_replays_in_cuda_graph():
    """The persistent kernel captured once in a CUDA graph (its per-device buffers reserved before
    the capture: qwen_ops.reserve_decode_buffers), replayed with other rows, positions, lengths and
    block tables, gives what eager calls give; no wait timed out."""
    case = CASES["cuda"][1]
    args = _args(*case, torch.bfloat16, "cuda")
    qwen_ops.reserve_decode_buffers("cuda")
    torch.ops.qwen.decode_layers(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.qwen.decode_layers(*args)
    for seed in (1, 2, 3):
        fresh = _args(*case, torch.bfloat16, "cuda", seed=seed)
        for i in range(4):  # x, positions, cache_seqlens, block_table
            args[i].copy_(fresh[i])
        caches = (args[13].clone(), args[14].clone())
        graph.replay()
        replayed = (static_out.clone(), args[13].clone(), args[14].clone())
        args[13].copy_(caches[0])
        args[14].copy_(caches[1])
        eager = torch.ops.qwen.decode_layers(*args)
        assert torch.equal(replayed[0], eager), f"replay {seed}: the output differs from eager"
        assert torch.equal(replayed[1], args[13]) and torch.equal(replayed[2], args[14]), f"replay {seed}: the caches"
    assert kernels.error_flag(torch.device("cuda")).item() == 0, "a wait of the persistent kernel timed out"


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_model_decode_layers(batch):
    """The engine's steps through the persistent kernel against op by op, Qwen3-0.6B's shape
    (``assert_persistent_decode_matches_ops``)."""
    from modeling.model.random_checkpoint import QWEN3_0_6B

    assert_persistent_decode_matches_ops(QWEN3_0_6B, batch)


def test_inference_weights_are_stacked_before_any_step_is_captured():
    """An engine whose decode steps may take the persistent kernel stacks the layer weights of its
    model when it is made, before any step is captured (a step captured before the stacking would
    go on reading the freed per-layer tensors); ``stack_layer_weights`` refuses a model being
    trained and one the kernels do not take, and an engine that never takes the kernel (the CPU's
    table, a hybrid model by default) leaves the weights as they are. A hybrid model asked for the
    persistent kernel stacks its weights for ``decode_hybrid_layers``."""
    from modeling import Engine, QwenConfig
    from modeling.model.random_checkpoint import random_model
    from tests.test_engine import QWEN3, QWEN3_5

    def stacked(config, kernels):
        model = random_model(QwenConfig.from_dict(config), dtype=torch.float32, device="cpu", std=0.2)
        before = model.layers[-1].qkv_weight.data_ptr()
        Engine(model, max_num_seqs=2, max_model_len=32, decode_kernels=kernels)
        stacks = model._stacks
        if stacks is not None:
            assert model.layers[-1].qkv_weight.data_ptr() != before
            assert all(layer.qkv_weight.data_ptr() == stacks[1][i].data_ptr() for i, layer in enumerate(model.layers))
        assert (model.layers[-1].qkv_weight.data_ptr() == before) == (stacks is None)
        return stacks is not None

    assert stacked(QWEN3, "persistent")
    assert not stacked(QWEN3, None)  # the CPU's table: no persistent kernel
    assert not stacked(QWEN3_5, None)
    model = random_model(QwenConfig.from_dict(QWEN3), dtype=torch.float32, device="cpu", std=0.2)
    with pytest.raises(ValueError, match="for inference models: a parameter requires grad"):
        model.requires_grad_(True).stack_layer_weights()
    hybrid = random_model(QwenConfig.from_dict(QWEN3_5), dtype=torch.float32, device="cpu", std=0.2)
    before = hybrid.layers[0].in_proj_weight.data_ptr()
    Engine(hybrid, max_num_seqs=2, max_model_len=32, decode_kernels="persistent")
    assert hybrid.layers[0].in_proj_weight.data_ptr() != before
    assert hybrid._kinds == [1, 0, 1, 0]  # Gated DeltaNet, gated attention, ...
    moe = QwenConfig.from_dict(dict(QWEN3_5, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, shared_expert_intermediate_size=16))
    with pytest.raises(ValueError, match="the persistent decode kernels take .* with dense MLPs"):
        random_model(moe, dtype=torch.float32, device="cpu", std=0.2).stack_layer_weights()
    with pytest.raises(ValueError, match="decode_kernels='persistent' needs a model of attention layers"):
        Engine(random_model(moe, dtype=torch.float32, std=0.2), max_num_seqs=2, max_model_len=32,
               decode_kernels="persistent")


@pytest.mark.cuda
def test_steps_captured_before_the_first_decode_step_keep_their_weights():
    """The engine captures a prompt's prefill step before its first decode step (whose persistent
    kernel reads the stacked weights): with fresh allocations reusing whatever memory was freed
    between two generations, the second generation's tokens equal the first's. Without prefix
    caching: the second generation would read its prompt's cached blocks, a path whose bf16 logits
    may differ by an ulp from a whole prefill's and so flip this random model's near-ties."""
    from modeling import Engine, QwenConfig, SamplingParams
    from modeling.model.random_checkpoint import QWEN3_0_6B, random_model

    model = random_model(QwenConfig.from_dict(dict(QWEN3_0_6B, num_hidden_layers=4)), dtype=torch.bfloat16,
                         device="cuda", std=0.05)
    engine = Engine(model, max_num_seqs=1, max_model_len=256, prefix_caching=False)
    prompt = [list(range(5, 60))]
    first = engine.generate(prompt, SamplingParams(), 24)
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 20, 1 << 21, 1 << 22, 1 << 23)]
    assert engine.generate(prompt, SamplingParams(), 24) == first
    del junk
