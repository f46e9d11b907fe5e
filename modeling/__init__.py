"""Qwen decoder built from torch.ops.qwen: config, checkpoint loading, model, tokenizer, the
continuous-batching engine, the text API on it (``LLM``), and the patch that swaps the ops into
transformers models.

The names below are imported on first use (PEP 562), so ``import modeling`` and the command line's
first lines do not import torch: ``python -m modeling.generate`` handles Ctrl-C and bad input from
its first instant, while torch is still loading.
"""

from typing import TYPE_CHECKING

from .common import lazy_exports

_EXPORTS = {
    "ChatTemplate": ".chat.template",
    "CheckpointError": ".model.loader",
    "CompletionOutput": ".api.outputs",
    "ConfigError": ".model.config",
    "Engine": ".engine.engine",
    "IncrementalDetokenizer": ".api.tokenizer",
    "LLM": ".api.llm",
    "ModelNotFound": ".model.hub",
    "QwenConfig": ".model.config",
    "QwenForCausalLM": ".model.causal_lm",
    "QwenTokenizer": ".api.tokenizer",
    "RequestOutput": ".api.outputs",
    "SamplingParams": ".engine.sampling_params",
    "TextStream": ".api.llm",
    "TransformersPatch": ".model.transformers_patch",
    "format_chat": ".chat.template",
    "generation_defaults": ".chat.template",
    "load_state_dict": ".model.loader",
    "patch_transformers": ".model.transformers_patch",
    "resolve_model": ".model.hub",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .chat.template import ChatTemplate, format_chat, generation_defaults  # noqa: F401
    from .model.config import ConfigError, QwenConfig  # noqa: F401
    from .engine.engine import Engine  # noqa: F401
    from .model.hub import ModelNotFound, resolve_model  # noqa: F401
    from .api.llm import LLM, TextStream  # noqa: F401
    from .api.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from .model.loader import CheckpointError, load_state_dict  # noqa: F401
    from .model.causal_lm import QwenForCausalLM  # noqa: F401
    from .engine.sampling_params import SamplingParams  # noqa: F401
    from .api.tokenizer import IncrementalDetokenizer, QwenTokenizer  # noqa: F401
    from .model.transformers_patch import TransformersPatch, patch_transformers  # noqa: F401
