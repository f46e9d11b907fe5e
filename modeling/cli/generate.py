"""Command line: ``python -m modeling.generate --model DIR_OR_ORG/NAME --prompt "..."`` (``qwen-generate``).

Streams the completion of one prompt to stdout; with ``--batch-file`` prints each completion on
one line when it is done, ``[i] text`` (newlines escaped), or with ``--json`` one JSON object per
completion; ``--interactive`` holds a multi-turn chat on stdin. One stats line ends on stderr.
Without ``--model`` it uses the model shipped in ``modeling/default_model`` (``modeling.api.checkpoint.default_model_dir``).

Exit status: 0 done; 2 bad input (one line ``error: ...`` on stderr, never a traceback); 1 any
other failure (one line too); 130 interrupted (Ctrl-C, from the first instant: this module imports
nothing heavy before its handlers are in place); 141 stdout closed by the reader (``| head``),
quietly, as a process killed by SIGPIPE would. See docs/generate.md.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    import argparse

USAGE_ERROR = 2
RUNTIME_ERROR = 1
INTERRUPTED = 130
PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MAX_SEQ_LEN = 2**31 - 1
DEVICE_PATTERN = r"(cuda|cpu)(:\d+)?"
# Only os and sys at the top (and typing, which the interpreter has loaded): Ctrl-C lands in main's
# handler from the first instant; argparse, json, torch... are imported inside it.


class UsageError(Exception):
    """Bad input from the user: printed as ``error: <message>``, exit status 2."""


def say(msg: str) -> None:
    """One line on stderr; never fails (stderr may be closed, a broken pipe, or ASCII-only)."""
    err = sys.stderr
    if err is None:
        return
    try:
        err.write(msg + "\n")
        err.flush()
    except (OSError, ValueError):
        pass


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def prog_name() -> str:
    """``qwen-generate`` (or whatever the console script is called), ``python -m modeling.generate``
    when run as a module."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m modeling.generate" if name in ("", "-c", "generate.py", "__main__.py") else name


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    import argparse

    p = argparse.ArgumentParser(
        prog=prog_name(),
        description="Generate text with a Qwen3, Qwen2/2.5 or Qwen3.5 checkpoint (model_type qwen3, qwen2, "
                    "qwen3_5 or qwen3_5_text) on the torch.ops.qwen Triton kernels (without CUDA: the PyTorch "
                    "reference ops).",
        epilog="Sampling flags left out take the checkpoint's generation_config.json values. Exit status: "
               "0 done, 2 bad input, 1 other failure, 130 interrupted, 141 stdout closed early. "
               "See docs/generate.md.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", help="a checkpoint directory (config.json, *.safetensors, tokenizer.json) or a "
                                   "Hugging Face Hub id ORG/NAME (downloaded once into the Hub cache); default: "
                                   "the shipped model, a small Qwen3 trained on Tiny Shakespeare")
    m.add_argument("--revision", help="branch, tag or commit of a Hub id (default main)")
    m.add_argument("--offline", action="store_true",
                   help="use only the local Hub cache (as HF_HUB_OFFLINE=1 does)")
    i = p.add_argument_group("input")
    i.add_argument("--prompt", help="the prompt text (with --interactive: the first user turn)")
    i.add_argument("--batch-file", metavar="FILE", help="one prompt per line ('\\n'; blank lines skipped), '-' for "
                                                        "stdin; decoded together, each completion printed as "
                                                        "'[i] text' with newlines escaped (or --json)")
    i.add_argument("--chat", action="store_true", help="format each prompt as a user turn with the checkpoint's "
                                                       "chat template (ChatML if it ships none)")
    i.add_argument("--system", metavar="TEXT", help="a system message before the user turn (--chat, --interactive)")
    i.add_argument("-i", "--interactive", action="store_true",
                   help="multi-turn chat on stdin: one line per turn, /reset forgets the conversation, "
                        "Ctrl-D leaves")
    i.add_argument("--no-thinking", action="store_true",
                   help="Qwen3's switch: render the chat template with enable_thinking=False")
    s = p.add_argument_group("sampling and stopping")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: generation_config.json's max_new_tokens, else 64")
    s.add_argument("--temperature", type=float, default=None, help="0: greedy (the default without "
                                                                   "generation_config.json sampling values)")
    s.add_argument("--top-k", type=int, default=None, help="0: off")
    s.add_argument("--top-p", type=float, default=None, help="1: off")
    s.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    s.add_argument("--stop", action="append", metavar="STR", default=[],
                   help="end a completion at this string (left out of the output); repeatable. Generation "
                        "also stops at the tokenizer's EOS ids")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per completion on stdout: index, text, "
                                                       "token_ids, finish_reason, stop_reason, prompt_tokens, "
                                                       "timings")
    r = p.add_argument_group("runtime")
    r.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and KV cache dtype (default bf16 on CUDA, fp32 on CPU)")
    r.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache positions per sequence (default: longest prompt + max new tokens; "
                        "--interactive: grown as the conversation needs)")
    r.add_argument("--max-batch-size", type=int, default=8, help="prompts decoded together (--batch-file)")
    r.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (one Python launch per op)")
    r.add_argument("--prefill-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill prompts padded to a length bucket, through a CUDA graph captured per bucket "
                        "(default: on with the CUDA-graph decode; with --no-cuda-graph the padded prefill "
                        "runs eagerly); --no-prefill-graph prefills eagerly at the exact length")
    r.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    return p.parse_args(argv)


def _unicode_problem(text: str) -> Optional[str]:
    from ..api.tokenizer import unicode_error

    return unicode_error(text)


def check_args(a: argparse.Namespace) -> None:
    """Every problem with the flags alone, in one message (before any model is read)."""
    import re

    from ..generation.sampling import sampling_errors

    problems = sampling_errors(0.0 if a.temperature is None else a.temperature, 0 if a.top_k is None else a.top_k,
                               1.0 if a.top_p is None else a.top_p, a.seed)
    if a.interactive:
        if a.batch_file is not None:
            problems.append("--interactive reads the conversation from stdin: it takes no --batch-file")
    elif a.prompt is None and a.batch_file is None:
        problems.append("give a prompt: --prompt TEXT, --batch-file FILE or --interactive")
    elif a.prompt is not None and a.batch_file is not None:
        problems.append("give either --prompt or --batch-file, not both")
    for flag, value in (("--prompt", a.prompt), ("--system", a.system)):
        if value is None:
            continue
        problem = _unicode_problem(value)
        if problem:
            problems.append(f"{flag} {problem}")
        elif flag == "--prompt" and not value.strip():
            problems.append("the prompt is empty")
    for stop in a.stop:
        problem = _unicode_problem(stop)
        if problem:
            problems.append(f"--stop {problem}")
        elif not stop:
            problems.append("--stop needs a non-empty string")
    if (a.system is not None or a.no_thinking) and not (a.chat or a.interactive):
        flag = "--system" if a.system is not None else "--no-thinking"
        problems.append(f"{flag} applies to chat prompts: add --chat (or --interactive)")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.max_seq_len is not None and not 2 <= a.max_seq_len <= MAX_SEQ_LEN:
        problems.append(f"--max-seq-len must be >= 2 and at most {MAX_SEQ_LEN} (int32 positions), got {a.max_seq_len}")
    if a.max_batch_size < 1:
        problems.append(f"--max-batch-size must be >= 1, got {a.max_batch_size}")
    if a.device is not None:
        if not re.fullmatch(DEVICE_PATTERN, a.device):
            problems.append(f"--device must be cuda, cuda:N or cpu, got {a.device!r}")
        elif a.device.startswith("cpu:") and a.device != "cpu:0":
            problems.append(f"--device {a.device}: the CPU has no index (use --device cpu)")
    if a.revision is not None and a.model is None:
        problems.append("--revision needs --model ORG/NAME")
    if problems:
        raise UsageError("; ".join(problems))


def split_prompts(text: str) -> List[str]:
    """One prompt per line: split on '\\n' only (a U+2028 or a form feed stays inside its prompt),
    one trailing '\\r' dropped (CRLF files), blank lines skipped."""
    lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def _decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_prompts(a: argparse.Namespace) -> List[str]:
    if a.batch_file is None:
        return [] if a.prompt is None else [a.prompt]
    if a.batch_file == "-":
        stdin = sys.stdin
        if stdin is None:
            raise UsageError("--batch-file -: standard input is closed")
        try:
            data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode("utf-8", "surrogateescape")
        except OSError as e:
            raise UsageError(f"--batch-file -: cannot read standard input: {e}") from None
        text, name = _decode_utf8(data, "--batch-file - (standard input)"), "- (standard input)"
    else:
        from pathlib import Path

        try:
            data = Path(a.batch_file).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read --batch-file {a.batch_file!r}: {e.strerror or e}") from None
        text, name = _decode_utf8(data, f"--batch-file {a.batch_file!r}"), repr(a.batch_file)
    prompts = split_prompts(text)
    if not prompts:
        raise UsageError(f"--batch-file {name} holds no prompt (one per line)")
    return prompts


def escape_line(text: str) -> str:
    """A completion on one line: backslash, newline and carriage return written as \\\\, \\n and \\r."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _tolerant_stdout() -> None:
    """Characters the output encoding cannot hold (PYTHONIOENCODING=ascii) print as '?' instead of
    raising UnicodeEncodeError (stderr already backslash-escapes them)."""
    out = sys.stdout
    if out is not None and getattr(out, "errors", None) == "strict" and hasattr(out, "reconfigure"):
        try:
            out.reconfigure(errors="replace")
        except (ValueError, OSError, AttributeError):
            pass


def _silence_stdout() -> None:
    """After a broken pipe: point fd 1 at /dev/null, so the interpreter's final flush is quiet."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        _tolerant_stdout()
        try:
            a = parse_args(argv)
        except SystemExit as e:  # argparse has printed its usage message (or --help)
            return USAGE_ERROR if e.code else 0
        check_args(a)
        return run(a)
    except UsageError as e:
        say(f"error: {e}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        say("interrupted")
        return INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        _silence_stdout()
        return PIPE_CLOSED
    except Exception as e:  # no tracebacks for users; the message says what failed
        say(f"error: {type(e).__name__}: {_one_line(e)}")
        try:  # e.g. stdout on a full disk: what is still buffered would fail again at exit
            if sys.stdout is not None:
                sys.stdout.flush()
        except (OSError, ValueError):
            _silence_stdout()
        return RUNTIME_ERROR


# ----------------------------------------------------------------------------------------------
# the run


def load_checkpoint(a: argparse.Namespace):
    from ..model.hub import ModelNotFound
    from ..api.checkpoint import Checkpoint

    name = a.model
    try:
        return Checkpoint.load(a.model, a.revision, True if a.offline else None, progress=True, notice=say)
    except ModelNotFound as e:
        raise UsageError(f"--model {e}") from None
    except ValueError as e:  # ConfigError, the tokenizer's files, generation_config.json
        where = f"--model {name!r}" if name is not None else "the default model"
        raise UsageError(f"{where}: {e}") from None


def sampling_params(a: argparse.Namespace, ck):
    """The flags given, the checkpoint's generation_config.json for the others (with a note)."""
    from ..api.llm import DEFAULT_MAX_TOKENS
    from ..generation.sampling import SamplingParams

    d = ck.defaults.merged(a.temperature, a.top_k, a.top_p, a.max_new_tokens)
    from_checkpoint = []
    if not ck.defaults.greedy:
        from_checkpoint += [f"{name} {value:g}" for name, flag, value in
                            (("temperature", a.temperature, d.temperature), ("top-k", a.top_k, d.top_k),
                             ("top-p", a.top_p, d.top_p)) if flag is None]
    if a.max_new_tokens is None and ck.defaults.max_new_tokens is not None:
        from_checkpoint.append(f"max-new-tokens {d.max_new_tokens}")
    if from_checkpoint:
        say(f"note: from the checkpoint's generation_config.json: {', '.join(from_checkpoint)} (flags override)")
    try:
        return SamplingParams(d.temperature, d.top_k, d.top_p, a.seed, max_tokens=d.max_new_tokens or DEFAULT_MAX_TOKENS,
                              stop=tuple(a.stop))
    except ValueError as e:
        raise UsageError(str(e)) from None


def load_llm(ck, device, dtype, **kwargs):
    from ..model.config import ConfigError
    from ..api.llm import LLM
    from ..generation.runtime import DoesNotFit
    from ..model.loader import CheckpointError

    try:
        return LLM(ck, device=device, dtype=dtype, **kwargs)
    except DoesNotFit as e:
        raise UsageError(f"the model does not fit: {e}") from None
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--model {str(ck.path)!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"--model {str(ck.path)!r}: cannot read the weights ({e})") from None
    except Exception as e:
        if type(e).__name__ == "SafetensorError":
            raise UsageError(f"--model {str(ck.path)!r}: unreadable weights ({_one_line(e)})") from None
        raise


class Totals:
    """The stats of every generate call of a run, for the stats line."""

    def __init__(self):
        self.prompt_tokens = self.new_tokens = self.steps = 0
        self.warmup_ms = self.prefill_ms = self.decode_ms = 0.0
        self.cuda_graph = False

    def add(self, result, outputs) -> None:
        self.prompt_tokens += result.prompt_tokens
        self.new_tokens += sum(o.generated_tokens for o in outputs)
        self.prefill_ms += result.prefill_ms
        self.decode_ms += result.decode_ms
        self.steps += result.decode_steps
        self.warmup_ms += result.setup_ms
        self.cuda_graph |= result.cuda_graph

    def line(self, path: str, dtype) -> str:
        seconds = (self.prefill_ms + self.decode_ms) / 1e3
        rate = f"{self.new_tokens / seconds:.1f}" if seconds else "nan"
        per_step = self.decode_ms / self.steps if self.steps else 0.0
        return (f"prompt tokens {self.prompt_tokens} | warm-up {self.warmup_ms:.1f} ms | "
                f"prefill {self.prefill_ms:.1f} ms | decode {per_step:.2f} ms/token ({self.steps} steps) | "
                f"{self.new_tokens} new tokens, {rate} tokens/s | "
                f"cuda graph: {'yes' if self.cuda_graph else 'no'} | {path}, {str(dtype).replace('torch.', '')}")


def _kernel_launches() -> int:
    from qwen_ops import kernel_calls

    return sum(kernel_calls.values())


def path_that_ran(device, dtype, launches_before: int) -> str:
    """The ops' path, from what ran: Triton launches counted since ``launches_before``."""
    from ..generation.runtime import backend_name

    expected = backend_name(device, dtype)
    ran_triton = _kernel_launches() > launches_before
    if ran_triton == expected.startswith("Triton"):
        return expected
    if ran_triton:
        return "Triton interpreter (CPU)" if device.type == "cpu" else "Triton kernels (CUDA)"
    return f"PyTorch reference ops ({device.type.upper()})"


class Writer:
    """stdout: written and flushed piece by piece; JSON non-ASCII escaped when the encoding is not UTF."""

    def __init__(self, stream):
        self.stream = stream
        encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "").replace("_", "")
        self.utf = encoding.startswith("utf")

    def write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def json(self, obj: Dict[str, Any]) -> None:
        import json

        self.write(json.dumps(obj, ensure_ascii=not self.utf) + "\n")


def run(a: argparse.Namespace) -> int:
    if sys.stdout is None:
        raise UsageError("standard output is closed: there is nowhere to write the completions")
    out = Writer(sys.stdout)
    prompts_text = read_prompts(a)

    from dataclasses import replace

    import torch

    from ..chat.template import ChatTemplateError
    from ..api.llm import ContextLengthError
    from ..generation.runtime import DoesNotFit, backend_name, check_fits, resolve_device

    ck = load_checkpoint(a)
    config, tokenizer = ck.config, ck.tokenizer
    params = sampling_params(a, ck)
    try:
        device = resolve_device(a.device)
    except ValueError as e:
        raise UsageError(f"--{e}") from None
    dtype = getattr(torch, DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")])
    template_kwargs = {"enable_thinking": False} if a.no_thinking else {}
    if a.chat or a.interactive:
        try:
            template = ck.chat_template
        except ChatTemplateError as e:
            raise UsageError(f"--model {str(ck.path)!r}: {e}") from None
        if template.is_default:
            say("note: the checkpoint ships no chat template: using ChatML")
    if device.type == "cpu":
        why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
        say(f"note: {why}: running eagerly on the CPU ({backend_name(device, dtype).split(' (')[0]}), slowly")
    if a.max_seq_len is not None and a.max_seq_len > config.max_position_embeddings:
        say(f"note: --max-seq-len {a.max_seq_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}")

    if a.interactive:
        return interactive(a, ck, params, device, dtype, out, template_kwargs)

    if a.chat:
        system = [{"role": "system", "content": a.system}] if a.system is not None else []
        try:
            prompts_text = [ck.chat_template.render(system + [{"role": "user", "content": p}],
                                                    add_generation_prompt=True, **template_kwargs)
                            for p in prompts_text]
        except ChatTemplateError as e:
            raise UsageError(str(e)) from None
    prompts = []
    for i, text in enumerate(prompts_text):
        try:
            ids = tokenizer.encode(text)
        except ValueError as e:
            raise UsageError(f"prompt {i}: {e}") from None
        if not ids:
            raise UsageError(f"prompt {i} is empty after tokenization")
        bad = [t for t in ids if t >= config.vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the model's vocabulary ({config.vocab_size})")
        prompts.append(ids)

    longest = max(map(len, prompts))
    limit = a.max_seq_len or config.max_position_embeddings
    if longest >= limit:
        what = "--max-seq-len" if a.max_seq_len else "the model's max_position_embeddings"
        raise UsageError(f"the prompt has {longest} tokens; the cache holds {limit} ({what}): no room for a new token")
    max_new = params.max_tokens
    if longest + max_new > limit:
        max_new = limit - longest
        what = "--max-new-tokens" if a.max_new_tokens is not None else "max new tokens (the checkpoint's or the default)"
        say(f"note: {what} lowered to {max_new} to fit the cache of {limit} positions")
    params = replace(params, max_tokens=max_new)
    max_seq_len = a.max_seq_len or longest + max_new
    batch = min(a.max_batch_size, len(prompts))
    try:
        check_fits(config, device, dtype, batch, max_seq_len, longest)
    except DoesNotFit as e:
        if e.max_prompt is not None and "prompts of at most" in str(e):
            raise UsageError(f"a prompt of {longest} tokens does not fit: {e}") from None
        if a.max_seq_len:
            raise UsageError(f"--max-seq-len {a.max_seq_len} does not fit: {e}") from None
        raise UsageError(f"{batch} sequence(s) of {longest} prompt + {max_new} new tokens do not fit: {e}; "
                         "lower --max-new-tokens or --max-batch-size") from None

    launches = _kernel_launches()
    llm = load_llm(ck, device, dtype, max_seq_len=max_seq_len, max_batch_size=batch,
                   use_cuda_graph=not a.no_cuda_graph, prefill_graph=a.prefill_graph)
    totals = Totals()
    totals.warmup_ms += llm.warm_up(prompts[0], params, batch)

    streaming = a.batch_file is None and not a.json
    on_text = (lambda i, piece: out.write(piece)) if streaming else None

    def on_output(i, o):
        if a.json:
            return
        out.write("\n" if streaming else f"[{i}] {escape_line(o.text)}\n")

    for start in range(0, len(prompts), batch):
        try:
            outputs, result = llm.generate_ids(prompts[start:start + batch], params, on_text, on_output,
                                               index_offset=start)
        except (ContextLengthError, DoesNotFit) as e:
            raise UsageError(str(e)) from None
        warm = totals.warmup_ms if start == 0 else 0.0
        totals.add(result, outputs)
        if a.json:
            for o in outputs:
                out.json(_json_output(o, start // batch, warm + result.setup_ms))
    say(totals.line(path_that_ran(device, dtype, launches), dtype))
    return 0


def _json_output(o, batch_index: int, warmup_ms: float) -> Dict[str, Any]:
    m = o.metrics
    return {"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason, "prompt_tokens": len(o.prompt_token_ids),
            "timings": {"batch": batch_index, "warmup_ms": round(warmup_ms, 3), "prefill_ms": round(m["prefill_ms"], 3),
                        "decode_ms": round(m["decode_ms"], 3), "decode_steps": m["decode_steps"],
                        "cuda_graph": m["cuda_graph"]}}


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
    from ..api.llm import ContextLengthError
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


if __name__ == "__main__":
    sys.exit(main())
