"""What the two command lines (``python -m modeling.generate`` and ``python -m modeling.serve``)
share: ``UsageError`` (bad input: exit status 2), ``say`` (one line on stderr), ``prog_name``, the
notes for deprecated flags (``say_renamed``), the values their flags take (``DTYPE_CHOICES``,
``DEVICE_PATTERN``), and the checkpoint and model their flags name (``load_checkpoint``,
``load_llm``), each failure a ``UsageError`` naming the flag.

Imports nothing heavy at the top: a command line handles Ctrl-C and bad input from its first
instant, while torch is still loading."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from ..common import one_line

if TYPE_CHECKING:
    import argparse

DTYPE_CHOICES = ("bf16", "fp16", "fp32")
DEVICE_PATTERN = r"(cuda|cpu)(:\d+)?"


class UsageError(Exception):
    """Bad input from the user: printed as ``error: <message>``, exit status 2."""


def say(msg: str) -> None:
    """One line on stderr; never fails (stderr may be closed, a broken pipe, or ASCII-only)."""
    err = sys.stderr
    if err is None:
        return
    try:
        err.write(msg + "\n")
        err.flush()
    except (OSError, ValueError):
        pass


def prog_name(module: str, *script_names: str) -> str:
    """The console script's name (``qwen-generate``, ``qwen-serve``), or ``python -m MODULE`` when run
    as a module (``script_names``: other names ``sys.argv[0]`` then has)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"python -m {module}" if name in ("", "-c", "__main__.py", *script_names) else name


def say_renamed(argv: Optional[Sequence[str]], renamed: Mapping[str, str]) -> None:
    """A note for each earlier flag of ``renamed`` (old -> new) given in ``argv`` (None: the
    command line's), naming the new one."""
    given = {arg.split("=", 1)[0] for arg in (sys.argv[1:] if argv is None else argv)}
    for old, new in renamed.items():
        if old in given:
            say(f"note: {old} is deprecated: use {new}")


def load_checkpoint(a: argparse.Namespace):
    """The ``Checkpoint`` of ``--model`` (``--revision``, ``--offline``); the shipped model without one."""
    from ..model.hub import ModelNotFound
    from .checkpoint import Checkpoint

    name = a.model
    try:
        return Checkpoint.load(a.model, a.revision, True if a.offline else None, progress=True, notice=say)
    except ModelNotFound as e:
        raise UsageError(f"--model {e}") from None
    except ValueError as e:  # ConfigError, the tokenizer's files, generation_config.json
        where = f"--model {name!r}" if name is not None else "the default model"
        raise UsageError(f"{where}: {e}") from None


def load_llm(ck, device, dtype, **kwargs: Any):
    """``LLM(ck, device=device, dtype=dtype, **kwargs)``: the weights read, or a ``UsageError``
    saying why not (they do not fit, a broken checkpoint, an unreadable file, a bad setting)."""
    from ..model.config import ConfigError
    from ..model.device import DoesNotFit
    from ..model.loader import CheckpointError
    from .llm import LLM

    try:
        return LLM(ck, device=device, dtype=dtype, **kwargs)
    except DoesNotFit as e:
        raise UsageError(f"the model does not fit: {e}") from None
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--model {str(ck.path)!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"--model {str(ck.path)!r}: cannot read the weights ({e})") from None
    except ValueError as e:  # a device or dtype that does not exist here, an engine setting out of range
        raise UsageError(one_line(e, typed=False)) from None
    except Exception as e:
        if type(e).__name__ == "SafetensorError":
            raise UsageError(f"--model {str(ck.path)!r}: unreadable weights ({one_line(e, typed=False)})") from None
        raise
