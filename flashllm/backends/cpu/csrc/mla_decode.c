/* The per-head products of absorbed MLA decode (DeepSeek-V2/V3 latent attention, backends/cpu/mla.py)
 * for x86 CPUs with AVX2 and FMA.
 *
 * A decode token multiplies each head's query by that head's W_UK (Dn x L) and each head's latent
 * output by its W_UV (Dv x L): 2 x H small products reading H x (Dn + Dv) x L weights, the kv_b_proj
 * matrix, once a layer. torch runs them as one batched matmul of one-row matrices, which read
 * ~9.5 GB/s on `epyc4-2c` (docs/deepseek.md); here each head's weight streams once with FMAs, the
 * heads split over the worker pool.
 *
 * flashllm_mla_vxm_mt: y[t, h, :N] = sum_k x[t, h, k] * w[h, k, :N] (a row vector times the head's
 *   K x N matrix, rows of N contiguous: W_UK as kv_b_proj stores it, no transpose). One item is one
 *   head: each weight row is read once for all T tokens, whose N accumulators stay in L1.
 * flashllm_mla_mxv_mt: y[t, h, n] = sum_k x[t, h, k] * w[h, n, :K] (the head's N x K matrix times a
 *   column: W_UV). One item is a run of a head's rows.
 * Strides are in floats; every output is written, none accumulated into.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "parallel_for.h"
#include "simd.h"

typedef struct {
    const float *x, *w;
    float *y;
    int64_t T, H, K, N, xt, xh, wh, yt, yh;
} mla_args;

#define VXM_K_AT_ONCE 4 /* weight rows folded into the accumulators per pass over them */

static void vxm_heads(void *ctx, int64_t h0, int64_t h1) {
    const mla_args *a = ctx;
    const int64_t body = a->N / 8 * 8;
    for (int64_t h = h0; h < h1; h++) {
        const float *wh = a->w + h * a->wh;
        for (int64_t t = 0; t < a->T; t++) memset(a->y + t * a->yt + h * a->yh, 0, (size_t)a->N * sizeof(float));
        int64_t k = 0;
        for (; k + VXM_K_AT_ONCE <= a->K; k += VXM_K_AT_ONCE) {
            const float *r0 = wh + k * a->N, *r1 = r0 + a->N, *r2 = r1 + a->N, *r3 = r2 + a->N;
            for (int64_t t = 0; t < a->T; t++) {
                const float *xv = a->x + t * a->xt + h * a->xh + k;
                float *yv = a->y + t * a->yt + h * a->yh;
                const __m256 c0 = _mm256_set1_ps(xv[0]), c1 = _mm256_set1_ps(xv[1]);
                const __m256 c2 = _mm256_set1_ps(xv[2]), c3 = _mm256_set1_ps(xv[3]);
                int64_t n = 0;
                for (; n < body; n += 8) {
                    __m256 acc = _mm256_loadu_ps(yv + n);
                    acc = _mm256_fmadd_ps(c0, _mm256_loadu_ps(r0 + n), acc);
                    acc = _mm256_fmadd_ps(c1, _mm256_loadu_ps(r1 + n), acc);
                    acc = _mm256_fmadd_ps(c2, _mm256_loadu_ps(r2 + n), acc);
                    acc = _mm256_fmadd_ps(c3, _mm256_loadu_ps(r3 + n), acc);
                    _mm256_storeu_ps(yv + n, acc);
                }
                for (; n < a->N; n++) yv[n] += xv[0] * r0[n] + xv[1] * r1[n] + xv[2] * r2[n] + xv[3] * r3[n];
            }
        }
        for (; k < a->K; k++) {
            const float *r0 = wh + k * a->N;
            for (int64_t t = 0; t < a->T; t++) {
                const float c = a->x[t * a->xt + h * a->xh + k];
                float *yv = a->y + t * a->yt + h * a->yh;
                for (int64_t n = 0; n < a->N; n++) yv[n] += c * r0[n];
            }
        }
    }
}

static void mxv_rows(void *ctx, int64_t r0, int64_t r1) {
    const mla_args *a = ctx;
    const int64_t body = a->K / 8 * 8;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r / a->N, n = r % a->N;
        const float *row = a->w + h * a->wh + n * a->K;
        for (int64_t t = 0; t < a->T; t++) {
            const float *xv = a->x + t * a->xt + h * a->xh;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 16 <= body; k += 16) {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(xv + k), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(xv + k + 8), acc1);
            }
            for (; k < body; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(xv + k), acc0);
            float sum = hsum8(_mm256_add_ps(acc0, acc1));
            for (; k < a->K; k++) sum += row[k] * xv[k];
            a->y[t * a->yt + h * a->yh + n] = sum;
        }
    }
}

void flashllm_mla_vxm_mt(const float *x, int64_t xt, int64_t xh, const float *w, int64_t wh, float *y, int64_t yt,
                         int64_t yh, int64_t T, int64_t H, int64_t K, int64_t N, int threads) {
    mla_args a = {x, w, y, T, H, K, N, xt, xh, wh, yt, yh};
    flashllm_parallel_items(vxm_heads, &a, H, threads, 1);
}

void flashllm_mla_mxv_mt(const float *x, int64_t xt, int64_t xh, const float *w, int64_t wh, float *y, int64_t yt,
                         int64_t yh, int64_t T, int64_t H, int64_t K, int64_t N, int threads) {
    mla_args a = {x, w, y, T, H, K, N, xt, xh, wh, yt, yh};
    flashllm_parallel_items(mxv_rows, &a, H * N, threads, FINE_SHARES);
}
