"""Qwen decoder built from torch.ops.qwen: config, checkpoint loading, model, tokenizer, generator,
and the patch that swaps the ops into transformers models."""

from .config import ConfigError, QwenConfig
from .generator import GenerationResult, Generator
from .layers import KVCache
from .loader import CheckpointError, load_state_dict
from .model import Cache, QwenForCausalLM
from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, QwenTokenizer, format_chat
from .transformers_patch import TransformersPatch, patch_transformers

__all__ = [
    "Cache",
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
    "TransformersPatch",
    "format_chat",
    "load_state_dict",
    "patch_transformers",
]
