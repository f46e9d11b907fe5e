"""qwen::apply_token_bitmask: the kernel against the reference and against a bit-by-bit Python
oracle, on the word boundaries (a vocabulary that is not a multiple of 32, bit 31, a mask wider than
the vocabulary), the all-ones and all-zeros rows, opcheck, and a CUDA graph replay with new masks."""
import pytest
import torch

import qwen_ops
from tests.helpers import DEVICES, DTYPES, poison_allocator, randn


def random_bitmask(rows: int, words: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32).to(device)


def python_oracle(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit, in plain Python integers (an oracle that shares nothing with the reference)."""
    out = logits.detach().cpu().clone()
    words = bitmask.cpu().tolist()
    for s in range(out.shape[0]):
        for v in range(out.shape[1]):
            if not (words[s][v // 32] & 0xFFFFFFFF) >> (v % 32) & 1:
                out[s, v] = float("-inf")
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, words", [(1, 5, 1), (3, 64, 2), (4, 1029, 33), (2, 1100, 40)])
def test_apply_token_bitmask_matches_the_oracle(device, dtype, rows, vocab, words):
    logits = randn(rows, vocab, dtype=dtype, device=device, scale=4.0)
    bitmask = random_bitmask(rows, words, device)
    bitmask[0, 0] = -1  # every bit, 31 (the sign) included
    if rows > 1:
        bitmask[1] = 0  # a row with nothing allowed
    if rows > 2:
        bitmask[2] = -1  # an unconstrained row
    poison_allocator(device)
    out = torch.ops.qwen.apply_token_bitmask(logits, bitmask)
    assert out.dtype == dtype and out.shape == logits.shape and out.is_contiguous()
    expected = python_oracle(logits, bitmask)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(qwen_ops.apply_token_bitmask_reference(logits, bitmask).cpu(), expected)
    if rows > 2:
        assert torch.equal(out[2], logits[2])


@pytest.mark.parametrize("device", DEVICES)
def test_apply_token_bitmask_strided_logits_and_opcheck(device):
    base = randn(3, 300, dtype=torch.float32, device=device)
    logits = base[:, 10:270]  # rows 300 apart, 260 columns
    bitmask = random_bitmask(3, 9, device, seed=1)
    assert torch.equal(torch.ops.qwen.apply_token_bitmask(logits, bitmask).cpu(), python_oracle(logits, bitmask))
    torch.library.opcheck(torch.ops.qwen.apply_token_bitmask.default, (logits.contiguous(), bitmask))


def test_apply_token_bitmask_errors():
    x = torch.randn(2, 64)
    with pytest.raises(qwen_ops.QwenOpError, match="bitmask must be int32"):
        torch.ops.qwen.apply_token_bitmask(x, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(qwen_ops.QwenOpError, match=r"bitmask must have shape \[2, >= 2\]"):
        torch.ops.qwen.apply_token_bitmask(x, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(qwen_ops.QwenOpError, match="logits must have 2 dims"):
        torch.ops.qwen.apply_token_bitmask(x[0], torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.cuda
def test_apply_token_bitmask_replays_in_a_cuda_graph():
    logits = torch.empty(8, 151936, device="cuda", dtype=torch.bfloat16)
    bitmask = torch.empty(8, 4748, device="cuda", dtype=torch.int32)
    logits.copy_(randn(8, 151936, dtype=torch.bfloat16, device="cuda"))
    bitmask.copy_(random_bitmask(8, 4748, "cuda"))
    torch.ops.qwen.apply_token_bitmask(logits, bitmask)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.qwen.apply_token_bitmask(logits, bitmask)
    for seed in (1, 2):
        logits.copy_(randn(8, 151936, dtype=torch.bfloat16, device="cuda"))
        bitmask.copy_(random_bitmask(8, 4748, "cuda", seed))
        graph.replay()
        assert torch.equal(out, qwen_ops.apply_token_bitmask_reference(logits, bitmask))
