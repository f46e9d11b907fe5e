"""The checkpoint's own chat template, rendered as transformers renders it, and its generation defaults.

``ChatTemplate.from_pretrained(path)`` loads the template a checkpoint ships:
``chat_template.jinja``, else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
named templates: ``default``, and ``tool_use`` when tools are given), else ``chat_template.json``,
else ChatML (``CHATML_TEMPLATE``, the same text as ``format_chat``).

``template.render(messages, add_generation_prompt=True, **kwargs)`` renders it as transformers'
``apply_chat_template(..., tokenize=False)`` does (its sandbox, globals and ``tojson``), with the
variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special
tokens that are set (``bos_token``, ``eos_token``, ...) and any extra keyword
(``enable_thinking=False``). Everything the template sees is rebuilt from JSON types (anything else
becomes the placeholder ``"<TypeName>"``); messages are passed without their ``None`` values, and a
message's reasoning (``reasoning_content``, ``thinking`` or ``reasoning``) is visible under
``reasoning_content`` and ``thinking``, as in transformers 5.

A template is untrusted code: the sandbox (``modeling.chat.sandbox``) holds each rendering to the
template's ``RenderLimits``; passing one raises ``RenderLimitError`` naming the template and the bound.

``generation_defaults(path)`` reads ``generation_config.json`` into ``GenerationDefaults``.
"""

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ..common import one_line
from ..model.files import SIDE_FILE_LIMIT, read_file, read_json

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen's ChatML, used when the checkpoint ships no template (``format_chat`` writes the same text)."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


def format_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """Qwen's ChatML as ``CHATML_TEMPLATE`` renders it, without jinja2 (the trainer formats its whole
    dialogue with it): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` when ``add_generation_prompt``."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n" if add_generation_prompt else text


class ChatTemplateError(ValueError):
    """A chat template that does not parse, or that failed while rendering (``raise_exception``
    in the template, a sandbox violation, an error in its logic)."""


class RenderLimitError(ChatTemplateError):
    """A chat template whose rendering passed one of its ``RenderLimits``."""


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering of a chat template may cost. The defaults leave room for the longest
    prompt a Qwen model takes (262,144 tokens, about a million characters) and stop a hostile
    template within seconds; real Qwen templates use a tiny fraction of them."""

    max_loop_iterations: int = 1_000_000
    """Iterations of all ``{% for %}`` loops together, items drawn from lazy sequences included."""
    max_chars: int = 4_000_000
    """Characters of the output, of any string, and of the text in any list, tuple or dict."""
    max_items: int = 1_000_000
    """Values in any list, tuple or dict (nested ones included, a shared one at every place)."""
    max_seconds: float = 5.0
    """Wall-clock time of one rendering."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"RenderLimits.{f.name} must be a positive finite number, got {value!r}")


class ChatTemplate:
    """A jinja chat template with the special tokens it may refer to.

    ``source`` is the template text; ``origin`` says where it came from (a file name, or
    ``"ChatML (default)"``); ``special_tokens`` maps ``bos_token``, ``eos_token``, ... to their text.
    ``named`` holds the other templates of a checkpoint that ships several (``tool_use``, ...).
    ``limits`` bound each rendering (``RenderLimits``).
    """

    def __init__(self, source: str, special_tokens: Optional[Mapping[str, str]] = None,
                 origin: str = "<string>", named: Optional[Mapping[str, str]] = None,
                 limits: RenderLimits = RenderLimits()):
        self.source, self.origin, self.limits = source, origin, limits
        self.special_tokens: Dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.named: Dict[str, str] = dict(named or {})
        self._compiled: Dict[str, Any] = {}
        self._compile(source)  # a syntax error surfaces at load, not at the first render

    @property
    def is_default(self) -> bool:
        """True when the checkpoint shipped no template and ChatML is used."""
        return self.origin == "ChatML (default)"

    @classmethod
    def chatml(cls, special_tokens: Optional[Mapping[str, str]] = None,
               limits: RenderLimits = RenderLimits()) -> "ChatTemplate":
        return cls(CHATML_TEMPLATE, special_tokens, origin="ChatML (default)", limits=limits)

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], limits: RenderLimits = RenderLimits()) -> "ChatTemplate":
        """The template of the checkpoint directory ``path`` (see the module docstring for the order)."""
        path = Path(path)
        tokenizer_config = read_json(path / "tokenizer_config.json", ChatTemplateError, optional=True)
        special = _special_tokens(tokenizer_config)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                source = read_file(jinja_file, SIDE_FILE_LIMIT, ChatTemplateError).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ChatTemplateError(f"cannot read {jinja_file.name}: {e}") from None
            return cls(source, special, origin=jinja_file.name, limits=limits)
        template = tokenizer_config.get("chat_template")
        origin = "tokenizer_config.json"
        if template is None:
            template = read_json(path / "chat_template.json", ChatTemplateError, optional=True).get("chat_template")
            origin = "chat_template.json"
        if template is None:
            return cls.chatml(special, limits)
        if isinstance(template, str):
            return cls(template, special, origin=origin, limits=limits)
        if isinstance(template, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys()
                                              for t in template):
            named = {t["name"]: t["template"] for t in template}
            if "default" not in named:
                raise ChatTemplateError(f"{origin}: several chat templates ({', '.join(sorted(named))}) "
                                        "and none named 'default'")
            return cls(named["default"], special, origin=origin, named=named, limits=limits)
        raise ChatTemplateError(f"{origin}: chat_template must be a string or a list of "
                                f"{{name, template}}, got {type(template).__name__}")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Optional[List[Dict[str, Any]]] = None, documents: Optional[List[Dict[str, Any]]] = None,
               **kwargs: Any) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content``, and whatever else the
        template reads: ``reasoning_content``, ``tool_calls`` ...). ``kwargs`` are template variables
        (``enable_thinking=False``) and override the special tokens of the same name. Safe to call
        from any thread; ``RenderLimitError`` when the rendering passes ``self.limits``."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"a chat message must be a dict, got {type(m).__name__}")
            chat.append(_alias_reasoning({k: _plain(v) for k, v in m.items() if v is not None}))
        source = self.named["tool_use"] if tools is not None and "tool_use" in self.named else self.source
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
        compiled = self._compile(source)
        from .budget import LimitExceeded, bounded

        try:
            with bounded(self.limits):
                return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                       add_generation_prompt=add_generation_prompt, **variables)
        except LimitExceeded as e:
            raise RenderLimitError(f"chat template ({self.origin}): {e}") from None
        except Exception as e:  # TemplateError from raise_exception, SecurityError, TypeError in the template...
            raise ChatTemplateError(f"chat template ({self.origin}): {one_line(e)}") from e

    def _compile(self, source: str):
        """``source`` compiled in the bounded sandbox (once; constant folding runs within ``limits``)."""
        compiled = self._compiled.get(source)
        if compiled is None:
            import jinja2

            from .budget import bounded
            from .sandbox import environment

            try:
                with bounded(self.limits):
                    compiled = environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat template ({self.origin}) line {e.lineno}: {e.message}") from None
            self._compiled[source] = compiled
        return compiled

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} chars)"


def _plain(value: Any) -> Any:
    """Template data rebuilt from plain JSON types (what the sandbox sees); anything else becomes
    a placeholder ``<TypeName>``, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):  # subclasses
        if isinstance(value, kind):
            return plain(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: Dict[str, Any]) -> Dict[str, Any]:
    """Fill ``reasoning_content`` (and ``thinking``) from whichever reasoning field the message has."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _special_tokens(tokenizer_config: Mapping[str, Any]) -> Dict[str, str]:
    """``bos_token``, ``eos_token``, ... of tokenizer_config.json (a string or an AddedToken dict
    with ``content``); unset ones are left out, so a template sees them undefined."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = tokenizer_config.get(name)
        if isinstance(token, Mapping):
            token = token.get("content")
        if isinstance(token, str):
            out[name] = token
    return out


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults of a checkpoint, in ``SamplingParams``' terms: temperature 0 is greedy,
    top-k 0, top-p 1, repetition penalty 1 and min-p 0 are off. ``max_new_tokens`` is None when the
    checkpoint sets none."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0


def generation_defaults(path: Union[str, Path]) -> GenerationDefaults:
    """Sampling defaults from ``path/generation_config.json`` (greedy when the file is absent).

    As in transformers: ``do_sample`` false or absent means greedy decoding (temperature, top-k and
    top-p are then ignored); with ``do_sample`` true, a field the file leaves out takes
    GenerationConfig's default (temperature 1.0, top-k 50, top-p 1.0). ``min_p`` is a sampling
    control too (taken with ``do_sample`` only; absent: off); ``repetition_penalty`` applies to
    greedy decoding as well (absent: 1.0, off). ``max_new_tokens`` is taken when present. Raises
    ``ValueError`` naming the field for a value outside ``SamplingParams``' range for it, and for a
    ``do_sample`` that is not a JSON boolean (the string "false" would otherwise read as true).
    """
    from ..engine.sampling_params import VALUE_CHECKS, in_range

    path = Path(path)
    config = read_json(path / "generation_config.json" if path.is_dir() else path, ChatTemplateError, optional=True)
    checks = {name: check for name, *check in VALUE_CHECKS}

    def value(field: str, default: Any, name: Optional[str] = None) -> Any:
        """The file's ``field`` (``default`` when absent or null), checked as SamplingParams' ``name``."""
        v = config.get(field)
        if v is None:
            return default
        kind, low, high, open_low, text = checks[name or field]
        if not in_range(v, kind, low, high, open_low):
            raise ValueError(f"generation_config.json: {field} {text}, got {v!r}")
        return kind(v)

    max_new, rep = value("max_new_tokens", None, "max_tokens"), value("repetition_penalty", 1.0)
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):  # "false" is not true
        raise ValueError(f"generation_config.json: do_sample must be true or false (a JSON boolean), got {do_sample!r}")
    if not do_sample:
        return GenerationDefaults(max_new_tokens=max_new, repetition_penalty=rep)
    return GenerationDefaults(value("temperature", 1.0), value("top_k", 50), value("top_p", 1.0), max_new, rep,
                              value("min_p", 0.0))
