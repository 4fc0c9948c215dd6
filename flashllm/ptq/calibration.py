"""Calibration for post-training quantization: JSONL text -> token windows -> per-linear input statistics."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from flashllm.models.layers.attention import Attention
from flashllm.models.layers.linear import LinearBase

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 2 * 1024**3   # a calibration set is a few MB; refuse anything absurd before reading it
MAX_LINE_BYTES = 16 * 1024**2
MAX_LINES = 1_000_000
DEFAULT_MAX_SAMPLE_ROWS = 1024  # AWQ's search runs on this many sampled input rows per linear


class CalibrationDataError(ValueError):
    """The calibration file cannot be used; the message names the file, the line and what to fix."""


def read_calibration_texts(path: str | Path) -> list[str]:
    """The non-empty "text" fields of a JSONL file, one JSON object per line (blank lines skipped).

    Bounded: at most MAX_FILE_BYTES, MAX_LINES lines of MAX_LINE_BYTES each. Raises
    CalibrationDataError naming the file and line for a missing file, invalid JSON, a missing
    or non-string "text" field, or a file without any text.
    """
    path = Path(path)
    if not path.is_file():
        raise CalibrationDataError(f"calibration file {path} does not exist; pass a JSONL file of {{\"text\": ...}} lines")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise CalibrationDataError(f"{path} is {size} bytes, more than the {MAX_FILE_BYTES} a calibration set may be; "
                                   "a few hundred documents are enough")
    texts: list[str] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number > MAX_LINES:
                raise CalibrationDataError(f"{path} has more than {MAX_LINES} lines; use a smaller sample")
            if len(raw) > MAX_LINE_BYTES:
                raise CalibrationDataError(f"{path}:{number} is longer than {MAX_LINE_BYTES} bytes; split the document")
            text = _line_text(path, number, raw)
            if text:
                texts.append(text)
    if not texts:
        raise CalibrationDataError(f"{path} has no non-empty \"text\" field; expected lines like {{\"text\": \"...\"}}")
    return texts


def _line_text(path: Path, number: int, raw: bytes) -> str | None:
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CalibrationDataError(f"{path}:{number} is not a UTF-8 JSON object ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise CalibrationDataError(f"{path}:{number} has no string \"text\" field; expected {{\"text\": \"...\"}}")
    return record["text"]


def pack_windows(token_lists: Iterable[Sequence[int]], num_samples: int, seq_len: int,
                 separator: int | None = None) -> list[list[int]]:
    """Concatenate tokenized documents (separated by `separator` when given) and cut num_samples windows of seq_len.

    Documents are packed end to end so that no window is padded. Fewer windows come back (with a
    warning) when the text is too short; none at all is an error.
    """
    if num_samples < 1 or seq_len < 2:
        raise CalibrationDataError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    stream: list[int] = []
    wanted = num_samples * seq_len
    for tokens in token_lists:
        stream.extend(tokens)
        if separator is not None:
            stream.append(separator)
        if len(stream) >= wanted:
            break
    count = min(num_samples, len(stream) // seq_len)
    if count == 0:
        raise CalibrationDataError(f"the calibration text has {len(stream)} tokens, fewer than one window of "
                                   f"--seq-len {seq_len}; add text or lower --seq-len")
    if count < num_samples:
        logger.warning("calibration text gives %d windows of %d tokens, not the %d asked for", count, seq_len,
                       num_samples)
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def tokenize_windows(texts: Sequence[str], tokenizer: Any, num_samples: int, seq_len: int) -> list[list[int]]:
    """Tokenize documents lazily (only as many as the windows need), separated by EOS, and pack them."""
    separator = getattr(tokenizer, "eos_token_id", None)
    lists = (tokenizer.encode(text, add_special_tokens=False) for text in texts)
    return pack_windows(lists, num_samples, seq_len, separator)


@dataclass
class LinearStats:
    """What the calibration saw at one linear layer's input x (T, K), accumulated over all windows.

    act_absmax (K,) max |x_j|; act_abssum (K,) sum |x_j| (mean = act_abssum / num_tokens);
    hessian (K, K) fp32 2 X^T X / n, when asked; samples (R, K) fp32 rows drawn uniformly over
    the windows, when asked (AWQ's search objective).
    """

    act_absmax: Tensor
    act_abssum: Tensor
    num_tokens: int = 0
    hessian: Tensor | None = None
    samples: list[Tensor] = field(default_factory=list)

    @property
    def act_mean(self) -> Tensor:
        """(K,) mean |x_j| over the calibration tokens."""
        return self.act_abssum / max(self.num_tokens, 1)

    def sample_rows(self) -> Tensor:
        """(R, K) the sampled input rows, fp32."""
        return torch.cat(self.samples) if self.samples else self.act_absmax.new_zeros(0, self.act_absmax.numel())


@dataclass
class CalibrationStats:
    """Per linear module name (flashllm's, e.g. model.layers.0.self_attn.qkv_proj) its LinearStats;
    per attention block prefix (model.layers.0.self_attn) the (Hk,) max |k| and max |v| of what the
    KV cache stores (keys after RoPE)."""

    linears: dict[str, LinearStats] = field(default_factory=dict)
    kv_absmax: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Which statistics to gather: the cheap per-channel ones always, the rest when asked."""

    hessian: bool = False
    max_sample_rows: int = 0
    kv: bool = False


@torch.inference_mode()
def collect_stats(model: nn.Module, windows: Sequence[Sequence[int]], run_window: Callable[[list[int]], Any],
                  request: StatsRequest, progress: bool = True, seed: int = 0) -> CalibrationStats:
    """Run every window through the model once, with hooks on each LinearBase and Attention module.

    run_window(token_ids) runs one window as a prefill (e.g. flashllm.eval.forward.window_hidden).
    All layers' statistics are gathered in the same pass on the float model (not layer by layer
    on already-quantized layers): the memory is one (K, K) fp32 Hessian per linear when asked
    (about 2.3 GB for a 0.5B Qwen2) plus max_sample_rows rows per linear.
    """
    stats = CalibrationStats()
    rows_per_window = math.ceil(request.max_sample_rows / max(len(windows), 1)) if request.max_sample_rows else 0
    gen = torch.Generator().manual_seed(seed)
    picked: dict[str, Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            handles.append(module.register_forward_pre_hook(_linear_hook(stats, name, request, picked)))
        elif isinstance(module, Attention) and request.kv:
            block = name.rpartition(".")[0]
            handles.append(module.register_forward_pre_hook(_kv_hook(stats, block)))
    try:
        for window in tqdm(windows, desc="Calibrating", unit="window", disable=not progress):
            if rows_per_window:
                picked["rows"] = torch.randperm(len(window), generator=gen)[:rows_per_window]
            run_window(list(window))
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _linear_hook(stats: CalibrationStats, name: str, request: StatsRequest, picked: dict[str, Tensor]) -> Callable:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)  # (T, K)
        entry = stats.linears.get(name)
        if entry is None:
            k = x.shape[1]
            entry = LinearStats(x.new_zeros(k), x.new_zeros(k),
                                hessian=x.new_zeros(k, k) if request.hessian else None)
            stats.linears[name] = entry
        _accumulate(entry, x, picked.get("rows"))

    return hook


def _accumulate(entry: LinearStats, x: Tensor, rows: Tensor | None) -> None:
    """Fold one window's inputs x (T, K) fp32 into the running statistics, in place."""
    absx = x.abs()
    torch.maximum(entry.act_absmax, absx.amax(dim=0), out=entry.act_absmax)
    entry.act_abssum += absx.sum(dim=0)
    before, entry.num_tokens = entry.num_tokens, entry.num_tokens + x.shape[0]
    if entry.hessian is not None:
        # H_n = 2/n sum x x^T, rescaled rather than summed raw so it stays O(1) whatever n is
        entry.hessian.mul_(before / entry.num_tokens)
        entry.hessian.addmm_(x.T, x, alpha=2.0 / entry.num_tokens)
    if rows is not None:
        entry.samples.append(x[rows.to(x.device)].clone())


def _kv_hook(stats: CalibrationStats, block: str) -> Callable:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        k, v = args[1].detach(), args[2].detach()  # (T, Hk, D) each, as they go into the cache
        k_max = k.abs().to(torch.float32).amax(dim=(0, 2))
        v_max = v.abs().to(torch.float32).amax(dim=(0, 2))
        if block in stats.kv_absmax:
            old_k, old_v = stats.kv_absmax[block]
            k_max, v_max = torch.maximum(old_k, k_max), torch.maximum(old_v, v_max)
        stats.kv_absmax[block] = (k_max, v_max)

    return hook


# What produces each projection's input inside a Llama-style decoder layer, keyed by the module's
# name under the layer: ("norm", n) an RMSNorm whose scale can absorb 1/s; ("rows", p) a
# linear whose output rows can absorb it (only when its outputs are exactly this input's features).
INPUT_PRODUCERS: dict[str, tuple[str, str]] = {
    "self_attn.qkv_proj": ("norm", "input_layernorm"),
    "self_attn.o_proj": ("rows", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("norm", "post_attention_layernorm"),
    "mlp.down_proj": ("rows", "mlp.up_proj"),
}


@dataclass(frozen=True, slots=True)
class LinearGroup:
    """One flashllm linear layer and the checkpoint projections fused into it (they share one input).

    module: flashllm module name, the CalibrationStats key (model.layers.0.self_attn.qkv_proj);
    prefixes: checkpoint names in shard order (...q_proj, ...k_proj, ...v_proj);
    producer: ("norm" | "rows", checkpoint prefix) of what computes the input, or None.
    """

    module: str
    prefixes: tuple[str, ...]
    producer: tuple[str, str] | None

    def fused_weight(self, tensors: dict[str, Tensor]) -> Tensor:
        """The shards' weights stacked along the output rows, fp32 (N, K)."""
        return torch.cat([tensors[f"{p}.weight"].to(torch.float32) for p in self.prefixes])

    def shard_rows(self, tensors: dict[str, Tensor]) -> list[int]:
        """Output rows of each shard, in order."""
        return [int(tensors[f"{p}.weight"].shape[0]) for p in self.prefixes]


def linear_groups(model: nn.Module) -> list[LinearGroup]:
    """Every LinearBase of the model (the LM head is not one) with its checkpoint prefixes.

    Fused modules are expanded through the model class's packed_modules_mapping, exactly as the
    loader maps checkpoint names onto them.
    """
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    groups = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, leaf = name.rpartition(".")
        shards = mapping.get(leaf, [leaf])
        prefixes = tuple(f"{parent}.{shard}" if parent else shard for shard in shards)
        groups.append(LinearGroup(name, prefixes, _producer(name)))
    return groups


def _producer(name: str) -> tuple[str, str] | None:
    for role, (kind, producer) in INPUT_PRODUCERS.items():
        if name.endswith("." + role):
            layer = name[: -len(role) - 1]
            return kind, f"{layer}.{producer}"
    return None
