"""The jinja2 sandbox chat templates render in: ``environment()``, transformers' chat template
environment (``modeling.chat.template``) in ``BoundedSandbox``, which holds every rendering to the
``RenderLimits`` it runs under (``with bounded(limits):``, a context variable: each thread keeps its
own budget):

- loop iterations: every ``{% for %}`` iteration, and every item drawn from a lazy sequence
  (``map``, ``select``, ``batch``...), counts toward ``max_loop_iterations``;
- sizes: no string, output or captured block over ``max_chars`` characters, no list, tuple, dict,
  namespace or lazy sequence over ``max_items`` values (nested ones included, a shared one at every
  place) or ``max_chars`` characters of text, no integer over ``MAX_INT_BITS``. A result that can
  outgrow its inputs by more than a small factor (a width, a repeat count, a separator, an indent)
  is sized from the arguments before the call; other results are measured after it;
- time: ``max_seconds``, checked at every loop iteration, call and filter.

``_Bounds`` rewrites the template's tree so that ``{% for %}`` iterables, ``~`` and non-constant
literals go through ``checked_loop``, ``checked_concat`` and ``checked_literal``; the hooks ``call``
and ``call_binop`` (``+ * ** %``) check calls and operators; ``str.format`` runs with a checking
formatter; ``concat`` joins the output and every captured block. A bound passed raises
``LimitExceeded`` with one line naming it. The budget and size checks live in ``budget``, the
checked filters and globals in ``builtins``.
"""

from functools import lru_cache, update_wrapper
from types import BuiltinMethodType, MethodType
from typing import Optional

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, Macro, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from .budget import (_BUDGET, _CHECKED_METHODS, LimitExceeded, _callable_name, _check_bits, _check_call,
                     _check_chars, _check_power, _check_repeat, _checked, _counted, _field_size, _lazy_args,
                     _printf_size, _small)
from .builtins import (_CHECKED_FILTERS, _bounded_filter, _GenerationBlock, _lipsum, _range, _raise_exception,
                       _strftime_now, _TemplateDict, _TemplateNamespace)


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
        return _checked(result, _callable_name(__obj))

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
        return _checked(result, repr(operator))

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
