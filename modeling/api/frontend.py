"""The text side of a checkpoint, without its weights: tokenizer, chat template, stop token ids and
generation defaults. ``LLM`` is a ``Frontend`` with the model loaded; the server's HTTP process is
one alone (its engine, with the weights, runs in a process of its own)."""
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..engine.sampling_params import MAX_STOP_IDS, SamplingParams
from .checkpoint import Checkpoint

Message = Mapping[str, Any]
RENDER_ARGUMENTS = ("messages", "tools", "add_generation_prompt")
"""What ``render_chat`` gives the chat template itself: never a ``chat_template_kwargs`` key."""


class TemplateKwargsError(ValueError):
    """A ``chat_template_kwargs`` key that is one of ``RENDER_ARGUMENTS``."""


class Frontend:
    """What a loaded ``Checkpoint`` says about text: its ``path``, ``config`` (``QwenConfig``),
    ``tokenizer`` (``QwenTokenizer``) and ``chat_template`` (``ChatTemplate``) are the checkpoint's."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint

    path = property(lambda self: self.checkpoint.path)
    config = property(lambda self: self.checkpoint.config)
    tokenizer = property(lambda self: self.checkpoint.tokenizer)
    chat_template = property(lambda self: self.checkpoint.chat_template)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (greedy when it has none)."""
        return self.checkpoint.default_sampling_params()

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
        ids = list(dict.fromkeys(([] if params.ignore_eos else list(self.tokenizer.eos_token_ids))
                                 + list(params.stop_token_ids)))
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(ids)} stop token ids (EOS and stop_token_ids): at most {MAX_STOP_IDS}")
        return ids
