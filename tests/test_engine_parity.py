"""The engine against transformers: random tiny Qwen3, Qwen2 and Qwen3.5 checkpoints saved with
``save_pretrained`` and loaded with modeling, several prompts of different lengths run as
one continuous batch (chunked prefill under a small token budget, so prompts are cut across steps
and share steps with decoding sequences): each prompt's greedy tokens are transformers' greedy
tokens for it alone. float32 runs the Triton kernels (under the interpreter on the CPU), float64
the PyTorch references (exact and fast): the Qwen3 case takes both, the others float64 only to
keep CI short (tests/test_engine.py and tests/test_qwen3_5.py run Qwen3.5's kernels)."""

import pytest
import torch

from modeling import QwenForCausalLM, SamplingParams
from modeling.engine import Engine
from tests.helpers import hf_greedy
from tests.test_modeling import random_hf_model as random_dense_model
from tests.test_qwen3_5 import random_hf_model as random_hybrid_model

NEW_TOKENS = 10
MODELS = {
    "qwen3": lambda dtype: random_dense_model("qwen3", True, 4, 2, 16, dtype=dtype),
    "qwen2": lambda dtype: random_dense_model("qwen2", False, 4, 2, 32, dtype=dtype),
    "qwen3_5": lambda dtype: random_hybrid_model(dtype=dtype),
}
CASES = [("qwen3", torch.float32), ("qwen3", torch.float64), ("qwen2", torch.float64), ("qwen3_5", torch.float64)]


@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
@torch.no_grad()
def test_engine_greedy_equals_transformers(tmp_path, name, dtype):
    hf = MODELS[name](dtype)
    hf.save_pretrained(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (7, 30, 1, 19)]
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=64, block_size=16)
    got = engine.generate(prompts, SamplingParams(), NEW_TOKENS)
    want = [hf_greedy(hf, torch.tensor([p]), NEW_TOKENS)[0].tolist() for p in prompts]
    assert got == want
    assert len({t for tokens in got for t in tokens}) > 8  # not a trivial repetition
    assert engine.stats.steps > NEW_TOKENS + 2  # the budget cut the prompts into chunks
