"""Paged KV blocks: which block holds which positions of which sequence, and prefix caching.

The pool (``modeling.engine.cache_pool``) holds ``num_blocks`` blocks of ``block_size`` positions
per attention layer; a sequence's ``block_table`` lists its blocks in position order, so position
p lives in block ``block_table[p // block_size]`` at offset ``p % block_size``, KV slot
``block * block_size + p % block_size``.

Prefix caching (attention-only models): a block that a sequence has filled with prompt tokens is
registered under a hash of its tokens chained with the hash of the block before it, so the hash
names the whole prefix up to the block's end. A new sequence whose prompt starts with the same
full blocks takes those blocks (reference counted) instead of computing them again. A block whose
count drops to zero stays cached until it is needed for new work: free blocks are reused in least-
recently-freed order, and reusing a cached one forgets its hash.
"""

import hashlib
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple


def block_hash(block, parent: Optional[bytes]) -> bytes:
    """The chained content hash of one full block: BLAKE2b-128 of the previous block's hash and the
    block's token ids (``block``: their int64 bytes, any bytes-like object), so equal hashes mean
    equal prefixes (a collision has probability 2^-128)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(block)
    return h.digest()


def extend_hashes(tokens: Sequence[int], hashes: List[bytes], num_blocks: int, block_size: int) -> None:
    """Extend ``hashes`` in place to the ``block_hash`` chain of the first ``num_blocks`` full blocks
    of ``tokens`` (the ones it already holds are kept: a prefix's hashes never change), converting
    the new blocks' tokens to int64 bytes once and hashing slices of them."""
    start = len(hashes)
    if num_blocks <= start:
        return
    data = memoryview(array("q", tokens[start * block_size:num_blocks * block_size])).cast("B")
    step, parent = block_size * 8, hashes[-1] if hashes else None
    for i in range(num_blocks - start):
        parent = block_hash(data[i * step:(i + 1) * step], parent)
        hashes.append(parent)


class BlockManager:
    """Allocation and reference counts of ``num_blocks`` KV blocks of ``block_size`` positions.

    ``allocate(tokens, known)`` returns (block table, hashes of the leading blocks already cached);
    ``append(table, num_tokens)`` grows a table to hold ``num_tokens`` positions;
    ``commit(table, tokens, num_tokens, hashes)`` registers the full blocks of ``tokens[:num_tokens]``
    for prefix reuse;
    ``free(table)`` drops a sequence's references."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs at least one block of at least one position, got "
                             f"{num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: List[Optional[bytes]] = [None] * num_blocks
        self.cached: Dict[bytes, int] = {}  # prefix hash -> block
        self.free_blocks: "OrderedDict[int, None]" = OrderedDict((b, None) for b in range(num_blocks))
        self.hits = self.queries = 0  # prefix-cache statistics, in blocks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are reused when needed)."""
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, block: int) -> int:
        if self.ref_count[block] == 0:
            del self.free_blocks[block]
        self.ref_count[block] += 1
        return block

    def _new_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)  # the least recently freed
        self.cached.pop(self.hash_of[block], None)  # its cached prefix, if any, is forgotten
        self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def cached_prefix(self, tokens: Sequence[int], known: Optional[List[bytes]] = None
                      ) -> Tuple[List[int], List[bytes]]:
        """(blocks, their hashes): the cached blocks that hold the leading full blocks of ``tokens``
        (never the whole prompt: its last token must run to produce logits). ``known``: the hash
        chain of ``tokens``' leading blocks computed so far (``Sequence.prefix_hashes``), extended
        in place, so a prompt is hashed once however often it is looked up."""
        if not self.prefix_caching:
            return [], []
        known = [] if known is None else known
        extend_hashes(tokens, known, (len(tokens) - 1) // self.block_size, self.block_size)
        blocks: List[int] = []
        for h in known[:(len(tokens) - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, known[:len(blocks)]

    def _fits(self, num_tokens: int, hit: Sequence[int]) -> bool:
        held = sum(self.ref_count[b] > 0 for b in hit)
        return self.blocks_for(num_tokens) - held <= self.num_free

    def can_allocate(self, tokens: Sequence[int], known: Optional[List[bytes]] = None, lookup: bool = True) -> bool:
        return self._fits(len(tokens), self.cached_prefix(tokens, known)[0] if lookup else [])

    def allocate(self, tokens: Sequence[int], known: Optional[List[bytes]] = None,
                 lookup: bool = True) -> Tuple[List[int], List[bytes]]:
        """(block table for ``tokens``, the hashes of its leading blocks found cached: those hold
        ``len(hashes) * block_size`` tokens already). Raises MemoryError when the blocks are not
        there (check ``can_allocate`` first). ``known``: as for ``cached_prefix``; ``lookup=False``:
        every block new, the prefix cache not asked (nor counted in ``hits`` and ``queries``)."""
        hit, hashes = self.cached_prefix(tokens, known) if lookup else ([], [])
        if not self._fits(len(tokens), hit):
            raise MemoryError(f"{self.blocks_for(len(tokens))} KV blocks needed, {self.num_free} free")
        table = [self._take(b) for b in hit]
        if lookup:
            self.queries += self.blocks_for(len(tokens))
        self.hits += len(hit)
        table += [self._new_block() for _ in range(self.blocks_for(len(tokens)) - len(hit))]
        return table, hashes

    def can_append(self, table: Sequence[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free

    def append(self, table: List[int], num_tokens: int) -> None:
        """Grow ``table`` in place to hold ``num_tokens`` positions."""
        if not self.can_append(table, num_tokens):
            raise MemoryError(f"{self.blocks_for(num_tokens) - len(table)} KV blocks needed, {self.num_free} free")
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._new_block())

    def commit(self, table: Sequence[int], tokens: Sequence[int], num_tokens: int, hashes: List[bytes],
               known: Optional[List[bytes]] = None) -> None:
        """Register the full blocks of ``tokens[:num_tokens]`` (whose KV is now in the pool) for prefix
        reuse; ``hashes``: the hashes of the sequence's blocks registered so far, extended in place
        (each block is registered once, when it fills: a step that fills no block costs nothing
        here). ``known``: as for ``cached_prefix``, also extended; without it the new blocks are
        hashed here."""
        if not self.prefix_caching:
            return
        chain = [] if known is None else known
        if known is None:
            chain += hashes
        extend_hashes(tokens, chain, num_tokens // self.block_size, self.block_size)
        for i in range(len(hashes), num_tokens // self.block_size):
            h = chain[i]
            hashes.append(h)
            block = table[i]
            if h in self.cached:  # this block, or another one holding the same prefix
                continue
            self.cached.pop(self.hash_of[block], None)
            self.hash_of[block], self.cached[h] = h, block

    def free(self, table: Sequence[int]) -> None:
        """Drop one reference to each block of ``table``; blocks nobody holds become free, last in
        the reuse order (the most recently used stay cached longest)."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
