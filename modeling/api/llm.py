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
  (``modeling.chat.template.ChatTemplate``; ChatML when it ships none), and without ``sampling_params``
  the sampling values come from its ``generation_config.json`` (``get_default_sampling_params``).
- The ``Generator`` lacks the engine's controls (``ENGINE_ONLY``: min-p, the penalties,
  logprobs): a ``SamplingParams`` that sets one is refused with a ``ValueError`` pointing to
  ``modeling.engine.Engine`` (the server's, ``python -m modeling.serve``), unless the value is the
  checkpoint's own default (``repetition_penalty``, ``min_p`` from generation_config.json): that
  one is left out with a ``UserWarning``, so a checkpoint such as Qwen2.5-Instruct (repetition
  penalty 1.05) still generates with the rest of its defaults.
- A prompt is a str or, as in vLLM, its token ids: ``{"prompt_token_ids": [...]}``
  (``generate_ids`` takes lists of token ids directly). Anything else is refused, and so is a
  token id that is not an integer (a float is never rounded).
- Generation stops at the tokenizer's EOS ids (unless ``ignore_eos``), at ``stop_token_ids``, at a
  ``stop`` string (the text ends before it; the token ids keep the token that completed it), or
  after ``max_tokens``.
- The token-level ``Generator`` (CUDA-graph decode) does the work; this module adds the tokenizer,
  incremental detokenization (``IncrementalDetokenizer``), stop strings and the cache sizing: the
  generator is built on first use for the batch and length a call needs (with ``max_seq_len=None``,
  rounded up to a power of two and rebuilt when a later call needs more) after checking that the
  cache fits the device's memory (``check_fits``; ``DoesNotFit`` says what fits).
- Outputs and their text are in ``outputs``, the stream in ``stream``, the prompt checks in
  ``modeling.generation.prompts``.
- ``modeling.api.checkpoint.Checkpoint`` is the part of a checkpoint that is not its weights, and
  ``modeling.generation.runtime`` decides the device, the dtype and whether a request fits.
"""

import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..generation.generator import GenerationResult, Generator
from ..generation.prompts import MAX_SEQ_LEN, check_room, checked_token_ids
from ..generation.readback import STOP
from ..generation.runtime import backend_name, check_fits, resolve_device, resolve_dtype
from ..generation.sampling import INT64_LIMIT, SamplingParams
from ..model.causal_lm import QwenForCausalLM
from .checkpoint import Checkpoint
from .frontend import Frontend, Message
from .outputs import RequestOutput, TextRow
from .stream import TextStream

DEFAULT_MAX_TOKENS = 64
"""New tokens per completion when neither the call nor the checkpoint's generation_config.json says."""
ENGINE_ONLY = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
"""``SamplingParams`` controls that the engine applies and the ``Generator`` (so ``LLM``) does not."""
MIN_AUTO_SEQ_LEN = 256
"""With ``max_seq_len=None`` the cache holds at least this many positions (then powers of two)."""
TOKEN_IDS_KEY = "prompt_token_ids"
"""The key of a prompt given as token ids, ``{"prompt_token_ids": [...]}`` (vLLM's ``TokensPrompt``)."""

Prompt = Union[str, Mapping[str, Sequence[int]]]
PromptLike = Union[Prompt, Sequence[Prompt]]


class LLM(Frontend):
    """A checkpoint loaded for generation (see the module doc); its text side (tokenizer, chat
    template, stop ids, defaults) is ``Frontend``'s.

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
                 max_batch_size: int = 8, use_cuda_graph: bool = True, prefill_graph: Optional[bool] = None,
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
    def backend(self) -> str:
        """"Triton kernels (CUDA)", "Triton interpreter (CPU)" or "PyTorch reference ops (CPU)"."""
        return backend_name(self.device, self.dtype)

    # ------------------------------------------------------------------ text API
    def generate(self, prompts: PromptLike, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        """Complete each prompt (a prompt or a list of them); one ``RequestOutput`` per prompt, in order.
        A prompt is a str, or its token ids as ``{"prompt_token_ids": [...]}`` (its output's
        ``prompt`` is then None). ``sampling_params``: one for all, one per prompt, or None
        (``get_default_sampling_params``)."""
        given = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        if not given:
            return []
        texts, ids = zip(*(self._prompt(p, i) for i, p in enumerate(given)))
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(texts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(texts)} prompts")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params or self.get_default_sampling_params()] * len(texts)
        per_prompt = [self._generator_params(p) for p in per_prompt]
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

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> "TextStream":
        """An iterator over the completion's text pieces as the tokens arrive; its ``output`` is the
        ``RequestOutput`` once it is exhausted. Closing it (or dropping it) stops the generation."""
        text, ids = self._prompt(prompt, 0)
        params = self._generator_params(sampling_params or self.get_default_sampling_params())
        return TextStream(self, text, ids, params)

    def stream_chat(self, messages: Sequence[Message], sampling_params: Optional[SamplingParams] = None,
                    **chat_kwargs: Any) -> "TextStream":
        """``stream`` of the reply to a conversation (``chat_kwargs`` as for ``chat``)."""
        return self.stream(self.render_chat(messages, **chat_kwargs), sampling_params)

    # ------------------------------------------------------------------ token level (the command line uses these)
    def _generator_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as the ``Generator`` runs them: a control of ``ENGINE_ONLY`` set to the
        checkpoint's default is turned off with a ``UserWarning``; one set otherwise is a ``ValueError``."""
        off, default = SamplingParams(), self.get_default_sampling_params()
        asked = [f for f in ENGINE_ONLY if getattr(params, f) != getattr(off, f)]
        refused = [f"{f}={getattr(params, f)!r}" for f in asked if getattr(params, f) != getattr(default, f)]
        if refused:
            raise ValueError(f"LLM generates with the Generator, which does not implement {', '.join(refused)}: "
                             "use the engine (modeling.engine.Engine; the server, python -m modeling.serve), "
                             "which does")
        if not asked:
            return params
        values = ", ".join(f"{f}={getattr(params, f)!r}" for f in asked)
        warnings.warn(f"the checkpoint's generation_config.json sets {values}, which LLM's Generator does not "
                      "implement: generating without it (the engine, modeling.engine.Engine, applies it)",
                      UserWarning, stacklevel=3)
        return replace(params, **{f: getattr(off, f) for f in asked})

    def max_new_tokens(self, params: SamplingParams) -> int:
        """``params.max_tokens``, else the checkpoint's ``max_new_tokens``, else ``DEFAULT_MAX_TOKENS``."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.checkpoint.defaults.max_new_tokens or DEFAULT_MAX_TOKENS

    def generate_ids(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None,
                     on_text: Optional[Callable[[int, str], None]] = None,
                     on_output: Optional[Callable[[int, RequestOutput], None]] = None,
                     index_offset: int = 0, cancel: Optional[threading.Event] = None
                     ) -> Tuple[List[RequestOutput], GenerationResult]:
        """Complete prompts given as token ids (each a sequence of ints or a 1-D integer tensor:
        anything else, floats and bools included, is refused with an error naming it, never rounded).
        ``on_text(i, piece)`` gets the text as it is ready,
        ``on_output(i, output)`` each completion when it ends (i counts from ``index_offset``, which
        also offsets the seed, so that consecutive calls on consecutive slices of a list sample as
        one call on the whole list would). ``cancel``: an event that ends every row when set."""
        params = self._generator_params(params or self.get_default_sampling_params())
        if isinstance(prompts, (str, Mapping)):
            raise ValueError("prompts must be a list of prompts (each a list of token ids), "
                             f"got a {type(prompts).__name__}")
        prompts = [checked_token_ids(p, f"prompts[{index_offset + i}]", self.config.vocab_size)
                   for i, p in enumerate(prompts)]
        if not prompts:
            raise ValueError("no prompts given")
        stop_ids = self.stop_ids(params)
        if params.seed is not None and index_offset:
            params = replace(params, seed=(params.seed + index_offset) % INT64_LIMIT)
        with self._lock:
            gen, max_new = self._generator_for(len(prompts), max(map(len, prompts)), self.max_new_tokens(params))
            rows = [TextRow(self.tokenizer, params) for _ in prompts]
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

    def _prompt(self, prompt: Prompt, index: int) -> Tuple[Optional[str], List[int]]:
        """A prompt's text (None when given as token ids) and its token ids."""
        if isinstance(prompt, Mapping):
            if set(prompt) != {TOKEN_IDS_KEY}:
                raise ValueError(f"prompts[{index}]: a dict prompt holds one key, {TOKEN_IDS_KEY!r}, "
                                 f"got the keys {list(prompt)!r}")
            return None, checked_token_ids(prompt[TOKEN_IDS_KEY], f"prompts[{index}][{TOKEN_IDS_KEY!r}]",
                                           self.config.vocab_size)
        if not isinstance(prompt, str):
            raise ValueError(f"prompts[{index}] must be a str or a {{{TOKEN_IDS_KEY!r}: [...]}} dict, "
                             f"got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        return prompt, ids

    def _generator_for(self, n: int, longest: int, max_new: int) -> Tuple[Generator, int]:
        """A generator for ``n`` prompts of up to ``longest`` tokens and up to ``max_new`` new tokens
        (lowered to what the cache holds), built or rebuilt if the current one is too small."""
        limit = self.max_seq_len or self.config.max_position_embeddings
        check_room(longest, limit, "max_seq_len" if self.max_seq_len else "the model's max_position_embeddings")
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
