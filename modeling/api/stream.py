"""``LLM.stream``'s iterator (``TextStream``): the generation in a worker thread, text pieces
handed over through a queue."""

import queue
import threading
from typing import TYPE_CHECKING, Iterator, List, Optional

from ..generation.sampling import SamplingParams
from .outputs import RequestOutput

if TYPE_CHECKING:
    from .llm import LLM


class _StreamState:
    """What a stream's worker thread shares with its consumer (not the ``TextStream`` itself, so
    that dropping the iterator lets it be collected, which cancels the generation)."""

    DONE = object()

    def __init__(self):
        self.queue: "queue.Queue" = queue.Queue()
        self.cancel = threading.Event()
        self.output: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None


def _stream_worker(llm: "LLM", state: _StreamState, prompt: Optional[str], ids: List[int],
                   params: SamplingParams) -> None:
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

    def __init__(self, llm: "LLM", prompt: Optional[str], ids: List[int], params: SamplingParams):
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
