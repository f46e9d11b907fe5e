"""What a chat reply's text holds besides its content: Qwen3's ``<think>...</think>`` block
(``reasoning_content``) and Qwen's tool calls (``tool_calls``), in one of two forms: Qwen3's JSON,
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or Qwen3.5's and Qwen3-Coder's XML,
``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``. Both
parsers take the text piece by piece as it streams and hold back what could still be the start
of a tag, so a streamed reply and the same reply parsed whole agree. A ``<tool_call>`` inside the
think block ends it (the model went on to call without closing it).
"""

import json
import re
from typing import Any, Dict, List, Optional, Tuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
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
    reply cut by max_tokens) is all reasoning."""

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
        if final:
            out, self.ws = (self.ws + body if body else ""), ""
            return out
        if not body:
            self.ws += text
            return ""
        out, self.ws = self.ws + body, text[len(body):]
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


XML_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_xml_tool_call(raw: str, types: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, str]]:
    """``{"name", "arguments"}`` of one XML ``<tool_call>`` body, or None when it is not one
    ``<function=NAME>`` block. A value is a string when its parameter's schema (``types``: function
    name -> parameter -> schema) says so or gives no type and it is no JSON; otherwise its JSON
    value when it is one."""
    m = XML_CALL.fullmatch(raw)
    if m is None:
        return None
    name, params = m.group(1).strip(), types.get(m.group(1).strip(), {})
    args: Dict[str, Any] = {}
    for key, value in XML_PARAMETER.findall(m.group(2)):
        key = key.strip()
        args[key] = value
        if (params.get(key) or {}).get("type") != "string":
            try:
                args[key] = json.loads(value)
            except ValueError:
                pass
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


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
    """Content text in, (content, tool calls) out: each well-formed ``<tool_call>`` block of
    ``form`` ("json" or "xml"; ``types`` as ``parse_xml_tool_call`` takes them) becomes a call; a
    block that does not parse stays in the content as it was written, as does an unclosed one at
    the end."""

    def __init__(self, form: str = "json", types: Optional[Dict[str, Dict[str, Any]]] = None):
        self.buf = ""
        self.inside = False
        self.parse = parse_tool_call if form == "json" else lambda raw: parse_xml_tool_call(raw, types or {})

    def push(self, text: str) -> Tuple[str, List[Dict[str, str]]]:
        self.buf += text
        content, calls = "", []
        while True:
            if not self.inside:
                i = self.buf.find(TOOL_OPEN)
                if i < 0:
                    cut = len(self.buf) - held_back(self.buf, TOOL_OPEN)
                    content, self.buf = content + self.buf[:cut], self.buf[cut:]
                    return content, calls
                content, self.buf, self.inside = content + self.buf[:i], self.buf[i + len(TOOL_OPEN):], True
            else:
                i = self.buf.find(TOOL_CLOSE)
                if i < 0:
                    return content, calls
                raw, self.buf, self.inside = self.buf[:i], self.buf[i + len(TOOL_CLOSE):], False
                call = self.parse(raw)
                if call is None:
                    content += TOOL_OPEN + raw + TOOL_CLOSE
                else:
                    calls.append(call)

    def finish(self) -> Tuple[str, List[Dict[str, str]]]:
        rest = (TOOL_OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest, []


class ChatOutput:
    """A chat reply's text split into (reasoning, content, tool calls) as it streams; ``reasoning``
    and ``tool_calls`` say which parsers run (the plan's), ``form`` and ``types`` which tool-call
    form is parsed (``ToolCallParser``)."""

    def __init__(self, reasoning: bool, tool_calls: bool, prompt_text: str, form: str = "json",
                 types: Optional[Dict[str, Dict[str, Any]]] = None):
        opened = prompt_text.rstrip().endswith(THINK_OPEN)
        self.splitter = ReasoningSplitter(opened, tool_calls) if reasoning else None
        self.tools = ToolCallParser(form, types) if tool_calls else None
        self.num_calls = 0

    def _route(self, reasoning: str, content: str, final: bool) -> Tuple[str, str, List[Dict[str, str]]]:
        calls: List[Dict[str, str]] = []
        if self.tools is not None:
            content, calls = self.tools.push(content)
            if final:
                tail, _ = self.tools.finish()
                content += tail
        self.num_calls += len(calls)
        return reasoning, content, calls

    def push(self, text: str) -> Tuple[str, str, List[Dict[str, str]]]:
        reasoning, content = self.splitter.push(text) if self.splitter is not None else ("", text)
        return self._route(reasoning, content, final=False)

    def finish(self) -> Tuple[str, str, List[Dict[str, str]]]:
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        return self._route(reasoning, content, final=True)
