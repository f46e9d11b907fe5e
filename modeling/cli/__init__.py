"""The command line ``python -m modeling.generate`` (``qwen-generate``). Nothing is imported here:
the command handles Ctrl-C and bad input while torch is still loading."""
