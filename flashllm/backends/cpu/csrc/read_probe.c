/* The bandwidth probe's reads (flashllm/backends/cpu/read_probe.py): several streams per thread, as
 * the one-token fp32 loops in decode_kernels.c read rows, without the arithmetic. */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "parallel_for.h"

/* The unit the probe's buffer comes in: READ_RUN floats (256 B). A share of runs is read as
 * `streams` streams, switching every `step` floats (32 or 64). Two streams switching every 256 B
 * read fastest of the two-stream patterns on `epyc3-2c` (docs/benchmarks.md; reads of 2 GiB by two
 * threads in huge pages, against 1 KiB runs: 256 B 1.03-1.09x, 128 B 0.98-1.08x, 512 B 1.03-1.05x,
 * `torch.sum` 0.84-0.88x); on `intel-2c` eight streams switching every 128 B read fastest. */
#define READ_RUN 64

typedef struct { const float *p; int streams, step; _Atomic uint64_t total; } read_args;  /* total: a double's bits */

static void add_to_total(_Atomic uint64_t *total, double v) {  /* no libatomic needed for this */
    uint64_t old = atomic_load(total), sum;
    do {
        double d;
        memcpy(&d, &old, sizeof d);
        d += v;
        memcpy(&sum, &d, sizeof sum);
    } while (!atomic_compare_exchange_weak(total, &old, sum));
}

static void add_floats(const float *p, int64_t n, __m256 acc[4]) {  /* n floats, a multiple of 32, into acc */
    for (int64_t k = 0; k < n; k += 32) {
        acc[0] = _mm256_add_ps(acc[0], _mm256_loadu_ps(p + k));
        acc[1] = _mm256_add_ps(acc[1], _mm256_loadu_ps(p + k + 8));
        acc[2] = _mm256_add_ps(acc[2], _mm256_loadu_ps(p + k + 16));
        acc[3] = _mm256_add_ps(acc[3], _mm256_loadu_ps(p + k + 24));
    }
}

static void read_share(void *ctx, int64_t r0, int64_t r1) {  /* runs r0 <= r < r1: the streams, then the leftover runs */
    read_args *a = ctx;
    const int64_t per = (r1 - r0) / a->streams * READ_RUN;  /* floats of each stream */
    const float *base = a->p + r0 * READ_RUN;
    __m256 acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < per; i += a->step)
        for (int s = 0; s < a->streams; s++) add_floats(base + s * per + i, a->step, acc);
    add_floats(base + a->streams * per, (r1 - r0) * READ_RUN - a->streams * per, acc);
    add_to_total(&a->total, hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                                  _mm256_add_ps(acc[2], acc[3]))));
}

/* The sum of runs x READ_RUN floats at p, read by `threads` threads with `streams` streams each
 * (1 to 16), switching streams every `step` floats (32 or 64); the sum keeps the reads from being
 * optimized away. NaN for arguments out of range. */
double flashllm_read_stream(const float *p, int64_t runs, int threads, int streams, int step) {
    if (streams < 1 || streams > 16 || (step != 32 && step != 64)) return NAN;
    read_args a = {p, streams, step, 0};  /* total: the bits of 0.0 */
    flashllm_parallel_for(read_share, &a, runs, threads, FINE_SHARES);
    const uint64_t bits = atomic_load(&a.total);
    double total;
    memcpy(&total, &bits, sizeof total);
    return total;
}
