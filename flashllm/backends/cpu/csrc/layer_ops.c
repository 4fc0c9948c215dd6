/* The small per-layer ops of a decode step (RMSNorm, rotary, one-token paged attention, SiLU-and-mul)
 * for x86 CPUs with AVX2 and FMA: at decode sizes their torch versions cost more in per-call
 * overhead than in arithmetic. The products are in decode_kernels.c and int4_int8_kernels.c. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decode_kernels.h"
#include "parallel_for.h"
#include "simd.h"

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

/* e^x for fp32 lanes, within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so the
 * reduction is exact enough), e^r from a degree-7 polynomial (the classic Cephes expf
 * coefficients), 2^n put into the exponent bits. Inputs are clamped to [-88.38, 88.38]: below,
 * the result is 0 (the true value is subnormal); above, n = 128 encodes +inf. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
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
 * KV head h / (Hq / Hk). The softmax is the online one over chunks of ATTENTION_CHUNK slots (a
 * running maximum, earlier partial sums rescaled when it grows), so no scratch grows with the
 * context. attend_pairs does the (sequence, head) pairs p0 <= p < p1, p = b * Hq + h. */
#define ATTENTION_CHUNK 256

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    const int64_t *rows;
    int64_t q_stride, width, Hq, Hk, D, block_size;
    float scale;
    float *out;
} attention_args;

static inline void scale_row(float *v, int64_t n, float factor) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(v + d, _mm256_mul_ps(_mm256_loadu_ps(v + d), _mm256_set1_ps(factor)));
    for (; d < n; d++) v[d] *= factor;
}

static void attend_pairs(const attention_args *a, int64_t p0, int64_t p1) {
    const int64_t group = a->Hq / a->Hk, slot_stride = a->Hk * a->D, D = a->D, bs = a->block_size;
    float scores[ATTENTION_CHUNK];
    for (int64_t p = p0; p < p1; p++) {
        const int64_t b = p / a->Hq, h = p % a->Hq, length = a->seq_lens[b], kvh = h / group;
        const int32_t *table = a->block_tables + b * a->width;
        const float *qh = a->q + a->rows[b] * a->q_stride + h * D;
        float *oh = a->out + a->rows[b] * a->Hq * D + h * D;
        float top = -INFINITY, total = 0.0f;
        for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
        for (int64_t c0 = 0; c0 < length; c0 += ATTENTION_CHUNK) {
            const int64_t n = length - c0 < ATTENTION_CHUNK ? length - c0 : ATTENTION_CHUNK;
            float chunk_top = -INFINITY;
            for (int64_t i = 0; i < n; i++) {
                const int64_t s = c0 + i, slot = (int64_t)table[s / bs] * bs + s % bs;
                scores[i] = dot_f32(qh, a->k_cache + slot * slot_stride + kvh * D, D) * a->scale;
                chunk_top = scores[i] > chunk_top ? scores[i] : chunk_top;
            }
            if (chunk_top > top) {  /* rescale what was summed under the old maximum */
                const float factor = expf(top - chunk_top);  /* 0 on the first chunk */
                total *= factor;
                scale_row(oh, D, factor);
                top = chunk_top;
            }
            int64_t i = 0;
            __m256 sum8 = _mm256_setzero_ps();
            for (; i + 8 <= n; i += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), _mm256_set1_ps(top)));
                _mm256_storeu_ps(scores + i, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            total += hsum8(sum8);
            for (; i < n; i++) {
                scores[i] = expf(scores[i] - top);
                total += scores[i];
            }
            for (i = 0; i < n; i++) {
                const int64_t s = c0 + i, slot = (int64_t)table[s / bs] * bs + s % bs;
                const float *vs = a->v_cache + slot * slot_stride + kvh * D;
                int64_t d = 0;
                for (; d + 8 <= D; d += 8)
                    _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(_mm256_set1_ps(scores[i]), _mm256_loadu_ps(vs + d),
                                                            _mm256_loadu_ps(oh + d)));
                for (; d < D; d++) oh[d] += scores[i] * vs[d];
            }
        }
        scale_row(oh, D, 1.0f / total);
    }
}

/* out[t * I + i] = silu(x[t * 2I + i]) * x[t * 2I + I + i] for the flat output elements e0 <= e < e1,
 * silu(g) = g / (1 + e^-g); fp32 x (T, 2I) gate columns then up columns, out (T, I). */
void flashllm_silu_and_mul(const float *x, float *out, int64_t I, int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1;) {
        const int64_t t = e / I, i = e % I, row_end = (t + 1) * I < e1 ? (t + 1) * I : e1;
        const float *gate = x + t * 2 * I, *up = gate + I;
        int64_t j = i;
        for (; j + 8 <= i + (row_end - e); j += 8) {
            const __m256 g = _mm256_loadu_ps(gate + j);
            const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(out + t * I + j, _mm256_mul_ps(sig, _mm256_loadu_ps(up + j)));
        }
        for (; j < i + (row_end - e); j++) out[t * I + j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
        e = row_end;
    }
}

typedef struct { const float *x; float *out; int64_t I, total; } silu_args;

static void silu_share(void *ctx, int64_t v0, int64_t v1) {  /* shares of 8-element runs of the output */
    const silu_args *a = ctx;
    flashllm_silu_and_mul(a->x, a->out, a->I, v0 * 8, v1 * 8 < a->total ? v1 * 8 : a->total);
}

/* flashllm_silu_and_mul over all T x I outputs, split over `threads` */
void flashllm_silu_and_mul_mt(const float *x, float *out, int64_t T, int64_t I, int threads) {
    silu_args a = {x, out, I, T * I};
    flashllm_parallel_for(silu_share, &a, (T * I + 7) / 8, threads, COARSE_SHARES);
}

static void attention_share(void *ctx, int64_t p0, int64_t p1) { attend_pairs(ctx, p0, p1); }

/* The attention above for B sequences, their B x Hq (sequence, head) pairs split over `threads`. */
void flashllm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t width, const int32_t *seq_lens,
                               const int64_t *rows, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, float *out, int threads) {
    attention_args a = {q, k_cache, v_cache, block_tables, seq_lens, rows, q_stride, width, Hq, Hk, D,
                        block_size, scale, out};
    flashllm_parallel_for(attention_share, &a, B * Hq, threads, COARSE_SHARES);
}
