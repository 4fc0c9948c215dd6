"""ModelLoadError, in a module of its own so that hf_config and the model registry can both raise it."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory or config that flashllm refuses to load; the message is one clear line."""
