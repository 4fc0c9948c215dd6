"""Parse and validate a Hugging Face `config.json` into a typed view, before anything is allocated."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashllm.ops.rope_cache import rope_inv_freq

logger = logging.getLogger(__name__)

# Sizes past these are not a model flashllm could run; refusing them early keeps a hostile or
# corrupted config.json from triggering a huge allocation.
MAX_HIDDEN_SIZE = 65536
MAX_INTERMEDIATE_SIZE = 4 * 65536
MAX_NUM_LAYERS = 512
MAX_NUM_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB_SIZE = 4 * 1024 * 1024
MAX_POSITION_EMBEDDINGS = 16 * 1024 * 1024
MAX_NUM_PARAMETERS = 2 * 10**12
MAX_CONFIG_BYTES = 4 * 1024 * 1024

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelLoadError(ValueError):
    """A model directory or config that flashllm refuses to load; the message is one clear line."""


# quant_method -> the checkpoint formats flashllm reads for it (GPTQ v1 stores zero points minus one)
PREQUANTIZED_FORMATS: dict[str, tuple[str, ...]] = {"gptq": ("gptq", "gptq_v2"), "awq": ("gemm",)}
PREQUANTIZED_BITS: dict[str, tuple[int, ...]] = {"gptq": (4, 8), "awq": (4,)}


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """A pre-quantized (GPTQ / AWQ) checkpoint's `quantization_config`, validated.

    method: "gptq" | "awq"; bits: 4 (or 8 for symmetric GPTQ); group_size: -1 or a divisor of
    every linear layer's in_features; desc_act: GPTQ act order (g_idx permutes the groups);
    sym: GPTQ symmetric zero points; checkpoint_format: "gptq" (v1: zero points stored minus
    one) | "gptq_v2" for GPTQ, "gemm" (AWQ's GEMM packing) for AWQ.
    """

    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"

    @property
    def scheme(self) -> str:
        """The QuantizedWeight scheme the layers hold: "w4a16" or "w8a16"."""
        return "w4a16" if self.bits == 4 else "w8a16"


@dataclass(frozen=True, slots=True)
class HFModelConfig:
    """The fields of a decoder-only HF config that flashllm models use, validated.

    `rope_scaling` is None for plain RoPE, else an HF-form dict with a "rope_type" key (e.g.
    {"rope_type": "llama3", "factor": 8.0, ...}), the same layout whatever config.json used.
    `torch_dtype` is the checkpoint's declared dtype (None when config.json does not say).
    `sliding_windows[i]` is the attention window of layer i (None = full attention).
    `quantization` describes a GPTQ / AWQ checkpoint's packed linear weights (None: float).
    """

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    sliding_windows: tuple[int | None, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: CheckpointQuant | None = None


def load_hf_config(
    model_dir: str | Path, supported_architectures: Iterable[str] | None = None
) -> HFModelConfig:
    """Read `<model_dir>/config.json` and validate it (see `parse_hf_config`)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors)"
        )
    raw = read_json_object(path, MAX_CONFIG_BYTES)
    return parse_hf_config(raw, supported_architectures, source=str(path))


def read_json_object(path: Path, max_bytes: int) -> dict[str, Any]:
    """Parse a JSON object file of at most `max_bytes`; ModelLoadError (one line) otherwise."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ModelLoadError(f"{path} is larger than {max_bytes} bytes ({size}); refusing to parse it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_hf_config(
    raw: Any, supported_architectures: Iterable[str] | None = None, source: str = "config.json"
) -> HFModelConfig:
    """Validate a config.json dict and return its typed view.

    Raises ModelLoadError (one line) on a missing or non-positive required field, an absurd size,
    inconsistent head counts, an unsupported activation, or an architecture not in
    `supported_architectures` (when given). `auto_map` is ignored with a warning.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source} must hold a JSON object, got {type(raw).__name__}")
    if "auto_map" in raw:
        logger.warning(
            "%s has auto_map (custom modeling code); flashllm never executes remote code and "
            "ignores it, using its built-in implementation of the architecture",
            source,
        )
    architecture = _architecture(raw, supported_architectures, source)
    sizes = _sizes(raw, source)
    rope_theta, rope_scaling = normalize_rope(raw, source)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(
            f"{source}: hidden_act={hidden_act!r} is not supported; flashllm's gated MLP "
            "implements 'silu' only"
        )
    rotary_dim = _rotary_dim(raw, sizes["head_dim"], source)
    _check_rope(rotary_dim, rope_theta, rope_scaling, sizes["max_position_embeddings"], source)
    return HFModelConfig(
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6, source),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rotary_dim=rotary_dim,
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", source),
        attention_bias=_flag(raw, "attention_bias", source),
        mlp_bias=_flag(raw, "mlp_bias", source),
        hidden_act=hidden_act,
        torch_dtype=_checkpoint_dtype(raw, source),
        bos_token_id=_token_ids(raw, "bos_token_id", source),
        eos_token_id=_token_ids(raw, "eos_token_id", source),
        sliding_windows=_sliding_windows(raw, sizes["num_hidden_layers"], source),
        raw=raw,
        quantization=parse_quantization_config(raw.get("quantization_config"), _linear_inputs(sizes), source),
        **sizes,
    )


def _architecture(raw: dict[str, Any], supported: Iterable[str] | None, source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelLoadError(
            f"{source} has no 'architectures' list; expected e.g. "
            '"architectures": ["LlamaForCausalLM"]'
        )
    arch = archs[0]
    if supported is not None:
        supported = sorted(supported)
        if arch not in supported:
            raise ModelLoadError(
                f"architecture {arch!r} ({source}) is not supported; supported: "
                f"{', '.join(supported)}; a plugin can add more via flashllm_register_models"
            )
    return arch


def _sizes(raw: dict[str, Any], source: str) -> dict[str, int]:
    hidden = _positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    num_heads = _positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    num_kv_heads = _positive_int(raw, "num_key_value_heads", num_heads, MAX_NUM_HEADS, source)
    if raw.get("head_dim") is None and hidden % num_heads != 0:
        raise ModelLoadError(
            f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={num_heads}"
        )
    head_dim = _positive_int(raw, "head_dim", hidden // num_heads, MAX_HEAD_DIM, source)
    if num_heads % num_kv_heads != 0:
        raise ModelLoadError(
            f"{source}: num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    sizes = {
        "hidden_size": hidden,
        "intermediate_size": _positive_int(
            raw, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source
        ),
        "num_hidden_layers": _positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": _positive_int(raw, "vocab_size", None, MAX_VOCAB_SIZE, source),
        "max_position_embeddings": _positive_int(
            raw, "max_position_embeddings", 2048, MAX_POSITION_EMBEDDINGS, source
        ),
    }
    _check_parameter_count(sizes, source)
    return sizes


def _check_parameter_count(s: dict[str, int], source: str) -> None:
    attn = s["hidden_size"] * s["head_dim"] * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    mlp = 3 * s["hidden_size"] * s["intermediate_size"]
    total = s["num_hidden_layers"] * (attn + mlp) + 2 * s["vocab_size"] * s["hidden_size"]
    if total > MAX_NUM_PARAMETERS:
        raise ModelLoadError(
            f"{source} describes ~{total:.3g} parameters, above the {MAX_NUM_PARAMETERS:.0e} "
            "limit; the config is corrupt or not a model flashllm can run"
        )


def _positive_int(
    raw: dict[str, Any], key: str, default: int | None, maximum: int, source: str
) -> int:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{source} is missing required field {key!r} (a positive int)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: {key}={value!r} must be a positive int")
    if value > maximum:
        raise ModelLoadError(f"{source}: {key}={value} exceeds the sanity limit {maximum}")
    return value


def _positive_float(raw: dict[str, Any], key: str, default: float, source: str) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{source}: {key}={value!r} must be a number")
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{source}: {key}={value!r} must be a finite positive number")
    return float(value)


def _rotary_dim(raw: dict[str, Any], head_dim: int, source: str) -> int:
    partial = _positive_float(raw, "partial_rotary_factor", 1.0, source)
    rotary_dim = int(head_dim * partial)
    if partial > 1.0 or rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ModelLoadError(
            f"{source}: partial_rotary_factor={partial} with head_dim={head_dim} gives rotary_dim="
            f"{rotary_dim}; expected a factor in (0, 1] giving a positive even rotary_dim"
        )
    return rotary_dim


def _check_rope(rotary_dim: int, theta: float, scaling: dict | None, max_position: int, source: str) -> None:
    """Compute the rope frequencies once (rotary_dim / 2 numbers) so a bad rope_scaling fails here."""
    try:
        inv_freq, _ = rope_inv_freq(rotary_dim, theta, scaling, max_position)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ModelLoadError(f"{source}: invalid rope settings {scaling!r}: {exc}") from None
    if not torch.isfinite(inv_freq).all():
        raise ModelLoadError(f"{source}: rope settings {scaling!r} (rope_theta={theta}) give non-finite frequencies")


def _flag(raw: dict[str, Any], key: str, source: str) -> bool:
    value = raw.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key}={value!r} must be true or false")
    return value


def _token_ids(raw: dict[str, Any], key: str, source: str) -> int | list[int] | None:
    value = raw.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return value
    raise ModelLoadError(f"{source}: {key}={value!r} must be a token id, a list of token ids, or null")


def normalize_rope(raw: dict[str, Any], source: str = "config.json") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout.

    Legacy layout: top-level `rope_theta` and `rope_scaling` ({"type" or "rope_type": ...}).
    transformers-5 layout: `rope_parameters` = {"rope_theta": ..., "rope_type": ..., ...}.
    rope_scaling comes back None for default RoPE, else a copy with "rope_type" set and no
    "type" or "rope_theta" keys.
    """
    params = raw.get("rope_parameters")
    key = "rope_parameters" if params else "rope_scaling"
    scaling = params if params else raw.get("rope_scaling")
    if scaling is None:
        scaling = {}
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: {key} must be an object or null, got {scaling!r}")
    scaling = dict(scaling)
    theta_src = {"rope_theta": scaling.pop("rope_theta", raw.get("rope_theta"))}
    theta = _positive_float(theta_src, "rope_theta", 10000.0, source)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if not isinstance(rope_type, str):
        raise ModelLoadError(f"{source}: rope type {rope_type!r} in {key} must be a string")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def _checkpoint_dtype(raw: dict[str, Any], source: str) -> torch.dtype | None:
    name = raw.get("dtype", raw.get("torch_dtype"))
    if name is None:
        return None
    if not isinstance(name, str) or name not in _DTYPES:
        logger.warning("%s: unrecognized checkpoint dtype %r; treating it as unknown", source, name)
        return None
    return _DTYPES[name]


def _sliding_windows(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    enabled = raw.get("use_sliding_window", window is not None)
    if not enabled or window is None:
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Qwen2's legacy rule: layers from max_window_layers on use the window.
    first = raw.get("max_window_layers", 0)
    return tuple(window if i >= first else None for i in range(num_layers))


def _linear_inputs(sizes: dict[str, int]) -> tuple[int, ...]:
    """in_features of the decoder's linear layers: hidden (qkv, gate_up), heads (o), intermediate (down)."""
    return sizes["hidden_size"], sizes["num_attention_heads"] * sizes["head_dim"], sizes["intermediate_size"]


def parse_quantization_config(qc: Any, in_features: tuple[int, ...] = (), source: str = "config.json"
                              ) -> CheckpointQuant | None:
    """`quantization_config` -> CheckpointQuant (None when absent), refusing what flashllm cannot load.

    GPTQ: bits 4 or 8 (8 only with sym), group_size, desc_act, sym, checkpoint_format (or
    format) gptq | gptq_v2; a quantized lm_head or per-module `dynamic` overrides are refused.
    AWQ: bits (w_bit) 4, group_size (q_group_size), zero_point true, version gemm, no
    modules_to_not_convert. group_size must be -1 or divide every entry of `in_features`.
    """
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in PREQUANTIZED_FORMATS:
        raise ModelLoadError(
            f"{source}: quantization_config.quant_method={method!r} is not supported; flashllm loads "
            f"{' and '.join(PREQUANTIZED_FORMATS)} checkpoints (or a float one quantized with --quant_type)"
        )
    where = f"{source}: {method} quantization_config"
    bits = _quant_int(qc, ("bits", "w_bit"), None, where)
    if bits not in PREQUANTIZED_BITS[method]:
        raise ModelLoadError(f"{where}: bits={bits} is not supported; flashllm loads bits in {PREQUANTIZED_BITS[method]}")
    group_size = _quant_int(qc, ("group_size", "q_group_size"), -1, where)
    if group_size != -1 and not 2 <= group_size <= MAX_INTERMEDIATE_SIZE:
        raise ModelLoadError(f"{where}: group_size={group_size} must be -1 or in 2..{MAX_INTERMEDIATE_SIZE}")
    bad = [k for k in in_features if group_size != -1 and k % group_size]
    if bad:
        raise ModelLoadError(f"{where}: group_size={group_size} does not divide in_features {bad[0]}; "
                             "flashllm needs equal groups")
    if method == "awq":
        return _awq_config(qc, bits, group_size, where)
    return _gptq_config(qc, bits, group_size, where)


def _gptq_config(qc: dict[str, Any], bits: int, group_size: int, where: str) -> CheckpointQuant:
    fmt = qc.get("checkpoint_format", qc.get("format")) or "gptq"
    if fmt not in PREQUANTIZED_FORMATS["gptq"]:
        raise ModelLoadError(f"{where}: checkpoint_format={fmt!r} is not supported; expected one of "
                             f"{PREQUANTIZED_FORMATS['gptq']} (convert other layouts with GPTQModel first)")
    sym, desc_act = _flag(qc, "sym", where) if "sym" in qc else True, _flag(qc, "desc_act", where)
    if bits == 8 and not sym:
        raise ModelLoadError(f"{where}: asymmetric 8-bit GPTQ is not supported (flashllm's w8a16 is symmetric); "
                             "use a sym=true or a 4-bit checkpoint")
    if _flag(qc, "lm_head", where) or qc.get("dynamic"):
        raise ModelLoadError(f"{where}: a quantized lm_head or per-module 'dynamic' settings are not supported; "
                             "flashllm loads checkpoints that quantize every decoder linear the same way")
    return CheckpointQuant("gptq", bits, group_size, desc_act, sym, fmt)


def _awq_config(qc: dict[str, Any], bits: int, group_size: int, where: str) -> CheckpointQuant:
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() not in PREQUANTIZED_FORMATS["awq"]:
        raise ModelLoadError(f"{where}: version={version!r} is not supported; flashllm reads AWQ's 'gemm' packing "
                             "(re-export GEMV/Marlin/ExLlama checkpoints as gemm)")
    if not (_flag(qc, "zero_point", where) if "zero_point" in qc else True):
        raise ModelLoadError(f"{where}: zero_point=false is not supported; flashllm reads AWQ with zero points")
    if qc.get("modules_to_not_convert"):
        raise ModelLoadError(f"{where}: modules_to_not_convert={qc['modules_to_not_convert']!r} is not supported; "
                             "flashllm loads AWQ checkpoints that quantize every decoder linear")
    return CheckpointQuant("awq", bits, group_size, sym=False, checkpoint_format="gemm")


def _quant_int(qc: dict[str, Any], keys: tuple[str, ...], default: int | None, where: str) -> int:
    value = next((qc[k] for k in keys if k in qc), default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{where}: {keys[0]}={value!r} must be an integer")
    return value
