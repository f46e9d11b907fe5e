"""The prompt checks every way in shares (``Engine.add``, ``LLM``, the server): token ids
(``checked_token_ids``; ``check_ids`` for lists of ints), the room a request leaves in
``max_model_len`` positions (``check_room``, ``ContextLengthError``), the longest
``max_model_len`` (``MAX_MODEL_LEN``), the engine's sizes (``check_engine_args``) and the
``max_model_len`` a model holds (``check_model_len``). Imports no torch until a check runs, so the
command line can name ``MAX_MODEL_LEN`` from its first instant."""

from collections.abc import Mapping
from typing import Any, List

from ..common import is_int

MAX_MODEL_LEN = 2**31 - 1
"""Positions and cache lengths are int32 on the device."""


def check_engine_args(max_model_len: Any, max_num_seqs: Any, max_num_batched_tokens: Any) -> None:
    """A ``ValueError`` naming the argument for a ``max_model_len`` that is not an integer in [2,
    ``MAX_MODEL_LEN``] (None passes), or a ``max_num_seqs`` or ``max_num_batched_tokens`` that is not
    an integer >= 1 (``LLM`` and ``Engine`` check theirs here)."""
    if max_model_len is not None and not (is_int(max_model_len) and 2 <= max_model_len <= MAX_MODEL_LEN):
        raise ValueError(f"max_model_len must be an integer in [2, {MAX_MODEL_LEN}] (or None), got {max_model_len!r}")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
        if not (is_int(value) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_model_len(max_model_len: Any, positions: int, name: str = "max_model_len") -> None:
    """A ``ValueError`` for a ``max_model_len`` above the model's ``positions`` (its
    max_position_embeddings; None passes); ``name``: the argument or flag it names (``LLM`` and the
    command lines check theirs here)."""
    if max_model_len is not None and max_model_len > positions:
        raise ValueError(f"{name} {max_model_len} exceeds the model's max_position_embeddings ({positions})")


class ContextLengthError(ValueError):
    """A request whose prompt and new tokens do not fit ``max_model_len`` positions."""


def check_room(num_prompt: int, max_tokens: int, max_model_len: int, where: str = "a prompt") -> None:
    """``ContextLengthError`` when ``num_prompt`` prompt tokens and ``max_tokens`` new ones exceed
    ``max_model_len`` positions (``where`` names the prompt)."""
    if num_prompt + max_tokens > max_model_len:
        room = max_model_len - num_prompt
        fix = f"max_tokens of at most {room} fit" if room > 0 else "no new token fits"
        raise ContextLengthError(f"{where} of {num_prompt} tokens and max_tokens {max_tokens} exceed max_model_len "
                                 f"{max_model_len} ({fix})")


def checked_token_ids(prompt: Any, where: str, vocab: int) -> List[int]:
    """``prompt`` as a list of token ids: a sequence of integers (NumPy's too) or a 1-D integer
    tensor, not empty, each in [0, ``vocab``). A float or a bool is refused, never rounded; the
    error names the prompt (``where``) and the offending entry."""
    if type(prompt) is list and set(map(type, prompt)) == {int}:  # the common case, checked at C speed
        check_ids(prompt, where, vocab)
        return list(prompt)
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
