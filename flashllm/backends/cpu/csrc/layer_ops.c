/* The small per-layer ops of a decode step (RMSNorm, rotary, SiLU-and-mul) for x86 CPUs with AVX2
 * and FMA: at decode sizes their torch versions cost more in per-call overhead than in arithmetic.
 * The products are in decode_kernels.c and int4_int8_kernels.c, one-token attention in
 * decode_attention.c. */
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
