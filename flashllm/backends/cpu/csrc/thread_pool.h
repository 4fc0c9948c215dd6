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
/* _mm_pause rounds before a worker sleeps: ~5 ms on `epyc3-2c` (docs/benchmarks.md; ~30 ns a pause).
 * The next product of a step follows within ~100 us, but between steps the engine's Python takes
 * 2-3 ms (its data cold after the weights streamed through the caches). The spin outlasts that gap:
 * a worker that sleeps in it (or in the one before the LM head) joins the next task 210-270 us
 * late, leaving the first products to the caller alone. */
#define FLASHLLM_SPIN_ROUNDS 160000

/* A task is published as one 64-bit ticket that its shares are claimed from by compare-and-swap:
 * bits 63..24 number the ticket (unique per publication), 23..16 hold the helpers taking part,
 * 15..0 the next unclaimed share (a task has at most FINE_SHARES x FLASHLLM_MAX_WORKERS = 2048).
 * Claims and completions are counted by share, not by worker, so the caller runs whatever nobody
 * claimed and waits only for shares that a worker is running. Under CPU contention (other processes
 * busy on every core) the host runs workers late: a caller that waited for every worker to wake,
 * even one with nothing left to do, would stretch a 1.5 ms decode step of the demo model to ~300 ms
 * with two busy-looping processes on `epyc4-2c` (tests/unit/test_cpu_pool_contention.py). */
#define TASK_SHIFT 24
#define HELPERS_SHIFT 16
#define FIELD_MASK 0xffffULL
#define HELPERS_MASK 0xffULL
/* _mm_pause rounds (~60 us) between two sched_yield calls of a spinning thread: on a busy host the
 * caller waiting for a worker's share, or a worker waiting for the next task, hands its core to a
 * thread that may be waiting for exactly that core; on an idle one the call returns at once.
 * With 2 busy-looping processes on `epyc4-2c`, 300 split products of 2048 x 512 take 1.1-1.4x
 * their unsplit time with these yields, 1.2-1.7x without them, and 5-50x where the caller waits for
 * every worker instead of counting shares. */
#define FLASHLLM_YIELD_ROUNDS 2048

static struct {
    pthread_mutex_t lock;          /* guards sleeping workers' wake-up and pool growth */
    pthread_cond_t wake;
    pthread_mutex_t caller;        /* one task at a time */
    atomic_long generation;        /* bumped once per task: wakes the workers */
    _Atomic uint64_t ticket;       /* task number, helpers and next share (see above) */
    atomic_int parts;              /* shares of the current task */
    atomic_int done;               /* shares of the current task finished */
    int workers;                   /* started worker threads */
    uint64_t tasks;                /* tasks published so far (the caller's, under pool.caller) */
    flashllm_share_fn fn;          /* the current task: written before its ticket is published, */
    void *ctx;                     /* read only by whoever claimed one of its shares */
    int64_t n, step;               /* rows and rows per share of the current task */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

/* Claim and run shares of the published task until none is left. A claim succeeds only against
 * the ticket word of a task still open, so a worker that wakes late can never run a share of a
 * task its caller already returned from: it finds every share claimed, or claims one of a newer
 * task whose fields that ticket published. `index` 0 is the caller; worker i joins only tasks
 * that asked for at least i helpers. */
static void run_shares(int index) {
    for (;;) {
        uint64_t word = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        const int share = (int)(word & FIELD_MASK);
        if ((int)((word >> HELPERS_SHIFT) & HELPERS_MASK) < index
            || share >= atomic_load_explicit(&pool.parts, memory_order_acquire)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &word, word + 1, memory_order_acq_rel,
                                                   memory_order_relaxed)) continue;
        const int64_t start = (int64_t)share * pool.step;
        pool.fn(pool.ctx, start, start + pool.step < pool.n ? start + pool.step : pool.n);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static long start_generation[FLASHLLM_MAX_WORKERS];  /* the generation a worker was started at */

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;  /* worker number; the caller is 0 */
    long seen = start_generation[index];   /* not a fresh load: the task that started it is newer */
    for (;;) {
        long now = seen;
        for (int spin = 1; spin <= FLASHLLM_SPIN_ROUNDS && now == seen; spin++) {
            _mm_pause();
            if (spin % FLASHLLM_YIELD_ROUNDS == 0) sched_yield();  /* a busy host: let the caller run */
            now = atomic_load_explicit(&pool.generation, memory_order_acquire);
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        run_shares(index);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: start over with no workers. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.caller, NULL);
    pool.workers = 0;
    atomic_store(&pool.ticket, 0);
    atomic_store(&pool.parts, 0);
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
    int64_t shares = (int64_t)shares_per_thread * (workers + 1);
    if (shares > 4096) shares = 4096;  /* a share number must fit the ticket's 16 bits */
    int64_t step = (n + shares - 1) / shares;
    step = (step + align - 1) / align * align;
    const int parts = (int)((n + step - 1) / step);
    /* Every share of the last task is finished (its caller waited for them), so nobody reads these
     * fields now; a share claimed from the ticket below sees them (its acquire pairs with this release). */
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.step = step;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    /* The ticket is closed (share 0xffff: past any task's parts) while parts changes: a claim that
     * read the new parts holding the last task's ticket then fails its compare-and-swap. */
    atomic_store_explicit(&pool.ticket, (++pool.tasks << TASK_SHIFT) | FIELD_MASK, memory_order_release);
    atomic_store_explicit(&pool.parts, parts, memory_order_release);
    atomic_store_explicit(&pool.ticket, (++pool.tasks << TASK_SHIFT) | ((uint64_t)workers << HELPERS_SHIFT),
                          memory_order_release);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_shares(0);
    /* wait only for the shares workers claimed and still run */
    for (int spin = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < parts; spin++) {
        _mm_pause();
        if (spin % FLASHLLM_YIELD_ROUNDS == 0) sched_yield();
    }
    pthread_mutex_unlock(&pool.caller);
}

void flashllm_parallel_for(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread) {
    run_task(fn, ctx, n, threads, shares_per_thread, FLASHLLM_ROW_ALIGN);
}

void flashllm_parallel_items(flashllm_share_fn fn, void *ctx, int64_t n, int threads, int shares_per_thread) {
    run_task(fn, ctx, n, threads, shares_per_thread, 1);
}
