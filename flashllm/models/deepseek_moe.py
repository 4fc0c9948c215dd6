"""DeepSeek-V2/V3 MoE: group-limited top-k routing (softmax, or sigmoid with a correction bias), shared experts."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.deepseek_config import DeepseekModelConfig
from flashllm.models.layers.linear import copy_checked
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import FusedMoE, RouterLinear


def select_experts_grouped(router_logits: Tensor, config: DeepseekModelConfig,
                           correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """router_logits (T, E) fp32 -> (topk_weights (T, k) fp32, topk_ids (T, k) int64), as DeepSeek routes.

    Scores: softmax over the experts (V2) or sigmoid (V3). With group-limited routing the E experts
    form n_group groups; a group's score is its best expert's (V2) or the sum of its best two
    biased scores (V3), only the topk_group best groups stay eligible, and the k experts are the best
    eligible ones. V3 chooses by score + correction_bias but weights by the unbiased score. The k
    weights are renormalized when norm_topk_prob, then multiplied by routed_scaling_factor.
    """
    k = config.num_experts_per_tok
    if config.sigmoid_scoring:
        scores = torch.sigmoid(router_logits)
        choice = scores if correction_bias is None else scores + correction_bias
    else:
        scores = choice = torch.softmax(router_logits, dim=-1)
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
    if config.sigmoid_scoring:
        weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


class DeepseekRouter(RouterLinear):
    """The expert gate `mlp.gate`: weight (E, hidden) kept in fp32 (as transformers keeps it) and, for V3,
    `e_score_correction_bias` (E,) fp32, added to the scores only to choose experts."""

    def __init__(self, config: DeepseekModelConfig, ops: Any, device: torch.device) -> None:
        super().__init__(config.hidden_size, config.n_routed_experts, False, ops, torch.float32, device)
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.sigmoid_scoring:
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

    def __init__(self, config: DeepseekModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
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
