"""What static-graph mode can run: the `onnx` row of the capability matrix and of `flashllm devices`."""

# Data about flashllm.static kept beside the matrix that renders it: static/ builds on the engine,
# which sits above the registry, so the registry cannot import it (pyproject [tool.importlinter]).

from __future__ import annotations

import importlib.util

ROW_NAME = "onnx"
ROW_KIND = "onnxruntime static graph"
# tests/static (nox -s onnx) runs exported graphs in onnxruntime: logits against transformers,
# generation against the dynamic engine, the float16 graph against the float32 one
PROOF = "conformance"
# onnxruntime execution providers static mode selects (graph.select_providers)
PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")

# precision key (registry.precision.PRECISIONS) of each dtype the exporter writes (manifest.DTYPES;
# tests/unit/test_matrix_static.py keeps the two in step)
EXPORTED_PRECISIONS = {"float32": "fp32", "float16": "fp16"}
# why every other precision is not exported; the matrix shows these, so a new one must say why
NOT_EXPORTED: dict[str, str] = {
    "bf16": "onnxruntime's CPU provider has no bfloat16 kernels (MatMul, Add, Softmax)",
    "w8a16": "quantized weights would need onnxruntime's contrib ops (MatMulNBits), which the exporter does not emit",
    "w4a16": "quantized weights would need onnxruntime's contrib ops (MatMulNBits), which the exporter does not emit",
    "a8w8": "int8 activations would need QDQ / MatMulInteger nodes, which the exporter does not emit",
    "fp8": "the exporter writes float32 / float16 weights; fp8 matmuls would need a float8 graph and the CUDA provider",
    "kv_int8": "the graph's past/present KV are float32 or float16 tensors",
    "gguf": "GGUF's quantized blocks would need onnxruntime's contrib ops (MatMulNBits), which the exporter does not emit",
}
NOTES = ("not a registry backend: onnxruntime (CUDA provider when present, else CPU) runs the whole graph "
         "`flashllm export --format onnx` writes, with `--mode static`; it exports float32 and float16 only "
         "(bf16: no onnxruntime CPU kernels; quantized weights, fp8 and int8 KV: ops the exporter does not emit)")


def onnxruntime_availability() -> tuple[bool, str]:
    """(whether static mode can run here, why / with which onnxruntime providers).

    Imports onnxruntime (not at module import: `flashllm devices` and the matrix stay cheap).
    """
    if importlib.util.find_spec("onnxruntime") is None:
        return False, "onnxruntime is not installed; pip install 'flashllm[onnx]'"
    try:
        import onnxruntime
    except (ImportError, OSError) as exc:
        return False, f"onnxruntime is installed but does not import ({exc}); reinstall it"
    usable = [p for p in PROVIDERS if p in onnxruntime.get_available_providers()]
    if not usable:
        return False, f"onnxruntime {onnxruntime.__version__} has none of {', '.join(PROVIDERS)}"
    reason = f"onnxruntime {onnxruntime.__version__}: {', '.join(usable)}"
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        reason += f"; `flashllm export` also needs {' and '.join(missing)} (pip install 'flashllm[onnx]')"
    return True, reason
