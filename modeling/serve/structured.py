"""The request fields that constrain an output, turned into the engine's ``StructuredOutputs``:
OpenAI's ``response_format`` (``json_object``; ``json_schema`` with its ``schema`` and
``strict``), vLLM's ``structured_outputs`` ({json, regex, choice, grammar, json_object}) and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one
of them per request (a 400 naming the fields otherwise).

``GrammarCheck`` compiles a request's constraint before it reaches the engine, in a worker
thread (never on the event loop) under a time limit, with the compiled grammars cached by
constraint: a constraint xgrammar cannot take, or one that takes longer than the limit, is a
400 naming the field; a server without xgrammar answers a constrained request with a 400 that
names the package.
"""
import asyncio
import contextlib
from typing import Any, Dict, Optional, Tuple

from ..engine.structured_outputs import Grammars, StructuredOutputs
from .errors import invalid

COMPILE_TIMEOUT_S = 10.0
"""The longest a constraint may take to compile before its request is refused."""
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older request fields and the ``structured_outputs`` key each stands for."""
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_of(req) -> Tuple[Optional[StructuredOutputs], Optional[str]]:
    """The request's constraint and the field it came from ((None, None): free text); a 400
    naming the field for a malformed one, or for two given together."""
    given = {}
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt != {"type": "text"}:
        given["response_format"] = _response_format(fmt)
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise invalid(f"'structured_outputs' takes {', '.join(STRUCTURED_KEYS)}; unknown: {', '.join(unknown)}",
                          "structured_outputs")
        given["structured_outputs"] = dict(req.structured_outputs)
    for name, key in GUIDED.items():
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    if not given:
        return None, None
    if len(given) > 1:
        raise invalid(f"one output constraint per request, got {', '.join(given)}", next(iter(given)))
    (field, fields), = given.items()
    try:
        return StructuredOutputs(**fields), field
    except (TypeError, ValueError) as e:
        raise invalid(f"'{field}': {e}", field) from None


def _response_format(fmt: Dict[str, Any]) -> Dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
                          "\"schema\": {...}}", "response_format")
        return {"json": spec["schema"], "strict": spec.get("strict") is not False}
    raise invalid(f"'response_format' type must be text, json_object or json_schema, got {kind!r}",
                  "response_format")


class GrammarCheck:
    """Compiles constraints for one tokenizer off the event loop (see the module doc); its
    ``Grammars`` (xgrammar's table of the vocabulary: seconds for Qwen's) are made in a worker
    thread by ``prepare``, as the server starts, or else at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, timeout: float = COMPILE_TIMEOUT_S):
        self.tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout
        self._grammars: Optional[Grammars] = None

    async def prepare(self) -> None:
        """Make the ``Grammars`` in a worker thread; nothing without xgrammar (``check`` then answers
        a constrained request with a 400 naming the package)."""
        if self._grammars is None:
            with contextlib.suppress(ImportError):
                self._grammars = await asyncio.to_thread(Grammars, self.tokenizer, self.vocab_size)

    async def check(self, spec: Optional[StructuredOutputs], field: str) -> None:
        if spec is None:
            return
        try:
            if self._grammars is None:
                self._grammars = await asyncio.to_thread(Grammars, self.tokenizer, self.vocab_size)
            await asyncio.wait_for(asyncio.to_thread(self._grammars.compile, spec), self.timeout)
        except (ImportError, ValueError) as e:
            raise invalid(str(e), field) from None
        except asyncio.TimeoutError:
            raise invalid(f"the {spec.kind} constraint took longer than {self.timeout:g} s to compile",
                          field) from None
