"""Command line: ``python -m modeling.generate --model DIR --prompt "..."``.

Streams the completion of one prompt to stdout (or, with ``--batch-file``, prints each
completion when it is done, prefixed by its index) and ends with one stats line on stderr.
Without ``--model`` it builds (once) a small random Qwen3 checkpoint and uses that. Bad input
gets a one-line ``error: ...`` on stderr and exit status 2; other failures exit 1; no
tracebacks. See docs/generate.md.
"""

import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence

USAGE_ERROR = 2
RUNTIME_ERROR = 1
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class UsageError(Exception):
    """Bad input from the user: printed as ``error: <message>``, exit status 2."""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m modeling.generate",
        description="Generate text with a Qwen3/Qwen2 checkpoint on the torch.ops.qwen Triton kernels.",
    )
    p.add_argument("--model", help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
                                    "default: a small random Qwen3 built on first use")
    p.add_argument("--random-model-dir", help="where the random checkpoint lives without --model "
                                              "(default ~/.cache/qwen-triton-ops/random-qwen3-tiny)")
    p.add_argument("--prompt", help="the prompt text")
    p.add_argument("--batch-file", help="a file with one prompt per line (blank lines skipped); "
                                        "decoded together, each completion printed as '[i] text'")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a ChatML user turn")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and KV cache dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache positions per sequence (default: longest prompt + max new tokens)")
    p.add_argument("--max-batch-size", type=int, default=8, help="prompts decoded together (--batch-file)")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (one Python launch per op)")
    p.add_argument("--prefill-graph", action="store_true",
                   help="capture prefill in CUDA graphs per padded length bucket (pays off when reused)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    from .sampling import sampling_errors

    problems = sampling_errors(a.temperature, a.top_k, a.top_p, a.seed)
    if a.prompt is None and a.batch_file is None:
        problems.append("give a prompt: --prompt TEXT or --batch-file FILE")
    if a.prompt is not None and a.batch_file is not None:
        problems.append("give either --prompt or --batch-file, not both")
    if a.prompt is not None and not a.prompt.strip():
        problems.append("the prompt is empty")
    if a.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.max_seq_len is not None and a.max_seq_len < 2:
        problems.append(f"--max-seq-len must be >= 2, got {a.max_seq_len}")
    if a.max_batch_size < 1:
        problems.append(f"--max-batch-size must be >= 1, got {a.max_batch_size}")
    if a.device is not None and a.device.split(":")[0] not in ("cuda", "cpu"):
        problems.append(f"--device must be cuda or cpu, got {a.device!r}")
    if problems:
        raise UsageError("; ".join(problems))


def read_prompts(a: argparse.Namespace) -> List[str]:
    if a.batch_file is None:
        return [a.prompt]
    try:
        text = Path(a.batch_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --batch-file {a.batch_file!r}: {e}") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--batch-file {a.batch_file!r} holds no prompt (one per line)")
    return prompts


def model_dir(a: argparse.Namespace, notice) -> Path:
    if a.model is None:
        from .random_checkpoint import default_random_model_dir, ensure_random_checkpoint, is_complete

        path = Path(a.random_model_dir) if a.random_model_dir else default_random_model_dir()
        built = not is_complete(path)
        try:
            ensure_random_checkpoint(path)
        except OSError as e:
            raise UsageError(f"cannot write the random checkpoint to {str(path)!r}: {e}") from None
        notice(f"note: no --model given: {'built' if built else 'using'} a random tiny Qwen3 checkpoint "
               f"at {path} (its text is gibberish)")
        return path
    path = Path(a.model)
    if not path.exists():
        raise UsageError(f"--model {a.model!r}: no such directory")
    if not path.is_dir():
        raise UsageError(f"--model {a.model!r} is not a directory")
    for name in ("config.json", "tokenizer.json"):
        f = path / name
        if not f.is_file():
            raise UsageError(f"--model {a.model!r} has no {name}")
        try:
            f.open("rb").close()
        except OSError as e:
            raise UsageError(f"--model {a.model!r}: cannot read {name}: {e}") from None
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    def notice(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        a = parse_args(argv)
    except SystemExit as e:  # argparse has printed its usage message
        return USAGE_ERROR if e.code else 0
    try:
        check_args(a)
        return run(a, notice)
    except UsageError as e:
        notice(f"error: {e}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        notice("interrupted")
        return 130
    except Exception as e:  # no tracebacks for users; the message says what failed
        notice(f"error: {type(e).__name__}: {e}")
        return RUNTIME_ERROR


def run(a: argparse.Namespace, notice) -> int:
    prompts_text = read_prompts(a)
    path = model_dir(a, notice)

    import torch

    from .config import ConfigError, QwenConfig
    from .generator import Generator
    from .loader import CheckpointError
    from .model import QwenForCausalLM
    from .sampling import SamplingParams
    from .tokenizer import IncrementalDetokenizer, QwenTokenizer, format_chat

    try:
        config = QwenConfig.from_pretrained(path)
    except ConfigError as e:
        raise UsageError(f"--model {str(path)!r}: {e}") from None
    except (ValueError, KeyError, OSError) as e:
        raise UsageError(f"--model {str(path)!r}: unreadable config.json ({type(e).__name__}: {e})") from None
    try:
        tokenizer = QwenTokenizer.from_pretrained(path)
    except Exception as e:
        raise UsageError(f"--model {str(path)!r}: cannot load the tokenizer ({e})") from None

    if a.chat:
        prompts_text = [format_chat([{"role": "user", "content": p}]) for p in prompts_text]
    prompts = [tokenizer.encode(p) for p in prompts_text]
    for i, ids in enumerate(prompts):
        if not ids:
            raise UsageError(f"prompt {i} is empty after tokenization")
        bad = [t for t in ids if t >= config.vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the model's vocabulary ({config.vocab_size})")
    longest = max(map(len, prompts))
    limit = a.max_seq_len or config.max_position_embeddings
    if longest >= limit:
        what = "--max-seq-len" if a.max_seq_len else "the model's max_position_embeddings"
        raise UsageError(f"the prompt has {longest} tokens; the cache holds {limit} ({what}): "
                         "no room for a new token")
    max_new = a.max_new_tokens
    if longest + max_new > limit:
        max_new = limit - longest
        notice(f"note: --max-new-tokens lowered to {max_new} to fit the cache of {limit} positions")
    max_seq_len = a.max_seq_len or longest + max_new

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    if device.type == "cpu":
        notice("note: no CUDA device: running eagerly on the CPU (PyTorch reference ops), slowly")
    dtype = getattr(torch, DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")])
    try:
        model = QwenForCausalLM.from_pretrained(path, device=device, dtype=dtype)
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--model {str(path)!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"--model {str(path)!r}: cannot read the weights ({e})") from None

    batch = min(a.max_batch_size, len(prompts))
    gen = Generator(model, max_batch_size=batch, max_seq_len=max_seq_len,
                    use_cuda_graph=not a.no_cuda_graph, prefill_graph=a.prefill_graph)
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
    out = sys.stdout

    if a.batch_file is None:
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)

        def on_token(_, token):
            text = detok.push(token)
            if text:
                out.write(text)
                out.flush()

        def on_finish(_, tokens, reason):
            out.write(detok.flush() + "\n")
            out.flush()
    else:
        on_token = None

        def on_finish(i, tokens, reason):
            out.write(f"[{i}] {tokenizer.decode(tokens, skip_special_tokens=True)}\n")
            out.flush()

    r = gen.generate(prompts, max_new, sampling, tokenizer.eos_token_ids, on_token, on_finish)
    seconds = (r.prefill_ms + r.decode_ms) / 1e3
    notice(f"prompt tokens {r.prompt_tokens} | prefill {r.prefill_ms:.1f} ms | "
           f"decode {r.decode_ms_per_step:.2f} ms/token ({r.decode_steps} steps) | "
           f"{r.generated_tokens} new tokens, {r.generated_tokens / seconds if seconds else math.nan:.1f} tokens/s | "
           f"cuda graph: {'yes' if r.cuda_graph else 'no'} | {device.type} {str(dtype).replace('torch.', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
