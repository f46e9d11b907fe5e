"""The training loop (``Trainer``: steps, validation, saves, resume) and its schedule (``lr_at``),
the validation loss (``Evaluator``); the package doc (``modeling.train``) describes the recipe."""

import argparse
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..common import one_line
from .constants import GENERATION_DEFAULTS, LOG_FILE, STATE_VERSION, UsageError
from .data import bits_per_char, dialogue_chat, eval_batches, read_text, split_text, train_tokenizer
from .files import _fsync_files, _minutes, _rate, _read_tokenizer, _replace_file, _versions, _write_json, read_state
from .model_init import attach_dropout, build_model, count_parameters, hf_tensors, load_init_weights, model_config_dict

if TYPE_CHECKING:
    from .cli import StopSignals

class Evaluator:
    """The mean next-token loss over a whole split (``eval_batches``) and its bits per character."""

    def __init__(self, ids, n_chars: int, seq_len: int, batch_size: int):
        self.n_tokens, self.n_chars = ids.numel(), n_chars
        self.batches = eval_batches(ids, seq_len, batch_size)
        self.n_predicted = sum(n for _, _, n in self.batches)

    def __call__(self, model) -> Tuple[float, float]:
        """(nats per token, bits per character); the model is put in eval mode and restored."""
        import torch

        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.batches[0][0].device)
        with torch.no_grad():
            for x, labels, n in self.batches:
                total += model.loss(x, labels=labels).double() * n
        model.train(was_training)
        nats = total.item() / self.n_predicted
        return nats, bits_per_char(nats, self.n_tokens, self.n_chars)


# --------------------------------------------------------------------------------------------
# training


def lr_at(a: argparse.Namespace, step: int, max_steps: int, elapsed_s: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr``; progress is the
    step fraction, or the elapsed fraction of ``max_minutes`` when that is further along."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    progress = (step - a.warmup_steps) / max(1, max_steps - a.warmup_steps)
    if a.max_minutes:
        progress = max(progress, elapsed_s / (60.0 * a.max_minutes))
    progress = min(1.0, progress)
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """One invocation of a training run into ``out``: a fresh run (tokenizer and config.json
    written here) or, with ``a.resume``, the run of the resume state at ``state_path``.
    ``stop.signum`` (set by ``StopSignals``) ends the loop at the next step boundary."""

    def __init__(self, a: argparse.Namespace, out: Path, state_path: Path, notice, stop: "StopSignals"):
        import torch

        from ..model.config import ConfigError, QwenConfig
        from ..model.device import DTYPES

        self.a, self.out, self.state_path, self.notice, self.stop = a, out, state_path, notice, stop
        self.device = torch.device(a.device)
        self.dtype, self.save_dtype = DTYPES[a.dtype], DTYPES[a.save_dtype]
        torch.manual_seed(a.seed)

        text = read_text(a.data)[:a.max_chars]
        train_text, val_text = split_text(text, a.val_fraction)
        if a.resume or a.init:
            tok = _read_tokenizer(out if a.resume else Path(a.init))
        else:
            tok = train_tokenizer(train_text, a.vocab_size)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        cfg = model_config_dict(a, vocab)
        try:
            self.config = QwenConfig.from_dict(cfg)
        except ConfigError as e:  # a flag combination the model does not take (--head-dim 24, --heads 3 --kv-heads 2)
            raise UsageError(f"the model flags make no valid model: {e}") from None

        def encode(s):
            return torch.tensor(tok.encode(s, add_special_tokens=False).ids, dtype=torch.long, device=self.device)

        self.train_ids, val_ids = encode(train_text), encode(val_text)
        if self.train_ids.numel() <= a.seq_len:
            raise UsageError(f"the training split has {self.train_ids.numel()} tokens, fewer than --seq-len + 1")
        self.val = Evaluator(val_ids, len(val_text), a.seq_len, a.eval_batch_size)
        self.chat_rows = round(a.batch_size * a.chat_fraction)
        self.chat_ids = self.val_chat = None
        if self.chat_rows:
            val_chat = dialogue_chat(val_text)
            self.chat_ids, val_chat_ids = encode(dialogue_chat(train_text)), encode(val_chat)
            if min(self.chat_ids.numel(), val_chat_ids.numel()) <= a.seq_len:
                raise UsageError(f"--chat-fraction: the dialogue of {a.data} is too short for --seq-len {a.seq_len}")
            self.val_chat = Evaluator(val_chat_ids, len(val_chat), a.seq_len, a.eval_batch_size)
        # the training loss in eval mode (no dropout) on the first tokens of the training split
        n = min(val_ids.numel() if a.train_eval_tokens is None else a.train_eval_tokens, self.train_ids.numel())
        self.train_eval = Evaluator(self.train_ids[:n], len(tok.decode(self.train_ids[:n].tolist())),
                                    a.seq_len, a.eval_batch_size) if n >= 2 else None
        self.tokens_per_step = a.batch_size * a.seq_len
        self.max_steps = a.steps or math.ceil(a.epochs * self.train_ids.numel() / self.tokens_per_step)

        cpu_model = build_model(self.config, a.seed, a.init_std)
        if a.init and not a.resume:
            load_init_weights(cpu_model, a.init)
        self.n_params = count_parameters(cpu_model)
        self.names = [name for name, _ in cpu_model.named_parameters()]
        fp32_params = [p.detach().clone() for p in cpu_model.parameters()]  # the init, before any bf16 rounding
        self.model = cpu_model.to(device=self.device, dtype=self.dtype).requires_grad_(True).train()
        self.params = list(self.model.parameters())
        if self.dtype == torch.float32:
            self.master = self.params
        else:  # fp32 master weights and gradients; the model keeps a bf16 copy
            self.master = [p.detach().to(self.device, torch.float32).clone().requires_grad_(True)
                           for p in fp32_params]
            for m in self.master:
                m.grad = torch.zeros_like(m)
        if a.dropout > 0:
            attach_dropout(self.model, a.dropout)
        decay = [m for m in self.master if m.ndim >= 2]
        no_decay = [m for m in self.master if m.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, fused=self.device.type == "cuda")
        self.data_gen = torch.Generator(device=self.device).manual_seed(a.seed + 1)
        self.offsets = torch.arange(a.seq_len, device=self.device)

        self.step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.best_val, self.best_step, self.evals_since_best = math.inf, -1, 0
        self.best_weights: Optional[List] = None
        self.log: Dict[str, Any] = {
            "settings": _training_args(a),
            "model": {"parameters": self.n_params, "vocab_size": vocab, "config": cfg},
            "data": {"file": Path(a.data).name, "chars_used": len(text), "train_chars": len(train_text), "val_chars": len(val_text),
                     "train_tokens": self.train_ids.numel(), "val_tokens": val_ids.numel(),
                     "train_eval_tokens": n, "chat_rows": self.chat_rows,
                     "chat_train_tokens": self.chat_ids.numel() if self.chat_rows else None,
                     "chat_val_tokens": self.val_chat.n_tokens if self.chat_rows else None},
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "versions": _versions(),
            "train": [], "val": [], "runs": [],
        }
        if a.resume:
            self._load_state()
        else:  # written once the settings have passed every check, before the first save
            from ..chat.template import CHATML_TEMPLATE
            from ..model.random_checkpoint import write_tokenizer_files

            write_tokenizer_files(out, tok, a.seq_len, {"chat_template": CHATML_TEMPLATE}, GENERATION_DEFAULTS)
            _fsync_files(out, ("tokenizer.json", "tokenizer_config.json", "generation_config.json"))
            _write_json(out / "config.json", cfg)

    # ----- one step

    def batch(self):
        """The step's sequences: random crops of the training tokens, then ``chat_rows`` crops of the
        training split's dialogue as ChatML (``--chat-fraction``)."""
        import torch
        rows = [self._crops(self.train_ids, self.a.batch_size - self.chat_rows)]
        if self.chat_rows:
            rows.append(self._crops(self.chat_ids, self.chat_rows))
        return torch.cat(rows)

    def _crops(self, ids, n: int):
        """``n`` random windows of ``--seq-len`` tokens of ``ids`` (starts from the data generator)."""
        import torch
        starts = torch.randint(0, ids.numel() - self.a.seq_len + 1, (n, 1), generator=self.data_gen, device=self.device)
        return ids[starts + self.offsets]

    def train_step(self, lr: float):
        import torch
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss = self.model.loss(self.batch())
        loss.backward()
        with torch.no_grad():
            if self.master is not self.params:
                torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
            grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.a.grad_clip, foreach=True)
            self.opt.step()
            if self.master is not self.params:
                torch._foreach_copy_(self.params, self.master)
        for p in self.params:
            p.grad = None
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return loss.detach(), grad_norm.detach()

    # ----- evaluation, best checkpoint

    def evaluate(self, elapsed_s: float) -> Tuple[float, float]:
        """Validation (and the training split in eval mode) at this step, logged; a new best (the
        lowest validation loss, or with --chat-fraction f the lowest (1 - f) * validation loss + f *
        the loss on the validation split's dialogue as ChatML) keeps a copy of the weights.
        Returns (validation loss, bits per character)."""
        val_loss, val_bpc = self.val(self.model)
        chat_loss = self.val_chat(self.model)[0] if self.val_chat is not None else None
        train_loss = self.train_eval(self.model)[0] if self.train_eval is not None else None
        self.log["val"].append({"step": self.step, "tokens": self.tokens_seen, "time_s": round(elapsed_s, 2),
                                "val_loss": val_loss, "val_bits_per_char": val_bpc, "val_chat_loss": chat_loss,
                                "train_loss_eval": train_loss})
        f = self.chat_rows / self.a.batch_size
        score = val_loss if chat_loss is None else (1 - f) * val_loss + f * chat_loss
        if score < self.best_val:
            self.best_val, self.best_step, self.evals_since_best = score, self.step, 0
            self.best_weights = [m.detach().to(self.save_dtype, copy=True) for m in self.master]
        else:
            self.evals_since_best += 1
        return val_loss, val_bpc

    # ----- files

    def write_model(self) -> None:
        """model.safetensors from the best weights (nothing before the first validation)."""
        from safetensors.torch import save

        if self.best_weights is None:
            return
        tensors = hf_tensors(dict(zip(self.names, self.best_weights)), self.config, self.save_dtype)
        data = save(tensors, metadata={"format": "pt"})
        _replace_file(self.out / "model.safetensors", lambda f: f.write(data))

    def write_log(self, elapsed_s: float, stopped: str) -> None:
        best = next((v for v in self.log["val"] if v["step"] == self.best_step), None)
        self.log["runs"][-1].update(end_step=self.step, wall_time_s=round(elapsed_s - self.elapsed_before, 2))
        self.log.update(
            steps=self.step, max_steps=self.max_steps, tokens_seen=self.tokens_seen,
            epochs_seen=self.tokens_seen / self.train_ids.numel(), wall_time_s=round(elapsed_s, 2),
            tokens_per_s=round(self.tokens_seen / elapsed_s, 1) if elapsed_s > 0 else None, stopped=stopped,
            best={"step": self.best_step, **{k: best[k] if best else None
                                             for k in ("val_loss", "val_bits_per_char", "val_chat_loss")}},
        )
        _write_json(self.out / LOG_FILE, self.log)

    def save_state(self, elapsed_s: float) -> None:
        """The resume state: everything the run needs to continue, and the best weights and the log
        that model.safetensors and training_log.json are written from."""
        import torch
        state = {
            "version": STATE_VERSION, "args": _training_args(self.a), "step": self.step,
            "tokens_seen": self.tokens_seen, "elapsed_s": elapsed_s,
            "weights": {n: m.detach().float().cpu() for n, m in zip(self.names, self.master)},
            "optimizer": self.opt.state_dict(),
            "best": {"val_loss": self.best_val, "step": self.best_step, "evals_since_best": self.evals_since_best},
            "best_weights": None if self.best_weights is None else
            {n: w.cpu() for n, w in zip(self.names, self.best_weights)},
            "rng": {"cpu": torch.get_rng_state(), "data": self.data_gen.get_state(),
                    "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None},
            "log": self.log,
        }
        _replace_file(self.state_path, lambda f: torch.save(state, f))

    def _load_state(self) -> None:
        import torch
        try:
            state = read_state(self.state_path)
            with torch.no_grad():
                for n, m, p in zip(self.names, self.master, self.params):
                    m.copy_(state["weights"][n])
                    if p is not m:
                        p.copy_(m)
            self.opt.load_state_dict(state["optimizer"])
            self.step, self.tokens_seen, self.elapsed_before = state["step"], state["tokens_seen"], state["elapsed_s"]
            b = state["best"]
            self.best_val, self.best_step, self.evals_since_best = b["val_loss"], b["step"], b["evals_since_best"]
            if state["best_weights"] is not None:
                self.best_weights = [state["best_weights"][n] for n in self.names]
            torch.set_rng_state(state["rng"]["cpu"])
            self.data_gen.set_state(state["rng"]["data"])
            if state["rng"]["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
            self.log = dict(state["log"], settings=self.log["settings"])  # overrides given on this command line
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:  # a state whose parts do not fit
            raise UsageError(f"--resume: {self.state_path} does not hold a state of this run "
                             f"({one_line(e, limit=200)})") from None

    # ----- the loop

    def run(self) -> str:
        """Train until the schedule, ``--stop-at``, the time budget, patience or an interrupt stops
        the run, then save; returns why it stopped (the log's ``stopped``). This invocation's
        starting point is saved first, so the directory can be resumed from the start on. Progress:
        a tqdm bar on stderr (steps, elapsed, and a postfix with loss, tokens/s and ETA)."""
        import torch
        from tqdm import tqdm

        a = self.a
        start = time.perf_counter()

        def elapsed() -> float:
            return self.elapsed_before + time.perf_counter() - start

        first_step = self.step
        self.log["runs"].append({"start_step": first_step, "device": self.log["device"]})
        self.notice(f"model: {self.n_params / 1e6:.2f}M parameters ({self.config.num_hidden_layers} layers, hidden "
                    f"{self.config.hidden_size}, vocab {self.config.vocab_size}); train {self.train_ids.numel()} tokens, "
                    f"val {self.val.n_tokens} tokens / {self.val.n_chars} chars; {self.max_steps} steps of "
                    f"{self.tokens_per_step} tokens" + (f", at most {a.max_minutes:g} min" if a.max_minutes else "")
                    + f"; {self.device.type} {a.dtype}")
        self._flush(elapsed(), "running")
        bar = tqdm(total=self.max_steps, initial=self.step, disable=not a.progress, dynamic_ncols=True, mininterval=1.0,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]", file=sys.stderr)
        if not self.log["val"] and self.stop.signum is None:  # a fresh run, or one stopped before this
            self._eval_and_report(elapsed(), bar)
        stop_at = min(self.max_steps, a.stop_at) if a.stop_at else self.max_steps
        loss_sum = torch.zeros((), device=self.device)
        window_steps, window_start, last_state_step = 0, time.perf_counter(), self.step
        last_eval_step = self.log["val"][-1]["step"] if self.log["val"] else None
        while True:
            stopped = self._stop_reason(stop_at, elapsed())
            if stopped is not None:
                break
            lr = lr_at(a, self.step, self.max_steps, elapsed())
            loss, grad_norm = self.train_step(lr)
            loss_sum += loss
            window_steps += 1
            if self.step % a.log_every == 0 or self.step == stop_at:
                mean_loss = loss_sum.item() / window_steps  # the one host sync per log interval
                now = time.perf_counter()
                tok_s = window_steps * self.tokens_per_step / max(now - window_start, 1e-9)
                self.log["train"].append({"step": self.step, "tokens": self.tokens_seen,
                                          "time_s": round(elapsed(), 2), "loss": mean_loss, "lr": lr,
                                          "grad_norm": grad_norm.item(), "tokens_per_s": round(tok_s, 1)})
                loss_sum.zero_()
                window_steps, window_start = 0, now
                done = self.step - first_step
                eta = (self.max_steps - self.step) * (elapsed() - self.elapsed_before) / max(done, 1)
                if a.max_minutes:
                    eta = min(eta, 60.0 * a.max_minutes - elapsed())
                bar.set_postfix_str(f"loss {mean_loss:.3f}, {_rate(tok_s)} tok/s, lr {lr:.1e}, "
                                    f"best val {self.best_val:.3f}, eta {_minutes(max(eta, 0.0))}", refresh=False)
                bar.update(self.step - bar.n)
            if self.step % a.eval_every == 0:
                self._eval_and_report(elapsed(), bar)
                last_eval_step = self.step
                if window_steps == 0:  # keep evaluation out of the next tokens/s window
                    window_start = time.perf_counter()
                if a.patience and self.evals_since_best >= a.patience:
                    stopped = "patience"
                    break
            if a.state_every and self.step - last_state_step >= a.state_every:
                self._flush(elapsed(), "running")
                last_state_step = self.step
        if stopped != "interrupted" and self.step != last_eval_step:
            self._eval_and_report(elapsed(), bar)
        bar.update(self.step - bar.n)
        bar.close()
        self._flush(elapsed(), stopped)
        if stopped == "interrupted":
            self.notice(f"interrupted by {signal.Signals(self.stop.signum).name} at step {self.step}: wrote the best "
                        f"checkpoint and the resume state; continue with --resume")
            return stopped
        best = self.log["best"]
        self.notice(f"done ({stopped}): {self.step} steps, {elapsed():.0f} s, {self.tokens_seen / 1e6:.1f}M tokens "
                    f"({self.log['epochs_seen']:.1f} epochs); best val loss {best['val_loss']:.4f} = "
                    f"{best['val_bits_per_char']:.3f} bits/char at step {best['step']}; wrote {self.out}")
        return stopped

    def _stop_reason(self, stop_at: int, elapsed_s: float) -> Optional[str]:
        """Why the loop stops before the next step (None: it goes on). The last step done wins over
        an interrupt, which wins over the time budget."""
        if self.step >= stop_at:
            return "steps" if self.step >= self.max_steps else "stop_at"
        if self.stop.signum is not None:
            return "interrupted"
        if self.a.max_minutes and elapsed_s >= 60.0 * self.a.max_minutes:
            return "time"
        return None

    def _eval_and_report(self, elapsed_s: float, bar) -> None:
        val_loss, val_bpc = self.evaluate(elapsed_s)
        train_loss, chat_loss = self.log["val"][-1]["train_loss_eval"], self.log["val"][-1]["val_chat_loss"]
        bar.write(f"step {self.step}: val loss {val_loss:.4f}, {val_bpc:.3f} bits/char"
                  + (f", val dialogue loss {chat_loss:.4f}" if chat_loss is not None else "")
                  + (f", train loss (eval mode) {train_loss:.4f}" if train_loss is not None else "")
                  + (" (best)" if self.best_step == self.step else ""), file=sys.stderr)

    def _flush(self, elapsed_s: float, stopped: str) -> None:
        """Save the run: model.safetensors and training_log.json, then the resume state, which is
        the record of the save (``--resume`` rewrites the first two from it, so a save cut short
        leaves the previous one in force)."""
        self.write_model()
        self.write_log(elapsed_s, stopped)
        if self.a.state != "none":
            self.save_state(elapsed_s)


def _training_args(a: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(a).items() if k not in ("given", "out", "resume", "state", "plot")}
