"""The decoder blocks the Llama-style families share (residual add fused in the norms): pre-norm and parallel."""

from __future__ import annotations

from torch import Tensor, nn

from flashllm.models.layers.attention_metadata import AttentionMetadata


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); a subclass sets input_layernorm, post_attention_layernorm, mlp and
    self_attn (or overrides attend, as ChatGLM's `self_attention` does; attend and feed_forward are where a block adds
    norms after its sublayers, as GLM-4-0414's does). The residual add is fused into each
    RMSNorm, so the block returns its output beside the residual stream it was not yet added to."""

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """The block's attention: normed hidden (T, H) -> (T, H)."""
        return self.self_attn(positions, hidden, kv_cache, attn_metadata)

    def feed_forward(self, hidden: Tensor) -> Tensor:
        """The block's MLP: normed hidden (T, H) -> (T, H)."""
        return self.mlp(hidden)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (block output, residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.attend(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)): one norm feeds both branches (Cohere, StableLM 2 12B, Phi-2). A subclass sets
    input_layernorm, self_attn and mlp. Called as run_decoder_stack's layers, the stream split as (hidden, residual),
    x = hidden + residual, which the input norm adds. The sums keep the checkpoint family's order: by default
    (x + attn) + mlp (the layer returns (mlp output, x + attn output) for the next add); with `branches_first`,
    (attn + mlp) + x (Phi's)."""

    branches_first: bool = False

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (a branch sum, the stream), each (T, H)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(positions, normed, kv_cache, attn_metadata)
        if self.branches_first:
            return attended + self.mlp(normed), residual
        return self.mlp(normed), residual + attended
