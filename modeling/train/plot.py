"""``loss_curve.png`` from ``training_log.json`` (``--plot DIR``, and at the end of a run)."""

import json
from pathlib import Path

from .constants import LOG_FILE, PLOT_FILE, UsageError


def plot(path: Path) -> Path:
    """``path/loss_curve.png`` from ``path/training_log.json``: the training loss (with dropout,
    mean per log interval), the training loss in eval mode and the validation loss, in nats per
    token, and the validation bits per character, against steps."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_file = path / LOG_FILE
    try:
        log = json.loads(log_file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {log_file}: {e}") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    tr, va = log.get("train", []), log.get("val", [])
    dropout = log.get("settings", {}).get("dropout", 0)
    if tr:
        ax1.plot([p["step"] for p in tr], [p["loss"] for p in tr], lw=0.8, alpha=0.6,
                 label=f"train batches (dropout {dropout:g})" if dropout else "train batches")
    if va:
        steps = [p["step"] for p in va]
        if all(p.get("train_loss_eval") is not None for p in va):
            ax1.plot(steps, [p["train_loss_eval"] for p in va], label="train (eval mode)")
        ax1.plot(steps, [p["val_loss"] for p in va], label="validation")
        if all(p.get("val_chat_loss") is not None for p in va):
            ax1.plot(steps, [p["val_chat_loss"] for p in va], label="validation dialogue (ChatML)")
        ax2.plot(steps, [p["val_bits_per_char"] for p in va], color="C2", label="validation")
    best = log.get("best") or {}
    if best.get("val_bits_per_char") is not None:
        ax2.scatter([best["step"]], [best["val_bits_per_char"]], color="C3", zorder=3,
                    label=f"best: {best['val_bits_per_char']:.3f} at step {best['step']}")
        lo = min(p["val_bits_per_char"] for p in va)
        ax2.set_ylim(lo - 0.1, min(max(p["val_bits_per_char"] for p in va), lo + 1.5))
    ax1.set(xlabel="step", ylabel="loss (nats / token)", title="loss")
    ax2.set(xlabel="step", ylabel="bits / character", title="validation bits per character")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    m = log.get("model", {})
    fig.suptitle(f"{m.get('parameters', 0) / 1e6:.2f}M-parameter Qwen3 on Tiny Shakespeare, vocab "
                 f"{m.get('vocab_size', '?')}: {log.get('steps', '?')} steps, {log.get('wall_time_s', 0):.0f} s "
                 f"on {log.get('device', '?')}")
    fig.tight_layout()
    out = path / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
