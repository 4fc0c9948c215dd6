"""Builds an engine's parts once: device, op table, model, tokenizer, KV cache size."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashllm.config import EngineConfig
from flashllm.core.model_runner import KV_SCALE_TYPES, ModelRunner, state_cache_specs
from flashllm.core.parallel import RankContext
from flashllm.core.runner_select import EngineConfigError, model_runner_class
from flashllm.core.scheduler import check_scheduler_config
from flashllm.models.default_model import resolve_model
from flashllm.models.gguf import is_gguf_path, open_gguf
from flashllm.models.gguf.tensors import gguf_quant_capability
from flashllm.models.hf_config import HFModelConfig, ModelLoadError, kernel_request, load_hf_config
from flashllm.models.loader import checkpoint_quant_spec, load_generation_config, load_model, resolve_dtype
from flashllm.models.registry import ModelRegistry
from flashllm.models.tokenizers import TOKENIZER_FILES
from flashllm.quant.spec import WeightQuantSpec, weight_quant_spec
from flashllm.registry.backend import OpRequest
from flashllm.registry.plugins import FlashPlugins, make_plugin_manager
from flashllm.registry.precision import parse_dtype
from flashllm.registry.resolve import DeviceSelection, OpTable, resolve_ops, select_device

logger = logging.getLogger(__name__)

# Without an explicit size, a CPU KV cache takes at most this share of the free host memory.
CPU_KV_MEMORY_FRACTION = 0.25
MAX_DEFAULT_MODEL_LEN = 8192
# --kv-cache-dtype names of the quantized caches; float names go through parse_dtype
QUANTIZED_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


@dataclass
class EngineParts:
    """Everything the engine steps with, built once."""

    config: EngineConfig
    selection: DeviceSelection
    ops: OpTable
    model: torch.nn.Module
    hf_config: HFModelConfig
    tokenizer: Any
    generation_config: dict[str, Any]
    eos_token_ids: list[int]
    runner: ModelRunner
    num_blocks: int
    model_dir: Path
    # the speculative proposer's weights (core/spec/build.py load_drafter), loaded before the KV cache was
    # sized so its own cache shares the budget; None without one
    drafter: Any = None
    # recurrent-state slots (one per seat, max_num_seqs) of a model whose layers keep per-sequence state; 0: none
    num_state_slots: int = 0


def build_engine_parts(config: EngineConfig, plugins: FlashPlugins | None = None,
                       rank: RankContext | None = None) -> EngineParts:
    """Select the device, resolve ops, load the model (this rank's shard of it) and the tokenizer
    (rank 0 only), and size the KV cache (the smallest size every rank can hold)."""
    plugins = plugins or make_plugin_manager()
    rank = rank or RankContext()
    try:
        check_scheduler_config(config.scheduler)  # before minutes of loading
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
    selection = rank.select(select_device(config.device.device, config.device.backend, plugins=plugins))
    plugins.adjust_config(config, selection.backend)
    model_dir = resolve_model(config.model.model)  # None: SmolLM2 when installed, else the demo model
    _check_tokenizer_source(config.model.tokenizer)  # before minutes of loading
    registry = ModelRegistry()
    for architecture, target in plugins.model_targets().items():
        registry.register(architecture, target)
    hf_config = load_hf_config(model_dir, registry)
    generation_config = load_generation_config(model_dir)  # a bad value fails before the weights load
    dtype = resolve_dtype(config.model.dtype, hf_config.torch_dtype, selection.profile.native_bf16,
                          selection.profile.accelerator)
    kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    if config.cache.cachekv_int8_type not in KV_SCALE_TYPES:
        raise EngineConfigError(f"--cachekv_int8_type {config.cache.cachekv_int8_type!r} is not one of "
                                f"{', '.join(KV_SCALE_TYPES)}")
    # a GPTQ/AWQ checkpoint brings its own scheme: resolve the op table for what the layers will hold
    quant = checkpoint_quant_spec(hf_config, weight_quant_spec(config.quant.quant_type, config.quant.group_size,
                                                                config.quant.quantize_lm_head))
    scheme = quant.scheme
    moe_quant = _moe_quant_spec(config)
    if is_gguf_path(model_dir):  # layers holding GGUF blocks as stored need kernels for their layouts
        scheme = gguf_quant_capability(open_gguf(model_dir), scheme, rank.world_size)
    request = OpRequest(dtype, kv_dtype, scheme, hf_config.head_dim, config.cache.block_size,
                        **kernel_request(hf_config))
    ops = resolve_ops(selection, request, plugins=plugins, strict=config.device.strict_kernels)
    selection.adapter.set_device(selection.device)
    runner_cls = model_runner_class(selection)
    model, hf_config = load_model(model_dir, ops, dtype, selection.device, registry, quant=quant,
                                  tp_rank=rank.rank, tp_size=rank.world_size, lora_path=config.model.lora_path,
                                  place_params=runner_cls.place_empty_weights, moe_quant=moe_quant,
                                  expert_parallel=config.parallel.enable_expert_parallel)
    model.set_matrix_absorption(config.model.mla_use_matrix_absorption)
    check_block = getattr(model, "check_kv_block_size", None)  # a plugin's model may not derive from CausalLM
    if check_block is not None:
        try:
            check_block(config.cache.block_size)
        except ValueError as exc:
            raise EngineConfigError(f"block_size {config.cache.block_size}: {exc}") from None
    num_state_slots = _state_slots(config, model)
    lora = _lora_manager(config, model, model_dir, ops, dtype, selection.device) if config.lora.enable_lora else None
    runner_cls.prepare_model(model, selection.adapter)  # what it keeps beside the weights is counted below
    tokenizer = _tokenizer(Path(config.model.tokenizer or model_dir)) if rank.rank == 0 else None
    _set_max_model_len(config, hf_config)
    drafter = None
    if config.speculative.enabled:  # its weights and cache count against the same memory as the target's
        from flashllm.core.spec.build import load_drafter
        from flashllm.core.spec.speculator import Target

        drafter = load_drafter(Target(config, selection, ops, model, hf_config, tokenizer, model_dir), rank.rank)
    # the draft's cache is on the driver only; agree_min gives every rank the driver's smaller block count
    draft_per_block = drafter.kv_bytes_per_block if drafter is not None else 0
    num_blocks = rank.agree_min(_num_kv_blocks(config, model, selection, kv_dtype, draft_per_block, num_state_slots))
    try:
        runner = runner_cls(model, selection.device, num_blocks, config.cache.block_size, kv_dtype,
                            config.cache.cachekv_int8_type, adapter=selection.adapter, num_state_slots=num_state_slots)
    except ValueError as exc:  # static KV scales the checkpoint lacks
        raise EngineConfigError(str(exc)) from None
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s%s", num_blocks,
                config.cache.block_size, num_blocks * config.cache.block_size, runner.kv_cache_bytes() / 2**30,
                selection.device, f" (rank {rank.rank} of {rank.world_size})" if rank.world_size > 1 else "")
    runner.lora = lora
    reason = _no_graphs_reason(config, selection, ops, rank.world_size, model)
    if reason is None:
        runner.capture_graphs(config.scheduler.max_num_seqs, int(config.model.max_model_len))
    elif selection.profile.accelerator:
        logger.info("decode steps run eagerly: %s", reason)
    eos = _config_eos(generation_config)
    if tokenizer is not None:
        from flashllm.models.tokenizer import eos_token_ids

        eos = eos_token_ids(tokenizer, generation_config)
    return EngineParts(config, selection, ops, model, hf_config, tokenizer, generation_config, eos, runner,
                       num_blocks, model_dir, drafter, num_state_slots)


def _state_slots(config: EngineConfig, model: torch.nn.Module) -> int:
    """Recurrent-state slots for a model whose layers keep per-sequence state: one per seat (max_num_seqs); 0 for
    every other model. Such a state is not paged by position, so prefix caching is turned off for it and
    speculative decoding (which would roll a state back) is refused."""
    if not state_cache_specs(model):
        return 0
    name = type(model).__name__
    if config.speculative.enabled:
        raise EngineConfigError(f"{name} keeps a recurrent state per sequence, which speculative decoding cannot "
                                "roll back yet; drop --speculate_method / --speculative-model")
    if config.cache.enable_prefix_caching:
        logger.info("prefix caching is off: %s keeps a recurrent state per sequence, which cached KV blocks do not "
                    "hold", name)
        config.cache.enable_prefix_caching = False
    return config.scheduler.max_num_seqs


# --moe_quant_type values: the experts' own weight-only scheme
MOE_QUANT_TYPES = ("weight_only_int8", "weight_only_int4")


def _moe_quant_spec(config: EngineConfig) -> WeightQuantSpec | None:
    """--moe_quant_type as the experts' WeightQuantSpec (group size from --weightonly_group_size); None: the
    experts follow --quant_type. Raises EngineConfigError for any other value."""
    name = config.quant.moe_quant_type
    if name is None:
        return None
    if name not in MOE_QUANT_TYPES:
        raise EngineConfigError(f"--moe_quant_type {name!r} is not one of {', '.join(MOE_QUANT_TYPES)}; drop it to "
                                "quantize the experts as --quant_type says")
    return weight_quant_spec(name, config.quant.group_size)


def _lora_manager(config: EngineConfig, model: torch.nn.Module, model_dir: Path, ops: OpTable, dtype: torch.dtype,
                  device: torch.device) -> Any:
    """The multi-LoRA manager (flashllm/lora/manager.py) of an engine started with enable_lora."""
    from flashllm.models.lora_serving import build_lora_manager

    lora = config.lora
    try:
        return build_lora_manager(model, model_dir, ops, dtype, device, lora.max_loras, lora.max_lora_rank,
                                  lora.max_cpu_loras)
    except (ModelLoadError, ValueError) as exc:
        raise EngineConfigError(f"enable_lora: {exc}") from None


def _no_graphs_reason(config: EngineConfig, selection: DeviceSelection, ops: OpTable,
                      world_size: int = 1, model: torch.nn.Module | None = None) -> str | None:
    """Why decode steps cannot be captured as device graphs here, or None when they can.

    Only the ops `model`'s layers bound count (a kernel that reads tensors on the host stops graphs
    only for models that call it), or every op of the table when no model is given."""
    if config.device.enforce_eager:
        return "--enforce-eager"
    if world_size > 1:
        return "tensor parallelism (the other ranks run their steps eagerly)"
    if config.lora.enable_lora:
        return "multi-LoRA (each step's adapter slots are chosen on the host)"
    if selection.adapter.new_graph(selection.device) is None:
        return f"the {selection.backend.name} backend's device has no graphs"
    if model is not None and state_cache_specs(model):  # the captured decode inputs hold no state slots
        return "the model keeps a recurrent state per sequence (its slots are not graph inputs)"
    if getattr(model, "reads_prompt_lens", False):  # the captured decode inputs hold no prompt lengths
        return "the model reads each sequence's prompt length (QWen's dynamic NTK, Phi-3's LongRoPE tables)"
    syncing = next((m for m in (model.modules() if model is not None else ()) if getattr(m, "syncs_with_host", False)),
                   None)
    if syncing is not None:  # a layer whose forward reads device values on the host cannot be captured
        return f"{type(syncing).__name__} layers read values on the host each step ({syncing.syncs_with_host})"
    unsafe = [op for op in (ops.sources if model is None else bound_ops(model, ops))
              if not ops.kernel(op).caps.graph_safe]
    if unsafe:
        return f"{', '.join(unsafe)} bound to kernels that read tensors on the host"
    return None


def bound_ops(model: torch.nn.Module, ops: OpTable) -> list[str]:
    """The ops whose kernels `model`'s modules hold: layers bind `ops.<op>` at construction."""
    held = {id(value) for module in model.modules() for value in vars(module).values() if callable(value)}
    return [op for op in ops.sources if id(ops.kernel(op).fn) in held]


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for --kv-cache-dtype: auto = the model `dtype`, int8, fp8 (e4m3) or a float."""
    key = name.lower()
    if key == "auto":
        return dtype
    if key in QUANTIZED_KV_CACHE_DTYPES:
        return QUANTIZED_KV_CACHE_DTYPES[key]
    try:
        return parse_dtype(name)
    except ValueError:
        raise EngineConfigError(
            f"unknown --kv-cache-dtype {name!r}; expected auto, int8, fp8 (fp8_e4m3), float32, float16 or bfloat16"
        ) from None


def _config_eos(generation_config: dict[str, Any]) -> list[int]:
    eos = generation_config.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _check_tokenizer_source(tokenizer: str | None) -> None:
    """EngineConfigError when a tokenizer given apart from the model (--tokenizer) is neither a GGUF file nor a
    directory holding tokenizer files: asked for explicitly, it must not quietly fall back to token ids."""
    if tokenizer is None:
        return
    path = Path(tokenizer)
    if is_gguf_path(path) or (path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES)):
        return
    raise EngineConfigError(f"--tokenizer {tokenizer}: not a GGUF file or a directory holding one of "
                            f"{', '.join(TOKENIZER_FILES)}; give the model's tokenizer directory (flashllm never "
                            "downloads)")


def _tokenizer(path: Path) -> Any:
    """The directory's (or GGUF file's) tokenizer; None when it has none (then prompts must be token ids)."""
    if not is_gguf_path(path) and not any((path / name).exists() for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", path)
        return None
    from flashllm.models.hf_config import ModelLoadError
    from flashllm.models.tokenizer import load_tokenizer

    try:
        return load_tokenizer(str(path))
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed tokenizer.json
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}") from exc


def _set_max_model_len(config: EngineConfig, hf_config: HFModelConfig) -> None:
    limit = hf_config.max_position_embeddings
    wanted = config.model.max_model_len
    if wanted is None:
        wanted = min(limit, MAX_DEFAULT_MODEL_LEN)
    elif wanted > limit:
        raise EngineConfigError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
    config.model.max_model_len = wanted
    config.scheduler.max_model_len = wanted
    if not config.scheduler.enable_chunked_prefill and config.scheduler.max_num_batched_tokens < wanted:
        config.scheduler.max_num_batched_tokens = wanted  # a whole prompt must fit in one step


def _num_kv_blocks(
    config: EngineConfig, model: torch.nn.Module, selection: DeviceSelection, kv_dtype: torch.dtype,
    draft_per_block: int = 0, num_state_slots: int = 0,
) -> int:
    """Blocks from --num-kv-blocks, else --kv-cache-memory, else a share of the device's free memory.

    draft_per_block: bytes a speculative drafter's own cache takes per block (it has as many blocks as the
    target's), so a memory budget covers both caches. A memory budget also covers the num_state_slots recurrent
    states; a model with no attention layer (nothing per block) gets a block table for every seat and position."""
    block_size = config.cache.block_size
    per_block = ModelRunner.kv_bytes_per_block(model, block_size, kv_dtype, config.cache.cachekv_int8_type)
    per_block += draft_per_block
    state_bytes = num_state_slots * ModelRunner.state_bytes_per_slot(model)
    blocks_per_seq = math.ceil(config.model.max_model_len / block_size)
    wanted = blocks_per_seq * config.scheduler.max_num_seqs
    num_blocks: int | None = None
    if config.cache.num_kv_blocks is not None:
        num_blocks = config.cache.num_kv_blocks
    elif per_block == 0:
        num_blocks = wanted
    elif config.cache.kv_cache_memory is not None:
        num_blocks = max(config.cache.kv_cache_memory - state_bytes, 0) // per_block
    elif selection.profile.accelerator and (budget := _profiled_kv_budget(config, model, selection, kv_dtype)):
        num_blocks = min(max(budget - state_bytes, 0) // per_block, MAX_PROFILED_BLOCKS)
    sized = ""
    if num_blocks is None:
        free, _ = selection.adapter.memory_info(selection.device)
        num_blocks = min(wanted, max(int(free * CPU_KV_MEMORY_FRACTION) - state_bytes, 0) // per_block)
        sized = (f", sized as {CPU_KV_MEMORY_FRACTION:.0%} of the {free / 2**30:.2f} GiB of memory available now "
                 f"at {per_block} bytes a block")
    if num_blocks < blocks_per_seq:
        raise EngineConfigError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens{sized}) but one sequence of "
            f"max_model_len {config.model.max_model_len} needs {blocks_per_seq} blocks"
            f"{' (each block also holds the speculative drafter cache)' if draft_per_block else ''}; raise "
            f"--num-kv-blocks / --kv-cache-memory or lower --max-model-len"
        )
    return num_blocks


# A bound on blocks sized from a memory profile: a tiny model on a large GPU would otherwise ask
# the block manager for millions of blocks (one Python object each) it could never fill.
MAX_PROFILED_BLOCKS = 1 << 17
# Kept free beside the KV cache for what the memory profile does not see: the decode graphs'
# private pool and the sampler's temporaries.
GRAPH_RESERVE_BYTES = 512 << 20


def _profiled_kv_budget(config: EngineConfig, model: torch.nn.Module, selection: DeviceSelection,
                        kv_dtype: torch.dtype) -> int | None:
    """Bytes for the KV cache: gpu_memory_utilization x device memory - what the worst step needs.

    The worst step is profiled: one forward pass over max_num_batched_tokens prompt tokens (into a
    throwaway cache just large enough for them) and the fp32 logits of max_num_seqs rows. Its
    peak allocation (weights included, the throwaway cache not), memory held outside torch's
    allocator (CUDA context, library handles), the decode graphs' logits buffer and
    GRAPH_RESERVE_BYTES are subtracted. None when the device module lacks memory statistics
    (the caller then sizes by free memory).
    """
    device = selection.device
    module = torch.get_device_module(device.type)
    if not all(hasattr(module, f) for f in ("reset_peak_memory_stats", "max_memory_allocated", "memory_reserved")):
        return None
    utilization = config.cache.gpu_memory_utilization
    if not 0.0 < utilization <= 1.0:
        raise EngineConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    selection.adapter.synchronize(device)
    module.reset_peak_memory_stats(device)
    tokens = min(config.scheduler.max_num_batched_tokens, int(config.model.max_model_len))
    rows = config.scheduler.max_num_seqs
    throwaway, vocab = _profile_step(model, selection, config.cache.block_size, kv_dtype,
                                     config.cache.cachekv_int8_type, tokens, rows)
    selection.adapter.synchronize(device)
    peak = module.max_memory_allocated(device) - throwaway
    free, total = selection.adapter.memory_info(device)
    outside_torch = max(total - free - module.memory_reserved(device), 0)
    graph_logits = rows * vocab * torch.float32.itemsize
    budget = int(total * utilization) - peak - outside_torch - graph_logits - GRAPH_RESERVE_BYTES
    logger.info("memory profile: %.2f GiB peak for a %d-token step, %.2f GiB outside torch; %.2f of %.2f GiB "
                "(gpu_memory_utilization %.2f) left for the KV cache", peak / 2**30, tokens, outside_torch / 2**30,
                max(budget, 0) / 2**30, total / 2**30, utilization)
    return max(budget, 0)


def _profile_step(model: torch.nn.Module, selection: DeviceSelection, block_size: int, kv_dtype: torch.dtype,
                  cachekv_int8_type: str, tokens: int, rows: int) -> tuple[int, int]:
    """Run one prompt of `tokens` tokens and `rows` logits rows; (bytes of the throwaway cache, vocab size)."""
    from flashllm.core.model_runner import allocate_kv_caches
    from flashllm.ops.attention_metadata import AttentionMetadata

    device = selection.device
    num_blocks = math.ceil(tokens / block_size)
    caches = allocate_kv_caches(model, device, num_blocks, block_size, kv_dtype, cachekv_int8_type)
    throwaway = sum(t.numel() * t.element_size() for layer in caches for t in layer)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(tokens, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1),
        max_seqlen_q=tokens, max_seqlen_k=tokens,
    )
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    positions = torch.arange(tokens, dtype=torch.int64, device=device)
    with selection.adapter.inference_mode():
        hidden = model(ids, positions, caches, metadata)
        rows_index = torch.arange(rows, device=device) % tokens  # a decode step of `rows` sequences samples them all
        vocab = model.compute_logits(hidden[rows_index]).float().shape[-1]
    return throwaway, vocab
