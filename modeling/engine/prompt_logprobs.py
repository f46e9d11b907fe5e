"""A prompt's own log-probabilities (vLLM's ``prompt_logprobs``): token i of the prompt given
tokens 0..i-1, for i >= 1, with the k most likely tokens at each position.

    lp = log_softmax(model(prompt)[:-1]) (fp32)    entry i = (lp[i-1, prompt[i]], top-k of lp[i-1])

One forward of the whole prompt outside the engine's steps (no KV cache, no CUDA graph), as a
reference model call: a request that asks for them pays a second prefill.
"""
from typing import List, Optional, Sequence

import torch

from .sequence import LogprobEntry


@torch.inference_mode()
def prompt_logprobs(model, prompt_ids: Sequence[int], k: int) -> List[Optional[LogprobEntry]]:
    """[None, entry of token 1, ..., entry of token L-1] (see the module doc)."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    lp = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
    chosen = lp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    top = lp.topk(k, dim=-1) if k else None
    out: List[Optional[LogprobEntry]] = [None]
    for i, c in enumerate(chosen):
        pairs = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else []
        out.append((c, pairs))
    return out
