"""weight_bytes: the bytes a loaded model keeps for its weights, and what one greedy decode step streams."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import LinearBase
from flashllm.models.layers.moe import FusedMoE, SparseMoeBlock


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes a loaded model keeps for its weights.

    linear: the linear layers' weights as stored (quantized data + scales + zeros, or float),
      a quantized LM head's int8 copy (--quantize_lm_head) and MoE experts kept as GGUF blocks;
    other: everything else (embeddings, norms, biases, a float untied lm_head, and the copy a
      device's greedy head keeps of it with its scales and bounds:
      flashllm/backends/cpu/greedy_screen.py); total = both.
    Tensors shared between modules (tied embeddings, a dense QuantizedWeight over its
    parameter) are counted once.
    streamed: what one greedy decode step reads, the ceiling's denominator: total less the input
      embedding table (a step reads one row of it per token) unless a float LM head is that table;
      where the head has a greedy screen, its copy is read instead of the float head; of a MoE
      layer's experts, only the k a batch-1 token is routed to.
    """

    linear: int
    other: int
    streamed: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.other


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the weight bytes of a loaded model (after process_weights_after_loading)."""
    seen: set[tuple[int, int]] = set()

    def count(tensors: list[Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            key = (t.untyped_storage().data_ptr(), t.numel() * t.element_size())
            if key not in seen:
                seen.add(key)
                total += key[1]
        return total

    linear = 0
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if qweight is not None and (isinstance(module, LinearBase) or qweight.scheme != "none"):
            linear += count(list(qweight.tensors))
        if isinstance(module, FusedMoE) and module.expert_blocks is not None:
            linear += count([t for pair in module.expert_blocks for w in pair for t in w.tensors])
    other = count([p for _, p in model.named_parameters()])
    other += sum(screen.nbytes for screen in map(_greedy_screen, _lm_heads(model)) if screen is not None)
    return WeightBytes(linear, other, linear + other - _unstreamed_bytes(model))


def _lm_heads(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LMHead)]


def _greedy_screen(head: nn.Module) -> object | None:
    """The cpu backend's greedy screen of an LM head (backends/cpu/greedy_screen.py keeps it in the
    head's kernel_cache under "greedy_screen"), or None."""
    return None if head.qweight is None else head.qweight.kernel_cache.get("greedy_screen")


def _unstreamed_bytes(model: nn.Module) -> int:
    """Bytes a greedy decode step does not read whole: input embedding tables that no float LM head
    reads, float heads that a greedy screen reads in their place, and the experts a MoE layer does
    not route a batch-1 token to."""
    float_heads = [m for m in _lm_heads(model) if m.qweight is not None and m.qweight.scheme == "none"]
    read = {m.weight.untyped_storage().data_ptr() for m in float_heads if _greedy_screen(m) is None}
    skipped = {m.weight.untyped_storage().data_ptr(): m.weight.numel() * m.weight.element_size()
               for m in float_heads if _greedy_screen(m) is not None}
    tables = {m.weight.untyped_storage().data_ptr(): m.weight.numel() * m.weight.element_size()
              for m in model.modules() if type(m) is VocabEmbedding}
    experts = sum(m.unstreamed_bytes() for m in model.modules() if isinstance(m, (SparseMoeBlock, DeepseekMoE)))
    return sum(size for ptr, size in (tables | skipped).items() if ptr not in read) + experts
