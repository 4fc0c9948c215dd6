"""The exported decoder step in an onnxruntime session, run through IOBinding so the KV cache stays in onnxruntime."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flashllm.static.manifest import FIXED_INPUTS, MODEL_FILE, StaticManifest, StaticModelError

logger = logging.getLogger(__name__)

DEVICE_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# onnxruntime's OrtValue device names, by the execution provider that runs the graph
PROVIDER_DEVICES = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}

KVCache = list[Any]  # one OrtValue per graph past input: key_0, value_0, key_1, ... each (B, Hk, S, D)


def onnxruntime_module() -> Any:
    """Import onnxruntime, or raise StaticModelError naming the extra to install."""
    try:
        import onnxruntime
    except ImportError:
        raise StaticModelError("static mode needs onnxruntime, which is not installed; "
                               "run `pip install 'flashllm[onnx]'`") from None
    return onnxruntime


def select_providers(device: str, available: Sequence[str]) -> list[Any]:
    """onnxruntime execution providers for --device auto | cpu | cuda | cuda:N.

    auto: CUDA when onnxruntime has it, else CPU; cuda:N passes device_id N to the CUDA provider.
    An explicit device whose provider is missing is a StaticModelError naming the package to install.
    """
    kind, _, index = device.partition(":")
    if kind == "auto":
        kind = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if kind not in DEVICE_PROVIDERS or (index and not (kind == "cuda" and index.isdigit())):
        raise StaticModelError(f"--device {device!r} is not supported in static mode; use auto, cpu, cuda or cuda:N")
    providers: list[Any] = list(DEVICE_PROVIDERS[kind])
    if providers[0] not in available:
        raise StaticModelError(f"--device {device} needs onnxruntime's {providers[0]}, which this onnxruntime "
                               f"lacks (it has {', '.join(available)}); install onnxruntime-gpu")
    if index:
        providers[0] = (providers[0], {"device_id": int(index)})
    return providers


class StaticGraph:
    """One onnxruntime session over `model.onnx`: a decoder step with past KV in, present KV out.

    Steps run through IOBinding: the present KV the graph returns stays in onnxruntime's memory
    (host, or the GPU under the CUDA provider) and is bound as the next step's past, so a decode
    step moves only ids, positions, the mask and the last position's logits across Python. The
    graph itself still concatenates past and new keys each step (it was exported with growing
    past/present tensors), so a step costs O(context) copies inside onnxruntime.
    """

    def __init__(self, model_dir: str | Path, manifest: StaticManifest, device: str = "auto") -> None:
        ort = onnxruntime_module()
        self.ort = ort
        self.manifest = manifest
        path = Path(model_dir) / MODEL_FILE
        providers = select_providers(device, ort.get_available_providers())
        self.session = ort.InferenceSession(str(path), providers=providers)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != manifest.inputs or outputs != manifest.outputs:
            raise StaticModelError(f"{path} does not match its manifest (graph inputs {inputs[:4]}..., "
                                   f"outputs {outputs[:2]}...); export the model again")
        self.provider = self.session.get_providers()[0]
        first = providers[0]
        self.device_id = first[1]["device_id"] if isinstance(first, tuple) else 0
        self.device_type = PROVIDER_DEVICES.get(self.provider, "cpu")
        logger.info("static mode: %s runs on onnxruntime's %s", model_dir, self.provider)

    @property
    def num_kv_tensors(self) -> int:
        return 2 * self.manifest.num_layers

    def empty_cache(self, batch: int) -> KVCache:
        """Zero-length past KV for `batch` rows: (batch, Hk, 0, D) per layer, key then value."""
        m = self.manifest
        empty = np.zeros((batch, m.num_kv_heads, 0, m.head_dim), dtype=NUMPY_DTYPES[m.dtype])
        return [self._to_device(empty) for _ in range(self.num_kv_tensors)]

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
            past: KVCache) -> tuple[np.ndarray, KVCache]:
        """One graph run.

        input_ids, position_ids (B, T) int64; attention_mask (B, S + T) int64 (0 = left padding);
        past: the cache of the previous run (or empty_cache). Returns the last position's logits
        (B, V) fp32 as numpy and the present cache (B, Hk, S + T, D), left in onnxruntime's memory.
        """
        binding = self.session.io_binding()
        for name, array in zip(FIXED_INPUTS, (input_ids, position_ids, attention_mask), strict=True):
            binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        for name, value in zip(self.manifest.inputs[len(FIXED_INPUTS):], past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")  # the sampler reads logits on the host
        for name in self.manifest.outputs[1:]:
            binding.bind_output(name, self.device_type, self.device_id)
        self.session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        return logits.numpy()[:, -1], present

    def select(self, cache: KVCache, rows: Sequence[int], start: int = 0) -> KVCache:
        """Rows `rows` of the cache, from sequence position `start` on (the other rows left the batch)."""
        return [self._to_device(np.ascontiguousarray(value.numpy()[rows, :, start:])) for value in cache]

    def _to_device(self, array: np.ndarray) -> Any:
        return self.ort.OrtValue.ortvalue_from_numpy(array, self.device_type, self.device_id)
