"""Command line: ``python -m modeling.generate --model DIR_OR_ORG/NAME --prompt "..."`` (``qwen-generate``).

Streams the completion of one prompt to stdout; with ``--batch-file`` (or ``--n`` above 1) prints
each completion on one line when it is done, ``[i] text`` (``[i.j] text`` for completion j of
prompt i with ``--n``; newlines escaped), or with ``--json`` one JSON object per completion; ``--interactive`` holds a multi-turn chat on stdin. One stats line ends on stderr.
The flags are in ``args``, what is written in ``output``, ``--interactive`` in ``interactive``.

Exit status: 0 done; 2 bad input (one line ``error: ...`` on stderr, never a traceback); 1 any
other failure; 130 interrupted (Ctrl-C, from the first instant); 141 stdout closed by the reader
(``| head``), quietly, as a process killed by SIGPIPE would. See docs/generate.md.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from ..api.commands import UsageError, command_main, load_checkpoint, load_llm, say
from .args import PIPE_CLOSED, RENAMED_FLAGS, check_args, parse_args, read_prompts, sampling_params
from .interactive import interactive
from .output import Totals, Writer, escape_line, json_output

if TYPE_CHECKING:
    import argparse


def main(argv: Optional[Sequence[str]] = None) -> int:
    if getattr(sys.stdout, "errors", None) == "strict":  # PYTHONIOENCODING=ascii: print '?' for what it cannot hold
        with contextlib.suppress(ValueError, OSError, AttributeError):
            sys.stdout.reconfigure(errors="replace")
    return command_main(argv, parse_args, RENAMED_FLAGS, check_args, run, PIPE_CLOSED)


def run(a: argparse.Namespace) -> int:
    if sys.stdout is None:
        raise UsageError("standard output is closed: there is nowhere to write the completions")
    out = Writer(sys.stdout)
    prompts_text = read_prompts(a)

    import torch

    from ..chat.template import ChatTemplateError
    from ..engine.prompts import ContextLengthError, check_ids
    from ..model.device import DoesNotFit, backend_name, resolve_device, resolve_dtype

    ck = load_checkpoint(a)
    params = sampling_params(a, ck)
    try:
        device = resolve_device(a.device)
    except ValueError as e:
        raise UsageError(f"--{e}") from None
    dtype = resolve_dtype(a.dtype, device)
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
    if not a.interactive:
        if a.chat:
            system = [{"role": "system", "content": a.system}] if a.system is not None else []
            try:
                prompts_text = [ck.chat_template.render(system + [{"role": "user", "content": p}], **template_kwargs)
                                for p in prompts_text]
            except ChatTemplateError as e:
                raise UsageError(str(e)) from None
        prompts = []
        for i, text in enumerate(prompts_text):
            try:
                ids = ck.tokenizer.encode(text)
                check_ids(ids, f"prompt {i}", ck.config.vocab_size)
            except ValueError as e:
                raise UsageError(f"prompt {i}: {e}") from None
            prompts.append({"prompt_token_ids": ids})
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        limit = a.max_model_len or ck.config.max_position_embeddings
        if longest >= limit:
            what = "--max-model-len" if a.max_model_len else "the model's max_position_embeddings"
            raise UsageError(f"a prompt of {longest} tokens leaves no room for a new token in {limit} positions "
                             f"({what})")
        if longest + params.max_tokens > limit:
            what = "--max-tokens" if a.max_tokens is not None else "max tokens (the checkpoint's or the default)"
            say(f"note: {what} cut to {limit - longest} for the longest prompt: a sequence holds {limit} positions")
    totals = Totals(device, dtype, device.type == "cuda" and not a.enforce_eager)
    llm = load_llm(ck, device, dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                   enforce_eager=a.enforce_eager, quantization=a.quantization,
                   tensor_parallel_size=a.tensor_parallel_size)
    try:
        if a.interactive:
            interactive(a, llm, params, out, totals, template_kwargs)
        elif a.batch_file is None and not a.json and params.n == 1:  # one prompt, streamed
            stream = llm.stream(prompts[0], params)
            for piece in stream:
                out.write(piece)
            out.write("\n")
            totals.add(stream.output)
        else:
            # a progress bar over the prompts when stderr is a terminal (not in logs, pipes or tests)
            for i, o in llm.iter_generate(prompts, params, use_tqdm=sys.stderr is not None and sys.stderr.isatty()):
                totals.add(o)
                for j, c in enumerate(o.outputs):
                    if a.json:
                        out.json(json_output(o, i, a.logprobs, j))
                    else:
                        out.write(f"[{i}] {escape_line(c.text)}\n" if params.n == 1 else f"[{i}.{j}] {escape_line(c.text)}\n")
    except ContextLengthError as e:
        raise UsageError(str(e)) from None
    except DoesNotFit as e:
        raise UsageError(f"the cache does not fit: {e}") from None
    finally:
        llm.close()
    say(totals.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
