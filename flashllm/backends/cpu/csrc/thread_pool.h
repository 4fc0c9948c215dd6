/* A tiny fork-safe worker pool for the decode kernels: run fn(ctx, n0, n1) over row shares of
 * [0, n) on the calling thread and up to FLASHLLM_MAX_WORKERS - 1 persistent workers.
 *
 * Why not the Python thread pool: a decode step of the 0.5b shape makes ~97 GEMV calls, and a
 * ThreadPoolExecutor hand-off costs tens of microseconds each. Workers here spin on an atomic
 * generation counter after each task, long enough to span the Python between two decode steps,
 * then sleep on a condition variable, so an idle engine costs no CPU. One caller at a time: a
 * second concurrent caller runs its whole task on its own thread instead of waiting.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "parallel_for.h"

#define FLASHLLM_MAX_WORKERS 64
#define FLASHLLM_ROW_ALIGN 16  /* flashllm_parallel_for's shares start at multiples of this many rows */
/* _mm_pause rounds before a worker sleeps: ~5 ms on the team's 2-core EPYC VM (~30 ns a pause).
 * The next product of a step follows within ~100 us, but between steps the engine's Python takes
 * 2-3 ms (its data cold after the weights streamed through the caches). With 20000 rounds (~0.6 ms)
 * the worker slept in that gap and in the one before the LM head, ~1.8 times a token at the 0.5b
 * shape, and joined the next task 210-270 us late, leaving the first products to the caller alone. */
#define FLASHLLM_SPIN_ROUNDS 160000

static struct {
    pthread_mutex_t lock;          /* guards sleeping workers' wake-up and pool growth */
    pthread_cond_t wake;
    pthread_mutex_t caller;        /* one task at a time */
    atomic_long generation;        /* bumped once per task */
    atomic_int pending;            /* workers still claiming shares of the current task */
    atomic_int next_share;         /* the next unclaimed share */
    int workers;                   /* started worker threads */
    flashllm_share_fn fn;
    void *ctx;
    int64_t n, step;               /* rows and rows per share of the current task */
    int parts, helpers;            /* shares of the current task; workers taking part in it */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

/* Every participant claims shares until none is left: a vCPU the host stalls for a while leaves
 * its rows to the others instead of making the whole task wait for it. */
static void run_shares(void) {
    for (;;) {
        const int i = atomic_fetch_add_explicit(&pool.next_share, 1, memory_order_relaxed);
        if (i >= pool.parts) return;
        const int64_t start = (int64_t)i * pool.step;
        pool.fn(pool.ctx, start, start + pool.step < pool.n ? start + pool.step : pool.n);
    }
}

static long start_generation[FLASHLLM_MAX_WORKERS];  /* the generation a worker was started at */

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;  /* worker number; the caller is 0 */
    long seen = start_generation[index];   /* not a fresh load: the task that started it is newer */
    for (;;) {
        long now = seen;
        for (int spin = 0; spin < FLASHLLM_SPIN_ROUNDS && now == seen; spin++) {
            _mm_pause();
            now = atomic_load_explicit(&pool.generation, memory_order_acquire);
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        if (index <= pool.helpers) {
            run_shares();
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
        }
    }
    return NULL;
}

/* A forked child has none of the parent's threads: start over with no workers. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.caller, NULL);
    pool.workers = 0;
}

static int pool_grow(int wanted) {  /* called with pool.lock held; returns the workers running */
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        atfork_done = 1;
    }
    while (pool.workers < wanted && pool.workers < FLASHLLM_MAX_WORKERS - 1) {
        pthread_t thread;
        start_generation[pool.workers + 1] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, worker_main, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        pthread_detach(thread);
        pool.workers++;
    }
    return pool.workers;
}

/* Run fn over [0, n) in shares (starting at multiples of `align`) that `threads` threads claim
 * dynamically, about `shares_per_thread` each: finer shares balance threads the host runs at
 * different speeds, coarser ones keep a kernel's per-share start-up (a tile's prefetch of its
 * first block) rare; the callers pick per kernel. A task of at most `align` runs on the caller. */
static void run_task(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread, int64_t align) {
    if (threads <= 1 || n <= align || pthread_mutex_trylock(&pool.caller) != 0) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    int workers = pool_grow(threads - 1);
    if (workers > threads - 1) workers = threads - 1;  /* the pool may be larger than this call wants */
    const int64_t parts = (int64_t)shares_per_thread * (workers + 1);
    int64_t step = (n + parts - 1) / parts;
    step = (step + align - 1) / align * align;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.step = step;
    pool.parts = (int)((n + step - 1) / step);
    pool.helpers = workers;
    atomic_store(&pool.next_share, 0);
    atomic_store(&pool.pending, workers);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_shares();
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&pool.caller);
}

void flashllm_parallel_for(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread) {
    run_task(fn, ctx, n, threads, shares_per_thread, FLASHLLM_ROW_ALIGN);
}

void flashllm_parallel_items(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread) {
    run_task(fn, ctx, n, threads, shares_per_thread, 1);
}
