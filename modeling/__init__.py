"""Qwen decoder built from torch.ops.qwen: config, checkpoint loading, model, tokenizer, generator."""

from .config import ConfigError, QwenConfig
from .generator import GenerationResult, Generator
from .loader import CheckpointError, load_state_dict
from .model import KVCache, QwenForCausalLM
from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, QwenTokenizer, format_chat

__all__ = [
    "CheckpointError",
    "ConfigError",
    "GenerationResult",
    "Generator",
    "IncrementalDetokenizer",
    "KVCache",
    "QwenConfig",
    "QwenForCausalLM",
    "QwenTokenizer",
    "SamplingParams",
    "format_chat",
    "load_state_dict",
]
