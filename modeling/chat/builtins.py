"""The filters and globals a chat template sees in the sandbox: the filters whose result can
outgrow their arguments check those first (``_CHECKED_FILTERS``), every filter is wrapped
(``_bounded_filter``: the deadline, lazy arguments counted, the result checked), and the globals
(``range``, ``lipsum``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``,
``{% generation %}``) as transformers defines them, bounded."""

import json
from datetime import datetime
from functools import wraps
from collections.abc import Sized
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.filters as jinja_filters
from jinja2 import nodes, pass_environment, pass_eval_context
from jinja2.utils import Namespace, generate_lorem_ipsum

from .budget import (_BUDGET, _check_chars, _check_size, _checked, _count, _lazy_args, _measure, _printf_size,
                     _replaced_size, _small, _Size)


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
        fill = _measure(fill_with)
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

    __call__ = staticmethod(dict)
    fromkeys = staticmethod(dict.fromkeys)


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
