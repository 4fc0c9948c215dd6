"""Mixture-of-experts MLP: a top-k router and stacked experts run by ops.fused_moe (Mixtral, Qwen2-MoE)."""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.layers.linear import ReplicatedLinear, copy_checked
from flashllm.models.layers.mlp import GatedMLP
from flashllm.ops.fused_moe import expert_batches
from flashllm.ops.quant_matmul import INT4_SYMMETRIC_ZERO, INT8_MAX, MIN_SCALE, QuantizedWeight, pack_int4
from flashllm.quant.spec import WeightQuantSpec
from flashllm.quant.weight_only import INT4_SYMMETRIC_MAX

logger = logging.getLogger(__name__)

# The checkpoint names of expert weights, per expert (HF checkpoints: Mixtral's w1/w3/w2, Qwen2-MoE's
# gate/up/down_proj) or already stacked over the experts (what transformers 5 writes with
# save_original_format=False: gate_up_proj (E, 2I, H), gate rows first, and down_proj (E, H, I)).
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
W13, W2 = "w13_weight", "w2_weight"


def expert_param_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """Checkpoint tensor name -> (FusedMoE parameter name, shard id), or None for a non-expert tensor.

    The shard id is (expert, "gate" | "up" | "down") for one expert's projection and None for a
    tensor stacked over every expert.
    """
    match = _PER_EXPERT.match(name)
    if match:
        part = _PART[match["proj"]]
        return f"{match['prefix']}.{W2 if part == 'down' else W13}", (int(match["expert"]), part)
    match = _STACKED.match(name)
    if match:
        return f"{match['prefix']}.{W2 if match['proj'] == 'down_proj' else W13}", None
    return None


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits (T, E) -> (topk_weights (T, k) fp32, topk_ids (T, k) int64).

    Softmax over all E experts in fp32, then the k largest probabilities; renormalize makes each
    token's k weights sum to one (Mixtral always, Qwen2-MoE when norm_topk_prob).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def with_fused_experts(model: nn.Module, loaded: set[str]) -> set[str]:
    """The loaded parameter names, each FusedMoE's stacked w13 / w2 counted only once every expert's
    projections (or the stacked tensor) arrived (CausalLM.load_weights counts a parameter at its first shard)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            loaded -= {f"{name}.{W13}", f"{name}.{W2}"}
            loaded |= {f"{name}.{param}" for param in module.fully_loaded()}
    return loaded


class RouterLinear(ReplicatedLinear):
    """A small replicated projection that decides routing (the expert gate, the shared-expert gate).

    It stays in the model dtype whatever --quant_type says: quantizing it would move tokens to other
    experts, for a matrix of E rows that is a rounding error of the model's bytes. GPTQ / AWQ checkpoints
    keep it float too, so it takes no packed tensors (prepare_prequantized skips it).
    """

    float_in_checkpoints: ClassVar[bool] = True

    def process_weights_after_loading(self, quant: WeightQuantSpec | None = None) -> None:
        """Build the dense QuantizedWeight; `quant` is ignored on purpose (see the class docstring)."""
        super().process_weights_after_loading(None)


class FusedMoE(nn.Module):
    """E gated experts stacked for ops.fused_moe: w13_weight (E, 2I/tp, H), w2_weight (E, H, I/tp).

    Under tensor parallelism every rank holds every expert, with its slice of the intermediate
    features (gate and up rows [r*I/tp, (r+1)*I/tp), the same columns of down); the ranks' partial
    outputs are summed with an all-reduce, as a row-parallel linear does.
    With expert_parallel the ranks instead hold whole experts, E/tp each (rank r: experts
    [r*E/tp, (r+1)*E/tp)): every rank has every token (the attention before it ends in an
    all-reduce), runs only the (token, expert) pairs routed to its own experts, and the same
    all-reduce combines the ranks' weighted sums. The stacked parameters are then (E/tp, 2I, H) and
    (E/tp, H, I); num_experts stays the model's E.

    Experts may instead be kept as one (w13, w2) QuantizedWeight pair per local expert (use_expert_blocks:
    a GGUF file's K-quant or Q8_0 blocks as stored, models/gguf/tensors.py). The stacked parameters are
    then dropped and each chosen expert's two products run on ops.quant_matmul, the op the dense layers of
    such a file run on, so every backend that multiplies the file's dense blocks runs its experts too.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel and num_experts % tp_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {tp_size} expert-parallel ranks; "
                             "choose a tensor parallel size that divides the expert count, or drop "
                             "--enable-expert-parallel")
        # ranks splitting each expert's intermediate features (1 under expert parallelism)
        self.feature_shards = 1 if self.expert_parallel else tp_size
        if intermediate_size % self.feature_shards:
            raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by tp_size={tp_size}; "
                             "choose a tensor parallel size that divides it, or --enable-expert-parallel")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # whole, as in the checkpoint
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_local_experts = num_experts // tp_size if self.expert_parallel else num_experts
        self.first_expert = tp_rank * self.num_local_experts if self.expert_parallel else 0
        inter = intermediate_size // self.feature_shards
        self.w13_weight = self._param((self.num_local_experts, 2 * inter, hidden_size), dtype, device)
        self.w2_weight = self._param((self.num_local_experts, hidden_size, inter), dtype, device)
        self._fused_moe = ops.fused_moe
        self._expert_schemes = _kernel_schemes(ops)
        self._loaded: dict[str, set[tuple[int, str] | None]] = {W13: set(), W2: set()}
        # w8a16 experts: fp32 (E, 2I) and (E, H) scales beside int8 codes (process_weights_after_loading)
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        self._quant_matmul = ops.quant_matmul
        self.expert_blocks: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None
        self._block_split: tuple[int, int] | None = None  # (first, count) features of split_at_blocks

    def rank_features(self) -> tuple[int, int]:
        """(first, count) of each expert's intermediate features this rank holds (all of them under expert parallelism;
        a share of whole blocks after split_at_blocks)."""
        if self._block_split is not None:
            return self._block_split
        inter = self.intermediate_size // self.feature_shards
        return (0 if self.expert_parallel else self.tp_rank * inter), inter

    def split_at_blocks(self, block: int) -> bool:
        """For experts to be kept as blocks of `block` input features (use_expert_blocks): cut each expert's
        intermediate features over the ranks at whole blocks, as evenly as they allow (768 features in blocks of
        256 over 2 ranks: 512 and 256); the ranks' partial outputs still sum in the all-reduce. False, changing
        nothing, where the features are not whole blocks or some rank would get none."""
        if self.feature_shards == 1:
            return self.intermediate_size % block == 0
        blocks, rest = divmod(self.intermediate_size, block)
        base, extra = divmod(blocks, self.feature_shards)
        if rest or base == 0:
            return False
        rank = self.tp_rank
        self._block_split = (block * (rank * base + min(rank, extra)), block * (base + (rank < extra)))
        return True

    def local_experts(self) -> range:
        """The model's expert ids this rank holds."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def use_expert_blocks(self, blocks: list[tuple[QuantizedWeight, QuantizedWeight]]) -> None:
        """Hold the experts as given, one (w13 (2I/tp, H), w2 (H, I/tp)) pair per local expert in order, in place
        of the stacked parameters (dropped). Raises ValueError on a count or shape that does not fit the layer."""
        first, inter = self.rank_features()
        if len(blocks) != self.num_local_experts:
            raise ValueError(f"{len(blocks)} expert weights for a layer holding {self.num_local_experts} experts")
        for expert, (w13, w2) in zip(self.local_experts(), blocks, strict=True):
            shapes = ((w13.out_features, w13.in_features), (w2.out_features, w2.in_features))
            if shapes != ((2 * inter, self.hidden_size), (self.hidden_size, inter)):
                raise ValueError(f"expert {expert}'s weights are (out, in) {shapes}; the layer expects "
                                 f"{((2 * inter, self.hidden_size), (self.hidden_size, inter))}")
        self.w13_weight = self.w2_weight = None
        self.expert_blocks = list(blocks)

    @property
    def syncs_with_host(self) -> str | None:
        """Why this layer's forward reads device values on the host (so no device graph can hold it), or None:
        experts kept as blocks are chosen on the host, one quant_matmul pair each."""
        return "the chosen experts of GGUF block experts" if self.expert_blocks is not None else None

    def expert_nbytes(self) -> int:
        """Bytes one local expert's weights take (codes, scales and offsets where quantized)."""
        if self.expert_blocks is not None:
            return sum(w.nbytes for w in self.expert_blocks[0]) if self.expert_blocks else 0
        params = (self.w13_weight, self.w2_weight, self.w13_scale, self.w2_scale)
        return sum(p.nbytes for p in params if p is not None) // self.num_local_experts

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: tuple[int, str] | None = None) -> None:
        """Copy this rank's part of a checkpoint expert tensor into `param` (see expert_param_target).

        shard_id (e, "gate" | "up"): one expert's (I, H) projection into w13; (e, "down"): its
        (H, I) into w2; None: the (E, 2I, H) or (E, H, I) tensor stacked over every expert.
        Raises ValueError on a shape that does not match the config or an expert id past E.
        """
        name = W13 if param is self.w13_weight else W2
        inter = self.w2_weight.shape[2]  # this rank's intermediate features
        start = 0 if self.expert_parallel else self.tp_rank * inter
        if shard_id is None:
            self._load_stacked(name, loaded, inter, start)
        else:
            self._load_expert(name, loaded, shard_id, inter, start)
        self._loaded[name].add(shard_id)

    def _load_stacked(self, name: str, loaded: Tensor, inter: int, start: int) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        expected = (e, 2 * i, h) if name == W13 else (e, h, i)
        _check(loaded, expected, f"stacked experts {name}")
        loaded = loaded.narrow(0, self.first_expert, self.num_local_experts)  # this rank's experts (all: no EP)
        if name == W2:
            copy_checked(self.w2_weight, loaded.narrow(2, start, inter), name)
            return
        copy_checked(self.w13_weight.narrow(1, 0, inter), loaded.narrow(1, start, inter), name)
        copy_checked(self.w13_weight.narrow(1, inter, inter), loaded.narrow(1, i + start, inter), name)

    def _load_expert(self, name: str, loaded: Tensor, shard_id: tuple[int, str], inter: int, start: int) -> None:
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is past the config's {self.num_experts} experts")
        if (part == "down") != (name == W2):
            raise ValueError(f"{part} projection cannot load into {name}")
        h, i = self.hidden_size, self.intermediate_size
        what = f"expert {expert} {part}"
        _check(loaded, (h, i) if part == "down" else (i, h), what)
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank's expert: never read from the file here
        if part == "down":
            copy_checked(self.w2_weight[local], loaded.narrow(1, start, inter), what)
            return
        offset = 0 if part == "gate" else inter
        copy_checked(self.w13_weight[local].narrow(0, offset, inter), loaded.narrow(0, start, inter), what)

    def fully_loaded(self) -> set[str]:
        """Names (w13_weight, w2_weight) whose every expert (this rank's, under expert parallelism) and projection
        has been loaded."""
        experts = self.local_experts()
        need = {W13: {(e, p) for e in experts for p in ("gate", "up")}, W2: {(e, "down") for e in experts}}
        return {n for n, shards in self._loaded.items() if None in shards or need[n] <= shards}

    def process_weights_after_loading(self, quant: WeightQuantSpec | None = None) -> None:
        """Store the experts as integer codes under --quant_type w8a16 (int8, one fp32 scale per expert and
        output channel, whatever the group size) or symmetric w4a16 (int4 packed two a byte, one scale
        per expert, output channel and group of quant.group_size input features), if the bound
        fused_moe kernel claims the format; anything else keeps them in the model dtype, saying so.
        Raises ValueError when the group size does not divide an expert's (rank's) input features."""
        if quant is None or not quant.enabled or self.expert_blocks is not None:
            return
        if quant.scheme not in ("w8a16", "w4a16") or not quant.symmetric:
            _warn_once(f"MoE experts stay in {self.w13_weight.dtype} under {quant.scheme}"
                       f"{'' if quant.symmetric else ' (asymmetric)'}: flashllm quantizes experts as w8a16 or "
                       "symmetric w4a16 only")
            return
        if quant.scheme not in self._expert_schemes:
            _warn_once(f"the bound fused_moe kernel does not take {quant.scheme} experts (caps "
                       f"{sorted(self._expert_schemes)}): MoE experts stay in {self.w13_weight.dtype}")
            return
        group = quant.group_size if quant.scheme == "w4a16" else -1
        self.w13_weight, self.w13_scale = self._quantized(self.w13_weight, quant.scheme, group, False)
        self.w2_weight, self.w2_scale = self._quantized(self.w2_weight, quant.scheme, group, True)

    def _quantized(self, weight: Tensor, scheme: str, group_size: int,
                   input_is_sharded: bool) -> tuple[nn.Parameter, nn.Parameter]:
        """(E, N, K) float -> codes and fp32 scales, round to nearest against max|w| / qmax per group.

        w8a16: int8 codes (E, N, K), scales (E, N). w4a16: codes + 8 packed two a byte (E, N, K/2)
        as QuantizedWeight's w4a16, scales (E, N, G). A per-row scale of w2, whose rows are split over
        the ranks' intermediate features, comes from the all-reduced row extremes, so every rank
        quantizes as one rank would (a group lies within one rank's slice when it divides the slice).
        """
        experts, rows, k = weight.shape
        if group_size != -1 and k % group_size:
            raise ValueError(f"group size {group_size} does not divide the experts' {k} input features (per rank); "
                             "choose a --weightonly_group_size that divides hidden and moe intermediate sizes")
        groups = 1 if group_size == -1 else k // group_size
        qmax = INT8_MAX if scheme == "w8a16" else INT4_SYMMETRIC_MAX
        w = weight.data.float().reshape(experts, rows, groups, k // groups)
        amax = w.abs().amax(dim=-1)  # (E, N, G)
        if input_is_sharded and self.feature_shards > 1 and groups == 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        scales = (amax / qmax).clamp(min=MIN_SCALE)
        codes = torch.round(w / scales[..., None]).clamp_(-qmax, qmax).reshape(experts, rows, k)
        if scheme == "w8a16":
            codes, scales = codes.to(torch.int8), scales[..., 0]
        else:
            codes = pack_int4((codes + INT4_SYMMETRIC_ZERO).to(torch.uint8))
        return nn.Parameter(codes, requires_grad=False), nn.Parameter(scales.contiguous(), requires_grad=False)

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x (T, H), topk_weights (T, k) fp32, topk_ids (T, k) int64 -> (T, H) in x.dtype, summed over ranks."""
        out = self._local_experts(x, topk_weights, topk_ids) if self.expert_parallel else self._run(
            x, topk_weights, topk_ids)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out

    def _run(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if self.expert_blocks is not None:
            return self._run_blocks(x, topk_weights, topk_ids)
        if self.w13_scale is None:
            return self._fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self._fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                               self.w13_scale, self.w2_scale)

    def _run_blocks(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """fused_moe's sum over expert_blocks: each chosen expert's rows through its two quant_matmul products
        (ops.fused_moe.expert_batches), the weighted sum in fp32, returned in x.dtype."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert, rows, weights in expert_batches(topk_ids, topk_weights, self.num_local_experts):
            if rows is None:  # the one decode token
                out += self._block_expert(x, expert).float() * weights
            else:
                out.index_add_(0, rows, self._block_expert(x[rows], expert).float() * weights)
        return out.to(x.dtype)

    def _block_expert(self, x: Tensor, expert: int) -> Tensor:
        """Local expert `expert`'s gated MLP over rows x (n, H) through its blocks -> (n, H) in x.dtype."""
        w13, w2 = self.expert_blocks[expert]
        gate, up = self._quant_matmul(x, w13).float().chunk(2, dim=-1)
        return self._quant_matmul((F.silu(gate) * up).to(x.dtype), w2)

    def _local_experts(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """Dispatch: the (token, slot) pairs routed to this rank's experts become rows of one k=1 call on
        the local experts (global id - first_expert); combine: their outputs added back at their tokens
        (a token with two local experts gets both). This rank's share of the sum, (T, H) in x.dtype."""
        local = topk_ids - self.first_expert
        token_idx, slot_idx = ((local >= 0) & (local < self.num_local_experts)).nonzero(as_tuple=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # summed in fp32, as fused_moe sums
        if token_idx.numel():
            rows = self._run(x[token_idx], topk_weights[token_idx, slot_idx, None],
                             local[token_idx, slot_idx, None])
            out.index_add_(0, token_idx, rows.float())
        return out.to(x.dtype)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Log `message` at WARNING once per process (every MoE layer of a model would repeat it)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


def _kernel_schemes(ops: Any) -> frozenset[str]:
    """The expert formats the op table's fused_moe kernel claims ({"none"} for a table without records)."""
    try:
        return ops.kernel("fused_moe").caps.quant
    except (AttributeError, KeyError):
        return frozenset({"none"})


def _check(loaded: Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what} has shape {tuple(loaded.shape)} but the model expects {expected}; "
                         "the checkpoint does not match its config.json")


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: route each token to its top-k experts, sum their outputs by weight.

    With a shared expert (Qwen2-MoE) every token also goes through one dense gated MLP, scaled by
    sigmoid(shared_expert_gate(x)), and added (unscaled where shared_expert_gated is False: Granite-MoE-Shared's
    shared_mlp). router_bias: the router has a bias (gpt-oss); experts_class: a
    FusedMoE subclass holding more than the stacked weights (gpt-oss's biased experts). Submodule names follow
    the checkpoints: gate, experts, shared_expert, shared_expert_gate. With expert_parallel the routed experts are
    split whole over the ranks (FusedMoE); the router stays replicated and the shared expert tensor parallel.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False, router_bias: bool = False,
                 experts_class: type[FusedMoE] = FusedMoE, shared_expert_gated: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = RouterLinear(hidden_size, num_experts, router_bias, ops, dtype, device, tp_rank, tp_size)
        self.experts = experts_class(num_experts, hidden_size, intermediate_size, ops, dtype, device, tp_rank, tp_size,
                                     expert_parallel)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: RouterLinear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, ops, dtype, device,
                                          tp_rank, tp_size)
            if shared_expert_gated:
                self.shared_expert_gate = RouterLinear(hidden_size, 1, False, ops, dtype, device, tp_rank, tp_size)

    def unstreamed_bytes(self) -> int:
        """Expert weight bytes one decode token does not read on this rank: E - k of the E experts
        (expert parallel: at least E/tp - k of the rank's E/tp)."""
        experts = self.experts
        return max(experts.num_local_experts - self.top_k, 0) * experts.expert_nbytes()

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden) in x.dtype."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out

