"""RoPE: frequency tables vs transformers' rope init functions, the op vs HF and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from flashllm.ops.rope_cache import SUPPORTED_ROPE_TYPES, build_cos_sin_cache, longrope_inv_freq, rope_inv_freq
from flashllm.ops.rotary_embedding import rotary_embedding
from flashllm.ops.tolerances import assert_close

HEAD_DIM = 64
MAX_POSITION = 1024

HF_SCALED_TYPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "legacy_type_key": {"type": "linear", "factor": 4.0},
}


def _hf_config(rope_parameters: dict, partial_rotary_factor: float | None = None) -> LlamaConfig:
    extra = {} if partial_rotary_factor is None else {"partial_rotary_factor": partial_rotary_factor}
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_theta": 50000.0, **rope_parameters},
        **extra,
    )


@pytest.mark.parametrize("name", sorted(HF_SCALED_TYPES))
def test_inv_freq_matches_transformers(name: str) -> None:
    config = _hf_config(dict(HF_SCALED_TYPES[name]))
    rope_type = config.rope_parameters["rope_type"]
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    inv_freq, factor = rope_inv_freq(HEAD_DIM, 50000.0, HF_SCALED_TYPES[name], MAX_POSITION)
    torch.testing.assert_close(inv_freq, expected_inv_freq)
    assert factor == pytest.approx(expected_factor)


@pytest.mark.parametrize("explicit", [{}, {"factor": 3.0}, {"attention_factor": 1.7}])
@pytest.mark.parametrize("seq_len", [256, 257])
def test_longrope_sets_match_transformers(seq_len: int, explicit: dict) -> None:
    """Phi-3's LongRoPE: the short set up to original_max_position_embeddings (256), the long one past it; the
    attention factor from max_position_embeddings / original unless the dict gives factor or attention_factor."""
    from transformers import Phi3Config

    rotary_dim = 48  # partial_rotary_factor 0.75 of HEAD_DIM
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(rotary_dim // 2)],
               "long_factor": [1.0 + 0.5 * i for i in range(rotary_dim // 2)], **explicit}
    config = Phi3Config(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=MAX_POSITION,
                        original_max_position_embeddings=256, partial_rotary_factor=0.75,
                        rope_parameters={"rope_theta": 50000.0, **scaling})
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    inv_freq, factor = longrope_inv_freq(rotary_dim, 50000.0, {**scaling, "original_max_position_embeddings": 256},
                                         MAX_POSITION, long=seq_len > 256)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_partial_rotary_inv_freq_matches_transformers() -> None:
    config = _hf_config({"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5)
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    inv_freq, _ = rope_inv_freq(HEAD_DIM // 2, 50000.0, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(inv_freq, expected)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, *HF_SCALED_TYPES.values()])
def test_cos_sin_cache_matches_transformers_rotary_module(scaling: dict | None) -> None:
    config = _hf_config(dict(scaling or {}))
    positions = torch.tensor([[0, 1, 5, 127, 128, 255, 256, 1023]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    cache = build_cos_sin_cache(HEAD_DIM, MAX_POSITION, 50000.0, scaling)
    cos, sin = cache[positions[0]].chunk(2, dim=-1)
    # transformers repeats the half-width table twice along the head (its rotate_half layout).
    # An fp32 angle near position 1000 is only good to ~3e-5, and a 1-ulp inv_freq difference
    # (same formula, other operation order) moves it by as much, hence atol 1e-4.
    torch.testing.assert_close(torch.cat((cos, cos), -1), hf_cos[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), hf_sin[0], atol=1e-4, rtol=0)


def test_dynamic_ntk_uses_the_scaled_base_for_the_cache_length() -> None:
    factor, original, dim, base = 2.0, 256, 32, 10000.0
    cache = build_cos_sin_cache(
        dim, 1024, base, {"type": "dynamic", "factor": factor, "original_max_position_embeddings": original}
    )
    ntk_base = base * ((factor * 1024 / original) - (factor - 1)) ** (dim / (dim - 2))
    for pos in (0, 3, 700, 1023):
        for i in range(dim // 2):
            angle = pos * ntk_base ** (-2 * i / dim)
            assert cache[pos, i].item() == pytest.approx(math.cos(angle), abs=2e-4)
            assert cache[pos, dim // 2 + i].item() == pytest.approx(math.sin(angle), abs=2e-4)


def test_dynamic_at_original_length_is_unscaled() -> None:
    scaled, _ = rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0}, max_position=512)
    plain, _ = rope_inv_freq(64, 10000.0, None)
    torch.testing.assert_close(scaled, plain)


def test_unknown_rope_type_names_supported_ones() -> None:
    with pytest.raises(ValueError) as excinfo:
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope"})
    assert all(name in str(excinfo.value) for name in SUPPORTED_ROPE_TYPES)


def test_missing_scaling_key_is_reported() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0})


def _qk(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 200, (tokens,), generator=gen)
    return positions, q, k


@pytest.mark.parametrize("rot_fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_neox_matches_transformers_apply_rotary(rot_fraction: float, dtype: torch.dtype) -> None:
    positions, q, k = _qk(11, 8, 2, HEAD_DIM, dtype)
    rot = int(HEAD_DIM * rot_fraction)
    cache = build_cos_sin_cache(rot, 256, 10000.0)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    hf_q, hf_k = apply_rotary_pos_emb(q[..., :rot].float(), k[..., :rot].float(), cos, sin, unsqueeze_dim=1)
    expected_q = torch.cat((hf_q.to(dtype), q[..., rot:]), -1)
    expected_k = torch.cat((hf_k.to(dtype), k[..., rot:]), -1)
    out_q, out_k = rotary_embedding(positions, q.clone(), k.clone(), cache, is_neox=True)
    assert out_q.dtype == dtype and out_k.dtype == dtype
    assert_close((out_q, out_k), (expected_q, expected_k), dtype)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_interleaved_matches_naive_pair_loop(rot_dim: int) -> None:
    dim, base = 16, 10000.0
    positions, q, k = _qk(5, 3, 1, dim, torch.float64, seed=1)
    out_q, out_k = rotary_embedding(positions, q, k, build_cos_sin_cache(rot_dim, 256, base), is_neox=False)
    for x, out in ((q, out_q), (k, out_k)):
        expected = x.clone()
        for t in range(x.shape[0]):
            for h in range(x.shape[1]):
                for i in range(rot_dim // 2):
                    angle = positions[t].item() / base ** (2 * i / rot_dim)
                    x0, x1 = x[t, h, 2 * i].item(), x[t, h, 2 * i + 1].item()
                    expected[t, h, 2 * i] = x0 * math.cos(angle) - x1 * math.sin(angle)
                    expected[t, h, 2 * i + 1] = x1 * math.cos(angle) + x0 * math.sin(angle)
        # the cache is fp32, so angles carry fp32 rounding
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rotation_preserves_norms_and_relative_positions() -> None:
    positions, q, k = _qk(6, 2, 2, 32, torch.float32)
    cache = build_cos_sin_cache(32, 512, 10000.0)
    for is_neox in (True, False):
        rq, rk = rotary_embedding(positions, q, k, cache, is_neox)
        torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
        # q.k after rotation depends only on the position difference
        shifted_q, shifted_k = rotary_embedding(positions + 37, q, k, cache, is_neox)
        torch.testing.assert_close((rq * rk).sum(-1), (shifted_q * shifted_k).sum(-1), atol=1e-4, rtol=1e-4)


def test_rotary_rejects_cache_wider_than_head() -> None:
    positions, q, k = _qk(2, 1, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding(positions, q, k, build_cos_sin_cache(32, 8, 10000.0), is_neox=True)
