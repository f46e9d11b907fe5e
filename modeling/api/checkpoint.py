"""Where a model comes from, and the files beside its weights: ``Checkpoint`` (cheap to load, so the
command line checks its input against it before reading any weight, and the server's HTTP process
holds one alone) and ``default_model_dir``. Every file is read through
``modeling.model.files``: regular files only, each under a size limit."""

from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from ..chat.template import ChatTemplate, GenerationDefaults, Message, generation_defaults
from ..engine.sampling_params import MAX_STOP_IDS, SamplingParams
from ..model.config import QwenConfig
from ..model.hub import resolve_model
from ..model.loader import check_weights_size
from .tokenizer import QwenTokenizer


DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "default_model"
"""The model shipped with the package: a 7.2M-parameter Qwen3 this project trained on Tiny
Shakespeare with its own kernels (``python -m modeling.train``; docs/training.md)."""


def default_model_dir(notice: Optional[Callable[[str], None]] = None) -> Path:
    """The checkpoint used when no model is named (the command line without ``--model``, ``LLM()``):
    ``DEFAULT_MODEL``. ``notice`` gets a one-line note saying so."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        raise ValueError(f"the shipped default model is missing from {DEFAULT_MODEL}: reinstall the package, "
                         "or name a model")
    if notice is not None:
        notice("note: no model given: using the shipped default model, a small Qwen3 trained on Tiny Shakespeare")
    return DEFAULT_MODEL


RENDER_ARGUMENTS = ("messages", "tools", "add_generation_prompt")
"""What ``render_chat`` gives the chat template itself: never a ``chat_template_kwargs`` key."""


class TemplateKwargsError(ValueError):
    """A ``chat_template_kwargs`` key that is one of ``RENDER_ARGUMENTS``."""


class Checkpoint:
    """A checkpoint's files other than its weights: ``path``, ``config`` (``QwenConfig``),
    ``tokenizer`` (``QwenTokenizer``), ``defaults`` (``GenerationDefaults`` from
    generation_config.json) and ``chat_template`` (loaded on first use). ``load`` raises a
    ``ValueError`` (``ModelNotFound``, ``ConfigError``, ``CheckpointError``, ...) with a one-line
    message; it also checks that the weights files are large enough for the config's sizes
    (``modeling.model.loader.check_weights_size``, from their sizes alone)."""

    def __init__(self, path: Path, config: QwenConfig, tokenizer: QwenTokenizer, defaults: GenerationDefaults):
        self.path, self.config, self.tokenizer, self.defaults = Path(path), config, tokenizer, defaults
        if len(tokenizer.eos_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"the tokenizer names {len(tokenizer.eos_token_ids)} EOS ids; at most {MAX_STOP_IDS} "
                             "stop ids are supported")

    @classmethod
    def load(cls, model: Union[str, Path, None] = None, revision: Optional[str] = None,
             offline: Optional[bool] = None, progress: bool = True,
             notice: Optional[Callable[[str], None]] = None) -> "Checkpoint":
        """``model``: a checkpoint directory or a Hub id ``ORG/NAME`` (``modeling.model.hub.resolve_model``:
        ``revision``, ``offline``, download ``progress`` on stderr); None: ``default_model_dir``."""
        if model is None:
            if revision is not None:
                raise ValueError("a revision needs a model name (a Hub id ORG/NAME)")
            path = default_model_dir(notice)
        else:
            path = resolve_model(model, revision=revision, offline=offline, progress=progress)
        config = QwenConfig.from_pretrained(path)
        check_weights_size(path, config)
        return cls(path, config, QwenTokenizer.from_pretrained(path, config.vocab_size), generation_defaults(path))

    @cached_property
    def chat_template(self) -> ChatTemplate:
        """The checkpoint's chat template (``ChatTemplateError`` if it is broken; ChatML if none)."""
        return ChatTemplate.from_pretrained(self.path)

    def default_sampling_params(self) -> SamplingParams:
        """generation_config.json's sampling values (repetition penalty and min-p included) and
        ``max_new_tokens`` as ``SamplingParams`` (greedy when it has none)."""
        d = self.defaults
        return SamplingParams(d.temperature, d.top_k, d.top_p, max_tokens=d.max_new_tokens,
                              repetition_penalty=d.repetition_penalty, min_p=d.min_p)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    enable_thinking: Optional[bool] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[List[Dict[str, Any]]] = None) -> str:
        """The prompt text of a conversation, rendered with the checkpoint's chat template;
        ``TemplateKwargsError`` for a ``chat_template_kwargs`` key of ``RENDER_ARGUMENTS``."""
        kwargs = dict(chat_template_kwargs or {})
        taken = [k for k in RENDER_ARGUMENTS if k in kwargs]
        if taken:
            raise TemplateKwargsError(f"chat_template_kwargs may not set {taken[0]!r}, which the chat template "
                                      "gets from its own argument")
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return self.chat_template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                         **kwargs)

    def stop_ids(self, params: SamplingParams) -> List[int]:
        """EOS (unless ``ignore_eos``) and ``params.stop_token_ids``, each once; a ``ValueError`` for
        a stop token id outside the vocabulary (it could never be sampled)."""
        vocab = self.config.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise ValueError(f"stop_token_ids {outside[:4]} lie outside the model's vocabulary [0, {vocab})")
        ids = list(dict.fromkeys((() if params.ignore_eos else self.tokenizer.eos_token_ids) + params.stop_token_ids))
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(ids)} stop token ids (EOS and stop_token_ids): at most {MAX_STOP_IDS}")
        return ids
