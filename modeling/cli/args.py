"""The command line's flags: ``parse_args``, ``check_args`` (every problem in one ``UsageError``)
and the prompts they name (``read_prompts``). Exit statuses are here too."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, List, Optional, Sequence

from ..generation.prompts import MAX_SEQ_LEN

if TYPE_CHECKING:
    import argparse


USAGE_ERROR = 2
RUNTIME_ERROR = 1
INTERRUPTED = 130
PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEVICE_PATTERN = r"(cuda|cpu)(:\d+)?"
BATCH_FILE_LIMIT = 64 << 20
"""Bytes --batch-file reads at most (a file, or standard input)."""
# Only os, sys, typing and modeling.generation.prompts (which imports nothing heavy) at the top of the
# command line's modules: Ctrl-C lands in main's handler from the first instant; argparse, json,
# torch... are imported inside the functions.


class UsageError(Exception):
    """Bad input from the user: printed as ``error: <message>``, exit status 2."""


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


def read_prompts(a: argparse.Namespace) -> List[str]:
    """The prompts: --prompt, or the lines of --batch-file, a regular file (as the checkpoint's files
    are read: ``modeling.model.files``; a FIFO, a device or a directory is refused, never waited on)
    or standard input, of at most ``BATCH_FILE_LIMIT`` bytes."""
    from ..model.files import decode_utf8, format_size, read_file

    if a.batch_file is None:
        return [] if a.prompt is None else [a.prompt]
    if a.batch_file == "-":
        stdin = sys.stdin
        if stdin is None:
            raise UsageError("--batch-file -: standard input is closed")
        try:
            data = (stdin.buffer.read(BATCH_FILE_LIMIT + 1) if hasattr(stdin, "buffer")
                    else stdin.read(BATCH_FILE_LIMIT + 1).encode("utf-8", "surrogateescape"))
        except OSError as e:
            raise UsageError(f"--batch-file -: cannot read standard input: {e}") from None
        if len(data) > BATCH_FILE_LIMIT:
            raise UsageError(f"--batch-file -: standard input holds more than the {format_size(BATCH_FILE_LIMIT)} "
                             "a batch file may have")
        text, name = decode_utf8(data, "--batch-file - (standard input)", UsageError), "- (standard input)"
    else:
        data = read_file(a.batch_file, BATCH_FILE_LIMIT, lambda m: UsageError(f"cannot read --batch-file "
                                                                               f"{a.batch_file!r}: {m}"))
        text, name = decode_utf8(data, f"--batch-file {a.batch_file!r}", UsageError), repr(a.batch_file)
    prompts = split_prompts(text)
    if not prompts:
        raise UsageError(f"--batch-file {name} holds no prompt (one per line)")
    return prompts
