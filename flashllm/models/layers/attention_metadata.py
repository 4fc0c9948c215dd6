"""Kept so that existing imports work: AttentionMetadata lives in flashllm.ops.attention_metadata."""

from flashllm.ops.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
