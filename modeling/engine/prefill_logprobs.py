"""A prompt's own log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's), computed by the
prefill steps that compute the prompt: no second forward.

A sequence that asks for them (k top tokens) holds ``Sequence.prompt_logprobs``, [None, entry 1,
..., entry L-1] for a prompt of L tokens once complete: entry i is token i's ``LogprobEntry``
given tokens 0..i-1. A step that computes a sequence's positions start..start+n-1 also takes the
logits of each row at a position p < L - 1 whose entry is still missing (p + 1 >= len(entries)):

    lp = log_softmax(logits of row p) (fp32, or the model's dtype if wider)
    entry p + 1 = (lp[prompt[p + 1]], the k largest of lp with their token ids, best first,
                   1 + the number of entries of lp larger than lp[prompt[p + 1]])

so a prompt split over several steps fills its entries chunk by chunk, and a sequence preempted
and recomputed is not scored twice. Such a step runs eagerly, outside the CUDA graphs
(``runner.StepRunner.run``: the model gathers these rows beside the sampling rows before its
lm_head); a step without them runs as it always does. Positions found in the prefix cache are
never computed, so a sequence whose entries are incomplete skips the prefix-cache lookup
(``scheduler``), as vLLM does.
"""

from typing import List, Optional, Sequence as Seq, Tuple

import numpy as np
import torch
from torch import Tensor

from .sampler import token_logprobs
from .sequence import Sequence, Status
from .step import to_device

ROWS_AT_ONCE = 1024
"""Rows whose log-softmax is taken at once: besides the step's logits ([Ss + R, V] in the model's
dtype), [ROWS_AT_ONCE, V] fp32 at most."""


class PromptRows:
    """The prompt-logprob rows of one step: ``rows`` [R] int64, indices into the step's tokens;
    ``targets`` [R] int64, the prompt token each row scores; ``seqs`` and ``counts``: whose rows
    they are, in order (``counts[i]`` consecutive rows of ``seqs[i]``)."""

    def __init__(self, seqs: List[Sequence], counts: List[int], rows: List[int], targets: List[int]):
        self.seqs, self.counts = seqs, counts
        self.rows, self.targets = np.array(rows, np.int64), np.array(targets, np.int64)

    def score(self, logits: Tensor) -> "PromptScores":
        """The entries of the rows (``logits`` [R, V], row i of ``rows[i]``), on the device."""
        k = max(seq.params.prompt_logprobs for seq in self.seqs)
        targets = to_device(self.targets, logits.device)
        parts = [token_logprobs(logits[i:i + ROWS_AT_ONCE], targets[i:i + ROWS_AT_ONCE], k)
                 for i in range(0, logits.shape[0], ROWS_AT_ONCE)]
        return PromptScores(self.seqs, self.counts, parts)


def prompt_rows(work: Seq[Tuple[Sequence, int]]) -> Optional[PromptRows]:
    """The prompt-logprob rows of a step's ``work`` ((sequence, new tokens) pairs, batch order),
    None when no sequence in it needs one."""
    seqs, counts, rows, targets = [], [], [], []
    offset = 0
    for seq, n in work:
        if seq.needs_prompt_logprobs:
            start = seq.num_computed
            first, end = max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt - 1)
            if first < end:
                seqs.append(seq)
                counts.append(end - first)
                rows += range(offset + first - start, offset + end - start)
                targets += seq.tokens[first + 1:end + 1]
        offset += n
    return PromptRows(seqs, counts, rows, targets) if seqs else None


class PromptScores:
    """One step's prompt-logprob entries on the device; ``collect`` appends them to their sequences."""

    def __init__(self, seqs: List[Sequence], counts: List[int], parts: List[Tuple[Tensor, Tensor, Tensor, Tensor]]):
        self.seqs, self.counts, self.parts = seqs, counts, parts

    def collect(self) -> None:
        """Append each sequence's entries (its own ``params.prompt_logprobs`` top tokens); a
        sequence finished meanwhile (aborted) is left as it is."""
        chosen, values, ids, ranks = (torch.cat(column).tolist() for column in zip(*self.parts))
        r = 0
        for seq, count in zip(self.seqs, self.counts):
            k = seq.params.prompt_logprobs
            if seq.status is not Status.FINISHED:
                seq.prompt_logprobs += [(chosen[j], list(zip(ids[j][:k], values[j][:k])), ranks[j])
                                        for j in range(r, r + count)]
            r += count
