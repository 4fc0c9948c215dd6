"""Static-graph mode: export a model to ONNX once (`flashllm export`), then run it with onnxruntime."""

from __future__ import annotations

from flashllm.static.manifest import StaticManifest, StaticModelError, read_manifest

__all__ = ["StaticLLM", "StaticManifest", "StaticModelError", "export_onnx", "read_manifest"]


def __getattr__(name: str) -> object:
    # StaticLLM and export_onnx pull in onnxruntime / the exporter: import them on first use only
    if name == "StaticLLM":
        from flashllm.static.runner import StaticLLM

        return StaticLLM
    if name == "export_onnx":
        from flashllm.static.export import export_onnx

        return export_onnx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
