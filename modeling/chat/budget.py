"""What one rendering of a chat template may cost, and the checks that hold it there: the budget
(``_Budget``: loop iterations, the deadline; ``bounded(limits)`` sets it for a rendering),
``LimitExceeded``, the sizes of values (``_measure``) and the sizes str methods and operators would
make before they run (``_STR_METHODS``, ``_check_repeat``, ``_check_power``). The sandbox
(``modeling.chat.sandbox``) and its filters (``modeling.chat.builtins``) call these."""

import math
import re
import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sized, ValuesView
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, NamedTuple, Optional, Tuple

from jinja2.runtime import LoopContext, Macro
from jinja2.utils import Cycler, Namespace

if TYPE_CHECKING:
    from .template import RenderLimits


MAX_INT_BITS = 1 << 16
"""The largest integer ``*`` and ``**`` may make, in bits (Python prints at most 4300 digits)."""


class LimitExceeded(Exception):
    """A rendering passed one of its ``RenderLimits`` (or ``MAX_INT_BITS``). Not a ``ValueError``,
    so that no ``except ValueError`` in jinja2 or in a builtin can swallow it."""


# ----------------------------------------------------------------------------------------------
# the budget of the rendering in progress


class _Budget:
    """One rendering's limits, its deadline and its loop iterations so far."""

    def __init__(self, limits: "RenderLimits"):
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.iterations = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(f"the rendering ran longer than RenderLimits.max_seconds ({self.limits.max_seconds} s)")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_loop_iterations:
            raise LimitExceeded(f"the loops would run more than RenderLimits.max_loop_iterations "
                                f"({self.limits.max_loop_iterations}) iterations")
        self.tick()


_BUDGET: ContextVar[_Budget] = ContextVar("chat_template_budget")


@contextmanager
def bounded(limits: "RenderLimits"):
    """Compile or render templates of ``environment()`` within ``limits`` (in this thread or task)."""
    token = _BUDGET.set(_Budget(limits))
    try:
        yield
    finally:
        _BUDGET.reset(token)


# ----------------------------------------------------------------------------------------------
# sizes


_SCALARS = frozenset({bool, int, float, type(None)})
_PLAIN = _SCALARS | {str, list, tuple, dict}
_ITERATORS_OF_HELD_VALUES = frozenset(type(it) for it in (
    iter([]), reversed([]), iter(()), reversed(()), iter(""), iter("\xe9"), iter(range(0)), reversed(range(0)),
    iter({}), reversed({}), iter({}.values()), reversed({}.values())))
"""Iterators over values a container already holds: nothing made, nothing to add up."""


class _Size(NamedTuple):
    """How big a value is once written out: ``values`` in its containers (nested ones included, a
    shared one at every place), ``chars`` of its strings and numbers, and its nesting ``depth``."""

    values: int
    chars: int
    depth: int = 0


def _children(value: Any) -> Optional[Iterable[Any]]:
    """The values a container holds (a dict's keys and values, a namespace's attributes, a
    cycler's items); None for anything that is not a container."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, Namespace):
        return _children(object.__getattribute__(value, "_Namespace__attrs"))  # jinja2 lets this name through
    if isinstance(value, Mapping):
        return (x for item in value.items() for x in item)
    if isinstance(value, (KeysView, ValuesView, ItemsView)):
        return _children(getattr(value, "mapping", {}))
    if isinstance(value, Cycler):
        return value.items
    return None


def _leaf_chars(value: Any) -> Optional[int]:
    """The characters a string, bytes or number takes written out (an int's digits, a float's
    repr at most), 0 for None; None for anything else."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, float):
        return 24
    return 0 if value is None else None


def _measure(value: Any) -> _Size:
    """``_Size`` of ``value``. A container met again is not walked again (its size is remembered),
    one met inside itself counts once, and counting stops once a container passes the limits
    (its counts are then partial, and over them)."""
    leaf = _leaf_chars(value)
    if leaf is not None:
        return _Size(0, leaf)
    if type(value) in (list, tuple):  # a flat list of strings or of integers, at C speed
        kinds = set(map(type, value))
        if kinds <= {str}:
            return _Size(len(value), sum(map(len, value)), 1 if value else 0)
        if kinds == {int}:
            return _Size(len(value), sum(map(int.bit_length, value)) // 3 + len(value), 1)
    limits = _BUDGET.get().limits
    max_values, max_chars = limits.max_items, limits.max_chars
    sizes: Dict[int, Tuple[int, int, int]] = {}
    inside = set()

    def walk(v: Any) -> Tuple[int, int, int]:
        children = _children(v)
        if children is None or id(v) in inside:
            return 0, 0, 0
        inside.add(id(v))
        values = chars = depth = 0
        for child in children:
            leaf = _leaf_chars(child)
            if leaf is not None:
                values, chars, depth = values + 1, chars + leaf, depth or 1
            else:
                child_values, child_chars, child_depth = sizes.get(id(child)) or walk(child)
                values, chars, depth = values + child_values + 1, chars + child_chars, max(depth, child_depth + 1)
            if values > max_values or chars > max_chars:
                break
        inside.discard(id(v))
        sizes[id(v)] = values, chars, depth
        return sizes[id(v)]

    return _Size(*walk(value))


def _text_size(value: Any) -> int:
    """About how long ``str(value)`` is: exact for a string, within a small factor otherwise (an
    object's repr, ``<... object at 0x...>``, taken as 100 characters)."""
    if isinstance(value, str):
        return len(value)
    size = _measure(value)
    return size.chars + 4 * size.values + 100


def _check_chars(amount: int, what: str) -> None:
    limit = _BUDGET.get().limits.max_chars
    if amount > limit:
        raise LimitExceeded(f"{what} would make {amount} characters, past RenderLimits.max_chars ({limit})")


def _check_size(size: _Size, what: str) -> None:
    """``size`` (measured, so perhaps partial once past a limit) within max_items and max_chars."""
    limits = _BUDGET.get().limits
    if size.values > limits.max_items:
        raise LimitExceeded(f"{what} would hold more than RenderLimits.max_items ({limits.max_items}) values")
    if size.chars > limits.max_chars:
        raise LimitExceeded(f"{what} would hold more than RenderLimits.max_chars ({limits.max_chars}) characters "
                            "of text")


def _small(value: Any, budget: _Budget) -> bool:
    """Whether ``value`` is a number, None or a string within max_chars (checked at once)."""
    kind = type(value)
    return kind in _SCALARS or (kind is str and len(value) <= budget.limits.max_chars)


def _checked(value: Any, what: str) -> Any:
    """``value`` (what a call, filter or operator returned) once it is known to be within the limits."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, (str, bytes)):
        _check_chars(len(value), what)
    elif _children(value) is not None:
        _check_size(_measure(value), what)
    return value


def _check_bits(bits: float, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise LimitExceeded(f"{what} would make an integer of {int(bits)} bits, past MAX_INT_BITS ({MAX_INT_BITS})")


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``'s items, each counted toward max_loop_iterations; a lazy sequence's items are
    also added up (values and characters), as whatever consumes it may collect them all."""
    budget = _BUDGET.get()
    lazy = _is_lazy(iterable)
    max_values, max_chars = budget.limits.max_items, budget.limits.max_chars
    values = chars = 0
    for item in iterable:
        budget.iterate()
        if lazy:
            size = _measure(item)
            values, chars = values + size.values + 1, chars + size.chars
            if values > max_values or chars > max_chars:
                _check_size(_Size(values, chars), "a lazy sequence (map, select, batch, ...)")
        yield item


def _is_lazy(x: Any) -> bool:
    """Whether ``x`` is a lazy sequence making its items as it goes (map, select, a generator...)."""
    return type(x) not in _PLAIN and type(x) not in _ITERATORS_OF_HELD_VALUES and isinstance(x, Iterator)


def _lazy_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[_Budget, Tuple[Any, ...], Dict[str, Any]]:
    """Before a call or filter: the deadline checked; the rendering's budget, and the arguments,
    lazy sequences among them ``_counted`` as they are consumed."""
    budget = _BUDGET.get()
    budget.tick()
    if (kwargs or not set(map(type, args)) <= _PLAIN) and any(map(_is_lazy, args)):
        args = tuple(_counted(a) if _is_lazy(a) else a for a in args)
    if kwargs and any(map(_is_lazy, kwargs.values())):
        kwargs = {k: _counted(v) if _is_lazy(v) else v for k, v in kwargs.items()}
    return budget, args, kwargs


def _count(x: Any) -> int:
    """A width or count argument as an int (0 when it is not a finite number, whose call then fails)."""
    if isinstance(x, int):
        return max(x, 0)
    if isinstance(x, float) and math.isfinite(x):
        return max(int(x), 0)
    return 0


# ----------------------------------------------------------------------------------------------
# sizes worked out before a call


def _replaced_size(s: Any, old: Any, new: Any, count: Any) -> int:
    """The length of ``s.replace(old, new, count)``."""
    if not (isinstance(old, type(s)) and isinstance(new, type(s)) and isinstance(count, int)):
        return len(s)
    n = s.count(old) if old else len(s) + 1
    if count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[a-zA-Z%]?", re.S)
_PRINTF_SPEC = re.compile(r"[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)", re.S)
_NUMBER_CHARS = 330
"""Characters a number may take beyond its width and precision (the digits of the largest float)."""


def _field_size(value: Any, spec: str) -> int:
    """At most how long ``format(value, spec)`` is."""
    m = _FORMAT_SPEC.fullmatch(spec)
    width, precision = (int(m[1] or 0), int(m[2] or 0)) if m else (len(spec), 0)
    return width + precision + _text_size(value) + _NUMBER_CHARS


def _printf_key(text: str, at: int) -> Tuple[Optional[str], int]:
    """The ``(key)`` of the printf conversion at ``text[at:]``, and where its flags start."""
    if text[at:at + 1] != "(":
        return None, at
    depth, end = 1, at + 1
    while end < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return text[at + 1:end - 1], end


def _printf_size(fmt: Any, args: Any) -> int:
    """At most how long ``fmt % args`` is: the format, and each conversion's width, precision and
    value (``*`` widths taken from the arguments, as Python does)."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else str(fmt)
    values = iter(args if isinstance(args, tuple) else (args,))
    size, at = len(text), text.find("%")
    while at >= 0:
        key, at = _printf_key(text, at + 1)
        spec = _PRINTF_SPEC.match(text, at)
        width, precision, conversion = spec.groups()
        size += sum(_count(next(values, 0)) if n == "*" else int(n or 0) for n in (width, precision or ""))
        if conversion != "%":
            value = args.get(key) if key is not None and isinstance(args, Mapping) else next(values, None)
            size += _text_size(value) + _NUMBER_CHARS
        at = text.find("%", spec.end())
    return size


# ----------------------------------------------------------------------------------------------
# calls: methods of strings and integers, macros


def _padding(s, name, args, kwargs):
    width = args[0] if args else None
    if isinstance(width, int):
        _check_chars(width, f"str.{name}")


def _expandtabs(s, name, args, kwargs):
    tabsize = args[0] if args else kwargs.get("tabsize", 8)
    if isinstance(tabsize, int):
        _check_chars(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 0), "str.expandtabs")


def _replace_method(s, name, args, kwargs):
    if len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        _check_chars(_replaced_size(s, args[0], args[1], count), "str.replace")


def _join_method(s, name, args, kwargs):
    if len(args) != 1:
        return None
    parts = args[0] if isinstance(args[0], Sized) else list(args[0])
    texts = sum(len(p) for p in parts if isinstance(p, (str, bytes)))
    _check_chars(texts + max(len(parts) - 1, 0) * len(s), "str.join")
    return (parts,)


def _translate(s, name, args, kwargs):
    table = args[0] if args else None
    mapped = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else ()
    longest = max((len(v) for v in mapped if isinstance(v, str)), default=1)
    _check_chars(len(s) * max(longest, 1), "str.translate")


_STR_METHODS: Dict[str, Callable[..., Optional[Tuple[Any, ...]]]] = {
    "ljust": _padding, "rjust": _padding, "center": _padding, "zfill": _padding,
    "expandtabs": _expandtabs, "replace": _replace_method, "join": _join_method, "translate": _translate,
}
"""str and bytes methods whose result can outgrow the string: each checks the size it would make
(and may return the arguments to call with: ``join`` collects a lazy sequence first)."""


_CHECKED_METHODS = frozenset(_STR_METHODS) | {"to_bytes"}


def _check_call(obj: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """The arguments to call ``obj`` with (a method in ``_CHECKED_METHODS``, a macro, a recursive
    loop), once the size of what it would make is within the limits."""
    name, owner = getattr(obj, "__name__", None), getattr(obj, "__self__", None)
    if name in _STR_METHODS and isinstance(owner, (str, bytes)):
        return _STR_METHODS[name](owner, name, args, kwargs) or args
    if name == "to_bytes" and isinstance(owner, int):
        _check_chars(_count(args[0] if args else kwargs.get("length", 1)), "int.to_bytes")
    elif isinstance(obj, LoopContext):  # loop(...) in a recursive loop: another loop
        return (_counted(args[0]),) + args[1:]
    elif isinstance(obj, Macro) and (obj.catch_varargs or obj.catch_kwargs):  # it keeps them in varargs / kwargs
        _check_size(_measure([args, kwargs]), f"the arguments of macro {obj.name!r}")
    return args


def _callable_name(obj: Any) -> str:
    name = getattr(obj, "__name__", None) or type(obj).__name__
    owner = getattr(obj, "__self__", None)
    return f"{type(owner).__name__}.{name}" if owner is not None and not isinstance(owner, type) else name


# ----------------------------------------------------------------------------------------------
# operators


def _check_repeat(left: Any, right: Any) -> None:
    """``left * right``: a sequence repeated, or two integers multiplied."""
    if isinstance(left, int) and not isinstance(right, (int, float)):
        left, right = right, left
    if not isinstance(right, int):
        return
    if isinstance(left, int):
        _check_bits(left.bit_length() + right.bit_length(), "'*'")
    elif isinstance(left, (str, bytes)):
        _check_chars(len(left) * max(right, 0), "'*'")
    elif isinstance(left, (list, tuple)):
        size, n = _measure(left), max(right, 0)
        _check_size(_Size(size.values * n, size.chars * n), "'*'")


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        _check_bits(math.log2(abs(base)) * exponent, "'**'")
