"""The engine's lookahead: a decode-only step's successor is launched before the host reads its
tokens (the next inputs are written on the device). The tokens stay the recomputed ones
(tests/test_engine.py); here, that the lookahead runs, and what it must not do: give a finished or
aborted sequence a token, hold blocks after the last step, or sample a row whose penalties or
grammar read the token still on the device before the host has it."""

import torch

from modeling.engine import Engine
from modeling.engine.sampling_params import SamplingParams

from tests.helpers import recompute_greedy
from tests.test_engine import GREEDY, QWEN3, model_of, prompts_of
from tests.test_engine_sampling import ref_penalised


def engine_of(model):
    return Engine(model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16)


def test_decode_steps_launch_the_next_one_before_their_tokens_are_read():
    model = model_of(QWEN3)
    prompts = prompts_of([9, 30, 17])
    want = recompute_greedy(model, prompts, 12)
    engine = engine_of(model)
    seqs = [engine.add(p, GREEDY, 12) for p in prompts]
    engine.step()  # the prefill: no lookahead, its first tokens come back at once
    assert engine._inflight is None and all(s.num_output == 1 for s in seqs)
    engine.step()  # a decode step: the next one is in flight when it returns
    assert engine._inflight is not None and all(s.num_pending == 1 for s in seqs)
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == want
    assert all(s.num_pending == 0 and s.finish_reason == "length" for s in seqs)
    assert engine.blocks.num_free == engine.size.num_blocks and engine._inflight is None


def test_a_sequence_aborted_or_stopped_while_a_step_is_in_flight_gets_no_more_tokens():
    model = model_of(QWEN3)
    prompts = prompts_of([20, 20])
    want = recompute_greedy(model, prompts[:1], 8)[0]
    engine = engine_of(model)
    stopped = engine.add(prompts[0], GREEDY, 50, stop_token_ids=[want[4]])
    aborted = engine.add(prompts[1], GREEDY, 50)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    engine.abort(aborted)  # its token of the step in flight is dropped
    kept = aborted.num_output
    while engine.has_work():
        engine.step()
    assert aborted.num_output == kept and aborted.finish_reason == "abort"
    assert stopped.output_ids == want[:5] and stopped.finish_reason == "stop"
    assert engine.blocks.num_free == engine.size.num_blocks


def test_rows_that_read_their_tokens_sample_after_them():
    """Penalties count a row's output tokens on the host: the step launched ahead of such a row runs
    its forward pass, and samples only once the tokens before it are read (the lookahead still
    runs). The tokens are a plain loop's that applies the penalties to the whole output."""
    model = model_of(QWEN3)
    prompt = prompts_of([3])[0]  # its greedy output repeats a token at once: a count that misses it shows
    engine = engine_of(model)
    seq = engine.add(prompt, SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0), 8)
    ahead = []
    while engine.has_work():
        engine.step()
        ahead.append(engine._inflight is not None)
    assert any(ahead) and seq.num_output == 8
    tokens = list(prompt)
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1]
        tokens.append(int(ref_penalised(logits, prompt, tokens[len(prompt):], 0.0, 2.0, 2.0).argmax()))
    assert seq.output_ids == tokens[len(prompt):]


def test_no_step_is_launched_after_every_token_is_sampled():
    """A sequence whose last allowed token is in flight is not scheduled again: n tokens of a batch
    take one prefill step and n - 1 decode steps, however the lookahead overlaps them."""
    engine = engine_of(model_of(QWEN3))
    seqs = [engine.add(p, GREEDY, 6) for p in prompts_of([9, 30, 17])]
    while engine.has_work():
        engine.step()
    assert all(s.num_output == 6 for s in seqs)
    assert (engine.stats.steps, engine.stats.decode_steps) == (6, 5)
