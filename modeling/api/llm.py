"""Text in, text out, on the continuous-batching engine: ``LLM(model).generate(prompts, SamplingParams(...))``,
in the style of vLLM.

```python
from modeling import LLM, SamplingParams

llm = LLM("Qwen/Qwen3-0.6B")                      # a Hub id or a local checkpoint directory
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, stop=["."]))
out[0].outputs[0].text, out[0].outputs[0].finish_reason   # "stop" or "length"
llm.chat([{"role": "user", "content": "Name three primes."}], enable_thinking=False)[0].text
for piece in llm.stream("Once upon a time"):       # text pieces as the tokens arrive
    print(piece, end="", flush=True)
```

- A call's prompts run together as one continuous batch in the ``modeling.engine.Engine``, each
  with its own ``SamplingParams``; a seeded prompt's tokens depend on its seed and the model only.
- Without ``sampling_params`` the values come from the checkpoint's ``generation_config.json``;
  ``chat`` renders the chat template it ships (ChatML when it ships none).
- A prompt is a str or its token ids, ``{"prompt_token_ids": [...]}``; anything else, or a token
  id that is not an integer, is refused with an error naming it.
- Generation stops at the tokenizer's EOS ids (unless ``ignore_eos``), at ``stop_token_ids``, at a
  ``stop`` string (the text ends before it; the token ids keep the token that completed it), after
  ``max_tokens``, or at ``max_model_len`` positions.
- The engine is sized on first use for the call's sequences (a power of two, at most
  ``max_num_seqs``) and, with ``max_model_len=None``, its longest request (a power of two, at least
  ``MIN_AUTO_MODEL_LEN``); it is built again, larger, when a later call needs more. Its cache pool
  takes at most ``gpu_memory_utilization`` of the free device memory (``DoesNotFit`` says what fits).
"""

import contextlib
import gc
import itertools
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..chat.messages import MessageError, template_messages
from ..common import is_int
from ..engine import Engine, Status
from ..engine.prompts import ContextLengthError, check_engine_args, check_model_len, checked_token_ids
from ..engine.sampling_params import SamplingParams, choice_params
from ..model.causal_lm import QwenForCausalLM
from ..model.device import backend_name, check_weights_fit, resolve_device, resolve_dtype
from ..model.fp8 import keeps_fp8
from ..model.tensor_parallel import SINGLE, TensorParallel
from ..engine.workers import TIMEOUT_S, Workers, start as start_workers
from .checkpoint import Checkpoint, Message
from .outputs import Completion, RequestMetrics, RequestOutput, TokenStrings, logprob_dict

DEFAULT_MAX_TOKENS = 64
"""New tokens per completion when neither the call nor the checkpoint's generation_config.json says."""
WORKER_LOAD_TIMEOUT_S = 1800
"""The longest a tensor-parallel worker may take to load its shard."""
MIN_AUTO_MODEL_LEN = 256
"""With ``max_model_len=None`` the engine holds at least this many positions a sequence (then powers of two)."""
TOKEN_IDS_KEY = "prompt_token_ids"
"""The key of a prompt given as token ids, ``{"prompt_token_ids": [...]}`` (vLLM's ``TokensPrompt``)."""
RENAMED = {"max_seq_len": "max_model_len", "max_batch_size": "max_num_seqs"}
"""Earlier keyword arguments of ``LLM`` that still work, with a ``DeprecationWarning``."""
REMOVED = {
    "use_cuda_graph": "LLM runs on the engine, whose steps replay CUDA graphs: enforce_eager=True runs them eagerly",
    "prefill_graph": "the engine captures prefill steps in CUDA graphs as it does decode steps (enforce_eager=True "
                     "runs every step eagerly)",
    "generate_ids": "pass token ids as prompts: llm.generate({'prompt_token_ids': ids}) or a list of such dicts",
    "warm_up": "the engine compiles and captures each step shape on first use; llm.engine.capture_graphs() "
               "captures them all ahead of time",
}
"""Earlier arguments and methods of ``LLM`` that mean nothing on the engine: refused, saying what to use."""

Prompt = Union[str, Mapping[str, Sequence[int]]]
PromptLike = Union[Prompt, Sequence[Prompt]]
ParamsLike = Union[SamplingParams, Sequence[SamplingParams], None]
ProgressLike = Union[bool, Callable[..., Any]]
"""``use_tqdm``: whether to show a progress bar, or a callable that makes it (a tqdm class), as vLLM's."""


class _Request:
    """One prompt of a call and its completions (one engine sequence each; the first one's prefill
    computes the prompt logprobs, when asked for)."""

    def __init__(self, request_id: str, prompt: Optional[str], ids: List[int], completions: List[Completion]):
        self.request_id, self.prompt, self.ids, self.completions = request_id, prompt, ids, completions
        self.metrics = RequestMetrics(time.time())
        self.seqs: list = []

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self) -> RequestOutput:
        entries = self.seqs[0].prompt_logprobs if self.seqs else None  # None unless asked for; as far as computed
        prompt_logprobs = None if entries is None else [None] + [
            logprob_dict(self.completions[0].strings, t, e) for t, e in zip(self.ids[1:], entries[1:])]
        return RequestOutput(self.request_id, self.prompt, list(self.ids), [c.output() for c in self.completions],
                             self.finished, self.metrics, prompt_logprobs)


class TextStream:
    """``LLM.stream``'s iterator: text pieces as they are ready; ``output`` (a ``RequestOutput``)
    once it is exhausted. Each ``next`` steps the engine until the completion has new text.
    ``close()`` (or leaving a ``with`` block, or dropping the iterator) stops the generation: its
    completion ends with ``finish_reason`` "abort"."""

    def __init__(self, llm: "LLM", request: _Request):
        self._llm, self._request = llm, request
        self.prompt = request.prompt
        self._sent = 0  # characters of the completion's text handed out
        self.output: Optional[RequestOutput] = None  # once the stream is exhausted (or closed)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        completion = self._request.completions[0]
        while True:
            text = completion.text
            if len(text) > self._sent:
                piece, self._sent = text[self._sent:], len(text)
                return piece
            if completion.finished:
                if self.output is None:
                    self.output = self._request.output()
                raise StopIteration
            if self._llm._step() is None:  # the engine holds nothing to run: it was aborted
                self._llm._abort([self._request])

    @property
    def text(self) -> str:
        """The whole completion (consumes what is left of the stream)."""
        for _ in self:
            pass
        return self._request.completions[0].text

    def close(self) -> None:
        """Stop the generation (if it still runs)."""
        self._llm._abort([self._request])
        if self.output is None:
            self.output = self._request.output()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        request = getattr(self, "_request", None)
        if request is not None and not request.finished:
            self._llm._abort([request])


class LLM:
    """A checkpoint loaded for generation on the engine (see the module doc); its ``path``,
    ``config``, ``tokenizer`` and ``chat_template`` are its ``checkpoint``'s.

    ``model``: a local checkpoint directory, a Hub id ``ORG/NAME`` (``revision``, ``offline``), a
    loaded ``Checkpoint``, or None for ``default_model_dir()``. ``device``: ``cuda[:N]`` / ``cpu``
    (default CUDA if available); ``dtype``: default bf16 on CUDA, fp32 on the CPU.
    ``max_model_len``: positions a sequence (prompt and output) holds at most, up to the model's
    max_position_embeddings (None: sized per call, grown as needed); ``max_num_seqs``,
    ``max_num_batched_tokens``, ``gpu_memory_utilization``: the engine's
    (``modeling.engine.Engine``); ``enforce_eager``: no CUDA graphs. ``quantization``: None, or
    "fp8" to quantise the layers' linear weights and experts as they load (``modeling.model.fp8``;
    an FP8 checkpoint runs in FP8 without it).
    ``tensor_parallel_size``: split the model over that many devices (``cuda:0`` .. on a GPU host;
    on the CPU, processes over gloo): this process is rank 0 and starts the others as workers
    (``modeling.engine.workers``); ``close()`` stops them.

    Calls may come from several threads: each engine step runs under a lock, and a step serves
    every call's sequences (an open ``stream`` advances while another call generates).
    """

    def __init__(self, model: Union[str, Path, Checkpoint, None] = None, *, revision: Optional[str] = None,
                 offline: Optional[bool] = None, device: Union[str, torch.device, None] = None,
                 dtype: Union[str, torch.dtype, None] = None, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, quantization: Optional[str] = None, progress: bool = True,
                 tensor_parallel_size: int = 1, **renamed: Any):
        for old, value in renamed.items():
            if old in REMOVED:
                raise TypeError(f"LLM(): {old} is no longer an argument: {REMOVED[old]}")
            if old not in RENAMED:
                raise TypeError(f"LLM() got an unexpected keyword argument {old!r}")
            warnings.warn(f"LLM({old}=...) is deprecated: use {RENAMED[old]}", DeprecationWarning, stacklevel=2)
            if RENAMED[old] == "max_model_len":
                max_model_len = value
            else:
                max_num_seqs = value
        check_engine_args(max_model_len, max_num_seqs, max_num_batched_tokens)
        if not (isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
                and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization!r}")
        if not (is_int(tensor_parallel_size) and tensor_parallel_size >= 1):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        if quantization is not None and tensor_parallel_size > 1:  # before any worker starts
            raise ValueError(f"quantization={quantization!r} takes a model on one device, not tensor_parallel_size "
                             f"{tensor_parallel_size}")
        if not (model is None or isinstance(model, (str, os.PathLike, Checkpoint))):
            raise TypeError(f"model must be a Hub id ORG/NAME or a checkpoint directory (a str or a path), a "
                            f"Checkpoint, or None for the shipped model, got {type(model).__name__}")
        self.checkpoint = (model if isinstance(model, Checkpoint)
                           else Checkpoint.load(model, revision, offline, progress))
        check_model_len(max_model_len, self.config.max_position_embeddings)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_model_len = max_model_len
        self.engine_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager)
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        fp8_weights = bool(quantization or self.config.quantization) and keeps_fp8(self.device, self.dtype)
        self.workers: Optional[Workers] = None
        self._closed = False
        self._engine: Optional[Engine] = None
        self._strings = TokenStrings(self.tokenizer)
        self._lock = threading.RLock()
        self._tracked: Dict[int, Tuple[_Request, Completion]] = {}  # Sequence.request_id -> its completion
        self._ids = itertools.count()
        parallel = SINGLE
        if tensor_parallel_size > 1:
            parallel = TensorParallel(0, tensor_parallel_size)
            parallel.local_config(self.config)  # a model that does not split: refused before any process starts
        check_weights_fit(self.config, self.device, self.dtype, fp8_weights, parallel)
        if tensor_parallel_size > 1:
            self.workers = start_workers(self.checkpoint.path, self.dtype, quantization, self.device,
                                         tensor_parallel_size)
        try:
            if self.workers is not None:
                parallel = TensorParallel.from_group()
            self.model = QwenForCausalLM.from_pretrained(self.checkpoint.path, device=self.device, dtype=self.dtype,
                                                         quantization=quantization, parallel=parallel)
            if self.workers is not None:
                self.workers.wait_ready(WORKER_LOAD_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the engine (its running requests end with "abort"), stop the tensor-parallel
        workers and leave their process group; the LLM takes no calls after. Safe to call twice."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
            for _, c in self._tracked.values():
                if not c.finished:
                    c.finish_reason = "abort"
            self._tracked.clear()
            if self.workers is not None:
                broken = engine is not None and engine.failed
                if engine is not None and not broken:
                    with contextlib.suppress(Exception):  # a step in flight: the workers wait for its tokens
                        engine.drain()
                self.workers.close(wait=1.0 if broken else TIMEOUT_S)
                self.workers = None
                torch.distributed.destroy_process_group()

    @classmethod
    def from_pretrained(cls, model: Union[str, Path, None] = None, **kwargs: Any) -> "LLM":
        """``LLM(model, **kwargs)``: a checkpoint directory or a Hub id ``ORG/NAME``."""
        return cls(model, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in REMOVED:
            raise AttributeError(f"LLM.{name} is gone: {REMOVED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ what it is
    path = property(lambda self: self.checkpoint.path)
    config = property(lambda self: self.checkpoint.config)
    tokenizer = property(lambda self: self.checkpoint.tokenizer)
    chat_template = property(lambda self: self.checkpoint.chat_template)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (greedy when it has none)."""
        return self.checkpoint.default_sampling_params()

    def render_chat(self, messages: Sequence[Message], *args: Any, **kwargs: Any) -> str:
        """The prompt text of a conversation (``Checkpoint.render_chat``) in OpenAI's message form:
        text parts joined, "developer" as "system" (``modeling.chat.messages``; a ``MessageError``,
        a ValueError, naming a malformed message)."""
        return self.checkpoint.render_chat(template_messages(messages), *args, **kwargs)

    @property
    def backend(self) -> str:
        """"Triton kernels (CUDA)", "Triton interpreter (CPU)" or "PyTorch reference ops (CPU)"."""
        return backend_name(self.device, self.dtype)

    @property
    def engine(self) -> Engine:
        """The engine (built on first use: for ``max_model_len``, or ``MIN_AUTO_MODEL_LEN`` positions)."""
        with self._lock:
            return self._engine_for(1, 1)

    # ------------------------------------------------------------------ text API
    def generate(self, prompts: PromptLike, sampling_params: ParamsLike = None, *,
                 use_tqdm: ProgressLike = True) -> List[RequestOutput]:
        """Complete each prompt (a prompt or a list of them); one ``RequestOutput`` per prompt, in
        order. A prompt is a str, or its token ids as ``{"prompt_token_ids": [...]}`` (its output's
        ``prompt`` is then None). ``sampling_params``: one for all, one per prompt, or None
        (``get_default_sampling_params``). ``use_tqdm``: a progress bar over the prompts (tqdm's,
        or what a callable given here makes with tqdm's arguments, as vLLM's)."""
        return [o for _, o in sorted(self._run(self._requests(prompts, sampling_params), use_tqdm))]

    def iter_generate(self, prompts: PromptLike, sampling_params: ParamsLike = None, *,
                      use_tqdm: ProgressLike = False) -> Iterator[Tuple[int, RequestOutput]]:
        """``generate``, yielding (index of the prompt, its ``RequestOutput``) as each prompt's
        completions finish; leaving the loop early aborts the rest."""
        return self._run(self._requests(prompts, sampling_params), use_tqdm)

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]], sampling_params: ParamsLike = None,
             *, use_tqdm: ProgressLike = True, add_generation_prompt: bool = True,
             enable_thinking: Optional[bool] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None,
             tools: Optional[List[Dict[str, Any]]] = None) -> List[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` dicts) or to each of a list of
        them, rendered with the checkpoint's chat template. ``enable_thinking=False`` is Qwen3's
        switch (a template variable, as ``chat_template_kwargs`` entries are)."""
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts (or a list of such lists), "
                             f"got {type(messages).__name__}")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        texts = []
        for i, conv in enumerate(convs):
            try:
                texts.append(self.render_chat(conv, add_generation_prompt, enable_thinking, chat_template_kwargs, tools))
            except MessageError as e:
                if len(convs) == 1:
                    raise
                raise MessageError(f"conversation {i}: {e.detail}", e.field, e.unsupported) from None
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> TextStream:
        """An iterator over the completion's text pieces as the tokens arrive; its ``output`` is the
        ``RequestOutput`` once it is exhausted. Closing it (or dropping it) stops the generation.
        One completion: ``n`` must be 1."""
        params = self._params(sampling_params, 0)
        if params.n != 1:
            raise ValueError(f"stream makes one completion: sampling_params.n must be 1, got {params.n}")
        return TextStream(self, self._add([(*self._prompt(prompt, 0, params), params)])[0])

    def stream_chat(self, messages: Sequence[Message], sampling_params: Optional[SamplingParams] = None,
                    **chat_kwargs: Any) -> TextStream:
        """``stream`` of the reply to a conversation (``chat_kwargs`` as for ``chat``)."""
        return self.stream(self.render_chat(messages, **chat_kwargs), sampling_params)

    def max_new_tokens(self, params: SamplingParams) -> int:
        """``params.max_tokens``, else the checkpoint's ``max_new_tokens``, else ``DEFAULT_MAX_TOKENS``."""
        return params.max_tokens or self.checkpoint.defaults.max_new_tokens or DEFAULT_MAX_TOKENS

    # ------------------------------------------------------------------ the requests
    def _params(self, params: Any, index: Optional[int]) -> SamplingParams:
        if params is None:
            return self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            where = "sampling_params" if index is None else f"sampling_params[{index}]"
            raise ValueError(f"{where} must be a SamplingParams (modeling.SamplingParams), got {type(params).__name__}")
        return params

    def _requests(self, prompts: PromptLike, sampling_params: Any) -> List[Tuple[Optional[str], List[int],
                                                                               SamplingParams]]:
        """(text, token ids, params) of each prompt, every argument checked (a ``ValueError`` naming it)."""
        if isinstance(prompts, (str, Mapping)):
            given = [prompts]
        elif isinstance(prompts, Sequence):
            given = list(prompts)
        else:
            raise ValueError(f"prompts must be a str, a {{{TOKEN_IDS_KEY!r}: [...]}} dict or a list of them, "
                             f"got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(given):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(given)} prompts: give one, or one "
                                 "per prompt")
            per_prompt = [self._params(p, i) for i, p in enumerate(sampling_params)]
        else:
            per_prompt = [self._params(sampling_params, None)] * len(given)
        return [(*self._prompt(p, i, params), params) for i, (p, params) in enumerate(zip(given, per_prompt))]

    def _prompt(self, prompt: Prompt, index: int, params: SamplingParams) -> Tuple[Optional[str], List[int]]:
        """A prompt's text (None when given as token ids) and its token ids, cut to the last
        ``params.truncate_prompt_tokens``."""
        if isinstance(prompt, Mapping):
            if set(prompt) != {TOKEN_IDS_KEY}:
                raise ValueError(f"prompts[{index}]: a dict prompt holds one key, {TOKEN_IDS_KEY!r}, "
                                 f"got the keys {list(prompt)!r}")
            text, ids = None, checked_token_ids(prompt[TOKEN_IDS_KEY], f"prompts[{index}][{TOKEN_IDS_KEY!r}]",
                                                self.config.vocab_size)
        elif not isinstance(prompt, str):
            raise ValueError(f"prompts[{index}] must be a str or a {{{TOKEN_IDS_KEY!r}: [...]}} dict, "
                             f"got {type(prompt).__name__}")
        else:
            try:
                text, ids = prompt, self.tokenizer.encode(prompt)
            except ValueError as e:  # not valid Unicode: "the text holds a lone surrogate ..."
                raise ValueError(f"prompts[{index}]: {e}") from None
            if not ids:
                raise ValueError(f"prompts[{index}] is empty")
        return text, ids[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else ids

    def _engine_for(self, need: int, num_seqs: int) -> Engine:
        """The engine, built (or built again, larger) so that a sequence holds ``need`` positions and
        ``num_seqs`` sequences run together (at most ``max_num_seqs``; more wait their turn)."""
        if self._closed:
            raise RuntimeError("this LLM was closed (LLM.close()): it takes no more calls")
        limit = self.max_model_len or self.config.max_position_embeddings
        need, num_seqs = min(need, limit), min(num_seqs, self.engine_args["max_num_seqs"])
        engine = self._engine
        if engine is not None and engine.max_model_len >= need and (
                engine.scheduler.max_num_seqs >= num_seqs or self._tracked):
            return engine
        size = limit if self.max_model_len else min(limit, max(MIN_AUTO_MODEL_LEN, 1 << (need - 1).bit_length()))
        seqs = 1 << (num_seqs - 1).bit_length()
        if engine is not None:
            if self._tracked:
                raise ContextLengthError(
                    f"a request of {need} positions needs a larger engine than the running one ({engine.max_model_len} "
                    "positions) while other requests (open streams) run in it: finish them first, or set max_model_len")
            size, seqs = max(size, engine.max_model_len), max(seqs, engine.scheduler.max_num_seqs)
            engine.drain()  # a step in flight: tensor-parallel workers wait for its tokens
            self._engine = engine = None
            gc.collect()  # the step graphs hold the old engine in a reference cycle
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        args = dict(self.engine_args, max_num_seqs=min(seqs, self.engine_args["max_num_seqs"]))
        self._engine = Engine(self.model, max_model_len=size, tokenizer=self.tokenizer, workers=self.workers, **args)
        return self._engine

    def _add(self, requests: Sequence[Tuple[Optional[str], List[int], SamplingParams]]) -> List[_Request]:
        """Every completion of ``requests`` into the engine (all or none)."""
        if not requests:
            return []
        limit = self.max_model_len or self.config.max_position_embeddings
        budgets = []
        for i, (_, ids, params) in enumerate(requests):
            room = limit - len(ids)
            if room < 1:
                what = "max_model_len" if self.max_model_len else "the model's max_position_embeddings"
                raise ContextLengthError(f"prompts[{i}] has {len(ids)} tokens, which leaves no room for a new token in "
                                         f"{what} ({limit})")
            budgets.append(min(self.max_new_tokens(params), room))
        with self._lock:
            engine = self._engine_for(max(len(r[1]) + b for r, b in zip(requests, budgets)),
                                      sum(r[2].n for r in requests))
            added: List[_Request] = []
            try:
                for (text, ids, params), budget in zip(requests, budgets):
                    stop_ids = self.checkpoint.stop_ids(params)
                    request = _Request(str(next(self._ids)), text, ids,
                                       [Completion(j, self._strings, params) for j in range(params.n)])
                    added.append(request)
                    for c in request.completions:
                        seq = engine.add(ids, choice_params(params, c.index), budget, stop_ids)
                        request.seqs.append(seq)
                        self._tracked[seq.request_id] = (request, c)
            except BaseException:
                self._abort(added)
                raise
        return added

    def _abort(self, requests: Sequence[_Request]) -> None:
        """Stop the sequences of ``requests`` that still run; their completions end with "abort"."""
        with self._lock:
            for r in requests:
                for seq, c in zip(r.seqs, r.completions):
                    if self._tracked.pop(seq.request_id, None) is not None:
                        self._engine.abort(seq)
                        if not c.finished:
                            c.finish_reason = "abort"
                if r.metrics.finished_time is None:
                    r.metrics.finished_time = time.time()

    def _step(self) -> Optional[List[Tuple[_Request, Completion, str]]]:
        """One engine step: (request, completion, new text) of each completion that got a token
        (none in a step of prompt chunks); None when the engine holds nothing to run."""
        with self._lock:
            if self._engine is None or not self._engine.has_work():
                return None
            out = []
            for seq in self._engine.step():
                tracked = self._tracked.get(seq.request_id)
                if tracked is None:
                    continue
                request, c = tracked
                if seq.error is not None:
                    raise RuntimeError(f"request {request.request_id}: {seq.error}")
                now = time.time()
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                text = c.push(seq.tokens[-1], seq.logprobs[-1] if seq.logprobs is not None else None, seq.finish_reason)
                if c.finished:
                    del self._tracked[seq.request_id]
                    if seq.status is not Status.FINISHED:  # a stop string: the engine does not know
                        self._engine.abort(seq)
                    if request.finished:
                        request.metrics.finished_time = now
                out.append((request, c, text))
            return out

    def _run(self, requests, use_tqdm: ProgressLike) -> Iterator[Tuple[int, RequestOutput]]:
        """Add ``requests``, step the engine until each finishes, yield (index, output) as they do."""
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm must be True, False or a callable that makes the progress bar (a tqdm "
                             f"class), got {use_tqdm!r}")
        added = self._add(requests)
        index = {id(r): i for i, r in enumerate(added)}
        left = set(index)
        bar = None
        if use_tqdm and added:
            make = use_tqdm
            if make is True:
                from tqdm import tqdm as make

            bar = make(total=len(added), desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        try:
            while left:
                stepped = self._step()
                if stepped is None:  # nothing runs them: aborted by another thread
                    raise RuntimeError("the engine holds none of this call's requests any more")
                for request, _, _ in stepped:
                    if id(request) in left and request.finished:
                        left.discard(id(request))
                        if bar is not None:
                            bar.update(1)
                        yield index[id(request)], request.output()
        finally:
            if left:
                self._abort([r for r in added if id(r) in left])
            if bar is not None:
                bar.close()
