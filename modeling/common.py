"""Small helpers every sub-package uses, importing nothing heavy: ``one_line`` (an exception as one
line of an error message), ``is_int`` (an integer that is not a bool) and ``lazy_exports`` (a
package's names imported on first use)."""

import importlib
import numbers
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``, whose names in ``exports``
    (name -> module, relative to ``package``) are imported on first use, then kept as attributes."""
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def is_int(x: Any) -> bool:
    """An integer (Python, NumPy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def one_line(e: Optional[BaseException], typed: bool = True, limit: Optional[int] = None) -> str:
    """``str(e)`` with its whitespace runs made single spaces, after ``Type: `` when ``typed``; the
    type's name alone when the text is empty; cut to ``limit`` characters (ending ``...``) when one
    is given; "unknown error" for None."""
    if e is None:
        return "unknown error"
    text = " ".join(str(e).split())
    if typed and text:
        text = f"{type(e).__name__}: {text}"
    text = text or type(e).__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."
