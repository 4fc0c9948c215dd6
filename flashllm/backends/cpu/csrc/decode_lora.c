/* Each decode token's LoRA delta inside the fused decode step (decode_stack.c), after a linear
 * layer's base product.
 *
 * Tokens are grouped by adapter slot, so each adapter's A and B stream once per step whatever number
 * of the batch's rows use it (16 rows over 4 rank-16 adapters of the 0.5b shape read ~140 MB of
 * tables a step; per row it would be 4x that). For each slot in use: its rows of x gathered into
 * one block, h = x_g A^T (one product over every shard's rank block), then per shard y_g += h_s B_s^T,
 * through the same native fp32 products as the base weights. This is what lora_shrink and
 * lora_expand compute (flashllm/ops/lora_*.py), up to the order of the fp32 sums. */
#include <string.h>

#include "decode_kernels.h"
#include "decode_lora.h"

int64_t flashllm_lora_scratch(int64_t T, int64_t widest, int64_t rank) {
    /* gathered rows, h, one shard's block of h, one shard's delta */
    return T * (widest + LORA_MAX_SHARDS * rank + rank + widest);
}

void flashllm_lora_apply(const stack_lora *lo, const int64_t *slots, int64_t T, const float *x, int64_t K,
                         float *y, int64_t ldy, float *scratch, int64_t split_elements, int threads) {
    if (!lo || !slots) return;
    const int64_t R = lo->rank, SR = lo->shards * R;
    float *xg = scratch, *h = xg + T * K, *hs = h + T * SR, *delta = hs + T * R;
    int64_t rows[T > 0 ? T : 1];
    for (int64_t t0 = 0; t0 < T; t0++) {
        const int64_t slot = slots[t0];
        int seen = slot < 0;
        for (int64_t t = 0; t < t0 && !seen; t++) seen = slots[t] == slot;
        if (seen) continue;  /* the base model's row, or a slot an earlier row's group took */
        int64_t n = 0;
        for (int64_t t = t0; t < T; t++)
            if (slots[t] == slot) {
                rows[n] = t;
                memcpy(xg + n * K, x + t * K, (size_t)K * sizeof(float));
                n++;
            }
        flashllm_f32_gemv_mt(xg, lo->a + slot * SR * K, h, n, K, SR, SR, SR * K >= split_elements ? threads : 1);
        for (int64_t s = 0; s < lo->shards; s++) {
            const int64_t N = lo->rows[s];
            for (int64_t i = 0; i < n; i++) memcpy(hs + i * R, h + i * SR + s * R, (size_t)R * sizeof(float));
            flashllm_f32_gemv_mt(hs, lo->b[s] + slot * N * R, delta, n, R, N, N, N * R >= split_elements ? threads : 1);
            for (int64_t i = 0; i < n; i++) {
                float *out = y + rows[i] * ldy + lo->offset[s];
                const float *d = delta + i * N;
                for (int64_t j = 0; j < N; j++) out[j] += d[j];
            }
        }
    }
}
