/* The greedy screen's scores from an int8 copy of the LM head (flashllm/backends/cpu/greedy_screen.py
 * has the bound and the proof). Each row n is kept as codes q_n (int8, -127..127) and a scale s_n;
 * each token x as integers P_k = m p1_k + p2_k with x ~ (t / m) P, t a power of two >= max |x| / 127,
 * p1 = round(x / t) and p2 = round(m (x / t - p1)), both exact in double. The sum I = sum_k q_k P_k is
 * an exact integer on every path (no term or partial sum reaches 2^31: m is picked for K by the
 * caller), and the score is fl(fl(fl(I) s_n) (t / m)).
 *
 * Half the bytes of the bf16 copy: the head of the 0.5b shape (151936 x 896), read cold by two
 * threads on `intel-2c` (docs/benchmarks.md, interleaved rounds): 4.2-4.4 ms against
 * 8.3-8.5 for the bf16 copy at one token, 4.6-5.0 against 9.5-9.9 at two, 6.9 against 8.9 at five;
 * with AMX-INT8 8.3-10.2 ms against 14-15.4 for the bf16 AMX tiles at 8-16 tokens (scores alone).
 * On `epyc-avx2-2c` (AVX2 only, the AVX2 loops below against the bf16 copy's AVX2 rows and tiles, the
 * same head cold, two threads, medians of 9 interleaved rounds): 5.7 ms against 12.2 at one token,
 * 5.1 against 8.8 at two, 9.9 against 15.5 at five, 13.8 against 23.9 at nine. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "parallel_for.h"

#define I8_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* One token: eight rows an eighth of the share apart (eight read streams, as the bf16 screen's
 * one-token loop reads), 64 codes of each a step widened to int16 in two halves, each stream
 * prefetching I8_AHEAD bytes on into L1 (4.2 against 4.6 ms without, the head above). */
#define I8_ROWS 8
#define I8_AHEAD 512
I8_VNNI static void i8_octs(const int16_t *P, const int8_t *w, const float *scales, float tm, float *y, int64_t K,
                            int64_t n0, int64_t n1) {
    const int64_t q = (n1 - n0) / I8_ROWS;
    for (int64_t i = 0; i < q; i++) {
        const int8_t *r[I8_ROWS];
        __m512i a[I8_ROWS];
        for (int s = 0; s < I8_ROWS; s++) {
            r[s] = w + (n0 + s * q + i) * K;
            a[s] = _mm512_setzero_si512();
        }
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            const __m512i x0 = _mm512_loadu_si512(P + k), x1 = _mm512_loadu_si512(P + k + 32);
            for (int s = 0; s < I8_ROWS; s++) {
                _mm_prefetch((const char *)(r[s] + k) + I8_AHEAD, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(r[s] + k);
                a[s] = _mm512_dpwssd_epi32(a[s], _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v)), x0);
                a[s] = _mm512_dpwssd_epi32(a[s], _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1)), x1);
            }
        }
        if (k < K) {  /* K an odd multiple of 32 */
            const __m512i x0 = _mm512_loadu_si512(P + k);
            for (int s = 0; s < I8_ROWS; s++)
                a[s] = _mm512_dpwssd_epi32(a[s], _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r[s] + k))), x0);
        }
        for (int s = 0; s < I8_ROWS; s++) {
            const int64_t n = n0 + s * q + i;
            y[n] = (float)_mm512_reduce_add_epi32(a[s]) * scales[n] * tm;
        }
    }
    for (int64_t n = n0 + I8_ROWS * q; n < n1; n++) {
        __m512i a = _mm512_setzero_si512();
        for (int64_t k = 0; k < K; k += 32)
            a = _mm512_dpwssd_epi32(a, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + n * K + k))),
                                    _mm512_loadu_si512(P + k));
        y[n] = (float)_mm512_reduce_add_epi32(a) * scales[n] * tm;
    }
}

/* A few tokens: tiles of 4 rows (a quarter of the share apart) x up to 6 tokens in 24 accumulators,
 * 32 codes of a row a step; the first sweep prefetches each row's successor (the layout of the bf16
 * screen's tiles and decode_kernels.c's f32_gemm_z). */
#define I8_TOKENS 6
I8_VNNI __attribute__((always_inline)) static inline void i8_tile(const int16_t *P, int64_t K, const int8_t *w,
                                                                  int64_t rs, int R, int TT, const float *scales,
                                                                  const float *tm, float *y, int64_t ldy, int64_t ys,
                                                                  int64_t ahead) {
    __m512i acc[4][I8_TOKENS];
    for (int r = 0; r < 4; r++) for (int t = 0; t < I8_TOKENS; t++) acc[r][t] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i v[4];
        for (int r = 0; r < R; r++) {
            if (ahead && (k & 63) == 0) _mm_prefetch((const char *)(w + r * rs + k) + ahead, _MM_HINT_T1);
            v[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + r * rs + k)));
        }
        for (int t = 0; t < TT; t++) {
            const __m512i x = _mm512_loadu_si512(P + t * K + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpwssd_epi32(acc[r][t], v[r], x);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++)
            y[t * ldy + r * ys] = (float)_mm512_reduce_add_epi32(acc[r][t]) * scales[r * ys] * tm[t];
}

#define I8_TILE(R, TT)                                                                                           \
    I8_VNNI static void i8_tile_##R##x##TT(const int16_t *P, int64_t K, const int8_t *w, int64_t rs,           \
                                           const float *scales, const float *tm, float *y, int64_t ldy,        \
                                           int64_t ys, int64_t ahead) {                                        \
        i8_tile(P, K, w, rs, R, TT, scales, tm, y, ldy, ys, ahead);                                             \
    }
#define I8_TILES_OF(R) I8_TILE(R, 1) I8_TILE(R, 2) I8_TILE(R, 3) I8_TILE(R, 4) I8_TILE(R, 5) I8_TILE(R, 6)
I8_TILES_OF(4)
I8_TILES_OF(1)
typedef void (*i8_tile_fn)(const int16_t *, int64_t, const int8_t *, int64_t, const float *, const float *, float *,
                           int64_t, int64_t, int64_t);
static const i8_tile_fn I8_TILES_4[I8_TOKENS] = {i8_tile_4x1, i8_tile_4x2, i8_tile_4x3,
                                                 i8_tile_4x4, i8_tile_4x5, i8_tile_4x6};
static const i8_tile_fn I8_TILES_1[I8_TOKENS] = {i8_tile_1x1, i8_tile_1x2, i8_tile_1x3,
                                                 i8_tile_1x4, i8_tile_1x5, i8_tile_1x6};

/* One tile's rows over all T tokens, I8_TOKENS or fewer a sweep, spread evenly */
static void i8_sweeps(const i8_tile_fn *tiles, const int16_t *P, int64_t T, int64_t K, const int8_t *w, int64_t rs,
                      const float *scales, const float *tm, float *y, int64_t ldy, int64_t ys, int64_t ahead) {
    const int64_t sweeps = (T + I8_TOKENS - 1) / I8_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t left = sweeps - sweep, tokens = (T - t) / left + ((T - t) % left != 0);
        tiles[tokens - 1](P + t * K, K, w, rs, scales, tm + t, y + t * ldy, ldy, ys, sweep == 0 ? ahead : 0);
        t += tokens;
    }
}

typedef struct {
    const int16_t *P;
    const int8_t *parts, *w;
    const float *scales, *tm;
    float *y;
    int64_t T, K, ldy, m;
} i8_args;

static void vnni_rows(const i8_args *a, int64_t n0, int64_t n1) {
    if (a->T == 1) {
        i8_octs(a->P, a->w, a->scales, a->tm[0], a->y, a->K, n0, n1);
        return;
    }
    const int64_t q = (n1 - n0) / 4, K = a->K;
    for (int64_t i = 0; i < q; i++)
        i8_sweeps(I8_TILES_4, a->P, a->T, K, a->w + (n0 + i) * K, q * K, a->scales + n0 + i, a->tm, a->y + n0 + i,
                  a->ldy, q, i + 1 < q ? K : 0);
    for (int64_t n = n0 + 4 * q; n < n1; n++)
        i8_sweeps(I8_TILES_1, a->P, a->T, K, a->w + n * K, K, a->scales + n, a->tm, a->y + n, a->ldy, 1, 0);
}

static void vnni_share(void *ctx, int64_t n0, int64_t n1) { vnni_rows(ctx, n0, n1); }

/* ---- AVX2, for CPUs without AVX-512 VNNI: VPMOVSXBW widens 16 codes to int16 and VPMADDWD multiplies
 * them by 16 token integers P, adding pairs into 8 int32 lanes (16 exact products an instruction), which
 * VPADDD adds to the sums. Every term q_k P_k is at most 127 * 127.5 m and any partial sum, a pair's
 * included, is a sum of some of the K terms, so below 127 * 127.5 m K < 2^31 in any order: the same
 * exact I as the VNNI loops (|P| <= 127.5 * 128 also keeps VPMADDWD's one overflow, -2^15 * -2^15
 * twice, out of reach). */
#define AVX2_I8_ROWS 8
#define AVX2_I8_AHEAD 512

/* the sum of a vector's 8 int32 lanes (exact: see above) */
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc + the products of 16 codes at w (widened) with 16 token integers x, pairwise in int32 */
static inline __m256i madd16(__m256i acc, const int8_t *w, __m256i x) {
    const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, x));
}

/* One token: eight rows an eighth of the share apart (eight read streams, as i8_octs), 32 codes of
 * each a step, each stream prefetching AVX2_I8_AHEAD bytes on into L1. */
static void avx2_i8_octs(const int16_t *P, const int8_t *w, const float *scales, float tm, float *y, int64_t K,
                         int64_t n0, int64_t n1) {
    const int64_t q = (n1 - n0) / AVX2_I8_ROWS;
    for (int64_t i = 0; i < q; i++) {
        const int8_t *r[AVX2_I8_ROWS];
        __m256i a[AVX2_I8_ROWS];
        for (int s = 0; s < AVX2_I8_ROWS; s++) {
            r[s] = w + (n0 + s * q + i) * K;
            a[s] = _mm256_setzero_si256();
        }
        for (int64_t k = 0; k < K; k += 32) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(P + k));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(P + k + 16));
            for (int s = 0; s < AVX2_I8_ROWS; s++) {
                if ((k & 63) == 0) _mm_prefetch((const char *)(r[s] + k) + AVX2_I8_AHEAD, _MM_HINT_T0);
                a[s] = madd16(madd16(a[s], r[s] + k, x0), r[s] + k + 16, x1);
            }
        }
        for (int s = 0; s < AVX2_I8_ROWS; s++) {
            const int64_t n = n0 + s * q + i;
            y[n] = (float)hsum8_epi32(a[s]) * scales[n] * tm;
        }
    }
    for (int64_t n = n0 + AVX2_I8_ROWS * q; n < n1; n++) {
        __m256i a = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += 16) a = madd16(a, w + n * K + k, _mm256_loadu_si256((const __m256i *)(P + k)));
        y[n] = (float)hsum8_epi32(a) * scales[n] * tm;
    }
}

/* A few tokens: tiles of 2 rows (half the share apart) x up to 4 tokens; each 16 codes of a row are
 * widened once and meet every token of the sweep, the tokens' integers read from L1 as VPMADDWD's
 * memory operand. The first sweep prefetches each row's successor. Wider tiles spill: GCC keeps
 * 2 x 5, 3 x 3 and 4 x 3 tiles' sums partly on the stack; of the tiles that fit the 16 registers,
 * 2 x 4 ran fastest on `epyc-avx2-2c` (two threads, the head read cold: 151936 x 896 at 5 / 9 / 16
 * tokens 8.7 / 14.4 / 24.4 ms against 11.2 / 18.4 / 26.2 for 4 x 2 and 14.2 / 21.2 / 34.0 for 3 x 2). */
#define AVX2_I8_TILE_ROWS 2
#define AVX2_I8_TOKENS 4
__attribute__((always_inline)) static inline void avx2_i8_tile(const int16_t *P, int64_t K, const int8_t *w,
                                                               int64_t rs, int R, int TT, const float *scales,
                                                               const float *tm, float *y, int64_t ldy, int64_t ys,
                                                               int64_t ahead) {
    __m256i acc[AVX2_I8_TILE_ROWS][AVX2_I8_TOKENS];
    for (int r = 0; r < R; r++) for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
        __m256i v[AVX2_I8_TILE_ROWS];
        for (int r = 0; r < R; r++) {
            if (ahead && (k & 63) == 0) _mm_prefetch((const char *)(w + r * rs + k) + ahead, _MM_HINT_T1);
            v[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + r * rs + k)));
        }
        for (int t = 0; t < TT; t++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(P + t * K + k));
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(v[r], x));
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++)
            y[t * ldy + r * ys] = (float)hsum8_epi32(acc[r][t]) * scales[r * ys] * tm[t];
}

#define AVX2_I8_TILE(R, TT)                                                                                        \
    static void avx2_i8_tile_##R##x##TT(const int16_t *P, int64_t K, const int8_t *w, int64_t rs,                 \
                                        const float *scales, const float *tm, float *y, int64_t ldy, int64_t ys,  \
                                        int64_t ahead) {                                                          \
        avx2_i8_tile(P, K, w, rs, R, TT, scales, tm, y, ldy, ys, ahead);                                           \
    }
#define AVX2_I8_TILES_OF(R) AVX2_I8_TILE(R, 1) AVX2_I8_TILE(R, 2) AVX2_I8_TILE(R, 3) AVX2_I8_TILE(R, 4)
AVX2_I8_TILES_OF(2)
AVX2_I8_TILES_OF(1)
static const i8_tile_fn AVX2_I8_TILES_2[AVX2_I8_TOKENS] = {avx2_i8_tile_2x1, avx2_i8_tile_2x2, avx2_i8_tile_2x3,
                                                           avx2_i8_tile_2x4};
static const i8_tile_fn AVX2_I8_TILES_1[AVX2_I8_TOKENS] = {avx2_i8_tile_1x1, avx2_i8_tile_1x2, avx2_i8_tile_1x3,
                                                           avx2_i8_tile_1x4};

/* One tile's rows over all T tokens, AVX2_I8_TOKENS or fewer a sweep, spread evenly */
static void avx2_i8_sweeps(const i8_tile_fn *tiles, const int16_t *P, int64_t T, int64_t K, const int8_t *w,
                           int64_t rs, const float *scales, const float *tm, float *y, int64_t ldy, int64_t ys,
                           int64_t ahead) {
    const int64_t sweeps = (T + AVX2_I8_TOKENS - 1) / AVX2_I8_TOKENS;
    for (int64_t sweep = 0, t = 0; sweep < sweeps; sweep++) {
        const int64_t left = sweeps - sweep, tokens = (T - t) / left + ((T - t) % left != 0);
        tiles[tokens - 1](P + t * K, K, w, rs, scales, tm + t, y + t * ldy, ldy, ys, sweep == 0 ? ahead : 0);
        t += tokens;
    }
}

static void avx2_share(void *ctx, int64_t n0, int64_t n1) {
    const i8_args *a = ctx;
    if (a->T == 1) {
        avx2_i8_octs(a->P, a->w, a->scales, a->tm[0], a->y, a->K, n0, n1);
        return;
    }
    const int64_t q = (n1 - n0) / AVX2_I8_TILE_ROWS, K = a->K;
    for (int64_t i = 0; i < q; i++)
        avx2_i8_sweeps(AVX2_I8_TILES_2, a->P, a->T, K, a->w + (n0 + i) * K, q * K, a->scales + n0 + i, a->tm,
                       a->y + n0 + i, a->ldy, q, i + 1 < q ? K : 0);
    for (int64_t n = n0 + AVX2_I8_TILE_ROWS * q; n < n1; n++)
        avx2_i8_sweeps(AVX2_I8_TILES_1, a->P, a->T, K, a->w + n * K, K, a->scales + n, a->tm, a->y + n, a->ldy, 1, 0);
}

/* ---- AMX-INT8: TDPBSSD multiplies 16 x 64 int8 by 64 x 16 int8 into 16 x 16 int32 sums. A tile of
 * 16 rows x 64 codes loads straight from the copy; each token goes in as two int8 parts with
 * P = m p1 + p2, two passes into separate sums combined as m I1 + I2 in int64: the I of the VNNI
 * path, exactly. */
/* From six tokens, where the VNNI tiles' work outgrows the read: the head above, cold, 7 interleaved
 * rounds: VNNI 4.7, 5.3, 9.0, 11.0 and 12.9 ms at 4-8 tokens, the tiles 7.0, 6.6, 7.5, 9.1 and 9.1. */
#define I8_AMX_MIN_TOKENS 6
#define I8_AMX_PREFETCH_BLOCKS 2
#ifdef FLASHLLM_AMX
static int amx_int8_usable(void) { return flashllm_amx_usable(1u << 24 | 1u << 25); }

/* The tokens' parts as the tiles' second operand: for each 16-token chunk c, 64-feature block kb and
 * part p (p1, then p2), 16 rows j of 16 tokens x features 4j..4j+3; tokens past T zero;
 * parts + ((c * K / 64 + kb) * 2 + p) * 1024 is one tile. */
static void amx_parts(const int16_t *P, int64_t T, int64_t K, int64_t m, int8_t *parts) {
    const int64_t blocks = K / 64, chunks = (T + 15) / 16;
    memset(parts, 0, (size_t)(chunks * blocks * 2048));
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            /* P = m p1 + p2 again with p1 = floor(P / m) and 0 <= p2 < m: as |P| <= 127.5 m, p1 is
             * within -128..127 (not always quantize_token's p1 and p2, but the same m p1 + p2) */
            const int64_t v = P[t * K + k], p1 = v >= 0 ? v / m : -((m - 1 - v) / m), p2 = v - m * p1;
            int8_t *at = parts + ((t / 16) * blocks + k / 64) * 2048 + (k % 64) / 4 * 64 + (t % 16) * 4 + k % 4;
            at[0] = (int8_t)p1;
            at[1024] = (int8_t)p2;
        }
}

/* Rows n0..n1 in blocks of 16 (the last rows through the VNNI tiles): tiles 0-3 the sums (I1, I2 of
 * each 16-token chunk), 4 the block's codes, 5-6 a chunk's two parts. */
__attribute__((target("amx-tile,amx-int8")))
static void amx_share(void *ctx, int64_t n0, int64_t n1) {
    const i8_args *a = ctx;
    const int64_t K = a->K, blocks = K / 64, chunks = (a->T + 15) / 16;
    flashllm_tiles_16x64(7);
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
        const int8_t *block = a->w + n * K;
        const char *ahead = (const char *)(block + I8_AMX_PREFETCH_BLOCKS * 16 * K);
        const int prefetch = n + (I8_AMX_PREFETCH_BLOCKS + 1) * 16 <= n1;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks; kb++) {
            if (prefetch)
                for (int r = 0; r < 16; r++) _mm_prefetch(ahead + r * K + kb * 64, _MM_HINT_T0);
            _tile_loadd(4, block + kb * 64, K);
            const int8_t *p = a->parts + kb * 2048;
            _tile_loadd(5, p, 64);
            _tile_loadd(6, p + 1024, 64);
            _tile_dpbssd(0, 4, 5);
            _tile_dpbssd(1, 4, 6);
            if (chunks > 1) {
                p += blocks * 2048;
                _tile_loadd(5, p, 64);
                _tile_loadd(6, p + 1024, 64);
                _tile_dpbssd(2, 4, 5);
                _tile_dpbssd(3, 4, 6);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        for (int64_t t = 0; t < a->T; t++)
            for (int r = 0; r < 16; r++) {
                const int c = (int)(t / 16) * 2;
                const int64_t I = a->m * (int64_t)sums[c][r][t % 16] + sums[c + 1][r][t % 16];
                a->y[t * a->ldy + n + r] = (float)I * a->scales[n + r] * a->tm[t];
            }
    }
    _tile_release();
    if (n < n1) vnni_rows(a, n, n1);
}
#else
static int amx_int8_usable(void) { return 0; }
#endif

/* The paths: 0 none (no AVX2), 1 VNNI, 2 VNNI and AMX-INT8 from I8_AMX_MIN_TOKENS tokens, 3 AMX-INT8
 * at any token count (tests and A/B runs), 4 AVX2 (the best on a CPU without AVX-512 VNNI; any AVX2
 * CPU takes it for tests and A/B runs). The best the CPU has (never 3) is set at load. */
#define I8_PATH_AVX2 4
static int i8_path = 0, i8_best = 0, i8_avx2 = 0;
__attribute__((constructor)) static void pick_i8_path(void) {
    __builtin_cpu_init();
    const int vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vnni");
    i8_avx2 = __builtin_cpu_supports("avx2");
    i8_best = i8_path = vnni ? (amx_int8_usable() ? 2 : 1) : i8_avx2 ? I8_PATH_AVX2 : 0;
}

/* Sets the path (one the CPU lacks changes nothing; a negative one only reads); returns the path in use. */
int flashllm_i8_screen_set_path(int path) {
    const int vnni_best = i8_best == 2 ? 3 : i8_best == 1 ? 1 : 0;
    if ((path >= 1 && path <= vnni_best) || (path == I8_PATH_AVX2 && i8_avx2)) i8_path = path;
    return i8_path;
}

/* Bytes of scratch flashllm_i8_screen_mt needs for T tokens of K features. */
int64_t flashllm_i8_screen_scratch(int64_t T, int64_t K) {
    return T * K * (int64_t)sizeof(int16_t) + (T + 15) / 16 * (K / 64) * 2048 + T * (int64_t)sizeof(float) + 64;
}

/* x_t as P = m p1 + p2 (see the top of this file); returns t / m as a float, or NaN where x_t has a
 * value that is not finite (its scores are then NaN: the pick hands that token to the full logits). */
static float quantize_token(const float *x, int64_t K, int64_t m, int16_t *P) {
    float largest = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float v = fabsf(x[k]);
        if (!(v <= 3.4028234663852886e38f)) return NAN;
        largest = v > largest ? v : largest;
    }
    int e = 0;
    frexp((double)largest / 127.0, &e);  /* 2^e > largest / 127 (the quotient rounds to it, never past it) */
    const double t = largest > 0.0f ? ldexp(1.0, e) : 1.0;
    for (int64_t k = 0; k < K; k++) {
        const double v = (double)x[k] / t, p1 = nearbyint(v), p2 = nearbyint((v - p1) * (double)m);
        P[k] = (int16_t)((int64_t)p1 * m + (int64_t)p2);
    }
    return (float)(t / (double)m);
}

/* Whether flashllm_i8_screen_mt takes rows of K features with multiplier m on this CPU. */
int flashllm_i8_screen_takes(int64_t K, int64_t m) {
    return i8_path != 0 && K % 32 == 0 && m >= 1 && m <= 128 && 127.0 * 127.5 * (double)m * (double)K < 2147483648.0;
}

/* y[t * ldy + n] = the int8 copy's score of row n for token t < T (codes (N, K) int8, scales (N,)),
 * with m the tokens' second-part multiplier: a power of two <= 128 with 127 (127.5 m) K < 2^31.
 * K a multiple of 32; scratch: flashllm_i8_screen_scratch(T, K) bytes. Returns 0 without computing
 * anything where this CPU has no int8 path or m does not fit K; 1 where the VNNI loops took the
 * tokens, 2 where the AMX-INT8 tiles did, 4 where the AVX2 loops did (the same scores on all). */
int flashllm_i8_screen_mt(const float *x, int64_t T, int64_t K, const int8_t *codes, const float *scales, float *y,
                          int64_t N, int64_t ldy, int64_t m, void *scratch, int threads) {
    if (!flashllm_i8_screen_takes(K, m)) return 0;
    int16_t *P = scratch;
    int8_t *parts = (int8_t *)(P + T * K);
    float *tm = (float *)(parts + (T + 15) / 16 * (K / 64) * 2048);
    for (int64_t t = 0; t < T; t++) tm[t] = quantize_token(x + t * K, K, m, P + t * K);
    i8_args a = {P, parts, codes, scales, tm, y, T, K, ldy, m};
#ifdef FLASHLLM_AMX
    if (((i8_path == 2 && T >= I8_AMX_MIN_TOKENS) || i8_path == 3) && T <= 32 && K % 64 == 0) {
        amx_parts(P, T, K, m, parts);
        flashllm_parallel_for(amx_share, &a, N, threads, FINE_SHARES);
        return 2;
    }
#endif
    if (i8_path == I8_PATH_AVX2) {
        flashllm_parallel_for(avx2_share, &a, N, threads, FINE_SHARES);
        return I8_PATH_AVX2;
    }
    flashllm_parallel_for(vnni_share, &a, N, threads, FINE_SHARES);
    return 1;
}
