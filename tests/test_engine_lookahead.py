"""The engine's lookahead: a decode-only step's successor is launched before the host reads its
tokens (the next inputs are written on the device). The tokens stay the recomputed ones
(tests/test_engine.py); here, that the lookahead runs, and what it must not do: give a finished or
aborted sequence a token, hold blocks after the last step, or run with penalties (whose counts
would miss the token still on the device)."""

from modeling.engine import Engine
from modeling.engine.sampling_params import SamplingParams

from tests.helpers import recompute_greedy
from tests.test_engine import GREEDY, QWEN3, model_of, prompts_of


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


def test_penalties_turn_the_lookahead_off():
    engine = engine_of(model_of(QWEN3))
    seq = engine.add(prompts_of([10])[0], SamplingParams(repetition_penalty=1.3), 6)
    while engine.has_work():
        engine.step()
        assert engine._inflight is None
    assert seq.num_output == 6


def test_no_step_is_launched_after_every_token_is_sampled():
    """A sequence whose last allowed token is in flight is not scheduled again: n tokens of a batch
    take one prefill step and n - 1 decode steps, however the lookahead overlaps them."""
    engine = engine_of(model_of(QWEN3))
    seqs = [engine.add(p, GREEDY, 6) for p in prompts_of([9, 30, 17])]
    while engine.has_work():
        engine.step()
    assert all(s.num_output == 6 for s in seqs)
    assert (engine.stats.steps, engine.stats.decode_steps) == (6, 5)
