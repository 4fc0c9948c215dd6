/* One-token paged attention for x86 CPUs with AVX2 and FMA (the decode step's attention op).
 *
 * Sequence b's query is row rows[b] of q (Hq heads of D, row stride q_stride), its context the
 * first seq_lens[b] slots of blocks block_tables[b * width ...]; caches (blocks, block_size, Hk, D).
 * Out row rows[b] (Hq * D contiguous) gets softmax(q k^T * scale) v per head; query head h reads
 * KV head h / (Hq / Hk).
 *
 * The work is split the way GQA and a long context allow:
 * - An item is one sequence's KV head and one part of its context. It takes all the query heads
 *   that share the KV head (up to GROUP_AT_ONCE at a time), so each key and value row comes from
 *   memory once for the group, not once per query head.
 * - A context longer than PART_MIN slots is cut into parts of PART_MIN or more slots, at most
 *   PARTS_MAX, so that at batch 1 a long context is shared by every thread. Each part leaves its
 *   running maximum, sum and unnormalised output; a pass over the rows merges them. A row's parts
 *   depend only on its own length, never on the threads or the other rows of the batch, so a row
 *   gets the same bits alone, beside a verify step's rows or in a batch of any size
 *   (tests/unit/test_cpu_attention_rows.py). Where they depended on the batch, a sequence's tokens
 *   did too: SmolLM2's GGUF file rounds every product's input to int8, which turns a last-bit
 *   difference in attention into logprobs 0.1-0.2 apart and flipped greedy tokens between a batch
 *   of four and each request alone.
 * - Within an item the softmax is the online one over chunks of CHUNK slots (a running maximum,
 *   earlier sums rescaled when it grows), so no scratch grows with the context.
 * - Consecutive rows of one sequence (a speculative verify step's 1 + k rows: lengths a row apart,
 *   the same blocks) form a run, and an item is the run's KV head and part: its rows' chunks are
 *   taken together, WINDOW slots at a time over all the rows, so keys and values come from memory
 *   once for the run, not once a row. Each row keeps its own parts, chunks and sums in their order,
 *   so its bits are those it gets alone (tests/unit/test_cpu_attention_rows.py).
 *
 * Scores take 8 slots at a time: 8 dot products of D accumulate in 8 vectors, and a tree of
 * horizontal adds turns them into one vector of 8 scores. One head, one slot and one horizontal
 * sum at a time costs ~82 us a layer at batch 1 for 14 heads over ~190 slots, 2% of a 0.5b-shape
 * token on `epyc3-2c` (docs/benchmarks.md).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_kernels.h"
#include "parallel_for.h"
#include "simd.h"

#define CHUNK 256
#define GROUP_AT_ONCE 8
#define PART_MIN 64
/* Parts of a long context at most. More parts share a long context among more threads at batch 1;
 * each costs a partial output to merge, for every row of a large batch too (the merge runs over
 * the rows on all threads). */
#define PARTS_MAX 8
/* Value rows summed for every head of a group before the next rows. Summing all of a chunk's rows
 * for one head, then again for the next, walks up to 64 KiB of values per head, more than L1 holds.
 * With the vector maximum below, slices of 32 rows run the kernel 1.07-1.40x the head-by-head sums
 * (benchmarks/cpu/attention_ab.py on `epyc3-2c`, docs/benchmarks.md: batch 1 at 64 to 4096 slots,
 * 16 x 256, 64 x 512; one and two threads); 16 and 64 rows are no better.
 * Each output still sums its rows in order, so the bits are the same either way. */
#define VALUE_SLICE 32
/* Slots of a run's chunk taken for all its rows before the next: 8 KiB of keys or values at D 64. */
#define WINDOW VALUE_SLICE
#define RUN_MAX 16 /* a verify step's 1 + k rows for k up to 15 */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    const int64_t *rows;
    int64_t q_stride, width, Hq, Hk, D, block_size, parts_max;
    float scale;
    float *out;
    float *partial; /* (B, Hk, parts_max, Hq / Hk, D + 2): output, maximum, sum; NULL when parts_max is 1 */
    const int64_t *run_first; /* run r is rows run_first[r] .. run_first[r + 1] - 1; NULL: one row each */
} attention_args;

/* The most rows of one sequence attended together (flashllm_attention_set_run_rows; 1: each row
 * alone), and how many calls took a run of two rows or more (for tests). */
static int run_rows_max = RUN_MAX;
static int64_t runs_taken;

/* The parts a context of `length` slots is cut into, and the slots of each but the last (a multiple
 * of 8): a function of the length alone (see the top of this file); 1 part where a->parts_max is 1
 * (no memory for the parts' outputs). */
static void parts_of(const attention_args *a, int64_t length, int64_t *parts, int64_t *span) {
    int64_t p = (length + PART_MIN - 1) / PART_MIN;
    p = p < PARTS_MAX ? (p > 0 ? p : 1) : PARTS_MAX;
    p = p < a->parts_max ? p : a->parts_max;
    const int64_t s = ((length + p - 1) / p + 7) & ~(int64_t)7;
    *parts = length > 0 ? (length + s - 1) / s : 1;
    *span = s;
}

/* The key and value rows of KV head kvh for slots s0 .. s0 + n - 1 of a block table. */
static void slot_rows(const attention_args *a, const int32_t *table, int64_t s0, int64_t n, int64_t kvh,
                      const float **k, const float **v) {
    const int64_t bs = a->block_size, slot_floats = a->Hk * a->D;
    int64_t block = s0 / bs, offset = s0 % bs;
    for (int64_t i = 0; i < n; i++) {
        const int64_t at = ((int64_t)table[block] * bs + offset) * slot_floats + kvh * a->D;
        k[i] = a->k_cache + at;
        v[i] = a->v_cache + at;
        if (++offset == bs) {
            offset = 0;
            block++;
        }
    }
}

/* The 8 dot products of q with rows k[0..7] (D a multiple of 8) as one vector. */
static inline __m256 dot8(const float *q, const float *const *k, int64_t D) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), acc[j]);
    }
    /* lanes 0-3 of acc[j] end in lane j of the low half, lanes 4-7 in lane j of the high half */
    const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The largest of s[0..n-1]; NaNs are passed over, as `s[i] > m ? s[i] : m` passes them. In vectors,
 * as that scalar loop's every compare waits on the one before: the vector form runs the whole kernel
 * 1.04-1.21x faster in attention_ab.py's cases (`epyc3-2c`). */
static inline float largest(const float *s, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(s + i), m8);  /* NaN lane: keeps m8 */
    float m = hmax8(m8);  /* no lane of m8 is NaN */
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

static inline float dot1(const float *q, const float *k, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    float sum = hsum8(acc);
    for (; d < D; d++) sum += q[d] * k[d];
    return sum;
}

static inline void scale_row(float *v, int64_t n, float factor) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(v + d, _mm256_mul_ps(_mm256_loadu_ps(v + d), _mm256_set1_ps(factor)));
    for (; d < n; d++) v[d] *= factor;
}

/* o (D) += sum over i < n of p[i] * v[i] (rows of D). 64 features at a time stay in 8 registers
 * across all n rows (an accumulator chain per vector, no store-to-load round trip per row); then
 * 8 at a time, then one at a time. */
static void add_values(const float *const *v, int64_t n, int64_t D, const float *p, float *o) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(o + d + 8 * j);
        for (int64_t i = 0; i < n; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v[i] + d + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d + 8 * j, acc[j]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_loadu_ps(o + d);
        for (int64_t i = 0; i < n; i++) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v[i] + d), acc);
        _mm256_storeu_ps(o + d, acc);
    }
    for (; d < D; d++)
        for (int64_t i = 0; i < n; i++) o[d] += p[i] * v[i][d];
}

/* Scores of query heads q (heads rows of D) against a chunk's slots i0 <= i < i1 (krows from the
 * chunk's start), times the scale, into scores[j][i]. i0 is a multiple of 8 and i1 one too or the
 * chunk's end, so whether a slot's score comes from dot8 or dot1 (their sums differ in the last
 * bit) depends only on the chunk, not on how its slots are split into calls. */
static void chunk_scores(const attention_args *a, const float *q, int heads, const float *const *krows, int64_t i0,
                         int64_t i1, float (*scores)[CHUNK]) {
    const int64_t D = a->D, tail = D % 8, body = D - tail;
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const float *const *k = krows + i;
        for (int j = 0; j < heads; j++) {
            __m256 s = dot8(q + j * D, k, body);
            if (tail) {
                float extra[8];
                for (int r = 0; r < 8; r++) extra[r] = dot1(q + j * D + body, k[r] + body, tail);
                s = _mm256_add_ps(s, _mm256_loadu_ps(extra));
            }
            _mm256_storeu_ps(scores[j] + i, _mm256_mul_ps(s, _mm256_set1_ps(a->scale)));
        }
    }
    for (; i < i1; i++)
        for (int j = 0; j < heads; j++) scores[j][i] = dot1(q + j * D, krows[i], D) * a->scale;
}

/* The online softmax's step for a chunk of n scores per head: each head's running maximum top[j]
 * (its output and sum rescaled when it grows), the scores replaced by their exponentials, added to total[j]. */
static void chunk_softmax(int heads, int64_t n, int64_t D, float (*scores)[CHUNK], float *o, int64_t o_stride,
                          float *top, float *total) {
    for (int j = 0; j < heads; j++) {
        float *sj = scores[j], *oj = o + j * o_stride, chunk_top = largest(sj, n);
        if (chunk_top > top[j]) {  /* rescale what was summed under the old maximum */
            const float factor = expf(top[j] - chunk_top);  /* 0 on the first chunk */
            total[j] *= factor;
            scale_row(oj, D, factor);
            top[j] = chunk_top;
        }
        __m256 sum8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sj + i), _mm256_set1_ps(top[j])));
            _mm256_storeu_ps(sj + i, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        total[j] += hsum8(sum8);
        for (; i < n; i++) {
            sj[i] = expf(sj[i] - top[j]);
            total[j] += sj[i];
        }
    }
}

/* Each head's o + j * o_stride += the weights scores[j][i] times value rows vrows[i], i0 <= i < i1.
 * Every output sums its rows in slot order, so splitting a chunk's slots into calls keeps its bits. */
static void chunk_values(int heads, int64_t D, const float *const *vrows, int64_t i0, int64_t i1,
                         float (*scores)[CHUNK], float *o, int64_t o_stride) {
    for (int j = 0; j < heads; j++) add_values(vrows + i0, i1 - i0, D, scores[j] + i0, o + j * o_stride);
}

/* Each head's output zeroed, its running maximum -inf and its sum 0: no slot seen yet. */
static void start_heads(int heads, int64_t D, float *o, int64_t o_stride, float *top, float *total) {
    for (int j = 0; j < heads; j++) {
        top[j] = -INFINITY;
        total[j] = 0.0f;
        for (int64_t d = 0; d < D; d++) o[j * o_stride + d] = 0.0f;
    }
}

/* Query heads h0 .. h0 + heads - 1 (all reading KV head kvh) of sequence b over slots s0 <= s < s1:
 * each head's unnormalised output into o + j * o_stride, its maximum and sum into top[j], total[j]. */
static void attend_slots(const attention_args *a, int64_t b, int64_t kvh, int64_t h0, int heads, int64_t s0,
                         int64_t s1, float *o, int64_t o_stride, float *top, float *total) {
    const int64_t D = a->D;
    const int32_t *table = a->block_tables + b * a->width;
    const float *q = a->q + a->rows[b] * a->q_stride + h0 * D, *krows[CHUNK], *vrows[CHUNK];
    float scores[GROUP_AT_ONCE][CHUNK];
    start_heads(heads, D, o, o_stride, top, total);
    for (int64_t c0 = s0; c0 < s1; c0 += CHUNK) {
        const int64_t n = s1 - c0 < CHUNK ? s1 - c0 : CHUNK;
        slot_rows(a, table, c0, n, kvh, krows, vrows);
        chunk_scores(a, q, heads, krows, 0, n, scores);
        chunk_softmax(heads, n, D, scores, o, o_stride, top, total);
        /* the group's value sums a slice of rows at a time, so the slice stays in L1 for all its heads */
        for (int64_t i = 0; i < n; i += VALUE_SLICE)
            chunk_values(heads, D, vrows, i, i + VALUE_SLICE < n ? i + VALUE_SLICE : n, scores, o, o_stride);
    }
}

/* Where query heads h0 .. h0 + heads - 1 of sequence b's part `part` go: out (normalised later) for
 * a context in one part, else the part's place in partial (item = (b * Hk + kvh) * parts_max + part). */
static float *part_output(const attention_args *a, int64_t b, int64_t kvh, int64_t part, int64_t parts, int64_t g,
                          int64_t *o_stride) {
    const int64_t group = a->Hq / a->Hk, D = a->D;
    *o_stride = parts == 1 ? D : D + 2;
    if (parts == 1) return a->out + a->rows[b] * a->Hq * D + (kvh * group + g) * D;
    return a->partial + (((b * a->Hk + kvh) * a->parts_max + part) * group + g) * (D + 2);
}

/* A finished part: a whole context's heads normalised, a part's maximum and sum kept beside its output. */
static void end_part(int64_t parts, int heads, int64_t D, float *o, const float *top, const float *total) {
    for (int j = 0; j < heads; j++) {
        if (parts == 1) {
            scale_row(o + j * D, D, 1.0f / total[j]);
        } else {
            o[j * (D + 2) + D] = top[j];
            o[j * (D + 2) + D + 1] = total[j];
        }
    }
}

/* Part `part` of sequence b's context for KV head kvh, all its query heads. */
static void attend_part(const attention_args *a, int64_t b, int64_t kvh, int64_t part) {
    const int64_t group = a->Hq / a->Hk, D = a->D;
    int64_t parts, span;
    parts_of(a, a->seq_lens[b], &parts, &span);
    if (part >= parts) return;
    const int64_t s0 = part * span, s1 = s0 + span < a->seq_lens[b] ? s0 + span : a->seq_lens[b];
    for (int64_t g = 0; g < group; g += GROUP_AT_ONCE) {
        const int heads = (int)(group - g < GROUP_AT_ONCE ? group - g : GROUP_AT_ONCE);
        float top[GROUP_AT_ONCE], total[GROUP_AT_ONCE], *o;
        int64_t o_stride;
        o = part_output(a, b, kvh, part, parts, g, &o_stride);
        attend_slots(a, b, kvh, kvh * group + g, heads, s0, s1, o, o_stride, top, total);
        end_part(parts, heads, D, o, top, total);
    }
}

/* One row of a run: its part's slots, where its heads' outputs go, their running maxima and sums,
 * and its chunk's key and value rows and scores (in the run's scratch). */
typedef struct {
    int64_t b, parts, s0, s1, o_stride;
    float *o, top[GROUP_AT_ONCE], total[GROUP_AT_ONCE];
    const float **krows, **vrows;
    float (*scores)[CHUNK];
} run_row;

/* Row `row`'s chunk c: its first slot in *c0 and its slot count (0 where the row's part is shorter). */
static int64_t row_chunk(const run_row *row, int64_t c, int64_t *c0) {
    *c0 = row->s0 + c * CHUNK;
    if (*c0 >= row->s1) return 0;
    return row->s1 - *c0 < CHUNK ? row->s1 - *c0 : CHUNK;
}

/* Chunk c of every row of a run, WINDOW slots at a time over all the rows: the scores of query heads
 * h0 .. h0 + heads - 1 (values 0) or their value sums (values 1). The rows' chunks overlap (one
 * sequence, lengths a row apart), so a window's keys or values come from memory once for the run and
 * from L1 for every further row. Windows start at multiples of 8 (so do chunks), as chunk_scores wants. */
static void run_windows(const attention_args *a, run_row *rr, int R, int64_t c, int heads, int64_t h0, int values) {
    int64_t lo = INT64_MAX, hi = 0, c0, n;
    for (int r = 0; r < R; r++) {
        if (!(n = row_chunk(rr + r, c, &c0))) continue;
        lo = c0 < lo ? c0 : lo;
        hi = c0 + n > hi ? c0 + n : hi;
    }
    for (int64_t w = lo; w < hi; w += WINDOW)
        for (int r = 0; r < R; r++) {
            n = row_chunk(rr + r, c, &c0);
            const int64_t i0 = w > c0 ? w - c0 : 0, i1 = w + WINDOW - c0 < n ? w + WINDOW - c0 : n;
            if (i0 >= i1) continue;
            if (values) {
                chunk_values(heads, a->D, rr[r].vrows, i0, i1, rr[r].scores, rr[r].o, rr[r].o_stride);
            } else {
                const float *q = a->q + a->rows[rr[r].b] * a->q_stride + h0 * a->D;
                chunk_scores(a, q, heads, rr[r].krows, i0, i1, rr[r].scores);
            }
        }
}

/* Rows b0 .. b0 + R - 1 (one sequence: run_rows) over part `part` of each one's context, KV head kvh:
 * per row the same chunks, scores, softmax steps and value sums in the same order as attend_part
 * gives it alone (so the same bits), with the rows taken together a chunk and a window at a time. */
static void attend_run(const attention_args *a, int64_t b0, int R, int64_t kvh, int64_t part) {
    const int64_t group = a->Hq / a->Hk, D = a->D;
    const int heads_max = (int)(group < GROUP_AT_ONCE ? group : GROUP_AT_ONCE);
    const size_t row_bytes = 2 * CHUNK * sizeof(float *) + (size_t)heads_max * CHUNK * sizeof(float);
    char *scratch = malloc(R * row_bytes);
    if (!scratch) {  /* no room for the run's chunks: each row alone (the same bits) */
        for (int r = 0; r < R; r++) attend_part(a, b0 + r, kvh, part);
        return;
    }
    run_row rr[RUN_MAX];
    int n = 0;
    int64_t chunks = 0, span, c0;
    for (int r = 0; r < R; r++) {
        run_row *row = rr + n;
        row->b = b0 + r;
        parts_of(a, a->seq_lens[row->b], &row->parts, &span);
        if (part >= row->parts) continue;
        row->s0 = part * span;
        row->s1 = row->s0 + span < a->seq_lens[row->b] ? row->s0 + span : a->seq_lens[row->b];
        row->krows = (const float **)(scratch + n * row_bytes);
        row->vrows = row->krows + CHUNK;
        row->scores = (float (*)[CHUNK])(row->vrows + CHUNK);
        const int64_t row_chunks = (row->s1 - row->s0 + CHUNK - 1) / CHUNK;
        chunks = row_chunks > chunks ? row_chunks : chunks;
        n++;
    }
    for (int64_t g = 0; g < group; g += GROUP_AT_ONCE) {
        const int heads = (int)(group - g < GROUP_AT_ONCE ? group - g : GROUP_AT_ONCE);
        const int64_t h0 = kvh * group + g;
        for (int r = 0; r < n; r++) {
            rr[r].o = part_output(a, rr[r].b, kvh, part, rr[r].parts, g, &rr[r].o_stride);
            start_heads(heads, D, rr[r].o, rr[r].o_stride, rr[r].top, rr[r].total);
        }
        for (int64_t c = 0; c < chunks; c++) {
            for (int r = 0; r < n; r++) {
                const int64_t m = row_chunk(rr + r, c, &c0);
                if (m) slot_rows(a, a->block_tables + rr[r].b * a->width, c0, m, kvh, rr[r].krows, rr[r].vrows);
            }
            run_windows(a, rr, n, c, heads, h0, 0);
            for (int r = 0; r < n; r++) {
                const int64_t m = row_chunk(rr + r, c, &c0);
                if (m) chunk_softmax(heads, m, D, rr[r].scores, rr[r].o, rr[r].o_stride, rr[r].top, rr[r].total);
            }
            run_windows(a, rr, n, c, heads, h0, 1);
        }
        for (int r = 0; r < n; r++) end_part(rr[r].parts, heads, D, rr[r].o, rr[r].top, rr[r].total);
    }
    free(scratch);
}

/* Items i0 <= i < i1, i = (run * Hk + kvh) * parts_max + part: a run of one row is attend_part's,
 * a longer one attend_run's. Without run_first every row is a run. */
static void attend_items(void *ctx, int64_t i0, int64_t i1) {
    const attention_args *a = ctx;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t part = item % a->parts_max, kvh = item / a->parts_max % a->Hk;
        const int64_t run = item / (a->parts_max * a->Hk);
        const int64_t b0 = a->run_first ? a->run_first[run] : run;
        const int R = a->run_first ? (int)(a->run_first[run + 1] - b0) : 1;
        if (R == 1) {
            attend_part(a, b0, kvh, part);
        } else {
            attend_run(a, b0, R, kvh, part);
        }
    }
}

/* Whether row b continues row b - 1's sequence: one longer, the same blocks under its context. */
static int same_sequence(const attention_args *a, int64_t b) {
    const int32_t *table = a->block_tables + b * a->width;
    if (a->seq_lens[b] != a->seq_lens[b - 1] + 1) return 0;
    const int64_t blocks = (a->seq_lens[b] + a->block_size - 1) / a->block_size;
    return memcmp(table, table - a->width, (size_t)blocks * sizeof(int32_t)) == 0;
}

/* The runs of rows of one sequence (at most run_rows_max each) in run_first (B + 1 entries);
 * their count, or B (and run_first NULL) where every row is its own. */
static int64_t find_runs(attention_args *a, int64_t B) {
    a->run_first = NULL;
    if (run_rows_max < 2 || B < 2) return B;
    int64_t *first = malloc((size_t)(B + 1) * sizeof(int64_t)), runs = 0;
    if (!first) return B;
    for (int64_t b = 0; b < B; b++)
        if (b == 0 || b - first[runs - 1] >= run_rows_max || !same_sequence(a, b)) first[runs++] = b;
    first[runs] = B;
    if (runs == B) {  /* no two rows share a sequence */
        free(first);
        return B;
    }
    __atomic_fetch_add(&runs_taken, 1, __ATOMIC_RELAXED);
    a->run_first = first;
    return runs;
}

int flashllm_attention_set_run_rows(int rows) {
    if (rows >= 1 && rows <= RUN_MAX) run_rows_max = rows;
    return run_rows_max;
}

int64_t flashllm_attention_runs_taken(void) {
    return __atomic_load_n(&runs_taken, __ATOMIC_RELAXED);
}

/* out for the heads of rows b0 <= b < b1 whose context was cut into parts: the parts' outputs, each
 * weighted by e^(its maximum - the overall maximum), over the likewise weighted sums. */
static void merge_parts(void *ctx, int64_t b0, int64_t b1) {
    const attention_args *a = ctx;
    const int64_t group = a->Hq / a->Hk, D = a->D;
    for (int64_t b = b0; b < b1; b++) {
        int64_t parts, span;
        parts_of(a, a->seq_lens[b], &parts, &span);
        if (parts == 1) continue;
        for (int64_t h = 0; h < a->Hq; h++) {
            const int64_t first = (b * a->Hk + h / group) * a->parts_max, g = h % group;
            float *o = a->out + a->rows[b] * a->Hq * D + h * D, top = -INFINITY, total = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float m = a->partial[((first + p) * group + g) * (D + 2) + D];
                top = m > top ? m : top;
            }
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float *part = a->partial + ((first + p) * group + g) * (D + 2);
                const float weight = expf(part[D] - top);
                total += weight * part[D + 1];
                for (int64_t d = 0; d < D; d++) o[d] += weight * part[d];
            }
            scale_row(o, D, 1.0f / total);
        }
    }
}

void flashllm_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t width, const int32_t *seq_lens,
                               const int64_t *rows, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, float *out, int threads) {
    attention_args a = {q, k_cache, v_cache, block_tables, seq_lens, rows, q_stride, width, Hq, Hk, D,
                        block_size, 1, scale, out, NULL, NULL};
    a.parts_max = PARTS_MAX;  /* parts_of's cap while the rows are counted */
    int64_t most = 1;
    for (int64_t b = 0; b < B; b++) {
        int64_t parts, span;
        parts_of(&a, seq_lens[b], &parts, &span);
        most = parts > most ? parts : most;
    }
    a.parts_max = most;
    if (most > 1) {
        a.partial = malloc((size_t)(B * Hk * most * (Hq / Hk) * (D + 2)) * sizeof(float));
        if (!a.partial && B > 1) {  /* no memory for the batch's parts: one row at a time (the same bits) */
            for (int64_t b = 0; b < B; b++)
                flashllm_decode_attention(q, q_stride, k_cache, v_cache, block_tables + b * width, width, seq_lens + b,
                                          rows + b, 1, Hq, Hk, D, block_size, scale, out, threads);
            return;
        }
        if (!a.partial) a.parts_max = 1;  /* not even a row's: its context whole (other bits) */
    }
    const int64_t runs = find_runs(&a, B);
    flashllm_parallel_items(attend_items, &a, runs * Hk * a.parts_max, threads, FINE_SHARES);
    free((void *)a.run_first);
    if (a.partial) {
        flashllm_parallel_items(merge_parts, &a, B, threads, FINE_SHARES);
        free(a.partial);
    }
}
