"""Prompt checks shared by every way in (``LLM``, the command line, the ``Generator``, the server):
token ids (``checked_token_ids``; ``check_ids`` for lists of ints), the room a prompt leaves in the cache (``check_room``,
``ContextLengthError``) and the longest cache (``MAX_SEQ_LEN``). Imports no torch until a check
runs, so the command line can name ``MAX_SEQ_LEN`` from its first instant."""

from collections.abc import Mapping
from typing import Any, List

from ..common import is_int

MAX_SEQ_LEN = 2**31 - 1
"""Positions and cache lengths are int32 on the device."""


class ContextLengthError(ValueError):
    """A prompt that leaves no room for a new token in the cache (``max_seq_len``) or in the
    model's ``max_position_embeddings``."""


def check_room(longest: int, limit: int, what: str) -> None:
    """``ContextLengthError`` when a prompt of ``longest`` tokens leaves no position for a new token
    in ``limit`` positions (``what`` names the limit)."""
    if longest >= limit:
        raise ContextLengthError(f"a prompt of {longest} tokens leaves no room for a new token in {limit} "
                                 f"positions ({what})")


def checked_token_ids(prompt: Any, where: str, vocab: int) -> List[int]:
    """``prompt`` as a list of token ids: a sequence of integers (NumPy's too) or a 1-D integer
    tensor, not empty, each in [0, ``vocab``). A float or a bool is refused, never rounded; the
    error names the prompt (``where``) and the offending entry."""
    import torch

    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"{where} must be a 1-D integer tensor of token ids, got a {prompt.dim()}-D "
                             f"{str(prompt.dtype).replace('torch.', '')} tensor")
        ids = prompt.tolist()
    else:
        if isinstance(prompt, (str, bytes, Mapping)):
            raise ValueError(f"{where} must be a sequence of token ids, got a {type(prompt).__name__}")
        try:
            ids = list(prompt)
        except TypeError:
            raise ValueError(f"{where} must be a sequence of token ids, got {prompt!r}") from None
        for j, t in enumerate(ids):
            if not is_int(t):
                raise ValueError(f"{where}[{j}] must be an integer token id, got {t!r} ({type(t).__name__})")
        ids = [int(t) for t in ids]
    check_ids(ids, where, vocab)
    return ids


def check_ids(ids: List[int], where: str, vocab: int) -> None:
    """A list of ints is a prompt: not empty, each id in [0, ``vocab``) (``ValueError`` naming ``where``)."""
    if not ids:
        raise ValueError(f"{where} is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"{where} has token ids outside the model's vocabulary [0, {vocab})")
