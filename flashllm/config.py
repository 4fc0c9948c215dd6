"""Engine configuration: model, cache, scheduler, device and quantization settings."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE_ENV = "FLASHLLM_CACHE_DIR"


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where flashllm caches built artifacts: `cache_dir`, else $FLASHLLM_CACHE_DIR, else ~/.cache/flashllm.

    The one cache-root rule, here at the bottom layer because models (the demo model) and backends
    (the cpu backend's native library) both keep files under it."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "flashllm"


@dataclass
class ModelConfig:
    """Which model to load and in which dtype."""

    model: str | None = None          # HF directory; None = the built-in demo model
    tokenizer: str | None = None      # defaults to `model`
    dtype: str = "auto"               # auto | float32 | float16 | bfloat16
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings (capped)
    seed: int = 0
    lora_path: str | None = None      # a PEFT LoRA adapter directory merged into the weights at load
    mla_use_matrix_absorption: bool = True  # MLA models: attend in the latent space (False: up-project per head)


@dataclass
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 64
    num_kv_blocks: int | None = None        # explicit block count wins over memory sizing
    kv_cache_memory: int | None = None      # bytes for the KV cache; None = derived from the device
    kv_cache_dtype: str = "auto"            # auto (the model dtype) | float32 | float16 | bfloat16 | int8 | fp8
    cachekv_int8_type: str = "dynamic"      # int8/fp8 caches: dynamic (per-token scales) | static (checkpoint's)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9     # accelerators: share of device memory for weights, activations and KV


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048             # filled in from ModelConfig once the model is known
    # greedy decode steps one scheduling round may run where the device can (the cpu backend's
    # multi-step decode, bounded by what the runner takes: Engine._max_steps); 1 = one step a round
    num_scheduler_steps: int = 8
    # prompt tokens (new prompts, later chunks, recomputes) one step may run; decodes do not count.
    # None: up to max_num_batched_tokens. Lower, a burst of new prompts is prefilled over several
    # steps, so the first ones start streaming while the rest are prefilled (time to first token)
    max_prefill_tokens: int | None = None
    # which waiting request is admitted next and which running one is preempted first: "fcfs" (arrival order)
    # or "priority" (each request's priority, lower first, then arrival; vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"


# `flashllm serve`'s max_prefill_tokens on a CPU when none is given: a step there costs about its token
# count (the GEMMs are compute-bound), so 16 new prompts of ~128 tokens prefilled in one 2,048-token
# step all wait ~9 s for their first token on the 2-core test VM, while 512-token steps hand the
# first four theirs after ~2.5 s at the same output tokens/s (docs/benchmarks.md, serving)
CPU_SERVE_MAX_PREFILL_TOKENS = 512


@dataclass
class DeviceConfig:
    """Device and backend selection."""

    device: str = "auto"                   # auto | cpu | cuda | cuda:1 | npu:0 | ...
    backend: str | None = None             # force one backend (e.g. "reference")
    strict_kernels: bool = False           # fallbacks to the reference become errors
    enforce_eager: bool = False            # never replay decode steps from device graphs (CUDA graphs)


@dataclass
class QuantConfig:
    """Quantization scheme of weights (and later activations / KV cache)."""

    quant_type: str = "none"
    group_size: int = -1
    quantize_lm_head: bool = False         # int8 LM head beside weight-only linears (quant/spec.py)
    # MoE experts only (PaddleNLP's --moe_quant_type): weight_only_int8 | weight_only_int4; None: as quant_type
    moe_quant_type: str | None = None


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md): adapters chosen per request, batched over device slots."""

    enable_lora: bool = False
    max_loras: int = 4                      # adapters on the device at once (slots; LRU eviction)
    max_lora_rank: int = 16                 # the largest adapter rank the slots hold
    max_cpu_loras: int | None = None        # host copies kept (default: max_loras); others re-read from disk


# ParallelConfig.distributed_executor_backend values; here, not in core/executor.py, so the CLI can offer
# them as choices without importing torch
DISTRIBUTED_EXECUTOR_BACKENDS = ("uniproc", "mp", "ray", "external")


@dataclass
class ParallelConfig:
    """How many ranks run the model and what launches them (core/executor.py)."""

    tensor_parallel_size: int = 1
    # uniproc (one rank, in process) | mp (a process per rank, this machine) | ray (an actor per rank
    # on a Ray cluster) | external (ranks launched by torchrun; the process group comes from its
    # environment); None: uniproc for one rank, external under torchrun, else mp
    distributed_executor_backend: str | None = None
    # MoE layers hold whole experts per rank (E / tensor_parallel_size each) instead of every expert's
    # slice; the rest of the model stays tensor parallel (models that implement it: DeepSeek-V2/V3)
    enable_expert_parallel: bool = False


# SpeculativeConfig.method values; PaddleNLP's "inference_with_reference" is the n-gram lookup
SPECULATE_METHODS = ("ngram", "inference_with_reference", "draft_model", "eagle", "eagle3", "mtp")
MAX_DRAFT_TOKENS = 8


class SpeculativeConfigError(ValueError):
    """Speculative decoding cannot run with these settings (a flag, a speculative_config key, or a drafter
    that does not fit the target); the message, one line, says which and what to change."""


class SpeculativeKeyError(SpeculativeConfigError, TypeError):
    """A speculative_config key that names no setting (a TypeError too, as an unknown keyword is)."""


@dataclass
class SpeculativeConfig:
    """Speculative decoding (flashllm/core/spec/): who drafts tokens and how many a round verifies."""

    method: str | None = None               # None (off) | one of SPECULATE_METHODS
    num_speculative_tokens: int = 4         # drafts per sequence and round (--speculate_max_draft_token_num), 1..8
    max_ngram_size: int = 3                 # ngram: the longest suffix looked up (--speculate_max_ngram_size)
    min_ngram_size: int = 1                 # ngram: the shortest suffix that may match
    model: str | None = None                # draft_model: its HF directory (--speculative-model), same vocabulary
    quant_type: str = "none"                # draft_model: weight-only quantization of the draft (e.g. weight_only_int8)
    group_size: int = -1                    # draft_model: its weight-only group size (-1: per output channel)
    # draft_model: the draft's greedy head scores the ids below this and every token of the drafted sequences
    # (core/spec/draft_model.py; exact all the same: the target verifies); 0: the whole vocabulary
    draft_vocab: int = 4096
    # draft_model: the draft checks the n-gram lookup's guesses at its next tokens in one pass of several rows,
    # so a run of right guesses costs one draft pass, not one per token; the drafts stay the draft's own
    draft_lookup: bool = True
    # the adaptive guard: a sequence whose recent acceptance falls below this share of its drafts stops
    # drafting for a while (see core/spec/speculator.py); 0 turns the guard off; None: a quarter, or for a
    # draft model, MTP layer or EAGLE head the break-even acceptance the engine measures at start-up
    # (core/spec/costs.py), if higher
    min_acceptance: float | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None


# the speculative decoding flags' dests (flashllm/cli/spec_flags.py, serve's options) -> SpeculativeConfig keys
SPECULATIVE_FLAG_KEYS = {"speculate_method": "method", "speculate_max_draft_token_num": "num_speculative_tokens",
                         "speculate_max_ngram_size": "max_ngram_size", "speculative_model": "model",
                         "speculative_quant_type": "quant_type", "speculative_weightonly_group_size": "group_size",
                         "speculative_draft_vocab": "draft_vocab", "speculative_draft_lookup": "draft_lookup"}


# LLM(speculative_config={...}) and --speculative-config keys -> SpeculativeConfig fields: the fields' own names,
# PaddleNLP's (the flags' dests) and vLLM's
SPECULATIVE_CONFIG_KEYS = {
    **{name: name for name in (*SPECULATIVE_FLAG_KEYS.values(), "min_ngram_size", "min_acceptance")},
    **SPECULATIVE_FLAG_KEYS,
    "prompt_lookup_max": "max_ngram_size", "prompt_lookup_min": "min_ngram_size", "quantization": "quant_type",
}


def speculative_fields(value: dict[str, Any], where: str = "speculative_config", imply: bool = True) -> dict[str, Any]:
    """A speculative_config dict in vLLM's or PaddleNLP's spelling as SpeculativeConfig fields (None values dropped;
    with `imply`, a model without a method means method "draft_model"); TypeError names unknown keys, ValueError
    two keys that give one field different values."""
    unknown = set(value) - set(SPECULATIVE_CONFIG_KEYS)
    if unknown:
        raise SpeculativeKeyError(f"unknown {where} keys {sorted(unknown)}; known: {sorted(SPECULATIVE_CONFIG_KEYS)}")
    fields: dict[str, Any] = {}
    for key, v in value.items():
        name = SPECULATIVE_CONFIG_KEYS[key]
        if v is not None and fields.setdefault(name, v) != v:
            raise SpeculativeConfigError(f"{where} gives {name} twice: {fields[name]!r} and {v!r} ({key})")
    if imply and fields.get("model") and not fields.get("method"):
        fields["method"] = "draft_model"
    return fields


def speculative_flags_config(get: Callable[[str], Any]) -> dict[str, Any] | None:
    """The speculative flags' values (get(dest) -> value or None: "speculative_config" a dict in vLLM's form, the
    others one field each) as LLM(speculative_config=...), or None when none was given; ValueError when only
    tuning flags were given, without a method or draft model, or when a flag and the dict disagree."""
    whole = get("speculative_config")
    config = speculative_fields(whole, "--speculative-config", imply=False) if whole else {}
    for dest, key in SPECULATIVE_FLAG_KEYS.items():
        value = get(dest)
        if value is None:
            continue
        if config.get(key, value) != value:
            raise SpeculativeConfigError(f"--speculative-config gives {key} {config[key]!r} and --{dest} gives "
                                         f"{value!r}; give one")
        config[key] = value
    if not config.get("method") and not config.get("model"):
        if config:
            given = ", ".join("--" + dest for dest in SPECULATIVE_FLAG_KEYS if get(dest) is not None)
            raise SpeculativeConfigError(f"{given or '--speculative-config'} need --speculate_method (or "
                                         f"--speculative-model for a draft model)")
        return None
    return config


@dataclass
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
