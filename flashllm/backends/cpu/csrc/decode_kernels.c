/* The cpu backend's decode kernels for x86 CPUs with AVX2 and FMA: matrix products of a few tokens
 * with a large weight, and the small per-layer ops (RMSNorm, rotary, one-token paged attention)
 * whose torch versions cost more in per-call overhead than in arithmetic at decode sizes.
 *
 * The products:
 * Every function works on the output rows n0 <= n < n1 only, so the caller can hand disjoint row
 * ranges to several threads (flashllm/backends/cpu/native.py does; ctypes drops the GIL around
 * each call). Weights are read once per call: all tokens of a row are done while the row is in L1.
 *
 * The integer-weight products keep the reference's fp32 semantics: every code (minus its zero
 * point, in integers) converts exactly to float and meets the fp32 activation in an FMA; only the
 * order of the sums and where the group scale is applied differ from dequantize-then-matmul.
 * Codes are widened straight from memory (vpmovsxbd / vpmovzxbd with a memory operand): on the
 * team's AVX2 EPYC that ran ~18% faster on one core than widening a loaded register.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "thread_pool.h"

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* y[t * ldy + n] = sum_k x[t * K + k] * w[n * K + k] for t < T and n0 <= n < n1 (fp32). */
void flashllm_f32_gemv(const float *x, const float *w, float *y, int64_t T, int64_t K,
                       int64_t n0, int64_t n1, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const float *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {  /* four chains hide the FMA latency */
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(xt + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(xt + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 16), _mm256_loadu_ps(xt + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 24), _mm256_loadu_ps(xt + k + 24), a3);
            }
            float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for (; k < K; k++) sum += row[k] * xt[k];
            y[t * ldy + n] = sum;
        }
    }
}

/* int8 weight w (N, K) with scales (N, G), K / G a multiple of 32:
 * y[t * ldy + n] = sum_g scales[n, g] * sum_{k in g} w[n, k] * x[t, k]. */
#define WIDEN_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
void flashllm_w8_gemv(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales,
                      int64_t G, float *y, int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t group = K / G;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            __m256 total = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    a0 = _mm256_fmadd_ps(WIDEN_I8(row + k), _mm256_loadu_ps(xt + k), a0);
                    a1 = _mm256_fmadd_ps(WIDEN_I8(row + k + 8), _mm256_loadu_ps(xt + k + 8), a1);
                    a2 = _mm256_fmadd_ps(WIDEN_I8(row + k + 16), _mm256_loadu_ps(xt + k + 16), a2);
                    a3 = _mm256_fmadd_ps(WIDEN_I8(row + k + 24), _mm256_loadu_ps(xt + k + 24), a3);
                }
                const __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
                total = _mm256_fmadd_ps(sum, _mm256_set1_ps(scales[n * G + g]), total);
            }
            y[t * ldy + n] = hsum8(total);
        }
    }
}

/* int4 weight: w (N, K/2) bytes, low nibble = even k, high nibble = odd k, codes 0..15, zero
 * points zeros (N, G) int32 (NULL: 8 everywhere), scales (N, G), K / G a multiple of 32;
 * x given deinterleaved: xe[t * K/2 + i] = x[t, 2i], xo[t * K/2 + i] = x[t, 2i + 1]:
 * y[t * ldy + n] = sum_g scales[n, g] * sum_{k in g} (code[n, k] - zero[n, g]) * x[t, k]. */
#define WIDEN_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
void flashllm_w4_gemv(const float *xe, const float *xo, int64_t T, int64_t K, const uint8_t *w,
                      const float *scales, const int32_t *zeros, int64_t G, float *y,
                      int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t half = K / 2, group = half / G;  /* bytes per row and per group */
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * half;
        for (int64_t t = 0; t < T; t++) {
            const float *et = xe + t * half, *ot = xo + t * half;
            __m256 total = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                const __m256i zero = _mm256_set1_epi32(zeros ? zeros[n * G + g] : 8);
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
                    const __m256i b0 = WIDEN_U8(row + i), b1 = WIDEN_U8(row + i + 8);
                    const __m256 e0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, nibble), zero));
                    const __m256 o0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), zero));
                    const __m256 e1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, nibble), zero));
                    const __m256 o1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), zero));
                    a0 = _mm256_fmadd_ps(e0, _mm256_loadu_ps(et + i), a0);
                    a1 = _mm256_fmadd_ps(o0, _mm256_loadu_ps(ot + i), a1);
                    a2 = _mm256_fmadd_ps(e1, _mm256_loadu_ps(et + i + 8), a2);
                    a3 = _mm256_fmadd_ps(o1, _mm256_loadu_ps(ot + i + 8), a3);
                }
                const __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
                total = _mm256_fmadd_ps(sum, _mm256_set1_ps(scales[n * G + g]), total);
            }
            y[t * ldy + n] = hsum8(total);
        }
    }
}

/* ---- the small per-layer ops of a decode step, where torch's per-call overhead dominates ---- */

/* out[t] = s / rms(s) * weight with s = x[t] (+ residual[t]), fp32 rows of H; with a residual,
 * summed[t] = s (the pre-norm sum the next layer adds to). Mean of squares in double. */
void flashllm_rms_norm(const float *x, const float *residual, float *summed, const float *weight,
                       float *out, int64_t T, int64_t H, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *ot = out + t * H;
        double sum = 0.0;
        for (int64_t i = 0; i < H; i++) {
            const float v = residual ? xt[i] + residual[t * H + i] : xt[i];
            if (residual) summed[t * H + i] = v;
            ot[i] = v;
            sum += (double)v * v;
        }
        const float inverse = 1.0f / sqrtf((float)(sum / H) + eps);
        for (int64_t i = 0; i < H; i++) ot[i] = ot[i] * inverse * weight[i];
    }
}

/* Rotate, in place, the first `rot` features of each of H heads of x, token t at x + t * stride,
 * heads of D contiguous; cache (max_position, rot): cos in the first rot/2 columns, sin in the
 * rest. neox pairs feature i with i + rot/2, otherwise 2i with 2i + 1. */
void flashllm_rotary(float *x, int64_t T, int64_t stride, int64_t H, int64_t D, int64_t rot,
                     const float *cache, const int64_t *positions, int neox) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *cos_ = cache + positions[t] * rot, *sin_ = cos_ + half;
        for (int64_t h = 0; h < H; h++) {
            float *v = x + t * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                const float x1 = v[a], x2 = v[b];
                v[a] = x1 * cos_[i] - x2 * sin_[i];
                v[b] = x2 * cos_[i] + x1 * sin_[i];
            }
        }
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum8(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* One query token per sequence against its paged fp32 keys and values (no mask beyond the length).
 * Sequence b's query is row rows[b] of q (Hq heads of D, row stride q_stride), its context the
 * first seq_lens[b] slots of blocks block_tables[b * width ...]; caches (blocks, block_size, Hk, D).
 * out row rows[b] (Hq * D contiguous) gets softmax(q k^T * scale) v per head; query head h reads
 * KV head h / (Hq / Hk). scores: scratch of at least max(seq_lens) floats. */
void flashllm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t width, const int32_t *seq_lens,
                               const int64_t *rows, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, float *out, float *scores) {
    const int64_t group = Hq / Hk, slot_stride = Hk * D;
    for (int64_t b = 0; b < B; b++) {
        const int32_t *table = block_tables + b * width;
        const int64_t length = seq_lens[b];
        for (int64_t h = 0; h < Hq; h++) {
            const float *qh = q + rows[b] * q_stride + h * D;
            const int64_t kvh = h / group;
            float top = -INFINITY;
            for (int64_t s = 0; s < length; s++) {
                const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
                scores[s] = dot_f32(qh, k_cache + slot * slot_stride + kvh * D, D) * scale;
                top = scores[s] > top ? scores[s] : top;
            }
            float total = 0.0f;
            for (int64_t s = 0; s < length; s++) {
                scores[s] = expf(scores[s] - top);
                total += scores[s];
            }
            float *oh = out + rows[b] * Hq * D + h * D;
            for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
            for (int64_t s = 0; s < length; s++) {
                const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
                const float *vs = v_cache + slot * slot_stride + kvh * D;
                const float p = scores[s] / total;
                int64_t d = 0;
                for (; d + 8 <= D; d += 8)
                    _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(_mm256_set1_ps(p), _mm256_loadu_ps(vs + d),
                                                            _mm256_loadu_ps(oh + d)));
                for (; d < D; d++) oh[d] += p * vs[d];
            }
        }
    }
}

/* ---- the GEMVs above over row shares of the worker pool (thread_pool.h) ---- */

typedef struct {
    const void *x, *x2, *w, *scales, *zeros;
    float *y;
    int64_t T, K, G, ldy;
} gemv_args;

static void f32_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    flashllm_f32_gemv(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
}

static void w8_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    flashllm_w8_gemv(a->x, a->T, a->K, a->w, a->scales, a->G, a->y, n0, n1, a->ldy);
}

static void w4_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    flashllm_w4_gemv(a->x, a->x2, a->T, a->K, a->w, a->scales, a->zeros, a->G, a->y, n0, n1, a->ldy);
}

void flashllm_f32_gemv_mt(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t N,
                          int64_t ldy, int threads) {
    gemv_args a = {x, NULL, w, NULL, NULL, y, T, K, 0, ldy};
    flashllm_parallel_for(f32_share, &a, N, threads);
}

void flashllm_w8_gemv_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, int64_t G,
                         float *y, int64_t N, int64_t ldy, int threads) {
    gemv_args a = {x, NULL, w, scales, NULL, y, T, K, G, ldy};
    flashllm_parallel_for(w8_share, &a, N, threads);
}

void flashllm_w4_gemv_mt(const float *xe, const float *xo, int64_t T, int64_t K, const uint8_t *w,
                         const float *scales, const int32_t *zeros, int64_t G, float *y, int64_t N, int64_t ldy,
                         int threads) {
    gemv_args a = {xe, xo, w, scales, zeros, y, T, K, G, ldy};
    flashllm_parallel_for(w4_share, &a, N, threads);
}
