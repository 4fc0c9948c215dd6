/* The entry points of decode_kernels.c, int4_int8_kernels.c, layer_ops.c and the greedy head's files that
 * decode_stack.c calls (see those files for their contracts). */
#ifndef FLASHLLM_DECODE_KERNELS_H
#define FLASHLLM_DECODE_KERNELS_H
#include <stdint.h>

void flashllm_f32_gemv_mt(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t N,
                          int64_t ldy, int threads);
void flashllm_w8_gemv_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, int64_t G,
                         float *y, int64_t N, int64_t ldy, int threads);
int flashllm_w8_bf16_takes(int64_t T, int64_t K, int64_t G);
int flashllm_w8_bf16_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, float *y,
                        int64_t N, int64_t ldy, int threads);
void flashllm_w4_gemv_mt(const float *xe, const float *xo, int64_t T, int64_t K, const uint8_t *w,
                         const float *scales, const int32_t *zeros, int64_t G, float *y, int64_t N, int64_t ldy,
                         int threads);
int flashllm_w4a8_gemv_mt(const float *x, int64_t T, int64_t K, const uint8_t *w, const float *scales,
                          const int32_t *zeros, const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy,
                          void *scratch, int threads, int afmt);
int flashllm_w8a8_gemv_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales,
                          const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy, void *scratch,
                          int threads, int afmt);
int flashllm_round_activations(float *x, int64_t T, int64_t K, int afmt);
void flashllm_rms_norm(const float *x, const float *residual, float *summed, const float *weight,
                       float *out, int64_t T, int64_t H, float eps);
void flashllm_rotary(float *x, int64_t T, int64_t stride, int64_t H, int64_t D, int64_t rot,
                     const float *cache, const int64_t *positions, int neox);
void flashllm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t width, const int32_t *seq_lens,
                               const int64_t *rows, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, float *out, int threads);
void flashllm_silu_and_mul_mt(const float *x, float *out, int64_t T, int64_t I, int threads);
int flashllm_bf16_screen_takes(int64_t T);
int flashllm_i8_screen_takes(int64_t K, int64_t m);
int flashllm_bf16_gemv_mt(const float *x, const uint16_t *w, float *y, int64_t T, int64_t K, int64_t N,
                          int64_t ldy, float *scratch, int threads);
int flashllm_i8_screen_mt(const float *x, int64_t T, int64_t K, const int8_t *codes, const float *scales, float *y,
                          int64_t N, int64_t ldy, int64_t m, void *scratch, int threads);
void flashllm_screen_pick(const float *x, int64_t T, int64_t K, const float *w, const float *scores, int64_t N,
                          int64_t ldy, const float *b, double factor, double floor0, double floor1, int64_t *out,
                          int64_t *counts, int threads);

#endif
