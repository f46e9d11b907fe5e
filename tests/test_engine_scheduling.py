"""The engine's host side: block manager (allocation, reference counts, prefix caching, reuse
order), scheduler (chunked prefill under a token budget, preemption by recompute) and the
per-request sampler (seeded streams independent of the batch, the distribution drawn)."""

import random

import pytest
import torch

from modeling.engine.block_manager import BlockManager
from modeling.engine.sampler import sample_rows, uniforms
from modeling.engine.scheduler import Scheduler, StateSlots
from modeling.engine.sequence import Sequence, Status
from modeling.engine.sampling_params import SamplingParams
from tests.test_engine_sampling import ref_probs


def seq(n_prompt, max_tokens=4, first=0):
    return Sequence(list(range(first, first + n_prompt)), SamplingParams(), max_tokens)


def test_blocks_allocate_and_free_every_block():
    bm = BlockManager(8, 4)
    table, hashes = bm.allocate(list(range(9)))  # 9 tokens: 3 blocks
    assert len(table) == 3 and len(set(table)) == 3 and hashes == [] and bm.num_free == 5
    bm.append(table, 13)
    assert len(table) == 4 and bm.num_free == 4
    with pytest.raises(MemoryError):
        bm.allocate(list(range(100, 121)))  # 6 blocks, 4 free
    bm.free(table)
    assert bm.num_free == 8
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(table)


def test_prefix_cache_hits_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    table, _ = bm.allocate(prompt)
    bm.commit(table, prompt, len(prompt), [])  # 2 full blocks registered
    same_start = prompt[:8] + [77, 78, 79]
    table2, hashes = bm.allocate(same_start)
    assert table2[:2] == table[:2] and len(hashes) == 2 and table2[2] not in table
    assert bm.ref_count[table[0]] == 2
    # a prompt of exactly the cached blocks keeps its last block to compute (its logits are needed)
    table3, hashes3 = bm.allocate(prompt[:8])
    assert len(hashes3) == 1 and table3[0] == table[0] and table3[1] != table[1]
    # a different first block shares nothing, even with an equal second block
    _, hashes4 = bm.allocate([99] + prompt[1:])
    assert hashes4 == []


def test_commit_registers_only_the_computed_full_blocks():
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    table, _ = bm.allocate(prompt)
    hashes = []
    bm.commit(table, prompt, 7, hashes)  # tokens 7.. not computed yet: one full block
    assert len(hashes) == 1 and len(bm.cached) == 1
    bm.commit(table, prompt, 7, hashes)  # nothing new
    assert len(hashes) == 1
    bm.commit(table, prompt, 10, hashes)
    assert len(hashes) == 2 and bm.cached[hashes[1]] == table[1]


def test_a_sequences_blocks_are_hashed_once_across_lookups_and_commits(monkeypatch):
    """The scheduler asks can_allocate then allocate for a prompt (every step, while the pool is
    full), and commit registers its blocks as they fill: with the sequence's hash chain (``known``)
    each block is hashed once, and the chain equals the one commit builds without it."""
    import modeling.engine.block_manager as bm_module

    calls = []
    real = bm_module.block_hash
    monkeypatch.setattr(bm_module, "block_hash", lambda block, parent: calls.append(1) or real(block, parent))
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    known = []
    for _ in range(3):
        assert bm.can_allocate(prompt, known)
    table, hit = bm.allocate(prompt, known)
    assert hit == [] and len(known) == 2 and len(calls) == 2  # (10 - 1) // 4 blocks, hashed once
    registered = []
    bm.commit(table, prompt + [10, 11], 12, registered, known)
    assert len(calls) == 3 and registered == known  # only the third block is new
    plain = []
    BlockManager(16, 4).commit(table, prompt + [10, 11], 12, plain)
    assert plain == known
    table2, hit2 = bm.allocate(prompt + [10, 11, 12], [])  # a new sequence, same prefix
    assert hit2 == known and table2[:3] == table[:3]


def test_prefix_cache_survives_free_until_the_block_is_reused_least_recent_first():
    bm = BlockManager(4, 2)
    a = [1, 2, 3, 4, 5]
    table, hashes = bm.allocate(a)
    bm.commit(table, a, len(a), hashes)
    bm.free(table)
    assert bm.num_free == 4
    _, hit = bm.allocate(a)  # still cached after the free
    assert len(hit) == 2
    bm2 = BlockManager(4, 2)
    t1, h1 = bm2.allocate([1, 2, 3])
    bm2.commit(t1, [1, 2, 3], 3, h1)
    bm2.free(t1)
    t2, _ = bm2.allocate([9, 9, 9, 9, 9, 9, 9])  # needs all four blocks: the cached one is reused
    assert sorted(t2) == [0, 1, 2, 3]
    _, hit = bm2.allocate([1, 2, 3]) if bm2.num_free >= 2 else (None, [])
    assert hit == []  # its content was overwritten: the hash was forgotten
    bm2.free(t2)
    _, hit = bm2.allocate([1, 2, 3])
    assert hit == []


def test_a_freed_sequence_gives_its_tail_blocks_for_reuse_first():
    """A sequence's blocks are freed last block first, so new work takes the ends of cached
    prefixes before their starts: a prefix keeps its leading blocks (the ones a later prompt can
    still hit) longest."""
    bm = BlockManager(4, 2)
    prompt = list(range(7))  # 4 blocks, the first 3 full
    table, hashes = bm.allocate(prompt)
    bm.commit(table, prompt, len(prompt), hashes)
    bm.free(table)
    other, _ = bm.allocate([100, 101])
    assert other == [table[-1]]
    blocks, hit = bm.cached_prefix(prompt[:6] + [55])
    assert blocks == table[:3] and hit == hashes  # every cached block still there


def test_a_prompt_whose_every_block_is_known_still_computes_its_last_block():
    """A sequence's hash chain can cover all its tokens (a preempted one: commit hashed its full
    blocks); the lookup still leaves the last block to compute, whose last token gives the logits."""
    bm = BlockManager(8, 4)
    tokens = list(range(8))
    table, hashes = bm.allocate(tokens)
    known = []
    bm.commit(table, tokens, 8, hashes, known)
    assert len(known) == 2 and len(bm.cached) == 2
    blocks, hit = bm.cached_prefix(tokens, known)
    assert blocks == table[:1] and hit == known[:1]


def test_blocks_are_reused_in_the_order_they_were_freed():
    bm = BlockManager(3, 1)
    t = [bm.allocate([i])[0][0] for i in range(3)]
    bm.free([t[1]])
    bm.free([t[0]])
    assert bm.allocate([7])[0] == [t[1]]


def test_scheduler_chunks_prefill_under_the_budget_beside_decodes():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=10)
    short, long = seq(3), seq(25, first=100)
    sch.add(short)
    step = sch.schedule()
    assert [(s is short, n) for s, n in step.work] == [(True, 3)]
    short.num_computed += 3
    short.append(5)
    sch.add(long)
    step = sch.schedule()
    assert [(s is short, n) for s, n in step.work] == [(True, 1), (False, 9)]
    for s, n in step.work:
        s.num_computed += n
    short.append(6)
    step = sch.schedule()
    assert [n for _, n in step.work] == [1, 9] and not step.decode_only


def test_scheduler_preempts_the_youngest_and_readmits_it_first():
    bm = BlockManager(6, 2)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8, first=10)
    sch.add(a)
    sch.add(b)
    for s, n in sch.schedule().work:  # both prefill: 4 of the 6 blocks
        s.num_computed += n
        s.append(1)
    for _ in range(4):  # decode until the blocks run out
        for s, n in sch.schedule().work:
            s.num_computed += n
            s.append(1)
    assert sch.preemptions >= 1 and b.status is Status.WAITING and b.num_computed == 0
    assert sch.waiting[0] is b and bm.num_free + sum(len(s.block_table) for s in sch.running) == 6
    sch.finish(a)
    step = sch.schedule()
    assert step.work[0][0] is b and step.work[0][1] == len(b.tokens)  # recomputed from its tokens


def test_a_preempted_sequence_goes_to_the_front_of_the_queue():
    """Preemption puts its victim before the sequences that were already waiting (it ran first, and
    what it computed is lost): readmitted next, ahead of a request that came after it."""
    bm = BlockManager(6, 2)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(4, max_tokens=8), seq(4, max_tokens=8, first=10), seq(2, max_tokens=2, first=20)
    for s in (a, b, c):
        sch.add(s)
    for _ in range(4):  # c waits (max_num_seqs 2) while a and b decode, until the blocks run out
        for s, n in sch.schedule().work:
            s.num_computed += n
            s.append(1)
    assert sch.preemptions == 1 and b.status is Status.WAITING and list(sch.waiting) == [b, c]
    sch.finish(a)
    assert [s for s, _ in sch.schedule().work] == [b, c]


def test_a_preempted_sequence_waits_for_its_token_in_flight():
    """A sequence preempted while its last sampled token is still on its way to the host
    (``num_pending``, the engine's lookahead step) is readmitted only once that token has landed:
    before, it would recompute its tokens without it, and compute them again for the token."""
    bm = BlockManager(8, 2)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    s = seq(4, max_tokens=8)
    sch.add(s)
    (work,) = sch.schedule().work
    s.num_computed += work[1]
    s.num_pending = 1  # sampled, not read yet
    sch._preempt(s)
    assert sch.schedule().work == [] and list(sch.waiting) == [s]
    s.num_pending = 0
    s.append(7)  # the token lands
    assert sch.schedule().work == [(s, 5)] and s.status is Status.RUNNING


def test_scheduler_refuses_what_can_never_fit():
    sch = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="needs 5 KV blocks; the pool has 4"):
        sch.add(seq(15, max_tokens=5))


def test_state_slots_are_held_while_running_and_given_back():
    slots = StateSlots(2)
    sch = Scheduler(BlockManager(64, 4), 4, 64, slots)
    seqs = [seq(3, first=10 * i) for i in range(3)]
    for s in seqs:
        sch.add(s)
    step = sch.schedule()
    assert len(step.work) == 2 and sorted(s.state_slot for s, _ in step.work) == [0, 1]
    sch.finish(seqs[0])
    assert seqs[0].state_slot is None
    assert sch.schedule().work[-1][0] is seqs[2] and seqs[2].state_slot is not None


def test_uniforms_depend_on_seed_and_position_only():
    seeds = torch.tensor([1, 2, 1, 2**62 + 5])
    pos = torch.tensor([7, 7, 8, 7])
    u = uniforms(seeds, pos, 1000)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(uniforms(seeds[[3, 0]], pos[[3, 0]], 1000), u[[3, 0]])  # batch-independent
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


def test_sample_rows_mixes_greedy_and_seeded_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temp = torch.tensor([0.0, 1.0, 1.0, 0.7])
    top_k, top_p = torch.tensor([0, 0, 5, 1]), torch.tensor([1.0, 1.0, 0.9, 1.0])
    seeds, pos = torch.tensor([3, 3, 4, 5]), torch.tensor([10, 10, 10, 10])
    out = sample_rows(logits, temp, top_k, top_p, seeds, pos, True, True)
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()  # temperature 0, top_k 1
    assert torch.equal(out, sample_rows(logits, temp, top_k, top_p, seeds, pos, True, True))
    assert out[2] in logits[2].topk(5).indices


def test_sample_rows_draws_the_softmax():
    torch.manual_seed(1)
    logits = torch.randn(1, 8) * 2
    temp, top_k, top_p = torch.tensor([0.8]), torch.tensor([0]), torch.tensor([0.9])
    n = 4000
    rng = random.Random(2)
    seeds = torch.tensor([rng.getrandbits(63) for _ in range(n)])
    draws = sample_rows(logits.expand(n, 8), temp.expand(n), top_k.expand(n), top_p.expand(n), seeds,
                        torch.zeros(n, dtype=torch.int64), True, True)
    freq = torch.bincount(draws, minlength=8).float() / n
    want = ref_probs(logits[0], 0.8, 0, 0.9).float()
    assert (freq - want).abs().max() < 0.03
    assert freq[want == 0].sum() == 0
