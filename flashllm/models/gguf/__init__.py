"""GGUF files (llama.cpp / Ollama): reader, config mapping, tokenizer and tensors, loaded like a model directory."""

from __future__ import annotations

from flashllm.models.gguf.reader import is_gguf_path, open_gguf

__all__ = ["is_gguf_path", "open_gguf"]
