"""The cpu backend's fused decode step: a standard decoder stack in one native call (csrc/decode_stack.c).

The per-op path spends ~0.3 ms of interpreter and ctypes work per layer at batch 1 (8 ms of a
72 ms token for the 0.5b shape on `epyc3-2c`, docs/benchmarks.md). For a decode step this module hands the
whole stack, embedding output to final norm, to one C call running the same native kernels in
the same order, so its hidden states equal the per-op native path's (tests hold it to that).

It takes a step only when everything is plain: a model that declares the decoder_stack fusion
(flashllm/registry/fusions.py: every layer the standard pre-norm block with a SwiGLU MLP, or with a
mixture of SwiGLU experts, moe_stack.py, and DeepSeek's latent attention in place of the attention,
mla_stack.py; Llama, Qwen2, Mixtral, Qwen2-MoE and DeepSeek-V2/V3 do) on one rank, whose
op table resolved its ops to the cpu backend's kernels (not the reference's, which shares the cpu
adapter), no sliding window, fp32 norms and activations, fp32 or
native w8a16/w4a16 weights, fp32 KV caches without scales, and a decode batch (every sequence one
new token, at most native.MAX_TOKENS of them). Anything else returns None and the model's own
forward runs. Multi-LoRA rows run here too: layers with adapter slot tables (fp32, one slot count
and rank) add each row's adapter delta after the base product (csrc/decode_lora.c). Every index
the C code follows (adapter slots included) is range-checked, in C, before the step writes anything.
FLASHLLM_CPU_FUSED_DECODE=0 turns it off (for A/B runs).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.backends.cpu import mla_stack, moe_stack, native, native_ops, parallel
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.registry.fusions import (
    DECODER_STACK,
    LM_HEAD,
    DecoderStackFusion,
    LinearWeights,
    LMHeadFusion,
    LoRASlots,
    declared,
)
from flashllm.registry.resolve import OpTable

ENV_SWITCH = "FLASHLLM_CPU_FUSED_DECODE"
_KINDS = {"none": 0, "w8a16": 1, "w4a16": 2}
# csrc/decode_stack.c's LINEAR_W4A8 / LINEAR_W8A8: weights the per-op path runs against int8 activations
_AGAINST_INT8 = {"w4a16": 3, "w8a16": 4}
_I64, _P = ctypes.c_int64, ctypes.c_void_p
_LORA_MAX_SHARDS = 3


class _Lora(ctypes.Structure):  # csrc/decode_lora.h's stack_lora
    _fields_ = [("shards", _I64), ("rank", _I64), ("count", _I64), ("a", _P), ("b", _P * _LORA_MAX_SHARDS),
                ("offset", _I64 * _LORA_MAX_SHARDS), ("rows", _I64 * _LORA_MAX_SHARDS)]


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I64), ("N", _I64), ("K", _I64), ("G", _I64),
                ("weight", _P), ("scales", _P), ("zeros", _P), ("offsets", _P), ("bias", _P), ("lora", _P),
                ("afmt", _I64)]

class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _P), ("post_norm", _P), ("k_cache", _P), ("v_cache", _P), ("moe", _P), ("mla", _P),
                ("q_norm", _P), ("k_norm", _P)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("T", "H", "Hq", "Hk", "D", "I", "rot", "neox", "block_size", "width")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cos_sin", _P), ("positions", _P), ("slots", _P), ("rows", _P), ("tables", _P), ("seq_lens", _P),
        ("final_norm", _P), ("threads", ctypes.c_int), ("split_elements", _I64), ("attention_split", _I64),
        ("silu_split", _I64), ("num_blocks", _I64), ("max_position", _I64), ("ids", _P), ("embed", _P),
        ("vocab", _I64), ("lora_slots", _P), ("lora_count", _I64), ("lora_rank", _I64), ("head_afmt", _I64),
        ("tap_layers", _P), ("num_taps", _I64), ("taps", _P)]

def by_sequence(rows: Tensor, steps: int) -> Tensor:
    """A burst's rows, `steps` steps of T tokens one step after another (steps * T, W), as the rows of one
    sequence after another, each sequence's steps in order: how a burst hands its rows to a drafter."""
    return rows.view(steps, -1, rows.shape[-1]).transpose(0, 1).reshape(-1, rows.shape[-1])


def _fp32(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu")


class _Unsupported(Exception):
    """The model is not one the fused step takes (the message says why; kept for debugging)."""


def _lora(slots: LoRASlots, shape: tuple[int, int], keep: list[Any]) -> _Lora:
    """The C descriptor of a linear layer's adapter slots (out_features, in_features = `shape`); keeps
    the tensors and the descriptor alive. The C code reads the live tables, which adapters load into in place."""
    a, b = slots.lora_a, slots.lora_b
    if not (_fp32(a) and a.is_contiguous() and a.dim() == 3 and 0 < len(b) <= _LORA_MAX_SHARDS
            and len(slots.offsets) == len(b) and a.shape[1:] == (len(b) * slots.rank, shape[1])):
        raise _Unsupported("LoRA slots are not fp32 (max_loras, shards * rank, in_features) tables")
    lora = _Lora(shards=len(b), rank=slots.rank, count=a.shape[0], a=a.data_ptr())
    for s, (table, offset) in enumerate(zip(b, slots.offsets, strict=True)):
        if not (_fp32(table) and table.is_contiguous() and table.dim() == 3 and table.shape[0] == a.shape[0]
                and table.shape[2] == slots.rank and 0 <= offset and offset + table.shape[1] <= shape[0]):
            raise _Unsupported("a LoRA B table is not fp32 (max_loras, rows, rank) within the layer's outputs")
        lora.b[s], lora.offset[s], lora.rows[s] = table.data_ptr(), offset, table.shape[1]
    keep.extend((a, *b, lora))
    return lora


def _linear(layer: LinearWeights, shape: tuple[int, int], keep: list[Any]) -> _Linear:
    """The C descriptor of a declared linear layer on one rank, whose weight must be `shape`
    (out_features, in_features); keeps the tensors it points at alive."""
    weight: QuantizedWeight | None = layer.weight
    if weight is None or layer.tp_size != 1 or weight.input_perm is not None or weight.scheme not in _KINDS:
        raise _Unsupported("a linear layer's weight is not a plain fp32 / w8a16 / w4a16 weight on one rank")
    if (weight.out_features, weight.in_features) != shape:
        raise _Unsupported(f"a {(weight.out_features, weight.in_features)} weight where the geometry says {shape}")
    bias = layer.bias
    if not _fp32(bias) or (bias is not None and tuple(bias.shape) != shape[:1]):
        raise _Unsupported("bias is not fp32 (out_features,)")
    desc = _Linear(kind=_KINDS[weight.scheme], N=weight.out_features, K=weight.in_features, G=1)
    if weight.scheme == "none":
        if not _fp32(weight.data) or not weight.data.is_contiguous():
            raise _Unsupported("float weight is not contiguous fp32")
        desc.weight = weight.data.data_ptr()
        keep.append(weight.data)
    else:
        if not native.supports_quantized(weight, 1):
            raise _Unsupported(f"{weight.scheme} weight the native kernels do not take")
        codes, scales, zeros = native._layout(weight)
        desc.G = weight.num_groups
        if native.int8_activations(weight):  # the per-op path's choice, made once for the step
            desc.kind = _AGAINST_INT8[weight.scheme]
            desc.afmt = native.A8_FORMATS[native.llama_format(weight)]
        desc.weight, desc.scales = codes.data_ptr(), scales.data_ptr()
        desc.zeros = None if zeros is None else zeros.data_ptr()
        offsets = native.offsets_layout(weight)  # only the xA8 kinds read it: supports_quantized saw to that
        desc.offsets = None if offsets is None else offsets.data_ptr()
        keep.extend(t for t in (codes, scales, zeros, offsets) if t is not None)
    if bias is not None:
        bias = bias.contiguous()
        desc.bias = bias.data_ptr()
        keep.append(bias)
    if layer.lora is not None:
        desc.lora = ctypes.addressof(_lora(layer.lora, shape, keep))
    return desc


def _lora_geometry(layers: list[_Layer]) -> tuple[int, int]:
    """(slots, rank) every adapted linear layer shares, (0, 0) without adapters; _Unsupported for a
    mix the step's one slot per token cannot index (different slot counts or ranks)."""
    found = {(lora.count, lora.rank) for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
             if linear.lora for lora in (_Lora.from_address(linear.lora),)}
    if len(found) > 1:
        raise _Unsupported(f"LoRA slot tables of different slot counts or ranks: {sorted(found)}")
    return found.pop() if found else (0, 0)


def _embedding_table(table: Tensor, hidden: int) -> Tensor | None:
    """The declared one-rank embedding table if the C code can copy its rows itself (fp32 (vocab,
    hidden), contiguous; F.embedding costs ~0.1 ms of a batch-1 step on `intel-2c`); None where torch embeds the
    ids before the call."""
    if not (_fp32(table) and table.is_contiguous() and table.dim() == 2 and table.shape[1] == hidden):
        return None
    return table


def _check_cpu_kernels(ops: OpTable) -> None:
    """The fused step stands in for the cpu backend's kernels only: a model whose op table resolved
    an op to another backend's (the reference, which shares the cpu adapter, or ipex) keeps its own
    forward. The layers call what the table resolved, so the table says what they run."""
    from flashllm.backends.cpu import kernels, quant

    if not isinstance(ops, OpTable):
        raise _Unsupported(f"the layers were built with a {type(ops).__name__}, not a resolved OpTable")
    wanted = {"rms_norm": kernels.rms_norm, "rotary_embedding": kernels.rotary_embedding,
              "write_kv_cache": kernels.write_kv_cache, "paged_attention": kernels.paged_attention,
              "silu_and_mul": kernels.silu_and_mul, "quant_matmul": quant.quant_matmul}
    for op, fn in wanted.items():
        if op not in ops.sources or ops.kernel(op).fn is not fn:
            raise _Unsupported(f"op {op} runs {ops.sources.get(op)}'s kernel, not the cpu backend's native one")


class FusedDecode:
    """Callable(input_ids, positions, kv_caches, attn_metadata) -> final hidden (T, H), or None when
    the step is not a plain decode step; built by `build` from a model's declared decoder stack."""

    def __init__(self, stack: DecoderStackFusion, head_format: str | None = None, tapped: Any = None) -> None:
        """tapped: the model's decoder-stack module; while its `hidden_taps` (models/llama.py HiddenTaps) is set,
        each step also keeps the streams entering the tapped layers there, as the layer-by-layer forward does."""
        _check_cpu_kernels(stack.ops)
        if stack.activation != "silu" or stack.embed_tp_size != 1 or not stack.layers:
            raise _Unsupported(f"activation {stack.activation!r}, an embedding over {stack.embed_tp_size} ranks "
                               f"or {len(stack.layers)} layers")
        hidden, heads, kv_heads, dim = stack.norm.weight.shape[0], stack.num_heads, stack.num_kv_heads, stack.head_dim
        if kv_heads < 1 or heads % kv_heads:
            raise _Unsupported(f"{heads} query heads do not share {kv_heads} KV heads evenly")
        rotary, inter = stack.rotary, stack.intermediate_size
        self._keep: list[Any] = []
        self._moe: list[ctypes.Structure] = []  # the MoE layers' descriptors (moe_stack.py), alive while used
        self._mla: list[ctypes.Structure] = []  # the latent attention layers' (mla_stack.py)
        latent = [layer.mla is not None for layer in stack.layers]
        if any(latent) and not (all(latent) and kv_heads == 1):
            raise _Unsupported("latent attention in some layers only, or over more than one cache row a token")
        self._caches_per_layer = 1 if latent[0] else 2
        layers = []
        for layer in stack.layers:
            if layer.sliding_window is not None:
                raise _Unsupported("sliding-window attention")
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(_fp32(n) and n.is_contiguous() and tuple(n.shape) == (hidden,) for n in norms):
                raise _Unsupported("norm weights are not fp32 (hidden_size,)")
            self._keep.extend(norms)
            if layer.moe is not None:
                try:
                    self._moe.append(moe_stack.describe(layer.moe, hidden, stack.ops, self._keep, _linear))
                except moe_stack.Unsupported as exc:
                    raise _Unsupported(str(exc)) from exc
                mlp = {"moe": ctypes.addressof(self._moe[-1])}
            else:
                mlp = {"gate_up": _linear(layer.gate_up_proj, (2 * inter, hidden), self._keep),
                       "down": _linear(layer.down_proj, (hidden, inter), self._keep)}
            if layer.mla is not None:
                if layer.qkv_proj is not None or layer.o_proj is not layer.mla.o_proj:
                    raise _Unsupported("a latent attention layer that also declares a qkv_proj or another o_proj")
                try:
                    self._mla.append(mla_stack.describe(layer.mla, hidden, heads, rotary.rotary_dim, stack.ops,
                                                        self._keep, _linear))
                except mla_stack.Unsupported as exc:
                    raise _Unsupported(str(exc)) from exc
                attention = {"mla": ctypes.addressof(self._mla[-1])}
            else:
                attention = {"qkv": _linear(layer.qkv_proj, ((heads + 2 * kv_heads) * dim, hidden), self._keep),
                             "o": _linear(layer.o_proj, (hidden, heads * dim), self._keep),
                             **self._head_norms(layer, dim, stack.norm.eps)}
            layers.append(_Layer(input_norm=norms[0].data_ptr(), post_norm=norms[1].data_ptr(), **attention, **mlp))
        if self._moe:
            self._keep.append(moe_stack.attach_scratch(self._moe))
        if self._mla:
            self._keep.append(mla_stack.attach_scratch(self._mla))
        cos_sin = rotary.cos_sin_cache
        if not (_fp32(cos_sin) and cos_sin.is_contiguous() and rotary.rotary_dim % 2 == 0 and _fp32(stack.norm.weight)
                and cos_sin.dim() == 2 and cos_sin.shape[1] == rotary.rotary_dim <= dim):
            raise _Unsupported("rotary table or final norm is not fp32")
        if not all(n.eps == stack.norm.eps for layer in stack.layers
                   for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            raise _Unsupported("norms with different eps")
        self._layers = (_Layer * len(layers))(*layers)
        self._lora_count, self._lora_rank = _lora_geometry(layers)
        self._embed = stack.embed_tokens  # (vocab, hidden) on this one rank
        self._hidden = hidden
        table = _embedding_table(self._embed, self._hidden)
        if table is not None:
            self._keep.append(table)
        self._final_norm = stack.norm.weight.contiguous()
        self._cos_sin = cos_sin
        self._max_position = cos_sin.shape[0]
        self._num_heads, self._num_kv_heads, self._head_dim = heads, kv_heads, dim
        self._inter = inter
        self._static = dict(H=self._hidden, Hq=self._num_heads, Hk=self._num_kv_heads, D=self._head_dim,
                            I=self._inter, rot=rotary.rotary_dim, neox=int(rotary.is_neox), eps=stack.norm.eps,
                            scale=stack.scale, cos_sin=cos_sin.data_ptr(),
                            final_norm=self._final_norm.data_ptr(), split_elements=native.SPLIT_MIN_ELEMENTS,
                            attention_split=native_ops.ATTENTION_SPLIT_WORK,
                            silu_split=native_ops.SILU_SPLIT_ELEMENTS, lora_count=self._lora_count,
                            lora_rank=self._lora_rank, head_afmt=_head_afmt(head_format, hidden))
        self._rows = torch.arange(native.MAX_TOKENS, dtype=torch.int64)  # sequence b's query is row b
        self._cache_key: list[tuple[object, ...]] = []  # the caches _bind_caches last took, as it compares them
        self._bound: tuple[int, int] | None = None
        # Kept from step to step, as building them costs ~0.1 ms of a batch-1 step on `intel-2c` (their Python runs
        # cold after each step's weight stream): the descriptor, whose per-step fields (every tensor
        # pointer among them) each call sets before the C code reads them; the residual stream,
        # scratch the C code alone writes; the scratch and its size per token count.
        self._step = _Step(max_position=self._max_position, rows=self._rows.data_ptr(),
                           embed=None if table is None else table.data_ptr(),
                           vocab=0 if table is None else table.shape[0], **self._static)
        self._residual = torch.empty(native.MAX_TOKENS, self._hidden)
        self._scratch = torch.empty(0)
        self._scratch_floats: dict[int, int] = {}
        self._held: tuple[Tensor, ...] = ()
        self._tapped = tapped
        self._tap_layers: tuple[Any, Tensor] | None = None  # (the HiddenTaps, its layers as an int64 tensor)
        self._taps_out: Tensor | None = None

    def _bind_caches(self, kv_caches: list[tuple[Tensor, ...]]) -> tuple[int, int] | None:
        """Point the layers at the KV caches; (num_blocks, block_size), or None for caches it does not take.

        Each step compares every cache's pointer, shape, strides and dtype with those last checked:
        the same caches skip the full check (~0.15 ms a step for 48 caches on `epyc3-2c`, more between the native
        calls, whose weight streams leave the interpreter's data cold)."""
        key = [(c.data_ptr(), c.shape, c.stride(), c.dtype) for cache in kv_caches for c in cache]
        if key == self._cache_key:
            return self._bound
        self._cache_key, self._bound = [], None
        shape = (self._num_kv_heads, self._head_dim)
        for cache in kv_caches:
            if len(cache) != self._caches_per_layer or not all(c.dtype == torch.float32 and c.is_contiguous() and c.dim() == 4
                                          and tuple(c.shape[2:]) == shape and c.shape == cache[0].shape
                                          for c in cache):
                return None
        if len(kv_caches) != len(self._layers):
            return None
        for layer, cache in zip(self._layers, kv_caches, strict=True):  # latent attention: one cache, k_cache
            layer.k_cache, layer.v_cache = cache[0].data_ptr(), cache[-1].data_ptr()
        self._cache_key, self._bound = key, (kv_caches[0][0].shape[0], kv_caches[0][0].shape[1])
        return self._bound

    def _head_norms(self, layer: Any, dim: int, eps: float) -> dict[str, int]:
        """The layer's per-head q / k norm weights as _Layer fields (none where it has none): fp32 (head_dim,),
        with the stack's eps (the C code norms every row with one eps)."""
        if layer.q_norm is None and layer.k_norm is None:
            return {}
        norms = (layer.q_norm, layer.k_norm)
        if any(n is None or not (_fp32(n.weight) and n.weight.is_contiguous() and tuple(n.weight.shape) == (dim,))
               or n.eps != eps for n in norms):
            raise _Unsupported("q / k norms that are not both fp32 (head_dim,) with the stack's eps")
        self._keep.extend(n.weight for n in norms)
        return {"q_norm": norms[0].weight.data_ptr(), "k_norm": norms[1].weight.data_ptr()}

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                 md: AttentionMetadata, lora_slots: Tensor | None = None) -> Tensor | None:
        hidden = self.set_step(input_ids, positions, kv_caches, md, lora_slots)
        if hidden is None:
            return None
        # every index the C code follows is range-checked there before anything is written: a bad
        # one returns 0 and the checked torch path runs instead
        done = native.library().flashllm_decode_stack(ctypes.addressof(self._layers), len(self._layers),
                                                      ctypes.addressof(self._step), hidden.data_ptr(),
                                                      self._residual.data_ptr(), self._scratch.data_ptr())
        if not done:
            return None
        if self._taps_out is not None:
            self._tap_layers[0].states = list(self._taps_out.split(self._hidden, dim=1))
        return hidden

    def _bind_taps(self, tokens: int) -> Tensor | None | bool:
        """Point the descriptor at a (tokens, taps x H) buffer for the tapped layers' streams: the buffer, None
        without taps, False for taps this stack does not have (the layer-by-layer forward runs instead)."""
        step, taps = self._step, getattr(self._tapped, "hidden_taps", None)
        if taps is None:
            step.taps, step.tap_layers, step.num_taps = None, None, 0
            return None
        if self._tap_layers is None or self._tap_layers[0] is not taps:
            layers = sorted(taps.layers)
            if not all(0 <= i < len(self._layers) for i in layers):
                return False
            self._tap_layers = (taps, torch.tensor(layers, dtype=torch.int64))
        layers = self._tap_layers[1]
        out = torch.empty(tokens, layers.numel() * self._hidden)
        step.taps, step.tap_layers, step.num_taps = out.data_ptr(), layers.data_ptr(), layers.numel()
        return out

    @property
    def copies_embedding(self) -> bool:
        """Whether the C code copies the embedding rows of int64 ids itself (a plain one-rank fp32 table)."""
        return bool(self._step.embed)

    def burst(self, head: ctypes.Structure, hidden: Tensor, steps: int, stops: Tensor, tokens: Tensor,
              picked: Tensor, states: Tensor | None = None) -> int:
        """flashllm_decode_burst from the step set_step set (with int64 ids, the C code embedding them, and
        set_step's `steps` at least this many): up to `steps` steps, each followed by the greedy head `head`
        (csrc/decode_stack.c's burst_head), stopping after a token in `stops`; their tokens into tokens
        (steps, T) int64, and with `states` ((steps, T, H) fp32) each step's final hidden states. Returns the
        steps done (0: refused before anything ran); keep_burst_taps(done) hands over their tapped streams."""
        return native.library().flashllm_decode_burst(
            ctypes.addressof(self._layers), len(self._layers), ctypes.addressof(self._step), ctypes.addressof(head),
            hidden.data_ptr(), self._residual.data_ptr(), self._scratch.data_ptr(), steps, stops.data_ptr(),
            stops.numel(), tokens.data_ptr(), picked.data_ptr(), None if states is None else states.data_ptr())

    @property
    def hidden_size(self) -> int:
        """The width of the hidden states a step writes."""
        return self._hidden

    def keep_burst_taps(self, done: int) -> None:
        """After a burst of `done` steps, its tapped layers' streams into the stack's HiddenTaps (where it keeps
        them) sequence after sequence, each sequence's steps in order: the order of the rows a burst hands a
        drafter (CpuRunner.execute_burst)."""
        if self._taps_out is None:
            return
        rows = by_sequence(self._taps_out[: done * int(self._step.T)], done)
        self._tap_layers[0].states = list(rows.split(self._hidden, dim=1))

    def set_step(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                 md: AttentionMetadata, lora_slots: Tensor | None = None, steps: int = 1) -> Tensor | None:
        """Point the kept step descriptor at this decode step and size the scratch; the (T, H) hidden
        buffer the C code writes (it holds the embedded tokens where the C code does not copy them),
        or None for a step the fused call does not take. With the embedding table in use, the
        descriptor points at input_ids, positions, slot_mapping and seq_lens themselves (the tensors,
        when contiguous and of the dtypes the C code reads), as decode_burst.py relies on.
        lora_slots: (T,) int64 each token's adapter slot (-1: the base model), or None for a step
        without adapter rows; a step with them needs a model whose layers have slot tables.
        steps: how many steps a burst from here may run (the taps' buffer holds each one's)."""
        tokens = input_ids.numel()
        if not (0 < tokens <= native.MAX_TOKENS and md.max_seqlen_q == 1 and md.seq_lens.numel() == tokens
                and md.slot_mapping.numel() == tokens and int(md.cu_seqlens_q[-1]) == tokens):
            return None
        if lora_slots is not None:
            if not (self._lora_rank and lora_slots.dtype == torch.int64 and lora_slots.device.type == "cpu"
                    and lora_slots.numel() == tokens):
                return None  # slots in range: checked in C with the other indices
            lora_slots = lora_slots.contiguous()
        bound = self._bind_caches(kv_caches)
        if bound is None:
            return None
        num_blocks, block_size = bound
        tables, seq_lens, slots = md.block_tables, md.seq_lens, md.slot_mapping
        if (tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tables.shape[0] != tokens
                or positions.dtype != torch.int64 or slots.dtype != torch.int64 or positions.numel() != tokens):
            return None
        positions, slots = positions.contiguous(), slots.contiguous()
        tables, seq_lens = tables.contiguous(), seq_lens.contiguous()
        step = self._step
        if step.embed and input_ids.dtype == torch.int64:  # the C code copies the ids' rows of the table
            input_ids = input_ids.contiguous()
            hidden, step.ids = torch.empty(tokens, self._hidden), input_ids.data_ptr()
        else:
            hidden, step.ids = F.embedding(input_ids, self._embed).contiguous(), None  # the lookup it declared
            if not _fp32(hidden):
                return None
        step.T, step.block_size, step.width, step.num_blocks = tokens, block_size, tables.shape[1], num_blocks
        step.positions, step.slots, step.tables = positions.data_ptr(), slots.data_ptr(), tables.data_ptr()
        step.seq_lens, step.threads = seq_lens.data_ptr(), parallel.workers()
        step.lora_slots = None if lora_slots is None else lora_slots.data_ptr()
        taps = self._bind_taps(tokens * steps)
        if taps is False:
            return None
        self._taps_out = taps
        # alive while the descriptor points at them
        self._held = (input_ids, positions, slots, tables, seq_lens, lora_slots, taps)
        size = self._scratch_floats.get(tokens)
        if size is None:
            size = self._scratch_floats[tokens] = native.library().flashllm_decode_stack_scratch(ctypes.addressof(step))
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.float32)
        return hidden


def build(model: Any) -> FusedDecode | None:
    """The fused decode step for `model`, or None where it does not apply (or is switched off): the
    model declares no decoder_stack fusion, or one this step does not take."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or native.library() is None:
        return None
    stack = declared(model, DECODER_STACK, DecoderStackFusion, keeps_taps=True)
    if stack is None:
        return None
    try:
        return FusedDecode(stack, _head_format(model), tapped=getattr(model, "model", None))
    except _Unsupported:
        return None


def _head_afmt(fmt: str | None, hidden: int) -> int:
    """csrc/decode_stack.c's head_afmt for a head input format (0: none)."""
    if fmt is None:
        return 0
    from flashllm.quant.gguf_activations import BLOCK

    if hidden % max(native.A8_BLOCK, BLOCK[fmt]):
        raise _Unsupported(f"{hidden} hidden features are not whole blocks of the head's {fmt} rounding")
    return native.A8_FORMATS[fmt]


def _head_format(model: Any) -> str | None:
    """llama.cpp's rounding of the LM head's input where the head is a GGUF one on one rank (see
    native.llama_format): the step's final states leave rounded so, as the head's product would
    round them (the greedy head and the decode bursts read them straight from the step)."""
    head = declared(model, LM_HEAD, LMHeadFusion)
    if head is None or head.qweight is None or head.tp_size != 1:
        return None
    return native.llama_format(head.qweight)
