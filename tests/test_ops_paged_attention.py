"""qwen::kv_cache_store_slots and qwen::paged_attention (a paged KV cache): against their references
on mixed batches of decode rows and prefill chunks (shuffled block ids, every cache slot outside a
sequence NaN, outputs poisoned), each KV split and tile mode, decode steps over lengths on every
block and split edge, index tensors read through their strides, the kernel's clamping of bad
device values, agreement with attention on the equivalent contiguous caches (decode rows sequence
by sequence, prompts and chunks), opcheck and clear errors; `cuda`: Qwen3-0.6B and Qwen3.5 shapes,
and one CUDA graph replayed at other lengths."""
import subprocess
import sys

import pytest
import torch

import qwen_ops
from csrc_free_ops.common import cdiv
from qwen_ops import kv_cache_store_slots_reference, paged_attention_reference
from tests.helpers import DEVICES, DTYPES, ROOT, assert_close, randn

NAN = float("nan")


def paged_batch(block_size, hq, hk, d, qlens, seq_lens, dtype, device, spare_blocks=3, seed=0):
    """(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table): sequence i has qlens[i] new tokens
    among seq_lens[i] cached positions, its blocks drawn from a shuffled pool with spare blocks in
    between. Every cache slot outside a sequence is NaN, and the table entries past a sequence's
    blocks are -1 or past num_blocks: the kernel must read neither."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = torch.randperm(num_blocks, generator=g)
    table = torch.empty((len(seq_lens), max(need, default=0) + 1), dtype=torch.int32)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used = 0
    for i, (n, blocks) in enumerate(zip(seq_lens, need)):
        table[i, :blocks] = ids[used:used + blocks]
        table[i, blocks:] = -1 if i % 2 else num_blocks + 7
        used += blocks
        pos = torch.arange(n)
        live[table[i, pos // block_size].long() * block_size + pos % block_size] = True
    k_cache = randn(num_blocks, block_size, hk, d, dtype=dtype, device=device)
    v_cache = randn(num_blocks, block_size, hk, d, dtype=dtype, device=device)
    live = live.to(device)
    k_cache.view(-1, hk, d)[~live] = NAN
    v_cache.view(-1, hk, d)[~live] = NAN
    cu = torch.tensor([0] + torch.tensor(qlens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(int(cu[-1]), hq, d, dtype=dtype, device=device)
    return (q, k_cache, v_cache, cu.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
            table.to(device))


# (block_size, q heads, kv heads, head_dim, new tokens per sequence, cached lengths)
CPU_BATCHES = [
    # one tile per sequence: lengths 1 and 2 * block_size, a 12-token chunk over a 28-token prefix,
    # a sequence not in this step (qlen 0), a fresh 3-token prompt
    (16, 4, 2, 32, [1, 1, 12, 0, 1, 3], [1, 32, 40, 9, 17, 3]),
    # query tiles (24 x 3 rows > 64): GQA group 3, a 24-token chunk ending on a block edge, a
    # padding sequence (qlen 0, length 0), a prompt of 9
    (32, 3, 1, 16, [24, 1, 0, 9], [64, 70, 0, 9]),
    # query tiles of 16 tokens x group 4: a padding sequence of 2 tokens and length 0 (zeros)
    (16, 4, 1, 64, [1, 2, 1, 17], [50, 0, 16, 33]),
    # no GQA, decode rows only
    (16, 2, 2, 16, [1, 1, 1], [5, 16, 48]),
]


def _rng_lens(n, lo, hi, seed):
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CUDA_BATCHES = [
    (bs, hq, hk, d, qlens, lens)
    for bs in (16, 64) for hq, hk, d in ((16, 8, 128), (8, 2, 256))
    for qlens, lens in (([2048], [2048]),  # a fresh 2048-token prompt
                        ([1] * 64, _rng_lens(64, 1000, 4000, bs + d)),  # 64 decode rows
                        ([1] * 63 + [0, 512], _rng_lens(63, 1000, 4000, d) + [77, 1536 + 512]))  # mixed
]


def _check_batch(batch, what):
    out = torch.ops.qwen.paged_attention(*batch[:6], 0.125, int((batch[3][1:] - batch[3][:-1]).max()))
    ref = paged_attention_reference(*batch[:6], 0.125, 0)
    assert_close(out, ref, what=what)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_reference(device, dtype, nan_empty):
    for bs, hq, hk, d, qlens, lens in (CPU_BATCHES if device == "cpu" else CUDA_BATCHES):
        batch = paged_batch(bs, hq, hk, d, qlens, lens, dtype, device)
        out = _check_batch(batch, f"block {bs} heads {hq}/{hk} d{d} qlens {qlens[:6]} lens {lens[:6]}")
        for i, n in enumerate(lens):
            if n == 0:  # a padding sequence: its rows see no key
                assert not out[batch[3][i]:batch[3][i + 1]].any(), "rows of a length-0 sequence must be zeros"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [48, 80], ids=["d48", "d80"])
def test_paged_attention_head_dims_not_powers_of_two(device, d, nan_empty):
    """A head dim inside a wider power-of-two block: the dims past D are masked on every load and
    store (decode rows and a chunk over a cached prefix; splits through the combine on CUDA)."""
    cases = [(16, 4, 2, d, [1, 12, 1], [33, 40, 17])] if device == "cpu" else \
        [(16, 16, 8, d, [1] * 31 + [512], _rng_lens(31, 100, 3000, d) + [1536])]
    for bs, hq, hk, d_, qlens, lens in cases:
        batch = paged_batch(bs, hq, hk, d_, qlens, lens, torch.bfloat16, device)
        _check_batch(batch, f"head_dim {d}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_paged_attention_every_split_count(device, splits, nan_empty):
    """Both tile modes with one, two and three KV splits (one split writes o directly, more go
    through the combine pass); key blocks end mid-split and mid-table-block, and with three splits
    (of 128 keys) the third starts between the positions of one tile's queries (255 and 256; 237
    to 268), whose first rows see none of its keys."""
    from csrc_free_ops.paged_attention import paged_attention as kernel, plan

    cases = [(16, 4, 2, 32, [1, 1, 2], [150, 70, 257]), (32, 2, 1, 16, [33, 0, 1], [270, 9, 100])]
    for bs, hq, hk, d, qlens, lens in cases:
        q, *rest = paged_batch(bs, hq, hk, d, qlens, lens, torch.float32, device)
        max_q = max(qlens)
        p = plan(q.shape[0], len(lens), hk, hq // hk, d, max_q, rest[4].shape[1] * bs, 4, 264, splits)
        assert p.num_splits == splits
        assert_close(kernel(q, *rest, 0.3, max_q, splits), paged_attention_reference(q, *rest, 0.3, max_q),
                     what=f"{splits} splits, one tile per sequence={p.one_tile_per_seq}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tq", [1, 2])
def test_paged_attention_decode_length_boundaries(device, dtype, tq, nan_empty):
    """One decode step (tq new tokens per sequence: one tile per sequence, two or more KV splits)
    over lengths on every edge the key loop has: 1 and tq, the table's blocks (16), the key blocks
    and splits (16 or 64) and one past them, the table's reach; every slot past each length is NaN
    and must not reach the output. At length 65 with tq = 2 the first query sees no key of the split
    from 64: its row stays masked through that split (shifted by 0, not by -inf, which would make
    NaN) and weighs nothing in the combine."""
    from csrc_free_ops.common import target_programs
    from csrc_free_ops.paged_attention import plan

    lens = [n for n in (1, 2, 15, 16, 17, 63, 64, 65, 66, 95, 96) if n >= tq]
    batch = paged_batch(16, 4, 2, 16, [tq] * len(lens), lens, dtype, device)
    p = plan(batch[0].shape[0], len(lens), 2, 2, 16, tq, batch[5].shape[1] * 16, batch[0].element_size(),
             target_programs(batch[0].device))
    assert p.one_tile_per_seq and p.num_splits >= 2, p
    _check_batch(batch, f"decode rows of {tq}, lengths {lens}")


def test_plan_modes_and_splits_depend_on_shapes_only():
    """Decode batches get one tile per sequence (the grid is the sequence count), longer chunks
    query tiles covering any batch of N tokens; the split count is a function of the shapes and
    host ints alone, and gives a short grid more splits."""
    from csrc_free_ops.paged_attention import plan

    decode = plan(64, 64, 8, 2, 128, 1, 4096, 2, 264)
    assert decode.one_tile_per_seq and decode.block_m == 16 and decode.tiles == 64
    prefill = plan(2048, 1, 8, 2, 128, 2048, 2048, 2, 264)
    assert not prefill.one_tile_per_seq and prefill.block_q == 32 and prefill.tiles == 2048 // 32 + 1
    assert prefill.num_splits == 1
    few = plan(4, 4, 2, 4, 256, 1, 4096, 2, 264)
    assert 1 < few.num_splits <= 4096 // few.block_n
    # a GPU with fewer SMs aims for fewer programs: fewer splits of the same keys
    assert plan(4, 4, 2, 4, 256, 1, 4096, 2, 2 * 66).num_splits < few.num_splits


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reach", ["near", "far"])
def test_paged_attention_kernel_clamps_bad_values(device, reach):
    """The kernel (no host check on CUDA) clamps: seq_lens past the table's reach or negative, block
    ids -1 or past num_blocks, cu_seqlens_q past N. "near": each bad value one block or one table
    entry past its bound, with the caches and the block table views of padded storage (NaN around
    the caches, valid block ids after the table), so that without its clamp the kernel reads the
    padding and the test fails by assertion. "far": seq_lens >= 2^31 (int64), a block id of 10^6,
    rows past N: without a clamp the kernel would read or write far outside its tensors, which
    crashes the interpreter, so this case runs in a process of its own whose failure, crash
    included, fails the test. The result is the reference's on the clamped values."""
    if reach == "near":
        clamped_case(device, reach)
        return
    code = f"from tests.test_ops_paged_attention import clamped_case; clamped_case({device!r}, {reach!r})"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n" + "\n".join(p.stderr.splitlines()[-20:])


def clamped_case(device: str, reach: str) -> None:
    """test_paged_attention_kernel_clamps_bad_values' case (``reach`` "near" or "far")."""
    from csrc_free_ops.paged_attention import paged_attention as kernel

    bs, hq, hk, d, nb = 16, 4, 2, 16, 6
    storage = torch.full((2, nb + 2, bs, hk, d), NAN, device=device)
    storage[:, 1:nb + 1] = randn(2, nb, bs, hk, d, dtype=torch.float32, device=device)
    k_cache, v_cache = storage[0, 1:nb + 1], storage[1, 1:nb + 1]
    q = randn(7, hq, d, dtype=torch.float32, device=device)
    tables = torch.full((7, 2), 3, dtype=torch.int32, device=device)
    table = tables[1:6]
    if reach == "near":
        table.copy_(torch.tensor([[0, 1], [2, -1], [4, nb], [1, 0], [5, 3]]))
        lens = torch.tensor([2 * bs + 1, -1, 2 * bs + 1, 1, 20], dtype=torch.int64, device=device)
        cu = torch.tensor([0, 1, 2, 3, 5, 7], dtype=torch.int32, device=device)
    else:
        table.copy_(torch.tensor([[0, 1], [2, -1], [4, 10**6], [1, 0], [5, 3]]))
        lens = torch.tensor([2 * bs + 40, -3, 2**31 + 5, 1, 20], dtype=torch.int64, device=device)
        cu = torch.tensor([0, 1, 2, 3, 5, 11], dtype=torch.int32, device=device)  # the last sequence claims rows past N=7
    out = kernel(q, k_cache, v_cache, cu, lens, table, 0.25, 2)
    clamped = (torch.tensor([0, 1, 2, 3, 5, 7], device=device), torch.tensor([2 * bs, 0, 2 * bs, 1, 20], device=device),
               table.clamp(0, nb - 1))
    ref = paged_attention_reference(q, k_cache, v_cache, clamped[0], clamped[1], clamped[2], 0.25, 2)
    assert_close(out, ref, what="clamped values")
    assert not out[1].any(), "a negative length sees no key"
    assert not out[3].any() and out[4].any(), "a query before position 0 (length 1 < 2 new tokens) sees no key"


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_queries_that_see_no_key_give_zeros(device):
    """A length below the sequence's query count (what the kernel makes of bad values, where it
    clamps instead of checking) puts its first queries at negative positions: they see no key and
    output zeros, in the kernel and in the reference, which is what the op runs on the CPU without
    the interpreter (its softmax over no key alone would be NaN)."""
    from csrc_free_ops.paged_attention import paged_attention as kernel

    bs, hq, hk, d = 16, 4, 2, 16
    k_cache, v_cache = (randn(2, bs, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    q = randn(4, hq, d, dtype=torch.float32, device=device)
    cu, lens = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([0, 4], [2]))
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    ref = paged_attention_reference(q, k_cache, v_cache, cu, lens, table, 0.25, 4)
    assert ref[2:].abs().sum() > 0 and not ref[:2].any(), "queries at positions -2 and -1 see no key: zeros"
    assert_close(kernel(q, k_cache, v_cache, cu, lens, table, 0.25, 4), ref, what="no key, then keys")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tq", [1, 2])
def test_paged_attention_decode_rows_equal_attention(device, tq):
    """A contiguous cache [B, L, Hk, D] is a paged one with one block of L per sequence and the table
    [[0], [1], ...]: decode rows over it give, sequence by sequence, causal attention of the tq
    queries over the sequence's first seq_len keys (Sk > Sq, the queries last), ragged lengths
    from tq to L."""
    b, cache_len, hq, hk, d = 3, 64, 4, 2, 32
    k_cache, v_cache = (randn(b, cache_len, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    q = randn(b, tq, hq, d, dtype=torch.float32, device=device)
    lens = [tq, 37, cache_len]
    cu = torch.arange(0, b * tq + 1, tq, dtype=torch.int32, device=device)
    table = torch.arange(b, dtype=torch.int32, device=device)[:, None]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.ops.qwen.paged_attention(q.flatten(0, 1), k_cache, v_cache, cu, seq_lens, table, 0.2, tq)
    for i, n in enumerate(lens):
        expected = torch.ops.qwen.attention(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], 0.2)
        assert_close(out.view(b, tq, hq, d)[i], expected[0], what=f"paged vs attention, sequence of length {n}")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_strided_index_tensors(device):
    """cu_seqlens_q and seq_lens as every other element of a wider tensor (the others values that
    would break the result if read), the block table column-major: read through their strides."""
    q, kc, vc, cu, lens, table = paged_batch(16, 4, 2, 16, [1, 3, 1], [5, 20, 40], torch.float32, device)

    def every_other(t):
        return torch.stack([t, torch.full_like(t, 10**6)], 1)[:, 0]

    strided = (every_other(cu), every_other(lens), table.t().contiguous().t())
    assert strided[0].stride() == strided[1].stride() == (2,) and strided[2].stride() == (1, 3)
    assert_close(torch.ops.qwen.paged_attention(q, kc, vc, *strided, 0.25, 3),
                 paged_attention_reference(q, kc, vc, cu, lens, table, 0.25, 3), what="strided index tensors")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_equals_attention(device):
    """A fresh prompt stored through kv_cache_store_slots (one block of L per sequence) gives
    attention's causal prefill; its last rows as a chunk over the cached prefix give attention with
    Sk > Sq."""
    b, s, cache_len, hq, hk, d = 2, 40, 64, 6, 2, 16
    q, k, v = (randn(b, s, h, d, dtype=torch.float32, device=device) for h in (hq, hk, hk))
    k_cache, v_cache = (torch.full((b, cache_len, hk, d), NAN, device=device) for _ in range(2))
    slots = (torch.arange(b, device=device)[:, None] * cache_len + torch.arange(s, device=device)).flatten()
    torch.ops.qwen.kv_cache_store_slots(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots)
    lens = torch.full((b,), s, dtype=torch.int32, device=device)
    table = torch.arange(b, dtype=torch.int32, device=device)[:, None]
    for chunk in (s, 16):
        cu = torch.arange(0, b * chunk + 1, chunk, dtype=torch.int32, device=device)
        rows = q[:, -chunk:].flatten(0, 1)
        out = torch.ops.qwen.paged_attention(rows, k_cache, v_cache, cu, lens, table, 0.25, chunk)
        assert_close(out.view(b, chunk, hq, d), torch.ops.qwen.attention(q[:, -chunk:], k, v, 0.25),
                     what=f"paged vs attention, chunk of {chunk}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_kv_cache_store_slots_matches_reference(device, dtype, slot_dtype):
    """k and v are views of one fused activation; slots shuffled across blocks, with padding (-1)
    and slots past the cache, which are not written (the caches are views of a longer storage)."""
    n, nb, bs, hk, d = (7, 3, 16, 2, 32) if device == "cpu" else (4096, 512, 16, 8, 128)
    kv = randn(n, 2 * hk * d + 8, dtype=dtype, device=device)
    k, v = kv[:, :hk * d].view(n, hk, d), kv[:, hk * d:2 * hk * d].view(n, hk, d)
    slots = torch.randperm(nb * bs, device=device)[:n].to(slot_dtype)
    slots[1], slots[-1] = -1, nb * bs
    storage = torch.full((2, nb + 2, bs, hk, d), NAN, dtype=dtype, device=device)
    k_cache, v_cache = storage[0, 1:nb + 1], storage[1, 1:nb + 1]
    expected = storage.clone()
    kv_cache_store_slots_reference(k, v, expected[0, 1:nb + 1], expected[1, 1:nb + 1], slots)
    torch.ops.qwen.kv_cache_store_slots(k, v, k_cache, v_cache, slots)
    assert torch.equal(storage.nan_to_num(7.0), expected.nan_to_num(7.0))
    written = storage.isfinite().all(-1).all(-1).sum().item()
    assert written == 2 * (n - 2), "the slots in range are written, the others and the storage around not"


@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_ops_on_empty_inputs(device, nan_empty):
    """No new token (every sequence idle), no sequence at all, no token to store: empty outputs,
    caches untouched."""
    q, kc, vc, _, lens, table = paged_batch(16, 4, 2, 16, [0, 0], [5, 20], torch.float32, device)
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    assert torch.ops.qwen.paged_attention(q, kc, vc, cu, lens, table, 0.5, 0).shape == (0, 4, 16)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    assert torch.ops.qwen.paged_attention(q, kc, vc, cu[:1], none, table[:0], 0.5, 0).shape == (0, 4, 16)
    before = kc.clone()
    torch.ops.qwen.kv_cache_store_slots(q[:, :2], q[:, :2], kc, vc, none)
    assert torch.equal(kc.nan_to_num(7.0), before.nan_to_num(7.0))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, kc, vc, cu, lens, table = paged_batch(16, 4, 2, 16, [1, 3], [20, 3], torch.float32, device)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    torch.library.opcheck(torch.ops.qwen.paged_attention.default, (q, kc, vc, cu, lens, table, 0.5, 3))
    kv = randn(3, 2, 32, dtype=torch.float32, device=device)
    slots = torch.tensor([5, -1, 40], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.qwen.kv_cache_store_slots.default, (kv[..., :16], kv[..., 16:], kc, vc, slots))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    """The slot store then attention over the cache in one compiled function, no graph break (on
    CUDA traced into the kernels), same result as eager."""
    q, kc, vc, cu, lens, table = paged_batch(16, 4, 2, 16, [1, 20], [30, 20], torch.float32, device)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    k, v = (randn(q.shape[0], 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    seq = torch.tensor([0] + [1] * 20, device=device)
    pos = torch.tensor([29] + list(range(20)), device=device)  # the new tokens' positions
    slots = table[seq, pos // 16] * 16 + pos % 16

    def step(q, k, v, k_cache, v_cache):
        torch.ops.qwen.kv_cache_store_slots(k, v, k_cache, v_cache, slots)
        return torch.ops.qwen.paged_attention(q, k_cache, v_cache, cu, lens, table, 0.25, 20)

    caches = (kc.clone(), vc.clone())
    expected = step(q, k, v, *caches)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert_close(compiled(q, k, v, kc, vc), expected, what="compiled vs eager")
    assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1])


def _cache(nb=4, bs=16, hk=2, d=16, dtype=torch.float32):
    return torch.zeros(nb, bs, hk, d, dtype=dtype)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _args(**changes):
    """paged_attention's arguments: two sequences (qlens 1 and 2, lengths 5 and 20), changed by name."""
    args = dict(q=torch.randn(3, 4, 16), k_cache=_cache(), v_cache=_cache(), cu_seqlens_q=_i32([0, 1, 3]),
                seq_lens=_i32([5, 20]), block_table=_i32([[0, 3], [1, 2]]), scale=0.5, max_query_len=2)
    args.update(changes)
    return tuple(args.values())


def _store_args(k_shape=(2, 2, 16), v_shape=(2, 2, 16), hk=2, slots=_i32([0, 1])):
    return torch.randn(k_shape), torch.randn(v_shape), _cache(hk=hk), _cache(hk=hk), slots


ERRORS = [
    ("paged_attention", _args(q=torch.randn(1, 3, 4, 16)), "q must have 3 dims"),
    ("paged_attention", _args(k_cache=_cache(bs=24), v_cache=_cache(bs=24)),
     "block_size (k_cache.shape[1]) must be a power of two >= 16, got 24"),
    ("paged_attention", _args(k_cache=_cache(bs=8), v_cache=_cache(bs=8)), "must be a power of two >= 16, got 8"),
    ("paged_attention", _args(v_cache=torch.zeros(4, 32, 2, 16)[:, :16]), "v_cache must be contiguous"),
    ("paged_attention", _args(v_cache=_cache(nb=5)), "must have the same shape"),
    ("paged_attention", _args(k_cache=_cache(dtype=torch.float16)),
     "k_cache has dtype torch.float16 but q has torch.float32"),
    ("paged_attention", _args(q=torch.randn(3, 3, 16)), "multiple of kv heads"),
    ("paged_attention", _args(q=torch.randn(3, 4, 32)), "q has head_dim 32 but k_cache has 16"),
    ("paged_attention", _args(cu_seqlens_q=_i32([0, 3])), "cu_seqlens_q must have shape (3,)"),
    ("paged_attention", _args(block_table=torch.zeros(3, 2, dtype=torch.int32)), "block_table must have shape (2, 2)"),
    ("paged_attention", _args(block_table=torch.zeros(2, 2)), "block_table must be int32 or int64"),
    ("paged_attention", _args(seq_lens=_i32([[5], [20]])), "seq_lens must be [num_seqs]"),
    ("paged_attention", _args(scale=0.0), "scale must be a positive finite number"),
    ("paged_attention", _args(max_query_len=-1), "max_query_len must be >= 0"),
    # values, checked on CPU tensors
    ("paged_attention", _args(cu_seqlens_q=_i32([0, 1, 2])), "cu_seqlens_q must rise from 0 to N=3"),
    ("paged_attention", _args(cu_seqlens_q=_i32([1, 1, 3])), "cu_seqlens_q must rise from 0"),
    ("paged_attention", _args(cu_seqlens_q=_i32([0, 4, 3])), "cu_seqlens_q must rise from 0"),
    ("paged_attention", _args(max_query_len=1), "a sequence has 2 new tokens, more than max_query_len=1"),
    ("paged_attention", _args(seq_lens=_i32([5, 1])), "seq_lens[1]=1 must be 0 (padding) or lie in [qlen=2, 32]"),
    ("paged_attention", _args(seq_lens=_i32([33, 20])), "seq_lens[0]=33 must be 0"),
    ("paged_attention", _args(block_table=_i32([[0, -1], [1, -1]])),
     "block_table entries a sequence reads must lie in [0, num_blocks=4), got values in [-1, 1]"),
    ("paged_attention", _args(block_table=_i32([[4, 0], [1, 2]])), "got values in [1, 4]"),
    ("kv_cache_store_slots", _store_args(hk=1), "does not match k_cache"),
    ("kv_cache_store_slots", _store_args(v_shape=(3, 2, 16)), "k (2, 2, 16) and v (3, 2, 16) must have the same shape"),
    ("kv_cache_store_slots", _store_args(slots=_i32([0, 1, 2])), "slot_mapping must have shape (2,)"),
    ("kv_cache_store_slots", _store_args(slots=torch.zeros(2)), "slot_mapping must be int32 or int64"),
]


@pytest.mark.parametrize("name,args,message", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_input_raises_clear_error(name, args, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(qwen_ops.QwenOpError, match=f"qwen.{name}: .*" + escaped):
        getattr(torch.ops.qwen, name)(*args)


@pytest.mark.cuda
def test_paged_attention_one_cuda_graph_serves_every_length():
    """A decode step captured once (max_query_len 1) and replayed with other lengths and block
    tables gives what eager calls give: nothing in the launch depends on the device values."""
    bs, hq, hk, d, seqs = 16, 16, 8, 128, 8
    batch = list(paged_batch(bs, hq, hk, d, [1] * seqs, [4000] * seqs, torch.bfloat16, "cuda", spare_blocks=40))
    static_q, kc, vc, cu, lens, table = batch
    kc.nan_to_num_(0.0)
    vc.nan_to_num_(0.0)
    torch.ops.qwen.paged_attention(static_q, kc, vc, cu, lens, table, d ** -0.5, 1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.qwen.paged_attention(static_q, kc, vc, cu, lens, table, d ** -0.5, 1)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        static_q.copy_(torch.randn(static_q.shape, generator=g).to(static_q))
        lens.copy_(torch.randint(1, 4001, (seqs,), generator=g).to(lens))
        table.copy_(torch.randperm(kc.shape[0], generator=g)[:table.numel()].view(table.shape).to(table))
        graph.replay()
        assert_close(static_out, torch.ops.qwen.paged_attention(static_q, kc, vc, cu, lens, table, d ** -0.5, 1),
                     rel_tol=0.0, what=f"replay {step}")


@pytest.mark.cuda
def test_paged_cache_ops_replay_launch_plans():
    """Both launchers only allocate and launch, so eager calls replay launch plans
    (qwen_ops/plans.py): a plan is made for each op, and a replayed call gives the first call's result."""
    from qwen_ops.registry import plan_tables

    q, kc, vc, cu, lens, table = paged_batch(16, 16, 8, 128, [1] * 6 + [40], [900] * 6 + [100], torch.bfloat16, "cuda")
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:q.shape[0]]
    outs = []
    for _ in range(3):
        torch.ops.qwen.kv_cache_store_slots(q[:, :8], q[:, 8:], kc, vc, slots)
        outs.append(torch.ops.qwen.paged_attention(q, kc, vc, cu, lens, table, 0.1, 40))
    for op in ("kv_cache_store_slots", "paged_attention"):
        assert any(map(callable, plan_tables[op].values())), f"{op}: no plan was made"
    assert torch.equal(outs[0], outs[2])
