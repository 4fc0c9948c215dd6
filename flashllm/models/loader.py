"""Load a Hugging Face model directory: config -> model -> safetensors weights (never pickle)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from flashllm.lora.merge import checkpoint_headers, merge_lora
from flashllm.lora.peft import LoRAAdapter, LoRAError, load_adapter
from flashllm.models.base import CausalLM
from flashllm.models.block_fp8 import dequantize_block_fp8
from flashllm.models.checkpoint_tensor import CheckpointTensor
from flashllm.models.gguf.config import gguf_arch
from flashllm.models.gguf.reader import is_gguf_path, open_gguf
from flashllm.models.gguf.tensors import GGUFWeights
from flashllm.models.hf_config import HFModelConfig, ModelLoadError, load_hf_config, read_json_object
from flashllm.models.layers.embedding import LMHead
from flashllm.models.layers.linear import LinearBase
from flashllm.models.layers.moe import FusedMoE
from flashllm.models.layers.prequantized import finish_prequantized, prepare_prequantized
from flashllm.models.registry import ModelRegistry
from flashllm.quant.spec import WeightQuantSpec
from flashllm.sampling_params import SamplingParams

__all__ = [
    "ModelLoadError",
    "checkpoint_quant_spec",
    "load_generation_config",
    "load_model",
    "load_selected_weights",
    "resolve_dtype",
    "safetensors_files",
]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
MAX_JSON_BYTES = 64 * 1024 * 1024

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def load_model(
    model_dir: str | Path, ops: Any, dtype: torch.dtype, device: torch.device | str,
    model_registry: ModelRegistry, progress: bool = True, quant: WeightQuantSpec | None = None,
    tp_rank: int = 0, tp_size: int = 1, lora_path: str | Path | None = None,
    place_params: Callable[[torch.nn.Module], Any] | None = None, expert_parallel: bool = False,
    moe_quant: WeightQuantSpec | None = None,
) -> tuple[CausalLM, HFModelConfig]:
    """Build the model `config.json` describes and fill it from the directory's safetensors.

    `model_dir` may instead be a GGUF file (flashllm/models/gguf/): its metadata stands for
    config.json and its tensors for the safetensors.

    ops: the bound op table the layers call; dtype: parameter dtype (checkpoint tensors are
    converted on load); model_registry: a ModelRegistry resolving `architectures[0]` to a
    CausalLM (models/base.py), whose parse_config reads the rest of config.json;
    quant: how the linear layers store their weights once loaded (None: as loaded, in `dtype`).
    Everything that can be checked before allocating is: the config's sizes, the architecture,
    the weight files (safetensors only, inside the directory). Raises ModelLoadError with one
    line on any problem, including missing, unexpected or mis-shaped tensors.
    A GPTQ / AWQ checkpoint (config.json `quantization_config`) keeps its packed weights, as
    w4a16 / w8a16; `quant` must then be None, disabled or the same scheme.
    tp_rank / tp_size: this process's tensor-parallel rank; the model holds that rank's shard, and
    only that part of each sharded tensor is read from the files (see models/checkpoint_tensor.py).
    lora_path: a PEFT LoRA adapter directory merged into the weights as they load (flashllm/lora/merge.py),
    so quantization applies to the merged weights; its shapes are checked before the model is built.
    place_params: called with the model once built, before any weight is read: it may swap
    parameters for uninitialized ones of the same shapes in memory of its choosing (the runner's
    place_empty_weights), which loading then fills.
    expert_parallel: the MoE layers' ranks hold whole experts (the architecture's with_expert_parallel;
    ModelLoadError where it has none).
    moe_quant: how the MoE experts store their weights (--moe_quant_type), in place of `quant`; None: `quant`.
    Returns (model in eval mode, with process_weights_after_loading() applied; its config).
    """
    model_dir = Path(model_dir)
    gguf = is_gguf_path(model_dir)  # a GGUF file stands in for the directory (models/gguf/)
    if not gguf and not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist or is not a directory")
    config = load_hf_config(model_dir, model_registry)
    files = {} if gguf else safetensors_files(model_dir)
    gguf_weights = _gguf_weights(model_dir, config, tp_size, quant, ops, moe_quant) if gguf else None
    model_cls = model_registry.resolve(config.architecture)
    checkpoint_quant_spec(config, quant)
    if expert_parallel:
        config = model_cls.with_expert_parallel(config)
    adapter = None if lora_path is None else _read_adapter(lora_path, config, files, model_cls)
    model = model_cls(config, ops, dtype, torch.device(device), tp_rank=tp_rank, tp_size=tp_size)
    if place_params is not None:
        place_params(model)
    prepare_prequantized(model, config.quantization)
    if gguf_weights is not None:
        gguf_weights.prepare(model)
    seen: set[str] = set()
    tensors = (gguf_weights.tensors(model, seen, progress) if gguf_weights
               else _iter_tensors(files, progress, seen, _base_model_prefix(files, model)))
    read = tensors
    fp8_block = getattr(config, "fp8_block", None)
    if fp8_block is not None and gguf_weights is None:  # block-FP8 weights arrive as code x block scale
        tensors = dequantize_block_fp8(tensors, fp8_block)
    if adapter is not None:
        tensors = merge_lora(tensors, adapter)
    try:
        loaded = model.load_weights(tensors)
    finally:
        # A refused tensor leaves the generator suspended: close it now so the progress bar ends
        # and the file is unmapped before the error is reported, not at interpreter exit.
        tensors.close()
        read.close()
    _check_complete(model, loaded, seen)
    if config.quantization is not None and moe_quant is None:
        # GPTQ / AWQ experts arrive dequantized (layers/packed_experts.py): they keep the checkpoint's values
        # instead of being rounded again to the dense layers' scheme; --moe_quant_type still quantizes them
        moe_quant = WeightQuantSpec()
    _after_loading(model, quant, lambda m: finish_prequantized(m) or (gguf_weights is not None and gguf_weights.finish(m)),
                   moe_quant)
    if gguf_weights is not None:
        gguf_weights.mark_head(model)
    return model.eval(), config


def _after_loading(model: CausalLM, quant: WeightQuantSpec | None,
                   finished: Callable[[Any], bool] = lambda module: False,
                   moe_quant: WeightQuantSpec | None = None) -> None:
    """Each module's post-load processing (quantizing linear weights per `quant`, MoE experts per `moe_quant`
    when given), except modules that `finished(module)` reports it already prepared (prequantized or GGUF blocks)."""
    for module in model.modules():
        if finished(module):
            continue
        if isinstance(module, FusedMoE) and moe_quant is not None:
            module.process_weights_after_loading(moe_quant)
        elif isinstance(module, (LinearBase, LMHead, FusedMoE)):
            module.process_weights_after_loading(quant)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def load_selected_weights(model: CausalLM, model_dir: str | Path, rename: Callable[[str], str | None],
                          quant: WeightQuantSpec | None = None) -> None:
    """Fill `model`, which holds part of a checkpoint (DeepSeek's MTP layers, models/deepseek_mtp.py), from the
    directory's safetensors: rename(checkpoint name) gives the model's name for a tensor it holds, None for one
    it does not (skipped unread). The checks and post-processing of load_model: ModelLoadError on a tensor of
    the wrong shape or a parameter nothing loaded; quant as in load_model."""
    files = safetensors_files(model_dir)
    seen: set[str] = set()
    tensors = ((local, tensor) for name, tensor in _iter_tensors(files, False, set())
               if (local := rename(name)) is not None and not seen.add(local))
    try:
        loaded = model.load_weights(tensors)
    finally:
        tensors.close()
    _check_complete(model, loaded, seen)
    _after_loading(model, quant)
    model.eval()


def _read_adapter(lora_path: str | Path, config: HFModelConfig, files: dict[Path, set[str] | None],
                  model_cls: type[CausalLM]) -> LoRAAdapter:
    """The --lora_path adapter, checked against the checkpoint's tensor headers before anything is allocated."""
    if not files:
        raise ModelLoadError("--lora_path merges into a safetensors checkpoint; a GGUF file is not supported")
    if config.quantization is not None:
        raise ModelLoadError(f"--lora_path cannot merge into a {config.quantization.method} checkpoint's packed "
                             "weights; merge into the float model, then quantize (--quant_type)")
    shapes, dtypes = checkpoint_headers(files)
    try:
        return load_adapter(lora_path, shapes, model_cls.packed_modules_mapping, base_dtypes=dtypes)
    except LoRAError as exc:
        raise ModelLoadError(str(exc)) from None


def _gguf_weights(path: Path, config: HFModelConfig, tp_size: int, quant: WeightQuantSpec | None,
                  ops: Any = None, moe_quant: WeightQuantSpec | None = None) -> GGUFWeights:
    """The GGUF file's tensors, planned (names mapped and checked) before the model is allocated; its quantized
    linear weights stay as stored unless --quant_type asks for a scheme (then they load as float first), and so
    do its MoE experts unless --quant_type or --moe_quant_type does; Q/K rows stay interleaved for a rotary
    kernel that keeps_interleaved_pairs (ops/rotary_embedding.py)."""
    gf = open_gguf(path)
    keep_pairs = bool(getattr(getattr(ops, "rotary_embedding", None), "keeps_interleaved_pairs", False))
    keep = not (quant is not None and quant.enabled)
    return GGUFWeights(gf, config, gguf_arch(gf)[1], tp_size, keep_blocks=keep, keep_rope_pairs=keep_pairs,
                       keep_expert_blocks=keep and not (moe_quant is not None and moe_quant.enabled))


def checkpoint_quant_spec(config: HFModelConfig, quant: WeightQuantSpec | None) -> WeightQuantSpec | None:
    """The scheme the linear layers will hold: a GPTQ / AWQ checkpoint's own, else `quant`.

    Resolve the op table for this spec. `--quant_type` with a pre-quantized checkpoint must name
    the same scheme (and group size, when one is given); anything else is a ModelLoadError.
    """
    ckpt = config.quantization
    if ckpt is None:
        return quant
    if quant is not None and quant.enabled and (
        quant.scheme != ckpt.scheme or quant.group_size not in (-1, ckpt.group_size)
    ):
        raise ModelLoadError(
            f"--quant_type asks for {quant.scheme} (group size {quant.group_size}) but the checkpoint is already "
            f"{ckpt.method} {ckpt.bits}-bit ({ckpt.scheme}, group size {ckpt.group_size}); drop --quant_type "
            "or load a float checkpoint"
        )
    return WeightQuantSpec(ckpt.scheme, ckpt.group_size, ckpt.sym)


def safetensors_files(model_dir: str | Path) -> dict[Path, set[str] | None]:
    """The weight files to read: {path: tensor names the index promises in it (None: unindexed)}.

    Prefers `model.safetensors.index.json` (sharded), then `model.safetensors`. Refuses pickle-only
    directories with a conversion hint, and index entries that escape the directory or are missing.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _files_from_index(model_dir, index)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {_inside(model_dir, SINGLE_FILE, single.name): None}
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles[:3])}), which flashllm "
            "never loads because unpickling can run code; convert them to safetensors first (e.g. "
            "in a sandbox: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ModelLoadError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; expected safetensors weights")


def _files_from_index(model_dir: Path, index: Path) -> dict[Path, set[str] | None]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no 'weight_map' object mapping tensor names to files")
    files: dict[Path, set[str] | None] = {}
    resolved: dict[str, Path] = {}
    for tensor_name, file_name in weight_map.items():
        if not isinstance(file_name, str):
            raise ModelLoadError(f"{index}: entry for {tensor_name!r} is not a file name: {file_name!r}")
        if file_name not in resolved:
            resolved[file_name] = _inside(model_dir, file_name, index.name)
        files.setdefault(resolved[file_name], set()).add(tensor_name)
    return files


def _allowed_roots(model_dir: Path) -> list[Path]:
    root = model_dir.resolve()
    # A Hugging Face hub cache snapshot links its files to ../../blobs; that sibling is the one
    # place outside the directory a weight file may resolve to.
    if root.parent.name == "snapshots":
        return [root, root.parent.parent / "blobs"]
    return [root]


def _inside(model_dir: Path, file_name: str, source: str) -> Path:
    """`model_dir / file_name`, refusing absolute paths, `..`, symlinks out of the dir, missing files."""
    relative = Path(file_name)
    if relative.is_absolute() or ".." in relative.parts or file_name.startswith(("/", "\\")):
        raise ModelLoadError(
            f"{source} names {file_name!r}, a path outside the model directory; refusing to read it"
        )
    path = model_dir / relative
    if not path.is_file():
        raise ModelLoadError(f"{source} names {file_name!r}, which does not exist in {model_dir}")
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in _allowed_roots(model_dir)):
        raise ModelLoadError(
            f"{file_name!r} in {model_dir} is a link to {real}, outside the model directory; "
            "refusing to read it"
        )
    if real.suffix != ".safetensors" and path.suffix != ".safetensors":
        raise ModelLoadError(f"{source} names {file_name!r}, which is not a .safetensors file")
    return path


def _base_model_prefix(files: dict[Path, set[str] | None], model: torch.nn.Module) -> str:
    """"model." when the checkpoint was saved from the base model (`layers.0...`, `embed_tokens.weight`, as some
    embedding models ship) while the architecture names its decoder `model.`; else "" (names as they are)."""
    first = next(iter(files), None)
    if first is None or not any(name.startswith("model.") for name, _ in model.named_parameters()):
        return ""
    try:
        with safe_open(first, framework="pt", device="cpu") as f:
            names = list(f.keys())
    except SafetensorError:
        return ""  # _iter_tensors reports the file
    bare = any(n.startswith(("layers.", "embed_tokens.")) for n in names)
    return "model." if bare and not any(n.startswith("model.") for n in names) else ""


def _iter_tensors(
    files: dict[Path, set[str] | None], progress: bool, seen: set[str], prefix: str = ""
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (prefix + name, unread CheckpointTensor in the file's dtype) from each file; names go to `seen`.

    Nothing is read here: a weight loader narrows the tensor to this rank's shard and reads only
    that (the whole tensor where it keeps it whole, and always with one rank). The copy into the
    parameter converts dtype and device in one pass.

    Each tensor comes from its own opening of the file: safetensors maps the whole file, and every
    page read stays in the process's resident memory while the mapping lives, so one opening per
    file held a whole shard's bytes beside the parameters they were copied into (the 0.5b shape's
    load peaked at 3.0 GB resident for 1.98 GB of fp32 weights). Re-reading the header is cheap.
    """
    total = sum(len(names) for names in files.values() if names is not None) or None
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path, promised in files.items():
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    names = list(f.keys())
                _check_promised(path, promised, names)
                for name in names:
                    seen.add(prefix + name)
                    with safe_open(path, framework="pt", device="cpu") as f:
                        yield prefix + name, CheckpointTensor.open(prefix + name, f.get_slice(name))
                    bar.update(1)
            except SafetensorError as exc:
                raise ModelLoadError(f"{path.name} is not a valid safetensors file ({_printable(str(exc))})") from None


def _printable(text: str, limit: int = 300) -> str:
    """A library's message about a hostile file on one line: it may quote the file's bytes (newlines,
    control characters), which are escaped; cut to `limit` characters."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _check_promised(path: Path, promised: set[str] | None, names: list[str]) -> None:
    if promised is None:
        return
    absent = sorted(promised - set(names))
    if absent:
        raise ModelLoadError(
            f"{INDEX_FILE} places {len(absent)} tensor(s) in {path.name} that it does not contain "
            f"(e.g. {absent[0]!r}); the checkpoint is incomplete, re-download or re-convert it"
        )


def _check_complete(model: torch.nn.Module, loaded: set[str], seen: set[str]) -> None:
    """Raise naming the checkpoint tensors whose parameters were not (fully) loaded."""
    missing: list[str] = []
    mapping = getattr(model, "packed_modules_mapping", {})
    for name, _ in model.named_parameters():
        if name in loaded:
            continue
        expected = [name]
        for packed, shards in mapping.items():
            if f".{packed}." in name:
                expected = [name.replace(f".{packed}.", f".{shard}.") for shard in shards]
        missing += [n for n in expected if n not in seen] or [name]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}{more}; "
            "the weights are incomplete or do not match config.json"
        )


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, MAX_JSON_BYTES)


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults in `generation_config.json` ({} when the file is absent, or for a GGUF file)."""
    if is_gguf_path(model_dir):
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = _read_json(path)
    try:  # refused here, before any weight loads, rather than at the first request
        SamplingParams.from_generation_config(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}; fix the value or delete the key") from None
    return config


def resolve_dtype(
    dtype: str, checkpoint_dtype: torch.dtype | None, device_supports_bf16_natively: bool,
    accelerator: bool,
) -> torch.dtype:
    """The parameter dtype for `--dtype auto|float32|float16|bfloat16`.

    auto: on an accelerator, the checkpoint's dtype (bf16 falls back to fp16 where the device has
    no native bf16; an undeclared dtype means fp32); on a host CPU (accelerator=False), fp32, since half-precision
    matmuls are slow there, unless the CPU has native bf16 and the checkpoint is half precision.
    An explicit dtype is returned as asked (the op table resolution checks the device runs it).
    """
    name = dtype.lower()
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise ValueError(f"--dtype {dtype!r} is not one of: auto, float32, float16, bfloat16")
        return _DTYPE_NAMES[name]
    checkpoint_dtype = checkpoint_dtype or torch.float32
    is_half = checkpoint_dtype in (torch.float16, torch.bfloat16)
    if not accelerator:
        return torch.bfloat16 if is_half and device_supports_bf16_natively else torch.float32
    if checkpoint_dtype == torch.bfloat16 and not device_supports_bf16_natively:
        return torch.float16
    return checkpoint_dtype if is_half or checkpoint_dtype == torch.float32 else torch.float32
