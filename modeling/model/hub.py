"""Model names to checkpoint directories: a local directory, or a Hugging Face Hub id ``ORG/NAME``.

``resolve_model(name_or_path, revision=None, offline=None)`` returns the directory that
``QwenConfig.from_pretrained``, ``QwenTokenizer.from_pretrained`` and
``QwenForCausalLM.from_pretrained`` read: an existing local directory as it is, once
``check_checkpoint_dir`` finds its files; otherwise the Hub id's snapshot, fetched with
``huggingface_hub.snapshot_download`` into the Hub cache (only ``ALLOW_PATTERNS``), or the one
already cached when offline or when the Hub cannot be reached. Every failure to find a checkpoint
is a ``ModelNotFound`` (a ``ValueError``) with a one-line message that names what is missing. The
environment is read when ``resolve_model`` is called (not when huggingface_hub is imported), so
``HF_HUB_CACHE`` / ``HF_HOME`` / ``HF_HUB_OFFLINE`` set later in the process take effect.
"""

import os
import re
from pathlib import Path
from typing import List, Optional, Union

from ..common import one_line
from .files import open_file

ALLOW_PATTERNS: List[str] = [
    "*.json",  # config.json, generation_config.json, tokenizer*.json, model.safetensors.index.json
    "*.safetensors",
    "*.jinja",  # chat_template.jinja
    "tokenizer*",  # tokenizer.model and other tokenizer files
    "vocab.*",
    "merges.txt",
]
"""The files of a checkpoint that ``resolve_model`` downloads (no *.bin / *.pt / ONNX / GGUF weights)."""

REQUIRED_FILES = ("config.json", "tokenizer.json")

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFound(ValueError):
    """No usable checkpoint for a name: not a local directory, not in the Hub cache and not
    downloadable, or a directory that lacks ``config.json`` / ``tokenizer.json``."""


def is_hub_id(name: str) -> bool:
    """``ORG/NAME`` (letters, digits, ``-``, ``_``, ``.``; one slash; no ``..``)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def hub_cache_dir() -> Path:
    """The Hub cache, read from the environment now, with huggingface_hub's precedence:
    ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``."""
    env = os.environ
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not path:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        path = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(path)))


def check_checkpoint_dir(path: Union[str, Path], name: Optional[str] = None) -> Path:
    """``path`` if it is a directory holding ``config.json`` and ``tokenizer.json``, readable regular
    files; else ``ModelNotFound`` naming the missing or unreadable file (``name``: how the user
    called it)."""
    path = Path(path)
    what = f"{name!r} ({path})" if name is not None and name != str(path) else f"{str(path)!r}"
    if not path.exists():
        raise ModelNotFound(f"{what}: no such directory")
    if not path.is_dir():
        raise ModelNotFound(f"{what} is not a directory (a checkpoint is a directory with config.json, "
                            "*.safetensors and tokenizer.json)")
    missing = [f for f in REQUIRED_FILES if not os.path.lexists(path / f)]
    if missing:
        raise ModelNotFound(f"{what} has no {' and no '.join(missing)}")
    for f in REQUIRED_FILES:
        with open_file(path / f, lambda message: ModelNotFound(f"{what}: {message}")):
            pass
    return path


def resolve_model(name_or_path: Union[str, Path], revision: Optional[str] = None, offline: Optional[bool] = None,
                  cache_dir: Optional[Union[str, Path]] = None, progress: bool = True) -> Path:
    """The checkpoint directory for a local path or a Hub id ``ORG/NAME``.

    - ``revision``: branch, tag or commit hash of a Hub id (default ``main``); an error for a local
      directory.
    - ``offline``: ``None`` reads ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``; ``True`` uses only
      the local Hub cache; ``False`` tries the Hub first (and still falls back to the cache when
      the Hub cannot be reached).
    - ``cache_dir``: the Hub cache (default ``hub_cache_dir()``).
    - ``progress``: show the download's tqdm progress bars (stderr).

    Raises ``ModelNotFound`` (a ``ValueError``) with a one-line message when there is no checkpoint.
    A local directory wins over a Hub id of the same spelling, as in transformers.
    """
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ModelNotFound("empty model name: give a checkpoint directory or a Hub id ORG/NAME")
    local = Path(name).expanduser()
    if local.exists() or not is_hub_id(name):
        if revision is not None and local.is_dir():
            raise ModelNotFound(f"{name!r} is a local directory: a revision ({revision!r}) applies to Hub ids only")
        if not local.exists():
            raise ModelNotFound(f"{name!r}: no such directory, and not a Hub id of the form ORG/NAME")
        return check_checkpoint_dir(local, name)
    if offline is None:  # the environment variable that turns offline mode on, if one does
        variable = next((v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                         if (os.environ.get(v) or "").upper() in _TRUE), None)
        offline, why_offline = variable is not None, f"offline mode is on ({variable}=1)"
    else:
        why_offline = "offline mode is on"
    return _resolve_hub(name, revision, offline, why_offline,
                        Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir(), progress)


def _resolve_hub(repo_id: str, revision: Optional[str], offline: bool, why_offline: str, cache_dir: Path,
                 progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    at = f"{repo_id}@{revision}" if revision else repo_id
    kwargs = dict(revision=revision, cache_dir=str(cache_dir), allow_patterns=ALLOW_PATTERNS)
    online_error: Optional[BaseException] = None
    if not offline:
        try:
            path = snapshot_download(repo_id, tqdm_class=_tqdm_class(progress), **kwargs)
            return check_checkpoint_dir(path, at)
        except GatedRepoError:
            raise ModelNotFound(f"{at}: a gated model on the Hub: accept its terms on its page, then log in "
                                "(`hf auth login` or HF_TOKEN)") from None
        except RepositoryNotFoundError:
            raise ModelNotFound(f"{at}: no such model on the Hub (or it is private: log in with "
                                "`hf auth login` or set HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise ModelNotFound(f"{repo_id}: the Hub has no revision {revision or 'main'!r}") from None
        except ModelNotFound:
            raise
        except Exception as e:  # no network, Hub down, cache not writable...: try the cache alone
            online_error = e
    try:
        path = snapshot_download(repo_id, local_files_only=True, **kwargs)
    except Exception as e:  # LocalEntryNotFoundError (FileNotFoundError), an incomplete snapshot, ...
        if not offline and isinstance(online_error, FileNotFoundError) and online_error.__cause__ is not None:
            online_error = online_error.__cause__  # huggingface_hub's own fallback: say why it went offline
        why = why_offline if offline else f"the Hub could not be reached ({one_line(online_error, limit=200)})"
        detail = "" if type(e).__name__ == "LocalEntryNotFoundError" else f": {one_line(e, limit=200)}"  # e.g. incomplete
        raise ModelNotFound(f"{at}: not in the local Hub cache {cache_dir} and {why}{detail}") from None
    return check_checkpoint_dir(path, at)


def _tqdm_class(progress: bool):
    from tqdm.auto import tqdm

    if progress:
        return tqdm

    class _Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return _Silent
