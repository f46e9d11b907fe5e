"""An OpenAI-compatible HTTP server on the continuous-batching engine: ``python -m modeling.serve``
(``qwen-serve``; docs/serve.md).

- ``__main__``: the command line (model, engine and HTTP flags), the engine's process, uvicorn.
- ``app``: the FastAPI routes, authentication, the body limit, error responses, the per-request
  log line.
- ``protocol``: request bodies validated into a ``Plan`` (prompts' token ids, each choice's
  ``SamplingParams``).
- ``generation``: one request's choices in the engine, their text (``modeling.api.outputs.Completion``)
  and the response or stream chunks built from it; ``responses``: OpenAI's JSON shapes and SSE events.
- ``chat_output``: Qwen3's ``<think>`` block and Qwen's ``<tool_call>`` blocks parsed out of a reply.
- ``engine_loop``: the loop that steps the engine and reports each step (``EngineCore``, in the
  engine's process or a thread, ``ThreadTransport``) and the server's side of it (``EngineClient``
  hands each request its tokens); ``engine_process``: the engine's process and its pipes.
- ``connections``: uvicorn's HTTP protocol with a deadline for each request's head and a cap on the
  connections open at once.
- ``metrics``: Prometheus metrics; ``drain``: SIGTERM/SIGINT handling; ``errors``: OpenAI's error JSON.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client): ``pip install 'qwen-triton-ops[serve]'``.
"""
