/* The cpu backend's decode products for x86 CPUs with AVX2 and FMA: matrix products of a few tokens
 * with a large weight (the small per-layer ops are in layer_ops.c).
 *
 * Every function works on the output rows n0 <= n < n1 only, so the caller can hand disjoint row
 * ranges to several threads (flashllm/backends/cpu/native.py does; ctypes drops the GIL around
 * each call). Weights are read once per call: all tokens of a row are done while the row is in L1.
 *
 * The integer-weight products keep the reference's fp32 semantics: every code (minus its zero
 * point, in integers) converts exactly to float and meets the fp32 activation in an FMA; only the
 * order of the sums and where the group scale is applied differ from dequantize-then-matmul.
 * Codes are widened straight from memory (vpmovsxbd / vpmovzxbd with a memory operand): on
 * `epyc3-2c` (docs/benchmarks.md) that runs ~18% faster on one core than widening a loaded register.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "decode_kernels.h"
#include "simd.h"
#include "parallel_for.h"
#include "thread_pool.h"

/* One row's dot product with x over features [k0, k1), a multiple of 32 apart, into four chains
 * acc[0..3] (four chains hide the FMA latency); SUM_CHAINS folds them. */
#define DOT_RUN(row, x, acc, k0, k1)                                                                  \
    for (int64_t k = (k0); k < (k1); k += 32) {                                                       \
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(x + k), acc[0]);           \
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(x + k + 8), acc[1]);   \
        acc[2] = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 16), _mm256_loadu_ps(x + k + 16), acc[2]); \
        acc[3] = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 24), _mm256_loadu_ps(x + k + 24), acc[3]); \
    }
#define SUM_CHAINS(acc) hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])))

/* y[t * ldy + n] = sum_k x[t * K + k] * w[n * K + k] for t < T and n0 <= n < n1 (fp32). */
void flashllm_f32_gemv(const float *x, const float *w, float *y, int64_t T, int64_t K,
                       int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t body = K / 32 * 32;
    for (int64_t n = n0; n < n1; n++) {
        const float *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            DOT_RUN(row, xt, acc, 0, body)
            float sum = SUM_CHAINS(acc);
            for (int64_t k = body; k < K; k++) sum += row[k] * xt[k];
            y[t * ldy + n] = sum;
        }
    }
}

/* flashllm_f32_gemv for one token x (K) and K a multiple of 32, with the bits it gives, reading
 * two rows at once: rows n0 + i and n0 + half + i, 32 features of each per step (128 B of one
 * stream, then 128 B of the other). Each row's four chains take the features DOT_RUN gives them,
 * in its order, so every output keeps its bits (a test holds each row of a pair to the row
 * computed alone). Why two streams: on `epyc3-2c` (docs/benchmarks.md) one thread's single stream
 * leaves bandwidth unused; reading 1 KiB of each row in turn beats the row loop by 4-10% on the 0.5b
 * shape's 896-feature products. Why 128 B steps: against 1 KiB runs, the LM head and the 24 gate_up
 * products run 1.03-1.13x, a whole token's 97 products 1.07x and the engine's decode 1.07x (same
 * machine, interleaved rounds); 1 KiB runs read those two products at only 0.87-0.92 of a plain read
 * of the same weights. (gcc keeps x as the FMAs' memory operand, so the loads per weight are the
 * same either way; only the order of the two streams' loads differs.) */
static void f32_gemv_pairs(const float *x, const float *w, float *y, int64_t K, int64_t n0, int64_t n1) {
    const int64_t half = (n1 - n0) / 2;
    for (int64_t i = 0; i < half; i++) {
        const float *ra = w + (n0 + i) * K, *rb = w + (n0 + half + i) * K;
        __m256 a[4], b[4];
        for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m256 xv[4];
            for (int j = 0; j < 4; j++) xv[j] = _mm256_loadu_ps(x + k + 8 * j);
            for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(ra + k + 8 * j), xv[j], a[j]);
            for (int j = 0; j < 4; j++) b[j] = _mm256_fmadd_ps(_mm256_loadu_ps(rb + k + 8 * j), xv[j], b[j]);
        }
        y[n0 + i] = SUM_CHAINS(a);
        y[n0 + half + i] = SUM_CHAINS(b);
    }
    if ((n1 - n0) % 2) flashllm_f32_gemv(x, w, y, 1, K, n1 - 1, n1, 0);
}

/* f32_gemv_pairs for CPUs with AVX-512F, eight rows at once: rows n0 + s * q + i for s < 8 (q an
 * eighth of the share), 32 features of each per step in two 16-lane chains; leftover rows one at a
 * time with the same chains, so again each output is the one its row gets alone (these bits differ
 * from the AVX2 loops' 4 x 8-lane chains; both are fp32 sums within the same bound). Why eight
 * streams: on `intel-2c` (docs/benchmarks.md) a read by two threads with eight streams each runs
 * ~1.2x one with two, this loop reads the 0.5b shape's 896-feature rows ~1.06x a four-row loop, and
 * the engine's batch-1 decode runs 1.25x the pair loop. On `epyc3-2c` (Zen 3, no AVX-512) four
 * streams read no faster than two. */
#define OCT_ROWS 8
__attribute__((target("avx512f")))
static void f32_gemv_octs(const float *x, const float *w, float *y, int64_t K, int64_t n0, int64_t n1) {
    const int64_t q = (n1 - n0) / OCT_ROWS;
    for (int64_t i = 0; i < q; i++) {
        const float *r[OCT_ROWS];
        __m512 a[OCT_ROWS][2];
        for (int s = 0; s < OCT_ROWS; s++) {
            r[s] = w + (n0 + s * q + i) * K;
            a[s][0] = a[s][1] = _mm512_setzero_ps();
        }
        for (int64_t k = 0; k < K; k += 32) {
            const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
            for (int s = 0; s < OCT_ROWS; s++) {
                a[s][0] = _mm512_fmadd_ps(_mm512_loadu_ps(r[s] + k), x0, a[s][0]);
                a[s][1] = _mm512_fmadd_ps(_mm512_loadu_ps(r[s] + k + 16), x1, a[s][1]);
            }
        }
        for (int s = 0; s < OCT_ROWS; s++) y[n0 + s * q + i] = _mm512_reduce_add_ps(_mm512_add_ps(a[s][0], a[s][1]));
    }
    for (int64_t n = n0 + OCT_ROWS * q; n < n1; n++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t k = 0; k < K; k += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + n * K + k), _mm512_loadu_ps(x + k), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + n * K + k + 16), _mm512_loadu_ps(x + k + 16), a1);
        }
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/* Rows the one-token loop reads at once: 8 where the CPU has AVX-512F, else 2 (set at load;
 * flashllm_f32_set_rows changes it, for tests and A/B runs). 8 also sends small batches to the
 * 16-lane tiles (f32_gemm_z). */
static int f32_rows = 2;
__attribute__((constructor)) static void pick_f32_rows(void) {
    __builtin_cpu_init();
    f32_rows = __builtin_cpu_supports("avx512f") ? OCT_ROWS : 2;
}

/* Sets the rows the one-token loop reads at once (2, or 8 where the CPU has AVX-512F: the AVX2 or
 * the AVX-512 fp32 paths) and returns the count in use afterwards: an unsupported count changes
 * nothing. */
int flashllm_f32_set_rows(int rows) {
    if (rows == 2 || (rows == OCT_ROWS && __builtin_cpu_supports("avx512f"))) f32_rows = rows;
    return f32_rows;
}

/* Rows the one-token loop reads at once on the AVX-512 paths (f32_rows 8): eight (f32_gemv_octs) on
 * Intel CPUs, two (the pair loop, rows of any length) on AMD ones. On `epyc4-2c` (Zen 4,
 * docs/benchmarks.md) eight streams a thread read slower than two: interleaved in one process, over
 * 1 GiB of 1024-feature rows by two threads, the pair loop read 1.00x the two-stream probe and the
 * eight-row loop 0.84x; at 512, 2048 and 4864 features the eight-row loop read 0.86-0.92x a
 * two-stream sum and the pair loop 1.03-1.14x. On `intel-2c` eight rows were the faster (above). */
static int f32_gemv_rows = OCT_ROWS;
__attribute__((constructor)) static void pick_f32_gemv_rows(void) {
    __builtin_cpu_init();
    f32_gemv_rows = __builtin_cpu_is("amd") ? 2 : OCT_ROWS;
}

/* Sets the rows the AVX-512 paths' one-token loop reads at once (2 or 8; anything else changes
 * nothing) and returns the count in use afterwards, for tests and A/B runs. */
int flashllm_f32_set_gemv_rows(int rows) {
    if (rows == 2 || rows == OCT_ROWS) f32_gemv_rows = rows;
    return f32_gemv_rows;
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

/* ---- small batches: register tiles of R weight rows x TT tokens ----
 * One token is memory-bound, and the row-at-a-time loops above stream each row once. With a few
 * tokens the product turns compute-bound, and row-at-a-time would load (and, for integer weights,
 * widen and convert) every weight vector once per token. A tile loads each weight vector once for
 * TT tokens and each activation vector once for R rows, keeping R x TT accumulators in registers
 * (AVX2 has 16: 4 rows x 3 tokens takes 12, plus 3 activations and 1 weight). Integer codes are
 * dequantized in registers the way the reference dequantizes them (code minus zero point,
 * converted, times the group's scale, in fp32), so only the order of the sums differs from it.
 *
 * A tile's arguments: x / x2 the activations of its first token (x2: the odd features of an int4
 * product, x the even ones), xs the stride between tokens, w its first weight row, ws the stride
 * between rows (elements of the weight's type), scales / zeros the first row's (G per row). */
typedef void (*tile_fn)(const float *x, const float *x2, int64_t xs, const void *w, int64_t ws,
                        const float *scales, const int32_t *zeros, int64_t G, float *y, int64_t ldy,
                        const char *pf, int64_t pf_len);

#define UNROLL _Pragma("GCC unroll 16")

/* A tile computes its R x TT dot products whole. While it runs it prefetches the pf_len bytes at
 * pf, one cache line per step of 8 features: see tiled_product. */
#define TILE_BEGIN(NAME, R, TT, W_T)                                                              \
static void NAME(const float *x, const float *x2, int64_t xs, const void *w_, int64_t ws,         \
                 const float *scales, const int32_t *zeros, int64_t G, float *y, int64_t ldy,     \
                 const char *pf, int64_t pf_len) {                                                \
    const W_T *w = w_;                                                                           \
    const char *pf_end = pf + pf_len;                                                            \
    __m256 acc[R][TT];                                                                           \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps(); \
    const int64_t group = ws / G;                                                                \
    for (int64_t g = 0; g < G; g++) {                                                            \
        __m256 scale[R];                                                                         \
        __m256i zero[R];                                                                         \
        UNROLL for (int r = 0; r < R; r++) {                                                     \
            scale[r] = _mm256_set1_ps(scales ? scales[r * G + g] : 1.0f);                         \
            zero[r] = _mm256_set1_epi32(zeros ? zeros[r * G + g] : 8);                            \
        }                                                                                        \
        (void)scale; (void)zero; (void)x2;                                                       \
        for (int64_t k = g * group; k < (g + 1) * group; k += 8) {                               \
            if (pf < pf_end) { _mm_prefetch(pf, _MM_HINT_T1); pf += 64; }                        \
            __m256 xv[TT];

/* one pass over the 8 weights at k of every row: `wv` from DEQUANT against activations `src` */
#define TILE_PASS(R, TT, src, DEQUANT)                                                            \
            UNROLL for (int t = 0; t < TT; t++) xv[t] = _mm256_loadu_ps((src) + t * xs + k);     \
            UNROLL for (int r = 0; r < R; r++) {                                                 \
                const __m256 wv = DEQUANT;                                                       \
                UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]); \
            }

#define TILE_END(R, TT)                                                                           \
        }                                                                                        \
    }                                                                                            \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) y[t * ldy + r] = hsum8(acc[r][t]); \
}

/* TILE_END for one group per row (G == 1): each row's scale multiplies its finished sums once */
#define TILE_END_ROW_SCALED(R, TT)                                                                \
        }                                                                                        \
    }                                                                                            \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)                       \
        y[t * ldy + r] = hsum8(acc[r][t]) * scales[r];                                           \
}

#define DQ_F32 _mm256_loadu_ps(w + r * ws + k)
#define DQ_I8 _mm256_mul_ps(WIDEN_I8(w + r * ws + k), scale[r])
#define DQ_I4(SHIFT) _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(                            \
    _mm256_and_si256(_mm256_srli_epi32(WIDEN_U8(w + r * ws + k), SHIFT), _mm256_set1_epi32(0x0F)), zero[r])), scale[r])

#define DEFINE_F32_TILE(NAME, R, TT) TILE_BEGIN(NAME, R, TT, float) TILE_PASS(R, TT, x, DQ_F32) TILE_END(R, TT)
#define DEFINE_I8_TILE(NAME, R, TT) TILE_BEGIN(NAME, R, TT, int8_t) TILE_PASS(R, TT, x, DQ_I8) TILE_END(R, TT)
/* int8 with one scale per row: the codes' sums are scaled at the end (as flashllm_w8_gemv does), not
 * every code, which saves one multiply per 8 weights and the scale registers (4 rows fit, as fp32) */
#define DEFINE_I8_ROW_TILE(NAME, R, TT) TILE_BEGIN(NAME, R, TT, int8_t) TILE_PASS(R, TT, x, WIDEN_I8(w + r * ws + k)) \
    TILE_END_ROW_SCALED(R, TT)
/* int4: bytes hold (even feature, odd feature) in (low, high) nibbles; x / x2 are deinterleaved */
#define DEFINE_I4_TILE(NAME, R, TT) TILE_BEGIN(NAME, R, TT, uint8_t)                                  \
    TILE_PASS(R, TT, x, DQ_I4(0)) TILE_PASS(R, TT, x2, DQ_I4(4)) TILE_END(R, TT)

/* The tiles of one kind: R rows x 1..3 tokens, and 1 row (a block's leftover rows) x 1..3 tokens.
 * R x 3 is the workhorse; it must fit the 16 registers with what the kind keeps per row: fp32 4 x 3
 * (12 accumulators, 3 activations, 1 weight), int8 3 x 3 (+ 3 scales), int4 2 x 3 (+ 2 scales,
 * 2 zero points). */
#define TILE_TOKENS 3
#define DEFINE_TILES(KIND, DEFINE, R)                                                            \
    DEFINE(KIND##_tile_Rx3, R, 3) DEFINE(KIND##_tile_Rx2, R, 2) DEFINE(KIND##_tile_Rx1, R, 1)    \
    DEFINE(KIND##_tile_1x3, 1, 3) DEFINE(KIND##_tile_1x2, 1, 2) DEFINE(KIND##_tile_1x1, 1, 1)    \
    static const tile_fn KIND##_TILES[2 * TILE_TOKENS] = {KIND##_tile_1x1, KIND##_tile_1x2, KIND##_tile_1x3, \
                                                         KIND##_tile_Rx1, KIND##_tile_Rx2, KIND##_tile_Rx3};

DEFINE_TILES(f32, DEFINE_F32_TILE, 4)
DEFINE_TILES(i8, DEFINE_I8_TILE, 3)
DEFINE_TILES(i8row, DEFINE_I8_ROW_TILE, 4)
DEFINE_TILES(i4, DEFINE_I4_TILE, 2)

/* The tokens of a sweep that starts at token t: T split as evenly as the sweeps allow (16 in sweeps
 * of 3 = 3+3+3+3+2+2, not ...+3+1: a 1-token tile is load-bound) */
static inline int64_t sweep_tokens(int64_t T, int64_t t, int64_t sweeps, int64_t sweep) {
    return (T - t) / (sweeps - sweep) + ((T - t) % (sweeps - sweep) != 0);
}

/* Rows n0..n1 of y[t * ldy + n] for T tokens: blocks of R rows (the last rows one at a time), each
 * swept over the tokens up to TILE_TOKENS at a time while its rows stay in cache. A block's sweeps
 * take long enough that the hardware prefetcher alone leaves DRAM idle through them and the next
 * block then waits on memory (time = transfer + arithmetic); so each sweep prefetches its share of
 * the next block's bytes (rows are contiguous) and the two overlap. ws: weights per row (elements of
 * size elem), xs: activations per token; tiles: the 1-row tiles of 1..TILE_TOKENS tokens, then the
 * R-row ones. */
static void tiled_product(const tile_fn *tiles, int R, const float *x, const float *x2, int64_t T, int64_t xs,
                          const void *w, int64_t ws, size_t elem, const float *scales, const int32_t *zeros,
                          int64_t G, float *y, int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t row_bytes = ws * (int64_t)elem, sweeps = (T + TILE_TOKENS - 1) / TILE_TOKENS;
    const char *end = (const char *)w + n1 * row_bytes;
    for (int64_t n = n0; n < n1;) {
        const int rows = n + R <= n1 ? R : 1;
        const char *wn = (const char *)w + n * row_bytes, *next = wn + rows * row_bytes;
        const int64_t share = (R * row_bytes / sweeps + 63) & ~(int64_t)63;
        for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
            const int64_t tokens = sweep_tokens(T, t, sweeps, sweep);
            const char *pf = next + sweep * share;
            const int64_t pf_len = pf >= end ? 0 : (end - pf < share ? end - pf : share);
            tiles[(rows == R) * TILE_TOKENS + tokens - 1](x + t * xs, x2 ? x2 + t * xs : NULL, xs, wn, ws,
                                                          scales ? scales + n * G : NULL,
                                                          zeros ? zeros + n * G : NULL, G, y + t * ldy + n, ldy,
                                                          pf, pf_len);
            t += tokens;
        }
        n += rows;
    }
}


/* ---- AVX2, 1 to STREAM_MAX_TOKENS tokens (a decode step, a speculative verify step's 1 + k rows): the
 * tiles' sums read as the one-token loop reads ----
 * tiled_product's contiguous 4-row blocks stream a few tokens' products slowly on `epyc-avx2-2c`
 * (docs/benchmarks.md): SmolLM2-135M's 150 body products (distinct weights, two threads) take
 * 1.4-1.6x the one-token loop at 2 to 5 tokens. Here the 4 rows of a tile are a quarter of the share
 * apart (four streams, each running on through the next rows of its quarter) and the features go by
 * in chunks of STREAM_CHUNK: every sweep of the tokens (up to TILE_TOKENS at a time) runs over one
 * chunk of the 4 rows before the next chunk is read, the accumulators parked in memory between
 * sweeps, so each stream moves on steadily while the chunk's lines sit in L1; the first sweep
 * prefetches STREAM_AHEAD bytes on in each stream. Same machine, interleaved, minimum of 13-15
 * rounds: those products ran 12.9 ms against 19.5 for the blocks at 2 tokens, 13.6 / 18.9 at 4,
 * 15.9 / 21.0 at 5, 19.5 / 22.8 at 8 and 20.6-23.0 / 22.8-22.9 at 9 (one token: ~15.6); at 12 and
 * 16 tokens the blocks were faster (28.2 against 30.0, 30.6 against 36.4), so larger batches keep them.
 *
 * Each output is still one 8-lane accumulator over k = 0, 8, 16, ... in order, then hsum8: the
 * blocks' sums, bit for bit, whatever the chunk, sweep, share or the batch's other tokens. */
#define STREAM_ROWS 4
#define STREAM_MAX_TOKENS 9
#define STREAM_CHUNK 128  /* features: 512 B of each of the 4 rows */
#define STREAM_AHEAD 512  /* bytes: a chunk on in each stream */
#define STREAM_SHARES 8   /* shares per thread (FINE_SHARES restart the streams too often) */
static int stream_max = STREAM_MAX_TOKENS;

/* Sets the most tokens the AVX2 stream tiles take (0: none, 1 < tokens <= STREAM_MAX_TOKENS; else
 * nothing changes) and returns the setting in use afterwards, for tests and A/B runs. */
int flashllm_f32_set_stream_max(int tokens) {
    if (tokens == 0 || (tokens > 1 && tokens <= STREAM_MAX_TOKENS)) stream_max = tokens;
    return stream_max;
}

/* The fewest tokens the stream tiles take: 1, so that one token (a decode step alone, each step of a
 * multi-step call) sums each output in the order every larger batch does, and a sequence's bits do
 * not depend on the batch it decodes in or on a verify step's rows; the pair loop's four chains summed
 * in another order. At one token the tiles are a memory-bound read, and on `epyc-avx2-2c` (one
 * sequence at 128 tokens, executor.execute, 30-40 interleaved rounds) they ran the one-token step
 * 0.93-0.96x the pair loop's time on the qwen2.5-0.5b shape and 0.97x on fp32 SmolLM2-135M. */
static int stream_min = 1;

/* Sets the fewest tokens the stream tiles take (1, or 2: one token on the pair loop, as before
 * 2026-11-30) and returns the setting in use afterwards, for tests and A/B runs. */
int flashllm_f32_set_stream_min(int tokens) {
    if (tokens == 1 || tokens == 2) stream_min = tokens;
    return stream_min;
}

/* Whether f32_gemm_streams takes T tokens of K features: the AVX2 paths (f32_rows 2) only */
static int stream_takes(int64_t T, int64_t K) {
    return T >= stream_min && T <= stream_max && K % 8 == 0 && f32_rows != OCT_ROWS;
}

/* One sweep of TT tokens (x, xs apart) over features [k0, k1) of R rows: acc[r * STREAM_MAX_TOKENS + t]
 * carries each sum from the previous chunk (fresh: zeros); prefetches `ahead` bytes on (0: none). */
__attribute__((always_inline))
static inline void stream_sweep(const float *x, int64_t xs, const float *const *rows, int R, int TT, int64_t k0,
                                int64_t k1, __m256 *acc, int fresh, int64_t ahead) {
    __m256 a[STREAM_ROWS][TILE_TOKENS];
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)
        a[r][t] = fresh ? _mm256_setzero_ps() : acc[r * STREAM_MAX_TOKENS + t];
    for (int64_t k = k0; k < k1; k += 8) {
        if (ahead && (k & 15) == 0)
            UNROLL for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rows[r] + k) + ahead, _MM_HINT_T0);
        __m256 xv[TILE_TOKENS];
        UNROLL for (int t = 0; t < TT; t++) xv[t] = _mm256_loadu_ps(x + t * xs + k);
        UNROLL for (int r = 0; r < R; r++) {
            const __m256 wv = _mm256_loadu_ps(rows[r] + k);
            UNROLL for (int t = 0; t < TT; t++) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r * STREAM_MAX_TOKENS + t] = a[r][t];
}

/* R rows (outputs at ys[r], tokens ldy apart) against all T tokens, chunk by chunk */
__attribute__((always_inline))
static inline void stream_rows(const float *x, int64_t T, int64_t K, const float *const *rows, int R,
                               float *const *ys, int64_t ldy) {
    __m256 acc[STREAM_ROWS * STREAM_MAX_TOKENS];
    const int64_t sweeps = (T + TILE_TOKENS - 1) / TILE_TOKENS;
    for (int64_t k0 = 0; k0 < K; k0 += STREAM_CHUNK) {
        const int64_t k1 = k0 + STREAM_CHUNK < K ? k0 + STREAM_CHUNK : K;
        for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
            const int64_t tokens = sweep_tokens(T, t, sweeps, sweep), ahead = sweep == 0 ? STREAM_AHEAD : 0;
            if (tokens == 3) stream_sweep(x + t * K, K, rows, R, 3, k0, k1, acc + t, k0 == 0, ahead);
            else if (tokens == 2) stream_sweep(x + t * K, K, rows, R, 2, k0, k1, acc + t, k0 == 0, ahead);
            else stream_sweep(x + t * K, K, rows, R, 1, k0, k1, acc + t, k0 == 0, ahead);
            t += tokens;
        }
    }
    for (int r = 0; r < R; r++) for (int64_t t = 0; t < T; t++) ys[r][t * ldy] = hsum8(acc[r * STREAM_MAX_TOKENS + t]);
}

/* Rows n0..n1 of y[t * ldy + n] for T <= STREAM_MAX_TOKENS tokens, K a multiple of 8: rows n0 + s * q + i
 * (s < 4, q a quarter of the rows) together, i in order; then the last rows one at a time. */
static void f32_gemm_streams(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t n0, int64_t n1,
                             int64_t ldy) {
    const int64_t q = (n1 - n0) / STREAM_ROWS;
    for (int64_t i = 0; i < q; i++) {
        const float *rows[STREAM_ROWS];
        float *ys[STREAM_ROWS];
        for (int s = 0; s < STREAM_ROWS; s++) {
            rows[s] = w + (n0 + s * q + i) * K;
            ys[s] = y + n0 + s * q + i;
        }
        stream_rows(x, T, K, rows, STREAM_ROWS, ys, ldy);
    }
    for (int64_t n = n0 + STREAM_ROWS * q; n < n1; n++) {
        const float *rows[1] = {w + n * K};
        float *ys[1] = {y + n};
        stream_rows(x, T, K, rows, 1, ys, ldy);
    }
}

/* ---- small batches on CPUs with AVX-512F: fp32 tiles of 4 rows x up to 6 tokens in 16-lane registers ----
 * The AVX2 tiles above hold 4 x 3 accumulators of 8 lanes; AVX-512's 32 registers of 16 lanes hold
 * 4 x 6 (24, plus 6 activations and a weight), so a 16-token sweep takes 3 passes over a block instead
 * of 6 and each pass does 4x the arithmetic per load. K must be a multiple of 16.
 *
 * A tile's rows are a quarter of the share apart (f32_gemm_z), as the one-token loop spreads its
 * eight, so each of the four is the next row of a stream that runs through its quarter; in its first
 * sweep the tile prefetches each row's successor, one line a row per 16-feature step. Contiguous
 * 4-row blocks (tiled_product, even with each sweep prefetching all of its part of the next block)
 * read the weights slower on `intel-2c` (docs/benchmarks.md): spread, a token's 97 products over
 * distinct weights (from DRAM, not the L3) run 1.12x, 1.14x, 1.11x and 1.08x faster at 2, 4, 8 and
 * 16 tokens, and the offline workload 1.16x. Each output is still its own accumulator's sum, in the
 * same order, so the bits are those of the blocks.
 *
 * A tile's arguments: x the activations of its first token (K apart), w its first row (rs apart),
 * y its first output (rows ys apart, tokens ldy), ahead the bytes from each row to prefetch (0: none). */
#define ZTILE_TOKENS 6
typedef void (*ztile_fn)(const float *x, int64_t K, const float *w, int64_t rs, float *y, int64_t ldy, int64_t ys,
                         int64_t ahead);

#define DEFINE_ZTILE(NAME, R, TT)                                                                 \
__attribute__((target("avx512f")))                                                               \
static void NAME(const float *x, int64_t K, const float *w, int64_t rs, float *y, int64_t ldy, int64_t ys, \
                 int64_t ahead) {                                                                \
    __m512 acc[R][TT];                                                                           \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; k += 16) {                                                        \
        if (ahead) UNROLL for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + r * rs + k) + ahead, _MM_HINT_T1); \
        __m512 xv[TT];                                                                           \
        UNROLL for (int t = 0; t < TT; t++) xv[t] = _mm512_loadu_ps(x + t * K + k);              \
        UNROLL for (int r = 0; r < R; r++) {                                                     \
            const __m512 wv = _mm512_loadu_ps(w + r * rs + k);                                   \
            UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]); \
        }                                                                                        \
    }                                                                                            \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)                       \
        y[t * ldy + r * ys] = _mm512_reduce_add_ps(acc[r][t]);                                   \
}
#define DEFINE_ZTILES_OF(R, P) DEFINE_ZTILE(P##1, R, 1) DEFINE_ZTILE(P##2, R, 2) DEFINE_ZTILE(P##3, R, 3) \
    DEFINE_ZTILE(P##4, R, 4) DEFINE_ZTILE(P##5, R, 5) DEFINE_ZTILE(P##6, R, 6)
DEFINE_ZTILES_OF(4, ztile_4x)
DEFINE_ZTILES_OF(1, ztile_1x)
static const ztile_fn ZTILES_4[ZTILE_TOKENS] = {ztile_4x1, ztile_4x2, ztile_4x3, ztile_4x4, ztile_4x5, ztile_4x6};
static const ztile_fn ZTILES_1[ZTILE_TOKENS] = {ztile_1x1, ztile_1x2, ztile_1x3, ztile_1x4, ztile_1x5, ztile_1x6};

/* One tile's rows (w, rs apart; outputs y, ys apart) over all T tokens, ZTILE_TOKENS or fewer a sweep;
 * the first sweep prefetches `ahead` bytes on from each row (0: none). */
static void z_sweeps(const ztile_fn *tiles, const float *x, int64_t T, int64_t K, const float *w, int64_t rs,
                     float *y, int64_t ldy, int64_t ys, int64_t ahead) {
    const int64_t sweeps = (T + ZTILE_TOKENS - 1) / ZTILE_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t tokens = sweep_tokens(T, t, sweeps, sweep);
        tiles[tokens - 1](x + t * K, K, w, rs, y + t * ldy, ldy, ys, sweep == 0 ? ahead : 0);
        t += tokens;
    }
}

/* Rows n0..n1 of y[t * ldy + n] for T tokens: rows n0 + s * q + i (s < 4, q a quarter of the rows)
 * in the 4-row tiles, i in order, each prefetching the next i's rows; then the last rows one at a time. */
static void f32_gemm_z(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t n0, int64_t n1,
                       int64_t ldy) {
    const int64_t q = (n1 - n0) / 4, row_bytes = K * (int64_t)sizeof(float);
    for (int64_t i = 0; i < q; i++)
        z_sweeps(ZTILES_4, x, T, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, i + 1 < q ? row_bytes : 0);
    for (int64_t n = n0 + 4 * q; n < n1; n++) z_sweeps(ZTILES_1, x, T, K, w + n * K, K, y + n, ldy, 1, 0);
}

/* Two or three tokens: eight rows an eighth of the share apart at once (8 x 3 accumulators), no
 * software prefetch, as the one-token loop reads: memory-bound there, eight streams read faster
 * than the 4-row tiles' four and their prefetch. The token's 97 products of the 0.5b shape, two
 * threads on `intel-2c` (docs/benchmarks.md): 1.085x the 4-row tiles at two tokens, 1.106x at three,
 * 0.92x at five (so from four tokens on the tiles run). Each output is still its own accumulator's
 * sum in the same order, so the bits are the 4-row tiles'. */
#define OCT_TILE_MAX_TOKENS 3
DEFINE_ZTILE(ztile_8x2, OCT_ROWS, 2) DEFINE_ZTILE(ztile_8x3, OCT_ROWS, 3)
static void f32_gemm_z8(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t n0, int64_t n1,
                        int64_t ldy) {
    const int64_t q = (n1 - n0) / OCT_ROWS;
    const ztile_fn tile = T == 2 ? ztile_8x2 : ztile_8x3;
    for (int64_t i = 0; i < q; i++) tile(x, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, 0);
    for (int64_t n = n0 + OCT_ROWS * q; n < n1; n++) z_sweeps(ZTILES_1, x, T, K, w + n * K, K, y + n, ldy, 1, 0);
}

/* ---- small batches of int8 weights with one scale per row, on CPUs with AVX-512F ----
 * The AVX2 int8 tiles (i8row, 4 rows x 3 tokens of 8 lanes) widen and convert each 8 codes for at most
 * three tokens; with 16 tokens a block is swept six times and every code is widened and converted six
 * times. These tiles are f32_gemm_z's over int8 codes: 4 rows a quarter of the share apart x up to 6
 * tokens in 16-lane accumulators (24 of the 32 registers), 16 codes widened (vpmovsxbd) and converted
 * once per 6 tokens, the row's scale multiplied into its finished sums (as flashllm_w8_gemv does). The
 * codes convert exactly, so only the order of the sums differs from the AVX2 tiles; each output is its
 * own accumulator's sum in one order whatever the tile, the sweep or the share, so a token's bits do
 * not depend on the other tokens of the batch (T >= W8_Z_MIN_TOKENS) or on the thread split. In its
 * first sweep a tile prefetches each row's successor, one line a row per 64 codes. */
#define WIDEN_I8_16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
typedef void (*i8ztile_fn)(const float *x, int64_t K, const int8_t *w, int64_t rs, const float *scales, int64_t ss,
                           float *y, int64_t ldy, int64_t ys, int64_t ahead);

#define DEFINE_I8_ZTILE(NAME, R, TT)                                                              \
__attribute__((target("avx512f")))                                                               \
static void NAME(const float *x, int64_t K, const int8_t *w, int64_t rs, const float *scales, int64_t ss, \
                 float *y, int64_t ldy, int64_t ys, int64_t ahead) {                             \
    __m512 acc[R][TT];                                                                           \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; k += 16) {                                                        \
        if (ahead && (k & 63) == 0)                                                              \
            UNROLL for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + r * rs + k) + ahead, _MM_HINT_T1); \
        __m512 xv[TT];                                                                           \
        UNROLL for (int t = 0; t < TT; t++) xv[t] = _mm512_loadu_ps(x + t * K + k);              \
        UNROLL for (int r = 0; r < R; r++) {                                                     \
            const __m512 wv = WIDEN_I8_16(w + r * rs + k);                                       \
            UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]); \
        }                                                                                        \
    }                                                                                            \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)                       \
        y[t * ldy + r * ys] = _mm512_reduce_add_ps(acc[r][t]) * scales[r * ss];                  \
}
#define DEFINE_I8_ZTILES_OF(R, P) DEFINE_I8_ZTILE(P##1, R, 1) DEFINE_I8_ZTILE(P##2, R, 2) DEFINE_I8_ZTILE(P##3, R, 3) \
    DEFINE_I8_ZTILE(P##4, R, 4) DEFINE_I8_ZTILE(P##5, R, 5) DEFINE_I8_ZTILE(P##6, R, 6)
DEFINE_I8_ZTILES_OF(4, i8ztile_4x)
DEFINE_I8_ZTILES_OF(1, i8ztile_1x)
static const i8ztile_fn I8ZTILES_4[ZTILE_TOKENS] = {i8ztile_4x1, i8ztile_4x2, i8ztile_4x3, i8ztile_4x4, i8ztile_4x5,
                                                    i8ztile_4x6};
static const i8ztile_fn I8ZTILES_1[ZTILE_TOKENS] = {i8ztile_1x1, i8ztile_1x2, i8ztile_1x3, i8ztile_1x4, i8ztile_1x5,
                                                    i8ztile_1x6};

static void i8_z_sweeps(const i8ztile_fn *tiles, const float *x, int64_t T, int64_t K, const int8_t *w, int64_t rs,
                        const float *scales, int64_t ss, float *y, int64_t ldy, int64_t ys, int64_t ahead) {
    const int64_t sweeps = (T + ZTILE_TOKENS - 1) / ZTILE_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t tokens = sweep_tokens(T, t, sweeps, sweep);
        tiles[tokens - 1](x + t * K, K, w, rs, scales, ss, y + t * ldy, ldy, ys, sweep == 0 ? ahead : 0);
        t += tokens;
    }
}

/* Rows n0..n1 of the one-scale-per-row int8 product for T tokens, K a multiple of 16: as f32_gemm_z */
static void w8_gemm_z(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, float *y,
                      int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t q = (n1 - n0) / 4;
    for (int64_t i = 0; i < q; i++)
        i8_z_sweeps(I8ZTILES_4, x, T, K, w + (n0 + i) * K, q * K, scales + n0 + i, q, y + n0 + i, ldy, q,
                    i + 1 < q ? K : 0);
    for (int64_t n = n0 + 4 * q; n < n1; n++) i8_z_sweeps(I8ZTILES_1, x, T, K, w + n * K, K, scales + n, 1, y + n, ldy, 1, 0);
}

/* The fewest tokens the AVX-512 int8 tiles take (0: never, as on CPUs without AVX-512F); set at load,
 * flashllm_w8_set_z_min changes it for tests and A/B runs. */
#define W8_Z_MIN_TOKENS 2
static int w8_z_min = 0;
__attribute__((constructor)) static void pick_w8_z(void) {
    __builtin_cpu_init();
    w8_z_min = __builtin_cpu_supports("avx512f") ? W8_Z_MIN_TOKENS : 0;
}

/* Sets the fewest tokens the AVX-512 int8 tiles take (0 turns them off; ignored without AVX-512F) and
 * returns the setting in use afterwards. */
int flashllm_w8_set_z_min(int tokens) {
    if (tokens >= 0 && __builtin_cpu_supports("avx512f")) w8_z_min = tokens;
    return w8_z_min;
}

/* flashllm_f32_gemv's product for K a multiple of 8, tiled (any T) */
void flashllm_f32_gemm(const float *x, const float *w, float *y, int64_t T, int64_t K,
                       int64_t n0, int64_t n1, int64_t ldy) {
    tiled_product(f32_TILES, 4, x, NULL, T, K, w, K, sizeof(float), NULL, NULL, 1, y, n0, n1, ldy);
}

/* flashllm_w8_gemv's product, tiled */
void flashllm_w8_gemm(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales,
                      int64_t G, float *y, int64_t n0, int64_t n1, int64_t ldy) {
    if (G == 1) tiled_product(i8row_TILES, 4, x, NULL, T, K, w, K, 1, scales, NULL, G, y, n0, n1, ldy);
    else tiled_product(i8_TILES, 3, x, NULL, T, K, w, K, 1, scales, NULL, G, y, n0, n1, ldy);
}

/* flashllm_w4_gemv's product, tiled */
void flashllm_w4_gemm(const float *xe, const float *xo, int64_t T, int64_t K, const uint8_t *w,
                      const float *scales, const int32_t *zeros, int64_t G, float *y,
                      int64_t n0, int64_t n1, int64_t ldy) {
    tiled_product(i4_TILES, 2, xe, xo, T, K / 2, w, K / 2, 1, scales, zeros, G, y, n0, n1, ldy);
}

/* The tokens the 16-lane tiles take at once: a prompt's tokens go through a share in chunks of this
 * many, so a chunk's activations (32 x 4864 fp32: 608 KiB) stay in the L2 while the share's rows (at
 * most a few hundred KiB) are swept once per chunk from the L2 too. Every output is still its own
 * accumulator's sum in one order, so the chunking changes no bits. */
#define Z_CHUNK_TOKENS 32

static void f32_gemm_z_chunks(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t n0,
                              int64_t n1, int64_t ldy) {
    for (int64_t t = 0; t < T; t += Z_CHUNK_TOKENS)
        f32_gemm_z(x + t * K, w, y + t * ldy, T - t < Z_CHUNK_TOKENS ? T - t : Z_CHUNK_TOKENS, K, n0, n1, ldy);
}

static void w8_gemm_z_chunks(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, float *y,
                             int64_t n0, int64_t n1, int64_t ldy) {
    for (int64_t t = 0; t < T; t += Z_CHUNK_TOKENS)
        w8_gemm_z(x + t * K, T - t < Z_CHUNK_TOKENS ? T - t : Z_CHUNK_TOKENS, K, w, scales, y + t * ldy, n0, n1, ldy);
}

/* ---- the products above over row shares of the worker pool (thread_pool.h; shares per thread:
 * parallel_for.h) ---- */

typedef struct {
    const void *x, *x2, *w, *scales, *zeros;
    float *y;
    int64_t T, K, G, ldy;
} gemv_args;

static void f32_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    /* One token: with AVX-512 the eight-row loop (Intel) or the pair loop (AMD; f32_gemv_rows) takes
     * every product (on `intel-2c` a four-row loop already beats the tiles on the down projection: the
     * engine's decode 1.075x). With AVX2 (on `epyc3-2c`, docs/benchmarks.md, two threads) the pair
     * loop takes rows of up to 2048 features, 4-10% faster there than the row loop; longer rows go to
     * the 4-row tiles, whose next-block prefetch streams the down projection (K 4864) at ~35 GB/s
     * against ~29 for the row loop and beats the pair loop by 5%. With AVX2, 1 to STREAM_MAX_TOKENS
     * tokens take the stream tiles (stream_min says why one token does), more the 4-row blocks (see
     * f32_gemm_streams): every output is then the same one-accumulator sum at any batch size. */
    if (a->T == 1 && a->K % 32 == 0 && f32_rows == OCT_ROWS && f32_gemv_rows == OCT_ROWS)
        f32_gemv_octs(a->x, a->w, a->y, a->K, n0, n1);
    else if (stream_takes(a->T, a->K)) f32_gemm_streams(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else if (a->T == 1 && a->K % 32 == 0 && (a->K <= 2048 || f32_rows == OCT_ROWS))
        f32_gemv_pairs(a->x, a->w, a->y, a->K, n0, n1);
    else if (a->T > 1 && a->T <= OCT_TILE_MAX_TOKENS && a->K % 16 == 0 && f32_rows == OCT_ROWS)
        f32_gemm_z8(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else if (a->T > 1 && a->K % 16 == 0 && f32_rows == OCT_ROWS)
        f32_gemm_z_chunks(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else if (a->K % 8 == 0 && (a->T > 1 || a->K > 2048)) flashllm_f32_gemm(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else flashllm_f32_gemv(a->x, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
}

static void w8_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    /* one token with short rows too: the tiles' prefetch reads 9728 x 896 int8 at ~26 GB/s against ~23
     * row at a time; with 4864-feature rows the row loop stays ahead (~22.5 against ~20.5; `epyc3-2c`) */
    if (w8_z_min && a->T >= w8_z_min && a->G == 1 && a->K % 16 == 0)
        w8_gemm_z_chunks(a->x, a->T, a->K, a->w, a->scales, a->y, n0, n1, a->ldy);
    else if (a->T > 1 || a->K <= 2048) flashllm_w8_gemm(a->x, a->T, a->K, a->w, a->scales, a->G, a->y, n0, n1, a->ldy);
    else flashllm_w8_gemv(a->x, a->T, a->K, a->w, a->scales, a->G, a->y, n0, n1, a->ldy);
}

static void w4_share(void *ctx, int64_t n0, int64_t n1) {
    const gemv_args *a = ctx;
    if (a->T > 1) flashllm_w4_gemm(a->x, a->x2, a->T, a->K, a->w, a->scales, a->zeros, a->G, a->y, n0, n1, a->ldy);
    else flashllm_w4_gemv(a->x, a->x2, a->T, a->K, a->w, a->scales, a->zeros, a->G, a->y, n0, n1, a->ldy);
}

void flashllm_f32_gemv_mt(const float *x, const float *w, float *y, int64_t T, int64_t K, int64_t N,
                          int64_t ldy, int threads) {
    gemv_args a = {x, NULL, w, NULL, NULL, y, T, K, 0, ldy};
    flashllm_parallel_for(f32_share, &a, N, threads, stream_takes(T, K) ? STREAM_SHARES : FINE_SHARES);
}

/* fp32 activations at every size (the MoE experts' op promises these numerics) */
void flashllm_w8_gemv_exact_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, int64_t G,
                               float *y, int64_t N, int64_t ldy, int threads) {
    gemv_args a = {x, NULL, w, scales, NULL, y, T, K, G, ldy};
    flashllm_parallel_for(w8_share, &a, N, threads, T > 1 ? FINE_SHARES : COARSE_SHARES);
}

void flashllm_w8_gemv_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, int64_t G,
                         float *y, int64_t N, int64_t ldy, int threads) {
    /* prompts and large batches on AVX512-BF16 CPUs: bf16-rounded activations (w8_bf16.c); where its
     * buffers cannot be allocated the exact tiles run instead */
    if (flashllm_w8_bf16_takes(T, K, G) && flashllm_w8_bf16_mt(x, T, K, w, scales, y, N, ldy, threads) == 0) return;
    flashllm_w8_gemv_exact_mt(x, T, K, w, scales, G, y, N, ldy, threads);
}

void flashllm_w4_gemv_mt(const float *xe, const float *xo, int64_t T, int64_t K, const uint8_t *w,
                         const float *scales, const int32_t *zeros, int64_t G, float *y, int64_t N, int64_t ldy,
                         int threads) {
    gemv_args a = {xe, xo, w, scales, zeros, y, T, K, G, ldy};
    flashllm_parallel_for(w4_share, &a, N, threads, COARSE_SHARES);
}
