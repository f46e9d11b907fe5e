"""The data: Tiny Shakespeare split by characters, its speeches and dialogue as ChatML, the
byte-level BPE tokenizer trained on the training split, and the validation windows and batches."""

import math
from typing import List, Tuple

from .constants import DATA_LIMIT, MAX_SPEAKER, UsageError


def read_text(path: str) -> str:
    """The text of --data: a regular file (read as a checkpoint's files are, ``modeling.model.files``:
    a FIFO, a device or a directory is refused, never waited on) of at most ``DATA_LIMIT`` bytes,
    in UTF-8."""
    from ..model.files import decode_utf8, read_file

    data = read_file(path, DATA_LIMIT, lambda message: UsageError(f"--data {path}: {message}"))
    return decode_utf8(data, f"--data {path}", UsageError)


def split_text(text: str, val_fraction: float) -> Tuple[str, str]:
    """(train, validation): the validation split is the last ``round(len * val_fraction)`` characters."""
    n_val = round(len(text) * val_fraction)
    if not 0 < n_val < len(text):
        raise UsageError(f"--val-fraction {val_fraction} leaves an empty split of a {len(text)}-character text")
    return text[:-n_val], text[-n_val:]


def speeches(text: str) -> List[str]:
    """The speeches of a play's text, in order: each blank-line-separated block whose first line
    names its speaker (``NAME:``), without that line. Blocks without a speaker line (the rest of a
    speech after a blank line) and speaker lines with nothing under them are left out."""
    out = []
    for block in text.split("\n\n"):
        head, sep, body = block.strip("\n").partition("\n")
        if sep and head.endswith(":") and len(head) <= MAX_SPEAKER and body.strip():
            out.append(body)
    return out


def dialogue_chat(text: str) -> str:
    """``text``'s dialogue as ChatML (``modeling.chat.template.format_chat``): its speeches in turn a
    user and an assistant message, each speech the reply to the one before and each message ended
    by ``<|im_end|>``, as ``--chat`` and ``--interactive`` put a conversation to the model."""
    from ..chat.template import format_chat

    roles = ("user", "assistant")
    return format_chat([{"role": roles[i % 2], "content": c} for i, c in enumerate(speeches(text))],
                       add_generation_prompt=False)


def train_tokenizer(text: str, vocab_size: int):
    """``random_checkpoint.build_tokenizer`` trained on ``text`` (one document): a byte-level BPE with
    ``SPECIAL_TOKENS`` as ids 0, 1, 2 and all 256 byte symbols, so any UTF-8 text encodes."""
    from ..model.random_checkpoint import SPECIAL_TOKENS, build_tokenizer

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UsageError(f"--vocab-size {vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} specials")
    return build_tokenizer(vocab_size, [text])


def bits_per_char(nats_per_token: float, n_tokens: int, n_chars: int) -> float:
    """Bits per character of a split: nats per token * tokens in the split / characters / ln 2."""
    return nats_per_token * n_tokens / n_chars / math.log(2)


# --------------------------------------------------------------------------------------------
# validation


def eval_windows(n_tokens: int, seq_len: int) -> List[Tuple[int, int]]:
    """Windows (start, first counted position) of length min(seq_len, n_tokens) that predict every
    token of a split but the first exactly once: window starts step by seq_len - 1 (each window's
    first token is the previous one's last); the last window is moved back to end at the split's
    end and counts only the tokens after the previous window's. Position j of a window predicts
    token start + j for j >= the first counted position (>= 1)."""
    t = min(seq_len, n_tokens)
    if t < 2:
        raise ValueError(f"a split of {n_tokens} tokens has nothing to predict")
    out = []
    for s in range(0, n_tokens - 1, t - 1):
        start = min(s, n_tokens - t)
        out.append((start, s - start + 1))
    return out


def eval_batches(ids, seq_len: int, batch_size: int):
    """[(input_ids [b, T], labels [b, T] with -100 where not counted, tokens counted)] covering
    ``eval_windows``; on ids' device."""
    import torch

    windows = eval_windows(ids.numel(), seq_len)
    t = min(seq_len, ids.numel())
    ar = torch.arange(t, device=ids.device)
    batches = []
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        x = ids[torch.tensor([s for s, _ in chunk], device=ids.device)[:, None] + ar]
        first = torch.tensor([f for _, f in chunk], device=ids.device)[:, None]
        labels = torch.where(ar[None] >= first, x, torch.full_like(x, -100))
        batches.append((x, labels, sum(t - f for _, f in chunk)))
    return batches
