"""Command line: ``python -m modeling.generate --model DIR_OR_ORG/NAME --prompt "..."`` (``qwen-generate``).

Streams the completion of one prompt to stdout; with ``--batch-file`` prints each completion on
one line when it is done, ``[i] text`` (newlines escaped), or with ``--json`` one JSON object per
completion; ``--interactive`` holds a multi-turn chat on stdin. One stats line ends on stderr.
Without ``--model`` it uses the model shipped in ``modeling/default_model`` (``modeling.api.checkpoint.default_model_dir``).

The flags are in ``args``, what is written in ``output``, the loading in ``loading``,
``--interactive`` in ``interactive``; this module runs them (``main``, ``run``).

Exit status: 0 done; 2 bad input (one line ``error: ...`` on stderr, never a traceback); 1 any
other failure (one line too); 130 interrupted (Ctrl-C, from the first instant: this module imports
nothing heavy before its handlers are in place); 141 stdout closed by the reader (``| head``),
quietly, as a process killed by SIGPIPE would. See docs/generate.md.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, Sequence

from ..common import one_line
from .args import (DTYPES, INTERRUPTED, PIPE_CLOSED, RUNTIME_ERROR, USAGE_ERROR, UsageError, check_args, parse_args,
                   read_prompts)
from .interactive import interactive
from .loading import load_checkpoint, load_llm, sampling_params
from .output import (Totals, Writer, _json_output, _kernel_launches, _silence_stdout, _tolerant_stdout, escape_line,
                     path_that_ran, say)

if TYPE_CHECKING:
    import argparse


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
        say(f"error: {type(e).__name__}: {one_line(e, typed=False)}")
        try:  # e.g. stdout on a full disk: what is still buffered would fail again at exit
            if sys.stdout is not None:
                sys.stdout.flush()
        except (OSError, ValueError):
            _silence_stdout()
        return RUNTIME_ERROR


# ----------------------------------------------------------------------------------------------
# the run


def run(a: argparse.Namespace) -> int:
    if sys.stdout is None:
        raise UsageError("standard output is closed: there is nowhere to write the completions")
    out = Writer(sys.stdout)
    prompts_text = read_prompts(a)

    from dataclasses import replace

    import torch

    from ..chat.template import ChatTemplateError
    from ..generation.prompts import ContextLengthError, check_ids, check_room
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
        try:
            check_ids(ids, f"prompt {i}", config.vocab_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        prompts.append(ids)

    longest = max(map(len, prompts))
    limit = a.max_seq_len or config.max_position_embeddings
    try:
        check_room(longest, limit, "--max-seq-len" if a.max_seq_len else "the model's max_position_embeddings")
    except ContextLengthError as e:
        raise UsageError(str(e)) from None
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


if __name__ == "__main__":
    sys.exit(main())
