"""Which sequences compute how many tokens in the next step (docs/generate.md, "Scheduling").

One rule serves prefill, decode and mixed steps: every running sequence computes
``tokens[num_computed:]``, cut to what is left of the step's token budget
(``max_num_batched_tokens``). Running sequences go first (oldest first), then waiting ones are
admitted in arrival order while the budget, ``max_num_seqs`` and the free blocks allow. When a
running sequence needs a block and none is free, the youngest running sequence is preempted: its
blocks and state slot are released and it goes back to the front of the queue, to be recomputed
from its tokens when readmitted. A sequence whose prompt logprobs are still to be computed is
admitted without the prefix-cache lookup (``prefill_logprobs``).
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Tuple

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledStep:
    """The sequences of one step and how many new tokens each computes, in batch order.
    ``decode_only``: every sequence computes one token and samples the next (a one-token chunk of
    a longer prompt samples nothing: its step is a mixed one); fixed when the step is made, before
    the engine counts its tokens as computed."""

    work: List[Tuple[Sequence, int]]
    decode_only: bool = field(init=False)

    def __post_init__(self):
        self.decode_only = all(n == 1 and seq.num_computed + 1 == seq.num_tokens for seq, n in self.work)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class StateSlots:
    """A free list of recurrent-state slots (one per running sequence of a hybrid model)."""

    def __init__(self, num_slots: int):
        self.free: List[int] = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 state_slots: Optional[StateSlots] = None):
        self.blocks, self.state_slots = blocks, state_slots
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        need = self.blocks.blocks_for(len(seq.tokens) + seq.max_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(f"a request of {len(seq.tokens)} prompt tokens and {seq.max_tokens} new ones needs "
                             f"{need} KV blocks; the pool has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table, seq.block_hashes = [], []
        if seq.state_slot is not None:
            self.state_slots.give(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = seq.num_cached = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: Optional[str] = None) -> None:
        """Take a sequence out (finished, or aborted with ``reason``) and free what it holds."""
        if reason is not None:
            seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> ScheduledStep:
        budget, work = self.max_num_batched_tokens, []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted by an older sequence in this loop, or no budget left
            if seq.num_tokens - seq.num_prompt >= seq.max_tokens:
                continue  # its last token is on its way to the host (a lookahead step): nothing left to compute
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_append(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.append(seq.block_table, seq.num_computed + n)
                work.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token still on its way to the host: next step
                break
            prompt = seq.tokens
            lookup = not seq.needs_prompt_logprobs  # cached positions would go unscored
            if (not self.blocks.can_allocate(prompt, seq.prefix_hashes, lookup)
                    or (self.state_slots is not None and not self.state_slots.free)):
                break
            self.waiting.popleft()
            seq.block_table, seq.block_hashes = self.blocks.allocate(prompt, seq.prefix_hashes, lookup)
            seq.num_computed = seq.num_cached = len(seq.block_hashes) * self.blocks.block_size
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.take()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(prompt) - seq.num_computed, budget)
            work.append((seq, n))
            budget -= n
        return ScheduledStep(work)
