"""modeling.generation.sampling and modeling.generation.generator: sampling distributions, stopping, ragged batches,
parity with transformers' greedy decoding, and (``cuda``) CUDA-graph decode vs eager.

CPU cost: the transformers parity test runs the Triton kernels (fp32, 2 layers, hidden 64) in
the interpreter; every other generator test uses a float64 model, which always runs the
PyTorch reference ops, so it is fast and exact.
"""

import pytest
import torch

from modeling import QwenConfig
from modeling.generation.generator import Generator
from modeling.model.random_checkpoint import QWEN3_0_6B, random_model
from modeling.generation.sampling import SamplingParams, sample, sampling_mode, sampling_probs
from tests.helpers import hf_greedy

TINY = dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def tiny_model(dtype=torch.float64, device="cpu", seed=0, std=0.2, **overrides):
    config = QwenConfig.from_dict(dict(TINY, **overrides))
    return random_model(config, dtype=dtype, device=device, std=std, seed=seed)


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def row_params(batch, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((batch,), float(temperature)), torch.full((batch,), top_k, dtype=torch.int64),
            torch.full((batch,), float(top_p)))


# ---------------------------------------------------------------------------- sampling


def test_sampling_mode_and_validation():
    assert sampling_mode(0.0, 0, 1.0) == "greedy"
    assert sampling_mode(0.7, 1, 1.0) == "greedy"
    assert sampling_mode(0.7, 0, 1.0) == "sample"
    assert sampling_mode(0.7, 40, 1.0) == "top"
    assert sampling_mode(0.7, 0, 0.9) == "top"
    for bad, word in [(dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                      (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                      (dict(top_p=float("nan")), "top_p"), (dict(seed=-3), "seed")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**bad)


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, *row_params(64), "greedy"), logits.argmax(-1))
    assert torch.equal(sample(logits, *row_params(64, top_k=1), "top", g), logits.argmax(-1))
    # a tiny top-p keeps only the most likely token
    assert torch.equal(sample(logits, *row_params(64, top_p=1e-6), "top", g), logits.argmax(-1))


def test_top_k_keeps_exactly_k():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))
    for k in (1, 3, 17, 40, 100):
        probs = sampling_probs(logits, *row_params(8, top_k=k))
        assert ((probs > 0).sum(-1) == min(k, 40)).all()
        kept = probs > 0
        top = logits.topk(min(k, 40), dim=-1).indices
        assert kept.gather(-1, top).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(8))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_smallest_set_with_mass_p(p):
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(3)) * 2
    full = logits.softmax(-1)
    probs = sampling_probs(logits, *row_params(16, top_p=p))
    for row in range(16):
        order = full[row].argsort(descending=True)
        n_keep = int((full[row][order].cumsum(0) < p).sum()) + 1  # smallest prefix with mass >= p
        kept = set(order[:n_keep].tolist())
        assert set(torch.nonzero(probs[row]).flatten().tolist()) == kept
        expected = torch.zeros(30)
        expected[order[:n_keep]] = full[row][order[:n_keep]] / full[row][order[:n_keep]].sum()
        torch.testing.assert_close(probs[row], expected)


def test_temperature_sampling_frequencies_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 40000
    g = torch.Generator().manual_seed(4)
    for temperature in (0.7, 1.5):
        tokens = sample(logits.expand(draws, -1), *row_params(draws, temperature), "sample", g)
        freq = torch.bincount(tokens, minlength=6).double() / draws
        torch.testing.assert_close(freq, (logits.double() / temperature).softmax(-1), atol=0.01, rtol=0)
    # top-k + top-p: frequencies follow the filtered, renormalized distribution
    tokens = sample(logits.expand(draws, -1), *row_params(draws, 1.0, top_k=4, top_p=0.8), "top", g)
    freq = torch.bincount(tokens, minlength=6).double() / draws
    expected = sampling_probs(logits[None], *row_params(1, 1.0, top_k=4, top_p=0.8))[0].double()
    assert (expected[3:] == 0).all()  # top-k 4 drops 4 and 5; top-p 0.8 drops 3 as well
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_sampling_seed_reproducible():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5))
    runs = []
    for seed in (7, 7, 8):
        g = torch.Generator().manual_seed(seed)
        runs.append(torch.stack([sample(logits, *row_params(4, 1.0, 50, 0.95), "top", g) for _ in range(8)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


# ---------------------------------------------------------------------------- generator (float64)


@pytest.fixture(scope="module")
def model64():
    return tiny_model()


def test_ragged_batch_equals_one_by_one(model64):
    prompts = prompts_of([5, 11, 2, 8, 3], TINY["vocab_size"])
    single = Generator(model64, max_batch_size=1, max_seq_len=32)
    alone = [single.generate([p], 12).tokens[0] for p in prompts]
    batched = Generator(model64, max_batch_size=4, max_seq_len=32)  # 5 prompts: a batch of 4, then of 1
    result = batched.generate(prompts, 12)
    assert result.tokens == alone
    assert result.finish_reasons == ["length"] * 5
    assert all(len(t) == 12 for t in alone)
    assert len({tuple(t) for t in alone}) == 5
    # a batch of 3 runs in the bucket of 4 with one idle row
    assert batched.generate(prompts[:3], 12).tokens == alone[:3]


def test_stop_tokens_end_each_sequence(model64):
    prompts = prompts_of([4, 7], TINY["vocab_size"], seed=2)
    gen = Generator(model64, max_batch_size=2, max_seq_len=40, readback_every=1)
    free = gen.generate(prompts, 20).tokens
    stop = free[0][5]
    assert stop not in free[0][:5]
    events = []
    result = gen.generate(prompts, 20, stop_token_ids=[stop],
                          on_token=lambda i, t: events.append(("token", i, t)),
                          on_finish=lambda i, toks, why: events.append(("finish", i, why)))
    for i, toks in enumerate(free):
        if stop in toks:
            assert result.tokens[i] == toks[: toks.index(stop)]
            assert result.finish_reasons[i] == "stop"
        else:
            assert result.tokens[i] == toks
            assert result.finish_reasons[i] == "length"
    for i in range(2):  # callbacks: every kept token in order, then one finish
        assert [e[2] for e in events if e[:2] == ("token", i)] == result.tokens[i]
        assert [e for e in events if e[:2] == ("finish", i)] == [("finish", i, result.finish_reasons[i])]
    # a stop token as the very first token: nothing generated, no decode step
    first = gen.generate(prompts[:1], 20, stop_token_ids=[free[0][0]])
    assert first.tokens == [[]] and first.finish_reasons == ["stop"] and first.decode_steps == 0


def test_max_new_tokens_one_and_cache_limits(model64):
    gen = Generator(model64, max_batch_size=2, max_seq_len=16)
    prompt = prompts_of([6], TINY["vocab_size"])[0]
    r = gen.generate([prompt], 1)
    assert len(r.tokens[0]) == 1 and r.decode_steps == 0
    assert gen.generate([prompt], 10).tokens[0][0] == r.tokens[0][0]  # fits exactly: 6 + 10 = 16
    with pytest.raises(ValueError, match="max_seq_len is 16"):
        gen.generate([prompt], 11)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([prompt, []], 4)
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[TINY["vocab_size"]]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([prompt], 0)


def test_padded_prefill_buckets_give_the_same_tokens(model64):
    """prefill_graph=True pads prompts to a length bucket (eagerly here, captured on CUDA): the
    padded tail changes nothing before it; a prompt longer than every bucket runs unpadded."""
    prompts = prompts_of([3, 8, 13, 20, 1], TINY["vocab_size"], seed=5)
    exact = Generator(model64, max_batch_size=4, max_seq_len=40).generate(prompts, 10)
    padded_gen = Generator(model64, max_batch_size=4, max_seq_len=40, prefill_graph=True, prefill_buckets=(8, 16))
    padded = padded_gen.generate(prompts, 10)
    assert padded.tokens == exact.tokens
    assert padded_gen.generate(prompts[::-1], 10).tokens == exact.tokens[::-1]  # stale gather index, shorter bucket


def test_prefill_graph_default_follows_the_decode_graph(model64):
    """Prefill graphs are on by default exactly where the decode step is captured: not on CPU."""
    assert not Generator(model64, max_seq_len=32).prefill_graph
    assert Generator(model64, max_seq_len=32, prefill_graph=True).prefill_graph
    if torch.cuda.is_available():
        cuda = tiny_model(torch.float32, "cuda")
        assert Generator(cuda, max_seq_len=32).prefill_graph
        assert not Generator(cuda, max_seq_len=32, use_cuda_graph=False).prefill_graph
        assert not Generator(cuda, max_seq_len=32, prefill_graph=False).prefill_graph


def test_sampled_generation_same_seed_same_tokens(model64):
    prompts = prompts_of([5, 9], TINY["vocab_size"], seed=3)
    gen = Generator(model64, max_batch_size=2, max_seq_len=32)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    a = gen.generate(prompts, 16, params).tokens
    b = gen.generate(prompts, 16, params).tokens
    c = gen.generate(prompts, 16, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=12)).tokens
    greedy = gen.generate(prompts, 16).tokens
    assert a == b
    assert a != c and a != greedy
    pure = gen.generate(prompts, 16, SamplingParams(temperature=0.8, seed=11)).tokens
    assert pure == gen.generate(prompts, 16, SamplingParams(temperature=0.8, seed=11)).tokens


def test_tiny_positive_temperature_is_greedy(model64):
    """A temperature far below float32's normal range (1e-40) is clamped to MIN_TEMPERATURE, so the
    scaled logits stay finite and sampling picks the argmax, not the first of many infinities."""
    prompts = prompts_of([5, 9], TINY["vocab_size"], seed=3)
    gen = Generator(model64, max_batch_size=2, max_seq_len=32)
    greedy = gen.generate(prompts, 16).tokens
    for params in (SamplingParams(temperature=1e-40, seed=0), SamplingParams(temperature=1e-40, top_k=5, seed=0)):
        assert gen.generate(prompts, 16, params).tokens == greedy


# ---------------------------------------------------------------------------- transformers parity


def hf_tiny_checkpoint(path, seed=0):
    """A transformers Qwen3 (fp32, std 0.2 weights) saved with save_pretrained, plus our tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from modeling.model.random_checkpoint import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path).get_vocab_size(with_added_tokens=True)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         rope_theta=10000.0, initializer_range=0.2, max_position_embeddings=256)
    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2)
            if "norm" in name:
                p.add_(1.0)
    hf.save_pretrained(path)
    write_tokenizer(path)  # save_pretrained wrote its own generation_config.json
    return hf


@torch.no_grad()
def test_greedy_matches_transformers_ragged_batch(tmp_path):
    """fp32 through the Triton kernels (the interpreter on CPU): a ragged batch of 3 (bucket 4)."""
    from modeling import QwenForCausalLM

    hf = hf_tiny_checkpoint(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    prompts = prompts_of([3, 9, 6], hf.config.vocab_size, seed=4)
    result = Generator(model, max_batch_size=4, max_seq_len=24).generate(prompts, 8)
    expected = [hf_greedy(hf, torch.tensor([p]), 8)[0].tolist() for p in prompts]
    assert result.tokens == expected
    assert len({t for row in expected for t in row}) > 6  # not a trivial repetition


# ---------------------------------------------------------------------------- CUDA graphs


@pytest.fixture(scope="module")
def qwen3_0_6b():
    return random_model(QwenConfig.from_dict(QWEN3_0_6B), dtype=torch.bfloat16, device="cuda", std=0.02)


def _graph_vs_eager(model, lengths, new_tokens, sampling=SamplingParams(), max_batch_size=None):
    prompts = prompts_of(lengths, model.config.vocab_size, seed=5)
    kw = dict(max_batch_size=max_batch_size or len(prompts), max_seq_len=max(lengths) + new_tokens)
    graph = Generator(model, use_cuda_graph=True, **kw)
    eager = Generator(model, use_cuda_graph=False, **kw)
    g, e = graph.generate(prompts, new_tokens, sampling), eager.generate(prompts, new_tokens, sampling)
    assert g.cuda_graph and not e.cuda_graph
    assert g.tokens == e.tokens
    assert graph.generate(prompts, new_tokens, sampling).tokens == g.tokens  # replaying again, same tokens
    return g


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_decode_equals_eager_small(dtype):
    model = tiny_model(dtype, "cuda")
    _graph_vs_eager(model, [7], 40)
    _graph_vs_eager(model, [3, 17, 9], 40)  # ragged, bucket 4


@pytest.mark.cuda
def test_graph_decode_equals_eager_qwen3_0_6b_shape(qwen3_0_6b):
    _graph_vs_eager(qwen3_0_6b, [40], 48)
    _graph_vs_eager(qwen3_0_6b, [5, 130, 33, 64, 12], 32, max_batch_size=8)  # bucket 8


@pytest.mark.cuda
def test_graph_sampling_equals_eager_with_seed(qwen3_0_6b):
    """The graph draws from the default CUDA generator like the eager step (Philox offsets)."""
    _graph_vs_eager(qwen3_0_6b, [20, 9], 24, SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=3))
    _graph_vs_eager(qwen3_0_6b, [20], 24, SamplingParams(temperature=1.2, seed=4))


@pytest.mark.cuda
def test_graph_ragged_batch_equals_one_by_one_fp32():
    """fp32, std 0.2 weights: batch rows decode like separate runs (different batch GEMM shapes
    round differently, so this holds where logits are well separated, not bit for bit in bf16)."""
    model = tiny_model(torch.float32, "cuda")
    prompts = prompts_of([4, 19, 11], model.config.vocab_size, seed=6)
    batched = Generator(model, max_batch_size=4, max_seq_len=64).generate(prompts, 30).tokens
    single = Generator(model, max_batch_size=1, max_seq_len=64)
    assert batched == [single.generate([p], 30).tokens[0] for p in prompts]


@pytest.mark.cuda
def test_prefill_graph_buckets(qwen3_0_6b):
    """Captured prefill (prompt padded to its bucket) equals the same padded prefill run eagerly,
    and its first token's logits match the exact-length prefill to bf16 rounding."""
    gen = Generator(qwen3_0_6b, max_batch_size=2, max_seq_len=200, prefill_graph=True)
    prompt = prompts_of([45], qwen3_0_6b.config.vocab_size, seed=7)[0]
    state = gen.state

    def staged_keys():
        return torch.stack([layer.k[0, :45] for layer in state.staging.layers])

    with torch.no_grad():
        replay = gen._prefill(64, "greedy")  # capture first: capturing resets the inputs
        state.stage(prompt)
        replay()
        captured = (state.pf_token.clone(), staged_keys().clone())
        state.prefill_bucket(64, "greedy")
        assert torch.equal(state.pf_token, captured[0]) and torch.equal(staged_keys(), captured[1])
        cache = qwen3_0_6b.new_cache(1, 64, torch.bfloat16, "cuda")
        exact = qwen3_0_6b(torch.tensor([prompt], device="cuda"), torch.arange(45, device="cuda")[None], cache)
        padded = qwen3_0_6b(state.pf_ids[:, :64], state.pf_pos[:, :64], cache, all_logits=True)
        rel = (padded[0, 44].float() - exact[0].float()).norm() / exact.float().norm()
        assert rel < 2e-2
    r = gen.generate([prompt, prompt[:20]], 16)
    assert r.cuda_graph and all(len(t) == 16 for t in r.tokens)
    assert {k[:2] for k in gen.graphs.keys()} == {("decode", 2), ("prefill", 64), ("prefill", 32)}


@pytest.mark.cuda
def test_readback_reads_the_last_chunk():
    """On CUDA the tokens come back in chunks of ``readback_every`` steps, each read once the next
    is queued; the chunks still queued when the loop ends are read after it: every row gets all
    its tokens, whatever the remainder of the length by the chunk size."""
    model = tiny_model(torch.float32, "cuda")
    prompts = prompts_of([4, 11], model.config.vocab_size, seed=10)
    gen = Generator(model, max_batch_size=2, max_seq_len=48, readback_every=4)
    assert gen.readback_every == 4
    full = gen.generate(prompts, 24)
    assert [len(t) for t in full.tokens] == [24, 24] and full.finish_reasons == ["length"] * 2
    for new in (2, 3, 5, 8, 9, 13):
        r = gen.generate(prompts, new)
        assert r.finish_reasons == ["length"] * 2 and r.tokens == [t[:new] for t in full.tokens]


def test_capture_is_a_no_op_without_cuda_graphs(model64):
    """On the CPU (or with use_cuda_graph=False) capture() captures nothing; generation is unchanged."""
    prompts = prompts_of([5, 9, 3], TINY["vocab_size"], seed=8)
    expected = Generator(model64, max_batch_size=4, max_seq_len=32).generate(prompts, 10).tokens
    gen = Generator(model64, max_batch_size=4, max_seq_len=32, prefill_graph=True, prefill_buckets=(8, 16))
    gen.capture(batch_sizes=[1, 3, 4], modes=["greedy", "top"], prefill_lengths=[5, 9])
    assert not gen.use_cuda_graph and not list(gen.graphs.keys())
    r = gen.generate(prompts, 10)
    assert r.tokens == expected and not r.cuda_graph


@pytest.mark.cuda
def test_capture_ahead_of_time_then_generate():
    """capture() ahead of time builds the graphs generate() then replays (none captured later);
    the tokens equal those of a generator that captures on first use, and of eager decoding."""
    model = tiny_model(torch.float32, "cuda")
    prompts = prompts_of([3, 17, 9], model.config.vocab_size, seed=9)
    kw = dict(max_batch_size=4, max_seq_len=64, prefill_graph=True)
    ahead = Generator(model, **kw)
    ahead.capture(batch_sizes=[3], modes=["greedy"], prefill_lengths=[3, 17, 9])
    keys = set(ahead.graphs.keys())
    assert keys == {("decode", 4, "greedy"), ("prefill", 16, "greedy"), ("prefill", 32, "greedy")}
    r = ahead.generate(prompts, 30)
    assert r.cuda_graph and set(ahead.graphs.keys()) == keys
    assert r.tokens == Generator(model, **kw).generate(prompts, 30).tokens
    assert r.tokens == Generator(model, use_cuda_graph=False, **kw).generate(prompts, 30).tokens
