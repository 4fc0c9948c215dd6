/* The cpu backend's screened greedy LM head (flashllm/backends/cpu/greedy_screen.py has the proof).
 *
 * A greedy step needs only each token's argmax over the vocabulary, not its logits. The LM head is
 * the largest product of a small model's step (136 M of the 0.5b shape's 494 M weights), so it is
 * read first as a bf16 copy, half the bytes, made fp32 in registers (flashllm_bf16_gemv_mt):
 * a score per row within a known bound of that row's fp32 logit. flashllm_screen_pick
 * (screen_pick.c) then keeps the rows whose score, plus the bound, reaches the best score less its
 * bound (the fp32 argmax is always one of them) and computes only those rows' logits in fp32, in
 * one fixed order per row. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "parallel_for.h"
#include "simd.h"

#ifdef FLASHLLM_AMX
#define SCREEN_AMX 1
#include <stdlib.h>
#endif

/* The weights' layout: each 32-bit lane of a row holds features 2i (low half) and 2i + 1 (high half)
 * as bf16, so one AND and one shift make both exact fp32 vectors: the odd features are the lane with
 * its low half cleared, the even ones the lane shifted up 16. The tokens come deinterleaved to meet
 * them (xe: each token's even features, xo: its odd ones, K / 2 apart). Against widening 16 bf16 at a
 * time (zero-extend then shift) this halves the extra instructions per weight, which share the FMA
 * ports: with the widening, the 4 x 6 tiles run 16 tokens no faster than the fp32 tiles (`intel-2c`,
 * docs/benchmarks.md). */
#define EVEN8(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define ODD8(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)))
#define EVEN16(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define ODD16(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))

/* Any CPU with AVX2: each row against every token while it sits in L1; 32 features a step in four
 * 8-lane chains (even and odd features of two 16-feature halves). K a multiple of 32. */
static void bf16_rows(const float *xe, const float *xo, const uint16_t *w, float *y, int64_t T, int64_t K,
                      int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t half = K / 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *et = xe + t * half, *ot = xo + t * half;
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t i = 0; i < half; i += 16) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(row + 2 * i));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(row + 2 * i + 16));
                a[0] = _mm256_fmadd_ps(EVEN8(v0), _mm256_loadu_ps(et + i), a[0]);
                a[1] = _mm256_fmadd_ps(ODD8(v0), _mm256_loadu_ps(ot + i), a[1]);
                a[2] = _mm256_fmadd_ps(EVEN8(v1), _mm256_loadu_ps(et + i + 8), a[2]);
                a[3] = _mm256_fmadd_ps(ODD8(v1), _mm256_loadu_ps(ot + i + 8), a[3]);
            }
            y[t * ldy + n] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        }
    }
}

/* AVX2, 2 to AVX2_TILE_MAX_TOKENS tokens (a speculative verify step's 1 + k rows, a small decode
 * batch): the rows above load each weight line once per token, and past two tokens the whole fp32
 * head ran instead. These tiles hold 4 rows (a quarter of the share apart, so four streams) x 2
 * tokens: 8 accumulators, each token's even and odd features (4), one row's two halves and the mask
 * fit the 16 registers, and each line of the copy meets every token of a sweep while in L1 (the
 * first sweep prefetches AVX2_TILE_AHEAD bytes on in each stream). On `epyc-avx2-2c`
 * (docs/benchmarks.md), SmolLM2-135M's 49152 x 576 head from random tokens, two threads, screen and
 * pick against the fp32 products (decode_kernels.c) and their argmax, interleaved, medians of 13, two
 * runs: 1.9-2.0 ms against 3.0 for the rows at 2 tokens; 3.5-4.1 against 3.8-4.8 at 3, 4.2-5.9
 * against 5.9-7.1 at 5, 5.8-8.7 against 7.5-9.7 at 9; at 16 and 32 tokens, where the fp32 4-row
 * blocks sweep 3 tokens at a time, 10.1-12.5 against 11.6-11.8 and 17.2-23.7 against 18.1-19.6, so
 * larger batches keep the fp32 head. A score is one FMA chain per row and token (even, then odd
 * features, 16 at a time), within the same bound as the rows' four chains. */
#define AVX2_TILE_ROWS 4
#define AVX2_TILE_TOKENS 2
#define AVX2_TILE_MAX_TOKENS 9
#define AVX2_TILE_AHEAD 1024
static int avx2_tile_max = AVX2_TILE_MAX_TOKENS;

/* Sets the most tokens the AVX2 tiles take (0: none, the rows then take at most AVX2_MAX_TOKENS;
 * 2 to AVX2_TILE_MAX_TOKENS; anything else changes nothing) and returns the setting in use afterwards,
 * for tests and A/B runs. */
int flashllm_screen_set_avx2_tiles(int tokens) {
    if (tokens == 0 || (tokens > 1 && tokens <= AVX2_TILE_MAX_TOKENS)) avx2_tile_max = tokens;
    return avx2_tile_max;
}

/* One sweep of TT tokens (deinterleaved, half = K / 2 apart) over R rows, sums into ys[r][t * ldy] */
__attribute__((always_inline))
static inline void bf16_avx2_pass(const float *xe, const float *xo, int64_t half, const uint16_t *const *rows, int R,
                                  int TT, float *const *ys, int64_t ldy, int64_t pf) {
    __m256 acc[AVX2_TILE_ROWS][AVX2_TILE_TOKENS];
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < half; i += 8) {
        if (pf && (i & 15) == 0) for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rows[r] + 2 * i) + pf, _MM_HINT_T0);
        __m256 e[AVX2_TILE_TOKENS], o[AVX2_TILE_TOKENS];
        for (int t = 0; t < TT; t++) {
            e[t] = _mm256_loadu_ps(xe + t * half + i);
            o[t] = _mm256_loadu_ps(xo + t * half + i);
        }
        for (int r = 0; r < R; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(rows[r] + 2 * i));
            const __m256 ev = EVEN8(v), ov = ODD8(v);
            for (int t = 0; t < TT; t++) {
                acc[r][t] = _mm256_fmadd_ps(ev, e[t], acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(ov, o[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) ys[r][t * ldy] = hsum8(acc[r][t]);
}

/* R rows against all T tokens, AVX2_TILE_TOKENS or fewer a sweep, spread evenly */
__attribute__((always_inline))
static inline void bf16_avx2_sweeps(const float *xe, const float *xo, int64_t T, int64_t K, const uint16_t *const *rows,
                                    int R, float *const *ys, int64_t ldy, int64_t pf) {
    const int64_t half = K / 2, sweeps = (T + AVX2_TILE_TOKENS - 1) / AVX2_TILE_TOKENS;
    float *at[AVX2_TILE_ROWS];
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t left = sweeps - sweep, tokens = (T - t) / left + ((T - t) % left != 0);
        for (int r = 0; r < R; r++) at[r] = ys[r] + t * ldy;
        if (tokens == 2) bf16_avx2_pass(xe + t * half, xo + t * half, half, rows, R, 2, at, ldy, sweep == 0 ? pf : 0);
        else bf16_avx2_pass(xe + t * half, xo + t * half, half, rows, R, 1, at, ldy, sweep == 0 ? pf : 0);
        t += tokens;
    }
}

/* Rows n0..n1 for T tokens: rows n0 + s * q + i (s < 4, q a quarter of the rows) together, then the
 * last rows one at a time */
static void bf16_avx2_tiles(const float *xe, const float *xo, const uint16_t *w, float *y, int64_t T, int64_t K,
                            int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t q = (n1 - n0) / AVX2_TILE_ROWS;
    for (int64_t i = 0; i < q; i++) {
        const uint16_t *rows[AVX2_TILE_ROWS];
        float *ys[AVX2_TILE_ROWS];
        for (int s = 0; s < AVX2_TILE_ROWS; s++) {
            rows[s] = w + (n0 + s * q + i) * K;
            ys[s] = y + n0 + s * q + i;
        }
        bf16_avx2_sweeps(xe, xo, T, K, rows, AVX2_TILE_ROWS, ys, ldy, AVX2_TILE_AHEAD);
    }
    for (int64_t n = n0 + AVX2_TILE_ROWS * q; n < n1; n++) {
        const uint16_t *rows[1] = {w + n * K};
        float *ys[1] = {y + n};
        bf16_avx2_sweeps(xe, xo, T, K, rows, 1, ys, ldy, 0);
    }
}

/* AVX-512, one token: eight rows an eighth of the share apart at once (eight read streams, as the
 * fp32 one-token loop in decode_kernels.c reads), 32 features of each a step in two 16-lane chains,
 * each stream prefetching SCREEN_AHEAD bytes on into L1. Why the prefetch here, where the fp32 loop
 * has none (`intel-2c`, docs/benchmarks.md, one token, two threads): the head's 151936 x 896 copy,
 * read cold, runs 1.09-1.16x the loop without it (768 B to 2 KiB ahead alike; a T1 hint 1.0x, NTA
 * 0.45x) and the engine's batch-1 decode 1.07x, while the same prefetch slows the fp32 loop's 97
 * products of a token to 0.92-0.93x. Prefetches past a stream's end touch the next stream's rows or
 * nothing (they never fault). */
#define SCREEN_ROWS 8
#define SCREEN_AHEAD 1024
__attribute__((target("avx512f")))
static void bf16_octs(const float *xe, const float *xo, const uint16_t *w, float *y, int64_t K, int64_t n0,
                      int64_t n1) {
    const int64_t q = (n1 - n0) / SCREEN_ROWS, half = K / 2;
    for (int64_t i = 0; i < q; i++) {
        const uint16_t *r[SCREEN_ROWS];
        __m512 a[SCREEN_ROWS][2];
        for (int s = 0; s < SCREEN_ROWS; s++) {
            r[s] = w + (n0 + s * q + i) * K;
            a[s][0] = a[s][1] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 e = _mm512_loadu_ps(xe + j), o = _mm512_loadu_ps(xo + j);
            for (int s = 0; s < SCREEN_ROWS; s++) {
                _mm_prefetch((const char *)(r[s] + 2 * j) + SCREEN_AHEAD, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(r[s] + 2 * j);
                a[s][0] = _mm512_fmadd_ps(EVEN16(v), e, a[s][0]);
                a[s][1] = _mm512_fmadd_ps(ODD16(v), o, a[s][1]);
            }
        }
        for (int s = 0; s < SCREEN_ROWS; s++) y[n0 + s * q + i] = _mm512_reduce_add_ps(_mm512_add_ps(a[s][0], a[s][1]));
    }
    for (int64_t n = n0 + SCREEN_ROWS * q; n < n1; n++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t j = 0; j < half; j += 16) {
            const __m512i v = _mm512_loadu_si512(w + n * K + 2 * j);
            a0 = _mm512_fmadd_ps(EVEN16(v), _mm512_loadu_ps(xe + j), a0);
            a1 = _mm512_fmadd_ps(ODD16(v), _mm512_loadu_ps(xo + j), a1);
        }
        y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/* AVX-512, a few tokens: tiles of 4 rows (a quarter of the share apart) x up to 6 tokens in 24
 * accumulators, each weight line meeting every token of the sweep; the first sweep prefetches each
 * row's successor (the layout of decode_kernels.c's f32_gemm_z). */
#define SCREEN_TOKENS 6
__attribute__((target("avx512f"), always_inline))
static inline void bf16_tile(const float *xe, const float *xo, int64_t K, const uint16_t *w, int64_t rs, int R,
                             int TT, float *y, int64_t ldy, int64_t ys, int64_t ahead) {
    const int64_t half = K / 2;
    __m512 acc[4][SCREEN_TOKENS];
    for (int r = 0; r < 4; r++) for (int t = 0; t < SCREEN_TOKENS; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; j += 16) {
        __m512i v[4];
        for (int r = 0; r < R; r++) {
            if (ahead) _mm_prefetch((const char *)(w + r * rs + 2 * j) + ahead, _MM_HINT_T1);
            v[r] = _mm512_loadu_si512(w + r * rs + 2 * j);
        }
        for (int t = 0; t < TT; t++) {
            const __m512 e = _mm512_loadu_ps(xe + t * half + j);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(EVEN16(v[r]), e, acc[r][t]);
        }
        for (int t = 0; t < TT; t++) {
            const __m512 o = _mm512_loadu_ps(xo + t * half + j);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(ODD16(v[r]), o, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) y[t * ldy + r * ys] = _mm512_reduce_add_ps(acc[r][t]);
}

/* bf16_tile's R and TT fixed at compile time, so the loops unroll and the accumulators stay in registers */
#define SCREEN_TILE(R, TT)                                                                                     \
    __attribute__((target("avx512f"))) static void bf16_tile_##R##x##TT(const float *xe, const float *xo,      \
        int64_t K, const uint16_t *w, int64_t rs, float *y, int64_t ldy, int64_t ys, int64_t ahead) {          \
        bf16_tile(xe, xo, K, w, rs, R, TT, y, ldy, ys, ahead);                                                 \
    }
#define SCREEN_TILES_OF(R) SCREEN_TILE(R, 1) SCREEN_TILE(R, 2) SCREEN_TILE(R, 3) SCREEN_TILE(R, 4) \
    SCREEN_TILE(R, 5) SCREEN_TILE(R, 6)
SCREEN_TILES_OF(4)
SCREEN_TILES_OF(1)
typedef void (*screen_tile_fn)(const float *, const float *, int64_t, const uint16_t *, int64_t, float *, int64_t,
                               int64_t, int64_t);
static const screen_tile_fn TILES_4[SCREEN_TOKENS] = {bf16_tile_4x1, bf16_tile_4x2, bf16_tile_4x3,
                                                      bf16_tile_4x4, bf16_tile_4x5, bf16_tile_4x6};
static const screen_tile_fn TILES_1[SCREEN_TOKENS] = {bf16_tile_1x1, bf16_tile_1x2, bf16_tile_1x3,
                                                      bf16_tile_1x4, bf16_tile_1x5, bf16_tile_1x6};

/* One tile's rows over all T tokens, SCREEN_TOKENS or fewer a sweep, spread evenly; the first sweep
 * prefetches `ahead` bytes on from each row (0: none). */
static void tile_sweeps(const screen_tile_fn *tiles, const float *xe, const float *xo, int64_t T, int64_t K,
                        const uint16_t *w, int64_t rs, float *y, int64_t ldy, int64_t ys, int64_t ahead) {
    const int64_t sweeps = (T + SCREEN_TOKENS - 1) / SCREEN_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t left = sweeps - sweep, tokens = (T - t) / left + ((T - t) % left != 0);
        tiles[tokens - 1](xe + t * K / 2, xo + t * K / 2, K, w, rs, y + t * ldy, ldy, ys, sweep == 0 ? ahead : 0);
        t += tokens;
    }
}

static void bf16_quads(const float *xe, const float *xo, const uint16_t *w, float *y, int64_t T, int64_t K,
                       int64_t n0, int64_t n1, int64_t ldy) {
    const int64_t q = (n1 - n0) / 4, row_bytes = K * (int64_t)sizeof(uint16_t);
    for (int64_t i = 0; i < q; i++)
        tile_sweeps(TILES_4, xe, xo, T, K, w + (n0 + i) * K, q * K, y + n0 + i, ldy, q, i + 1 < q ? row_bytes : 0);
    for (int64_t n = n0 + 4 * q; n < n1; n++) tile_sweeps(TILES_1, xe, xo, T, K, w + n * K, K, y + n, ldy, 1, 0);
}

/* ---- AMX: the scores as bf16 tile products, for CPUs with AMX-BF16 ----
 * TDPBF16PS multiplies 16 x 32 bf16 by 32 x 16 bf16 into 16 x 16 fp32 sums. The copy's rows are
 * already bf16, so a tile of 16 rows x 32 features loads straight from it; each token is split
 * x = hi + lo + e with hi its top 16 bits, lo the top 16 bits of x - hi (exact), |e| < 2^-14 |x|,
 * and the two parts go through the tiles as two passes into the same sums. Every product of two
 * bf16 values is exact in fp32, and the tile unit adds them in fp32 with round-to-nearest, taking
 * subnormal inputs as zero and flushing subnormal sums: the score is within
 * (2^-8 + 2^-13 + 2.01 gamma_2K) sum |x| |w| of the fp32 logit (greedy_screen.py states the bound).
 * On `intel-2c` (docs/benchmarks.md, two threads) the tiles take the scores of 151936 x 896 in ~16 ms
 * at 16 tokens against ~32 for the AVX-512 tiles, about the same at 8 tokens and 1.05-1.8x longer at
 * 1 to 4, so they take AMX_MIN_TOKENS and more. The process asks the
 * kernel for tile permission when the library loads (pick_screen_path). */
#define AMX_MIN_TOKENS 8
#define AMX_MAX_TOKENS 32  /* two 16-token column tiles */
#define AMX_PREFETCH_BLOCKS 2  /* the next rows to prefetch: this many 16-row blocks on */
#ifdef SCREEN_AMX
/* AMX-TILE and AMX-BF16, and the kernel's permission (asked once, by pick_screen_path when the
 * library loads) */
static int amx_usable(void) { return flashllm_amx_usable(1u << 22 | 1u << 24); }

/* The tokens' parts as the tiles' second operand: for each 16-token column chunk c, 32-feature block
 * kb and part p (hi, then lo), 16 rows j of 16 tokens x (feature 2j, feature 2j + 1), tokens past T
 * zero; parts + ((c * K / 32 + kb) * 2 + p) * 512 is one tile. */
static void amx_token_parts(const float *x, int64_t T, int64_t K, uint16_t *parts) {
    const int64_t blocks = K / 32, chunks = (T + 15) / 16;
    memset(parts, 0, (size_t)(chunks * blocks * 1024) * sizeof(uint16_t));
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            uint32_t u, hi, lo;
            float rest;
            memcpy(&u, x + t * K + k, 4);
            hi = u & 0xFFFF0000u;
            memcpy(&rest, &hi, 4);
            rest = x[t * K + k] - rest;  /* exact: the bits below hi's */
            memcpy(&lo, &rest, 4);
            uint16_t *at = parts + ((t / 16) * blocks + k / 32) * 1024 + (k % 32) / 2 * 32 + (t % 16) * 2 + k % 2;
            at[0] = (uint16_t)(hi >> 16);
            at[512] = (uint16_t)(lo >> 16);
        }
}

typedef struct {
    const uint16_t *parts, *w;
    float *y;
    int64_t T, K, ldy;
} amx_args;

/* Rows n0..n1 in blocks of 16 (a last block of fewer rows from a zero-padded copy): tile 0 (and 1,
 * for tokens 16..31) the sums, 2 the block's rows, 3-4 (5-6) the tokens' hi and lo parts. */
__attribute__((target("amx-tile,amx-bf16")))
static void amx_share(void *ctx, int64_t n0, int64_t n1) {
    const amx_args *a = ctx;
    const int64_t K = a->K, blocks = K / 32, chunks = (a->T + 15) / 16, stride = K * (int64_t)sizeof(uint16_t);
    flashllm_tiles_16x64(7);
    float sums[2][16][16] __attribute__((aligned(64)));
    uint16_t *padded = NULL;
    for (int64_t n = n0; n < n1; n += 16) {
        const int64_t rows = n1 - n < 16 ? n1 - n : 16;
        const uint16_t *block = a->w + n * K;
        if (rows < 16) {
            padded = padded ? padded : calloc((size_t)(16 * K), sizeof(uint16_t));
            if (!padded) abort();
            memcpy(padded, block, (size_t)(rows * K) * sizeof(uint16_t));
            block = padded;
        }
        const char *ahead = (const char *)(block + AMX_PREFETCH_BLOCKS * 16 * K);
        const int prefetch = rows == 16 && n + (AMX_PREFETCH_BLOCKS + 1) * 16 <= n1;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < blocks; kb++) {
            if (prefetch)
                for (int r = 0; r < 16; r++) _mm_prefetch(ahead + r * stride + kb * 64, _MM_HINT_T0);
            _tile_loadd(2, block + kb * 32, stride);
            const uint16_t *p = a->parts + kb * 1024;
            _tile_loadd(3, p, 64);
            _tile_loadd(4, p + 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(0, 2, 4);
            if (chunks > 1) {
                p += blocks * 1024;
                _tile_loadd(5, p, 64);
                _tile_loadd(6, p + 512, 64);
                _tile_dpbf16ps(1, 2, 5);
                _tile_dpbf16ps(1, 2, 6);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        for (int64_t t = 0; t < a->T; t++)
            for (int64_t r = 0; r < rows; r++) a->y[t * a->ldy + n + r] = sums[t / 16][r][t % 16];
    }
    _tile_release();
    free(padded);
}
#else
static int amx_usable(void) { return 0; }
#endif

/* The paths: 0 AVX2 (rows, or tiles for 2+ tokens), 1 AVX-512, 2 AMX from AMX_MIN_TOKENS tokens (AVX-512 below), 3 AMX at any
 * token count (tests and A/B runs). The best the CPU has below 3 is set at load; flashllm_screen_set_path. */
static int screen_path = 0, best_path = 0;
__attribute__((constructor)) static void pick_screen_path(void) {
    __builtin_cpu_init();
    best_path = screen_path = !__builtin_cpu_supports("avx512f") ? 0 : amx_usable() ? 2 : 1;
}

/* Sets the path (for tests and A/B runs; one the CPU lacks changes nothing); returns the path in use. */
int flashllm_screen_set_path(int path) {
    if (path >= 0 && path <= (best_path == 2 ? 3 : best_path)) screen_path = path;
    return screen_path;
}

typedef struct {
    const float *xe, *xo;
    const uint16_t *w;
    float *y;
    int64_t T, K, ldy;
} screen_args;

static void screen_share(void *ctx, int64_t n0, int64_t n1) {
    const screen_args *a = ctx;
    if (screen_path >= 1 && a->T == 1) bf16_octs(a->xe, a->xo, a->w, a->y, a->K, n0, n1);
    else if (screen_path >= 1) bf16_quads(a->xe, a->xo, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else if (a->T > 1 && a->T <= avx2_tile_max) bf16_avx2_tiles(a->xe, a->xo, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
    else bf16_rows(a->xe, a->xo, a->w, a->y, a->T, a->K, n0, n1, a->ldy);
}

/* The most tokens the AVX2 rows take without the AVX2 tiles: past two tokens they lose to the fp32
 * AVX2 tiles, which load a weight once for 3 tokens (16 rows of 151936 x 896 on `intel-2c` with
 * AVX-512 off, two threads: 20 ms against 27 at one token, 26 against 27 at two, 37 against 28 at four). */
#define AVX2_MAX_TOKENS 2

/* Whether flashllm_bf16_gemv_mt takes T tokens on this CPU's path. */
int flashllm_bf16_screen_takes(int64_t T) { return !(screen_path == 0 && T > AVX2_MAX_TOKENS && T > avx2_tile_max); }

/* y[t * ldy + n] ~ sum_k x[t * K + k] * fp32(w[n * K + k]) for t < T, n < N: w holds bf16 bit
 * patterns. K a multiple of 32; scratch: 16 * ceil(T / 16) * K floats. Returns 0 without computing
 * anything where this CPU's path does not take T tokens (AVX2_MAX_TOKENS); 1 where each sum is an
 * fp32 FMA chain of x against the weights (x deinterleaved into scratch); 2 where the AMX tiles took
 * them (x split into scratch; a looser bound, see the AMX section). */
int flashllm_bf16_gemv_mt(const float *x, const uint16_t *w, float *y, int64_t T, int64_t K, int64_t N,
                          int64_t ldy, float *scratch, int threads) {
    if (!flashllm_bf16_screen_takes(T)) return 0;
#ifdef SCREEN_AMX
    if (((screen_path == 2 && T >= AMX_MIN_TOKENS) || screen_path == 3) && T <= AMX_MAX_TOKENS) {
        amx_token_parts(x, T, K, (uint16_t *)scratch);
        amx_args a = {(const uint16_t *)scratch, w, y, T, K, ldy};
        flashllm_parallel_for(amx_share, &a, N, threads, FINE_SHARES);
        return 2;
    }
#endif
    const int64_t half = K / 2;
    float *xe = scratch, *xo = scratch + T * half;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            xe[t * half + i] = x[t * K + 2 * i];
            xo[t * half + i] = x[t * K + 2 * i + 1];
        }
    screen_args a = {xe, xo, w, y, T, K, ldy};
    flashllm_parallel_for(screen_share, &a, N, threads, FINE_SHARES);
    return 1;
}
