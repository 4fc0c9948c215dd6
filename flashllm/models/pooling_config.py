"""A model directory's embedding pooling, read from its sentence-transformers files (modules.json, the Pooling
module's config.json), as sentence-transformers and vLLM read them.

Without those files a decoder model embeds as vLLM embeds one: the last token's state, normalized. The pipeline
must be one flashllm computes exactly: the transformer, one Pooling module of a supported mode, and optionally
Normalize; anything else (a Dense projection, max or weighted-mean pooling) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import read_json_object
from flashllm.sampling_params import Pooling

MAX_MODULES_BYTES = 64 * 1024
_TRANSFORMER, _POOLING, _NORMALIZE = (f"sentence_transformers.models.{n}" for n in ("Transformer", "Pooling",
                                                                                   "Normalize"))
# config.json's pooling_mode_* key -> Pooling.type
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def read_pooling(model_dir: str | Path) -> Pooling:
    """The directory's pooling (Pooling() when it has no sentence-transformers modules.json)."""
    root = Path(model_dir)
    path = root / "modules.json"
    if not root.is_dir() or not path.is_file():
        return Pooling()
    modules = _read_modules(path)
    kinds = [m.get("type") for m in modules]
    unknown = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown or kinds.count(_POOLING) != 1:
        raise ModelLoadError(f"{path}: flashllm embeds with the transformer, one Pooling module and optionally "
                             f"Normalize; this pipeline has {', '.join(map(str, kinds))}")
    (pooling,) = (m for m in modules if m.get("type") == _POOLING)
    config = read_json_object(_inside(root, pooling.get("path"), path) / "config.json", MAX_MODULES_BYTES)
    return Pooling(type=_mode(config, path), normalize=_NORMALIZE in kinds)


def _read_modules(path: Path) -> list[dict[str, Any]]:
    size = path.stat().st_size
    if size > MAX_MODULES_BYTES:
        raise ModelLoadError(f"{path} is larger than {MAX_MODULES_BYTES} bytes ({size}); refusing to parse it")
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({type(exc).__name__}); fix or re-download it") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{path} must hold a JSON list of module objects")
    return modules


def _inside(root: Path, relative: Any, source: Path) -> Path:
    """root / relative, which must stay inside root."""
    if not isinstance(relative, str):
        raise ModelLoadError(f"{source}: the Pooling module's path must be a string, got {relative!r:.60}")
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ModelLoadError(f"{source}: the Pooling module's path {relative!r:.60} leaves the model directory")
    return target


def _mode(config: dict[str, Any], source: Path) -> str:
    chosen = [kind for key, kind in _MODES.items() if config.get(key) is True]
    other = [key for key in _OTHER_MODES if config.get(key) is True]
    if len(chosen) != 1 or other:
        raise ModelLoadError(f"{source}: the Pooling module must use exactly one of {', '.join(_MODES)} (flashllm "
                             f"computes those); it sets {', '.join(other + [k for k in _MODES if config.get(k)])}")
    if config.get("include_prompt") is False:
        raise ModelLoadError(f"{source}: the Pooling module leaves an instruction prefix out (include_prompt false), "
                             "which flashllm cannot tell apart from the text; embed with a model that pools every token")
    return chosen[0]
