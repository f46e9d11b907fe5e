"""Text in, text out: ``LLM(model).generate(prompts, SamplingParams(...))``, in the style of vLLM.

```python
from modeling import LLM, SamplingParams

llm = LLM("Qwen/Qwen3-0.6B")                      # a Hub id or a local checkpoint directory
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, stop=["."]))
out[0].text, out[0].token_ids, out[0].finish_reason  # "stop" or "length"
llm.chat([{"role": "user", "content": "Name three primes."}], enable_thinking=False)[0].text
for piece in llm.stream("Once upon a time"):       # text pieces as the tokens arrive
    print(piece, end="", flush=True)
```

- The checkpoint decides the format: ``chat`` renders the chat template it ships
  (``modeling.chat.ChatTemplate``; ChatML when it ships none), and without ``sampling_params``
  the sampling values come from its ``generation_config.json`` (``get_default_sampling_params``).
- Generation stops at the tokenizer's EOS ids (unless ``ignore_eos``), at ``stop_token_ids``, at a
  ``stop`` string (the text ends before it; the token ids keep the token that completed it), or
  after ``max_tokens``.
- The token-level ``Generator`` (CUDA-graph decode) does the work; this module adds the tokenizer,
  incremental detokenization (``IncrementalDetokenizer``), stop strings and the cache sizing: the
  generator is built on first use for the batch and length a call needs (with ``max_seq_len=None``,
  rounded up to a power of two and rebuilt when a later call needs more) after checking that the
  cache fits the device's memory (``check_fits``; ``DoesNotFit`` says what fits).
- ``Checkpoint`` is the part of a checkpoint that is not its weights (config, tokenizer, chat
  template, generation defaults): cheap to load, so the command line checks its input against it
  before reading any weight. ``default_model_dir`` is where a model comes from when none is named.
"""

import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .chat import ChatTemplate, GenerationDefaults, generation_defaults
from .config import ConfigError, QwenConfig
from .decode_state import MAX_STOP_IDS
from .generator import GenerationResult, Generator
from .hub import resolve_model
from .model import QwenForCausalLM
from .readback import STOP
from .sampling import INT64_LIMIT, SamplingParams
from .tokenizer import IncrementalDetokenizer, QwenTokenizer

DEFAULT_MAX_TOKENS = 64
"""New tokens per completion when neither the call nor the checkpoint's generation_config.json says."""
MIN_AUTO_SEQ_LEN = 256
"""With ``max_seq_len=None`` the cache holds at least this many positions (then powers of two)."""
MAX_SEQ_LEN = 2**31 - 1
"""Positions and cache lengths are int32 on the device."""
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}

PromptLike = Union[str, Sequence[str]]
Message = Mapping[str, Any]


class DoesNotFit(ValueError):
    """The weights, KV cache and buffers a request needs exceed the device's memory. ``max_seq_len``:
    the longest cache (positions per sequence) that would fit the same batch, 0 if none;
    ``max_prompt``: on the PyTorch reference path, the longest prompt whose prefill fits (else None)."""

    def __init__(self, message: str, max_seq_len: int = 0, max_prompt: Optional[int] = None):
        super().__init__(message)
        self.max_seq_len, self.max_prompt = max_seq_len, max_prompt


class ContextLengthError(ValueError):
    """A prompt that leaves no room for a new token in the cache (``max_seq_len``) or in the
    model's ``max_position_embeddings``."""


# ---------------------------------------------------------------------------------------------
# where a model comes from, and the files beside its weights


DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
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


def load_config(path: Union[str, Path]) -> QwenConfig:
    """``QwenConfig`` of a checkpoint directory; every problem with config.json is a ``ConfigError``
    with one line that says what is wrong (not a JSON object, a missing field, a wrong type...)."""
    import json

    f = Path(path) / "config.json"
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"unreadable config.json ({type(e).__name__}: {_one_line(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config.json is not a JSON object (it holds a {type(data).__name__})")
    try:
        return QwenConfig.from_dict(data)
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(f"config.json has no {e.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"config.json has a field of the wrong type or value ({type(e).__name__}: "
                          f"{_one_line(e)})") from None


class Checkpoint:
    """A checkpoint's files other than its weights: ``path``, ``config`` (``QwenConfig``),
    ``tokenizer`` (``QwenTokenizer``), ``defaults`` (``GenerationDefaults`` from
    generation_config.json) and ``chat_template`` (loaded on first use). ``load`` raises a
    ``ValueError`` (``ModelNotFound``, ``ConfigError``, ...) with a one-line message."""

    def __init__(self, path: Path, config: QwenConfig, tokenizer: QwenTokenizer, defaults: GenerationDefaults):
        self.path, self.config, self.tokenizer, self.defaults = Path(path), config, tokenizer, defaults
        self._chat_template: Optional[ChatTemplate] = None
        if len(tokenizer.eos_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"the tokenizer names {len(tokenizer.eos_token_ids)} EOS ids; at most {MAX_STOP_IDS} "
                             "stop ids are supported")

    @classmethod
    def load(cls, model: Union[str, Path, None] = None, revision: Optional[str] = None,
             offline: Optional[bool] = None, progress: bool = True,
             notice: Optional[Callable[[str], None]] = None) -> "Checkpoint":
        """``model``: a checkpoint directory or a Hub id ``ORG/NAME`` (``modeling.hub.resolve_model``:
        ``revision``, ``offline``, download ``progress`` on stderr); None: ``default_model_dir``."""
        if model is None:
            if revision is not None:
                raise ValueError("a revision needs a model name (a Hub id ORG/NAME)")
            path = default_model_dir(notice)
        else:
            path = resolve_model(model, revision=revision, offline=offline, progress=progress)
        config = load_config(path)
        tokenizer = QwenTokenizer.from_pretrained(path)
        defaults = generation_defaults(path)
        return cls(path, config, tokenizer, defaults)

    @property
    def chat_template(self) -> ChatTemplate:
        """The checkpoint's chat template (``ChatTemplateError`` if it is broken; ChatML if none)."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_pretrained(self.path)
        return self._chat_template

    def default_sampling_params(self) -> SamplingParams:
        """generation_config.json's sampling values and ``max_new_tokens`` as ``SamplingParams``."""
        d = self.defaults
        return SamplingParams(d.temperature, d.top_k, d.top_p, max_tokens=d.max_new_tokens)


# ---------------------------------------------------------------------------------------------
# devices, the path the ops take, memory


def resolve_device(spec: Union[str, torch.device, None] = None) -> torch.device:
    """``cuda``, ``cuda:N``, ``cpu`` (or a ``torch.device``); None: CUDA if available. ``ValueError``
    for anything else, a CUDA index that does not exist, or CUDA without a CUDA device."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(spec)
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "cpu") or (index and not index.isdigit()) or (":" in text and not index):
        raise ValueError(f"device must be cuda, cuda:N or cpu, got {text!r}")
    if kind == "cpu":
        if index and int(index) != 0:
            raise ValueError(f"device {text}: the CPU has no index (use cpu)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {text}: no CUDA device is available")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device {text}: there {'is' if count == 1 else 'are'} {count} CUDA device"
                         f"{'' if count == 1 else 's'} (cuda:0{'' if count == 1 else f' to cuda:{count - 1}'})")
    return torch.device("cuda", int(index)) if index else torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """None: bf16 on CUDA, fp32 on the CPU; a ``torch.dtype`` or bf16 / fp16 / fp32 (or their long names).
    ``torch.float64`` is accepted too: it always runs the PyTorch reference ops (exact, for tests)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values() and dtype != torch.float64:  # float64: the reference ops, for tests
            raise ValueError(f"dtype must be bfloat16, float16, float32 (or float64), got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def backend_name(device: torch.device, dtype: torch.dtype) -> str:
    """Where the ops run: "Triton kernels (CUDA)", "Triton interpreter (CPU)" (TRITON_INTERPRET=1)
    or "PyTorch reference ops (CPU)" (see qwen_ops.registry)."""
    from csrc_free_ops.common import INTERPRET
    from qwen_ops.checks import KERNEL_DTYPES

    if dtype not in KERNEL_DTYPES:
        return f"PyTorch reference ops ({device.type.upper()})"
    if device.type == "cuda":
        return "Triton interpreter (CUDA)" if INTERPRET else "Triton kernels (CUDA)"
    return "Triton interpreter (CPU)" if INTERPRET else "PyTorch reference ops (CPU)"


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free on the device (CUDA: ``mem_get_info``; CPU: MemAvailable, capped by the cgroup's
    limit), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    try:  # cgroup v2: a container's limit
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def _tensors(obj) -> List[torch.Tensor]:
    """The tensors a layer's cache object holds (attributes, and lists/tuples of them)."""
    out = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def memory_estimate(config: QwenConfig, dtype: torch.dtype, batch: int, seq_len: int, prompt_len: int,
                    backend: str) -> Dict[str, int]:
    """Bytes a generator of ``batch`` x ``seq_len`` needs, by part: ``weights``, ``cache`` (built on
    the meta device from the model's own ``new_cache``, so any layer kind counts right), ``buffers``
    (token history, sampling scratch), ``prefill`` (activations of the longest prompt) and, on the
    PyTorch reference path, ``scores``: its attention builds the full fp32 score matrix, ~4 copies of
    heads x T x T. ``per_position``: cache + history bytes per position of ``seq_len``."""
    with torch.device("meta"):
        model = QwenForCausalLM(config)

    def cache_bytes(length: int) -> int:
        cache = model.new_cache(batch, length, dtype, "meta")
        return sum(t.numel() * t.element_size() for c in cache.layers for t in _tensors(c))

    itemsize = torch.empty(0, dtype=dtype).element_size()
    one, two = cache_bytes(1), cache_bytes(2)
    per_position = (two - one) + batch * 8  # + the int64 token history
    c = config
    parts = {
        "weights": sum(p.numel() for p in model.parameters()) * itemsize,
        "cache": (one - (two - one)) + (two - one) * seq_len,
        "buffers": batch * seq_len * 8 + batch * c.vocab_size * 4 * 3,
        "prefill": prompt_len * (c.qkv_size + 2 * c.intermediate_size + 4 * c.hidden_size) * 4 + c.vocab_size * 8,
        "scores": 0,
        "per_position": per_position,
    }
    if backend.startswith("PyTorch reference") and "full_attention" in c.layer_types:
        parts["scores"] = 4 * c.num_attention_heads * prompt_len * prompt_len * 4
    return parts


def check_fits(config: QwenConfig, device: torch.device, dtype: torch.dtype, batch: int, seq_len: int,
               prompt_len: int, weights_loaded: bool = False) -> None:
    """Raise ``DoesNotFit`` (a one-line message with the sizes and what would fit) when the weights
    (unless ``weights_loaded``), the cache of ``batch`` x ``seq_len`` positions, the buffers and the
    prefill of a ``prompt_len``-token prompt exceed ``available_memory(device)``. On CUDA the pinned
    host copy of the token history is checked against the host's memory too."""
    backend = backend_name(device, dtype)
    parts = memory_estimate(config, dtype, batch, seq_len, prompt_len, backend)
    where = str(device)
    checks = [(available_memory(device), where)]
    if device.type == "cuda":
        checks.append((available_memory(torch.device("cpu")), "the host (pinned token history)"))
    weights = 0 if weights_loaded else parts["weights"]
    need = weights + parts["cache"] + parts["buffers"] + parts["prefill"] + parts["scores"]
    free = checks[0][0]
    if free is not None and need > free:
        fixed = need - parts["per_position"] * seq_len
        fits_len = max(0, (free - fixed) // parts["per_position"]) if parts["per_position"] else 0
        max_prompt = None
        what = [f"a KV cache of {batch} x {seq_len:,} positions ({str(dtype).replace('torch.', '')}): "
                f"{_size(parts['cache'])}"]
        if weights:
            what.append(f"weights {_size(weights)}")
        if parts["scores"] > need / 100:
            what.append(f"the reference prefill's fp32 attention scores for {prompt_len:,} tokens: "
                        f"{_size(parts['scores'])}")
            room = free - (need - parts["scores"])
            heads = config.num_attention_heads
            max_prompt = max(0, int((max(room, 0) / (16 * heads)) ** 0.5)) if room > 0 else 0
        msg = f"needs {_size(need)} ({'; '.join(what)}) but {where} has {_size(free)} free"
        if parts["scores"] and parts["scores"] > free / 2:
            msg += (f": prompts of at most ~{max_prompt:,} tokens fit on the PyTorch reference path (it builds "
                    "the full score matrix; the Triton paths do not: CUDA, or TRITON_INTERPRET=1 on the CPU)")
        else:
            msg += f": at most {fits_len:,} positions per sequence fit for a batch of {batch}"
        raise DoesNotFit(msg, fits_len, max_prompt)
    host = checks[1][0] if len(checks) > 1 else None
    if host is not None and batch * seq_len * 8 > host:
        raise DoesNotFit(f"the pinned host copy of the token history ({batch} x {seq_len:,} int64) needs "
                         f"{_size(batch * seq_len * 8)} but the host has {_size(host)} free",
                         host // (8 * batch))


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------------------------------------
# outputs, stop strings


@dataclass
class RequestOutput:
    """One completion. ``text``: the new text (without the stop string that ended it);
    ``token_ids``: the new token ids (without a stop token; with the token that completed a stop
    string); ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"``
    (``max_tokens``) or ``"abort"`` (the stream was closed before the end); ``stop_reason``: the stop string that ended it, else None. ``metrics``: the
    timings of the ``Generator.generate`` call it ran in (``prefill_ms``, ``decode_ms``,
    ``decode_steps``, ``setup_ms``: graph warm-up and capture, ``cuda_graph``). ``outputs`` is
    ``[self]``, so code written for vLLM's ``RequestOutput.outputs[0].text`` works."""

    index: int
    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: str
    stop_reason: Optional[str] = None
    metrics: Dict[str, Any] = field(default_factory=dict)

    @property
    def outputs(self) -> List["RequestOutput"]:
        return [self]

    @property
    def generated_tokens(self) -> int:
        """Tokens the model produced for it, a stop token included."""
        return len(self.token_ids) + (self.finish_reason == "stop" and self.stop_reason is None)

    def to_dict(self) -> Dict[str, Any]:
        return {"index": self.index, "text": self.text, "token_ids": list(self.token_ids),
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "prompt_tokens": len(self.prompt_token_ids), "metrics": dict(self.metrics)}


class StopStrings:
    """Text pieces in, the text to emit out, up to the first stop string. What could still be the
    start of a stop string is held back until the next piece shows it is not."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.pending = ""
        self.matched: Optional[str] = None

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stop for i in [self.pending.find(s)] if i >= 0]
        if hits:
            i, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
            out, self.pending = self.pending[:i], ""
            return out
        keep = max((k for s in self.stop for k in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


class _Row:
    """One completion's text as its tokens arrive."""

    def __init__(self, tokenizer: QwenTokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop)
        self.pieces: List[str] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, token: int) -> str:
        out = self.stops.push(self.detok.push(token))
        self.pieces.append(out)
        return out

    def finish(self) -> str:
        out = self.stops.push(self.detok.flush())
        out += self.stops.flush()
        self.pieces.append(out)
        return out


# ---------------------------------------------------------------------------------------------
# the text API


class LLM:
    """A checkpoint loaded for generation (see the module doc).

    ``model``: a local checkpoint directory, a Hub id ``ORG/NAME`` (``revision``, ``offline``), a
    loaded ``Checkpoint``, or None for ``default_model_dir()``. ``device``: ``cuda[:N]`` / ``cpu``
    (default CUDA if available); ``dtype``: default bf16 on CUDA, fp32 on the CPU.
    ``max_seq_len``: cache positions per sequence (None: sized per call, grown as needed);
    ``max_batch_size``: prompts decoded together (more run in consecutive batches);
    ``use_cuda_graph``, ``prefill_graph``: as for ``Generator``.

    One generation runs at a time (a lock); ``stream`` runs its generation in a worker thread.
    """

    def __init__(self, model: Union[str, Path, Checkpoint, None] = None, *, revision: Optional[str] = None,
                 offline: Optional[bool] = None, device: Union[str, torch.device, None] = None,
                 dtype: Union[str, torch.dtype, None] = None, max_seq_len: Optional[int] = None,
                 max_batch_size: int = 8, use_cuda_graph: bool = True, prefill_graph: bool = False,
                 progress: bool = True):
        if isinstance(model, Checkpoint):
            self.checkpoint = model
        else:
            self.checkpoint = Checkpoint.load(model, revision, offline, progress)
        if max_seq_len is not None and not (isinstance(max_seq_len, int) and 2 <= max_seq_len <= MAX_SEQ_LEN):
            raise ValueError(f"max_seq_len must be an integer in [2, {MAX_SEQ_LEN}], got {max_seq_len!r}")
        if not (isinstance(max_batch_size, int) and max_batch_size >= 1):
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.use_cuda_graph, self.prefill_graph = use_cuda_graph, prefill_graph
        check_fits(self.config, self.device, self.dtype, 1, 2, 0)  # the weights alone, before reading them
        self.model = QwenForCausalLM.from_pretrained(self.checkpoint.path, device=self.device, dtype=self.dtype)
        self.generator: Optional[Generator] = None
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, model: Union[str, Path, None] = None, **kwargs: Any) -> "LLM":
        """``LLM(model, **kwargs)``: a checkpoint directory or a Hub id ``ORG/NAME``."""
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ what it is
    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def config(self) -> QwenConfig:
        return self.checkpoint.config

    @property
    def tokenizer(self) -> QwenTokenizer:
        return self.checkpoint.tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        return self.checkpoint.chat_template

    @property
    def backend(self) -> str:
        """"Triton kernels (CUDA)", "Triton interpreter (CPU)" or "PyTorch reference ops (CPU)"."""
        return backend_name(self.device, self.dtype)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (greedy when it has none)."""
        return self.checkpoint.default_sampling_params()

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    enable_thinking: Optional[bool] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[List[Dict[str, Any]]] = None) -> str:
        """The prompt text of a conversation, rendered with the checkpoint's chat template."""
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return self.chat_template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                         **kwargs)

    # ------------------------------------------------------------------ text API
    def generate(self, prompts: PromptLike, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        """Complete each prompt (a str or a list of them); one ``RequestOutput`` per prompt, in order.
        ``sampling_params``: one for all, one per prompt, or None (``get_default_sampling_params``)."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts:
            return []
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(texts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(texts)} prompts")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params or self.get_default_sampling_params()] * len(texts)
        ids = [self._encode(t, i) for i, t in enumerate(texts)]
        outputs: List[Optional[RequestOutput]] = [None] * len(texts)
        for params in dict.fromkeys(per_prompt):  # one Generator call per distinct params
            idx = [i for i, p in enumerate(per_prompt) if p == params]
            outs, _ = self.generate_ids([ids[i] for i in idx], params)
            for i, out in zip(idx, outs):
                out.index, out.prompt = i, texts[i]
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
             sampling_params: Optional[SamplingParams] = None, *, add_generation_prompt: bool = True,
             enable_thinking: Optional[bool] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None,
             tools: Optional[List[Dict[str, Any]]] = None) -> List[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` dicts) or to each of a list of
        them, rendered with the checkpoint's chat template. ``enable_thinking=False`` is Qwen3's
        switch (a template variable, as ``chat_template_kwargs`` entries are)."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        texts = [self.render_chat(c, add_generation_prompt, enable_thinking, chat_template_kwargs, tools)
                 for c in convs]
        return self.generate(texts, sampling_params)

    def stream(self, prompt: str, sampling_params: Optional[SamplingParams] = None) -> "TextStream":
        """An iterator over the completion's text pieces as the tokens arrive; its ``output`` is the
        ``RequestOutput`` once it is exhausted. Closing it (or dropping it) stops the generation."""
        return TextStream(self, prompt, self._encode(prompt, 0), sampling_params or self.get_default_sampling_params())

    def stream_chat(self, messages: Sequence[Message], sampling_params: Optional[SamplingParams] = None,
                    **chat_kwargs: Any) -> "TextStream":
        """``stream`` of the reply to a conversation (``chat_kwargs`` as for ``chat``)."""
        return self.stream(self.render_chat(messages, **chat_kwargs), sampling_params)

    # ------------------------------------------------------------------ token level (the command line uses these)
    def max_new_tokens(self, params: SamplingParams) -> int:
        """``params.max_tokens``, else the checkpoint's ``max_new_tokens``, else ``DEFAULT_MAX_TOKENS``."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.checkpoint.defaults.max_new_tokens or DEFAULT_MAX_TOKENS

    def stop_ids(self, params: SamplingParams) -> List[int]:
        ids = list(dict.fromkeys(([] if params.ignore_eos else list(self.tokenizer.eos_token_ids))
                                 + list(params.stop_token_ids)))
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(ids)} stop token ids (EOS and stop_token_ids): at most {MAX_STOP_IDS}")
        return ids

    def generate_ids(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None,
                     on_text: Optional[Callable[[int, str], None]] = None,
                     on_output: Optional[Callable[[int, RequestOutput], None]] = None,
                     index_offset: int = 0, cancel: Optional[threading.Event] = None
                     ) -> Tuple[List[RequestOutput], GenerationResult]:
        """Complete prompts given as token ids. ``on_text(i, piece)`` gets the text as it is ready,
        ``on_output(i, output)`` each completion when it ends (i counts from ``index_offset``, which
        also offsets the seed, so that consecutive calls on consecutive slices of a list sample as
        one call on the whole list would). ``cancel``: an event that ends every row when set."""
        params = params or self.get_default_sampling_params()
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("no prompts given")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {index_offset + i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {index_offset + i} has token ids outside the model's vocabulary [0, {vocab})")
        stop_ids = self.stop_ids(params)
        if params.seed is not None and index_offset:
            params = replace(params, seed=(params.seed + index_offset) % INT64_LIMIT)
        with self._lock:
            gen, max_new = self._generator_for(len(prompts), max(map(len, prompts)), self.max_new_tokens(params))
            rows = [_Row(self.tokenizer, params) for _ in prompts]
            outputs: List[Optional[RequestOutput]] = [None] * len(prompts)

            def on_token(i: int, token: int):
                piece = rows[i - index_offset].push(token)
                if piece and on_text is not None:
                    on_text(i, piece)
                if rows[i - index_offset].stops.matched is not None or (cancel is not None and cancel.is_set()):
                    return STOP
                return None

            def on_finish(i: int, tokens: List[int], reason: str):
                row = rows[i - index_offset]
                tail = row.finish()
                if tail and on_text is not None:
                    on_text(i, tail)
                if reason == "callback":  # a stop string, or the caller stopped the stream
                    reason = "stop" if row.stops.matched is not None else "abort"
                out = RequestOutput(i, None, prompts[i - index_offset], row.text, list(tokens), reason,
                                    row.stops.matched)
                outputs[i - index_offset] = out
                if on_output is not None:
                    on_output(i, out)

            result = gen.generate(prompts, max_new, params, stop_ids, _offset(on_token, index_offset),
                                  _offset(on_finish, index_offset))
        metrics = dict(prefill_ms=result.prefill_ms, decode_ms=result.decode_ms, decode_steps=result.decode_steps,
                       setup_ms=result.setup_ms, cuda_graph=result.cuda_graph)
        for out in outputs:
            out.metrics = metrics  # type: ignore[union-attr]
        return outputs, result  # type: ignore[return-value]

    def warm_up(self, prompt: Sequence[int], params: SamplingParams, batch_size: int = 1) -> float:
        """Compile the kernels (a prefill of ``prompt`` and one decode step) and capture the decode
        graph of ``batch_size`` ahead of a timed run; returns the milliseconds it took. Only CUDA
        compiles (the CPU paths return 0 at once). A prompt length or batch whose kernels were not
        compiled here still compiles on first use."""
        if self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        with self._lock:
            gen, max_new = self._generator_for(batch_size, len(prompt), min(2, self.max_new_tokens(params)))
            warm = replace(params, seed=None, max_tokens=None, stop=())
            gen.generate([list(prompt)], max_new, warm, ())
            gen.capture(batch_sizes=[batch_size], modes=[params.mode])
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) * 1e3

    def _encode(self, text: str, index: int) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt {index} must be a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        return ids

    def _generator_for(self, n: int, longest: int, max_new: int) -> Tuple[Generator, int]:
        """A generator for ``n`` prompts of up to ``longest`` tokens and up to ``max_new`` new tokens
        (lowered to what the cache holds), built or rebuilt if the current one is too small."""
        limit = self.max_seq_len or self.config.max_position_embeddings
        if longest >= limit:
            what = "max_seq_len" if self.max_seq_len else "the model's max_position_embeddings"
            raise ContextLengthError(f"a prompt of {longest} tokens leaves no room for a new token in {limit} "
                                     f"positions ({what})")
        max_new = min(max_new, limit - longest)
        need = longest + max_new
        batch = min(self.max_batch_size, n)
        gen = self.generator
        if self.max_seq_len:
            seq_len = self.max_seq_len
        else:
            seq_len = min(limit, max(MIN_AUTO_SEQ_LEN, 1 << (need - 1).bit_length()))
        if gen is not None and gen.max_batch_size >= batch and gen.max_seq_len >= need:
            return gen, max_new
        if gen is not None:  # grow, never shrink: keep the larger of each
            batch, seq_len = max(batch, gen.max_batch_size), max(seq_len, gen.max_seq_len)
            self.generator = gen = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        check_fits(self.config, self.device, self.dtype, batch, seq_len, longest, weights_loaded=True)
        self.generator = Generator(self.model, max_batch_size=batch, max_seq_len=seq_len,
                                   use_cuda_graph=self.use_cuda_graph, prefill_graph=self.prefill_graph)
        return self.generator, max_new


def _offset(fn, offset: int):
    """The Generator numbers prompts from 0 within a call; the callbacks count from ``offset``."""
    if not offset:
        return fn
    return lambda i, *args: fn(i + offset, *args)


class _StreamState:
    """What a stream's worker thread shares with its consumer (not the ``TextStream`` itself, so
    that dropping the iterator lets it be collected, which cancels the generation)."""

    DONE = object()

    def __init__(self):
        self.queue: "queue.Queue" = queue.Queue()
        self.cancel = threading.Event()
        self.output: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None


def _stream_worker(llm: LLM, state: _StreamState, prompt: str, ids: List[int], params: SamplingParams) -> None:
    try:
        outputs, _ = llm.generate_ids([ids], params, on_text=lambda i, piece: state.queue.put(piece),
                                      cancel=state.cancel)
        outputs[0].prompt = prompt
        state.output = outputs[0]
    except BaseException as e:  # handed to the consumer
        state.error = e
    finally:
        state.queue.put(_StreamState.DONE)


class TextStream:
    """``LLM.stream``'s iterator: text pieces as they are ready; ``output`` (a ``RequestOutput``)
    once it is exhausted. The generation runs in a worker thread; ``close()`` (or leaving a
    ``with`` block, or dropping the iterator) ends it at the next token."""

    def __init__(self, llm: LLM, prompt: str, ids: List[int], params: SamplingParams):
        self.prompt = prompt
        self._state = _StreamState()
        self._finished = False
        self._thread = threading.Thread(target=_stream_worker, args=(llm, self._state, prompt, ids, params),
                                        daemon=True, name="qwen-llm-stream")
        self._thread.start()

    @property
    def output(self) -> Optional[RequestOutput]:
        """The ``RequestOutput`` once the stream is exhausted (None before, or after ``close``)."""
        return self._state.output

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        item = self._state.queue.get()
        if item is _StreamState.DONE:
            self._finished = True
            self._thread.join()
            if self._state.error is not None:
                raise self._state.error
            raise StopIteration
        return item

    @property
    def text(self) -> str:
        """The whole completion (consumes what is left of the stream)."""
        for _ in self:
            pass
        return self.output.text if self.output is not None else ""

    def close(self) -> None:
        """Stop the generation (at the next token) and wait for the worker."""
        self._state.cancel.set()
        self._thread.join()
        self._finished = True

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        state = getattr(self, "_state", None)
        if state is not None:
            state.cancel.set()
