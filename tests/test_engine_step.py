"""``step.pack``: the padded flat-token batch of a step, field by field, against the layout it
promises (docs/architecture.md, the cache layout): each real token's id, position and KV slot,
each sequence's rows, cached length, block table and state slot, the sampling rows, and the
padding rows of a decode and of a mixed graph shape; a buffer full of garbage first, so a field
pack leaves unwritten shows."""

import numpy as np

from modeling.engine.sequence import Sequence
from modeling.engine.step import fields, pack, table_offset
from modeling.engine.sampling_params import SamplingParams

BLOCK = 4
PADDING_SLOT = 9


def sequence(tokens, computed, blocks, slot=None, pending=0):
    seq = Sequence(tokens, SamplingParams(), 8)
    seq.num_computed, seq.block_table, seq.state_slot, seq.num_pending = computed, blocks, slot, pending
    return seq


def packed(work, shape, width):
    buffer = np.full(table_offset(*shape[1:]) + 4 * len(work) * width + 64, 0x5A, np.uint8)
    out = pack(work, shape, BLOCK, PADDING_SLOT, buffer)
    return out, fields(buffer, *shape[1:]), buffer


def test_a_mixed_step_packs_every_field_and_pads_the_rest():
    a = sequence(list(range(100, 110)), computed=4, blocks=[7, 2, 5], slot=3)  # a prefill chunk of 6: samples
    b = sequence(list(range(200, 203)), computed=2, blocks=[1], slot=0)  # its last token: samples
    c = sequence(list(range(300, 309)), computed=0, blocks=[4, 6], slot=1)  # a first chunk of 5: does not
    work, shape = [(a, 6), (b, 1), (c, 5)], ("mixed", 16, 8)
    out, f, buffer = packed(work, shape, width=3)
    assert (out.query_lens, out.starts) == ([6, 1, 5], [4, 2, 0])
    assert out.sampling == [0, 1] and out.pending == [] and out.nbytes == table_offset(16, 8) + 4 * 3 * 3
    positions = list(range(4, 10)) + [2] + list(range(0, 5))
    tables = [[7, 2, 5], [1], [4, 6]]
    owners = [0] * 6 + [1] + [2] * 5
    assert f.input_ids.tolist() == list(range(104, 110)) + [202] + list(range(300, 305)) + [0] * 4
    assert f.positions.tolist() == positions + [0] * 4
    assert f.slot_mapping.tolist() == [tables[o][p // BLOCK] * BLOCK + p % BLOCK for o, p in zip(owners, positions)] \
        + [-1] * 4
    assert f.cu_seqlens_q.tolist() == [0, 6, 7, 12, 16, 16, 16, 16, 16]  # sequence 3 holds the padding tokens
    assert f.seq_lens.tolist() == [10, 3, 5, 0, 0, 0, 0, 0]
    assert f.state_slots.tolist() == [3, 0, 1] + [PADDING_SLOT] * 5
    assert f.logits_rows.tolist() == [5, 6] + [0] * 6
    table = buffer[f.table_offset:out.nbytes].view(np.int32).reshape(3, 3)
    assert [row[:len(t)].tolist() for row, t in zip(table, tables)] == tables


def test_a_decode_step_gives_every_row_a_sequence_and_marks_pending_inputs():
    a = sequence([5, 6, 7], computed=2, blocks=[3])  # decodes its last host token
    b = sequence([8, 9], computed=2, blocks=[0], pending=1)  # its input is still on the device
    out, f, _ = packed([(a, 1), (b, 1)], ("decode", 4, 4), width=1)
    assert out.sampling == [0, 1] and out.pending == [1]
    assert f.input_ids.tolist() == [7, -1, 0, 0]
    assert f.positions.tolist() == [2, 2, 0, 0] and f.slot_mapping.tolist() == [14, 2, -1, -1]
    assert f.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and f.seq_lens.tolist() == [3, 3, 0, 0]
    assert f.logits_rows.tolist() == [0, 1, 2, 3]
    assert f.state_slots.tolist() == [PADDING_SLOT] * 4  # attention-only sequences hold no state slot


def test_an_empty_step_is_all_padding():
    """What a graph capture warms up on: nothing read out of bounds, nothing written but padding."""
    for shape, cu in ((("mixed", 8, 4), [0, 8, 8, 8, 8]), (("decode", 4, 4), [0, 1, 2, 3, 4])):
        out, f, _ = packed([], shape, width=0)
        assert out.sampling == [] and out.nbytes == table_offset(*shape[1:])
        assert f.cu_seqlens_q.tolist() == cu and not f.seq_lens.any()
        assert not f.input_ids.any() and not f.positions.any() and (f.slot_mapping == -1).all()
        assert (f.state_slots == PADDING_SLOT).all()
        assert f.logits_rows.tolist() == (list(range(4)) if shape[0] == "decode" else [0] * 4)
