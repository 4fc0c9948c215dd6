"""Read a Hugging Face `config.json`, check what every architecture shares, and let the architecture parse the rest."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from flashllm.models.builtin import BUILTIN_MODELS
from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import is_gguf_path, open_gguf
from flashllm.models.registry import ModelRegistry
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


class HFModelConfig(Protocol):
    """A parsed `config.json`, whatever the architecture: the fields the engine and loader read.

    Each architecture's `parse_config` (see `flashllm.models.base.CausalLM`) returns its own type
    with these fields (a frozen dataclass is simplest); `parse_hf_config` checks them after parsing.
    architecture: `architectures[0]`, exactly; vocab_size: rows of the embedding and the logits;
    head_dim: attention head size (the op table is resolved for it); max_position_embeddings: the
    longest context; torch_dtype: the checkpoint's declared dtype (None: not declared);
    quantization: a GPTQ / AWQ checkpoint's packing (None: float weights); bos/eos_token_id: a
    token id, a list of them, or None; tie_word_embeddings: the LM head shares the embedding;
    raw: the config.json dict; num_parameters: an estimate, bounded before anything is allocated.
    Optional: alibi (bool, absent means False): the attention adds ALiBi biases, so the op table is
    resolved for attention kernels that implement them (read through `uses_alibi`); attn_logit_softcapping
    (a positive float, absent or None: none): the attention caps its scores (Gemma 2), likewise; attention_sinks
    (bool) and moe_activation (str) likewise (`kernel_request`).
    """

    @property
    def architecture(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def torch_dtype(self) -> torch.dtype | None: ...
    @property
    def quantization(self) -> CheckpointQuant | None: ...
    @property
    def bos_token_id(self) -> int | list[int] | None: ...
    @property
    def eos_token_id(self) -> int | list[int] | None: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def raw(self) -> dict[str, Any]: ...
    @property
    def num_parameters(self) -> int: ...


# The HFModelConfig fields, in the order check_model_config reports a missing one.
GENERIC_FIELDS: tuple[str, ...] = (
    "architecture", "vocab_size", "head_dim", "max_position_embeddings", "torch_dtype", "quantization",
    "bos_token_id", "eos_token_id", "tie_word_embeddings", "raw", "num_parameters",
)


def load_hf_config(model_dir: str | Path, registry: ModelRegistry | None = None) -> HFModelConfig:
    """Read `<model_dir>/config.json` and parse it with its architecture's parser (see `parse_hf_config`).

    `model_dir` may also be a GGUF file: its architecture metadata maps to the same dict (models/gguf/config.py).
    """
    if is_gguf_path(model_dir):
        from flashllm.models.gguf.config import gguf_config_dict

        return parse_hf_config(gguf_config_dict(open_gguf(model_dir)), registry, source=Path(model_dir).name)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors)"
        )
    raw = read_json_object(path, MAX_CONFIG_BYTES)
    return parse_hf_config(raw, registry, source=str(path))


def read_json_object(path: Path, max_bytes: int) -> dict[str, Any]:
    """Parse a JSON object file of at most `max_bytes`; ModelLoadError (one line) otherwise."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ModelLoadError(f"{path} is larger than {max_bytes} bytes ({size}); refusing to parse it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); fix or re-download it") from None
    except RecursionError:  # json nests one Python frame per level: 100k `[` exhaust the stack
        raise ModelLoadError(f"{path} is nested too deeply to be a model file; fix or re-download it") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_hf_config(raw: Any, registry: ModelRegistry | None = None, source: str = "config.json") -> HFModelConfig:
    """Validate a config.json dict: the generic parts here, the rest by its architecture's `parse_config`.

    registry: the architectures that may load (None: flashllm's built-in ones; the engine passes
    the one its plugins filled). Raises ModelLoadError (one line) on a missing `architectures`
    list, an architecture not in `registry`, anything its parser refuses, or a parsed config whose
    generic fields are missing or past the sanity bounds. `auto_map` is ignored with a warning.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source} must hold a JSON object, got {type(raw).__name__}")
    if "auto_map" in raw:
        logger.warning(
            "%s has auto_map (custom modeling code); flashllm never executes remote code and "
            "ignores it, using its built-in implementation of the architecture",
            source,
        )
    registry = registry if registry is not None else _builtin_registry()
    architecture = config_architecture(raw, source, registry.architectures())
    model_cls = registry.resolve(architecture)
    parse = getattr(model_cls, "parse_config", None)
    if not callable(parse):
        raise ModelLoadError(
            f"{model_cls.__module__}.{model_cls.__qualname__}, registered for {architecture!r}, has no "
            "parse_config classmethod; derive it from flashllm.models.base.CausalLM"
        )
    config = parse(raw, source)
    check_model_config(config, architecture, source)
    return config


def _builtin_registry() -> ModelRegistry:
    return ModelRegistry.from_targets(BUILTIN_MODELS)


def config_architecture(raw: dict[str, Any], source: str, supported: Iterable[str] | None = None) -> str:
    """`architectures[0]` of a config.json dict; ModelLoadError when absent or not in `supported` (when given)."""
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


def check_model_config(config: Any, architecture: str, source: str) -> None:
    """The generic bounds every parsed config must meet before its model is allocated (see HFModelConfig)."""
    missing = [name for name in GENERIC_FIELDS if not hasattr(config, name)]
    if missing:
        raise ModelLoadError(
            f"the {architecture} parser returned a {type(config).__name__} without {', '.join(missing)} ({source}); "
            f"every architecture's config must provide: {', '.join(GENERIC_FIELDS)} (see flashllm.models.base)"
        )
    if config.architecture != architecture:
        raise ModelLoadError(f"the {architecture} parser returned architecture={config.architecture!r} ({source}); "
                             "it must be config.json's architectures[0]")
    bounds = {"vocab_size": MAX_VOCAB_SIZE, "head_dim": MAX_HEAD_DIM, "max_position_embeddings": MAX_POSITION_EMBEDDINGS}
    for name, maximum in bounds.items():
        positive_int({name: getattr(config, name)}, name, None, maximum, source)
    total = config.num_parameters
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ModelLoadError(f"{source}: the parsed num_parameters={total!r} must be a non-negative int")
    if total > MAX_NUM_PARAMETERS:
        raise ModelLoadError(
            f"{source} describes ~{total:.3g} parameters, above the {MAX_NUM_PARAMETERS:.0e} "
            "limit; the config is corrupt or not a model flashllm can run"
        )
    if config.torch_dtype is not None and config.torch_dtype not in _DTYPES.values():
        raise ModelLoadError(f"{source}: torch_dtype={config.torch_dtype} must be one of {sorted(_DTYPES)} or None")
    if config.quantization is not None and not isinstance(config.quantization, CheckpointQuant):
        raise ModelLoadError(f"{source}: the parsed quantization must be a CheckpointQuant or None, "
                             f"got {type(config.quantization).__name__}")
    if not isinstance(getattr(config, "alibi", False), bool):
        raise ModelLoadError(f"{source}: the parsed alibi must be a bool, got {config.alibi!r}")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, float) or not softcap > 0):
        raise ModelLoadError(f"{source}: the parsed attn_logit_softcapping must be a positive float or None, "
                             f"got {softcap!r}")
    if not isinstance(config.tie_word_embeddings, bool) or not isinstance(config.raw, dict):
        raise ModelLoadError(f"{source}: the parsed tie_word_embeddings must be a bool and raw the config.json dict")
    for name in ("bos_token_id", "eos_token_id"):
        token_ids({name: getattr(config, name)}, name, source)


def uses_alibi(config: HFModelConfig) -> bool:
    """Whether the model's attention adds ALiBi biases: the parsed config's optional `alibi` field."""
    return getattr(config, "alibi", False) is True


def kernel_request(config: HFModelConfig) -> dict[str, Any]:
    """The OpRequest fields the model needs kernels to implement: `alibi` (uses_alibi), `softcap` (the parsed
    config's optional attn_logit_softcapping is set), `sinks` (its optional attention_sinks is true: gpt-oss) and
    `moe_activation` (its optional moe_activation, "silu" where absent)."""
    return {"alibi": uses_alibi(config), "softcap": getattr(config, "attn_logit_softcapping", None) is not None,
            "sinks": getattr(config, "attention_sinks", False) is True,
            "moe_activation": getattr(config, "moe_activation", "silu")}


def positive_int(raw: dict[str, Any], key: str, default: int | None, maximum: int, source: str) -> int:
    """`raw[key]` as an int in 1..maximum; `default` when absent (None: the field is required)."""
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


def positive_float(raw: dict[str, Any], key: str, default: float, source: str) -> float:
    """`raw[key]` as a finite float > 0; `default` when absent or null."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{source}: {key}={value!r} must be a number")
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{source}: {key}={value!r} must be a finite positive number")
    return float(value)


def check_rope(rotary_dim: int, theta: float, scaling: dict | None, max_position: int, source: str) -> None:
    """Compute the rope frequencies once (rotary_dim / 2 numbers) so a bad rope_scaling fails here."""
    try:
        inv_freq, _ = rope_inv_freq(rotary_dim, theta, scaling, max_position)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ModelLoadError(f"{source}: invalid rope settings {scaling!r}: {exc}") from None
    if not torch.isfinite(inv_freq).all():
        raise ModelLoadError(f"{source}: rope settings {scaling!r} (rope_theta={theta}) give non-finite frequencies")


def partial_rotary(raw: dict[str, Any], head_dim: int, default: float, source: str) -> tuple[int, dict[str, Any]]:
    """(rotary_dim, config without partial_rotary_factor in its rope dict): RoPE turns the first
    partial_rotary_factor x head_dim features of each head. transformers 5 writes the factor inside
    rope_parameters and prefers it there; older versions write it at the top level; `default` where neither does."""
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = raw.get(key)
    inner = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = positive_float({"partial_rotary_factor": raw.get("partial_rotary_factor") if inner is None else inner},
                            "partial_rotary_factor", default, source)
    rotary_dim = int(head_dim * factor)
    if factor > 1.0 or rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ModelLoadError(f"{source}: partial_rotary_factor={factor} with head_dim={head_dim} gives rotary_dim="
                             f"{rotary_dim}; expected a factor in (0, 1] giving a positive even rotary_dim")
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        raw = {**raw, key: {k: v for k, v in rope.items() if k != "partial_rotary_factor"}}
    return rotary_dim, raw


def flag(raw: dict[str, Any], key: str, source: str) -> bool:
    """`raw[key]` as a JSON boolean; False when absent or null."""
    value = raw.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key}={value!r} must be true or false")
    return value


def token_ids(raw: dict[str, Any], key: str, source: str) -> int | list[int] | None:
    """`raw[key]` as a token id >= 0, a list of them, or None (e.g. bos_token_id, eos_token_id)."""
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
    theta = positive_float(theta_src, "rope_theta", 10000.0, source)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if not isinstance(rope_type, str):
        raise ModelLoadError(f"{source}: rope type {rope_type!r} in {key} must be a string")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def checkpoint_dtype(raw: dict[str, Any], source: str) -> torch.dtype | None:
    """The checkpoint's declared `dtype` (or legacy `torch_dtype`); None, with a warning, when unknown."""
    name = raw.get("dtype", raw.get("torch_dtype"))
    if name is None:
        return None
    if not isinstance(name, str) or name not in _DTYPES:
        logger.warning("%s: unrecognized checkpoint dtype %r; treating it as unknown", source, name)
        return None
    return _DTYPES[name]


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
    sym, desc_act = flag(qc, "sym", where) if "sym" in qc else True, flag(qc, "desc_act", where)
    if bits == 8 and not sym:
        raise ModelLoadError(f"{where}: asymmetric 8-bit GPTQ is not supported (flashllm's w8a16 is symmetric); "
                             "use a sym=true or a 4-bit checkpoint")
    if flag(qc, "lm_head", where) or qc.get("dynamic"):
        raise ModelLoadError(f"{where}: a quantized lm_head or per-module 'dynamic' settings are not supported; "
                             "flashllm loads checkpoints that quantize every decoder linear the same way")
    return CheckpointQuant("gptq", bits, group_size, desc_act, sym, fmt)


def _awq_config(qc: dict[str, Any], bits: int, group_size: int, where: str) -> CheckpointQuant:
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() not in PREQUANTIZED_FORMATS["awq"]:
        raise ModelLoadError(f"{where}: version={version!r} is not supported; flashllm reads AWQ's 'gemm' packing "
                             "(re-export GEMV/Marlin/ExLlama checkpoints as gemm)")
    if not (flag(qc, "zero_point", where) if "zero_point" in qc else True):
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
