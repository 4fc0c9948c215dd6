"""flashllm: LLM inference on any device through a pluggable backend registry."""

from __future__ import annotations

from typing import Any

from flashllm.registry.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "AutoModel", "hookimpl", "__version__"]

# Heavy pieces load on first use so `import flashllm` (and plugin discovery) stays cheap.
_LAZY = {
    "LLM": "flashllm.llm",
    "AutoModel": "flashllm.auto_model",
    "SamplingParams": "flashllm.sampling_params",
    "LoRARequest": "flashllm.lora.manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flashllm' has no attribute {name!r}")
