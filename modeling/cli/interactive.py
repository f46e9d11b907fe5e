"""``--interactive``: a multi-turn chat on stdin, each reply streamed to stdout."""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

from .args import _unicode_problem
from .loading import load_llm
from .output import Totals, Writer, _json_output, _kernel_launches, path_that_ran, say


def _line_reader():
    """Reads one turn: ``input()`` (line editing) when stdin and stdout are terminals, else raw lines
    from stdin decoded as UTF-8. Returns None at end of input (Ctrl-D)."""
    stdin = sys.stdin
    if stdin is None:
        return lambda: None
    tty = stdin.isatty() and sys.stdout.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing for input())
        except ImportError:
            pass

        def read_tty() -> Optional[str]:
            try:
                return input(">>> ")
            except EOFError:
                say("")
                return None

        return read_tty

    def read_pipe() -> Optional[str]:
        raw = stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline().encode("utf-8")
        if not raw:
            return None
        try:
            return raw.decode("utf-8").rstrip("\n").rstrip("\r")
        except UnicodeDecodeError as e:
            return ValueError(f"the line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})")

    return read_pipe


def interactive(a, ck, params, device, dtype, out: Writer, template_kwargs) -> int:
    """A multi-turn chat: each stdin line is a user turn, the reply streams to stdout (or one JSON
    object with --json). ``/reset`` forgets the conversation (the system message stays), end of
    input (Ctrl-D) leaves, Ctrl-C during a reply cuts it short (at the prompt: leaves, status 130)."""
    from ..chat.template import ChatTemplateError
    from ..generation.prompts import ContextLengthError
    from ..generation.runtime import DoesNotFit

    launches = _kernel_launches()
    llm = load_llm(ck, device, dtype, max_seq_len=a.max_seq_len, max_batch_size=1,
                   use_cuda_graph=not a.no_cuda_graph, prefill_graph=a.prefill_graph)
    system = [{"role": "system", "content": a.system}] if a.system is not None else []
    history: List[Dict[str, str]] = list(system)
    read = _line_reader()
    totals = Totals()
    first = a.prompt
    turn = 0
    if sys.stdin is not None and sys.stdin.isatty():
        say("chat: one line per turn; /reset starts over; Ctrl-D leaves")
    while True:
        if first is not None:
            line, first = first, None
        else:
            line = read()
            if line is None:
                break
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
            ids = llm.tokenizer.encode(llm.render_chat(history, **template_kwargs))
            if turn == 0:
                totals.warmup_ms += llm.warm_up(ids, params, 1)
            on_text = None if a.json else (lambda i, piece: out.write(piece))
            outputs, result = llm.generate_ids([ids], params, on_text)
        except (ContextLengthError, DoesNotFit, ChatTemplateError) as e:
            history.pop()
            say(f"error: {e} (/reset starts a new conversation)")
            continue
        except KeyboardInterrupt:
            history.pop()
            if not a.json:
                out.write("\n")
            say("(reply interrupted; Ctrl-D leaves)")
            continue
        turn += 1
        totals.add(result, outputs)
        reply = outputs[0]
        reply.index = turn - 1
        if a.json:
            out.json(_json_output(reply, turn - 1, result.setup_ms))
        else:
            out.write("\n")
        history.append({"role": "assistant", "content": reply.text})
    say(totals.line(path_that_ran(device, dtype, launches), dtype))
    return 0
