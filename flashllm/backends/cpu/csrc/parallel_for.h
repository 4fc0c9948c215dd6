/* The worker pool's entry point (defined in thread_pool.h, which one translation unit includes) and
 * the share counts its callers pick per kernel. */
#ifndef FLASHLLM_PARALLEL_FOR_H
#define FLASHLLM_PARALLEL_FOR_H
#include <stdint.h>

typedef void (*flashllm_share_fn)(void *ctx, int64_t n0, int64_t n1);

/* Run fn over row shares of [0, n) on `threads` threads, about `shares_per_thread` shares each;
 * shares start at multiples of 16 rows (a product's row tiles), and 16 rows or fewer run on the caller. */
void flashllm_parallel_for(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread);

/* The same over [0, n) items that split anywhere (shares as small as one item). */
void flashllm_parallel_items(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread);

/* Shares per thread: a tiled share starts with its first block not prefetched, so where tiles read
 * fast enough for that to show (int8 and int4 codes for one token) a thread takes few shares; fp32
 * products and 16-token integer ones take many, so a thread the host slows down hands its rows to
 * the other. The 0.5b shape's 97 products of a token, two threads on `epyc3-2c` (docs/benchmarks.md),
 * fine (32) against coarse (4) shares: fp32 one token +4%, 16 tokens +7%; int8 16 tokens +4%, one
 * token -3%. */
#define COARSE_SHARES 4
#define FINE_SHARES 32

#endif
