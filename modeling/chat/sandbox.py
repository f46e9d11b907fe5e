"""The jinja2 sandbox chat templates render in: transformers' environment, with bounds on what one
rendering may cost.

``environment()`` is jinja2's ``ImmutableSandboxedEnvironment`` configured as transformers'
``apply_chat_template`` configures it (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, ``{% generation %}``, the globals ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``, ``tojson`` without HTML escaping), in a subclass, ``BoundedSandbox``, that holds every
rendering to the ``RenderLimits`` (``modeling.chat.template``) it runs under (``with bounded(limits):``, a
context variable, so renderings in other threads keep their own budgets):

- loop iterations: every ``{% for %}`` iteration, and every item a filter, call or loop draws from
  a lazy sequence (``map``, ``select``, ``batch``...), counts toward ``max_loop_iterations``;
- sizes: no string over ``max_chars`` characters, no list, tuple, dict or namespace over
  ``max_items`` values (nested ones included, a shared one counted at every place it appears) or
  ``max_chars`` characters of text, no lazy sequence yielding more than that in all, no output or
  captured block (``{% set %}...{% endset %}``, a macro's text) over ``max_chars``, and no
  integer over ``MAX_INT_BITS``. Where a result can outgrow its inputs by more than a small constant
  factor (a width, a repeat count, a separator between many items, an indent on every line), its
  size is worked out from the arguments before the call; other results are measured after it;
- time: ``max_seconds`` from the start of the rendering, checked at every loop iteration, call and
  filter (between those a template runs no more than its own text).

How: ``_Bounds`` rewrites the template's tree so that ``{% for %}`` iterables, ``~`` and the list,
tuple and dict literals built from variables go through the environment's ``checked_loop``,
``checked_concat`` and ``checked_literal``; the sandbox's hooks ``call`` and ``call_binop``
(``+ * ** %``) check calls and operators (``str.ljust`` / ``rjust`` / ``center`` / ``zfill`` /
``expandtabs`` / ``replace`` / ``join`` / ``translate``, ``int.to_bytes``, macros taking
``varargs``); ``str.format`` runs with a formatter that checks every field; every filter is wrapped,
and ``center``, ``indent``, ``format``, ``replace``, ``join``, ``wordwrap``, ``urlize``, ``tojson``,
``pprint``, ``batch``, ``slice`` and ``sum`` check their arguments first; ``range`` and ``lipsum``
are checking versions; ``concat`` joins the output and every captured block. A bound passed raises
``LimitExceeded`` with one line naming it.

Below, in this order: the budget (``_Budget``; ``bounded(limits)`` sets it for a rendering) and the
size checks (``_measure``; ``_STR_METHODS``, ``_check_repeat``, ``_check_power`` for sizes worked
out before a call); the checked filters (``_CHECKED_FILTERS``, every filter wrapped by
``_bounded_filter``) and the globals; the formatters, the tree rewrite, the environment and its hooks.
"""

import json
import math
import re
import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sized, ValuesView
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, update_wrapper, wraps
from types import BuiltinMethodType, MethodType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, NamedTuple, Optional, Tuple, Union

import jinja2
import jinja2.ext
import jinja2.filters as jinja_filters
from jinja2 import nodes, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, Macro, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Cycler, Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

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
_TEXT = frozenset({str})
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
    kind = type(value)
    if kind is str or kind is bytes or isinstance(value, (str, bytes)):
        return len(value)
    if kind is int or kind is bool or isinstance(value, int):
        return value.bit_length() // 3 + 1
    if kind is float or isinstance(value, float):
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
        if kinds <= _TEXT:
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


Described = Union[str, Callable[[], str]]
"""What an error names: a string, or a function giving it (to build it only for the error)."""


def _described(what: Described) -> str:
    return what if isinstance(what, str) else what()


def _check_chars(amount: int, what: Described) -> None:
    limit = _BUDGET.get().limits.max_chars
    if amount > limit:
        raise LimitExceeded(f"{_described(what)} would make {amount} characters, "
                            f"past RenderLimits.max_chars ({limit})")


def _check_size(size: _Size, what: Described) -> None:
    """``size`` (measured, so perhaps partial once past a limit) within max_items and max_chars."""
    limits = _BUDGET.get().limits
    if size.values > limits.max_items:
        raise LimitExceeded(f"{_described(what)} would hold more than RenderLimits.max_items "
                            f"({limits.max_items}) values")
    if size.chars > limits.max_chars:
        raise LimitExceeded(f"{_described(what)} would hold more than RenderLimits.max_chars "
                            f"({limits.max_chars}) characters of text")


def _small(value: Any, budget: _Budget) -> bool:
    """Whether ``value`` is a number, None or a string within max_chars (checked at once)."""
    kind = type(value)
    return kind in _SCALARS or (kind is str and len(value) <= budget.limits.max_chars)


def _checked(value: Any, what: Described) -> Any:
    """``value`` (what a call, filter or operator returned) once it is known to be within the limits."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is str or isinstance(value, (str, bytes)):
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
            leaf = _leaf_chars(item)
            size = _Size(0, leaf) if leaf is not None else _measure(item)
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


# ----------------------------------------------------------------------------------------------
# filters (those whose result can outgrow their arguments check those first) and globals


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson (``json.dumps``, no HTML escaping); its size is worked out first, an
    indent repeated on every line once per nesting level."""
    size = _measure(x)
    width = len(indent) if isinstance(indent, str) else _count(indent)
    seps = separators if isinstance(separators, tuple) and all(isinstance(s, str) for s in separators) else ()
    per_value = 4 + sum(map(len, seps)) + (1 + width * size.depth if indent is not None else 0)
    _check_chars(size.chars + size.values * per_value, "tojson")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _pprint(value):
    size = _measure(value)
    _check_chars(size.chars + size.values * (4 + size.depth), "pprint")
    return jinja_filters.do_pprint(value)


def _center(value, width=80):
    if isinstance(width, int):
        _check_chars(width, "center")
    return jinja_filters.do_center(value, width)


def _indent(s, width=4, first=False, blank=False):
    if isinstance(s, str):
        per_line = len(width) if isinstance(width, str) else _count(width)
        _check_chars(len(s) + (len(s.splitlines()) + 1) * per_line, "indent")
    return jinja_filters.do_indent(s, width, first, blank)


def _format(value, *args, **kwargs):
    _check_chars(_printf_size(str(value), kwargs or args), "format")
    return jinja_filters.do_format(value, *args, **kwargs)


@pass_eval_context
def _replace(eval_ctx, s, old, new, count=None):
    _check_chars(_replaced_size(str(s), str(old), str(new), -1 if count is None else count), "replace")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    items = value if isinstance(value, Sized) else list(value)
    _check_chars(max(len(items) - 1, 0) * len(str(d)), "join")
    return jinja_filters.do_join(eval_ctx, items, d, attribute)


@pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    """Also counts the copying textwrap does to split a word longer than the width (the rest of the
    word again for every line it fills)."""
    if isinstance(width, int) and width > 0:
        text = str(s)
        sep = environment.newline_sequence if wrapstring is None else str(wrapstring)
        copies = sum(len(w) ** 2 for w in text.split() if len(w) > width) // (2 * width) if break_long_words else 0
        _check_chars(len(text) * (1 + len(sep)) + copies, "wordwrap")
    return jinja_filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def _urlize(eval_ctx, value, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None):
    text = str(value)
    per_link = 60 + 6 * (len(str(target or "")) + len(str(rel or "")))
    _check_chars(3 * len(text) + len(text.split()) * per_link, "urlize")
    return jinja_filters.do_urlize(eval_ctx, value, trim_url_limit, nofollow, target, rel, extra_schemes)


def _batch(value, linecount, fill_with=None):
    if fill_with is not None and isinstance(linecount, int):
        fill, n = _measure(fill_with), max(linecount, 0)
        _check_size(_Size((fill.values + 1) * n, fill.chars * n), "batch")
    return jinja_filters.do_batch(value, linecount, fill_with)


@pass_eval_context
def _slice(eval_ctx, value, slices, fill_with=None):
    if isinstance(slices, int):
        fill = _measure(fill_with) if fill_with is not None else _Size(0, 0)
        _check_size(_Size((fill.values + 2) * slices, fill.chars * slices), "slice")
    return jinja_filters.do_slice(eval_ctx, value, slices, fill_with)


@pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """Summing lists copies the running total at each step: that copying is counted in values."""
    if attribute is not None:
        iterable = map(jinja_filters.make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    if isinstance(start, (list, tuple)):
        total = len(start) + sum(len(v) for v in items if isinstance(v, (list, tuple)))
        _check_size(_Size(len(items) * total, 0), "sum")
    return jinja_filters.do_sum(environment, items, start=start)


def _range(*args):
    """``range``, refused past max_items values."""
    r = range(*args)
    n = max(0, (r.stop - r.start + r.step - (1 if r.step > 0 else -1)) // r.step)
    _check_size(_Size(n, 0), "range")
    return r


def _lipsum(n=5, html=True, min=20, max=100):
    """``lipsum``, refused when its paragraphs could pass max_chars."""
    if isinstance(n, int) and isinstance(max, int):
        _check_chars(_count(n) * (_count(max) * 16 + 8), "lipsum")
    return generate_lorem_ipsum(n, html, min, max)


_CHECKED_FILTERS = {
    "tojson": _tojson, "pprint": _pprint, "center": _center, "indent": _indent, "format": _format,
    "replace": _replace, "join": _join, "wordwrap": _wordwrap, "urlize": _urlize, "batch": _batch,
    "slice": _slice, "sum": _sum,
}


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter ``f`` with the deadline checked, lazy sequences among its arguments counted, and its
    result checked (it keeps ``f``'s pass_context / pass_eval_context / pass_environment mark)."""

    what = f"the filter {name!r}"

    @wraps(f)
    def bounded_filter(*args, **kwargs):
        budget, args, kwargs = _lazy_args(args, kwargs)
        result = f(*args, **kwargs)
        return result if _small(result, budget) else _checked(result, what)

    return bounded_filter


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training masks in
    transformers; rendering keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without attribute access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names, and is written out only
    within the limits (its attributes are set one by one, so their sizes add up unchecked)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    def __repr__(self):
        if _BUDGET.get(None) is not None:
            _check_size(_measure(self), "a namespace")
        return Namespace.__repr__(self)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


# ----------------------------------------------------------------------------------------------
# str.format


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in templates: each field's width and precision are checked before the field
    is formatted, and the text made so far after."""

    def vformat(self, format_string, args, kwargs):
        self._made = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value, format_spec):
        _check_chars(self._made + _field_size(value, format_spec), "str.format")
        text = super().format_field(value, format_spec)
        self._made += len(text)
        _check_chars(self._made, "str.format")
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    """``Markup.format``: the bounded formatter that escapes its fields."""


# ----------------------------------------------------------------------------------------------
# the environment


def _check_node(method: str, args, lineno: Optional[int]) -> nodes.Call:
    """A call of the environment's ``method`` on ``args``, in the template's tree."""
    return nodes.Call(nodes.EnvironmentAttribute(method), list(args), [], None, None, lineno=lineno)


def _is_const(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const) or (isinstance(node, (nodes.List, nodes.Tuple, nodes.Dict, nodes.Pair))
                                             and all(_is_const(c) for c in node.iter_child_nodes()))


class _Bounds(NodeTransformer):
    """Sends what the sandbox's hooks do not see through the environment's checks: ``{% for %}``
    iterables and ``*args`` (``checked_loop``), ``~`` (``checked_concat``), and list, tuple and
    dict literals that are not constants (``checked_literal``)."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _check_node("checked_loop", [node.iter], node.lineno)
        return node

    def visit_Call(self, node: nodes.Expr) -> nodes.Expr:
        node = self.generic_visit(node)
        if node.dyn_args is not None:  # f(*args) unpacks before the call hook runs
            node.dyn_args = _check_node("checked_loop", [node.dyn_args], node.lineno)
        return node

    visit_Filter = visit_Test = visit_Call

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return _check_node("checked_concat", [nodes.ContextReference(), *node.nodes], node.lineno)

    def visit_List(self, node: nodes.Expr) -> nodes.Expr:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load" or _is_const(node):
            return node
        return _check_node("checked_literal", [node], node.lineno)

    visit_Tuple = visit_Dict = visit_List


class _Buffer(list):
    """The text a block captures (``{% set %}``, a macro, ``{% filter %}``, a recursive loop),
    each piece checked as it is added: a loop may add many."""

    def __init__(self):
        super().__init__()
        self.size, self.limit = 0, _BUDGET.get().limits.max_chars

    def append(self, piece):
        self._grow(len(piece))
        super().append(piece)

    def extend(self, pieces):
        pieces = tuple(pieces)
        self._grow(sum(map(len, pieces)))
        super().extend(pieces)

    def _grow(self, n):
        self.size += n
        if self.size > self.limit:
            raise LimitExceeded(f"a captured block's text would be longer than RenderLimits.max_chars "
                                f"({self.limit}) characters")


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with the blocks' buffers made by ``environment.new_buffer()``."""

    def buffer(self, frame):
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template sandbox, holding every rendering to its ``RenderLimits``."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        """jinja2's compile, on the tree ``_Bounds`` has rewritten."""
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        source = _Bounds().visit(source)
        source.set_environment(self)
        return super().compile(source, name, filename, raw, defer_init)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        """A call in a template: the deadline, the arguments and the result checked."""
        if getattr(__obj, "__self__", None) is __self:  # one of the checks _Bounds inserted
            return __obj(*args)
        budget, args, kwargs = _lazy_args(args, kwargs)
        if args and (getattr(__obj, "__name__", None) in _CHECKED_METHODS or isinstance(__obj, (Macro, LoopContext))):
            args = _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if _small(result, budget):
            return result
        return _checked(result, lambda: _callable_name(__obj))

    def call_binop(self, context, operator, left, right):
        """``+``, ``*``, ``**`` and ``%``: the size of the result checked before (``*``, ``**``,
        ``%``) or after (``+``, which at most doubles). No deadline here: without a loop iteration
        or a call, which check it, a template runs no more operators than its text holds."""
        if operator == "*":
            _check_repeat(left, right)
        elif operator == "**":
            _check_power(left, right)
        elif operator == "%" and isinstance(left, (str, bytes)):
            _check_chars(_printf_size(left, right), "'%'")
        result = self.binop_table[operator](left, right)
        kind = type(result)
        if kind is str and len(result) <= _BUDGET.get().limits.max_chars:
            return result
        if kind is int:  # '+' adds a bit at a time
            _check_bits(result.bit_length(), repr(operator))
        return _checked(result, lambda: repr(operator))

    def new_buffer(self) -> _Buffer:
        return _Buffer()

    def concat(self, pieces):
        """The output, or a captured block's text: joined once its length is known to be within
        max_chars."""
        if type(pieces) is _Buffer:  # checked as it grew
            return "".join(pieces)
        limit = _BUDGET.get().limits.max_chars
        parts, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > limit:
                raise LimitExceeded(f"the rendered text would be longer than RenderLimits.max_chars ({limit}) "
                                    "characters")
            parts.append(piece)
        return "".join(parts)

    def wrap_str_format(self, value):
        """jinja2's sandboxed ``str.format`` / ``format_map``, with ``_BoundedFormatter``."""
        if not (isinstance(value, (MethodType, BuiltinMethodType)) and value.__name__ in ("format", "format_map")
                and isinstance(value.__self__, str)):
            return None
        text = value.__self__
        formatter = (_BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup)
                     else _BoundedFormatter(self))
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args, **kwargs):
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return update_wrapper(wrapper, value)

    def checked_loop(self, iterable):
        """A ``{% for %}`` iterable, ``_counted``."""
        return _counted(iterable)

    def checked_literal(self, value):
        """A list, tuple or dict literal, once its size is within the limits."""
        return _checked(value, f"a {type(value).__name__} literal")

    def checked_concat(self, context, *values):
        """``a ~ b ~ ...``: jinja2's ``str_join`` (``markup_join`` where autoescaping is on), joined
        once its length is within max_chars (escaping adds at most a small factor)."""
        texts = [str(v) for v in values]
        _check_chars(sum(map(len, texts)), "'~'")
        return markup_join(values) if context.eval_ctx.autoescape else "".join(texts)


@lru_cache(maxsize=None)
def environment() -> BoundedSandbox:
    """The environment chat templates compile in (one, built on first use, shared by all threads)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters.update(_CHECKED_FILTERS)
    env.filters.update({name: _bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals.update(range=_range, lipsum=_lipsum, raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env
