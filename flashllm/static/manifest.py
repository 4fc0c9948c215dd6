"""`flashllm_static.json`: what an exported static-graph directory holds, written at export, checked at load."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashllm.models.hf_config import ModelLoadError

MANIFEST_FILE = "flashllm_static.json"
MODEL_FILE = "model.onnx"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
DTYPES = ("float32", "float16")
FIXED_INPUTS = ("input_ids", "position_ids", "attention_mask")


class StaticModelError(ModelLoadError):
    """An exported directory flashllm cannot run; the message is one line saying what to do."""


def past_names(num_layers: int) -> list[str]:
    """Graph input names of the past KV cache: past_key_values.{i}.key / .value, layer by layer."""
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """Graph output names of the extended KV cache: present.{i}.key / .value, layer by layer."""
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


@dataclass(frozen=True)
class StaticManifest:
    """The manifest of an exported directory.

    inputs: input_ids, position_ids, attention_mask, then past_key_values.{i}.key/value;
    outputs: logits, then present.{i}.key/value. KV tensors are (batch, num_kv_heads, seq, head_dim)
    in `dtype`; logits are fp32. weights_sha256 identifies the safetensors the graph came from.
    files: every file of the directory the runner needs (the graph, its external data if any).
    """

    format_version: int
    architecture: str
    dtype: str
    opset: int
    exporter: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    inputs: list[str]
    outputs: list[str]
    files: list[str]
    weights_sha256: str

    def write(self, directory: Path) -> Path:
        """Write the manifest as JSON into `directory`; returns its path."""
        path = directory / MANIFEST_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        return path


def read_manifest(directory: str | Path) -> StaticManifest:
    """Load and validate `<directory>/flashllm_static.json`.

    Raises StaticModelError (one line) when the directory is not an export, the format version
    is not FORMAT_VERSION, a field is missing or mistyped, the names disagree with the layer
    count, or a listed file is missing.
    """
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise StaticModelError(f"{directory} has no {MANIFEST_FILE}, so it is not a static-graph export; "
                               f"create one with `flashllm export MODEL --format onnx --output {directory}`")
    raw = _read_json(path)
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise StaticModelError(f"{path}: format_version {version!r} is not supported (this flashllm reads "
                               f"{FORMAT_VERSION}); export the model again with this version")
    manifest = _typed(raw, path)
    _check_names(manifest, path)
    missing = [f for f in manifest.files if not _plain_file_inside(directory, f)]
    if missing:
        raise StaticModelError(f"{directory} lacks {', '.join(missing)} listed in {MANIFEST_FILE}; the export "
                               "is incomplete, run `flashllm export` again")
    return manifest


def _read_json(path: Path) -> dict[str, Any]:
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise StaticModelError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes; it is not a flashllm manifest")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StaticModelError(f"{path} is not valid JSON ({exc}); export the model again") from None
    if not isinstance(raw, dict):
        raise StaticModelError(f"{path} must hold a JSON object; export the model again")
    return raw


_FIELD_TYPES: dict[str, type] = {
    "format_version": int, "architecture": str, "dtype": str, "opset": int, "exporter": str,
    "num_layers": int, "num_kv_heads": int, "head_dim": int, "vocab_size": int,
    "inputs": list, "outputs": list, "files": list, "weights_sha256": str,
}


def _typed(raw: dict[str, Any], path: Path) -> StaticManifest:
    for name, kind in _FIELD_TYPES.items():
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StaticModelError(f"{path}: field {name!r} is {value!r}, expected a {kind.__name__}; "
                                   "export the model again")
        if kind is list and not all(isinstance(v, str) for v in value):
            raise StaticModelError(f"{path}: field {name!r} must list strings; export the model again")
    if raw["dtype"] not in DTYPES:
        raise StaticModelError(f"{path}: dtype {raw['dtype']!r} is not one of {', '.join(DTYPES)}")
    return StaticManifest(**{name: raw[name] for name in _FIELD_TYPES})


def _check_names(manifest: StaticManifest, path: Path) -> None:
    inputs = [*FIXED_INPUTS, *past_names(manifest.num_layers)]
    outputs = ["logits", *present_names(manifest.num_layers)]
    if manifest.inputs != inputs or manifest.outputs != outputs:
        raise StaticModelError(f"{path}: inputs/outputs do not match a {manifest.num_layers}-layer decoder step "
                               f"(expected inputs {inputs[:4]}..., outputs {outputs[:2]}...); export again")
    if MODEL_FILE not in manifest.files:
        raise StaticModelError(f"{path}: files must include {MODEL_FILE}; export the model again")


def _plain_file_inside(directory: Path, name: str) -> bool:
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return False
    path = directory / relative
    return path.is_file() and path.resolve().is_relative_to(directory.resolve())


def weights_sha256(weight_files: list[Path], config_file: Path) -> str:
    """sha256 over config.json and the weight files (names and bytes, in sorted name order)."""
    digest = hashlib.sha256()
    for path in [config_file, *sorted(weight_files, key=lambda p: p.name)]:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
