/* The pick both greedy screen copies share (greedy_screen.c's bf16 copy, greedy_screen_int8.c's
 * int8 one; the proof is in flashllm/backends/cpu/greedy_screen.py): from a token's scores and
 * each row's bound, the rows whose fp32 logits could be the largest, those logits, and their argmax. */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>

#include "parallel_for.h"
#include "simd.h"

/* The fp32 logit of one row: four 8-lane chains over 32 features a step, then the leftover features
 * in order. The same order for a row wherever it is and whatever else is picked. */
static float fixed_dot(const float *x, const float *row, int64_t K) {
    const int64_t body = K / 32 * 32;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < body; k += 32)
        for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), a[j]);
    float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    for (int64_t k = body; k < K; k++) sum = fmaf(row[k], x[k], sum);
    return sum;
}

/* ||x|| in double: every square of a float is exact in double, and their sum is within K 2^-53 of
 * its exact value, far inside the 2^-20 the caller's factor adds for it. */
static double norm_of(const float *x, int64_t K) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int j = 0; j < 4; j++) s[j] += (double)x[k + j] * x[k + j];
    for (; k < K; k++) s[0] += (double)x[k] * x[k];
    return sqrt((s[0] + s[1]) + (s[2] + s[3]));
}

/* The float nearest v, or the next one up where that fell below v (NaN stays NaN) */
static float up_to_float(double v) {
    const float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* Pick work is split into items: each token's rows in `parts` row ranges (more than one where there
 * are fewer tokens than threads, so a batch-1 step's two passes over the 151,936 scores and their
 * bounds, ~0.17 ms on one thread as they come cold after the head's stream, run on every thread). */
#define PICK_MAX_ITEMS 64

typedef struct {
    const float *x, *w, *scores, *b;
    double factor, floor0, floor1;
    int64_t K, N, ldy, parts;
    float ct[PICK_MAX_ITEMS], dt[PICK_MAX_ITEMS];  /* a token's margin factor and floor, rounded up */
    float low[PICK_MAX_ITEMS];                     /* an item's largest s_n - m_n (pass 1) */
    int finite[PICK_MAX_ITEMS];                    /* whether all of an item's scores are finite (pass 1) */
    float best[PICK_MAX_ITEMS];                    /* an item's largest picked logit (pass 2) */
    int64_t best_n[PICK_MAX_ITEMS];                /* its row; -1 none picked, -2 a non-finite logit */
    _Atomic int64_t picked;
} pick_args;

/* Item i's token and rows [*n0, *n1): part p of token i / parts, parts starting on multiples of 8 */
static int64_t item_rows(const pick_args *a, int64_t i, int64_t *n0, int64_t *n1) {
    const int64_t p = i % a->parts, groups = a->N / 8;
    *n0 = groups * p / a->parts * 8;
    *n1 = p + 1 == a->parts ? a->N : groups * (p + 1) / a->parts * 8;
    return i / a->parts;
}

/* Pass 1 over items i0..i1: each item's largest s_n - m_n and whether its scores are finite */
static void pick_floor_share(void *ctx, int64_t i0, int64_t i1) {
    pick_args *a = ctx;
    for (int64_t i = i0; i < i1; i++) {
        int64_t n0, n1;
        const int64_t t = item_rows(a, i, &n0, &n1);
        const float *s = a->scores + t * a->ldy, *b = a->b, ct = a->ct[t], dt = a->dt[t];
        const __m256 cv = _mm256_set1_ps(ct), dv = _mm256_set1_ps(dt);
        __m256 low = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8) {
            const __m256 sv = _mm256_loadu_ps(s + n);
            low = _mm256_max_ps(low, _mm256_sub_ps(sv, _mm256_fmadd_ps(cv, _mm256_loadu_ps(b + n), dv)));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(sv, sv), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        }
        float floor_ = hmax8(low);
        int finite = _mm256_movemask_ps(bad) == 0;
        for (; n < n1; n++) {
            finite &= isfinite(s[n]);
            const float lo = s[n] - fmaf(ct, b[n], dt);
            if (lo > floor_) floor_ = lo;
        }
        a->low[i] = floor_;
        a->finite[i] = finite;
    }
}

/* A token's floor max_j (s_j - m_j) over its items, or NaN where a score is not finite. Any value no
 * larger than that maximum keeps the pick sound (the argmax row's s_n + m_n is at least it), so a
 * NaN item floor that a max skips only widens the pick. */
static float token_floor(const pick_args *a, int64_t t) {
    float floor_ = -INFINITY;
    for (int64_t i = t * a->parts; i < (t + 1) * a->parts; i++) {
        if (!a->finite[i]) return NAN;
        if (a->low[i] > floor_) floor_ = a->low[i];
    }
    return floor_;
}

/* Pass 2 over items i0..i1: the fixed_dot of every row with s_n + m_n >= its token's floor, and the
 * largest (the first on ties), or -2 at the first non-finite one */
static void pick_rows_share(void *ctx, int64_t i0, int64_t i1) {
    pick_args *a = ctx;
    for (int64_t i = i0; i < i1; i++) {
        int64_t n0, n1;
        const int64_t t = item_rows(a, i, &n0, &n1);
        const float *s = a->scores + t * a->ldy, *b = a->b, *xt = a->x + t * a->K, ct = a->ct[t], dt = a->dt[t];
        const float floor_ = token_floor(a, t);
        const __m256 cv = _mm256_set1_ps(ct), dv = _mm256_set1_ps(dt), fv = _mm256_set1_ps(floor_);
        int64_t best_n = -1, picked = 0;
        float best = -INFINITY;
        for (int64_t n = n0; isfinite(floor_) && n < n1 && best_n != -2; n += 8) {
            int mask = 0;
            if (n + 8 <= n1) {
                const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(s + n), _mm256_fmadd_ps(cv, _mm256_loadu_ps(b + n), dv));
                mask = _mm256_movemask_ps(_mm256_cmp_ps(hi, fv, _CMP_GE_OQ));
            } else {
                for (int64_t j = n; j < n1; j++) mask |= (s[j] + fmaf(ct, b[j], dt) >= floor_) << (j - n);
            }
            for (; mask; mask &= mask - 1) {  /* the picked rows in order */
                const int64_t row = n + __builtin_ctz(mask);
                const float v = fixed_dot(xt, a->w + row * a->K, a->K);
                picked++;
                if (!isfinite(v)) { best_n = -2; break; }
                if (best_n < 0 || v > best) { best = v; best_n = row; }
            }
        }
        a->best[i] = best;
        a->best_n[i] = best_n;
        atomic_fetch_add(&a->picked, picked);
    }
}

/* For each token t < T, with scores s = scores + t * ldy (N of them) and margins m_n = c_t * b[n] + d_t,
 * where c_t = factor ||x_t|| and d_t = floor0 + floor1 ||x_t||, both rounded up to floats:
 * out[t] = the row with the largest fixed_dot(x_t, w_n) (the first on ties) among the rows with
 * s_n + m_n >= max_j (s_j - m_j); -1 where a score or a picked row's logit is not finite (the caller
 * then takes that token's full logits). counts[0]: the rows computed over all tokens, counts[1]: the
 * tokens left at -1. Tokens, and with fewer tokens than threads each token's rows, are split over the
 * worker pool. The margins are worked out here rather than by the caller: a handful of torch ops on
 * one token cost ~0.3 ms there, run just after the head's copy streamed through the caches
 * (`intel-2c`, docs/benchmarks.md). */
void flashllm_screen_pick(const float *x, int64_t T, int64_t K, const float *w, const float *scores, int64_t N,
                          int64_t ldy, const float *b, double factor, double floor0, double floor1, int64_t *out,
                          int64_t *counts, int threads) {
    counts[0] = counts[1] = 0;
    for (int64_t t0 = 0; t0 < T; t0 += PICK_MAX_ITEMS) {  /* at most PICK_MAX_ITEMS tokens a round */
        const int64_t tokens = T - t0 < PICK_MAX_ITEMS ? T - t0 : PICK_MAX_ITEMS;
        int64_t parts = threads > tokens ? threads / tokens : 1;
        if (parts * tokens > PICK_MAX_ITEMS) parts = PICK_MAX_ITEMS / tokens;
        if (parts > N / 8) parts = N / 8 > 0 ? N / 8 : 1;
        pick_args *a = &(pick_args){.x = x + t0 * K, .w = w, .scores = scores + t0 * ldy, .b = b, .factor = factor,
                                    .floor0 = floor0, .floor1 = floor1, .K = K, .N = N, .ldy = ldy, .parts = parts};
        for (int64_t t = 0; t < tokens; t++) {
            const double norm = norm_of(a->x + t * K, K);
            a->ct[t] = up_to_float(factor * norm);
            a->dt[t] = up_to_float(floor0 + floor1 * norm);
        }
        flashllm_parallel_items(pick_floor_share, a, tokens * parts, threads, 1);
        flashllm_parallel_items(pick_rows_share, a, tokens * parts, threads, 1);
        for (int64_t t = 0; t < tokens; t++) {
            int64_t best_n = -1;
            float best = -INFINITY;
            for (int64_t i = t * parts; i < (t + 1) * parts && best_n != -2; i++) {  /* parts in row order */
                if (a->best_n[i] == -2) best_n = -2;
                else if (a->best_n[i] >= 0 && (best_n < 0 || a->best[i] > best)) { best = a->best[i]; best_n = a->best_n[i]; }
            }
            out[t0 + t] = best_n < 0 ? -1 : best_n;
            counts[1] += best_n < 0;
        }
        counts[0] += atomic_load(&a->picked);
    }
}
