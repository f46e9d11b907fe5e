"""Qwen decoder built from torch.ops.qwen: config, checkpoint loading, model, tokenizer, generator,
the text API (``LLM``), and the patch that swaps the ops into transformers models.

The names below are imported on first use (PEP 562), so ``import modeling`` and the command line's
first lines do not import torch: ``python -m modeling.generate`` handles Ctrl-C and bad input from
its first instant, while torch is still loading.
"""

import importlib
from typing import TYPE_CHECKING, Any, List

_EXPORTS = {
    "Cache": ".model",
    "ChatTemplate": ".chat",
    "CheckpointError": ".loader",
    "ConfigError": ".config",
    "GenerationResult": ".generator",
    "Generator": ".generator",
    "IncrementalDetokenizer": ".tokenizer",
    "KVCache": ".layers",
    "LLM": ".llm",
    "ModelNotFound": ".hub",
    "QwenConfig": ".config",
    "QwenForCausalLM": ".model",
    "QwenTokenizer": ".tokenizer",
    "RequestOutput": ".llm",
    "SamplingParams": ".sampling",
    "TextStream": ".llm",
    "TransformersPatch": ".transformers_patch",
    "format_chat": ".tokenizer",
    "generation_defaults": ".chat",
    "load_state_dict": ".loader",
    "patch_transformers": ".transformers_patch",
    "resolve_model": ".hub",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .chat import ChatTemplate, generation_defaults  # noqa: F401
    from .config import ConfigError, QwenConfig  # noqa: F401
    from .generator import GenerationResult, Generator  # noqa: F401
    from .hub import ModelNotFound, resolve_model  # noqa: F401
    from .layers import KVCache  # noqa: F401
    from .llm import LLM, RequestOutput, TextStream  # noqa: F401
    from .loader import CheckpointError, load_state_dict  # noqa: F401
    from .model import Cache, QwenForCausalLM  # noqa: F401
    from .sampling import SamplingParams  # noqa: F401
    from .tokenizer import IncrementalDetokenizer, QwenTokenizer, format_chat  # noqa: F401
    from .transformers_patch import TransformersPatch, patch_transformers  # noqa: F401
