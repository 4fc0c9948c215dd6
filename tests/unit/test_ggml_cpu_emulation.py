"""flashllm.testing.ggml_cpu (ggml's CPU float arithmetic, emulated) against float64 formulas of each op."""

from __future__ import annotations

import numpy as np
import pytest

from flashllm.testing import ggml_cpu as g

F32, F64 = np.float32, np.float64


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_expf_is_exp_within_its_error_bound_and_saturates():
    # the polynomial's bound is about 2 float32 ulps (1.45 plus the final rounding); a wrong constant is far off
    x = np.concatenate([np.linspace(-87.0, 0.0, 20001), np.linspace(0.0, 88.0, 2001), [-1e-30, 1e-30]]).astype(F32)
    ours = g.expf(x).astype(F64)
    exact = np.exp(x.astype(F64))
    assert np.all(np.abs(ours - exact) <= 2.5 * np.spacing(exact.astype(F32)).astype(F64))
    assert np.array_equal(g.expf(np.array([-np.inf, -200.0, 200.0, np.inf], F32)), np.array([0, 0, np.inf, np.inf], F32))


def test_q8_rounding_is_round_half_even_of_x_times_127_over_absmax():
    x = _rng().normal(size=(3, 96)).astype(F32)
    x[1, 32:64] = 0.0
    d, codes, sums = g.quantize_q8(x, True)
    blocks = x.reshape(3, 3, 32).astype(F64)
    amax = np.abs(blocks).max(-1)
    assert np.array_equal(d, (amax / 127).astype(F32).astype(np.float16).astype(F32))
    inverse = np.divide(127.0, amax, out=np.zeros_like(amax), where=amax > 0).astype(F32)
    assert np.array_equal(codes, np.rint(blocks.astype(F32) * inverse[..., None]).astype(np.int64))
    assert np.abs(codes).max() == 127 and not codes[1, 1].any() and sums[1, 1] == 0
    assert np.allclose(sums, (amax / 127) * codes.sum(-1), rtol=1e-3, atol=0)  # fp16-rounded


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_dot_is_the_dot_of_the_rounded_activations(kind):
    rng = _rng(1)
    tokens, rows, k = 3, 40, 256
    x = (rng.normal(size=(tokens, k)) * np.exp(rng.normal(size=(tokens, k)))).astype(F32)
    d = (np.exp(rng.normal(size=(rows, k // 32)) - 4)).astype(np.float16).astype(F32)
    if kind == "Q4_1":
        codes = rng.integers(0, 16, size=(rows, k // 32, 32))
        minimums = (-8 * d * rng.uniform(0.5, 1.5, size=d.shape)).astype(np.float16).astype(F32)
    else:
        codes, minimums = rng.integers(-128, 128, size=(rows, k // 32, 32)), None
    ours = g.block_dot(x, d, codes, minimums)
    dx, qx, sx = g.quantize_q8(x, kind == "Q4_1")
    weight = (d[..., None] * codes).reshape(rows, k).astype(F64)
    rounded = (dx[..., None].astype(F64) * qx).reshape(tokens, k)
    oracle = rounded @ weight.T
    if kind == "Q4_1":  # the minimum meets q8_1's fp16 sum s, not d * sum(codes)
        oracle += sx.astype(F64) @ minimums.astype(F64).T
    scale = np.abs(rounded) @ np.abs(weight).T + (0 if minimums is None else np.abs(sx) @ np.abs(minimums).T)
    assert np.all(np.abs(ours - oracle) <= 4e-7 * scale + 1e-30)
    # and the activation rounding matters: exact activations are further away than float32 accumulation
    assert np.abs(x.astype(F64) @ weight.T - oracle).max() > 100 * np.abs(ours - oracle).max()


def test_rms_norm_is_the_float64_formula_within_two_ulp():
    rng = _rng(2)
    x = (rng.normal(size=(5, 576)) * 3).astype(F32)
    w = rng.normal(size=576).astype(F32)
    ours = g.rms_norm(x, w, 1e-5).astype(F64)
    exact = x.astype(F64) / np.sqrt((x.astype(F64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    assert np.all(np.abs(ours - exact) <= 2 * np.abs(exact) * 2.0**-23 + 1e-30)


def test_rope_table_and_rotation_follow_the_float64_angles():
    positions = [0, 1, 7, 100, 1000]
    cos, sin = g.rope_table(positions, 64, 100000.0)
    angles = np.array(positions, F64)[:, None] * 100000.0 ** (-2 * np.arange(32) / 64)
    # theta is multiplied by the float32 step 31 times: the angle drifts by up to ~32 float32 ulps
    tolerance = 40 * 2.0**-24 * np.maximum(angles, 1e-30)
    assert np.all(np.abs(cos - np.cos(angles)) <= tolerance + 2.0**-24)
    assert np.all(np.abs(sin - np.sin(angles)) <= tolerance + 2.0**-24)
    assert cos[0].tolist() == [1.0] * 32 and sin[0].tolist() == [0.0] * 32
    x = _rng(3).normal(size=(5, 3, 64)).astype(F32)
    out = g.rope_interleaved(x, cos, sin).astype(F64)
    c, s, x0, x1 = cos[:, None].astype(F64), sin[:, None].astype(F64), x[..., 0::2].astype(F64), x[..., 1::2]
    assert np.allclose(out[..., 0::2], x0 * c - x1 * s, rtol=0, atol=1e-6)
    assert np.allclose(out[..., 1::2], x0 * s + x1 * c, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dot", [g.dot_f32, g.dot_chain16])
def test_float_dots_are_dots(dot):
    rng = _rng(4)
    a, b = rng.normal(size=(7, 256)).astype(F32), rng.normal(size=(7, 256)).astype(F32)
    exact = (a.astype(F64) * b).sum(-1)
    assert np.all(np.abs(dot(a, b) - exact) <= 1e-6 * (np.abs(a.astype(F64) * b).sum(-1)))


def test_softmax_and_swiglu_follow_float64():
    rng = _rng(5)
    scores = (rng.normal(size=(4, 64)) * 8).astype(F32)
    mask = np.where(np.arange(64)[None, :] <= np.array([0, 5, 40, 63])[:, None], 0.0, -np.inf).astype(F32)
    ours = g.softmax(scores, mask, 0.125)
    w = scores.astype(F64) * 0.125 + mask
    exact = np.exp(w - w.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    assert np.allclose(ours, exact, rtol=2e-6, atol=1e-12) and not ours[0, 1:].any()
    gate, up = (rng.normal(size=(3, 96)) * 6).astype(F32), rng.normal(size=(3, 96)).astype(F32)
    exact = gate.astype(F64) / (1 + np.exp(-gate.astype(F64))) * up
    assert np.allclose(g.swiglu(gate, up), exact, rtol=2e-6, atol=1e-30)
