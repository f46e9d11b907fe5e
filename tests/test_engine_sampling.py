"""The engine's sampling controls (modeling.engine.sampler; SamplingParams' min_p, presence /
frequency / repetition penalties and logprobs), each against a plain PyTorch reference written
here, on random logits of awkward sizes with settings mixed per row; then the checkpoint defaults
(generation_config.json's repetition_penalty and min_p, which ``LLM`` applies), ``LLM`` passing
every control to the engine, and an end-to-end Engine run on a tiny random float64 model."""

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch

from modeling import LLM, SamplingParams
from modeling.chat.template import GenerationDefaults, generation_defaults
from modeling.engine import Engine
from modeling.engine.sampler import apply_penalties, penalties_of, sample_rows, sample_sequences, token_logprobs
from modeling.engine.sequence import Sequence
from tests.helpers import recompute_greedy
from tests.test_engine import QWEN3, model_of, prompts_of
from tests.test_generate_cli import build_chat_checkpoint

F64 = dict(device="cpu", dtype=torch.float64)


# ------------------------------------------------------------------ plain references


def ref_penalised(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    """One row [V]: repetition over prompt and output tokens, then OpenAI's presence / frequency
    penalties over the output tokens, token by token in float64."""
    out = logits.double().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """One row [V]: softmax(logits / T); keep p >= min_p * max p; then the top-k; then, renormalized,
    the smallest prefix of the sorted tokens with mass >= top_p; renormalized. float64."""
    p = (logits.double() / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    order = [t for t in p.argsort(descending=True).tolist() if p[t] > 0][:top_k or None]
    kept, mass, total = [], 0.0, p[order].sum().item()
    for t in order:
        if mass >= top_p:
            break
        kept.append(t)
        mass += p[t].item() / total
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def seq_of(prompt, output, seed=0, **params):
    s = Sequence(list(prompt) + list(output), SamplingParams(**params), max_tokens=10**6, num_prompt=len(prompt))
    s.seed = seed
    return s


def random_history(g, vocab, n_prompt, n_output):
    """Token ids with repeats (a narrow range), so counts above 1 and prompt/output overlaps occur."""
    return (torch.randint(0, min(vocab, 12), (n_prompt,), generator=g).tolist(),
            torch.randint(0, min(vocab, 12), (n_output,), generator=g).tolist())


# ------------------------------------------------------------------ penalties


@pytest.mark.parametrize("vocab", [37, 1000])
def test_penalties_match_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[:, :12] = logits[:, :12].abs() * torch.tensor([1.0, -1.0]).repeat(6)  # both signs on the repeated ids
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4), dict(),
                dict(repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=-0.3),
                dict(frequency_penalty=2.0)]
    histories = [random_history(g, vocab, n, m) for n, m in [(4, 9), (1, 13), (6, 6), (9, 1), (3, 20)]]
    seqs = [seq_of(p, o, **s) for (p, o), s in zip(histories, settings)]
    pen = penalties_of(seqs, "cpu")
    assert pen.rows.tolist() == [0, 1, 3, 4]  # the plain row is left out
    got = apply_penalties(logits, pen)
    assert got.dtype == torch.float32 and torch.equal(got[2], logits[2])
    for i, ((prompt, output), s) in enumerate(zip(histories, settings)):
        want = ref_penalised(logits[i], prompt, output, s.get("presence_penalty", 0.0),
                             s.get("frequency_penalty", 0.0), s.get("repetition_penalty", 1.0))
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
        assert (got[i] != logits[i]).any() == bool(s)  # a penalised row changed, the plain one did not


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    g = torch.Generator().manual_seed(3)
    vocab = 37
    logits = torch.randn(4, vocab, generator=g)
    histories = []
    for i in range(4):  # each row's output repeats its own argmax, so a penalty moves the argmax
        top = int(logits[i].argmax())
        histories.append(([top, 5], [top, top, 7]))
    settings = [dict(repetition_penalty=3.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict()]
    seqs = [seq_of(p, o, **s) for (p, o), s in zip(histories, settings)]
    tokens = [t for t, _ in sample_sequences(logits, seqs).collect()]
    for i, ((prompt, output), s) in enumerate(zip(histories, settings)):
        want = ref_penalised(logits[i], prompt, output, s.get("presence_penalty", 0.0), s.get("frequency_penalty", 0.0),
                             s.get("repetition_penalty", 1.0)).argmax().item()
        assert tokens[i] == want
    assert tokens[3] == logits[3].argmax() and tokens[:3] != logits[:3].argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_plain_rows_of_a_penalised_batch_draw_what_they_draw_without(dtype):
    g = torch.Generator().manual_seed(4)
    vocab = 1000
    logits = (torch.randn(5, vocab, generator=g) * 2).to(dtype)
    plain = [dict(), dict(temperature=0.8), dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.05)]
    penalised = [dict(temperature=0.9, repetition_penalty=1.5, frequency_penalty=1.0), dict(presence_penalty=2.0)]
    histories = [random_history(g, vocab, 5, 8) for _ in range(5)]
    for i, (p, o) in enumerate(histories):  # outputs repeat every row's argmax: a penalty misplaced shows
        histories[i] = (p, o + [int(logits[j].argmax()) for j in range(5)] * 2)
    rows = [plain[0], penalised[0], plain[1], penalised[1], plain[2]]
    def run(settings):
        return sample_sequences(logits, [seq_of(p, o, seed=i, **s) for i, ((p, o), s) in
                                         enumerate(zip(histories, settings))]).collect()

    mixed = run(rows)
    without = run([{k: v for k, v in s.items() if not k.endswith("penalty")} for s in rows])
    assert [mixed[i] for i in (0, 2, 4)] == [without[i] for i in (0, 2, 4)]
    assert mixed[3] != without[3]  # the greedy presence-penalised row moved off its argmax


# ------------------------------------------------------------------ min_p, top-k, top-p: the drawn distribution


def draws(logits, settings, n):
    """n draws of each row (n distinct seeds), all rows in one batch; frequencies [S, V]."""
    seqs = [seq_of([0], [], seed=random.Random(r * n + j).getrandbits(63), **s)
            for j in range(n) for r, s in enumerate(settings)]
    rows = logits.repeat(n, 1)
    tokens = torch.tensor([t for t, _ in sample_sequences(rows, seqs).collect()]).view(n, len(settings))
    return torch.stack([torch.bincount(tokens[:, r], minlength=logits.shape[1]).double() / n
                        for r in range(len(settings))])


@pytest.mark.parametrize("vocab", [37, 1000])
def test_min_p_top_k_top_p_draw_the_reference_distribution(vocab):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, vocab, generator=g) * (2.0 if vocab == 37 else 4.0)
    settings = [dict(temperature=0.5, min_p=0.1), dict(temperature=2.0, min_p=0.2, top_k=6),
                dict(temperature=1.0, min_p=0.05, top_p=0.8), dict(temperature=0.8, top_k=10, top_p=0.9),
                dict(temperature=1.3)]
    freq = draws(logits, settings, 3000)
    discriminating = []  # min_p rows whose cut after the temperature differs from one before it
    for r, s in enumerate(settings):
        want = ref_probs(logits[r], s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0))
        assert freq[r][want == 0].sum() == 0, f"row {r} drew a token the reference cuts"
        assert (freq[r][want > 0.01] > 0).all()
        assert (freq[r] - want).abs().max() < 0.035, f"row {r}"
        if s.get("min_p"):
            before = ref_probs(logits[r], 1.0, min_p=s["min_p"]) > 0
            discriminating.append(not torch.equal(before, ref_probs(logits[r], s["temperature"], min_p=s["min_p"]) > 0))
    assert any(discriminating)


def test_min_p_keeps_exactly_the_tokens_within_the_ratio():
    """One step of min_p alone: the kept set is {t : p_t >= min_p * p_max} exactly (a token just
    inside, one just outside the ratio), and min_p 1 keeps the top token only."""
    vocab, temperature, min_p = 37, 0.7, 0.25
    logits = torch.full((vocab,), -30.0)
    logits[3] = 2.0
    ratio = torch.log(torch.tensor(min_p)) * temperature  # a logit gap whose probability ratio is min_p
    logits[10], logits[20], logits[30] = 2.0 + ratio + 1e-3, 2.0 + ratio - 1e-3, 1.9
    settings = [dict(temperature=temperature, min_p=min_p), dict(temperature=5.0, min_p=1.0)]
    freq = draws(logits.expand(2, vocab), settings, 2000)
    assert set(freq[0].nonzero().flatten().tolist()) == {3, 10, 30}
    assert freq[1].nonzero().flatten().tolist() == [3]


def test_seeded_draws_depend_on_the_seed_and_position_only():
    g = torch.Generator().manual_seed(6)
    vocab = 37
    logits = torch.randn(4, vocab, generator=g)
    rows = [dict(temperature=1.0, min_p=0.02, presence_penalty=0.5), dict(temperature=0.9, top_k=8),
            dict(temperature=1.2, repetition_penalty=1.2, logprobs=2), dict(temperature=1.0)]
    histories = [random_history(g, vocab, 3, 5) for _ in rows]
    seqs = [seq_of(p, o, seed=100 + i, **s) for i, ((p, o), s) in enumerate(zip(histories, rows))]
    first = sample_sequences(logits, seqs).collect()
    assert sample_sequences(logits, seqs).collect() == first
    for i in range(4):  # alone: no other row's top-k sort, penalties or min_p in its batch
        alone = [seq_of(*histories[i], seed=100 + i, **rows[i])]
        assert sample_sequences(logits[i:i + 1], alone).collect() == [first[i]]
    reseeded = [sample_sequences(logits[:1], [seq_of(*histories[0], seed=s, **rows[0])]).collect()[0][0]
                for s in range(20)]
    assert len(set(reseeded)) > 1


# ------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("vocab", [7, 37, 1000])
def test_logprobs_are_of_the_raw_logits(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g) * 3
    rows = [dict(logprobs=3), dict(logprobs=0, temperature=0.5), dict(),
            dict(logprobs=20, temperature=0.3, repetition_penalty=2.0, presence_penalty=1.0),
            dict(logprobs=5, repetition_penalty=1.8)]
    histories = [random_history(g, vocab, 4, 6) for _ in rows]
    seqs = [seq_of(p, o, seed=i, **s) for i, ((p, o), s) in enumerate(zip(histories, rows))]
    out = sample_sequences(logits, seqs).collect()
    raw = logits.double().log_softmax(-1)
    assert out[2][1] is None
    for i, (token, entry) in enumerate(out):
        if rows[i].get("logprobs") is None:
            continue
        k = min(rows[i]["logprobs"], vocab)
        chosen, top, rank = entry
        assert isinstance(chosen, float) and chosen == pytest.approx(raw[i, token].item(), abs=1e-5)
        same = logits[i].log_softmax(-1)  # the sampler's own fp32 values: no near-tie decided differently
        assert rank == 1 + (same > same[token]).sum().item()
        want = raw[i].topk(k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert out[0][0] == out[0][1][1][0][0] and out[0][1][0] == out[0][1][1][0][1]  # greedy: the top logprob
    # the penalised greedy row still reports the raw distribution, not the penalised one
    assert out[4][1][1][0][0] == logits[4].argmax()
    penalised = ref_penalised(logits[4], *histories[4], repetition=1.8).log_softmax(-1)
    assert penalised.topk(min(5, vocab)).values.tolist() != pytest.approx([lp for _, lp in out[4][1][1]], abs=1e-5)


def test_token_logprobs_shapes_and_values():
    logits = torch.randn(3, 37, dtype=torch.bfloat16)
    tokens = torch.tensor([0, 36, 5])
    chosen, values, ids, ranks = token_logprobs(logits, tokens, 4)
    assert chosen.dtype == torch.float32 and values.shape == ids.shape == (3, 4)
    ref = logits.float().log_softmax(-1)
    torch.testing.assert_close(chosen, ref[torch.arange(3), tokens])
    torch.testing.assert_close(values, ref.topk(4).values)
    assert ranks.tolist() == [1 + sum(v > ref[r, t] for v in ref[r]).item() for r, t in enumerate(tokens.tolist())]
    assert token_logprobs(logits, tokens, 0)[1].shape == (3, 0)


def test_sample_rows_without_the_new_controls_is_unchanged():
    """min_p 0 and no penalties take the same tokens as not passing them at all."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 37, generator=g)
    temp, top_k = torch.tensor([0.0, 1.0, 0.8, 1.5]), torch.tensor([0, 0, 5, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.7])
    seeds, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([9, 9, 9, 9])
    want = sample_rows(logits, temp, top_k, top_p, seeds, pos, True, True)
    assert torch.equal(sample_rows(logits, temp, top_k, top_p, seeds, pos, True, True, min_p=torch.zeros(4)), want)


# ------------------------------------------------------------------ validation, Sequence


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", True),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"),
    ("frequency_penalty", -3), ("frequency_penalty", float("inf")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True),
])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must"):
        SamplingParams(**{field: value})


def test_sampling_mode_and_the_other_values_checked():
    assert [SamplingParams(temperature=t, top_k=k, top_p=p).mode for t, k, p in
            [(0.0, 0, 1.0), (0.7, 1, 1.0), (0.7, 0, 1.0), (0.7, 40, 1.0), (0.7, 0, 0.9)]] == \
        ["greedy", "greedy", "sample", "top", "top"]
    every = SamplingParams(temperature=0.7, top_k=-1)  # vLLM's "every token": off, as 0
    assert every == SamplingParams(temperature=0.7) and every.top_k == 0 and every.mode == "sample"
    for bad, word in [(dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                      (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                      (dict(top_p=float("nan")), "top_p"), (dict(seed=-3), "seed"), (dict(n=0), "n"),
                      (dict(n=1.0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"),
                      (dict(stop_token_ids=[-1]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**bad)


def test_tiny_positive_temperature_is_greedy():
    """A temperature far below float32's normal range (1e-40) is clamped to MIN_TEMPERATURE, so the
    scaled logits stay finite and sampling picks the argmax, not the first of many infinities."""
    model, prompts = model_of(QWEN3), prompts_of([5, 9], seed=3)
    engine = Engine(model, max_num_seqs=2, max_model_len=32)
    greedy = engine.generate(prompts, SamplingParams(), 12)
    for params in (SamplingParams(temperature=1e-40, seed=0), SamplingParams(temperature=1e-40, top_k=5, seed=0)):
        assert engine.generate(prompts, params, 12) == greedy


def test_boundary_values_are_accepted_as_plain_numbers():
    import numpy as np

    p = SamplingParams(min_p=1, presence_penalty=-2, frequency_penalty=np.float32(2), repetition_penalty=1e-3,
                       logprobs=np.int64(20))
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.logprobs) == (1.0, -2.0, 2.0, 20)
    assert type(p.frequency_penalty) is float and type(p.logprobs) is int and p.has_penalty
    assert SamplingParams(min_p=0.0, logprobs=0).logprobs == 0 and not SamplingParams(min_p=0.5).has_penalty
    with pytest.raises(ValueError, match="min_p must.*; logprobs must"):  # every problem named at once
        SamplingParams(min_p=2, logprobs=99)


def test_sequence_records_one_entry_per_output_token():
    asked = seq_of([1, 2], [], logprobs=1)
    asked.append(5, (-0.5, [(5, -0.5)], 1))
    assert asked.logprobs == [(-0.5, [(5, -0.5)], 1)] and asked.output_ids == [5]
    with pytest.raises(ValueError, match="logprobs entry"):
        asked.append(6)
    plain = seq_of([1, 2], [])
    assert plain.logprobs is None
    with pytest.raises(ValueError, match="logprobs entry"):
        plain.append(6, (-0.1, [], 1))
    assert plain.output_ids == []  # a refused append records nothing


# ------------------------------------------------------------------ checkpoint defaults, LLM


def write_generation_config(path, **fields):
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], **fields}))
    return path


def test_generation_config_repetition_penalty_and_min_p(tmp_path):
    qwen25 = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, min_p=0.05)
    d = generation_defaults(write_generation_config(tmp_path, **qwen25))
    assert d == GenerationDefaults(0.7, 20, 0.8, None, 1.05, 0.05)
    # greedy: the repetition penalty still applies (a logits processor in transformers), min_p does not
    d = generation_defaults(write_generation_config(tmp_path, **dict(qwen25, do_sample=False)))
    assert d == GenerationDefaults(repetition_penalty=1.05)
    assert generation_defaults(write_generation_config(tmp_path, do_sample=True, repetition_penalty=None,
                                                       min_p=None)) == GenerationDefaults(1.0, 50, 1.0)
    for fields, field in [(dict(repetition_penalty=0), "repetition_penalty"),
                          (dict(repetition_penalty="1.1"), "repetition_penalty"),
                          (dict(do_sample=True, min_p=1.5), "min_p")]:
        with pytest.raises(ValueError, match=f"generation_config.json: {field} must"):
            generation_defaults(write_generation_config(tmp_path, **fields))


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """A tiny checkpoint without sampling defaults, and its copy with Qwen2.5-Instruct's."""
    plain = build_chat_checkpoint(tmp_path_factory.mktemp("plain") / "tiny")
    rep = tmp_path_factory.mktemp("rep") / "tiny"
    shutil.copytree(plain, rep)
    gen = json.loads((rep / "generation_config.json").read_text())
    write_generation_config(rep, **dict(gen, do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                        repetition_penalty=1.05, min_p=0.05, max_new_tokens=4))
    return LLM(plain, **F64), LLM(rep, **F64)


def test_llm_applies_every_control_as_the_engine_does(llms):
    """``LLM`` hands min-p, the penalties, logprobs and the seed to the engine: its tokens are the
    engine's for the same request, its logprobs the engine's entries as vLLM's ``Logprob``s."""
    llm, _ = llms
    ids = llm.tokenizer.encode("Hello there")
    params = SamplingParams(temperature=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.3,
                            repetition_penalty=1.2, seed=5, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    engine = Engine(llm.model, max_num_seqs=2, max_model_len=64)
    seq = engine.add(ids, params, 6)
    while engine.has_work():
        engine.step()
    assert out.token_ids == seq.output_ids and len(out.logprobs) == 6
    for token, entry, (chosen, top, rank) in zip(out.token_ids, out.logprobs, seq.logprobs):
        places = {t: place for place, (t, _) in enumerate(top, 1)}
        assert entry[token].logprob == chosen and entry[token].rank == places.get(token, rank)
        assert [(t, lp.logprob, lp.rank) for t, lp in entry.items()][:len(top)] == [(t, lp, places[t]) for t, lp in top]
    assert out.cumulative_logprob == pytest.approx(sum(chosen for chosen, _, _ in seq.logprobs))


def test_llm_takes_the_checkpoint_defaults_whole(llms):
    """Without sampling params, ``LLM`` samples with generation_config.json's values, its
    repetition penalty and min-p included, as the same values given explicitly do."""
    _, llm = llms
    defaults = llm.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.min_p, defaults.temperature, defaults.max_tokens) == \
        (1.05, 0.05, 0.7, 4)
    seeded = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3, max_tokens=4, repetition_penalty=1.05,
                            min_p=0.05)
    got = llm.generate("Hello", seeded, use_tqdm=False)[0].token_ids
    assert got == llm.generate("Hello", replace(defaults, seed=3), use_tqdm=False)[0].token_ids
    assert len(llm.generate("Hello", use_tqdm=False)[0].token_ids) <= 4


# ------------------------------------------------------------------ the engine end to end


def reference_greedy(model, prompt, new, **penalty):
    """Greedy tokens and each step's raw logits, the model rerun on the whole sequence every step."""
    tokens, logits = list(prompt), []
    for _ in range(new):
        with torch.no_grad():
            step = model(torch.tensor([tokens]))[0, -1]
        logits.append(step)
        tokens.append(int(ref_penalised(step, prompt, tokens[len(prompt):], **penalty).argmax()))
    return tokens[len(prompt):], logits


def test_engine_applies_penalties_and_returns_logprobs():
    model = model_of(QWEN3)
    prompts = prompts_of([9, 23, 4])
    new = 8
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    penalised = engine.add(prompts[0], SamplingParams(repetition_penalty=1.6, presence_penalty=0.8,
                                                      frequency_penalty=0.5, logprobs=4), new)
    plain = engine.add(prompts[1], SamplingParams(logprobs=0), new)
    drawn = engine.add(prompts[2], SamplingParams(temperature=0.9, min_p=0.1, frequency_penalty=1.0, seed=7), new)
    while engine.has_work():
        engine.step()
    want, logits = reference_greedy(model, prompts[0], new, presence=0.8, frequency=0.5, repetition=1.6)
    assert penalised.output_ids == want
    assert want != reference_greedy(model, prompts[0], new)[0]  # the penalties changed the greedy tokens
    assert len(penalised.logprobs) == new
    for token, step, (chosen, top, rank) in zip(want, logits, penalised.logprobs):
        raw = step.log_softmax(-1)
        assert chosen == pytest.approx(raw[token].item(), abs=1e-9) and rank == 1 + (raw > raw[token]).sum().item()
        assert [t for t, _ in top] == raw.topk(4).indices.tolist()
    assert plain.output_ids == recompute_greedy(model, prompts[1:2], new)[0]
    assert [top for _, top, _ in plain.logprobs] == [[] for _ in range(new)]
    assert [rank for _, _, rank in plain.logprobs] == [1] * new  # greedy: the argmax, rank 1 with no top token
    assert all(chosen <= 0 for chosen, _, _ in plain.logprobs) and drawn.logprobs is None
    again = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)
    assert again.generate(prompts[2:], drawn.params, new) == [drawn.output_ids]  # seeded: the batch does not matter
