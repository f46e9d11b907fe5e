"""Which tokens a sequence may sample next: its token bitmask (xgrammar's layout: bit ``v % 32`` of
int32 word ``v // 32`` allows token v), built on the host for the rows that exclude some, and
applied on the device by ``torch.ops.qwen.apply_token_bitmask`` (docs/generate.md, "Sampling").

A sequence's ``TokenControls`` gather what excludes tokens (``SamplingParams``):
``allowed_token_ids`` and one-token ``bad_words`` (a fixed mask, made once), longer bad words (the
word's last token while the output ends with its others), ``min_tokens`` (the stop tokens until
then) and a grammar (``GrammarMatcher``: the tokens that keep the output in the grammar, filled
per step). Longer bad words and grammars read the output so far (``needs_history``). Should the
bans leave a grammar row nothing, the grammar's mask wins (a grammar that must end gets its stop
tokens).

The masks are built on the host while the device runs a forward pass (``Engine.step``: once the
tokens before are read, before the next step is packed), so they must take less time than one,
together with the rest of the host's step: the rows held to a grammar alone (the
common case) are filled together by xgrammar's ``BatchGrammarMatcher`` (one call into its C++),
with their dead ends found in one pass over the bitmask; the other rows one by one (``fill``).

A grammar can reach a dead end: its output so far is a prefix of some instance, but no token of
the vocabulary continues it (a vocabulary without single spaces, after a "," that the grammar
must follow with one). The row's mask is then empty (``dead_end``), its sampled token means
nothing, and the sequence ends there with finish_reason "abort" (``Sequence.append``); the other
rows of the step go on.
"""

import threading
from typing import List, Optional, Sequence as Seq, Tuple

import numpy as np
import torch

from .sampling_params import SamplingParams


def words(vocab: int) -> int:
    """int32 words of a row of the bitmask."""
    return -(-vocab // 32)


def clear(row: np.ndarray, tokens: Seq[int]) -> None:
    """Clear the bits of ``tokens`` in ``row`` [W] int32."""
    bits = row.view(np.uint32)
    for t in tokens:
        bits[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


class TokenControls:
    """What excludes tokens for one sequence (see the module doc). ``bad_words``: each bad word's
    token ids (as ``bad_word_ids`` tokenizes them); ``stop_ids``: the sequence's stop tokens;
    ``matcher``: a grammar's ``xgrammar.GrammarMatcher`` or None."""

    def __init__(self, params: SamplingParams, vocab: int, bad_words: Seq[Seq[int]], stop_ids: Seq[int],
                 matcher=None):
        self.fixed: Optional[np.ndarray] = None
        single = [w[0] for w in bad_words if len(w) == 1]
        if params.allowed_token_ids is not None or single:
            self.fixed = np.zeros(words(vocab), np.int32) if params.allowed_token_ids is not None \
                else np.full(words(vocab), -1, np.int32)
            if params.allowed_token_ids is not None:
                bits = self.fixed.view(np.uint32)
                for t in params.allowed_token_ids:
                    bits[t >> 5] |= np.uint32(1 << (t & 31))
            clear(self.fixed, single)
        self.bad_words: List[Tuple[List[int], int]] = [(list(w[:-1]), w[-1]) for w in bad_words if len(w) > 1]
        self.min_tokens, self.stop_ids = params.min_tokens, tuple(stop_ids)
        self.matcher = matcher
        self.dead_end = False

    @property
    def grammar_only(self) -> bool:
        """Only a grammar, not completed, excludes tokens: its row is the grammar's mask."""
        return (self.fixed is None and self.min_tokens <= 0 and not self.bad_words and self.matcher is not None
                and not self.matcher.is_terminated())

    @property
    def needs_history(self) -> bool:
        """Its mask depends on output tokens: the host must have read them before the next step."""
        return bool(self.bad_words) or self.matcher is not None

    def fill(self, bitmask: torch.Tensor, index: int, output: List[int], num_output: int) -> None:
        """Write the mask of the next token into row ``index`` of ``bitmask`` [S, W] int32 on the
        host (all ones there); ``output``: the output token ids on the host, ``num_output``: the
        tokens generated so far (those still on the device included)."""
        mask = bitmask[index].numpy()
        grammar = None
        if self.matcher is not None and not self.matcher.is_terminated():  # terminated: its sequence has ended
            self.matcher.fill_next_token_bitmask(bitmask, index)
            grammar = mask.copy()
        if self.fixed is not None:
            mask &= self.fixed
        if num_output < self.min_tokens:
            clear(mask, self.stop_ids)
        for prefix, last in self.bad_words:
            if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
                clear(mask, [last])
        if grammar is not None and not mask.any():
            mask[:] = grammar
            self.dead_end = not grammar.any() and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        """Its grammar is complete (it took a stop token): the sequence ends there, whatever its
        own stop tokens (with ``ignore_eos`` too), since the grammar allows nothing after."""
        return self.matcher is not None and self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance the grammar past a sampled token (a ``RuntimeError`` if it refuses it: the mask
        allowed only tokens it takes)."""
        if self.matcher is not None and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")


def bad_word_ids(tokenizer, bad_words: Seq[str]) -> List[List[int]]:
    """Each bad word's token ids, as vLLM tokenizes them: the word with its leading whitespace
    stripped (a word of whitespace alone, "\\n", as it is), and with one leading space when that
    spells it with other tokens of the same count (the word inside a text)."""
    out: List[List[int]] = []
    for word in bad_words:
        word = word.lstrip() or word
        plain = tokenizer.encode(word)
        out.append(plain)
        spaced = tokenizer.encode(" " + word)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


_per_thread = threading.local()


def fill_grammars(matchers: list, bitmask: torch.Tensor, rows: List[int]) -> None:
    """Write each matcher's next-token mask into its row of ``bitmask`` (rows ``rows``), together
    (xgrammar's ``BatchGrammarMatcher``: one per thread, made at the thread's first call, filling on
    that thread: its own pool of threads filled 64 rows slower than one thread, docs/performance.md)."""
    batch = getattr(_per_thread, "batch_matcher", None)
    if batch is None:
        from .structured_outputs import xgrammar

        batch = _per_thread.batch_matcher = xgrammar().BatchGrammarMatcher(max_threads=1)
    batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def token_bitmask(seqs, vocab: int, generated: Seq[int], pin: bool = False) -> Optional[torch.Tensor]:
    """The bitmask [len(seqs), W] int32 on the host (in pinned memory with ``pin``) of a step's
    sampling sequences (row i is ``seqs[i]``'s, ``generated[i]`` the tokens it has generated before
    this one), or None when none of them excludes a token."""
    rows = [i for i, s in enumerate(seqs) if s.controls is not None]
    if not rows:
        return None
    grammar, other = [], []
    for i in rows:
        (grammar if seqs[i].controls.grammar_only else other).append(i)
    bitmask = torch.empty((len(seqs), words(vocab)), dtype=torch.int32, pin_memory=pin)
    host = bitmask.numpy()
    if len(grammar) < len(seqs):  # the grammar rows are written whole by their fill
        host[np.setdiff1d(np.arange(len(seqs)), grammar)] = -1
    if grammar:
        fill_grammars([seqs[i].controls.matcher for i in grammar], bitmask, grammar)
        empty = ~(host if len(grammar) == len(seqs) else host[grammar]).any(axis=1)
        for i, dead in zip(grammar, empty.tolist()):
            seqs[i].controls.dead_end = dead
    for i in other:
        seqs[i].controls.fill(bitmask, i, seqs[i].output_ids, generated[i])
    return bitmask
