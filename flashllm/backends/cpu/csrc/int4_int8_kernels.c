/* int4 weights against int8 activations: the cpu backend's default decode product for w4a16 (and,
 * at the end of this file, int8 weights against them: w8a16's opt-in one).
 *
 * Why: dequantizing int4 codes to fp32 (unpack, subtract the zero point, convert, FMA) costs more
 * instructions per weight than widening int8 codes, so the exact fp32 int4 kernel in
 * decode_kernels.c is compute-bound and no faster than int8 per token on AVX2, though it reads
 * half the bytes. Here each token's activations are quantized to int8 (symmetric, one fp32 scale
 * per block of 64 features) and the codes meet them in integer multiply-adds (vpmaddubsw, 32 code
 * x activation products per instruction, then vpmaddwd), as llama.cpp's Q4 x Q8 dot products and
 * IPEX's INT8 compute mode do. The only approximation is the activations' rounding: at most half
 * a step, absmax / 254, per feature. FLASHLLM_CPU_INT4_ACTIVATIONS=fp32 keeps the exact kernel
 * (flashllm/backends/cpu/native.py decides).
 *
 * Layout: the int4 weight w (N, K/2) bytes, byte i = code 2i (low nibble) | code 2i + 1 (high),
 * codes 0..15, zero points zeros (N, G) int32 (NULL: 8), scales (N, G) fp32. A block of 64
 * features is 32 bytes of a row: its low nibbles are the even features, its high ones the odd. The
 * quantized activations of block b of token t are stored as those even features then the odd ones,
 * so one 32-byte load of codes, split into nibbles, lines up with two 32-byte loads of activations.
 *
 * Per row n and token t, with d[t, b] the activation scale of block b and q the int8 activations:
 *   y = sum_g scales[n, g] * (sum_{b in g} d[t, b] * sum_{k in b} code[n, k] * q[t, k]
 *                             - zero[n, g] * sum_{b in g} d[t, b] * sum_{k in b} q[t, k])
 * The inner sums are exact integers (at most 64 * 15 * 127 < 2^24, so their fp32 conversion is
 * exact too); the zero-point term is one product per group, from per-token sums computed once. The
 * decode body for flashllm's own activations (flash_rows) adds those terms into a token's lanes
 * before their one horizontal sum; every body keeps each token's bits independent of the others'.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel_for.h"
#include "simd.h"

#define A8_BLOCK 64  /* features per activation step: 32 bytes of int4 codes */
#define A8_HALF 32   /* features per stored activation scale (d): two per A8_BLOCK */
#define A8_SUPER 256 /* features per llama.cpp q8_K block (its K-quants' activations) */
/* How activations become int8 codes and scales (afmt). A8_FLASH: flashllm's own, one fp32 scale
 * absmax / 127 per 64 features. The others are llama.cpp's CPU rounding for GGUF weights (its
 * quantize_row_q8_0 / q8_1 / q8_K), so that a product equals what llama.cpp computes up to the fp32
 * order of its sums: A8_Q8_0 (Q4_0, Q5_0, Q8_0 weights) one scale per 32 features, absmax / 127
 * rounded to fp16; A8_Q8_1 (Q4_1, Q5_1) the same, and each 32 features' sum of codes times the fp32
 * scale is rounded to fp16 too (llama.cpp's s, which meets the weights' minimums); A8_Q8_K (the
 * K-quants) one fp32 scale 1 / (127 / absmax) per 256 features. Codes are round-half-even(x * (127 /
 * absmax)) in every format (the sign of q8_K's scale cancels). */
enum { A8_FLASH = 0, A8_Q8_0 = 1, A8_Q8_1 = 2, A8_Q8_K = 3 };
/* Rows are read in order, one line per two blocks, and the hardware prefetcher alone leaves DRAM
 * half idle: 9728 x 896 codes take 0.45 ms for one token on `epyc3-2c` (docs/benchmarks.md), 0.33 ms
 * when each step prefetches the line this far ahead (512 to 4096 bytes alike, within noise). */
#define PREFETCH_AHEAD 1024
/* Activations of at least this many features (tokens x K) are quantized on every thread */
#define QUANTIZE_SPLIT_FEATURES (1 << 16)


/* v rounded to the nearest fp16, as an fp32 (llama.cpp stores its q8_0 / q8_1 scales as fp16) */
__attribute__((target("f16c"))) static inline float fp16_rounded(float v) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT)));
}

/* One block of 64 features v -> out (64 int8; with split, the even features then the odd ones, for
 * the int4 codes' nibbles; else in order, for int8 codes) and d[0], d[1] (the scales of features
 * 0..31 and 32..63), adding each group's share of the activations' sum to qsum (the token's G group
 * sums: groups of 16 or 32 features (GGUF's) lie within a block, groups of a multiple of 64 span
 * whole blocks): d * sum q, or for A8_Q8_1 fp16(fp32 scale * sum q). The scales follow afmt (see
 * its enum; kmax is the absmax of the 256 features around the block for A8_Q8_K); a feature becomes
 * round-to-nearest-even(v * (127 / absmax)), an all-zero block scale 0 and codes 0. With residual
 * (64 floats; A8_FLASH only), v - code * d rounded once (fused) goes there: what a second term
 * quantizes. */
static void quantize_block(const float *v, int64_t b, int64_t group, int8_t *out, float *d, float *qsum, int split,
                           float *residual, int afmt, float kmax) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    float amax[2], inverse[2], exact[2];
    if (afmt == A8_Q8_K) {
        amax[0] = amax[1] = kmax;
    } else {
        __m256 top0 = _mm256_setzero_ps(), top1 = _mm256_setzero_ps();
        for (int i = 0; i < A8_HALF; i += 8) {
            top0 = _mm256_max_ps(top0, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
            top1 = _mm256_max_ps(top1, _mm256_and_ps(_mm256_loadu_ps(v + A8_HALF + i), magnitude));
        }
        if (afmt == A8_FLASH) {
            amax[0] = amax[1] = hmax8(_mm256_max_ps(top0, top1));
        } else {
            amax[0] = hmax8(top0);
            amax[1] = hmax8(top1);
        }
    }
    for (int h = 0; h < 2; h++) {
        inverse[h] = amax[h] > 0.0f ? 127.0f / amax[h] : 0.0f;
        exact[h] = afmt == A8_Q8_K ? (amax[h] > 0.0f ? 1.0f / inverse[h] : 0.0f) : amax[h] / 127.0f;
        d[h] = afmt == A8_Q8_0 || afmt == A8_Q8_1 ? fp16_rounded(exact[h]) : exact[h];
    }
    int32_t codes[A8_BLOCK];
    for (int i = 0; i < A8_BLOCK; i += 8)
        _mm256_storeu_si256((__m256i *)(codes + i), _mm256_cvtps_epi32(_mm256_mul_ps(
            _mm256_loadu_ps(v + i), _mm256_set1_ps(inverse[i / A8_HALF]))));
    int32_t total = 0, part = 0, halves[2] = {0, 0};
    if (residual)
        for (int i = 0; i < A8_BLOCK; i += 8)
            _mm256_storeu_ps(residual + i, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(codes + i))),
                                                            _mm256_set1_ps(d[0]), _mm256_loadu_ps(v + i)));
    for (int i = 0; i < A8_BLOCK / 2; i++) {
        const int h = 2 * i / A8_HALF;
        out[split ? i : 2 * i] = (int8_t)codes[2 * i];
        out[split ? A8_BLOCK / 2 + i : 2 * i + 1] = (int8_t)codes[2 * i + 1];
        total += codes[2 * i] + codes[2 * i + 1];
        halves[h] += codes[2 * i] + codes[2 * i + 1];
        part += codes[2 * i] + codes[2 * i + 1];
        if (group < A8_BLOCK && (2 * i + 2) % group == 0) {  /* a sub-block group ends here */
            qsum[(b * A8_BLOCK + 2 * i + 1) / group] += afmt == A8_Q8_1 ? fp16_rounded(exact[h] * (float)part)
                                                                         : d[h] * (float)part;
            part = 0;
        }
    }
    if (group >= A8_BLOCK)
        qsum[b * A8_BLOCK / group] += afmt == A8_FLASH ? d[0] * (float)total
                                      : afmt == A8_Q8_1 ? fp16_rounded(exact[0] * (float)halves[0]) +
                                                              fp16_rounded(exact[1] * (float)halves[1])
                                                        : d[0] * (float)halves[0] + d[1] * (float)halves[1];
}

/* The absmax of the n features at v (a multiple of 8) */
static float absmax(const float *v, int64_t n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
    return hmax8(top);
}

/* Token t's K features -> q (K int8), d (K / 32 scales) and qsum (G group sums), block by block as
 * quantize_block says in format afmt (A8_Q8_K: K a multiple of 256). With q2 and d2 (a second term), each block's remainder x - code * d is
 * quantized the same way into q2, d2, and its group sums join qsum: the two terms carry x to within
 * absmax / 64516 per block (half a step of the remainder, itself at most half a step of x), where
 * one leaves absmax / 254. */
static void quantize_activations(const float *x, int64_t K, int64_t G, int8_t *q, float *d, float *qsum,
                                 int split, int8_t *q2, float *d2, int afmt) {
    const int64_t blocks = K / A8_BLOCK, group = K / G;
    for (int64_t g = 0; g < G; g++) qsum[g] = 0.0f;
    float kmax = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        float residual[A8_BLOCK];
        if (afmt == A8_Q8_K && b % (A8_SUPER / A8_BLOCK) == 0) kmax = absmax(x + b * A8_BLOCK, A8_SUPER);
        quantize_block(x + b * A8_BLOCK, b, group, q + b * A8_BLOCK, d + 2 * b, qsum, split, q2 ? residual : NULL,
                       afmt, kmax);
        if (q2) quantize_block(residual, b, group, q2 + b * A8_BLOCK, d2 + 2 * b, qsum, split, NULL, afmt, kmax);
    }
}

/* x (T, K) in place: every token's features replaced by what the integer products see of them in
 * format afmt (code * scale, per block as quantize_block rounds them; q8_1's fp16 sums do not apply
 * to a float product). K a multiple of 64 (A8_Q8_K: of 256). Returns 0, or -2 when K does not fit. */
int flashllm_round_activations(float *x, int64_t T, int64_t K, int afmt) {
    if (K % A8_BLOCK || afmt < A8_FLASH || afmt > A8_Q8_K || (afmt == A8_Q8_K && K % A8_SUPER)) return -2;
    for (int64_t t = 0; t < T; t++) {
        float *row = x + t * K, kmax = 0.0f;
        for (int64_t b = 0; b < K / A8_BLOCK; b++) {
            int8_t codes[A8_BLOCK];
            float d[2], qsum = 0.0f;
            if (afmt == A8_Q8_K && b % (A8_SUPER / A8_BLOCK) == 0) kmax = absmax(row + b * A8_BLOCK, A8_SUPER);
            quantize_block(row + b * A8_BLOCK, 0, A8_BLOCK, codes, d, &qsum, 0, NULL, afmt, kmax);
            for (int i = 0; i < A8_BLOCK; i++) row[b * A8_BLOCK + i] = (float)codes[i] * d[i / A8_HALF];
        }
    }
    return 0;
}

/* sum over one block of code * q, as 8 int32 lanes: 32 bytes of codes against 64 activations */
static inline __m256i block_dot(__m256i low, __m256i high, const int8_t *q) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)q)),
                                           _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(q + 32))));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

typedef struct {
    const void *w;          /* int4 bytes (N, K / 2) or int8 codes (N, K) */
    const float *scales;
    const int32_t *zeros;
    const float *offsets;   /* (N, G) per-group float offsets (W = code * scale + offset), or NULL */
    const int8_t *q;        /* (T, K) */
    const float *d, *qsum;  /* (T, K / 32), (T, G) */
    float *y;
    int64_t T, K, G, ldy;   /* T: activation rows, terms per token (T / terms tokens) */
    int terms;              /* 1, or 2: rows 2t and 2t + 1 are token t's two terms (x ~ q0 d0 + q1 d1) */
    int afmt;               /* how the activations were rounded (A8_*): whether a block's two halves share d */
} a8_args;

/* sum_g scales[g] * zeros[g] * qsum[g] over G groups, 8 at a time (masked loads for the tail) */
static inline float zero_term(const float *scales, const int32_t *zeros, const float *qsum, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 8) {
        const int64_t left = G - g < 8 ? G - g : 8;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 zero = zeros ? _mm256_cvtepi32_ps(_mm256_maskload_epi32(zeros + g, mask)) : _mm256_set1_ps(8.0f);
        const __m256 sz = _mm256_mul_ps(_mm256_maskload_ps(scales + g, mask), zero);
        acc = _mm256_fmadd_ps(sz, _mm256_maskload_ps(qsum + g, mask), acc);
    }
    return hsum8(acc);
}

/* sum_g offsets[g] * qsum[g] over G groups: the offsets' share of a row's product */
static inline float offset_term(const float *offsets, const float *qsum, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(qsum + g), acc);
    float sum = hsum8(acc);
    for (; g < G; g++) sum += offsets[g] * qsum[g];
    return sum;
}

/* What a row adds besides its code dots: + the offsets' term, or - the zero points' */
static inline float row_term(const a8_args *a, int64_t n, const float *qsum) {
    const int64_t G = a->G;
    if (a->offsets) return offset_term(a->offsets + n * G, qsum, G);
    return -zero_term(a->scales + n * G, a->zeros ? a->zeros + n * G : NULL, qsum, G);
}

/* Row n's results for activation rows t0..t0 + TT from their block sums: a token's terms (adjacent
 * rows; t0 and TT are multiples of a->terms) add up, then the row's offsets (w8: offsets only) or
 * zero-point term joins once per token. */
static inline __attribute__((always_inline)) void store_rows(const a8_args *a, int64_t n, int64_t t0, int TT,
                                                              const float *sums, int w8) {
    const int64_t G = a->G;
    if (a->terms == 1) {  /* a decode batch: as before the prompt path came, one store per token */
        for (int j = 0; j < TT; j++) {
            const float *qsum = a->qsum + (t0 + j) * G;
            a->y[(t0 + j) * a->ldy + n] = sums[j] + (!w8 ? row_term(a, n, qsum)
                                                     : a->offsets ? offset_term(a->offsets + n * G, qsum, G) : 0.0f);
        }
        return;
    }
    for (int j = 0; j < TT; j += a->terms) {
        const int64_t t = (t0 + j) / a->terms;
        const float *qsum = a->qsum + t * G;
        const float extra = !w8 ? row_term(a, n, qsum) : a->offsets ? offset_term(a->offsets + n * G, qsum, G) : 0.0f;
        a->y[t * a->ldy + n] = (a->terms == 2 ? sums[j] + sums[j + 1] : sums[j]) + extra;
    }
}

/* Rows n0..n1 for tokens t0..t0 + TT (TT <= 4): each block's codes are split into nibbles once for
 * all TT tokens; the group's scale changes every per_group blocks (1 with groups of 64), or, with
 * groups of 32 (GGUF's), within the block: its 32-byte load holds features 0..31 in bytes 0..15,
 * whose products land in the low 128-bit lane of the dot, and 32..63 in the high one. */
static inline void rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, const int TT) {
    const int64_t half = a->K / 2, blocks = a->K / A8_BLOCK, G = a->G, per_group = blocks / G;
    const int halves = a->K / G == A8_BLOCK / 2;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int8_t *q[4];
    const float *d[4];
    for (int j = 0; j < TT; j++) {
        q[j] = a->q + (t0 + j) * a->K;
        d[j] = a->d + (t0 + j) * 2 * blocks;
    }
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->w + n * half;
        const float *scales = a->scales + n * G;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 scale = _mm256_set1_ps(scales[0]);
        for (int64_t b = 0, g = 0, left = per_group; b < blocks; b++, left--) {
            if (halves) {
                scale = _mm256_set_m128(_mm_set1_ps(scales[2 * b + 1]), _mm_set1_ps(scales[2 * b]));
            } else if (left == 0) {
                scale = _mm256_set1_ps(scales[++g]);
                left = per_group;
            }
            if (b & 1) _mm_prefetch((const char *)(row + b * 32 + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + b * 32));
            const __m256i low = _mm256_and_si256(bytes, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            for (int j = 0; j < TT; j++) {
                const __m256 dot = _mm256_cvtepi32_ps(block_dot(low, high, q[j] + b * A8_BLOCK));
                const __m256 dd = _mm256_set_m128(_mm_set1_ps(d[j][2 * b + 1]), _mm_set1_ps(d[j][2 * b]));
                acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, dd), acc[j]);
            }
        }
        float sums[4];
        for (int j = 0; j < TT; j++) sums[j] = hsum8(acc[j]);
        store_rows(a, n, t0, TT, sums, 0);
    }
}

/* ---- the decode body for flashllm's own activations (A8_FLASH) and groups of a multiple of 64 ----
 * A draft model's passes bring 1 to ~10 tokens of one sequence, and for a small model (K = 576: nine
 * blocks a row) what rows_for_tokens spends around the blocks (a zero-point term per row and token,
 * recomputing the row's scale x zero products, then two horizontal sums) costs about as much as
 * the blocks. Here a block's two activation scales are one (A8_FLASH), so each token's block costs
 * two vpmaddubsw, one vpaddw, one vpmaddwd, a conversion, the scale product and an fma; the row's
 * zero-point term, scales[g] * zero[g] * qsum[t, g] over its groups, is folded into each token's
 * accumulator lanes (8 groups a step, the row's scale x zero products made once for all tokens)
 * before its one horizontal sum; and up to FLASH_TOKENS tokens share each unpacked block, two rows
 * at a time where few tokens leave registers for it (a chain of fmas per row hides their latency).
 * The fp32 order per token and row is fixed: blocks in order into 8 lanes, then the groups'
 * zero-point terms, 8 at a time, then the lanes' sum: whatever the other tokens of the pass, and
 * whichever R and TT run it, a token gets the same bits. */
#define FLASH_TOKENS 6

/* mask of the first `left` (clamped to 0..8) fp32 lanes, for a row's last groups */
static inline __m256i lanes_below(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* acc[j] -= sum_g scales[g] * zero[g] * qsum[j][g], 8 groups per step into the lanes (zeros NULL: 8) */
static inline __attribute__((always_inline)) void fold_zero_terms(__m256 *acc, const float *scales,
                                                                    const int32_t *zeros, const float *const *qsum,
                                                                    int64_t G, const int TT) {
    for (int64_t g = 0; g < G; g += 8) {
        const __m256i mask = lanes_below(G - g);
        const __m256 zero = zeros ? _mm256_cvtepi32_ps(_mm256_maskload_epi32(zeros + g, mask)) : _mm256_set1_ps(8.0f);
        const __m256 sz = _mm256_mul_ps(_mm256_maskload_ps(scales + g, mask), zero);
        for (int j = 0; j < TT; j++) acc[j] = _mm256_fnmadd_ps(sz, _mm256_maskload_ps(qsum[j] + g, mask), acc[j]);
    }
}

/* Rows n..n + R (R 1 or 2) for tokens t0..t0 + TT (TT <= FLASH_TOKENS), as the section's comment says */
static inline __attribute__((always_inline)) void flash_rows(const a8_args *a, int64_t n, int64_t t0, const int R,
                                                               const int TT) {
    const int64_t half = a->K / 2, blocks = a->K / A8_BLOCK, G = a->G, per_group = blocks / G;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *q[FLASH_TOKENS];
    const float *d[FLASH_TOKENS], *qsum[FLASH_TOKENS];
    for (int j = 0; j < TT; j++) {
        q[j] = a->q + (t0 + j) * a->K;
        d[j] = a->d + (t0 + j) * 2 * blocks;
        qsum[j] = a->qsum + (t0 + j) * G;
    }
    const uint8_t *row[2];
    __m256 acc[2][FLASH_TOKENS];
    for (int r = 0; r < R; r++) {
        row[r] = (const uint8_t *)a->w + (n + r) * half;
        for (int j = 0; j < TT; j++) acc[r][j] = _mm256_setzero_ps();
    }
    for (int64_t b = 0, g = 0, left = per_group; b < blocks; b++, left--) {
        if (left == 0) {  /* the next group: counted, as a division per block costs more than its products */
            g++;
            left = per_group;
        }
        __m256i low[2], high[2];
        __m256 scale[2];
        for (int r = 0; r < R; r++) {
            if (b & 1) _mm_prefetch((const char *)(row[r] + b * 32 + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row[r] + b * 32));
            low[r] = _mm256_and_si256(bytes, nibble);
            high[r] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            scale[r] = _mm256_broadcast_ss(a->scales + (n + r) * G + g);
        }
        for (int j = 0; j < TT; j++) {
            const __m256i qe = _mm256_loadu_si256((const __m256i *)(q[j] + b * A8_BLOCK));
            const __m256i qo = _mm256_loadu_si256((const __m256i *)(q[j] + b * A8_BLOCK + 32));
            const __m256 dd = _mm256_broadcast_ss(d[j] + 2 * b);
            for (int r = 0; r < R; r++) {
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low[r], qe), _mm256_maddubs_epi16(high[r], qo));
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                                            _mm256_mul_ps(scale[r], dd), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        fold_zero_terms(acc[r], a->scales + (n + r) * G, a->zeros ? a->zeros + (n + r) * G : NULL, qsum, G, TT);
        for (int j = 0; j < TT; j++) a->y[(t0 + j) * a->ldy + n + r] = hsum8(acc[r][j]);
    }
}

/* Rows n0..n1 for tokens t0..t0 + TT: two rows a step while their 2 x TT accumulators leave registers
 * for the unpacked codes, else one */
static inline __attribute__((always_inline)) void flash_rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1,
                                                                          int64_t t0, const int TT) {
    int64_t n = n0;
    if (TT <= 3)
        for (; n + 2 <= n1; n += 2) flash_rows(a, n, t0, 2, TT);
    for (; n < n1; n++) flash_rows(a, n, t0, 1, TT);
}

/* ---- the same body with each row's scale products made 8 at a time ----
 * Per token and block flash_rows multiplies the row's group scale by the token's block scale (one
 * vmulps of a broadcast pair) before its fma. With groups of 64 both are one per block, so a row's
 * products scales[n, b] * d[t, b] are made here for 8 blocks per vmulps into a table on the stack
 * (the tokens' d compacted once per share), and each token's block broadcasts its product from there:
 * the same fp32 products, fmas and order as flash_rows, so the same bits, one instruction fewer per
 * token and block, and no per-token pointer into d in the block loop. Passes of 1-3 tokens keep
 * flash_rows (two rows a step): a table per row and token saves them fewer products than it costs to
 * build and read back (2-3 tokens, K = 576: 0.84-1.0x). */
#define TABLE_BLOCKS 256  /* blocks a row (K <= 16384) whose products fit the stack */
/* tokens a sweep of table_row takes: up to 10, a draft pass's, whose one accumulator each still leaves
 * registers for the block's codes and activations (1536 x 576: 1.04-1.15x over sweeps
 * of at most 6, which unpack each block twice for 7-10 tokens) */
#define TABLE_TOKENS 10
#define TABLE_MIN_TOKENS 4  /* fewer run flash_rows (the section comment says why) */

/* d[t0 + j, block b] at dc[j * TABLE_BLOCKS + b] for j < TT, zero up to the next multiple of 8 blocks */
static inline void compact_scales(const a8_args *a, int64_t t0, int TT, float *dc) {
    const int64_t blocks = a->K / A8_BLOCK, padded = (blocks + 7) / 8 * 8;
    for (int j = 0; j < TT; j++) {
        const float *d = a->d + (t0 + j) * 2 * blocks;
        for (int64_t b = 0; b < padded; b++) dc[j * TABLE_BLOCKS + b] = b < blocks ? d[2 * b] : 0.0f;
    }
}

/* Row n for tokens t0..t0 + TT (TABLE_MIN_TOKENS <= TT <= TABLE_TOKENS), as flash_rows computes it;
 * dc from compact_scales */
static inline __attribute__((always_inline)) void table_row(const a8_args *a, int64_t n, int64_t t0, const int TT,
                                                              const float *dc) {
    const int64_t blocks = a->K / A8_BLOCK, G = a->G;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const float *scales = a->scales + n * G;
    float sd[TABLE_TOKENS * TABLE_BLOCKS];  /* [j * TABLE_BLOCKS + b]: scales[n, b] * d[t0 + j, b] */
    for (int64_t b = 0; b < blocks; b += 8) {
        const __m256 s = _mm256_maskload_ps(scales + b, lanes_below(blocks - b));
        for (int j = 0; j < TT; j++)
            _mm256_storeu_ps(sd + j * TABLE_BLOCKS + b, _mm256_mul_ps(s, _mm256_loadu_ps(dc + j * TABLE_BLOCKS + b)));
    }
    const int8_t *q = a->q + t0 * a->K;
    const uint8_t *row = (const uint8_t *)a->w + n * (a->K / 2);
    __m256 acc[TABLE_TOKENS];
    for (int j = 0; j < TT; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (b & 1) _mm_prefetch((const char *)(row + b * 32 + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + b * 32));
        const __m256i low = _mm256_and_si256(bytes, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        for (int j = 0; j < TT; j++) {
            const int8_t *qb = q + j * a->K + b * A8_BLOCK;
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)qb)),
                                                   _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(qb + 32))));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                                     _mm256_broadcast_ss(sd + j * TABLE_BLOCKS + b), acc[j]);
        }
    }
    const float *qsum[TABLE_TOKENS];
    for (int j = 0; j < TT; j++) qsum[j] = a->qsum + (t0 + j) * G;
    fold_zero_terms(acc, scales, a->zeros ? a->zeros + n * G : NULL, qsum, G, TT);
    for (int j = 0; j < TT; j++) a->y[(t0 + j) * a->ldy + n] = hsum8(acc[j]);
}

/* Rows n0..n1 for tokens t0..t0 + TT on table_row */
static inline __attribute__((always_inline)) void table_rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1,
                                                                          int64_t t0, const int TT) {
    float dc[TABLE_TOKENS * TABLE_BLOCKS];
    compact_scales(a, t0, TT, dc);
    for (int64_t n = n0; n < n1; n++) table_row(a, n, t0, TT, dc);
}

/* 1: passes of 4+ tokens with groups of 64 run table_row; 0: flash_rows, for tests and A/B runs (a
 * negative value only reads). Returns the setting in use. */
static int a8_table = 1;
int flashllm_a8_set_table(int on) {
    if (on >= 0) a8_table = on != 0;
    return a8_table;
}

/* Whether flash_share takes the product: flashllm's activations, one term a token, no offsets, and
 * groups of whole blocks */
static inline int flash_takes(const a8_args *a) {
    return a->afmt == A8_FLASH && a->terms == 1 && !a->offsets && (a->K / a->G) % A8_BLOCK == 0;
}

/* Rows n0..n1 for the TT (TABLE_MIN_TOKENS..TABLE_TOKENS) tokens from t0 on table_row, TT a constant in each call */
static void table_sweep(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, int64_t TT) {
    switch (TT) {
        case 4: table_rows_for_tokens(a, n0, n1, t0, 4); break;
        case 5: table_rows_for_tokens(a, n0, n1, t0, 5); break;
        case 6: table_rows_for_tokens(a, n0, n1, t0, 6); break;
        case 7: table_rows_for_tokens(a, n0, n1, t0, 7); break;
        case 8: table_rows_for_tokens(a, n0, n1, t0, 8); break;
        case 9: table_rows_for_tokens(a, n0, n1, t0, 9); break;
        default: table_rows_for_tokens(a, n0, n1, t0, 10); break;
    }
}

/* Rows n0..n1 for the TT (1..FLASH_TOKENS) tokens from t0 on flash_rows, TT a constant in each call */
static void rows_sweep(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, int64_t TT) {
    switch (TT) {
        case 1: flash_rows_for_tokens(a, n0, n1, t0, 1); break;
        case 2: flash_rows_for_tokens(a, n0, n1, t0, 2); break;
        case 3: flash_rows_for_tokens(a, n0, n1, t0, 3); break;
        case 4: flash_rows_for_tokens(a, n0, n1, t0, 4); break;
        case 5: flash_rows_for_tokens(a, n0, n1, t0, 5); break;
        default: flash_rows_for_tokens(a, n0, n1, t0, 6); break;
    }
}

/* The share's rows for all T tokens in sweeps of at most TABLE_TOKENS (groups of 64) or FLASH_TOKENS,
 * as even as they come (12 tokens: 6 and 6), so every sweep re-reads the share's codes (from L2 after
 * the first) as few times as it can; sweeps of fewer than TABLE_MIN_TOKENS run flash_rows */
static void flash_share(const a8_args *shared, int64_t n0, int64_t n1) {
    /* a copy the compiler sees no store to, so the rows' loops keep K, G and the pointers in registers
     * (through `shared` every result stored could have changed them: a division per row came back) */
    const a8_args local = *shared, *a = &local;
    const int table = a8_table && a->G * A8_BLOCK == a->K && a->K <= TABLE_BLOCKS * A8_BLOCK;
    const int64_t most = table ? TABLE_TOKENS : FLASH_TOKENS, sweeps = (a->T + most - 1) / most;
    for (int64_t s = 0, t0 = 0; s < sweeps; s++) {
        const int64_t t1 = a->T * (s + 1) / sweeps;
        if (table && t1 - t0 >= TABLE_MIN_TOKENS) table_sweep(a, n0, n1, t0, t1 - t0);
        else rows_sweep(a, n0, n1, t0, t1 - t0);
        t0 = t1;
    }
}

/* A share of rows: ROWS(a, r0, r1, t0, TT) over the activation rows 4 at a time, TT a constant in
 * each call so that the token loop unrolls, one tile of rows at a time: for a prompt (hundreds of
 * rows) every 4 rows re-read the tile's codes, which stay in L2 when the tile is TILE_BYTES, where
 * sweeping the whole share re-read it from memory (a decode batch sweeps once either way). */
#define TILE_BYTES (128 * 1024)
#define TILE_MIN_ROWS 32  /* decode batches (one term, at most native.MAX_TOKENS rows) sweep the share whole */
#define TOKEN_SWEEPS(ROWS, ROW_BYTES)                                                             \
    const int64_t tile = a->T <= TILE_MIN_ROWS ? n1 - n0 + 1                                     \
                         : (ROW_BYTES) >= TILE_BYTES / 16 ? 16 : TILE_BYTES / (ROW_BYTES);          \
    for (int64_t r0 = n0; r0 < n1; r0 += tile) {                                                  \
        const int64_t r1 = r0 + tile < n1 ? r0 + tile : n1;                                       \
        for (int64_t t0 = 0; t0 < a->T; t0 += 4) {                                                \
            switch (a->T - t0 < 4 ? a->T - t0 : 4) {                                              \
                case 1: ROWS(a, r0, r1, t0, 1); break;                                            \
                case 2: ROWS(a, r0, r1, t0, 2); break;                                            \
                case 3: ROWS(a, r0, r1, t0, 3); break;                                            \
                default: ROWS(a, r0, r1, t0, 4); break;                                           \
            }                                                                                     \
        }                                                                                         \
    }

/* ---- the same product with AVX-512 VNNI, two activation blocks (128 features, 64 code bytes) a step ----
 * Where the CPU has it: vpdpbusd multiplies 64 unsigned codes by 64 int8 activations and adds each
 * four products into an int32 lane, exactly (no int16 saturation), one instruction where AVX2 takes
 * three, and with AVX2 alone (0.33 ms for a 9728 x 896 token) the int4 GEMV is compute-bound on
 * `epyc4-2c` (docs/benchmarks.md). Lanes 0-7 hold block b (lanes 0-3 its features 0..31, 4-7 32..63), lanes
 * 8-15 block b + 1, so a group of 32 features is four lanes and a group of 64 or more eight. The
 * scale each lane meets is scale[group] * d[block], built once per step from four floats. K must be
 * whole pairs of blocks (K % 128 == 0); a8_share falls back to the AVX2 rows otherwise. */
#define A8_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* scale[group] of the step's four quarters (32 features each) of blocks b, b + 1 */
A8_VNNI static inline __m128 quarter_scales(const float *scales, int64_t b, int64_t group) {
    if (group == A8_BLOCK / 2) return _mm_loadu_ps(scales + 2 * b);
    const float s0 = scales[b * A8_BLOCK / group], s1 = scales[(b + 1) * A8_BLOCK / group];
    return _mm_setr_ps(s0, s0, s1, s1);
}

A8_VNNI static inline void vnni_rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, const int TT) {
    const int64_t half = a->K / 2, blocks = a->K / A8_BLOCK, group = a->K / a->G;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->w + n * half;
        const float *scales = a->scales + n * a->G;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < blocks; b += 2) {
            _mm_prefetch((const char *)(row + b * 32 + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m512i bytes = _mm512_loadu_si512(row + b * 32);
            const __m512i low = _mm512_and_si512(bytes, nibble);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
            const __m128 sq = quarter_scales(scales, b, group);
            for (int j = 0; j < TT; j++) {
                const int8_t *q = a->q + (t0 + j) * a->K + b * A8_BLOCK;  /* b: even 32, odd 32; b + 1 the same */
                const __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)),
                                                        _mm256_loadu_si256((const __m256i *)(q + 64)), 1);
                const __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32))),
                                                       _mm256_loadu_si256((const __m256i *)(q + 96)), 1);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, even), high, odd);
                /* features 0..31 and 32..63 of blocks b and b + 1: four consecutive scales */
                const __m128 lane = _mm_mul_ps(sq, _mm_loadu_ps(a->d + (t0 + j) * 2 * blocks + 2 * b));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(lane)), acc[j]);
            }
        }
        float sums[4];
        for (int j = 0; j < TT; j++) sums[j] = _mm512_reduce_add_ps(acc[j]);
        store_rows(a, n, t0, TT, sums, 0);
    }
}

A8_VNNI static void vnni_share(const a8_args *a, int64_t n0, int64_t n1) {
    TOKEN_SWEEPS(vnni_rows_for_tokens, a->K / 2)
}

/* 1 where the CPU has AVX-512 VNNI (picked at load; flashllm_a8_set_vnni turns it off for tests and A/B
 * runs); the int8-code body below reads it too */
static int a8_vnni = 0, a8_vnni_best = 0;
/* 1: prompts of int8 codes run the 4-row VNNI tiles (w8_vnni_tile); 0: the one-row body, for tests and
 * A/B runs; a negative value only reads. Returns the setting in use. */
static int w8_tiles = 1;
int flashllm_w8_set_tiles(int on) {
    if (on >= 0) w8_tiles = on != 0;
    return w8_tiles;
}
__attribute__((constructor)) static void pick_a8_vnni(void) {
    __builtin_cpu_init();
    a8_vnni_best = a8_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Sets whether the int4 x int8 product may use AVX-512 VNNI (on = 1 only where the CPU has it; a
 * negative value only reads); returns the setting in use. */
int flashllm_a8_set_vnni(int on) {
    if (on >= 0) a8_vnni = on && a8_vnni_best;
    return a8_vnni;
}

static void a8_share(void *ctx, int64_t n0, int64_t n1) {
    const a8_args *a = ctx;
    if (a8_vnni && a->K % (2 * A8_BLOCK) == 0) {
        vnni_share(a, n0, n1);
        return;
    }
    if (a->T <= TILE_MIN_ROWS && flash_takes(a)) {
        flash_share(a, n0, n1);
        return;
    }
    TOKEN_SWEEPS(rows_for_tokens, a->K / 2)
}

/* Bytes of scratch flashllm_w4a8_gemv_mt needs for T tokens: the int8 activations and their scales. */
static int64_t scratch_bytes(int64_t T, int64_t K, int64_t G) {
    return T * K + (int64_t)sizeof(float) * T * (K / A8_HALF + G);
}

typedef struct {
    const float *x;
    int64_t K, G;
    int8_t *q;
    float *d, *qsum;
    int split, terms, afmt;
} quantize_args;

/* Tokens t0..t1 into their activation rows: token t's at row t * terms, its second term's (if any) next. */
static void quantize_share(void *ctx, int64_t t0, int64_t t1) {
    const quantize_args *a = ctx;
    const int64_t K = a->K, scales = K / A8_HALF;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t row = t * a->terms;
        quantize_activations(a->x + t * K, K, a->G, a->q + row * K, a->d + row * scales, a->qsum + t * a->G, a->split,
                             a->terms == 2 ? a->q + (row + 1) * K : NULL, a->terms == 2 ? a->d + (row + 1) * scales : NULL,
                             a->afmt);
    }
}

/* Quantize the T tokens' activations (split: for int4 codes; terms 1 or 2 rows per token, see
 * quantize_share) into scratch (scratch_bytes for T * terms rows, 4-byte aligned, or NULL to
 * allocate it here) and run `share` over the N rows. Returns 0, or -1 when the scratch could not
 * be allocated. */
static int run_against_int8(const float *x, int64_t T, int64_t K, const void *w, const float *scales,
                            const int32_t *zeros, const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy,
                            void *scratch, int threads, int split, int terms, int afmt, flashllm_share_fn share) {
    const int64_t rows = T * terms;
    if (afmt < A8_FLASH || afmt > A8_Q8_K || (afmt == A8_Q8_K && K % A8_SUPER) || (terms == 2 && afmt != A8_FLASH))
        return -2;
    void *owned = scratch ? NULL : malloc((size_t)scratch_bytes(rows, K, G));
    if (!scratch && !owned) return -1;
    float *d = scratch ? scratch : owned, *qsum = d + rows * (K / A8_HALF);
    int8_t *q = (int8_t *)(qsum + rows * G);
    quantize_args qa = {x, K, G, q, d, qsum, split, terms, afmt};
    if (T * K >= QUANTIZE_SPLIT_FEATURES) flashllm_parallel_items(quantize_share, &qa, T, threads, 1);
    else quantize_share(&qa, 0, T);
    a8_args a = {w, scales, zeros, offsets, q, d, qsum, y, rows, K, G, ldy, terms, afmt};
    flashllm_parallel_for(share, &a, N, threads, COARSE_SHARES);
    free(owned);
    return 0;
}

/* y[t * ldy + n] for t < T, n < N as in the header comment, x (T, K) fp32, K a multiple of 64 and
 * K / G 32 or a multiple of 64; offsets (N, G) or NULL: with offsets, W = code * scale + offset
 * (zeros unused); rows split over `threads`; activations rounded as afmt says (A8_*; A8_Q8_K needs K a
 * multiple of 256); scratch and the result as for run_against_int8 (-2: afmt does not fit). */
int flashllm_w4a8_gemv_mt(const float *x, int64_t T, int64_t K, const uint8_t *w, const float *scales,
                          const int32_t *zeros, const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy,
                          void *scratch, int threads, int afmt) {
    return run_against_int8(x, T, K, w, scales, zeros, offsets, G, y, N, ldy, scratch, threads, 1, 1, afmt,
                            a8_share);
}

/* The same for a prompt: terms 1 or 2 activation rows per token (quantize_share); scratch allocated here. */
int flashllm_w4a8_prompt_mt(const float *x, int64_t T, int64_t K, const uint8_t *w, const float *scales,
                            const int32_t *zeros, const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy,
                            int terms, int threads, int afmt) {
    if (terms != 1 && terms != 2) return -2;
    return run_against_int8(x, T, K, w, scales, zeros, offsets, G, y, N, ldy, NULL, threads, 1, terms, afmt,
                            a8_share);
}

/* ---- int8 weights against int8 activations (opt-in for w8a16: FLASHLLM_CPU_W8_ACTIVATIONS=int8) ----
 * The same activation blocks in feature order, against symmetric int8 codes w (N, K) with scales
 * (N, G): y = sum_g scales[n, g] * sum_{b in g} d[t, b] * sum_{k in b} w[n, k] * q[t, k].
 * vpmaddubsw takes an unsigned operand, so it multiplies |w| by q carrying w's sign (llama.cpp's
 * Q8 trick); each pair sum is at most 2 * 128 * 127 < 2^15, and each 32-byte half of a block is
 * widened to int32 (vpmaddwd) before the halves are added. A block's sum, at most
 * 64 * 128 * 127 < 2^24, converts to fp32 exactly. */
static inline __m256i signed_dot32(__m256i w, const int8_t *q) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                               _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q), w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* One block's 32-byte half h against q, times the per-lane scales of groups of 16 or 32 features */
static inline __m256 fine_scales(const float *scales, int64_t b, int h, int64_t group) {
    if (group == 16)  /* lanes 0..3: features 0..15 of the half, lanes 4..7: 16..31 */
        return _mm256_set_m128(_mm_set1_ps(scales[4 * b + 2 * h + 1]), _mm_set1_ps(scales[4 * b + 2 * h]));
    return _mm256_set1_ps(scales[2 * b + h]);
}

static inline void w8_rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, const int TT) {
    const int64_t blocks = a->K / A8_BLOCK, G = a->G, per_group = blocks / G, group = a->K / G;
    const int8_t *codes = (const int8_t *)a->w;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = codes + n * a->K;
        const float *scales = a->scales + n * G;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 scale = _mm256_set1_ps(scales[0]);
        for (int64_t b = 0, g = 0, left = per_group; b < blocks; b++, left--) {
            _mm_prefetch((const char *)(row + b * A8_BLOCK + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(row + b * A8_BLOCK));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(row + b * A8_BLOCK + 32));
            if (group < A8_BLOCK) {  /* GGUF's groups of 16 or 32: each half has its own scales */
                const __m256 s0 = fine_scales(scales, b, 0, group), s1 = fine_scales(scales, b, 1, group);
                for (int j = 0; j < TT; j++) {
                    const int8_t *q = a->q + (t0 + j) * a->K + b * A8_BLOCK;
                    const float *dj = a->d + (t0 + j) * 2 * blocks + 2 * b;
                    const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(signed_dot32(w0, q)),
                                                      _mm256_mul_ps(s0, _mm256_set1_ps(dj[0])));
                    acc[j] = _mm256_add_ps(acc[j], _mm256_fmadd_ps(_mm256_cvtepi32_ps(signed_dot32(w1, q + 32)),
                                                                   _mm256_mul_ps(s1, _mm256_set1_ps(dj[1])), part));
                }
                continue;
            }
            if (left == 0) {
                scale = _mm256_set1_ps(scales[++g]);
                left = per_group;
            }
            for (int j = 0; j < TT; j++) {
                const int8_t *q = a->q + (t0 + j) * a->K + b * A8_BLOCK;
                const float *dj = a->d + (t0 + j) * 2 * blocks + 2 * b;
                const __m256i lo = signed_dot32(w0, q), hi = signed_dot32(w1, q + 32);
                if (dj[0] == dj[1]) {  /* one scale for the block (A8_FLASH, A8_Q8_K): one conversion */
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
                    acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(dj[0])), acc[j]);
                } else {
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(scale, _mm256_set1_ps(dj[0])), acc[j]);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(scale, _mm256_set1_ps(dj[1])), acc[j]);
                }
            }
        }
        float sums[4];
        for (int j = 0; j < TT; j++) sums[j] = hsum8(acc[j]);
        store_rows(a, n, t0, TT, sums, 1);
    }
}

/* int8 codes with VNNI, one 64-feature block a step: vpdpbusd takes an unsigned operand, so the codes
 * are offset to w + 128 (a sign-bit flip) and 128 * the activations' sum per lane, itself one
 * vpdpbusd of 0x80 bytes, is taken off first: exact int32 lanes, lane i = features 4i..4i + 3. The
 * block's four quarters (16 features each) meet scale[group] * d[block]: GGUF's groups of 16 and
 * 32 too. */
A8_VNNI static inline __m128 w8_quarter_scales(const float *scales, int64_t b, int64_t group) {
    if (group == 16) return _mm_loadu_ps(scales + 4 * b);
    if (group == 32) return _mm_setr_ps(scales[2 * b], scales[2 * b], scales[2 * b + 1], scales[2 * b + 1]);
    return _mm_set1_ps(scales[b * A8_BLOCK / group]);
}

A8_VNNI static inline void w8_vnni_rows_for_tokens(const a8_args *a, int64_t n0, int64_t n1, int64_t t0,
                                                   const int TT) {
    const int64_t blocks = a->K / A8_BLOCK, G = a->G, group = a->K / G;
    const int8_t *codes = (const int8_t *)a->w;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = codes + n * a->K;
        const float *scales = a->scales + n * G;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < blocks; b++) {
            _mm_prefetch((const char *)(row + b * A8_BLOCK + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(row + b * A8_BLOCK), flip);
            const __m128 sq = w8_quarter_scales(scales, b, group);
            for (int j = 0; j < TT; j++) {
                const __m512i q = _mm512_loadu_si512(a->q + (t0 + j) * a->K + b * A8_BLOCK);
                const __m512i shift = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, q);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), shift), w, q);
                const float *dj = a->d + (t0 + j) * 2 * blocks + 2 * b;  /* quarters 0, 1: dj[0]; 2, 3: dj[1] */
                const __m128 lane = _mm_mul_ps(sq, _mm_setr_ps(dj[0], dj[0], dj[1], dj[1]));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(lane)), acc[j]);
            }
        }
        float sums[4];
        for (int j = 0; j < TT; j++) sums[j] = _mm512_reduce_add_ps(acc[j]);
        store_rows(a, n, t0, TT, sums, 1);
    }
}

/* A prompt's tile: 4 rows x TT activation rows, one 64-feature block a step. The activations are offset
 * to q + 128 (unsigned) and the rows stay signed, so 128 * the row's codes per lane, one vpdpbusd a row
 * and block, is what comes off, shared by the tile's tokens (the decode body takes it off per token):
 * one vpdpbusd, a conversion, a scale product and an fma per row, token and block. Each row's sums
 * add in the order of w8_vnni_rows_for_tokens, so the bits are those of the one-row body. */
A8_VNNI static inline __attribute__((always_inline)) void w8_vnni_tile(const a8_args *a, int64_t n, int64_t t0,
                                                                        const int TT) {
    const int64_t blocks = a->K / A8_BLOCK, G = a->G, group = a->K / G;
    const int8_t *codes = (const int8_t *)a->w;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w[4], shift[4];
        __m512 sq[4];  /* each lane's weight scale; times the token's (below) as the one-row body's lane scale */
        for (int r = 0; r < 4; r++) {
            w[r] = _mm512_loadu_si512(codes + (n + r) * a->K + b * A8_BLOCK);
            shift[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, w[r]));
            sq[r] = _mm512_permutexvar_ps(quarters,
                                          _mm512_castps128_ps512(w8_quarter_scales(a->scales + (n + r) * G, b, group)));
        }
        for (int j = 0; j < TT; j++) {
            const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(a->q + (t0 + j) * a->K + b * A8_BLOCK), flip);
            const float *dj = a->d + (t0 + j) * 2 * blocks + 2 * b;
            const __m512 dq = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_setr_ps(dj[0], dj[0], dj[1], dj[1])));
            for (int r = 0; r < 4; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(shift[r], q, w[r]);
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sq[r], dq), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < 4; r++) {
        float sums[4];
        for (int j = 0; j < TT; j++) sums[j] = _mm512_reduce_add_ps(acc[r][j]);
        store_rows(a, n + r, t0, TT, sums, 1);
    }
}

A8_VNNI static inline void w8_vnni_tiles(const a8_args *a, int64_t n0, int64_t n1, int64_t t0, const int TT) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) w8_vnni_tile(a, n, t0, TT);
    if (n < n1) w8_vnni_rows_for_tokens(a, n, n1, t0, TT);
}

A8_VNNI static void w8_vnni_share(const a8_args *a, int64_t n0, int64_t n1) {
    if (a->T > TILE_MIN_ROWS && w8_tiles) {  /* a prompt: decode batches keep the one-row body */
        TOKEN_SWEEPS(w8_vnni_tiles, a->K)
        return;
    }
    TOKEN_SWEEPS(w8_vnni_rows_for_tokens, a->K)
}

static void w8a8_share(void *ctx, int64_t n0, int64_t n1) {
    const a8_args *a = ctx;
    if (a8_vnni) {
        w8_vnni_share(a, n0, n1);
        return;
    }
    TOKEN_SWEEPS(w8_rows_for_tokens, a->K)
}

/* y[t * ldy + n] for t < T, n < N as above (+ sum_g offsets[n, g] * the group's activations where
 * offsets is not NULL), x (T, K) fp32, K a multiple of 64 and K / G 16, 32 or a multiple of 64;
 * scratch and the result as for run_against_int8. */
int flashllm_w8a8_gemv_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales,
                          const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy, void *scratch,
                          int threads, int afmt) {
    return run_against_int8(x, T, K, w, scales, NULL, offsets, G, y, N, ldy, scratch, threads, 0, 1, afmt,
                            w8a8_share);
}

/* The same for a prompt: terms 1 or 2 activation rows per token (quantize_share); scratch allocated here. */
int flashllm_w8a8_prompt_mt(const float *x, int64_t T, int64_t K, const int8_t *w, const float *scales,
                            const float *offsets, int64_t G, float *y, int64_t N, int64_t ldy, int terms, int threads,
                            int afmt) {
    if (terms != 1 && terms != 2) return -2;
    return run_against_int8(x, T, K, w, scales, NULL, offsets, G, y, N, ldy, NULL, threads, 0, terms, afmt,
                            w8a8_share);
}
