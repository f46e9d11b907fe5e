"""Small helpers every sub-package uses, importing nothing heavy: ``one_line`` (an exception as one
line of an error message) and ``is_int`` (an integer that is not a bool)."""

import numbers
from typing import Any, Optional


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
    if typed:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    else:
        text = text or type(e).__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."
