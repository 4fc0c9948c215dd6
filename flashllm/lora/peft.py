"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors), checked against the base model."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

__all__ = ["AdapterConfig", "LoRAAdapter", "LoRAError", "LoRAWeights", "load_adapter", "read_adapter_config"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_RANK = 1024
_PREFIX = "base_model.model."
_FLOAT_DTYPES = {"F32", "F16", "BF16"}
# adapter_config.json settings that change the computation beyond W + scale * B @ A: refused, never ignored
_REFUSED_TRUTHY = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layouts)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "use_qalora": "QALoRA",
    "megatron_config": "Megatron-sharded LoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow adapter routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
}


class LoRAError(ValueError):
    """An adapter that cannot be used; the message is one line saying what and what to do."""


@dataclass(frozen=True)
class AdapterConfig:
    """What flashllm uses of adapter_config.json: rank r, lora_alpha, use_rslora and the resulting scale."""

    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class LoRAWeights:
    """One adapted projection: y += scale * (x @ lora_a.T) @ lora_b.T.

    lora_a (r, in_features) and lora_b (out_features, r), float32 on the CPU.
    """

    lora_a: Tensor
    lora_b: Tensor
    scale: float

    def delta(self) -> Tensor:
        """scale * B @ A: (out_features, in_features) float32, what merging adds to the base weight."""
        return self.scale * (self.lora_b @ self.lora_a)


@dataclass
class LoRAAdapter:
    """A loaded adapter: {checkpoint weight name (e.g. `model.layers.0.self_attn.q_proj.weight`): LoRAWeights}.

    A target named by a fused module (flashllm's `qkv_proj` / `gate_up_proj`) is already split into
    the checkpoint projections it packs, each with its rows of lora_b and the shared lora_a.
    """

    path: Path
    config: AdapterConfig
    weights: dict[str, LoRAWeights] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The adapter's rank r."""
        return self.config.rank


def _refuse(adapter_dir: Path, what: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {adapter_dir}: {what}")


def read_adapter_config(adapter_dir: str | Path, max_rank: int = MAX_RANK) -> AdapterConfig:
    """Parse and check `adapter_dir/adapter_config.json`; LoRAError (one line) on anything flashllm cannot apply."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise _refuse(adapter_dir, f"no {CONFIG_FILE}; expected a PEFT LoRA directory (save_pretrained output)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise _refuse(adapter_dir, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(adapter_dir, f"{CONFIG_FILE} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise _refuse(adapter_dir, f"{CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(adapter_dir, f"peft_type is {raw.get('peft_type')!r}; only LORA adapters load")
    for key, what in _REFUSED_TRUTHY.items():
        if raw.get(key):
            raise _refuse(adapter_dir, f"uses {what}, which flashllm does not support; retrain without it "
                                       "or merge the adapter with peft first")
    if raw.get("bias", "none") != "none":
        raise _refuse(adapter_dir, f"bias is {raw.get('bias')!r}; only bias='none' adapters load")
    rank, alpha, rslora = raw.get("r", 8), raw.get("lora_alpha", 8), raw.get("use_rslora", False)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise _refuse(adapter_dir, f"rank r={rank!r}; expected a whole number in 1..{max_rank} (--max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _refuse(adapter_dir, f"lora_alpha={alpha!r}; expected a finite number")
    if not isinstance(rslora, bool):
        raise _refuse(adapter_dir, f"use_rslora={rslora!r}; expected true or false")
    return AdapterConfig(rank, float(alpha), rslora)


def _weights_file(adapter_dir: Path) -> Path:
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        pickled = [p.name for p in adapter_dir.glob("adapter_model.*")]
        hint = f" (found {', '.join(sorted(pickled))}: pickle files never load)" if pickled else ""
        raise _refuse(adapter_dir, f"no {WEIGHTS_FILE}{hint}; save the adapter with safe_serialization=True")
    if not path.resolve().is_relative_to(adapter_dir.resolve()):
        raise _refuse(adapter_dir, f"{WEIGHTS_FILE} links outside the adapter directory; refusing to read it")
    return path


def _module_of(adapter_dir: Path, key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A")."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX):-len(suffix)], which
    raise _refuse(adapter_dir, f"tensor {key!r} is not a LoRA A/B matrix of a linear layer (embedding LoRA, "
                               "DoRA magnitudes and saved modules are not supported)")


def _targets(module: str, base_shapes: Mapping[str, tuple[int, ...]],
             packed: Mapping[str, list[str]]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The checkpoint weights adapter module `module` adapts, with their shapes, in row order (None: unknown)."""
    name = f"{module}.weight"
    if name in base_shapes:
        return [(name, base_shapes[name])]
    head, _, last = module.rpartition(".")
    shards = packed.get(last)
    if not shards:
        return None
    names = [f"{head}.{shard}.weight" if head else f"{shard}.weight" for shard in shards]
    if not all(n in base_shapes for n in names):
        return None
    return [(n, base_shapes[n]) for n in names]


def load_adapter(adapter_dir: str | Path, base_shapes: Mapping[str, tuple[int, ...]],
                 packed_modules_mapping: Mapping[str, list[str]] | None = None, max_rank: int = MAX_RANK,
                 base_dtypes: Mapping[str, str] | None = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter against the base checkpoint, then load it (float32, CPU).

    base_shapes: the base checkpoint's tensor shapes by name (safetensors headers; nothing read);
    packed_modules_mapping: the model's fused module -> checkpoint projections, so an adapter trained
    on a fused `qkv_proj` / `gate_up_proj` applies to the projections the checkpoint stores;
    base_dtypes: safetensors dtype strings by name, to refuse adapting a pre-quantized (integer) weight.
    Every shape is checked from the adapter's header before any tensor is read. Raises LoRAError.
    """
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir, max_rank)
    path = _weights_file(adapter_dir)
    packed = packed_modules_mapping or {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            keys = list(f.keys())
            plan = _check_header(adapter_dir, f, keys, config, base_shapes, packed, base_dtypes or {})
            adapter = LoRAAdapter(adapter_dir, config)
            for module, targets in plan.items():
                a = f.get_tensor(f"{_PREFIX}{module}.lora_A.weight").to(torch.float32)
                b = f.get_tensor(f"{_PREFIX}{module}.lora_B.weight").to(torch.float32)
                row = 0
                for name, shape in targets:
                    adapter.weights[name] = LoRAWeights(a, b[row:row + shape[0]].contiguous(), config.scale)
                    row += shape[0]
    except SafetensorError as exc:
        raise _refuse(adapter_dir, f"{WEIGHTS_FILE} is not a valid safetensors file ({exc})") from None
    _check_finite(adapter)
    return adapter


def _check_header(adapter_dir: Path, f: Any, keys: list[str], config: AdapterConfig,
                  base_shapes: Mapping[str, tuple[int, ...]], packed: Mapping[str, list[str]],
                  base_dtypes: Mapping[str, str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """module -> its checkpoint targets, after checking every A/B pair's shape and dtype from the header."""
    if not keys:
        raise _refuse(adapter_dir, f"{WEIGHTS_FILE} holds no tensors")
    if len(keys) > 2 * max(len(base_shapes), 1):
        raise _refuse(adapter_dir, f"{WEIGHTS_FILE} holds {len(keys)} tensors, more than the base model has layers")
    pairs: dict[str, dict[str, str]] = {}
    for key in keys:
        module, which = _module_of(adapter_dir, key)
        pairs.setdefault(module, {})[which] = key
    plan: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    claimed: set[str] = set()
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(adapter_dir, f"{module} has lora_{''.join(pair)} but not its partner; the file is incomplete")
        targets = _targets(module, base_shapes, packed)
        if targets is None:
            raise _refuse(adapter_dir, f"targets {module}, which the base model has no linear weight for; "
                                       "the adapter was trained for another model")
        a_slice, b_slice = f.get_slice(pair["A"]), f.get_slice(pair["B"])
        for s, key in ((a_slice, pair["A"]), (b_slice, pair["B"])):
            if s.get_dtype() not in _FLOAT_DTYPES:
                raise _refuse(adapter_dir, f"{key} is {s.get_dtype()}; expected F32, F16 or BF16")
        out_features = sum(shape[0] for _, shape in targets)
        in_features = {shape[1] if len(shape) == 2 else -1 for _, shape in targets}
        a_shape, b_shape = tuple(a_slice.get_shape()), tuple(b_slice.get_shape())
        expected_a, expected_b = (config.rank, next(iter(in_features))), (out_features, config.rank)
        if len(in_features) != 1 or a_shape != expected_a or b_shape != expected_b:
            raise _refuse(adapter_dir, f"{module}: lora_A {a_shape} and lora_B {b_shape} do not fit the base weight "
                                       f"(expected {expected_a} and {expected_b} for rank {config.rank}); "
                                       "the adapter was trained for another model")
        for name, _ in targets:
            if base_dtypes.get(name, "F32") not in _FLOAT_DTYPES:
                raise _refuse(adapter_dir, f"{name} is stored pre-quantized ({base_dtypes[name]}); LoRA merges "
                                           "only into float weights (load a float checkpoint, then --quant_type)")
            if name in claimed:
                raise _refuse(adapter_dir, f"adapts {name} twice (through a fused and a single module)")
            claimed.add(name)
        plan[module] = targets
    return plan


def _check_finite(adapter: LoRAAdapter) -> None:
    for name, weights in adapter.weights.items():
        if not (torch.isfinite(weights.lora_a).all() and torch.isfinite(weights.lora_b).all()):
            raise _refuse(adapter.path, f"the LoRA matrices of {name} hold NaN or infinity")
