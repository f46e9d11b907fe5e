"""How this package opens a checkpoint's files (config.json, tokenizer.json, the weights, ...): only
a regular file, symlinks followed, and never more of it than a limit for its kind.

Anything else in a checkpoint directory would hang or exhaust the reader: a FIFO blocks the first
read until a writer comes, and a symlink to ``/dev/zero`` never ends. ``open_file`` refuses what
``os.stat`` says is not a regular file before opening it, then opens with ``O_NONBLOCK`` and checks
the open file again, so a FIFO swapped in between cannot block either. ``read_file`` reads at most
``limit + 1`` bytes, so a file that grows, or reports no size (``/proc``), is bounded too. Each
refusal is one line naming the file, raised as the caller's ``error`` class (``ConfigError``,
``CheckpointError``, ...; ``ValueError`` by default).
"""

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Optional, Union

SIDE_FILE_LIMIT = 64 << 20
"""Bytes a JSON side file or chat template may have (config.json, generation_config.json,
tokenizer_config.json, model.safetensors.index.json, chat_template.jinja): released ones are well
under a megabyte."""
TOKENIZER_LIMIT = 512 << 20
"""Bytes tokenizer.json may have: the largest vocabularies in use write a few tens of MiB."""

Error = Callable[[str], Exception]
PathLike = Union[str, os.PathLike]

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def open_file(path: PathLike, error: Error = ValueError) -> BinaryIO:
    """``path`` opened for binary reading, once it is known to be a regular file (symlinks followed);
    ``error`` with one line naming it when it is missing, not a regular file, or unreadable."""
    name = _name(path)
    try:
        _check_regular(path, os.stat(path).st_mode, error)
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise error(f"{name} not found" if not os.path.islink(path) else
                    f"{name} is a link to {os.path.realpath(path)}, which does not exist") from None
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
    f = os.fdopen(fd, "rb")
    try:
        _check_regular(path, os.fstat(fd).st_mode, error)  # swapped for something else since the stat
    except BaseException:
        f.close()
        raise
    return f


def read_file(path: PathLike, limit: int, error: Error = ValueError) -> bytes:
    """The bytes of the regular file ``path`` (``open_file``), at most ``limit`` of them: a larger
    file is an ``error`` naming it, found from its size before anything is read."""
    with open_file(path, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(_too_large(path, limit, size))
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"cannot read {_name(path)}: {e.strerror or e}") from None
    if len(data) > limit:
        raise error(_too_large(path, limit))
    return data


def read_json(path: PathLike, error: Error = ValueError, optional: bool = False,
              limit: int = SIDE_FILE_LIMIT) -> Dict[str, Any]:
    """The JSON object in ``path`` (``read_file`` under ``limit``); ``{}`` when ``optional`` and
    nothing is at ``path``. Anything that is not a JSON object in UTF-8 is an ``error`` naming the
    file."""
    if optional and not os.path.lexists(path):
        return {}
    raw = read_file(path, limit, error)
    name = _name(path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested too deep
        raise error(f"unreadable {name} ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise error(f"{name} is not a JSON object (it holds a {type(data).__name__})")
    return data


def decode_utf8(data: bytes, what: str, error: Error = ValueError) -> str:
    """``data`` as UTF-8 text (a leading BOM dropped); ``error`` naming ``what`` and the first byte
    that is not UTF-8 otherwise."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _check_regular(path: PathLike, mode: int, error: Error) -> None:
    if stat.S_ISREG(mode):
        return
    kind: Optional[str] = next((what for test, what in _KINDS if test(mode)), None)
    link = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    raise error(f"{_name(path)}{link} is not a regular file{f' ({kind})' if kind else ''}")


def _too_large(path: PathLike, limit: int, size: Optional[int] = None) -> str:
    has = f"{format_size(size)}, " if size is not None else ""
    return f"{_name(path)} is {has}larger than the {format_size(limit)} this package reads of such a file"


def format_size(n: int) -> str:
    """``n`` bytes for a message: "12.5 MiB", "3.2 GiB", "800 bytes"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _name(path: PathLike) -> str:
    return Path(path).name or str(path)
