"""The checkpoint, sampling settings and ``LLM`` a command line asks for, each failure a
``UsageError`` naming the flag (shared with ``python -m modeling.serve``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common import one_line
from .args import UsageError
from .output import say

if TYPE_CHECKING:
    import argparse


def load_checkpoint(a: argparse.Namespace):
    from ..model.hub import ModelNotFound
    from ..api.checkpoint import Checkpoint

    name = a.model
    try:
        return Checkpoint.load(a.model, a.revision, True if a.offline else None, progress=True, notice=say)
    except ModelNotFound as e:
        raise UsageError(f"--model {e}") from None
    except ValueError as e:  # ConfigError, the tokenizer's files, generation_config.json
        where = f"--model {name!r}" if name is not None else "the default model"
        raise UsageError(f"{where}: {e}") from None


def sampling_params(a: argparse.Namespace, ck):
    """The flags given, the checkpoint's generation_config.json for the others (with a note)."""
    from ..api.llm import DEFAULT_MAX_TOKENS
    from ..generation.sampling import SamplingParams

    d = ck.defaults.merged(a.temperature, a.top_k, a.top_p, a.max_new_tokens)
    from_checkpoint = []
    if not ck.defaults.greedy:
        from_checkpoint += [f"{name} {value:g}" for name, flag, value in
                            (("temperature", a.temperature, d.temperature), ("top-k", a.top_k, d.top_k),
                             ("top-p", a.top_p, d.top_p)) if flag is None]
    if a.max_new_tokens is None and ck.defaults.max_new_tokens is not None:
        from_checkpoint.append(f"max-new-tokens {d.max_new_tokens}")
    if from_checkpoint:
        say(f"note: from the checkpoint's generation_config.json: {', '.join(from_checkpoint)} (flags override)")
    try:
        return SamplingParams(d.temperature, d.top_k, d.top_p, a.seed, max_tokens=d.max_new_tokens or DEFAULT_MAX_TOKENS,
                              stop=tuple(a.stop))
    except ValueError as e:
        raise UsageError(str(e)) from None


def load_llm(ck, device, dtype, **kwargs):
    from ..model.config import ConfigError
    from ..api.llm import LLM
    from ..generation.runtime import DoesNotFit
    from ..model.loader import CheckpointError

    try:
        return LLM(ck, device=device, dtype=dtype, **kwargs)
    except DoesNotFit as e:
        raise UsageError(f"the model does not fit: {e}") from None
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--model {str(ck.path)!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"--model {str(ck.path)!r}: cannot read the weights ({e})") from None
    except Exception as e:
        if type(e).__name__ == "SafetensorError":
            raise UsageError(f"--model {str(ck.path)!r}: unreadable weights ({one_line(e, typed=False)})") from None
        raise
