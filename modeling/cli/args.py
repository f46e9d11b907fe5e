"""The command line's flags: ``parse_args``, ``check_args`` (every problem in one ``UsageError``)
and the prompts they name (``read_prompts``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, List, Optional, Sequence

from ..api.commands import UsageError, add_model_flags, device_problem, prog_name, quantization_problem
from ..engine.prompts import MAX_MODEL_LEN

if TYPE_CHECKING:
    import argparse


PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`
RENAMED_FLAGS = {"--max-new-tokens": "--max-tokens", "--max-seq-len": "--max-model-len",
                 "--max-batch-size": "--max-num-seqs", "--no-cuda-graph": "--enforce-eager"}
"""Earlier flags that still work, with a note naming the new one."""
REMOVED_FLAGS = dict.fromkeys(("--prefill-graph", "--no-prefill-graph"), "the engine captures prefill steps in CUDA "
                              "graphs as it does decode steps (--enforce-eager runs every step eagerly)")
"""Earlier flags that mean nothing on the engine: refused, saying what to use."""
BATCH_FILE_LIMIT = 64 << 20
"""Bytes --batch-file reads at most (a file, or standard input)."""
# At the top of the command line's modules, only modules that import nothing heavy (Ctrl-C lands in
# main's handler from the first instant); argparse, json, torch... are imported inside the functions.


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    import argparse

    p = argparse.ArgumentParser(
        prog=prog_name("modeling.generate", "generate.py"),
        description="Generate text with a Qwen3, Qwen2/2.5 or Qwen3.5 checkpoint, dense or mixture of experts "
                    "(model_type qwen3, qwen2, qwen3_5, qwen3_5_text, qwen3_moe, qwen2_moe, qwen3_5_moe or "
                    "qwen3_5_moe_text) on the torch.ops.qwen Triton kernels (without CUDA: the PyTorch "
                    "reference ops).",
        epilog="Sampling flags left out take the checkpoint's generation_config.json values. Exit status: "
               "0 done, 2 bad input, 1 other failure, 130 interrupted, 141 stdout closed early. "
               "See docs/generate.md.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", help="a checkpoint directory (config.json, *.safetensors, tokenizer.json) or a "
                                   "Hugging Face Hub id ORG/NAME (downloaded once into the Hub cache); default: "
                                   "the shipped model, a small Qwen3 trained on Tiny Shakespeare")
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
    s.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per completion at most (default: generation_config.json's max_new_tokens, else 64)")
    s.add_argument("--temperature", type=float, default=None, help="0: greedy (the default without "
                                                                   "generation_config.json sampling values)")
    s.add_argument("--top-k", type=int, default=None, help="0 or -1: off")
    s.add_argument("--top-p", type=float, default=None, help="1: off")
    s.add_argument("--min-p", type=float, default=None, help="drop tokens below this times the most likely one's "
                                                             "probability; 0: off")
    s.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    s.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    s.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1: off")
    s.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    s.add_argument("--n", type=int, default=None, metavar="N",
                   help="completions per prompt (default 1; printed as they finish, not streamed)")
    s.add_argument("--stop", action="append", metavar="STR", default=[],
                   help="end a completion at this string (left out of the output); repeatable. Generation "
                        "also stops at the tokenizer's EOS ids")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's EOS ids")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per completion on stdout: index, text, "
                                                       "token_ids, finish_reason, stop_reason, prompt_tokens, "
                                                       "timings (and logprobs)")
    o.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability and the K most likely tokens' (0 to 20)")
    r = p.add_argument_group("runtime")
    r.add_argument("--max-model-len", type=int, default=None,
                   help="positions a sequence (prompt and new tokens) holds at most (default: sized for the "
                        "prompts, grown as --interactive needs)")
    r.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together at most (default 256)")
    r.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    add_model_flags(m, r)
    for old, new in RENAMED_FLAGS.items():
        kind = dict(action="store_const", const=True) if new == "--enforce-eager" else dict(type=int)
        r.add_argument(old, dest=new[2:].replace("-", "_"), help=argparse.SUPPRESS, **kind)
    for old in REMOVED_FLAGS:
        r.add_argument(old, dest="removed_flag", action="store_const", const=old, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _unicode_problem(text: str) -> Optional[str]:
    from ..api.tokenizer import unicode_error

    return unicode_error(text)


def _as_flag(problem: str) -> str:
    """A ``SamplingParams`` message ("top_k must be ...") as the flag's ("--top-k must be ...")."""
    name, _, rest = problem.strip().partition(" ")
    return f"--{name.replace('_', '-')} {rest}"


def check_args(a: argparse.Namespace) -> None:
    """Every problem with the flags alone, in one message (before any model is read)."""
    from ..engine.sampling_params import SamplingParams

    problems = []
    if a.removed_flag is not None:
        problems.append(f"{a.removed_flag} no longer means anything: {REMOVED_FLAGS[a.removed_flag]}")
    try:
        SamplingParams(**{k: getattr(a, k) for k in (*SAMPLING_FLAGS, "seed", "logprobs", "n") if getattr(a, k) is not None})
    except ValueError as e:
        problems += [_as_flag(problem) for problem in str(e).split(";")]
    if a.logprobs is not None and not a.json:
        problems.append("--logprobs needs --json (the log-probabilities have no place in plain text)")
    if a.interactive:
        if a.batch_file is not None:
            problems.append("--interactive reads the conversation from stdin: it takes no --batch-file")
        if a.n not in (None, 1):
            problems.append(f"--interactive writes one reply a turn: it takes no --n (got {a.n})")
    elif a.prompt is None and a.batch_file is None:
        problems.append("give a prompt: --prompt TEXT, --batch-file FILE or --interactive")
    elif a.prompt is not None and a.batch_file is not None:
        problems.append("give either --prompt or --batch-file, not both")
    for flag, value in (("--prompt", a.prompt), ("--system", a.system), *(("--stop", stop) for stop in a.stop)):
        problem = _unicode_problem(value) if value is not None else None
        if problem:
            problems.append(f"{flag} {problem}")
        elif flag == "--prompt" and value is not None and not value.strip():
            problems.append("the prompt is empty")
        elif flag == "--stop" and not value:
            problems.append("--stop needs a non-empty string")
    if (a.system is not None or a.no_thinking) and not (a.chat or a.interactive):
        flag = "--system" if a.system is not None else "--no-thinking"
        problems.append(f"{flag} applies to chat prompts: add --chat (or --interactive)")
    if a.max_tokens is not None and a.max_tokens < 1:
        problems.append(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.max_model_len is not None and not 2 <= a.max_model_len <= MAX_MODEL_LEN:
        problems.append(f"--max-model-len must be >= 2 and at most {MAX_MODEL_LEN} (int32 positions), "
                        f"got {a.max_model_len}")
    if a.max_num_seqs < 1:
        problems.append(f"--max-num-seqs must be >= 1, got {a.max_num_seqs}")
    if a.tensor_parallel_size < 1:
        problems.append(f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    problems += filter(None, (quantization_problem(a.quantization, a.tensor_parallel_size), device_problem(a.device)))
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


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")


def sampling_params(a: argparse.Namespace, ck):
    """The sampling flags given over the checkpoint's generation_config.json values (a note on
    stderr names those taken from it), ``--seed``, ``--max-tokens``, ``--stop``, ``--ignore-eos``
    and ``--logprobs``."""
    from dataclasses import replace

    from ..api.commands import say
    from ..api.llm import DEFAULT_MAX_TOKENS

    base = ck.default_sampling_params()
    given = {name: getattr(a, name) for name in SAMPLING_FLAGS if getattr(a, name) is not None}
    try:
        params = replace(base, **given, seed=a.seed, max_tokens=a.max_tokens or base.max_tokens or DEFAULT_MAX_TOKENS,
                         stop=tuple(a.stop), logprobs=a.logprobs, ignore_eos=a.ignore_eos, n=a.n or 1)
    except ValueError as e:
        raise UsageError("; ".join(_as_flag(problem) for problem in str(e).split(";"))) from None
    off = type(base)()
    taken = [f"{name.replace('_', '-')} {getattr(base, name):g}" for name in SAMPLING_FLAGS
             if getattr(a, name) is None and getattr(base, name) != getattr(off, name)
             and (params.mode != "greedy" or name == "repetition_penalty")]  # what greedy ignores is not taken
    if a.max_tokens is None and base.max_tokens is not None:
        taken.append(f"max-tokens {base.max_tokens}")
    if taken:
        say(f"note: from the checkpoint's generation_config.json: {', '.join(taken)} (flags override)")
    return params
