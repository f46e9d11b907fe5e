"""Forced tool calls: ``tool_choice`` "required" (one call of any of the tools) or a named
function (a call of that one), as an xgrammar EBNF grammar over the whole reply in the tool-call
form of the template:

- "json" (Qwen3, vLLM's ``hermes``): ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``,
  ARGS an instance of the function's ``parameters`` schema (compact JSON, as structured outputs
  write it);
- "xml" (Qwen3.5, Qwen3-Coder; vLLM's ``qwen3_xml``): ``<tool_call>\\n<function=NAME>\\n``, then
  ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` for each required parameter in order, then
  ``</function>\\n</tool_call>``; a VALUE is text without ``<`` (an integer, number or boolean
  parameter: its JSON literal; a string with ``maxLength``: at most that many characters).
"""
import json
import re
from typing import Any, Dict, List


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def _rename(ebnf: str, prefix: str) -> str:
    """Every rule of ``ebnf`` renamed ``prefix + name`` (string literals and character classes kept)."""
    names = set(re.findall(r"^(\w+) ::=", ebnf, re.M))
    pieces = re.split(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])', ebnf)
    return "".join(p if i % 2 else re.sub(r"\b\w+\b", lambda m: prefix + m.group(0) if m.group(0) in names else
                                          m.group(0), p) for i, p in enumerate(pieces))


def _json_call(tools: List[Dict[str, Any]]) -> str:
    from ..engine.structured_outputs import JSON_CHAR, LAX_CHAR, refusal, xgrammar

    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        body = str(xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except RuntimeError as e:
        raise ValueError(f"xgrammar cannot take the functions' parameters: {refusal(e)}") from None
    return ('root ::= "<tool_call>\\n" call_root "\\n</tool_call>"\n'
            + _rename(body.replace(LAX_CHAR, JSON_CHAR), "call_"))


def _xml_value(schema: Dict[str, Any]) -> str:
    kind = schema.get("type")
    bounds = [abs(b) for b in (schema.get("minimum"), schema.get("maximum")) if isinstance(b, int)]
    digits = f"[0-9]{{1,{len(str(max(bounds)))}}}" if len(bounds) == 2 else "[0-9]+"
    if kind == "integer":
        return f'"-"? {digits}'
    if kind == "number":
        return f'"-"? {digits} ("." [0-9]+)?'
    if kind == "boolean":
        return '"true" | "false"'
    if kind == "string" and isinstance(schema.get("maxLength"), int):
        return f"[^<]{{0,{schema['maxLength']}}}"
    return "[^<]*"


def _xml_call(tools: List[Dict[str, Any]]) -> str:
    rules, alternatives = [], []
    for i, t in enumerate(tools):
        params = t.get("parameters") or {}
        props = params.get("properties") or {}
        parts = [_literal(f"<tool_call>\n<function={t['name']}>\n")]
        for j, key in enumerate(k for k in props if k in (params.get("required") or ())):
            rules.append(f"v{i}_{j} ::= {_xml_value(props[key])}")
            parts += [_literal(f"<parameter={key}>\n"), f"v{i}_{j}", _literal("\n</parameter>\n")]
        parts.append(_literal("</function>\n</tool_call>"))
        alternatives.append("(" + " ".join(parts) + ")")
    return "\n".join([f"root ::= {' | '.join(alternatives)}", *rules])


def forced_call_grammar(tools: List[Dict[str, Any]], form: str) -> str:
    """The EBNF grammar of a reply that is one call of one of ``tools`` (OpenAI's
    ``{"type": "function", "function": {"name", "parameters"}}``), in ``form``; a ``ValueError``
    saying why when xgrammar cannot convert their ``parameters`` schemas ("json"), an
    ``ImportError`` naming the package without xgrammar."""
    functions = [t["function"] for t in tools]
    return _json_call(functions) if form == "json" else _xml_call(functions)
