/* Per-channel int8 weights (w8a16, one scale per row) against bf16-rounded activations, for CPUs with
 * AVX512-BF16: the products of prompts and large decode batches on VDPBF16PS.
 *
 * Why: the exact tiles of decode_kernels.c (int8 codes widened to fp32, fp32 FMAs) run this shape's
 * prompts at 155-190 GFLOP/s on a 2-core Zen 4, ~85 % of its fp32 FMA rate, so prefill is compute-bound.
 * VDPBF16PS multiplies 32 bf16 pairs into 16 fp32 sums per instruction, twice the FMA's products.
 *
 * Numerics: an int8 code (-128..127) is exact in bf16 (8 significant bits), and the product of two
 * bf16 values is exact in fp32, so the only rounding beyond the exact tiles' fp32 sums is each
 * activation's, to bf16 (round to nearest even, 8 significant bits; denormal bf16 inputs count as 0).
 * Each output is its own 16 accumulator lanes' sum over K in one order, times its row's scale, so a
 * token's bits depend neither on the other tokens of the call nor on the row split.
 *
 * Layout of the work: the caller rounds the activations to bf16 once (every thread a share of the
 * tokens); each row share converts its rows' codes to bf16 once, a block of rows at a time into a
 * buffer of its thread that stays in the L2, and sweeps each block over the tokens in chunks of
 * BF_CHUNK_TOKENS (a chunk's bf16 activations stay in the L2 too) with 4-row x up-to-6-token tiles
 * (24 of the 32 registers). Both
 * copies pad K with zeros to a multiple of 32, so any K runs here: a tensor-parallel rank's slice of
 * the features takes the same path as the whole weight. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel_for.h"

/* The AVX512-BF16 intrinsics came with GCC 10 and clang 9; older compilers build the exact tiles only. */
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 9)

#define UNROLL _Pragma("GCC unroll 16")
#define BF_TILE_TOKENS 6
#define BF_CHUNK_TOKENS 64
#define BF_ALIGN 64

/* A grow-only buffer of the calling thread (the worker pool's threads live as long as the process). */
static _Thread_local void *act_buf, *row_buf;
static _Thread_local size_t act_cap, row_cap;

static void *grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return *buf;
    void *fresh = aligned_alloc(BF_ALIGN, (bytes + BF_ALIGN - 1) / BF_ALIGN * BF_ALIGN);
    if (!fresh) return NULL;
    free(*buf);
    *buf = fresh;
    *cap = bytes;
    return fresh;
}

/* The fewest tokens whose products run here (0: never, as on CPUs without AVX512-BF16); set at load,
 * flashllm_w8_set_bf16_min changes it (FLASHLLM_CPU_W8_BF16, tests and A/B runs). */
#define W8_BF16_MIN_TOKENS 16
static int bf16_min = 0;
static int bf16_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
__attribute__((constructor)) static void pick_bf16(void) { bf16_min = bf16_cpu() ? W8_BF16_MIN_TOKENS : 0; }

/* Sets the fewest tokens (0 turns the path off; ignored without AVX512-BF16); returns the setting in use. */
int flashllm_w8_set_bf16_min(int tokens) {
    if (tokens >= 0 && bf16_cpu()) bf16_min = tokens;
    return bf16_min;
}

/* Whether flashllm_w8_gemv_mt sends a product of T tokens, K features and G groups here. */
int flashllm_w8_bf16_takes(int64_t T, int64_t K, int64_t G) {
    return bf16_min > 0 && T >= bf16_min && G == 1 && K > 0;
}

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The lanes of a 32-feature block that starts at feature i of K */
static inline uint32_t block_mask(int64_t i, int64_t K) {
    return K - i >= 32 ? 0xffffffffu : (1u << (K - i)) - 1;
}

/* ---- the activations: fp32 rows (K apart) -> bf16 rows (Kp apart, zero-padded; round to nearest even),
 * tokens t0..t1 ---- */
typedef struct {
    const float *x;
    uint16_t *xb;
    int64_t K, Kp;
} round_args;

BF_TARGET static void round_share(void *ctx, int64_t t0, int64_t t1) {
    const round_args *a = ctx;
    for (int64_t t = t0; t < t1; t++) {
        const float *x = a->x + t * a->K;
        for (int64_t i = 0; i < a->Kp; i += 32) {
            const uint32_t m = i < a->K ? block_mask(i, a->K) : 0;
            const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, x + i);
            const __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), x + i + 16);
            _mm512_storeu_si512(a->xb + t * a->Kp + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* ---- the tiles: R rows (rs apart) x TT tokens (K apart), all bf16, K a multiple of 32 ---- */
typedef void (*bftile_fn)(const uint16_t *x, int64_t K, const uint16_t *w, int64_t rs, const float *scales,
                          float *y, int64_t ldy);

#define DEFINE_BF_TILE(NAME, R, TT)                                                               \
BF_TARGET                                                                                         \
static void NAME(const uint16_t *x, int64_t K, const uint16_t *w, int64_t rs, const float *scales, \
                 float *y, int64_t ldy) {                                                        \
    __m512 acc[R][TT];                                                                           \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; k += 32) {                                                        \
        __m512bh xv[TT];                                                                         \
        UNROLL for (int t = 0; t < TT; t++) xv[t] = (__m512bh)_mm512_loadu_si512(x + t * K + k); \
        UNROLL for (int r = 0; r < R; r++) {                                                     \
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * rs + k);                    \
            UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]); \
        }                                                                                        \
    }                                                                                            \
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < TT; t++)                       \
        y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]) * scales[r];                            \
}
#define DEFINE_BF_TILES_OF(R, P) DEFINE_BF_TILE(P##1, R, 1) DEFINE_BF_TILE(P##2, R, 2) DEFINE_BF_TILE(P##3, R, 3) \
    DEFINE_BF_TILE(P##4, R, 4) DEFINE_BF_TILE(P##5, R, 5) DEFINE_BF_TILE(P##6, R, 6)
DEFINE_BF_TILES_OF(4, bftile_4x)
DEFINE_BF_TILES_OF(1, bftile_1x)
static const bftile_fn BFTILES_4[BF_TILE_TOKENS] = {bftile_4x1, bftile_4x2, bftile_4x3, bftile_4x4, bftile_4x5,
                                                    bftile_4x6};
static const bftile_fn BFTILES_1[BF_TILE_TOKENS] = {bftile_1x1, bftile_1x2, bftile_1x3, bftile_1x4, bftile_1x5,
                                                    bftile_1x6};

/* One tile's rows over T tokens, BF_TILE_TOKENS or fewer a sweep, T split as evenly as the sweeps allow
 * (a 1-token tile is load-bound) */
static void bf_sweeps(const bftile_fn *tiles, const uint16_t *x, int64_t T, int64_t K, const uint16_t *w,
                      const float *scales, float *y, int64_t ldy) {
    const int64_t sweeps = (T + BF_TILE_TOKENS - 1) / BF_TILE_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t tokens = (T - t) / (sweeps - sweep) + ((T - t) % (sweeps - sweep) != 0);
        tiles[tokens - 1](x + t * K, K, w, K, scales, y + t * ldy, ldy);
        t += tokens;
    }
}

typedef struct {
    const uint16_t *xb;
    const int8_t *w;
    const float *scales;
    float *y;
    int64_t T, K, Kp, ldy;
    _Atomic int failed;
} product_args;

/* codes (rows x K, int8) -> bf16 rows Kp apart (zero-padded), exactly */
BF_TARGET static void codes_to_bf16(const int8_t *w, int64_t rows, int64_t K, int64_t Kp, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < Kp; i += 32) {
            const uint32_t m = i < K ? block_mask(i, K) : 0;
            const __m256i codes = _mm256_maskz_loadu_epi8((__mmask32)m, w + r * K + i);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
            _mm512_storeu_si512(out + r * Kp + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

/* The bytes of bf16 rows a share converts at once: they stay in the L2 beside a chunk's activations, and a
 * share as large as the whole weight (one thread, or a second concurrent caller) needs no more memory. */
#define BF_BLOCK_BYTES (192 * 1024)

/* Rows n0..n1 in blocks of a few rows: a block's codes to bf16 once, then every chunk of tokens over
 * 4-row tiles (the last rows one at a time). A share whose buffer cannot be allocated marks the call
 * failed and leaves its rows. */
static void product_share(void *ctx, int64_t n0, int64_t n1) {
    product_args *a = ctx;
    const int64_t K = a->Kp;  /* the copies' row length */
    int64_t block = BF_BLOCK_BYTES / (K * (int64_t)sizeof(uint16_t)) / 4 * 4;
    block = block < 4 ? 4 : block;
    uint16_t *wb = grow(&row_buf, &row_cap, (size_t)(block * K) * sizeof(uint16_t));
    if (!wb) {
        a->failed = 1;
        return;
    }
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t rows = n1 - b0 < block ? n1 - b0 : block, quads = rows / 4;
        codes_to_bf16(a->w + b0 * a->K, rows, a->K, K, wb);
        for (int64_t t0 = 0; t0 < a->T; t0 += BF_CHUNK_TOKENS) {
            const int64_t T = a->T - t0 < BF_CHUNK_TOKENS ? a->T - t0 : BF_CHUNK_TOKENS;
            const uint16_t *x = a->xb + t0 * K;
            float *y = a->y + t0 * a->ldy + b0;
            for (int64_t i = 0; i < quads; i++)
                bf_sweeps(BFTILES_4, x, T, K, wb + 4 * i * K, a->scales + b0 + 4 * i, y + 4 * i, a->ldy);
            for (int64_t r = 4 * quads; r < rows; r++)
                bf_sweeps(BFTILES_1, x, T, K, wb + r * K, a->scales + b0 + r, y + r, a->ldy);
        }
    }
}

/* y[t * ldy + n] = scales[n] * sum_k bf16(x[t * K + k]) * w[n * K + k] for t < T, n < N, one scale per
 * row. Returns 0, -1 where this CPU lacks AVX512-BF16 or T or K is not positive, -2 where a buffer could not
 * be allocated (y then incomplete: the caller runs the exact tiles instead). */
int flashllm_w8_bf16_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, float *y,
                        int64_t N, int64_t ldy, int threads) {
    if (!bf16_cpu() || K <= 0 || T <= 0) return -1;
    const int64_t Kp = (K + 31) / 32 * 32;
    uint16_t *xb = grow(&act_buf, &act_cap, (size_t)(T * Kp) * sizeof(uint16_t));
    if (!xb) return -2;
    round_args r = {x, xb, K, Kp};
    flashllm_parallel_items(round_share, &r, T, T * K >= (1 << 16) ? threads : 1, 1);
    product_args a = {xb, w, scales, y, T, K, Kp, ldy, 0};
    flashllm_parallel_for(product_share, &a, N, threads, FINE_SHARES);
    return a.failed ? -2 : 0;
}

#else
int flashllm_w8_set_bf16_min(int tokens) { (void)tokens; return 0; }
int flashllm_w8_bf16_takes(int64_t T, int64_t K, int64_t G) { (void)T; (void)K; (void)G; return 0; }
int flashllm_w8_bf16_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales, float *y,
                        int64_t N, int64_t ldy, int threads) {
    (void)x; (void)T; (void)K; (void)w; (void)scales; (void)y; (void)N; (void)ldy; (void)threads;
    return -1;
}
#endif
