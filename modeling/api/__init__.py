"""The text API: ``llm`` (``LLM``: generate / chat / stream on text), ``checkpoint`` (a checkpoint's
config, tokenizer, chat template and generation defaults), ``tokenizer`` (``QwenTokenizer``).
Nothing is imported here."""
