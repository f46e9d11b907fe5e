"""What a chat reply's text holds besides its content: Qwen3's ``<think>...</think>`` block
(``reasoning_content``) and Qwen's tool calls (``tool_calls``), in one of two forms: Qwen3's JSON,
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or Qwen3.5's and Qwen3-Coder's XML,
``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``. Both
parsers take the text piece by piece as it streams and hold back what could still be the start
of a tag, so a streamed reply and the same reply parsed whole agree. A ``<tool_call>`` that starts a
call inside the think block ends it (the model went on to call without closing it).
"""

import json
import re
from typing import Any, Dict, List, Optional, Tuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL_STARTS = ("{", "<function=")
"""What follows a ``<tool_call>`` that starts a call (after whitespace): JSON's, XML's."""
TOOL_PARSERS = {"hermes": "json", "qwen3_json": "json", "qwen3_xml": "xml", "qwen3_coder": "xml"}
"""``--tool-call-parser`` names (vLLM's for the same forms) and the form each parses."""


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``tag`` (it may complete it)."""
    return max((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), default=0)


class ReasoningSplitter:
    """Text in, (reasoning, content) out. The reply starts inside the think block when the prompt
    opened it (``opened``: templates that end the prompt with ``<think>``), else when it starts
    with ``<think>`` (after whitespace); ``</think>`` ends it. The whitespace around the tags, and
    at the end, is dropped (Qwen writes ``<think>\\n...\\n</think>\\n\\n``). An unclosed block (the
    reply cut by max_tokens) is all reasoning. With ``tool_calls``, a ``<tool_call>`` that a call
    follows (``CALL_STARTS``, after whitespace) ends it too; one the reasoning only mentions is
    reasoning text (vLLM's qwen3 parser looks ahead the same way)."""

    def __init__(self, opened: bool, tool_calls: bool = False):
        self.mode = "reasoning" if opened else "start"
        self.ends = (THINK_CLOSE, TOOL_OPEN) if tool_calls else (THINK_CLOSE,)
        self.buf = ""
        self.lead = True  # drop the whitespace that starts the current part
        self.ws = ""  # whitespace held until more text shows it is not the part's end

    def _emit(self, text: str, final: bool) -> str:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        body = text.rstrip()
        if not body:
            self.ws = "" if final else self.ws + text
            return ""
        out, self.ws = self.ws + body, "" if final else text[len(body):]
        return out

    def push(self, text: str) -> Tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf, self.mode, self.lead = s[len(THINK_OPEN):], "reasoning", True
                    continue
                if not s or THINK_OPEN.startswith(s):
                    return reasoning, content  # it may still become <think>
                self.mode = "content"
            elif self.mode == "reasoning":
                found = [(i, tag) for tag in self.ends if (i := self.buf.find(tag)) >= 0]
                if found:
                    i, tag = min(found)
                    after = self.buf[i + len(tag):].lstrip()
                    if tag == TOOL_OPEN and not after.startswith(CALL_STARTS):
                        if any(start.startswith(after) for start in CALL_STARTS):  # it may still start a call
                            reasoning += self._emit(self.buf[:i], final=False)
                            self.buf = self.buf[i:]
                            return reasoning, content
                        reasoning += self._emit(self.buf[:i + len(tag)], final=False)  # a mention
                        self.buf = self.buf[i + len(tag):]
                        continue
                    reasoning += self._emit(self.buf[:i], final=True)
                    rest = self.buf[i + len(THINK_CLOSE):] if tag == THINK_CLOSE else self.buf[i:]
                    self.buf, self.mode, self.lead = rest, "content", True
                    continue
                cut = len(self.buf) - max(held_back(self.buf, tag) for tag in self.ends)
                reasoning += self._emit(self.buf[:cut], final=False)
                self.buf = self.buf[cut:]
                return reasoning, content
            else:
                content += self._emit(self.buf, final=False)
                self.buf = ""
                return reasoning, content

    def finish(self) -> Tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return self._emit(rest, final=True), ""
        return "", self._emit(rest, final=True)


LEAD = re.compile(r"\s*")
XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?"
                           r"(?:(</parameter>)|(?=<parameter=|</function>)|\Z)", re.S)
"""A parameter: it ends at ``</parameter>``, else where the next tag starts (vLLM's qwen3_coder
rule), else at the end of the text (taken only when ``</tool_call>`` ended the block there)."""
XML_END = re.compile(r"\s*</function>")


def xml_value(key: str, value: str, params: Dict[str, Any]) -> Any:
    """An XML parameter's value: the string as written when its schema (``params``: parameter ->
    schema) says string, else its JSON value when it is JSON, else the string."""
    if (params.get(key) or {}).get("type") != "string":
        try:
            return json.loads(value)
        except ValueError:
            pass
    return value


def parse_tool_call(raw: str) -> Optional[Dict[str, str]]:
    """``{"name", "arguments"}`` (arguments as a JSON string) of one JSON ``<tool_call>`` body, or
    None when it is not a JSON object with a string "name"."""
    try:
        call = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args: Any = call.get("arguments", call.get("parameters", {}))
    return {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


class ToolCallParser:
    """Content text in, (content, call deltas) out, as OpenAI streams ``tool_calls``: a delta is
    ``{"index", "arguments"}`` (the call's number and the next piece of its arguments), the call's
    first one with its ``"name"`` too. ``calls``: every call so far (name, arguments joined).

    ``form`` "json": a ``<tool_call>`` block becomes one delta when it closes, if it parses
    (``parse_tool_call``). ``form`` "xml": a block streams. Its first delta (name, arguments "")
    goes out once ``<function=NAME>`` is read, then one per parameter as it closes (at
    ``</parameter>``, or without it at the next ``<parameter=``, ``</function>`` or ``</tool_call>``; ``"key":
    value``, after the object's "{" or ", "; values by ``xml_value`` with ``types``: function name ->
    parameter -> schema), then "}" at ``</function>`` (``{}`` without parameters), so the
    arguments joined are ``json.dumps`` of the parameters. A ``<tool_call>`` that no call follows
    (``CALL_STARTS``' of the form, after whitespace) is content text, and the next one may open a
    call; a block that does not start a call, or a JSON block that does not parse, stays in the
    content as written, as does an unclosed one at the end; an XML call already started ends at ``</tool_call>`` or at
    the end of the text, its arguments closed, whatever else the block holds."""

    def __init__(self, form: str = "json", types: Optional[Dict[str, Dict[str, Any]]] = None):
        self.buf = ""
        self.inside = False
        self.form, self.types = form, types or {}
        self.calls: List[Dict[str, str]] = []
        self.params: Optional[List[str]] = None  # the XML call streaming: its parameter names so far
        self.closed = False  # its </function> was read

    def _delta(self, fragment: str) -> Dict[str, Any]:
        self.calls[-1]["arguments"] += fragment
        return {"index": len(self.calls) - 1, "arguments": fragment}

    def _stream_xml(self) -> List[Dict[str, Any]]:
        """The deltas of what the buffer holds of the XML block, up to ``</tool_call>`` (which ends a
        parameter left open)."""
        end = self.buf.find(TOOL_CLOSE)
        region = self.buf if end < 0 else self.buf[:end]
        deltas, pos = [], 0
        if self.params is None:
            m = XML_HEAD.match(region)
            if m is None:
                return deltas
            self.params, self.closed, pos = [], False, m.end()
            self.calls.append({"name": m.group(1).strip(), "arguments": ""})
            deltas.append({"index": len(self.calls) - 1, "name": self.calls[-1]["name"], "arguments": ""})
        types = self.types.get(self.calls[-1]["name"], {})
        while not self.closed:
            m = XML_PARAMETER.match(region, pos)
            if m is not None and (m.group(3) or m.end() < len(region) or end >= 0):
                key = m.group(1).strip()
                value = json.dumps(xml_value(key, m.group(2), types), ensure_ascii=False)
                deltas.append(self._delta(("{" if not self.params else ", ") + json.dumps(key) + ": " + value))
                self.params.append(key)
            elif (m := XML_END.match(region, pos)) is not None:
                deltas.append(self._delta("}" if self.params else "{}"))
                self.closed = True
            else:
                break
            pos = m.end()
        self.buf = self.buf[pos:]
        return deltas

    def _end_xml(self) -> List[Dict[str, Any]]:
        """The started XML call's last delta (its arguments closed, if ``</function>`` never came)."""
        deltas = [] if self.closed else [self._delta("}" if self.params else "{}")]
        self.params = None
        return deltas

    def push(self, text: str) -> Tuple[str, List[Dict[str, Any]]]:
        self.buf += text
        content, deltas = "", []
        while True:
            if not self.inside:
                i = self.buf.find(TOOL_OPEN)
                if i < 0:
                    cut = len(self.buf) - held_back(self.buf, TOOL_OPEN)
                    content, self.buf = content + self.buf[:cut], self.buf[cut:]
                    return content, deltas
                content, self.buf, self.inside = content + self.buf[:i], self.buf[i + len(TOOL_OPEN):], True
                continue
            if self.params is None:
                start = CALL_STARTS[self.form == "xml"]
                k = LEAD.match(self.buf).end()
                head = self.buf[k:k + len(start)]
                if not start.startswith(head):  # no call follows: the tag is content text
                    content, self.inside = content + TOOL_OPEN, False
                    continue
            if self.form == "xml":
                deltas += self._stream_xml()
            i = self.buf.find(TOOL_CLOSE)
            if i < 0:
                return content, deltas
            raw, self.buf, self.inside = self.buf[:i], self.buf[i + len(TOOL_CLOSE):], False
            if self.params is not None:
                deltas += self._end_xml()
                continue
            call = parse_tool_call(raw) if self.form == "json" else None
            if call is None:
                content += TOOL_OPEN + raw + TOOL_CLOSE
            else:
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, **call})

    def finish(self) -> Tuple[str, List[Dict[str, Any]]]:
        started = self.inside and self.params is not None  # an XML call: closed, the rest of its block dropped
        rest = "" if started else (TOOL_OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest, self._end_xml() if started else []


class ChatOutput:
    """A chat reply's text split into (reasoning, content, tool-call deltas) as it streams;
    ``reasoning`` and ``tool_calls`` say which parsers run (the plan's), ``form`` and ``types``
    which tool-call form ``tools`` parses (a ``ToolCallParser``: its ``calls`` are the reply's)."""

    def __init__(self, reasoning: bool, tool_calls: bool, prompt_text: str, form: str = "json",
                 types: Optional[Dict[str, Dict[str, Any]]] = None):
        opened = prompt_text.rstrip().endswith(THINK_OPEN)
        self.splitter = ReasoningSplitter(opened, tool_calls) if reasoning else None
        self.tools = ToolCallParser(form, types) if tool_calls else None

    def push(self, text: str, final: bool = False) -> Tuple[str, str, List[Dict[str, Any]]]:
        """The next piece of the reply; ``final``: it ends the reply (what was held back goes out)."""
        reasoning, content = self.splitter.push(text) if self.splitter is not None else ("", text)
        if final and self.splitter is not None:
            r, c = self.splitter.finish()
            reasoning, content = reasoning + r, content + c
        deltas: List[Dict[str, Any]] = []
        if self.tools is not None:
            content, deltas = self.tools.push(content)
            if final:
                tail, more = self.tools.finish()
                content, deltas = content + tail, deltas + more
        return reasoning, content, deltas
