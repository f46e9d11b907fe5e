"""Train the shipped default model: a small Qwen3 on Tiny Shakespeare, on the torch.ops.qwen kernels.

    python -m modeling.train --out DIR --device cuda --max-minutes 5   # the shipped recipe, stage 1 (H200)
    python -m modeling.train --out DIR --device cpu --preset tiny      # a smoke run in seconds
    python -m modeling.train --out DIR --resume                        # continue DIR's last run

docs/training.md ("Training the default model") holds the recipe: the data and its ChatML
dialogue, the tokenizer, the model and its initialisation, the schedule, validation (bits per
character: nats per token * tokens in the split / characters in the split / ln 2), the output
directory, saving, stopping (SIGTERM, SIGINT: exit 128 + the signal number) and resuming.

The package: ``data`` (text, dialogue, tokenizer, validation windows), ``model_init`` (config,
initialisation, Hugging Face names, dropout), ``trainer`` (``Trainer``, ``Evaluator``, ``lr_at``),
``files`` (safe writes, the resume state read back), ``plot``, ``constants`` and ``cli`` (``main``, the output
directory's lock, the stop signals). The names below are what its callers and tests use.
"""

from .cli import OutLock, StopSignals, check_args, main, parse_args, prepare
from .constants import (DATA_FILE, GENERATION_DEFAULTS, LOCK_FILE, LOG_FILE, MODEL_FILES, PLOT_FILE, STATE_FILE,
                        UsageError)
from .data import bits_per_char, dialogue_chat, eval_batches, eval_windows, speeches, split_text, train_tokenizer
from .model_init import attach_dropout, build_model, count_parameters, hf_tensors, model_config_dict
from .plot import plot
from .trainer import Evaluator, Trainer, lr_at

__all__ = ["DATA_FILE", "GENERATION_DEFAULTS", "LOCK_FILE", "LOG_FILE", "MODEL_FILES", "PLOT_FILE", "STATE_FILE",
           "Evaluator", "OutLock", "StopSignals", "Trainer", "UsageError", "attach_dropout", "bits_per_char",
           "build_model", "check_args", "count_parameters", "dialogue_chat", "eval_batches", "eval_windows",
           "hf_tensors", "lr_at", "main", "model_config_dict", "parse_args", "plot", "prepare", "speeches",
           "split_text", "train_tokenizer"]
