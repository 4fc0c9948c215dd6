/* What decode_stack.c shares with moe_decode.c and mla_decode.c: the linear-layer descriptor and its
 * product, the mixture-of-experts block a layer may carry in place of its dense MLP, and the latent
 * attention block (DeepSeek's MLA) it may carry in place of its attention. */
#ifndef FLASHLLM_DECODE_STACK_H
#define FLASHLLM_DECODE_STACK_H
#include <stdint.h>

#include "decode_lora.h"

enum { LINEAR_F32 = 0, LINEAR_W8 = 1, LINEAR_W4 = 2, LINEAR_W4A8 = 3, LINEAR_W8A8 = 4 };  /* xA8: x int8 activations */

typedef struct {
    int64_t kind, N, K, G;           /* kind: LINEAR_*; weight (N, K) fp32, int8, or (N, K/2) int4 bytes */
    const void *weight;
    const float *scales;              /* (N, G), integer kinds */
    const int32_t *zeros;             /* (N, G) int4 zero points, or NULL for 8 */
    const float *offsets;             /* (N, G) per-group offsets (GGUF's minimums; xA8 kinds only), or NULL */
    const float *bias;                /* (N,) or NULL */
    const stack_lora *lora;           /* the layer's adapter slots (decode_lora.h), or NULL */
    int64_t afmt;                     /* xA8 kinds: how the activations are rounded (int4_int8_kernels.c's A8_*) */
} stack_linear;

/* y (T, N) = x (T, K) W^T (+ bias) on `threads` threads (no adapters: decode_stack.c adds those); even / odd: (T, K/2) floats each, adjacent,
 * scratch for an int4 weight's activations (the two together hold the int8 ones and their scales
 * for the xA8 kinds) */
void flashllm_stack_linear(const stack_linear *l, int64_t T, int threads, const float *x, float *y, float *even,
                           float *odd);

typedef struct stack_moe stack_moe;  /* moe_decode.c */

/* The sizes a step passes the MoE block: tokens, hidden size, threads, and the per-op path's split
 * thresholds (products of at least split_elements weights, silu_and_mul of silu_split outputs). */
typedef struct {
    int64_t T, H;
    int threads;
    int64_t split_elements, silu_split;
} moe_sizes;

/* Whether the block's scratch holds T tokens (checked before a step writes anything). */
int flashllm_moe_takes(const stack_moe *m, int64_t T);

/* out (T, H) = the block's MLP of x (T, H), the normed hidden states (see moe_decode.c). */
void flashllm_moe_block(const stack_moe *m, const moe_sizes *z, const float *x, float *out);

typedef struct stack_mla stack_mla;  /* mla_decode.c */

/* What a step passes the latent attention block: tokens, threads and the per-op path's split
 * thresholds, the rotary table, and the step's positions, cache slots, query rows (0..T-1), block
 * tables and context lengths, every index already checked by decode_stack.c. */
typedef struct {
    int64_t T, block_size, width, rot, neox;
    int threads;
    int64_t split_elements, attention_split;
    float scale;
    const float *cos_sin;
    const int64_t *positions, *slots, *rows;
    const int32_t *tables, *seq_lens;
} mla_sizes;

/* Whether the block's scratch holds T tokens (checked before a step writes anything). */
int flashllm_mla_takes(const stack_mla *m, int64_t T);

/* out (T, H) = the block's attention output (after o_proj) of x (T, H), the normed hidden states;
 * writes the new tokens' latent rows into cache (blocks, block_size, L + R) (see mla_decode.c). */
void flashllm_mla_block(const stack_mla *m, const mla_sizes *z, float *cache, const float *x, float *out);

#endif
