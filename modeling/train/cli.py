"""The command line ``python -m modeling.train``: flags, their checks, the output directory and its
lock (``OutLock``), the signals that stop a run (``StopSignals``), progress, ``main``."""

import argparse
import contextlib
import fcntl
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .constants import DATA_FILE, LOCK_FILE, LOG_FILE, MODEL_FILES, PER_INVOCATION, PLOT_FILE, PRESETS, RESUME_OVERRIDES, STATE_FILE, STOP_SIGNALS, UsageError
from .files import read_state
from .model_init import take_init_settings
from .plot import plot
from .trainer import Trainer


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m modeling.train", allow_abbrev=False,
        description="Train the default model (a small Qwen3 on Tiny Shakespeare) on the torch.ops.qwen kernels.",
    )
    p.add_argument("--out", help="output directory: the best checkpoint (Hugging Face layout), "
                                 "training_log.json, loss_curve.png, resume_state.pt")
    p.add_argument("--plot", metavar="DIR", help="only write DIR/loss_curve.png from DIR/training_log.json")
    p.add_argument("--resume", action="store_true", help="continue from the resume state of --out (or --state)")
    p.add_argument("--state", help=f"resume state file (default OUT/{STATE_FILE}); 'none': do not write one")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="default sizes: 'default' the shipped model, 'tiny' a CPU smoke run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="weights and compute (default bf16 on CUDA with fp32 master weights, fp32 on CPU)")
    p.add_argument("--save-dtype", choices=("bf16", "fp32"), default="bf16", help="model.safetensors dtype")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data", default=str(DATA_FILE), help="a UTF-8 text file (default: Tiny Shakespeare)")
    g.add_argument("--max-chars", type=int, help="use only the first N characters of --data (smoke runs)")
    g.add_argument("--val-fraction", type=float, default=0.1, help="the last fraction of characters: validation")
    g.add_argument("--chat-fraction", type=float, default=0.0,
                   help="the fraction of each batch's sequences cropped from the training split's dialogue "
                        "as ChatML (each speech a user or assistant turn, the reply to the one before)")
    g.add_argument("--vocab-size", type=int, help="BPE vocabulary, special tokens and 256 bytes included")
    g = p.add_argument_group("model")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--heads", type=int, help="query heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    g.add_argument("--head-dim", type=int, help="a multiple of 16, at most 256")
    g.add_argument("--intermediate-size", type=int)
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g.add_argument("--init-std", type=float, default=0.02)
    g.add_argument("--init", metavar="DIR", help="start from the weights and tokenizer of DIR (a checkpoint this "
                                                 "trainer wrote); the model's settings come from DIR/config.json")
    g = p.add_argument_group("optimisation")
    g.add_argument("--seq-len", type=int, help="tokens per training sequence (also max_position_embeddings)")
    g.add_argument("--batch-size", type=int, help="sequences per step")
    g.add_argument("--epochs", type=float, help="training length in passes over the training tokens")
    g.add_argument("--steps", type=int, help="training length in steps (overrides --epochs)")
    g.add_argument("--max-minutes", type=float, help="wall-time budget of the training loop (the cosine follows it)")
    g.add_argument("--stop-at", type=int, help="stop this invocation at this step, schedule unchanged "
                                               "(continue with --resume)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--weight-decay", type=float, default=0.1, help="on matrices and the embedding, not on norms")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.99)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--dropout", type=float, default=0.2, help="on the embedding and each MLP output (0: off)")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", type=int, help="steps between validations")
    g.add_argument("--eval-batch-size", type=int, default=32, help="windows per validation batch")
    g.add_argument("--train-eval-tokens", type=int, help="also evaluate the first N training tokens without "
                                                          "dropout (default: as many as the validation split; 0: off)")
    g.add_argument("--patience", type=int, default=0, help="stop after this many validations without a new best (0: never)")
    g.add_argument("--log-every", type=int, help="steps between training-loss points (one host sync each)")
    g.add_argument("--state-every", type=int, default=1000, help="steps between resume-state saves (0: only at the end)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-plot", dest="plot_after", action="store_false", help="do not write loss_curve.png at the end")
    pre, _ = p.parse_known_args(argv)
    p.set_defaults(**PRESETS[pre.preset])
    a = p.parse_args(argv)
    a.given = {k for k in vars(a) if _was_given(argv, k)}
    _epochs_over_preset_steps(a)
    return a


def _epochs_over_preset_steps(a: argparse.Namespace) -> None:
    """--epochs given without --steps sets the length, over a preset's (or a resumed run's) steps."""
    if "epochs" in a.given and "steps" not in a.given:
        a.steps = None


def _was_given(argv: Optional[Sequence[str]], dest: str) -> bool:
    flags = {"progress": "--no-progress", "plot_after": "--no-plot"}
    flag = flags.get(dest, _flag(dest))
    return any(x == flag or x.startswith(flag + "=") for x in (sys.argv[1:] if argv is None else argv))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _same_setting(dest: str, given: Any, saved: Any) -> bool:
    """Whether a setting given again on --resume is the saved one (paths compared resolved)."""
    if dest in ("data", "init") and given is not None and saved is not None:
        return Path(given).resolve() == Path(saved).resolve()
    return given == saved


def check_args(a: argparse.Namespace) -> None:
    problems = []
    if a.plot is None and a.out is None:
        problems.append("give --out DIR (or --plot DIR)")
    for name in ("out", "state", "data", "init", "plot"):
        if getattr(a, name) == "":
            problems.append(f"--{name} needs a path, got ''")
    if a.device is not None and a.device.split(":")[0] not in ("cuda", "cpu"):
        problems.append(f"--device must be cuda or cpu, got {a.device!r}")
    for name in ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size",
                 "seq_len", "batch_size", "eval_every", "log_every", "eval_batch_size"):
        if getattr(a, name) is None or getattr(a, name) < 1:
            problems.append(f"{_flag(name)} must be >= 1")
    if a.steps is None and (a.epochs is None or not 0 < a.epochs < math.inf):
        problems.append("give --steps N or --epochs E > 0 (finite)")
    if a.steps is not None and a.steps < 1:
        problems.append("--steps must be >= 1")
    if a.max_minutes is not None and not 0 < a.max_minutes < math.inf:
        problems.append("--max-minutes must be a finite number > 0")
    for name, low, inclusive in (("lr", 0.0, False), ("min_lr", 0.0, True), ("weight_decay", 0.0, True),
                                 ("grad_clip", 0.0, False), ("init_std", 0.0, False), ("rope_theta", 0.0, False)):
        value = getattr(a, name)
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            problems.append(f"{_flag(name)} must be a finite number {'>=' if inclusive else '>'} {low:g}, "
                            f"got {value}")
    for name, interval in (("beta1", "[0, 1)"), ("beta2", "[0, 1)"), ("dropout", "[0, 1)"), ("val_fraction", "(0, 1)"),
                           ("chat_fraction", "[0, 1]")):
        value = getattr(a, name)
        above = 0 <= value if interval[0] == "[" else 0 < value  # "[" and "]" include the bound
        if not (above and (value <= 1 if interval[-1] == "]" else value < 1)):
            problems.append(f"{_flag(name)} must be in {interval}, got {value}")
    if 0 < a.chat_fraction <= 1 and a.batch_size and round(a.batch_size * a.chat_fraction) < 1:
        problems.append(f"--chat-fraction {a.chat_fraction:g} of --batch-size {a.batch_size} is no sequence")
    if a.seq_len is not None and a.seq_len < 2:
        problems.append("--seq-len must be >= 2")
    for name, low in (("stop_at", 1), ("max_chars", 1), ("warmup_steps", 0), ("patience", 0), ("state_every", 0),
                      ("train_eval_tokens", 0)):
        if getattr(a, name) is not None and getattr(a, name) < low:
            problems.append(f"{_flag(name)} must be >= {low}, got {getattr(a, name)}")
    if problems:
        raise UsageError("; ".join(problems))


def prepare(a: argparse.Namespace, created: Optional[List[Path]] = None) -> Tuple[Path, Path, "OutLock"]:
    """Create --out (and --state's folder; the folders made are appended to ``created``), take OUT's
    lock, check that a fresh run finds no run there and that --resume finds one, and merge a resume
    state's settings into ``a``; (out, state path, the lock, which the caller releases)."""
    out = Path(a.out)
    state_path = Path(a.state) if a.state not in (None, "none") else out / STATE_FILE
    if a.resume and not out.is_dir():
        raise UsageError(f"--resume: --out {out} is not a directory")
    if a.state not in (None, "none") and os.path.lexists(state_path) and not state_path.is_file():
        raise UsageError(f"--state {state_path}: exists and is not a regular file (name a file: a new one, or a "
                         "resume state to continue)")
    _make_dir(out, "--out", created)
    if a.state not in (None, "none"):
        _make_dir(state_path.parent, "--state", created)
    lock = OutLock(out)
    try:
        if a.resume:
            if a.state == "none":
                raise UsageError("--resume needs a resume state: drop --state none")
            if not os.path.lexists(state_path):
                raise UsageError(f"--resume: no resume state at {state_path}")
            saved = read_state(state_path)["args"]
            fixed = [k for k in sorted(a.given) if k in saved and k not in RESUME_OVERRIDES and k not in PER_INVOCATION
                     and not _same_setting(k, getattr(a, k), saved[k])]
            if fixed:
                raise UsageError(f"--resume continues the saved run's settings: {', '.join(_flag(k) for k in fixed)} "
                                 f"cannot change (of the run's settings only "
                                 f"{', '.join(_flag(k) for k in RESUME_OVERRIDES)} may be given again)")
            for k, v in saved.items():
                if k not in PER_INVOCATION and not (k in RESUME_OVERRIDES and k in a.given):
                    setattr(a, k, v)
            _epochs_over_preset_steps(a)
            missing = [f for f in ("tokenizer.json", "config.json") if not (out / f).is_file()]
            if missing:
                raise UsageError(f"--resume: {out} has no {', '.join(missing)}")
        else:
            ours = [f for f in (*MODEL_FILES, LOG_FILE, STATE_FILE) if (out / f).exists()]
            if ours or (a.state not in (None, "none") and state_path.exists()):
                raise UsageError(f"{out} already holds a training run ({', '.join(ours) or state_path.name}): "
                                 "continue it with --resume, or choose a new --out")
            if a.init:
                take_init_settings(a)
    except BaseException:
        lock.release()
        raise
    return out, state_path, lock


def _make_dir(path: Path, flag: str, created: Optional[List[Path]] = None) -> None:
    """``path`` as a directory (created with its parents if missing, each appended to ``created``);
    UsageError naming ``flag`` where it cannot be one."""
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    finally:
        if created is not None:
            created += [p for p in missing if os.path.isdir(p)]


class OutLock:
    """An exclusive ``fcntl.flock`` on ``OUT/.train.lock`` (holding the holder's pid), taken without
    waiting: UsageError when another process holds it. ``release`` removes the file and unlocks."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise UsageError(f"--out {out}: cannot create {self.path.name} ({e.strerror or e})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UsageError(f"--out {out} is being written by another training run (pid {holder}, which holds "
                                 f"{self.path}): wait for it to end, or choose another --out") from None
            try:  # the file may have been removed by a holder that let go before our flock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        """Remove the lock file, then unlock (in that order: a waiter that took the old file's lock
        sees it gone and opens a new one)."""
        if self.fd is None:
            return
        os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


class StopSignals:
    """While entered, SIGTERM and SIGINT only record the first signal's number in ``signum``; the
    training loop reads it between steps. The previous handlers come back on exit."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.previous: Dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopSignals":
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    def notice(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        a = parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    created: List[Path] = []  # the folders this invocation made (removed again if it is refused)
    try:
        check_args(a)
        if a.plot is not None:
            notice(f"wrote {plot(Path(a.plot))}")
            return 0
        import torch

        a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        with StopSignals() as stop:  # `timeout`, `kill`, Ctrl-C: finish the step, save, then stop
            out, state_path, lock = prepare(a, created)  # on --resume: the saved device unless --device is given
            try:
                if a.device.startswith("cuda") and not torch.cuda.is_available():
                    raise UsageError(f"--device {a.device}: no CUDA device is available")
                a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
                if Trainer(a, out, state_path, notice, stop).run() == "interrupted":
                    return 128 + stop.signum
                if a.plot_after:
                    try:
                        notice(f"wrote {plot(out)}")
                    except UsageError as e:
                        notice(f"note: no {PLOT_FILE}: {e}; run `python -m modeling.train --plot {out}` where it is")
            finally:
                lock.release()
        return 0
    except UsageError as e:
        for folder in reversed(created):  # deepest first, each still empty: a refused run leaves nothing behind
            with contextlib.suppress(OSError):  # something was written in it
                folder.rmdir()
        notice(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        notice("interrupted")
        return 130
