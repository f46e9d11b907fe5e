"""Packed (varlen) sequences: which sequence, and which tile of it, a program serves.

S sequences lie back to back in N flat rows: sequence i holds rows cu[i]:cu[i + 1]
(``cu_seqlens`` [S + 1] int32, cu[0] = 0, nondecreasing, cu[S] = N). Kernels that split every
sequence into tiles of TILE rows (the conv's row ranges, the delta rule's chunks of 64; a
sequence's last tile may be partial, no tile crosses a sequence boundary) number the tiles by
"slots" computed from cu alone, so that the grid depends on shapes only (CUDA graphs):

    sequence i owns slots  first(i) = cu[i] // TILE + i  ...  first(i) + cdiv(len_i, TILE) - 1

first() increases strictly (first(i + 1) - first(i) = (cu[i + 1] // TILE - cu[i] // TILE) + 1 >= 1
and >= cdiv(len_i, TILE)), so the slots of different sequences never collide, and the last one is
at most N // TILE + S - 1: a grid of ``num_slots(N, S, TILE)`` programs covers every tile. A slot
past its sequence's tiles (at most one per sequence, also the one slot of a length-0 sequence)
finds t0 >= eos and does nothing. The owner of slot p is the last i with first(i) <= p: one
vector load of cu and a count, no search loop.
"""
import triton
import triton.language as tl


def num_slots(n: int, s: int, tile: int) -> int:
    """Programs (tile slots) that cover every tile of s packed sequences of n rows in all."""
    return n // tile + s if s else 0


def seq_block(s: int) -> int:
    """BLOCK_S of `packed_tile`: cu[0:s] in one power-of-two vector."""
    return triton.next_power_of_2(max(s, 1))


@triton.jit
def packed_tile(pid, cu_ptr, S, TILE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile slot pid -> (seq, bos, eos, t0): the sequence owning it, its rows [bos, eos) and the
    tile's first row t0 (t0 >= eos: no rows, the program has nothing to do)."""
    i = tl.arange(0, BLOCK_S)
    first = tl.load(cu_ptr + i, mask=i < S, other=0) // TILE + i
    seq = tl.sum(((first <= pid) & (i < S)).to(tl.int32), axis=0) - 1
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    t0 = bos + (pid - (bos // TILE + seq)) * TILE
    return seq, bos, eos, t0
