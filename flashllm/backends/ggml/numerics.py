"""ggml's CPU float arithmetic (x86 AVX2/AVX-512 builds) in numpy: the llama.cpp-numerics backend's ops and the test oracle's."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

# Why this exists: llama.cpp rounds every matmul input to int8 blocks, a discontinuous step, so a
# 1-ulp difference anywhere before one flips a code and grows over the layers to the size of the
# rounding itself (docs/gguf.md). Agreeing with its greedy tokens on a quantized model takes its
# float operations in its order, bit for bit. Every function here states that order; each was
# checked to reproduce llama.cpp 0c1e570's tensors bit for bit on SmolLM2 Q4_1 (tests/e2e/test_smollm2.py).
# numpy float32 + - * / sqrt round once (IEEE); fused multiply-adds are emulated in float64, exact
# for the products met here (24 x 24 bits) and rounded twice, which differs from one rounding only
# when the float64 sum sits within 2^-53 of a float32 midpoint.

F32, F64 = np.float32, np.float64
_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("powf", "cosf", "sinf"):
    getattr(_LIBM, _name).restype = ctypes.c_float
_LIBM.powf.argtypes = [ctypes.c_float, ctypes.c_float]
_LIBM.cosf.argtypes = _LIBM.sinf.argtypes = [ctypes.c_float]


def fma(a, b, c) -> np.ndarray:
    """float32 a * b + c with one rounding (emulated through float64; see the module comment)."""
    return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


def quantize_q8(x: np.ndarray, with_sums: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Activation rows x (T, K) float32 -> llama.cpp's q8_0 / q8_1 blocks of 32 as its AVX path makes them:
    (d (T, K/32) float32 holding the fp16 scale, codes (T, K/32, 32) int64, q8_1's fp16 sums s or None).

    absmax per block; d = fp16(absmax / 127); codes = round-half-even(x * (127 / absmax)) in float32;
    s = fp16(float32(absmax / 127) * sum(codes)).
    """
    tokens, k = x.shape
    blocks = x.astype(F32).reshape(tokens, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    codes = np.rint((blocks * inverse[..., None]).astype(F32)).astype(np.int64)
    sums = None
    if with_sums:
        sums = (d * codes.sum(-1).astype(F32)).astype(F32).astype(np.float16).astype(F32)
    return d.astype(np.float16).astype(F32), codes, sums


def hsum8(acc: np.ndarray) -> np.ndarray:
    """The horizontal sum of 8 float32 lanes (last axis) in ggml's order: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    half = (acc[..., 4:8] + acc[..., 0:4]).astype(F32)
    return ((half[..., 0] + half[..., 2]).astype(F32) + (half[..., 1] + half[..., 3]).astype(F32)).astype(F32)


def hsum16(acc: np.ndarray) -> np.ndarray:
    """The horizontal sum of 16 float32 lanes (an AVX-512 register's reduce-add): halves, quarters, then hsum of 4."""
    eight = (acc[..., 8:16] + acc[..., 0:8]).astype(F32)
    four = (eight[..., 4:8] + eight[..., 0:4]).astype(F32)
    return ((four[..., 0] + four[..., 2]).astype(F32) + (four[..., 1] + four[..., 3]).astype(F32)).astype(F32)


def lane_codes(codes: np.ndarray) -> np.ndarray:
    """Weight codes (N, K/32, 32) as block_dot multiplies them: (K/32 * 8, 4, N) float32 (exact integers).
    A caller that multiplies one weight many times builds this once and passes it as `lanes`."""
    rows, blocks = codes.shape[0], codes.shape[1]
    return np.ascontiguousarray(codes.reshape(rows, blocks * 8, 4).transpose(1, 2, 0).astype(F32))


def block_dot(x: np.ndarray, d: np.ndarray, codes: np.ndarray, minimums: np.ndarray | None = None,
              lanes: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32 against a Q4_1 (minimums given), Q8_0 or Q4_0 weight of N rows, as ggml's x86 vec_dot
    (and llamafile's tinyBLAS for Q8_0 / Q4_0): (T, N) float32.

    d (N, K/32) float32 scales, codes (N, K/32, 32) integers (Q4_1 0..15, Q8_0 -128..127, Q4_0 code - 8),
    minimums (N, K/32) float32; lanes: lane_codes(codes) when the caller keeps it. x is rounded to q8_1 (Q4_1)
    or q8_0 (the others). Per block: 8 lanes of 4-product integer sums (exact), scale = float32(d_w * d_x),
    lane = fma(scale, lane_sum, lane); Q4_1's minimum term: m_sum = fma(m_w, s_x, m_sum) per block.
    Result: hsum8(lanes) + m_sum.
    """
    dx, qx, sx = quantize_q8(x, minimums is not None)
    rows, blocks = codes.shape[0], codes.shape[1]
    w = lane_codes(codes) if lanes is None else lanes                               # (B*8, 4, N)
    out = np.empty((x.shape[0], rows), F32)
    step = max(1, min(16, (1 << 18) // (rows * 8)))  # token rows are independent: bound the temporaries
    for lo in range(0, x.shape[0], step):
        hi = min(lo + step, x.shape[0])
        tokens = hi - lo
        # every lane sum at once: a float32 product of integers whose sums stay below 2^24 is exact in any order
        a = qx[lo:hi].reshape(tokens, blocks * 8, 4).transpose(1, 0, 2).astype(F32)  # (B*8, T, 4)
        sums = np.matmul(a, w).reshape(blocks, 8, tokens, rows).transpose(0, 2, 3, 1)  # (B, T, N, 8)
        scale = (d.T[:, None, :] * dx[lo:hi].T[:, :, None]).astype(F32)               # (B, T, N)
        acc = np.zeros((tokens, rows, 8), F32)
        for b in range(blocks):  # the fma's product is exact in float64 (24 x 17 bits); the sum rounds once
            acc = (scale[b][..., None].astype(F64) * sums[b] + acc).astype(F32)
        offsets = np.zeros((tokens, rows), F32)
        if minimums is not None:
            terms = minimums.T[:, None, :].astype(F64) * sx[lo:hi].T[:, :, None].astype(F64)  # (B, T, N)
            for b in range(blocks):
                offsets = (terms[b] + offsets).astype(F32)
        out[lo:hi] = (hsum8(acc) + offsets).astype(F32)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ggml's RMS norm fused with the weight: x (T, H) float32 -> (T, H) float32.

    sum of float32(x * x) in float64 left to right; mean = float32(sum / H); scale = 1 / sqrt(mean + eps)
    in float32; y = float32(x * scale) * weight.
    """
    squares = (x * x).astype(F32).astype(F64)
    total = np.cumsum(squares, axis=-1)[:, -1]  # add.accumulate: strictly left to right, unlike np.sum
    mean = (total / x.shape[1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return ((x * scale[:, None]).astype(F32) * weight.astype(F32)).astype(F32)


def rope_table(positions, dims: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """ggml's rotary angles: (cos, sin) each (len(positions), dims/2) float32.

    theta_scale = powf(base, -2 / dims); per position theta starts at float32(p) and is multiplied by
    theta_scale in float32 after each pair (not p * base^(-2i/dims)); cosf / sinf of libm.
    """
    step = F32(_LIBM.powf(F32(base), F32(-2.0) / F32(dims)))
    thetas = np.zeros((len(positions), dims // 2), F32)
    theta = np.asarray(positions, F32).reshape(-1)
    for i in range(dims // 2):
        thetas[:, i] = theta
        theta = (theta * step).astype(F32)
    cosf, sinf = np.frompyfunc(_LIBM.cosf, 1, 1), np.frompyfunc(_LIBM.sinf, 1, 1)
    flat = [float(t) for t in thetas.reshape(-1)]
    cos = np.asarray(cosf(np.asarray(flat, object)), F32).reshape(thetas.shape)
    sin = np.asarray(sinf(np.asarray(flat, object)), F32).reshape(thetas.shape)
    return cos, sin


def rope_pairs(x0: np.ndarray, x1: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One rotary pair (x0, x1) float32 by (cos, sin) as the build compiles ggml's rope:
    x0' = fma(x0, cos, -(x1 * sin)), x1' = fma(x0, sin, x1 * cos)."""
    return fma(x0, cos, -(x1 * sin).astype(F32)), fma(x0, sin, (x1 * cos).astype(F32))


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, dims) float32 rotated in adjacent pairs (x0, x1) = (x[2i], x[2i+1]) by rope_pairs."""
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = rope_pairs(x[..., 0::2], x[..., 1::2], cos[:, None], sin[:, None])
    return out


def expf(x: np.ndarray) -> np.ndarray:
    """ggml's vectorized float32 exp (AVX-512 body): n = nearest integer of x * log2(e) (by adding and
    subtracting 1.5 * 2^23), b = x - n * ln2 in two fused steps (ln2 split into a 16-bit head and a tail),
    a degree-5 polynomial in b evaluated in fused steps as ((c5 b + c4) b^2 + (c3 b + c2)) b^2 + (c1 b + 1),
    scaled by 2^n; |n| > 192 gives 0 (n <= 0) or inf."""
    x = np.asarray(x, F32)
    h = float.fromhex
    with np.errstate(invalid="ignore", over="ignore"):
        shifter = F32(h("0x1.8p23"))
        n = (fma(x, F32(h("0x1.715476p+0")), shifter) - shifter).astype(F32)
        b = fma(-n, F32(h("0x1.7f7d1cp-20")), fma(-n, F32(h("0x1.62e4p-1")), x))
        b2 = (b * b).astype(F32)
        high = fma(fma(F32(h("0x1.0e4020p-7")), b, F32(h("0x1.573e2ep-5"))), b2,
                   fma(F32(h("0x1.555e66p-3")), b, F32(h("0x1.fffdb6p-2"))))
        poly = fma(high, b2, fma(F32(h("0x1.ffffecp-1")), b, F32(1.0)))
        far = np.abs(n) > 192
        scaled = np.ldexp(poly, np.where(far, 0, n).astype(np.int32)).astype(F32)
        return np.where(far, np.where(n <= 0, F32(0), F32(np.inf)), scaled).astype(F32)


def dot_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 (AVX-512) over the last axis (a multiple of 64; a and b broadcast): four 16-lane
    accumulators take consecutive 16-feature chunks by fma, then (acc0 + acc2) + (acc1 + acc3), then hsum16."""
    if a.shape[-1] % 64:
        raise ValueError(f"dot_f32 emulates whole 64-feature steps; got {a.shape[-1]} features")
    acc: list = [F32(0)] * 4
    for i in range(0, a.shape[-1], 64):
        for j in range(4):
            lo = i + 16 * j
            acc[j] = fma(a[..., lo:lo + 16], b[..., lo:lo + 16], acc[j])
    return hsum16(((acc[0] + acc[2]).astype(F32) + (acc[1] + acc[3]).astype(F32)).astype(F32))


def dot_chain16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """llamafile's tinyBLAS float32 dot (AVX-512) over the last axis (a multiple of 16): one 16-lane
    accumulator, fma over consecutive chunks, then hsum16."""
    acc = F32(0)
    for lo in range(0, a.shape[-1], 16):
        acc = fma(a[..., lo:lo + 16], b[..., lo:lo + 16], acc)
    return hsum16(acc)


def softmax(scores: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """ggml's soft_max_ext over the last axis (a multiple of 16): w = scores * scale + mask in float32;
    e = expf(w - max); sum of each 16-chunk's hsum16 in float64; e * float32(1 / sum)."""
    w = ((scores * F32(scale)).astype(F32) + mask).astype(F32)
    e = expf((w - w.max(-1, keepdims=True)).astype(F32))
    total = np.zeros(w.shape[:-1], F64)
    for lo in range(0, w.shape[-1], 16):
        total = total + hsum16(e[..., lo:lo + 16]).astype(F64)
    return (e * (1.0 / total).astype(F32)[..., None]).astype(F32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml's fused SwiGLU: (gate / (1 + expf(0 - gate))) * up, each step rounded to float32."""
    gate = np.asarray(gate, F32)
    return ((gate / (F32(1) + expf((F32(0) - gate).astype(F32))).astype(F32)).astype(F32) * up).astype(F32)
