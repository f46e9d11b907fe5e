"""An OpenAI-compatible HTTP server on the continuous-batching engine: ``python -m modeling.serve``
(``qwen-serve``; docs/serve.md; its modules: docs/architecture.md).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client): ``pip install 'qwen-triton-ops[serve]'``.
"""
