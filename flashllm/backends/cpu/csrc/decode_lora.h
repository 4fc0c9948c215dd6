/* LoRA adapters on the fused decode step's linear layers (decode_lora.c, called from decode_stack.c). */
#ifndef FLASHLLM_DECODE_LORA_H
#define FLASHLLM_DECODE_LORA_H
#include <stdint.h>

#define LORA_MAX_SHARDS 3

/* One linear layer's adapter slot table (flashllm/models/layers/lora.py's LinearLoRA): slot i's A in
 * a + i * shards * rank * K, (shards * rank, K), shard s's rows [s * rank, (s + 1) * rank); shard
 * s's B, the LoRA scale folded in, in b[s] + i * rows[s] * rank, (rows[s], rank), which adds to the
 * layer's output columns [offset[s], offset[s] + rows[s]). Smaller ranks are zero-padded. */
typedef struct {
    int64_t shards, rank, count;  /* count: the slots (max_loras) */
    const float *a;
    const float *b[LORA_MAX_SHARDS];
    int64_t offset[LORA_MAX_SHARDS], rows[LORA_MAX_SHARDS];
} stack_lora;

/* Floats of scratch flashllm_lora_apply needs for T tokens of a layer whose in and out features are
 * at most `widest`. */
int64_t flashllm_lora_scratch(int64_t T, int64_t widest, int64_t rank);

/* y[t, offset[s]:offset[s] + rows[s]] += B_s[slot] (A[slot] x_t)[s-th rank block] for every token t whose
 * slots[t] >= 0 (slots[t] < lo->count, checked by the caller); x (T, K), y (T, ldy). */
void flashllm_lora_apply(const stack_lora *lo, const int64_t *slots, int64_t T, const float *x, int64_t K,
                         float *y, int64_t ldy, float *scratch, int64_t split_elements, int threads);

#endif
