"""Writing the output directory safely (fsynced temporary files and ``os.replace``), reading a
tokenizer and a resume state back, and the small formatters of the run's messages and log."""

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Sequence

from .constants import STATE_VERSION, UsageError

STATE_KEYS = ("version", "args", "step", "tokens_seen", "elapsed_s", "weights", "optimizer", "best", "best_weights",
              "rng", "log")
"""What a resume state holds (``Trainer.save_state``)."""


def _read_tokenizer(folder: Path):
    """``folder/tokenizer.json`` as a ``tokenizers.Tokenizer``; UsageError naming it when it does not load."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise UsageError(f"cannot read {path}: {' '.join(str(e).split())}") from None


def read_state(path: Path) -> Dict[str, Any]:
    """The resume state at ``path``: a regular file (``modeling.model.files.open_file``) that
    ``torch.load`` reads (weights only) as this trainer's ``STATE_VERSION``, with every part of
    ``STATE_KEYS``; a UsageError naming it otherwise (a corrupt or foreign file, a device, a
    directory), never a traceback."""
    import torch

    from ..model.files import open_file

    with open_file(path, lambda message: UsageError(f"--resume: {message}")) as f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle, zip and torch errors of a file torch.save did not write
            raise UsageError(f"--resume: {path} is not a resume state (torch.load: {type(e).__name__})") from None
    if isinstance(state, dict) and state.get("version", STATE_VERSION) != STATE_VERSION:
        raise UsageError(f"--resume: {path}: resume state version {state['version']!r}, expected {STATE_VERSION}")
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS) or not isinstance(state["args"], dict):
        raise UsageError(f"--resume: {path} is not a resume state of this trainer")
    return state


def _write_json(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=2) + "\n").encode()
    _replace_file(path, lambda f: f.write(data))


def _replace_file(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``path`` written by ``write(f)`` into a temporary file beside it, fsynced, moved over ``path``
    with ``os.replace`` and the folder fsynced: after a crash ``path`` holds its old or its new
    content, never a mix. Mode 0644."""
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    _fsync_files(path.parent, ())


def _fsync_files(folder: Path, names: Sequence[str]) -> None:
    """fsync the files ``names`` of ``folder``, then the folder itself (its entries)."""
    for p in [folder / n for n in names] + [folder]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _versions() -> Dict[str, str]:
    import torch
    v = {"torch": str(torch.__version__)}
    try:
        import triton
        v["triton"] = str(triton.__version__)
    except ImportError:
        pass
    return v
