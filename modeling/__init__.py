"""Qwen decoder built from torch.ops.qwen: config, checkpoint loading, model, tokenizer."""

from .config import ConfigError, QwenConfig
from .loader import CheckpointError, load_state_dict
from .model import KVCache, QwenForCausalLM
from .tokenizer import IncrementalDetokenizer, QwenTokenizer, format_chat

__all__ = [
    "CheckpointError",
    "ConfigError",
    "IncrementalDetokenizer",
    "KVCache",
    "QwenConfig",
    "QwenForCausalLM",
    "QwenTokenizer",
    "format_chat",
    "load_state_dict",
]
