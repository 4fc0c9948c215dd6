"""Token embedding and LM head, split over the vocabulary for tensor parallelism, optionally tied."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.layers.linear import copy_checked, default_weight_loader
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant.spec import WeightQuantSpec
from flashllm.quant.weight_only import quantize_weight


class VocabEmbedding(nn.Module):
    """Embedding table; rank r holds vocabulary rows [r * V_p, (r + 1) * V_p), V_p = ceil(V / tp).

    weight: (V_p, hidden). Rows past the real vocabulary (padding of the last rank) stay zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the (V, hidden) checkpoint table."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding has shape {tuple(loaded_weight.shape)} but the model expects "
                f"{(self.num_embeddings, self.embedding_dim)}; the checkpoint does not match its config.json"
            )
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.narrow(0, 0, rows), loaded_weight.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) int64 -> (T, hidden) in the weight dtype."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        torch.distributed.all_reduce(out)
        return out


class PositionEmbedding(nn.Module):
    """Learned absolute position embeddings (GPT-2's and StarCoder 1's `wpe`): a (max_positions, hidden) table, whole
    on every tensor-parallel rank (it is small), looked up by each token's position and added to its embedding."""

    def __init__(self, num_positions: int, embedding_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (num_positions, embedding_dim)
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) int64, each < num_positions -> (T, hidden) in the weight dtype."""
        return F.embedding(positions, self.weight)


class LMHead(VocabEmbedding):
    """hidden -> vocabulary logits through ops.quant_matmul; `tie_to` shares the embedding table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, device, tp_rank, tp_size)
        self._quant_matmul = ops.quant_matmul
        self.qweight: QuantizedWeight | None = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Use `embedding`'s table as this head's weight (Llama 3.2, small Qwen2.5)."""
        self.weight = embedding.weight

    def process_weights_after_loading(self, quant: WeightQuantSpec | None = None) -> None:
        """Build the QuantizedWeight the forward multiplies by: dense, or per-channel int8 when
        quant.lm_head asks (see WeightQuantSpec); a tied embedding keeps its float table."""
        if quant is not None and quant.lm_head:
            self.qweight = quantize_weight(self.weight, "w8a16")
        else:
            self.qweight = QuantizedWeight.dense(self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, V) in hidden.dtype."""
        if self.qweight is None:
            raise RuntimeError("LMHead used before process_weights_after_loading(); load the model "
                               "with flashllm.models.loader.load_model")
        logits = self._quant_matmul(hidden, self.qweight, None)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]


# A head's view of a model's vocabulary: (token embedding, LM head), each a module called on ids / hidden states
# (None: one the head does not read).
Vocabulary = tuple[Any, Any]


def target_vocabulary(model: Any, given: Vocabulary | None = None) -> Vocabulary:
    """A CausalLM's (model.embed_tokens, lm_head), None for whichever it does not have; where `given` holds a
    module in that place (whole copies of a tensor-parallel model's), that one."""
    own = getattr(getattr(model, "model", None), "embed_tokens", None), getattr(model, "lm_head", None)
    given = given or (None, None)
    return given[0] if given[0] is not None else own[0], given[1] if given[1] is not None else own[1]


def gather_whole_vocabulary(embed: VocabEmbedding, head: LMHead, ops: Any,
                            wanted: tuple[bool, bool] = (True, True)) -> Vocabulary | None:
    """Whole copies, on tensor-parallel rank 0, of a model's embedding and LM head split over its ranks (`wanted`:
    which of the two; None in the other place): every rank sends its rows (all must call this, in the same
    order, wanting the same), rank 0 builds one-rank modules from them (the head tied where the model's is,
    quantized as the model's is); None on the other ranks. For what runs whole on the driver beside its shard
    of the model (a speculative head reading the model's vocabulary)."""
    tied = head.weight is embed.weight
    want_embed, want_head = wanted
    tables: dict[str, Tensor] = {}
    needed = {"embed": want_embed or (tied and want_head), "head": want_head and not tied}  # the tables to send
    for name, part in (("embed", embed), ("head", head)):
        if not needed[name]:
            continue
        rows = part.weight.detach().contiguous()
        if part.tp_size == 1:  # whole on every rank already
            tables[name] = rows
            continue
        parts = [torch.empty_like(rows) for _ in range(part.tp_size)] if part.tp_rank == 0 else None
        torch.distributed.gather(rows, parts, dst=0)
        if parts is not None:
            tables[name] = torch.cat(parts)[: part.num_embeddings]
    if embed.tp_rank != 0 or head.tp_rank != 0:
        return None
    dtype, device = embed.weight.dtype, embed.weight.device
    whole_embed = whole_head = None
    if "embed" in tables:
        whole_embed = VocabEmbedding(embed.num_embeddings, embed.embedding_dim, dtype, device)
        whole_embed.weight.data = tables["embed"]
    if want_head:
        whole_head = LMHead(head.num_embeddings, head.embedding_dim, ops, dtype, device)
        if tied:
            whole_head.tie_to(whole_embed)
        else:
            whole_head.weight.data = tables["head"]
        # as process_weights_after_loading made the model's: per-channel int8 (--quantize_lm_head) or dense,
        # keeping the GGUF type a GGUF head's input is rounded for
        model = head.qweight
        if model is not None and model.scheme == "w8a16":
            whole_head.qweight = quantize_weight(whole_head.weight, "w8a16")
        else:
            whole_head.qweight = dataclasses.replace(QuantizedWeight.dense(whole_head.weight),
                                                     gguf_type=getattr(model, "gguf_type", None))
    return whole_embed if want_embed else None, whole_head
