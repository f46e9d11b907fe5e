"""``LLM.stream``'s iterator (``TextStream``): each ``next`` steps the engine (under the ``LLM``'s
lock) until its completion has new text; a step serves every sequence in the engine, so other
calls' requests advance too, and the stream's advances while they run."""

from typing import TYPE_CHECKING, Iterator, Optional

from .outputs import RequestOutput

if TYPE_CHECKING:
    from .llm import LLM, _Request


class TextStream:
    """``LLM.stream``'s iterator: text pieces as they are ready; ``output`` (a ``RequestOutput``)
    once it is exhausted. ``close()`` (or leaving a ``with`` block, or dropping the iterator) stops
    the generation: its completion ends with ``finish_reason`` "abort"."""

    def __init__(self, llm: "LLM", request: "_Request"):
        self._llm, self._request = llm, request
        self.prompt = request.prompt
        self._sent = 0  # characters of the completion's text handed out
        self.output: Optional[RequestOutput] = None  # once the stream is exhausted (or closed)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        completion = self._request.completions[0]
        while True:
            text = completion.row.text
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
        return self._request.completions[0].row.text

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
