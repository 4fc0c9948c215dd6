/* Decode-sized matrix products for x86 CPUs with AVX2 and FMA: a few tokens times a large weight.
 *
 * Every function works on the output rows n0 <= n < n1 only, so the caller can hand disjoint row
 * ranges to several threads (flashllm/backends/cpu/native.py does; ctypes drops the GIL around
 * each call). Weights are read once per call: all tokens of a row are done while the row is in L1.
 *
 * The integer-weight products keep the reference's fp32 semantics: every code (minus its zero
 * point, in integers) converts exactly to float and meets the fp32 activation in an FMA; only the
 * order of the sums and where the group scale is applied differ from dequantize-then-matmul.
 * Codes are widened straight from memory (vpmovsxbd / vpmovzxbd with a memory operand): on the
 * team's AVX2 EPYC that ran ~18% faster on one core than widening a loaded register.
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* y[t * ldy + n] = sum_k x[t * K + k] * w[n * K + k] for t < T and n0 <= n < n1 (fp32). */
void flashllm_f32_gemv(const float *x, const float *w, float *y, int64_t T, int64_t K,
                       int64_t n0, int64_t n1, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const float *row = w + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {  /* four chains hide the FMA latency */
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(xt + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(xt + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 16), _mm256_loadu_ps(xt + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 24), _mm256_loadu_ps(xt + k + 24), a3);
            }
            float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for (; k < K; k++) sum += row[k] * xt[k];
            y[t * ldy + n] = sum;
        }
    }
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
