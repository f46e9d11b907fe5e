"""Train the shipped default model: a small Qwen3 on Tiny Shakespeare, on the torch.ops.qwen kernels.

    python -m modeling.train --out DIR --device cuda --max-minutes 5   # the shipped recipe, stage 1 (H200)
    python -m modeling.train --out DIR2 --init DIR --chat-fraction 0.75 ...  # stage 2 (docs/training.md)
    python -m modeling.train --out DIR --device cpu --preset tiny      # a smoke run in seconds
    python -m modeling.train --out DIR --resume                        # continue DIR's last run
    python -m modeling.train --plot DIR                                # DIR/loss_curve.png

Data: ``modeling/data/tinyshakespeare.txt`` split by characters; the last ``--val-fraction``
(10%) is the validation split, used for nothing but validation (not for the tokenizer either).
With ``--chat-fraction F``, F of each batch's sequences are crops of the training split's
dialogue as ChatML (``dialogue_chat``: each speech a user or an assistant turn, the reply to the
one before, ended by ``<|im_end|>``), so that the model ends a chat reply by itself.

Tokenizer: a byte-level BPE trained with the ``tokenizers`` library on the training split, with
the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (ids 0, 1, 2; the same
pipeline as ``modeling.model.random_checkpoint.build_tokenizer``).

Model: a Qwen3 (q/k norm, GQA, tied embeddings) built as ``QwenForCausalLM(config)`` and
initialised as transformers initialises Qwen3 (matrices ~ N(0, 0.02^2), norm weights 1), or with
``--init DIR`` from the weights, tokenizer and sizes of a checkpoint this trainer wrote; trained
with ``model.loss(input_ids)`` (the fused lm_head + cross-entropy) on random crops of the
training tokens. On CUDA the weights and the compute are bf16 and AdamW keeps fp32 master
weights and moments; on CPU everything is fp32. ``--dropout`` applies ``F.dropout`` to the
embedding and to each layer's MLP output before it joins the residual stream (forward hooks on
the layers: the decoder itself has no dropout).

Schedule: linear warm-up, then cosine decay to ``--min-lr`` over ``--steps`` (default: the steps
of ``--epochs`` passes over the training tokens); with ``--max-minutes`` the decay also follows
the elapsed fraction of the time budget (whichever is further along), so a run cut short by the
clock still ends annealed. Gradients are clipped to ``--grad-clip``.

Validation: every ``--eval-every`` steps and at the end, the loss over the whole validation
split (windows of ``--seq-len`` tokens overlapping by one, so every token but the first is
predicted exactly once) and its bits per character:
``nats per token * tokens in the split / characters in the split / ln 2``; with
``--chat-fraction F`` also the loss on the validation split's dialogue as ChatML.

Output directory (the model is the checkpoint with the best validation loss, with
``--chat-fraction F`` the best (1 - F) * validation loss + F * validation dialogue loss):

- ``config.json``, ``model.safetensors`` (Hugging Face tensor names, un-fused, bf16),
  ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``: a checkpoint that
  ``QwenForCausalLM.from_pretrained``, ``python -m modeling.generate --model DIR`` and
  ``transformers.Qwen3ForCausalLM.from_pretrained`` load as it is;
- ``training_log.json``: the settings, the loss curves, throughput, wall time, the best
  validation loss and bits/char; ``loss_curve.png``, drawn from it at the end of a run or by
  ``--plot DIR`` (needs matplotlib; without it the run says so and skips the picture);
- ``resume_state.pt`` (or ``--state PATH``): the run's one record for ``--resume``, written last at
  every save: the last step's fp32 weights, optimizer state, step, RNG states, and the best
  weights and the log that the two files above are written from. Not part of the model.

Interrupts: SIGTERM and SIGINT (Ctrl-C) set a flag that the loop reads between whole steps; it
then saves and exits with 128 + the signal number (143, 130). Every file goes to disk through an
fsynced temporary file and ``os.replace`` (then an fsync of its folder). Each invocation saves
its starting point before anything else (a fresh run: step 0, before the step-0 validation), and
``--resume`` rewrites the model and the log from the resume state, so a run stopped at any moment
continues with ``--resume`` to the weights of a run without a stop. ``OUT/.train.lock`` (an
``fcntl.flock``) keeps a second run out of a directory that one is writing.

The package: ``trainer`` (``Trainer``, ``Evaluator``, ``lr_at``; the data, the model's config,
initialisation and Hugging Face names, dropout, safe writes, the names the modules share), ``plot``
and ``cli`` (``main``, the output directory's lock, the stop signals). The names below are what its
callers and tests use.
"""

from .cli import OutLock, StopSignals, check_args, main, parse_args, prepare
from .plot import plot
from .trainer import (DATA_FILE, GENERATION_DEFAULTS, LOCK_FILE, LOG_FILE, MODEL_FILES, PLOT_FILE, STATE_FILE, Evaluator,
                      Trainer, UsageError, attach_dropout, bits_per_char, build_model, count_parameters, dialogue_chat,
                      eval_batches, eval_windows, hf_tensors, lr_at, model_config_dict, speeches, split_text,
                      train_tokenizer)

__all__ = ["DATA_FILE", "GENERATION_DEFAULTS", "LOCK_FILE", "LOG_FILE", "MODEL_FILES", "PLOT_FILE", "STATE_FILE",
           "Evaluator", "OutLock", "StopSignals", "Trainer", "UsageError", "attach_dropout", "bits_per_char",
           "build_model", "check_args", "count_parameters", "dialogue_chat", "eval_batches", "eval_windows",
           "hf_tensors", "lr_at", "main", "model_config_dict", "parse_args", "plot", "prepare", "speeches",
           "split_text", "train_tokenizer"]
