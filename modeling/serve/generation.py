"""One API request in the engine: its choices (``n`` per prompt) submitted together, their tokens
turned into text as they arrive (each a ``modeling.api.outputs.Completion``: incremental
detokenization and stop strings, as ``LLM``'s; ``ChatOutput`` splits a chat reply into reasoning,
content and tool calls), and the choices of the response or of each streamed chunk built from them."""

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..api.outputs import Completion, TokenStrings
from ..engine.sampling_params import SamplingParams
from .chat_output import ChatOutput
from .engine_loop import EngineClient, EngineFailure, Sink, TokenEvent
from .errors import APIError, invalid
from .protocol import Plan, Prompt
from .responses import chat_logprobs, completion_logprobs, prompt_logprobs, tool_call, tool_call_delta, usage


class EngineError(Exception):
    """The engine failed a step while this request was in it (a 500 for the client)."""


class ClientGone(Exception):
    """The client disconnected before its whole response was ready: put in the request's sink, so
    that the handler waiting for tokens wakes and ends (a 499 that nobody reads)."""


@dataclass
class Piece:
    """What one update added to a choice: text (split for chat: reasoning, content and tool-call
    deltas, ``ToolCallParser``'s), token ids, logprobs, and the finish reason when it was the last."""

    text: str = ""
    reasoning: str = ""
    content: str = ""
    call_deltas: List[Dict[str, Any]] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[tuple] = field(default_factory=list)
    finish_reason: Optional[str] = None


def merged(deltas: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One delta a call: a piece's consecutive deltas of one call joined (its name kept)."""
    out: List[Dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1] = {**out[-1], "arguments": out[-1]["arguments"] + d["arguments"]}
        else:
            out.append(dict(d))
    return out


class Choice(Completion):
    """One sequence of a request: choice ``index`` of ``prompt`` (its stop token counts: it stays in
    ``token_ids`` and ``entries``)."""

    def __init__(self, index: int, prompt: Prompt, params: SamplingParams, plan: Plan, chat: bool,
                 strings: TokenStrings):
        super().__init__(index, strings, params, keep_stop_tokens=True)
        self.prompt = prompt
        self.chat = ChatOutput(plan.reasoning, plan.tool_calls, plan.prompt_text, plan.tool_form,
                               plan.tool_types) if chat else None
        self.parallel_tool_calls = plan.parallel_tool_calls
        self.rid: Optional[int] = None  # its request id in the engine, once submitted
        self.reasoning = self.content = ""
        self.call_ids: Dict[int, str] = {}  # a streamed call's id, by its index
        self.admitted: Optional[float] = None
        self.first_token: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.lp_offset = 0  # text_offset of the next streamed logprob (completions)
        self.prompt_logprobs: Optional[list] = None  # its prompt's entries, when its params ask for them
        self.echoed = False  # its streamed echo is sent (with logprobs: in its first chunk)
        self.ids_sent = False  # its prompt's ids are streamed (return_token_ids: in its first chunk)

    def consume(self, events: List[TokenEvent]) -> Optional[Piece]:
        """Take this step's tokens; None once the choice has finished (tokens the engine sampled
        after a stop string matched, before its abort landed, are dropped)."""
        if self.finished:
            return None
        piece = Piece()
        now = time.perf_counter()
        for ev in events:
            if self.admitted is None:
                self.admitted, self.first_token = ev.admitted, now
            if ev.prompt_logprobs is not None:
                self.prompt_logprobs = ev.prompt_logprobs
            piece.token_ids.append(ev.token)
            if ev.logprobs is not None:
                piece.logprobs.append(ev.logprobs)
            piece.text += self.push(ev.token, ev.logprobs, ev.finish_reason)
            if self.finished:
                break
        if self.chat is not None:
            piece.reasoning, piece.content, deltas = self.chat.push(piece.text, self.finished)
            piece.call_deltas = deltas if self.parallel_tool_calls else [d for d in deltas if d["index"] == 0]
            self.reasoning += piece.reasoning
            self.content += piece.content
        if self.finished:
            self.finished_at = now
            if self.finish_reason == "stop" and self.calls:
                self.finish_reason = "tool_calls"
            piece.finish_reason = self.finish_reason
        return piece

    @property
    def calls(self) -> List[Dict[str, str]]:
        """The reply's tool calls (name, arguments): the first only without parallel_tool_calls."""
        calls = self.chat.tools.calls if self.chat is not None and self.chat.tools is not None else []
        return calls if self.parallel_tool_calls else calls[:1]

    def call_id(self, index: int) -> str:
        """The id of the reply's call ``index``, made when its first delta goes out."""
        return self.call_ids.setdefault(index, f"call_{uuid.uuid4().hex[:24]}")


class Generation:
    """The choices of one request (``plan``), their sequences in the engine and their sink."""

    def __init__(self, plan: Plan, chat: bool, loop: EngineClient, strings: TokenStrings, arrival: float):
        self.plan, self.chat, self.loop, self.strings, self.arrival = plan, chat, loop, strings, arrival
        self.sink = Sink()
        self.choices = [Choice(i * plan.n + j, prompt, plan.params[i * plan.n + j], plan, chat, strings)
                        for i, prompt in enumerate(plan.prompts) for j in range(plan.n)]
        self.finished_at: Optional[float] = None
        self.closed = False  # its log line and metrics are recorded

    def submit(self) -> None:
        """Every choice into the engine (a 400 if one cannot run: nothing is left running)."""
        try:
            for c in self.choices:
                c.rid = self.loop.submit(self.sink, c.index, c.prompt.ids, c.params,
                                         self.plan.max_tokens[c.index // self.plan.n], self.plan.stop_ids)
        except ValueError as e:
            self.abort()
            raise invalid(str(e)) from None

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def next(self) -> List[Tuple[Choice, Piece]]:
        """The pieces of the engine steps that reached this request since the last call, one per
        choice (``EngineError`` if the engine failed it, ``ClientGone`` if the client left). Waits
        for the next step when none did; when several are queued (the event loop fell behind the
        engine), their tokens are merged, so a busy server sends fewer, longer chunks instead of
        falling further behind."""
        items = await self.sink.take()
        failure = next((item for item in items if isinstance(item, (EngineFailure, ClientGone))), None)
        if isinstance(failure, ClientGone):
            raise failure
        if failure is not None:
            for c in self.choices:
                if c.finish_reason is None:
                    c.finish_reason = "error"
            raise EngineError(failure.message)
        by_choice: Dict[int, List[TokenEvent]] = {}
        for item in items:
            for ev in item:
                by_choice.setdefault(ev.index, []).append(ev)
        out = []
        for index, events in by_choice.items():
            c = self.choices[index]
            piece = c.consume(events)
            if piece is None:
                continue
            if c.stops.matched is not None:
                self.loop.abort(c.rid)  # the engine stops it at once
            out.append((c, piece))
        if self.done and self.finished_at is None:
            self.finished_at = time.perf_counter()
        return out

    def abort(self) -> None:
        """Stop every unfinished choice (a client gone, a drain timeout, an error)."""
        for c in self.choices:
            if c.rid is not None and not c.finished:
                self.loop.abort(c.rid)
                c.finish_reason = "abort"

    # ------------------------------------------------------------------ accounting
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.plan.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def choice_usage(self, index: int) -> Dict[str, int]:
        """Choice ``index``'s usage so far (vLLM's ``continuous_usage_stats``): its prompt's tokens
        and its own tokens."""
        c = self.choices[index]
        return usage(len(c.prompt.ids), len(c.token_ids))

    def timings(self) -> Dict[str, Optional[float]]:
        """Seconds from arrival: ``queue`` (to the first admission), ``ttft`` (to the first token),
        ``total`` (to the last)."""
        admitted = [c.admitted for c in self.choices if c.admitted is not None]
        first = [c.first_token for c in self.choices if c.first_token is not None]
        end = self.finished_at or time.perf_counter()
        return {"queue": min(admitted) - self.arrival if admitted else None,
                "ttft": min(first) - self.arrival if first else None,
                "total": end - self.arrival}

    # ------------------------------------------------------------------ response choices
    def _echo(self, c: Choice) -> str:
        if not self.plan.echo:
            return ""
        if c.prompt.text is not None:
            return c.prompt.text
        return self.strings.tokenizer.decode(c.prompt.ids, c.params.skip_special_tokens)

    def _prompt_entries(self, c: Choice) -> list:
        """The prompt logprob entries of ``c``'s prompt: its own, else its prompt's first choice's
        (the one that computes them for a whole response, ``choice_params``)."""
        own = c.prompt_logprobs
        return own if own is not None else self.choices[c.index - c.index % self.plan.n].prompt_logprobs

    def _echo_logprobs(self, c: Choice) -> Tuple[List[int], List[Optional[tuple]]]:
        """The echoed prompt's token ids and their entries (None for the first, then ``logprobs``
        top tokens each): what precedes the completion's in the legacy logprobs."""
        k = self.plan.logprobs
        return c.prompt.ids, [None] + [(lp, top[:k], rank) for lp, top, rank in self._prompt_entries(c)[1:]]

    def prompt_logprobs(self, c: Choice) -> list:
        """vLLM's ``prompt_logprobs`` of ``c``'s prompt (``responses.prompt_logprobs``), when asked for."""
        return prompt_logprobs(c.prompt.ids, self._prompt_entries(c), self.strings, self.plan.prompt_logprobs)

    def completion_choice(self, c: Choice) -> Dict[str, Any]:
        out = {"index": c.index, "text": self._echo(c) + c.text, "logprobs": None,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.plan.logprobs is not None:
            ids, entries = self._echo_logprobs(c) if self.plan.echo else ([], [])
            out["logprobs"] = completion_logprobs(ids + c.token_ids, entries + c.entries, self.strings, 0)
        if self.plan.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(c)
        if self.plan.return_token_ids:
            out.update(prompt_token_ids=c.prompt.ids, token_ids=c.token_ids)
        return out

    def response_fields(self) -> Dict[str, Any]:
        """A whole response's top-level fields beside the choices: a chat response's
        ``prompt_logprobs`` and ``prompt_token_ids`` (vLLM's: one prompt), when asked for."""
        out = self.first_chunk_fields()
        if self.chat and self.plan.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(self.choices[0])
        return out

    def first_chunk_fields(self) -> Dict[str, Any]:
        """The top-level fields of a stream's first chunks (``first_deltas``'): a chat stream's
        ``prompt_token_ids`` with ``return_token_ids``, as vLLM sends them."""
        if self.chat and self.plan.return_token_ids:
            return {"prompt_token_ids": self.choices[0].prompt.ids}
        return {}

    def chat_choice(self, c: Choice) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.calls:  # the reply's tool calls, parsed when the request gave tools
            message.update(content=c.content.strip() or None,
                           tool_calls=[tool_call(call, c.call_id(i)) for i, call in enumerate(c.calls)])
        if self.plan.reasoning:
            message["reasoning_content"] = c.reasoning or None
        out = {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason}
        if self.plan.logprobs is not None:
            out["logprobs"] = chat_logprobs(c.token_ids, c.entries, self.strings)
        if self.plan.return_token_ids:
            out["token_ids"] = c.token_ids  # the prompt's ids: beside the choices (response_fields)
        return out

    def first_deltas(self) -> List[Dict[str, Any]]:
        """The chunk choices sent before any token: the assistant role (chat), the prompt (echo;
        with logprobs it waits for the first token, which brings the prompt's logprobs)."""
        if self.chat:
            return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for c in self.choices]
        if self.plan.echo and self.plan.logprobs is None:
            for c in self.choices:
                c.echoed = True
            return [self._with_prompt_ids(c, {"index": c.index, "text": self._echo(c), "logprobs": None,
                                              "finish_reason": None}) for c in self.choices]
        return []

    def _with_prompt_ids(self, c: Choice, out: Dict[str, Any]) -> Dict[str, Any]:
        """A streamed completion choice ``out`` of ``c``, with its prompt's ids when it is the first
        (``return_token_ids``; vLLM's place for them in a stream)."""
        if self.plan.return_token_ids and not c.ids_sent:
            c.ids_sent = True
            out["prompt_token_ids"] = c.prompt.ids
        return out

    def delta(self, c: Choice, p: Piece) -> Optional[Dict[str, Any]]:
        """A streamed chunk's choice for piece ``p`` of ``c`` (its ``stop_reason`` null until the
        chunk that finishes it), or None when it carries nothing a client would see."""
        extra = self.plan.return_token_ids or self.plan.logprobs is not None
        out: Dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": p.finish_reason}
        if self.chat:
            d: Dict[str, Any] = {k: v for k, v in (("reasoning_content", p.reasoning), ("content", p.content)) if v}
            if p.call_deltas:
                d["tool_calls"] = [tool_call_delta(x, c.call_id(x["index"])) for x in merged(p.call_deltas)]
            if not d and not extra and p.finish_reason is None:
                return None
            out["delta"] = d
            if self.plan.logprobs is not None:
                out["logprobs"] = chat_logprobs(p.token_ids, p.logprobs, self.strings)
        else:
            text, ids, entries = p.text, p.token_ids, p.logprobs
            if self.plan.echo and not c.echoed:  # the first piece, with the prompt's logprobs
                c.echoed = True
                echo_ids, echo_entries = self._echo_logprobs(c)
                text, ids, entries = self._echo(c) + text, echo_ids + ids, echo_entries + entries
            if not text and not extra and p.finish_reason is None:
                return None
            out["text"] = text
            if self.plan.logprobs is not None:
                out["logprobs"] = completion_logprobs(ids, entries, self.strings, c.lp_offset)
                c.lp_offset += sum(len(self.strings(t)) for t in ids)
            self._with_prompt_ids(c, out)
        out["stop_reason"] = c.stop_reason if p.finish_reason else None  # both endpoints, as vLLM's
        if self.plan.return_token_ids:
            out["token_ids"] = p.token_ids
        return out


def check_admission(loop: EngineClient, plan: Plan, max_waiting: int) -> None:
    """A 429 when the request's sequences would take the waiting queue past ``max_waiting`` (a 400
    when they alone pass it: retrying would never help)."""
    num = len(plan.prompts) * plan.n
    if num > max_waiting:
        raise invalid(f"This request makes {num} sequences (prompts x n); at most {max_waiting} may "
                      "wait for the engine (--max-waiting)", "n")
    waiting = loop.counts()["waiting"]
    if waiting + num > max_waiting:
        raise APIError(429, f"The server is busy: {waiting} sequences are waiting and this request adds {num} "
                            f"(at most {max_waiting} wait, --max-waiting). Retry later.", code="queue_full")
