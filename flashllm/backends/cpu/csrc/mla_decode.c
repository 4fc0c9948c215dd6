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
 *
 * flashllm_mla_block: a decode step's whole MLA layer inside decode_stack.c's one native call, what
 * flashllm/models/deepseek.py's DeepseekAttention computes through the ops, in the same order:
 *   q = q_b(rms(q_a(x)) * w_qa)  (or q_proj(x)); c = kv_a(x) (L + R);
 *   cache[slot] = (rms(c[:L]) * w_kva, rotate(c[L:])); rotate each head's q[Dn:];
 *   per head: query = (q_nope W_UK, q_pe); a = attention over the cache rows as one shared
 *   key/value head of L + R (decode_attention.c; the value's R rope columns are not used);
 *   o = (a[:L] W_UV^T per head) Wo^T.
 * Every product is the kernel the per-op path runs (flashllm_stack_linear, the two above), split
 * over the step's threads by the same rules, so the result is the per-op native path's.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "decode_kernels.h"
#include "decode_stack.h"
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

struct stack_mla {
    int64_t Hq, Dn, R, L, Dv, Q;       /* heads; nope, rope, latent and value dims; q_lora_rank (0: none) */
    float eps;                         /* the q_a and kv_a norms' */
    const stack_linear *q_a, *q_b;     /* q_a (Q, H) or NULL: then q_b is q_proj (Hq (Dn + R), H) */
    const float *q_norm;               /* (Q,) */
    const stack_linear *kv_a;          /* (L + R, H) */
    const float *kv_norm;              /* (L,) */
    const float *kv_b;                 /* (Hq, Dn + Dv, L) fp32: each head's W_UK rows, then its W_UV rows */
    const stack_linear *o;             /* (H, Hq Dv) */
    float *scratch;                    /* flashllm_mla_scratch(this, max_tokens) floats */
    int64_t max_tokens, H;
};

/* The widest input any of the block's products reads (their int4 / int8 activation scratch). */
static int64_t mla_widest(const stack_mla *m) {
    int64_t wide = m->H > m->Q ? m->H : m->Q;
    return m->Hq * m->Dv > wide ? m->Hq * m->Dv : wide;
}

/* Floats of scratch the block needs for T tokens (the caller allocates them). */
int64_t flashllm_mla_scratch(const stack_mla *m, int64_t T) {
    const int64_t W = m->L + m->R, wide = mla_widest(m) + 1;
    /* q, q_a and its norm, the compressed row, the queries and the latent outputs, the heads' values,
     * then even / odd */
    return T * (m->Hq * (m->Dn + m->R) + 2 * m->Q + W + 2 * m->Hq * W + m->Hq * m->Dv + 2 * (wide / 2 + 1));
}

int flashllm_mla_takes(const stack_mla *m, int64_t T) {
    return T >= 1 && T <= m->max_tokens;
}

static void mla_linear(const stack_linear *l, const mla_sizes *z, const float *x, float *y, float *even,
                       float *odd) {
    flashllm_stack_linear(l, z->T, l->N * l->K >= z->split_elements ? z->threads : 1, x, y, even, odd);
}

void flashllm_mla_block(const stack_mla *m, const mla_sizes *z, float *cache, const float *x, float *out) {
    const int64_t T = z->T, Hq = m->Hq, qk = m->Dn + m->R, W = m->L + m->R, L = m->L, R = m->R;
    const int64_t wide = mla_widest(m) + 1;
    float *q = m->scratch, *qa = q + T * Hq * qk, *qn = qa + T * m->Q, *comp = qn + T * m->Q;
    float *query = comp + T * W, *latent = query + T * Hq * W, *values = latent + T * Hq * W;
    float *even = values + T * Hq * m->Dv, *odd = even + T * (wide / 2 + 1);
    if (m->q_a) {
        mla_linear(m->q_a, z, x, qa, even, odd);
        flashllm_rms_norm(qa, NULL, NULL, m->q_norm, qn, T, m->Q, m->eps);
        mla_linear(m->q_b, z, qn, q, even, odd);
    } else {
        mla_linear(m->q_b, z, x, q, even, odd);
    }
    mla_linear(m->kv_a, z, x, comp, even, odd);
    /* the new tokens' cache rows: the normed latent, then the rotated shared key */
    flashllm_rotary(comp + L, T, W, 1, R, R, z->cos_sin, z->positions, (int)z->neox);
    for (int64_t t = 0; t < T; t++) {
        float *row = cache + z->slots[t] * W;
        flashllm_rms_norm(comp + t * W, NULL, NULL, m->kv_norm, row, 1, L, m->eps);
        memcpy(row + L, comp + t * W + L, (size_t)R * sizeof(float));
    }
    flashllm_rotary(q + m->Dn, T, Hq * qk, Hq, qk, R, z->cos_sin, z->positions, (int)z->neox);
    /* absorbed queries: each head's q_nope W_UK in its first L features, its rotated q_pe after them */
    flashllm_mla_vxm_mt(q, Hq * qk, qk, m->kv_b, (m->Dn + m->Dv) * L, query, Hq * W, W, T, Hq, m->Dn, L, z->threads);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hq; h++)
            memcpy(query + (t * Hq + h) * W + L, q + (t * Hq + h) * qk + m->Dn, (size_t)R * sizeof(float));
    int64_t longest = 0;
    for (int64_t t = 0; t < T; t++) longest = z->seq_lens[t] > longest ? z->seq_lens[t] : longest;
    /* native_ops.decode_attention's threshold; threads never change the result */
    const int threads = T * Hq * longest >= z->attention_split ? z->threads : 1;
    flashllm_decode_attention(query, Hq * W, cache, cache, z->tables, z->width, z->seq_lens, z->rows, T, Hq, 1, W,
                              z->block_size, z->scale, latent, threads);
    flashllm_mla_mxv_mt(latent, Hq * W, W, m->kv_b + m->Dn * L, (m->Dn + m->Dv) * L, values, Hq * m->Dv, m->Dv, T,
                        Hq, L, m->Dv, z->threads);
    mla_linear(m->o, z, values, out, even, odd);
}
