"""``--interactive``: a multi-turn chat on stdin, each reply streamed to stdout."""

from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Dict, Iterator, List, Union

from ..api.commands import say
from .args import _unicode_problem
from .output import Totals, Writer, json_output


def _lines() -> Iterator[Union[str, ValueError]]:
    """The turns on stdin, up to the end of input (Ctrl-D): ``input()`` (line editing) when stdin and
    stdout are terminals, else raw lines decoded as UTF-8 (a ``ValueError`` for one that is not)."""
    stdin = sys.stdin
    if stdin is None:
        return
    if stdin.isatty() and sys.stdout.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing for input())
        while True:
            try:
                yield input(">>> ")
            except EOFError:
                say("")
                return
    while raw := stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline().encode("utf-8"):
        try:
            yield raw.decode("utf-8").rstrip("\n").rstrip("\r")
        except UnicodeDecodeError as e:
            yield ValueError(f"the line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})")


def interactive(a, llm, params, out: Writer, totals: Totals, template_kwargs) -> None:
    """A multi-turn chat with ``llm``: each stdin line is a user turn, the reply streams to stdout
    (or one JSON object with --json; each reply counts in ``totals``). ``/reset`` forgets the
    conversation (the system message stays), end of input (Ctrl-D) leaves, Ctrl-C during a reply
    cuts it short (at the prompt: leaves, status 130).
    Each turn's prompt is the whole conversation so far (the engine's prefix cache reuses what it
    computed of it before, on models of attention layers)."""
    from ..chat.template import ChatTemplateError
    from ..engine.prompts import ContextLengthError
    from ..model.device import DoesNotFit

    system = [{"role": "system", "content": a.system}] if a.system is not None else []
    history: List[Dict[str, str]] = list(system)
    turn = 0
    if sys.stdin is not None and sys.stdin.isatty():
        say("chat: one line per turn; /reset starts over; Ctrl-D leaves")
    for line in itertools.chain([] if a.prompt is None else [a.prompt], _lines()):
        if isinstance(line, ValueError):
            say(f"error: {line}")
            continue
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = list(system)
            say("(conversation reset)")
            continue
        problem = _unicode_problem(line)
        if problem:
            say(f"error: the line {problem}")
            continue
        history.append({"role": "user", "content": line})
        try:
            stream = llm.stream_chat(history, params, **template_kwargs)
            with stream:
                for piece in stream:
                    if not a.json:
                        out.write(piece)
        except (ContextLengthError, DoesNotFit, ChatTemplateError, ValueError) as e:
            history.pop()
            say(f"error: {e} (/reset starts a new conversation)")
            continue
        except KeyboardInterrupt:
            history.pop()
            if not a.json:
                out.write("\n")
            say("(reply interrupted; Ctrl-D leaves)")
            continue
        reply = stream.output
        totals.add(reply)
        if a.json:
            out.json(json_output(reply, turn, a.logprobs))
        else:
            out.write("\n")
        turn += 1
        history.append({"role": "assistant", "content": reply.text})
