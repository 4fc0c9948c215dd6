"""DeepSeek-V2/V3 MoE: group-limited top-k routing (softmax, or sigmoid with a correction bias), shared experts."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from flashllm.models.layers.linear import copy_checked
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import FusedMoE, RouterLinear
from flashllm.models.mixtral import MixtralForCausalLM, MoEModelConfig
from flashllm.registry.fusions import LinearWeights, MoEWeights

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class SharedExpertsMoEConfig(MoEModelConfig):
    """MoEModelConfig plus DeepSeek's routing fields (GroupedMoEConfig), for decoders with Llama's attention and
    DeepSeek-style MoE layers (GLM-4.5, ERNIE 4.5): sparse_layers says which layers are MoE, n_routed_experts ==
    num_experts, n_shared_experts shared experts of moe_intermediate_size features each
    (shared_expert_intermediate_size their sum), choice_bias: the router's e_score_correction_bias."""

    first_k_dense_replace: int = 0
    n_routed_experts: int = 1
    n_shared_experts: int = 0
    sigmoid_scoring: bool = True
    group_limited: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    choice_bias: bool = True

    @property
    def num_parameters(self) -> int:
        """Every weight (MoEModelConfig's count, less the shared-expert gate these models have not, plus the
        correction biases)."""
        sparse = sum(self.sparse_layers)
        gate = self.hidden_size if self.shared_expert_intermediate_size else 0
        return MoEModelConfig.num_parameters.fget(self) + sparse * (self.num_experts * self.choice_bias - gate)


class GroupedMoEConfig(Protocol):
    """The config fields DeepSeek's MoE reads (DeepseekModelConfig's; GLM-4.5's Glm4MoeModelConfig has them too)."""

    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    sigmoid_scoring: bool
    group_limited: bool
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    expert_parallel: bool
    choice_bias: bool  # the router holds e_score_correction_bias, added to the scores to choose the experts


def select_experts_grouped(router_logits: Tensor, config: GroupedMoEConfig,
                           correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """router_logits (T, E) fp32 -> (topk_weights (T, k) fp32, topk_ids (T, k) int64), as DeepSeek routes.

    Scores: softmax over the experts (V2, ERNIE 4.5) or sigmoid (V3). With group-limited routing the E experts
    form n_group groups; a group's score is its best expert's (V2) or the sum of its best two
    biased scores (V3), only the topk_group best groups stay eligible, and the k experts are the best
    eligible ones. With a correction_bias (V3, ERNIE 4.5) the choice is by score + bias, the weights the
    unbiased scores. The k
    weights are renormalized when norm_topk_prob, then multiplied by routed_scaling_factor.
    """
    k = config.num_experts_per_tok
    scores = torch.sigmoid(router_logits) if config.sigmoid_scoring else torch.softmax(router_logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if config.group_limited:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, config.n_group, experts // config.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if config.sigmoid_scoring else grouped.amax(dim=-1)
        chosen = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        # V2 zeroes the other groups' probabilities, V3 rules them out: the same choice for positive scores
        choice = choice.masked_fill(~keep, float("-inf") if config.sigmoid_scoring else 0.0)
    weights, ids = torch.topk(choice, k=k, dim=-1, sorted=False)
    if correction_bias is not None or config.sigmoid_scoring:
        weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


class DeepseekRouter(RouterLinear):
    """The expert gate `mlp.gate`: weight (E, hidden) kept in fp32 (as transformers keeps it) and, where
    config.choice_bias (V3, GLM-4.5, ERNIE 4.5), `e_score_correction_bias` (E,) fp32, added to the scores only to
    choose experts."""

    def __init__(self, config: GroupedMoEConfig, ops: Any, device: torch.device) -> None:
        super().__init__(config.hidden_size, config.n_routed_experts, False, ops, torch.float32, device)
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.choice_bias:
            bias = torch.zeros(config.n_routed_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = self._load_bias

    @staticmethod
    def _load_bias(param: Tensor, loaded: Tensor, shard_id: Any = None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"e_score_correction_bias has shape {tuple(loaded.shape)}; expected {tuple(param.shape)}")
        copy_checked(param, loaded, "e_score_correction_bias")

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> router logits (T, E) in fp32."""
        return super().forward(x.float())


class DeepseekMoE(nn.Module):
    """One MoE MLP: routed experts through ops.fused_moe (weights computed here) plus the shared experts,
    one gated MLP of n_shared_experts x moe_intermediate_size features, added unscaled."""

    def __init__(self, config: GroupedMoEConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.gate = DeepseekRouter(config, ops, device)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, ops,
                                dtype, device, tp_rank, tp_size, expert_parallel=config.expert_parallel)
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts:
            self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                           False, ops, dtype, device, tp_rank, tp_size)

    def unstreamed_bytes(self) -> int:
        """Expert weight bytes one decode token does not read on this rank: E - k of the E routed experts
        (expert parallel: at least E/tp - k of the rank's E/tp)."""
        experts = self.experts
        return max(experts.num_local_experts - self.top_k, 0) * experts.expert_nbytes()

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden) in x.dtype."""
        weights, ids = select_experts_grouped(self.gate(x), self.config, self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def decode_stack_moe(mlp: nn.Module) -> MoEWeights | None:
    """`mlp` as the fused decode stack's MoEWeights, or None when the stack cannot run it as is: not this file's
    DeepseekMoE (a subclass, another router or shared MLP), its routed experts split whole over the ranks
    (expert parallel), or kept as a GGUF file's blocks."""
    if type(mlp) is not DeepseekMoE:
        return None
    experts, shared, gate = mlp.experts, mlp.shared_experts, mlp.gate
    if (type(experts) is not FusedMoE or experts.expert_parallel or experts.expert_blocks is not None
            or type(gate) is not DeepseekRouter or (shared is not None and type(shared) is not GatedMLP)):
        return None
    config, linear, bias = mlp.config, LinearWeights.of, gate.e_score_correction_bias
    grouped = config.group_limited
    return MoEWeights(
        router=linear(gate), top_k=mlp.top_k, renormalize=config.norm_topk_prob, w13=experts.w13_weight.data,
        w2=experts.w2_weight.data, w13_scale=None if experts.w13_scale is None else experts.w13_scale.data,
        w2_scale=None if experts.w2_scale is None else experts.w2_scale.data, experts_tp_size=experts.tp_size,
        shared_gate_up=None if shared is None else linear(shared.gate_up_proj),
        shared_down=None if shared is None else linear(shared.down_proj), shared_gate=None,
        scoring="sigmoid" if config.sigmoid_scoring else "softmax",
        correction_bias=None if bias is None else bias.data, n_group=config.n_group if grouped else 1,
        topk_group=config.topk_group if grouped else 1, routed_scaling_factor=config.routed_scaling_factor)


def without_mtp_layers(weights: Iterable[tuple[str, Tensor]], num_layers: int) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors less those of layers >= num_layers: the next-token-prediction (MTP) layers
    DeepSeek-V3 and GLM-4.5 checkpoints append after the decoder's (--speculate_method mtp loads DeepSeek's)."""
    skipped = 0
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match and int(match[1]) >= num_layers:
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("skipped %d tensors of layers past num_hidden_layers (next-token-prediction layers)", skipped)


class SharedExpertsMoEForCausalLM(MixtralForCausalLM):
    """Llama's attention over DeepSeek's MoE (routed and shared experts) in the layers config.sparse_layers says, dense
    gated MLPs elsewhere (GLM-4.5, ERNIE 4.5); checkpoint names as the DeepSeek MoE's."""

    renamed_modules: ClassVar[dict[str, str]] = {}

    @staticmethod
    def make_mlp(config: SharedExpertsMoEConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """A DeepseekMoE where config.sparse_layers says, else a dense gated MLP of intermediate_size."""
        if config.sparse_layers[layer_idx]:
            return DeepseekMoE(config, ops, dtype, device, tp_rank, tp_size)
        return GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size)

    @staticmethod
    def decode_stack_moe(mlp: nn.Module) -> MoEWeights | None:
        """A DeepseekMoE as the fused decode stack's MoEWeights (decode_stack_moe)."""
        return decode_stack_moe(mlp)
