"""Names shared by the trainer's modules: the data file, the output directory's files, the settings
that --init and --resume carry over, the checkpoint's generation defaults; ``UsageError``."""

import signal
from pathlib import Path
from typing import Any, Dict


DATA_FILE = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"
DATA_LIMIT = 1 << 30
"""Bytes --data may have (Tiny Shakespeare has 1.1 MB): the whole text, its tokens and the BPE
training all sit in memory."""
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")
LOG_FILE = "training_log.json"
PLOT_FILE = "loss_curve.png"
STATE_FILE = "resume_state.pt"
LOCK_FILE = ".train.lock"
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95}
STATE_VERSION = 2  # 2: the state holds the best weights
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MAX_SPEAKER = 40  # characters of a speaker line ("KING RICHARD III:")
# --init DIR: these settings come from DIR/config.json (setting -> its config.json key)
INIT_SETTINGS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "layers": "num_hidden_layers",
                 "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                 "intermediate_size": "intermediate_size", "seq_len": "max_position_embeddings",
                 "rope_theta": "rope_theta"}

# Defaults: the shipped model (about 7.2M parameters, 14.4 MB in bf16). "tiny": a CPU smoke run.
PRESETS: Dict[str, Dict[str, Any]] = {
    "default": dict(vocab_size=2048, hidden_size=384, layers=5, heads=6, kv_heads=2, head_dim=64,
                    intermediate_size=768, seq_len=512, batch_size=16, epochs=50.0, eval_every=50,
                    log_every=10, warmup_steps=100),
    "tiny": dict(vocab_size=320, hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16,
                 intermediate_size=64, seq_len=32, batch_size=4, steps=20, eval_every=10,
                 log_every=1, warmup_steps=2, eval_batch_size=512, max_chars=200_000),
}
# On --resume every setting comes from the resume state, except these when given again ...
RESUME_OVERRIDES = ("steps", "epochs", "max_minutes", "eval_every", "log_every", "state_every", "patience",
                    "device", "dtype")
# ... and these, which belong to one invocation (never taken from the state).
PER_INVOCATION = ("stop_at", "progress", "plot_after")


class UsageError(Exception):
    """Bad input: printed as ``error: <message>``, exit status 2."""
