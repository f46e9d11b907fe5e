"""Chat messages as OpenAI's API (and vLLM's ``LLM.chat``) take them, turned into what a chat
template reads.

``template_messages(messages)``: a non-empty list of dicts, each with a ``role`` (one of
``ROLES``; "developer" becomes "system") and a ``content`` that is a string, a list of text parts
(``{"type": "text", "text": ...}``, joined into one string) or null (only for an assistant
message with ``tool_calls``: it becomes ""). An assistant message's ``tool_calls`` whose
``function.arguments`` is a string holding a JSON object get that object instead (OpenAI sends
arguments as a JSON string, templates iterate them as a mapping: vLLM parses them the same way);
other keys (``reasoning_content``, ``name``, ...) pass through. A malformed message raises
``MessageError`` naming it; a content part of another kind (an image) raises it with
``unsupported`` set (text only).
"""
import json
from typing import Any, Dict, List, Mapping, Sequence

ROLES = ("system", "user", "assistant", "tool", "developer")


class MessageError(ValueError):
    """A chat message the chat template cannot take: ``detail`` says why; ``unsupported``: a content
    part (``field``, ``messages[i].content[j]``) of a kind this project does not take."""

    def __init__(self, detail: str, field: str = "messages", unsupported: bool = False):
        super().__init__(f"'{field}' is not supported: {detail}" if unsupported else detail)
        self.detail, self.field, self.unsupported = detail, field, unsupported


def template_messages(messages: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The messages as the chat template takes them (see the module doc)."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise MessageError("'messages' must hold at least one {'role': ..., 'content': ...} dict")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise MessageError(f"'messages[{i}]' must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise MessageError(f"only text parts ({{\"type\": \"text\", \"text\": ...}}), got {kind!r}",
                                       f"messages[{i}].content[{j}]", unsupported=True)
                if not isinstance(part.get("text"), str):  # a text part, malformed
                    raise MessageError(f"'messages[{i}].content[{j}].text' must be a string, got "
                                       f"{type(part.get('text')).__name__}")
            content = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise MessageError(f"'messages[{i}].content' must be a string, a list of text parts or null")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise MessageError(f"'messages[{i}].content' is required (null only for an assistant message with "
                               "tool_calls)")
        out.append({**m, "role": "system" if role == "developer" else role, "content": content or ""})
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            out[-1]["tool_calls"] = [_with_object_arguments(call) for call in m["tool_calls"]]
    return out


def _with_object_arguments(call: Any) -> Any:
    """``call`` (an OpenAI tool call) with ``function.arguments`` parsed when it is a string holding a
    JSON object (a copy; anything else as it is)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    args = fn.get("arguments") if isinstance(fn, Mapping) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": parsed}} if isinstance(parsed, dict) else call
