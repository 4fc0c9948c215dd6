/* Small AVX2 helpers shared by the cpu backend's kernel files. */
#ifndef FLASHLLM_SIMD_H
#define FLASHLLM_SIMD_H
#include <immintrin.h>

/* the sum of a vector's 8 fp32 lanes */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

#endif
