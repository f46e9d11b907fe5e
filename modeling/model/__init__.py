"""The decoder and its checkpoints: ``config`` (``QwenConfig``), ``layers`` (the layer kinds),
``causal_lm`` (``QwenForCausalLM``), ``loader`` (safetensors into the fused layout),
``files`` (bounded reads of a checkpoint's files), ``hub`` (model ids to folders),
``random_checkpoint`` (random test checkpoints) and ``transformers_patch`` (our ops inside
transformers models). Nothing is imported here: ``import modeling.model.files`` stays torch-free."""
