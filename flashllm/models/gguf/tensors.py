"""GGUF tensors -> checkpoint-named torch tensors (llama.cpp's q/k row order undone), or QuantizedWeights."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import moe
from flashllm.models.gguf.config import LLAMA3_ROPE_FREQS, ArchMap
from flashllm.models.gguf.reader import GGUFFile, import_gguf

logger = logging.getLogger(__name__)

GGUF_BLOCKS_MODULE = "flashllm.quant.gguf_blocks"
_ATTR = "_gguf_quantized_shards"  # shard id -> QuantizedWeight of a layer loading GGUF blocks as they are
_EXPERTS_ATTR = "_gguf_expert_blocks"  # (expert, "gate" | "up" | "down") -> QuantizedWeight of a MoE layer's experts
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    **moe.LAYER_NAMES,
}
_LAYER_TENSOR = re.compile(r"blk\.(\d{1,6})\.([a-z_0-9]+)\.(weight|bias)")  # Falcon-40B's attn_norm_2
_SKIPPED = (LLAMA3_ROPE_FREQS,)  # consumed by the config (llama3 rope scaling)


def hf_tensor_name(gguf_name: str, layer_names: Mapping[str, str] | None = None,
                   layer_params: Mapping[str, str] | None = None) -> str | None:
    """The checkpoint (transformers) name of a GGUF tensor ("blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj.weight").

    layer_names: the arch's own GGUF layer part -> checkpoint module entries, taking precedence over Llama's
    (Gemma 3's `ffn_norm` is its pre_feedforward_layernorm, not Llama's post_attention_layernorm).
    layer_params: the arch's GGUF "part.suffix" -> checkpoint parameter entries (ArchMap.layer_params).
    None when the name is not one flashllm's llama-family models hold. A layer's stacked experts
    ("blk.3.ffn_up_exps.weight") get moe.stacked_name, which GGUFWeights expands into per-expert names.
    """
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):  # a LayerNorm's bias (StarCoder 2's output_norm)
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in moe.EXPERT_PROJS and match.group(3) == "weight":
        return moe.stacked_name(int(match.group(1)), match.group(2))
    if match and f"{match.group(2)}.{match.group(3)}" in (layer_params or {}):
        return f"model.layers.{int(match.group(1))}.{layer_params[f'{match.group(2)}.{match.group(3)}']}"
    names = {**_LAYER_NAMES, **(layer_names or {})}
    if match and match.group(2) in names:
        return f"model.layers.{int(match.group(1))}.{names[match.group(2)]}.{match.group(3)}"
    return None


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter reordering of Q/K rows (interleaved rotary pairs -> half-split pairs).

    rows: (num_heads * head_dim, ...) weight rows (float values or a block format's bytes: the
    reorder moves whole rows) or a (num_heads * head_dim,) bias. Within each head, row 2i of the
    GGUF tensor is row i of the transformers checkpoint and row 2i + 1 is row i + head_dim/2.
    """
    head_dim = rows.shape[0] // num_heads
    if head_dim * num_heads != rows.shape[0] or head_dim % 2:
        raise ModelLoadError(f"cannot split {rows.shape[0]} rows into {num_heads} heads of even size")
    pairs = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return pairs.swapaxes(1, 2).reshape(rows.shape)


@dataclass
class _Shards:
    """The QuantizedWeights a linear layer collects while loading: shard id -> weight, `expected` of them."""

    expected: int
    weights: dict[Any, Any] = dataclasses.field(default_factory=dict)


@dataclass
class _ExpertBlocks:
    """The QuantizedWeights a MoE layer keeping GGUF blocks collects: (expert, "gate" | "up" | "down") -> weight,
    and the device its stacked parameters were on."""

    device: torch.device
    weights: dict[tuple[int, str], Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One GGUF tensor (or one part of a fused one) to load: its checkpoint name, the heads its rows are reordered
    over (None: as is), the offset the converter added to its values (ArchMap.norm_offset; subtracted on loading)
    and which of the tensor's rows it is."""

    gguf_name: str
    hf_name: str
    permute_heads: int | None
    offset: float = 0.0
    rows: tuple[int, int] | None = None  # [start, stop) of a fused tensor's rows (ArchMap.fused_rows); None: all
    joined: tuple[str, ...] = ()  # further GGUF tensors whose values join with this one's (ArchMap.joined)
    join: Any = None  # (float values of gguf_name and `joined`, in order) -> the checkpoint tensor


class GGUFWeights:
    """The tensors of a GGUF file as the model's load_weights takes them.

    Float tensors load as float; quantized ones are dequantized with the gguf package, except the
    2-D linear weights of layers whose every projection is of one type flashllm.quant.gguf_blocks
    represents (when that module is present and `keep_blocks`, i.e. no --quant_type asks for another
    scheme): those become the layer's QuantizedWeight as stored. Under tensor parallelism a rank keeps
    its rows of each projection and, for a row-parallel layer, its input features, cut at block
    boundaries of the stored bytes (a layer whose rank slice would split a block loads as float).
    Embedding and norm tensors are always float, and so are MoE routers (float_in_checkpoints layers).
    Stacked experts (moe.py) of a layer whose three projections are of types gguf_blocks represents (gate
    and up of one layout) stay as stored too, one QuantizedWeight pair per expert (FusedMoE.use_expert_blocks),
    each rank holding whole blocks of the down projection's input features (FusedMoE.split_at_blocks), unless
    `keep_expert_blocks` is false (--quant_type or --moe_quant_type asks for a scheme) or some rank would hold
    no whole block. Otherwise they reach the MoE layer one
    expert at a time as float (dequantized where stored in blocks); the layer keeps them so, or stores them
    in its own --quant_type expert scheme, and its weight_loader takes each rank's part under tensor parallelism.
    keep_rope_pairs: leave Q and K rows in the file's interleaved rotary order (and run the model's rotary
    with is_neox=False) instead of reordering them for the half-split one; for a rotary kernel that
    declares keeps_interleaved_pairs (ops/rotary_embedding.py), whose Q.K sums follow the file's order.
    """

    def __init__(self, gf: GGUFFile, config: Any, spec: ArchMap, tp_size: int = 1, keep_blocks: bool = True,
                 keep_rope_pairs: bool = False, keep_expert_blocks: bool | None = None) -> None:
        self.gf, self.config, self.tp_size, self.keep_blocks = gf, config, tp_size, keep_blocks
        self.keep_expert_blocks = keep_blocks if keep_expert_blocks is None else keep_expert_blocks
        self._expert_layers: dict[str, str] = {}  # stacked checkpoint prefix -> FusedMoE module keeping its blocks
        self.interleaved = keep_rope_pairs and spec.permute_qk  # the file's pairs are interleaved and stay so
        self.plan = self._plan(spec)
        self._routed: dict[str, tuple[str, Any]] = {}  # checkpoint name -> (linear layer name, shard id)
        self._dequantized: Counter[str] = Counter()

    def _plan(self, spec: ArchMap) -> list[PlannedTensor]:
        heads = ({"self_attn.q_proj": self.config.num_attention_heads,
                  "self_attn.k_proj": self.config.num_key_value_heads} if spec.permute_qk else {})
        plan, unknown = [], []
        fused = spec.fused_rows(self.config) if spec.fused_rows is not None else {}
        joined = {parts[0]: (parts, module, join) for parts, module, join in spec.joined}
        in_joins = {part for parts, _, _ in spec.joined for part in parts}
        for name in self.gf.tensors:
            if name in _SKIPPED or name in spec.config_tensors or spec.skips(name, self.config):
                continue
            match = _LAYER_TENSOR.fullmatch(name)
            if match and match.group(2) in fused:
                plan += self._fused_parts(name, int(match.group(1)), match.group(3), fused[match.group(2)])
                continue
            if match and match.group(2) in joined:
                plan.append(self._joined(name, match, *joined[match.group(2)]))
            if match and match.group(2) in in_joins:
                continue  # a later part is planned with the first part of its join
            hf_name = spec.tensor_names.get(name) or hf_tensor_name(name, spec.layer_names, spec.layer_params)
            if hf_name is None:
                unknown.append(name)
                continue
            proj = hf_name.rsplit(".", 1)[0].split(".", 3)[-1]
            permute = spec.permute_qk and not self.interleaved
            offset = spec.norm_offset if name.endswith("norm.weight") else 0.0
            plan.append(PlannedTensor(name, hf_name, heads.get(proj) if permute else None, offset))
        if unknown:
            more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
            raise ModelLoadError(f"{self.gf.name} holds tensors a {spec.architecture} does not have: "
                                 f"{', '.join(unknown[:3])}{more}; the file is not a plain {spec.model_type} model")
        return plan

    def _joined(self, name: str, match: re.Match[str], parts: tuple[str, ...], module: str, join: Any) -> PlannedTensor:
        """The checkpoint tensor `module` of this layer, joined from `name` and the layer's other parts; refuses a
        file that lacks one of them."""
        layer, suffix = match.group(1), match.group(3)
        others = tuple(f"blk.{layer}.{part}.{suffix}" for part in parts[1:])
        missing = [other for other in others if other not in self.gf.tensors]
        if missing:
            raise ModelLoadError(f"{self.gf.name} has {name} without {missing[0]}; together they are the checkpoint's "
                                 f"{module}: the file is incomplete")
        return PlannedTensor(name, f"model.layers.{int(layer)}.{module}.{suffix}", None, joined=others, join=join)

    def _fused_parts(self, name: str, layer: int, suffix: str,
                     parts: tuple[tuple[str, int], ...]) -> list[PlannedTensor]:
        """One PlannedTensor per checkpoint projection of a fused GGUF tensor, each its run of rows (whole rows of
        blocks, so a quantized tensor's parts stay as stored); refuses a tensor whose rows the parts do not fill."""
        shape = self.gf.tensors[name].shape
        rows = int(shape[-1]) if len(shape) else 0  # ggml order: rows last
        if sum(size for _, size in parts) != rows:
            raise ModelLoadError(f"{self.gf.name}: {name} has {rows} rows; the config's "
                                 f"{' + '.join(f'{m} {n}' for m, n in parts)} give {sum(n for _, n in parts)}")
        planned, start = [], 0
        for module, size in parts:
            hf_name = f"model.layers.{layer}.{module}.{suffix}"
            planned.append(PlannedTensor(name, hf_name, None, rows=(start, start + size)))
            start += size
        return planned

    def prepare(self, model: nn.Module) -> None:
        """Pick the linear layers that take GGUF blocks as they are; drop their float weights (never allocated twice).
        With interleaved Q/K rows kept, switch the model's rotary layers to adjacent pairs."""
        if self.interleaved:
            from flashllm.models.layers.rotary import RotaryEmbedding

            for module in model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.is_neox = False
        blocks = _gguf_blocks()
        if blocks is not None and self.keep_expert_blocks:
            self._prepare_experts(model, blocks)
        if blocks is None or not self.keep_blocks:
            return
        from flashllm.models.layers.linear import LinearBase

        layers: dict[str, list[tuple[PlannedTensor, Any]]] = {}
        for item in self.plan:
            if not item.hf_name.endswith(".weight") or moe.STACKED_SUFFIX in item.hf_name:
                continue
            param_name, shard_id = model._param_target(item.hf_name)
            prefix = param_name.rpartition(".")[0]
            try:
                module = model.get_submodule(prefix)
            except AttributeError:
                continue
            if isinstance(module, LinearBase) and not getattr(module, "float_in_checkpoints", False):
                layers.setdefault(prefix, []).append((item, shard_id))
        for prefix, shards in layers.items():
            types = {self.gf.tensors[item.gguf_name].tensor_type for item, _ in shards}
            if any(len(self.gf.tensors[item.gguf_name].shape) != 2 for item, _ in shards):
                continue  # a (hidden,) shared-expert gate: float
            if not types <= blocks.SUPPORTED_TYPES or len({blocks.layout_of(t) for t in types}) != 1:
                continue  # float projections, or block types of different layouts: the layer loads float
            module = model.get_submodule(prefix)
            k_start, k_size, k_full = module.input_shard()
            if k_size != k_full and any((k_start % blocks.block_of(t)) or (k_size % blocks.block_of(t)) for t in types):
                continue  # a rank's input features would cut a block (or q8_K's 256 activations): float
            setattr(module, _ATTR, _Shards(len(shards)))
            module.weight = None
            self._routed.update({item.hf_name: (prefix, shard_id) for item, shard_id in shards})

    def _prepare_experts(self, model: nn.Module, blocks: Any) -> None:
        """Pick the MoE layers whose experts stay GGUF blocks (see the class docstring); drop their float stacks."""
        from flashllm.models.layers.moe import FusedMoE

        stacks: dict[str, dict[str, Any]] = {}  # "model.layers.L.mlp" -> projection -> GGUF tensor
        for item in self.plan:
            if moe.STACKED_SUFFIX in item.hf_name:
                prefix, _, tail = item.hf_name.partition(moe.STACKED_SUFFIX)
                stacks.setdefault(prefix, {})[tail.split(".")[1]] = self.gf.tensors[item.gguf_name]
        for prefix, projections in stacks.items():
            types = {proj: tensor.tensor_type for proj, tensor in projections.items()}
            if set(types) != {"gate_proj", "up_proj", "down_proj"} or not set(types.values()) <= blocks.SUPPORTED_TYPES:
                continue
            if blocks.layout_of(types["gate_proj"]) != blocks.layout_of(types["up_proj"]):
                continue  # gate and up rows join into one w13 weight: they must share a layout
            param_name, _ = model._param_target(f"{prefix}.experts.0.gate_proj.weight")
            name = param_name.rpartition(".")[0]
            module = model.get_submodule(name)
            if not isinstance(module, FusedMoE):
                continue
            if not module.split_at_blocks(blocks.block_of(types["down_proj"])):
                continue  # the down projection's features are not whole blocks on every rank: float experts
            setattr(module, _EXPERTS_ATTR, _ExpertBlocks(module.w13_weight.device))
            module.w13_weight = module.w2_weight = None  # never allocated beside the blocks
            self._expert_layers[prefix] = name

    def tensors(self, model: nn.Module, seen: set[str], progress: bool) -> Iterator[tuple[str, Tensor]]:
        """Yield (checkpoint name, float tensor) per planned tensor; routed weights go to their layer instead."""
        with tqdm(total=len(self.plan), desc="Loading GGUF weights", unit="tensor", disable=not progress) as bar:
            for item in self.plan:
                seen.add(item.hf_name)
                if item.hf_name in self._routed:
                    self._route(model, item)
                elif item.hf_name.partition(moe.STACKED_SUFFIX)[0] in self._expert_layers:
                    self._route_experts(model, item)
                elif moe.STACKED_SUFFIX in item.hf_name:
                    yield from self._expert_tensors(model, item)
                else:
                    yield item.hf_name, self._float_tensor(item)
                bar.update(1)
        if self._dequantized:
            kinds = ", ".join(f"{n} {t}" for t, n in sorted(self._dequantized.items()))
            reason = ("flashllm.quant.gguf_blocks is not installed" if _gguf_blocks() is None
                      else "--quant_type asks for another scheme" if not self.keep_blocks
                      else "they are routers, embeddings, norms, mixed-type fused layers or experts, or "
                           "tensor-parallel shards that would cut a block")
            logger.info("%s: dequantized %s tensor(s) to float with the gguf package (%s)", self.gf.name, kinds, reason)

    def _rows(self, item: PlannedTensor) -> np.ndarray:
        data = np.asarray(self.gf.tensors[item.gguf_name].data)
        if item.rows is not None:
            data = data[item.rows[0]:item.rows[1]]
        return unpermute_rope_rows(data, item.permute_heads) if item.permute_heads else data

    def _expert_tensors(self, model: nn.Module, item: PlannedTensor) -> Iterator[tuple[str, Tensor]]:
        """One layer's stacked experts of one projection as per-expert float tensors, dequantized one expert at a
        time so that memory holds a single expert's floats beside the model; under expert parallelism only this
        rank's experts (the layer never reads the others')."""
        tensor = self.gf.tensors[item.gguf_name]
        if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            self._dequantized[f"{tensor.tensor_type.name} experts"] += 1
        layer = model.get_submodule(item.hf_name.partition(moe.STACKED_SUFFIX)[0] + ".experts")
        local = layer.local_experts()
        for expert, (name, rows) in enumerate(moe.expert_rows(item.hf_name, np.asarray(tensor.data))):
            if expert in local:
                yield name, self._to_float(rows, tensor.tensor_type)

    def _route_experts(self, model: nn.Module, item: PlannedTensor) -> None:
        """One projection of a layer's stacked experts, kept as stored: this rank's experts, each cut to the
        rank's intermediate features (rows of gate and up, input features of down), as QuantizedWeights."""
        prefix, _, tail = item.hf_name.partition(moe.STACKED_SUFFIX)
        module = model.get_submodule(self._expert_layers[prefix])
        part = moe.EXPERT_PARTS[tail.split(".")[1]]
        tensor = self.gf.tensors[item.gguf_name]
        data = np.asarray(tensor.data)  # (E, N, row bytes)
        first, count = module.rank_features()
        collected = getattr(module, _EXPERTS_ATTR).weights
        blocks = _gguf_blocks()
        for expert in module.local_experts():
            rows = data[expert]
            if part == "down":
                raw = rows[:, blocks.row_bytes(tensor.tensor_type, first):blocks.row_bytes(tensor.tensor_type, first + count)]
                shape = (module.hidden_size, count)
            else:
                raw, shape = rows[first:first + count], (count, module.hidden_size)
            try:
                collected[expert, part] = blocks.weight_from_gguf(np.ascontiguousarray(raw), tensor.tensor_type, shape)
            except ValueError as exc:
                raise ModelLoadError(f"{self.gf.name}: {item.gguf_name} expert {expert}: {exc}") from None

    def _finish_experts(self, module: nn.Module, blocks: _ExpertBlocks) -> None:
        """Give a MoE layer its experts' blocks: gate and up rows joined into w13, on the layer's device."""
        collected, device = blocks.weights, blocks.device
        missing = [(e, p) for e in module.local_experts() for p in ("gate", "up", "down") if (e, p) not in collected]
        if missing:
            raise ModelLoadError(f"{self.gf.name}: a MoE layer received no {missing[0][1]} projection of expert "
                                 f"{missing[0][0]} ({len(missing)} missing)")
        pairs = [(_to_device(concat_rows([collected[e, "gate"], collected[e, "up"]]), device),
                  _to_device(collected[e, "down"], device)) for e in module.local_experts()]
        delattr(module, _EXPERTS_ATTR)
        try:
            module.use_expert_blocks(pairs)
        except ValueError as exc:
            raise ModelLoadError(f"{self.gf.name}: {exc}") from None

    def _float_tensor(self, item: PlannedTensor) -> Tensor:
        tensor = self.gf.tensors[item.gguf_name]
        if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            self._dequantized[tensor.tensor_type.name] += 1
        if item.join is not None:  # the parts whole, as stored (ArchMap.joined)
            return item.join([self._to_float(np.asarray(self.gf.tensors[n].data), self.gf.tensors[n].tensor_type)
                              for n in (item.gguf_name, *item.joined)])
        value = self._to_float(self._rows(item), tensor.tensor_type)
        if item.offset:
            # the file holds offset + w, the model's weight_loader adds the offset back to w: exact in float32
            # wherever the stored value is >= 0.5, so the loaded parameter is the file's value bit for bit
            value = value.float() - item.offset
        # llama.cpp stores the shared expert's (1, hidden) gate as (hidden,); the checkpoint layer is (1, hidden)
        return value.reshape(1, -1) if item.hf_name.endswith("shared_expert_gate.weight") else value

    @staticmethod
    def _to_float(rows: np.ndarray, ggml_type: Any) -> Tensor:
        """Float values (F32 / F16 / BF16 as stored) or dequantized blocks (float32) of `rows`, copied out of the file."""
        kind = ggml_type.name
        if kind in ("F32", "F16"):
            return torch.from_numpy(np.array(rows, copy=True))
        if kind == "BF16":
            return torch.from_numpy(np.array(rows.view(np.int16), copy=True)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(import_gguf().quants.dequantize(rows, ggml_type)))

    def _route(self, model: nn.Module, item: PlannedTensor) -> None:
        prefix, shard_id = self._routed[item.hf_name]
        module = model.get_submodule(prefix)
        tensor = self.gf.tensors[item.gguf_name]
        shape = (int(tensor.shape[1]), int(tensor.shape[0])) if len(tensor.shape) == 2 else None
        if shape is None:
            raise ModelLoadError(f"{self.gf.name}: {item.gguf_name} is not a 2-D weight")
        if item.rows is not None:
            shape = (item.rows[1] - item.rows[0], shape[1])
        try:
            raw, shape = _rank_slice(module, shard_id, self._rows(item), tensor.tensor_type, shape)
            weight = _gguf_blocks().weight_from_gguf(raw, tensor.tensor_type, shape)
        except ValueError as exc:
            raise ModelLoadError(f"{self.gf.name}: {item.gguf_name}: {exc}") from None
        getattr(module, _ATTR).weights[shard_id] = weight

    def finish(self, module: nn.Module) -> bool:
        """Give a layer loading GGUF blocks its QuantizedWeight (shards joined along N), a MoE layer keeping its
        experts' blocks those (FusedMoE.use_expert_blocks); False for any other."""
        experts = getattr(module, _EXPERTS_ATTR, None)
        if isinstance(experts, _ExpertBlocks):
            self._finish_experts(module, experts)
            return True
        collected = getattr(module, _ATTR, None)
        if not isinstance(collected, _Shards):
            return False
        shards = collected.weights
        order = sorted(shards, key=lambda s: module.output_shard(s)[0])  # where each lands in this rank's rows
        if len(order) != collected.expected:
            raise ModelLoadError(f"{self.gf.name}: a layer received {len(order)} of its {collected.expected} "
                                 "GGUF projections")
        weight = concat_rows([shards[s] for s in order])
        if tuple(weight.data.shape[:1]) != (module.output_size_per_partition,):
            raise ModelLoadError(f"{self.gf.name}: a layer's GGUF weight has {weight.data.shape[0]} rows, expected "
                                 f"{module.output_size_per_partition}")
        device = module.bias.device if module.bias is not None else torch.device("cpu")
        module.qweight = _to_device(weight, device)
        delattr(module, _ATTR)
        return True

    def mark_head(self, model: nn.Module) -> None:
        """Name the GGUF type the LM head's float rows were read from on its QuantizedWeight (gguf_type), so
        that a backend can round the head's input as llama.cpp does for that type (it multiplies the
        stored blocks): `output.weight`, else the tied `token_embd.weight`; only for a float head of a
        quantized type whose activation blocks divide the hidden size, and not with --quant_type."""
        from flashllm.models.layers.embedding import LMHead
        from flashllm.quant.gguf_activations import BLOCK, FORMAT_OF_TYPE

        head = getattr(model, "lm_head", None)
        if not self.keep_blocks or not isinstance(head, LMHead) or head.qweight is None or head.qweight.scheme != "none":
            return
        name = "output.weight" if "output.weight" in self.gf.tensors else "token_embd.weight"
        tensor = self.gf.tensors.get(name)
        kind = None if tensor is None else tensor.tensor_type.name
        if kind in FORMAT_OF_TYPE and head.qweight.in_features % BLOCK[FORMAT_OF_TYPE[kind]] == 0:
            head.qweight = dataclasses.replace(head.qweight, gguf_type=kind)


def _to_device(weight: Any, device: torch.device) -> Any:
    """A QuantizedWeight with every tensor field moved to `device`."""
    moved = {f.name: getattr(weight, f.name).to(device) for f in dataclasses.fields(weight)
             if isinstance(getattr(weight, f.name), Tensor)}
    return dataclasses.replace(weight, **moved)


def _rank_slice(module: nn.Module, shard_id: Any, rows: np.ndarray, ggml_type: Any,
                shape: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int]]:
    """A GGUF tensor's raw bytes (N, row bytes) cut to what this rank holds of it: the rows that
    module.output_shard(shard_id) names and, for a row-parallel layer, the bytes of the input features
    module.input_shard() names (prepare() checked they are whole blocks); returns (bytes, (rows, features))."""
    _, start, count, full = module.output_shard(shard_id)
    k_start, k_size, k_full = module.input_shard()
    if (full, k_full) != shape:
        raise ValueError(f"the tensor is {shape} (out, in); the layer expects {(full, k_full)}")
    raw = rows[start:start + count]
    if k_size != k_full:
        row_bytes = _gguf_blocks().row_bytes
        raw = raw[:, row_bytes(ggml_type, k_start):row_bytes(ggml_type, k_start + k_size)]
    return np.ascontiguousarray(raw), (count, k_size)


def concat_rows(weights: list[Any]) -> Any:
    """QuantizedWeights of the projections of one fused layer joined along the output features (N).

    Every tensor field of a QuantizedWeight leads with N (data, scales, zeros), so the join is per
    field; the shards must share the scheme, group size, which fields they carry and their dtypes
    (GGUF types of one gguf_blocks.layout_of do).
    """
    first = weights[0]
    if len(weights) == 1:
        return first
    fields = [f.name for f in dataclasses.fields(first) if isinstance(getattr(first, f.name), Tensor)]
    for other in weights[1:]:
        same = (other.scheme, other.group_size) == (first.scheme, first.group_size) and fields == [
            f.name for f in dataclasses.fields(other) if isinstance(getattr(other, f.name), Tensor)] and all(
            getattr(other, n).dtype == getattr(first, n).dtype for n in fields)
        if not same:
            raise ModelLoadError(f"the projections of a fused layer are stored as {first.scheme} and {other.scheme}; "
                                 "they cannot be joined")
    for name in ("smooth", "input_perm"):
        if getattr(first, name, None) is not None:
            raise ModelLoadError(f"GGUF weights carry no {name}; cannot join shards that do")
    names = list(dict.fromkeys(w.gguf_type for w in weights if w.gguf_type))
    return dataclasses.replace(first, **{n: torch.cat([getattr(w, n) for w in weights]) for n in fields},
                               gguf_type="+".join(names) or None, kernel_cache={})


def gguf_quant_capability(gf: GGUFFile, scheme: str, tp_size: int = 1) -> str:
    """The quant capability the op table needs for this file: gguf_blocks' (AFFINE_CAPABILITY) when some linear
    weight will load as GGUF blocks (see GGUFWeights.prepare), else `scheme` (the --quant_type one)."""
    blocks = _gguf_blocks()
    if blocks is None or scheme != "none":
        return scheme
    linear = [t.tensor_type for name, t in gf.tensors.items()  # 2-D weights and 3-D stacked experts
              if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) in (2, 3)]
    return blocks.request_quant(linear)


def _gguf_blocks() -> Any:
    """flashllm.quant.gguf_blocks when it is present (imported lazily), else None."""
    try:
        return importlib.import_module(GGUF_BLOCKS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != GGUF_BLOCKS_MODULE:
            raise
        return None

