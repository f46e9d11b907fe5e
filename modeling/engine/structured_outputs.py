"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar, with xgrammar (an optional dependency:
``pip install xgrammar``, part of the ``serve`` extra).

``StructuredOutputs`` is the request's constraint (vLLM's ``StructuredOutputsParams``: exactly one
of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``). ``Grammars`` compiles them for
one tokenizer, each constraint once (an LRU cache keyed by the constraint), and makes a
``GrammarMatcher`` per sequence; its ``fill_next_token_bitmask`` writes the tokens that keep the
output in the grammar (bit ``v % 32`` of int32 word ``v // 32``), the layout of
``torch.ops.qwen.apply_token_bitmask``. A constraint xgrammar cannot take is a ``ValueError``
naming the field and xgrammar's reason. A JSON constraint is compact JSON (", " and ": " between
items, no other whitespace), so an instance's length is bounded when its schema bounds it.
"""
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

CACHE_SIZE = 256
"""Compiled grammars kept per ``Grammars`` (the least recently used goes first)."""

LAX_CHAR, JSON_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
"""The character class xgrammar (0.2) gives a string of bounded length (minLength, maxLength),
which lets control characters through that JSON forbids raw, and JSON's own (as xgrammar's
unbounded strings have it): json schemas are compiled with the one replaced by the other."""

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def xgrammar():
    """The xgrammar module, or an ``ImportError`` naming the package to install."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ImportError("structured outputs need the xgrammar package: pip install xgrammar "
                          "(or the package's serve extra)") from None
    return xgr


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output. ``json``: a JSON schema (a dict, or its JSON text;
    stored as compact JSON text in the schema's own key order, the order an object's properties
    are generated in, as OpenAI and vLLM keep it; equal schemas written alike share a compiled
    grammar); ``json_object``:
    any JSON object; ``regex``: a regular expression the whole output matches; ``choice``: the
    output is one of these strings; ``grammar``: an EBNF grammar (xgrammar's, GBNF-like, rule
    ``root``). ``strict`` (json only): no properties beyond the schema's unless it allows them
    (OpenAI's ``strict``; False follows JSON Schema's default, which allows them)."""

    json: Any = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[Tuple[str, ...]] = None
    grammar: Optional[str] = None
    strict: bool = True

    def __post_init__(self):
        for name in ("json_object", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, Iterable) and not isinstance(choice, str):
                choice = tuple(choice)  # read once: a generator is checked and stored whole
            if not (isinstance(choice, tuple) and choice and all(isinstance(c, str) for c in choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {choice!r}")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def refusal(e: RuntimeError) -> str:
    """The reason of an error xgrammar raised, without its "[time] file.cc:line: " prefix."""
    return str(e).strip().split(": ", 1)[-1] if ".cc:" in str(e) else str(e).strip()


def choice_regex(choice: Sequence[str]) -> str:
    """A regular expression that matches exactly the strings of ``choice``."""
    special = set("\\^$.|?*+()[]{}/")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in s) for s in choice) + ")"


class Grammars:
    """Compiles ``StructuredOutputs`` for one tokenizer (a ``QwenTokenizer``; ``vocab_size``: the
    model's logits width, which may exceed the tokenizer's) and makes matchers; thread-safe, so
    compiles may run off the caller's thread."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = xgrammar()
        tok = tokenizer.tokenizer
        vocab = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())  # byte-level, byte-fallback or raw
        info = xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=meta["add_prefix_space"])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: "OrderedDict[StructuredOutputs, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec`` (cached); a ``ValueError`` naming the field when
        xgrammar refuses it."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs):
        xgr, c, kind = xgrammar(), self._compiler, spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if kind == "json" else '{"type": "object"}'
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=spec.strict)
                return c.compile_grammar(xgr.Grammar.from_ebnf(str(grammar).replace(LAX_CHAR, JSON_CHAR)))
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_regex(choice_regex(spec.choice))
            return c.compile_grammar(spec.grammar)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{kind}: xgrammar cannot take it: {refusal(e)}") from None

    def matcher(self, spec: StructuredOutputs):
        """A fresh ``xgrammar.GrammarMatcher`` of ``spec`` (compiled, or taken from the cache)."""
        return xgrammar().GrammarMatcher(self.compile(spec))
