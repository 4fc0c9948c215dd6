"""rotary_embedding: rotary position embedding (RoPE) of queries and keys, neox or interleaved."""

from __future__ import annotations

import torch
from torch import Tensor

USES: frozenset[str] = frozenset({"head_size"})

# A kernel whose numerics depend on how the model prepares its inputs may say so as attributes of its
# function (the ggml backend's does; models read them where they build, kernels stay bound as usual):
#   cos_sin_table(rotary_dim, max_position, base, rope_scaling, dtype) -> the [cos | sin] table, built
#     its way (models/layers/rotary.py uses it in place of ops.rope_cache.build_cos_sin_cache);
#   keeps_interleaved_pairs = True: a checkpoint that stores rotary pairs interleaved (a GGUF Llama's
#     Q and K rows) keeps that layout with is_neox=False instead of being reordered to the half-split
#     one, so Q.K sums run in the file's feature order (models/gguf/tensors.py).


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """Rotate the first rot_dim features of every head of x (T, H, D) by per-token angles.

    cos, sin: (T, 1, rot_dim / 2) fp32. Returns (T, H, D) in x.dtype.
    """
    rot_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox:
        # pairs are (i, i + rot_dim/2): the two halves of the rotated block
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        # pairs are (2i, 2i + 1): adjacent features
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat((y1, y2), dim=-1)
    else:
        rotated = torch.stack((y1, y2), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Apply RoPE to the queries and keys of a flat batch.

    Shapes: positions (T,) int64, each token's absolute position in its sequence;
    q (T, Hq, D); k (T, Hk, D); cos_sin_cache (max_position, rot_dim) fp32 whose first
    rot_dim/2 columns are cos(pos * inv_freq) and last rot_dim/2 are sin(pos * inv_freq)
    (see `flashllm.ops.rope_cache.build_cos_sin_cache`), rot_dim even and <= D.

    Only the first rot_dim features of each head rotate (partial rotary, e.g. ChatGLM rotates
    half the head); the remaining D - rot_dim features pass through unchanged.
    Pairing: is_neox=True rotates feature i with i + rot_dim/2 (Llama/Qwen "rotate_half" style);
    is_neox=False rotates adjacent pairs (2i, 2i+1) (GPT-J/ChatGLM style). Pair j uses angle
    column j of the cache in both styles.

    Numerics: the rotation runs in fp32; returns new (q, k) in q.dtype / k.dtype. Kernels may
    rotate in place, so callers must use the returned tensors.
    """
    rot_dim = cos_sin_cache.shape[-1]
    head_size = q.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > head_size or k.shape[-1] != head_size:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache has rot_dim={rot_dim}, q head size {head_size}, "
            f"k head size {k.shape[-1]}; expected an even rot_dim <= the common head size "
            "(build the cache with rotary_dim = head_size * partial_rotary_factor)"
        )
    cos_sin = cos_sin_cache[positions].float().unsqueeze(1)  # (T, 1, rot_dim)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)
