"""The JSON shapes of OpenAI's responses: completions, chat completions, their streamed chunks
(Server-Sent Events, ``data: {...}`` then ``data: [DONE]``), usage and logprobs."""

import json
import time
import uuid
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

from ..api.outputs import TokenStrings, logprob_dict
from ..engine.sequence import LogprobEntry


JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""The encoder of every event (one for the server: ``json.dumps`` with arguments builds one a call)."""


def sse(obj: Any) -> str:
    return f"data: {JSON.encode(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: Sequence[int], entries: Sequence[Optional[LogprobEntry]], strings: TokenStrings,
                        offset: int) -> Dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (the top tokens, and the
    sampled one, as {text: logprob}), text_offset (from ``offset``, the text before them). An entry
    None (an echoed prompt's first token) has null token_logprobs and top_logprobs."""
    texts, offsets, tops = [], [], []
    for token, entry in zip(tokens, entries):
        texts.append(strings(token))
        offsets.append(offset)
        offset += len(texts[-1])
        top = None if entry is None else {strings(t): v for t, v in entry[1]}
        if top is not None:
            top.setdefault(texts[-1], entry[0])  # the sampled token, when not among the top
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [None if e is None else e[0] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(ids: Sequence[int], entries: Sequence[Optional[LogprobEntry]], strings: TokenStrings,
                    k: int) -> List[Optional[Dict[int, Dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token {token id:
    {logprob, rank, decoded_token}} of its k most likely tokens (ranked from 1) and of itself (its
    own rank when not among them); ``entries`` as ``Sequence.prompt_logprobs``, at least k top tokens."""
    return [None] + [{t: asdict(v) for t, v in logprob_dict(strings, token, (lp, top[:k], rank)).items()}
                     for token, (lp, top, rank) in zip(ids[1:], entries[1:])]


def chat_logprobs(tokens: Sequence[int], entries: Sequence[LogprobEntry], strings: TokenStrings) -> Dict[str, Any]:
    """The chat shape: content, one {token, logprob, bytes, top_logprobs} per token."""
    def one(token: int, lp: float) -> Dict[str, Any]:
        s = strings(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
               for token, (lp, top, _) in zip(tokens, entries)]
    return {"content": content, "refusal": None}


def tool_call(call: Dict[str, str], call_id: str) -> Dict[str, Any]:
    """One parsed call (name, arguments) in OpenAI's shape."""
    return {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def tool_call_delta(delta: Dict[str, Any], call_id: str) -> Dict[str, Any]:
    """A streamed piece of call ``delta["index"]`` in OpenAI's shape: with its id, type and name
    when it is the call's first (``"name"`` in it), its arguments' next piece alone after."""
    if "name" in delta:
        return {"index": delta["index"], **tool_call(delta, call_id)}
    return {"index": delta["index"], "function": {"arguments": delta["arguments"]}}


class Envelope:
    """What every response and chunk of one request shares: id, object, created, model."""

    def __init__(self, kind: str, model: str):
        self.chat = kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}
        self._chunk_head = JSON.encode(head)[:-1] + ',"choices":['

    def response(self, choices: List[Dict[str, Any]], use: Dict[str, int], **extra: Any) -> Dict[str, Any]:
        """The whole response; ``extra``: top-level fields after ``usage`` (vLLM's ``prompt_logprobs``)."""
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": use, **extra}

    def chunk(self, choices: List[Dict[str, Any]], include_usage: bool, use: Optional[Dict[str, int]] = None,
              **extra: Any) -> str:
        """One streamed chunk as its SSE event (the text of ``sse`` of the chunk's object, its
        fields in the same order, from a prefix encoded once); ``extra``: top-level fields after
        ``usage`` (vLLM's ``prompt_token_ids``)."""
        body = ",".join(map(JSON.encode, choices))
        tail = f'],"usage":{JSON.encode(use)}' if include_usage else "]"
        tail += "".join(f',"{k}":{JSON.encode(v)}' for k, v in extra.items())
        return f"data: {self._chunk_head}{body}{tail}}}\n\n"
