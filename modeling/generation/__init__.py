"""Token generation on one model: ``sampling`` (``SamplingParams``, the device-side samplers),
``runtime`` (device, dtype, memory checks), and the batch-1 CUDA-graph decode path behind ``LLM``:
``decode_state`` (static buffers and step bodies), ``graph_cache`` (a CUDA graph per key, one pool;
the engine's runner uses it too), ``readback`` (tokens to the host in chunks) and ``generator``
(``Generator``). Nothing is imported here."""
