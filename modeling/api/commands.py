"""What the two command lines (``python -m modeling.generate`` and ``python -m modeling.serve``)
share: ``command_main`` (parse, check and run, each failure an exit status), ``UsageError``, ``say``,
``prog_name``, the flags both take (``add_model_flags``, ``device_problem``, ``quantization_problem``), and the checkpoint and
model those flags name (``load_checkpoint``, ``load_llm``). Imports nothing heavy at the top: a
command line handles Ctrl-C and bad input from its first instant, while torch is still loading."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from ..common import one_line

if TYPE_CHECKING:
    import argparse

DEVICE_PATTERN = r"(cuda|cpu)(:\d+)?"
USAGE_ERROR, RUNTIME_ERROR, INTERRUPTED = 2, 1, 130
"""Exit statuses: bad input, any other failure, Ctrl-C."""


class UsageError(Exception):
    """Bad input from the user: printed as ``error: <message>``, exit status 2."""


def say(msg: str) -> None:
    """One line on stderr; never fails (stderr may be None or closed, a broken pipe, or ASCII-only)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def prog_name(module: str, *script_names: str) -> str:
    """The console script's name (``qwen-generate``, ``qwen-serve``), or ``python -m MODULE`` when run
    as a module (``script_names``: other names ``sys.argv[0]`` then has)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"python -m {module}" if name in ("", "-c", "__main__.py", *script_names) else name


def command_main(argv: Optional[Sequence[str]], parse: Callable, renamed: Mapping[str, str], check: Callable,
                 run: Callable[..., int], pipe_closed: Optional[int] = None) -> int:
    """A command line's exit status: ``parse(argv)`` (argparse's own exit: ``USAGE_ERROR``, or 0 after
    --help), a note for each ``renamed`` flag (old -> new) given, ``check(a)``, then ``run(a)``'s status. A
    ``UsageError`` is ``error: <message>`` and ``USAGE_ERROR``, Ctrl-C ``INTERRUPTED``, any other
    failure one line (no traceback) and ``RUNTIME_ERROR``; with ``pipe_closed``, a broken pipe (the
    reader went away, ``| head``) is that status, quietly."""
    try:
        try:
            a = parse(argv)
        except SystemExit as e:  # argparse has printed its usage message (or --help)
            return USAGE_ERROR if e.code else 0
        given = {arg.split("=", 1)[0] for arg in (sys.argv[1:] if argv is None else argv)}
        for old, new in renamed.items():
            if old in given:
                say(f"note: {old} is deprecated: use {new}")
        check(a)
        return run(a)
    except UsageError as e:
        say(f"error: {e}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        say("interrupted")
        return INTERRUPTED
    except Exception as e:
        if pipe_closed is not None and isinstance(e, BrokenPipeError):
            silence_stdout()
            return pipe_closed
        say(f"error: {type(e).__name__}: {one_line(e, typed=False)}")
        try:  # e.g. stdout on a full disk: what is still buffered would fail again at exit
            if sys.stdout is not None:
                sys.stdout.flush()
        except (OSError, ValueError):
            silence_stdout()
        return RUNTIME_ERROR


def silence_stdout() -> None:
    """After a broken pipe: point fd 1 at /dev/null, so the interpreter's final flush is quiet."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)


def add_model_flags(model, engine) -> None:
    """The flags both command lines take: where the model comes from (in the ``model`` argument
    group) and how it runs (in ``engine``'s)."""
    model.add_argument("--revision", help="branch, tag or commit of a Hub id (default main)")
    model.add_argument("--offline", action="store_true", help="use only the local Hub cache (as HF_HUB_OFFLINE=1 does)")
    engine.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                        help="weights and KV cache dtype (default bf16 on CUDA, fp32 on CPU)")
    engine.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    engine.add_argument("--quantization", choices=["fp8"],
                        help="fp8: quantise the layers' linear weights and experts to FP8 as they load (an FP8 "
                             "checkpoint runs in FP8 without it)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many GPUs of this host (a worker process each; default 1)")


def device_problem(device: Optional[str]) -> Optional[str]:
    """What is wrong with a ``--device`` value on its face (not cuda, cuda:N or cpu; an index on the
    CPU), or None; whether a CUDA device exists is the model's loading to say."""
    if device is None:
        return None
    if not re.fullmatch(DEVICE_PATTERN, device):
        return f"--device must be cuda, cuda:N or cpu, got {device!r}"
    if device.startswith("cpu:") and device != "cpu:0":
        return f"--device {device}: the CPU has no index (use --device cpu)"
    return None


def quantization_problem(quantization: Optional[str], tensor_parallel_size: int) -> Optional[str]:
    """What is wrong with ``--quantization`` beside ``--tensor-parallel-size`` (quantisation at load
    takes a model on one device), or None."""
    if quantization is not None and tensor_parallel_size > 1:
        return (f"--quantization {quantization} takes a model on one device, not --tensor-parallel-size "
                f"{tensor_parallel_size}")
    return None


def load_checkpoint(a: argparse.Namespace):
    """The ``Checkpoint`` of ``--model`` (``--revision``, ``--offline``); the shipped model without one.
    A ``UsageError`` also when ``--max-model-len`` exceeds its max_position_embeddings."""
    from ..engine.prompts import check_model_len
    from ..model.hub import ModelNotFound
    from .checkpoint import Checkpoint

    try:
        ck = Checkpoint.load(a.model, a.revision, True if a.offline else None, progress=True, notice=say)
    except ModelNotFound as e:
        raise UsageError(f"--model {e}") from None
    except ValueError as e:  # ConfigError, the tokenizer's files, generation_config.json
        where = f"--model {a.model!r}" if a.model is not None else "the default model"
        raise UsageError(f"{where}: {e}") from None
    try:
        check_model_len(a.max_model_len, ck.config.max_position_embeddings, "--max-model-len")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return ck


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
