"""The default model's trainer (``python -m modeling.train``)."""

from .trainer import *  # noqa: F401,F403
