/* The threads pdserve's CPU kernels share their work with.
 *
 * A job is n items (a matmul's groups of output columns, an attention's
 * sequence and KV head pairs). The calling thread takes items itself, in
 * chunks, from a shared counter; helper threads that are awake take chunks
 * from the same counter. The caller never waits for a helper to start: it
 * takes every chunk nobody has claimed, and waits only for chunks a helper
 * is computing. So a helper pays only where its core is free: on a host
 * whose other cores are busy (a router, HTTP, clients, another engine) the
 * caller does the whole job alone, at one thread's speed, instead of
 * waiting on a descheduled thread as OpenMP's fork-join does.
 *
 * Helpers spin for a short while after a job (a round's jobs come a few
 * microseconds apart), then sleep on a futex, so between rounds they
 * leave their cores to the rest of the host. Every item is computed by one
 * thread in one order, so results do not depend on which thread ran it.
 * One job at a time: a call made while another is in flight (another
 * thread's) runs alone. Built and loaded by native.py. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pdserve_cpu.h"

#define MAX_HELPERS 15
#define SPIN_NS 100000          /* a helper's wait for the next job before it sleeps */

struct job {
    pd_task fn;
    void *ctx;
    int64_t n, chunk;
    int workers;                /* helpers 1..workers-1 take part */
    _Alignas(64) atomic_llong next;     /* claimed and finished items, each on */
    _Alignas(64) atomic_llong done;     /* a cache line of its own */
};

static struct job *_Atomic current;         /* the job in flight, or NULL */
static atomic_uint generation;              /* bumped for each job: what helpers wait on */
static atomic_int sleepers;                 /* helpers asleep on `generation` */
static atomic_int holding[MAX_HELPERS];     /* helper i may be reading `current` */
static atomic_flag busy = ATOMIC_FLAG_INIT; /* a job is in flight */
static atomic_int helpers;                  /* started (they run until the process ends) */
static atomic_int active = 1;               /* workers a job shares itself among by default */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_llong helped;                 /* items helpers computed, ever */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void work(struct job *j, int worker) {
    for (;;) {
        const int64_t i = atomic_fetch_add(&j->next, j->chunk);
        if (i >= j->n) return;
        const int64_t end = i + j->chunk < j->n ? i + j->chunk : j->n;
        for (int64_t k = i; k < end; k++) j->fn(j->ctx, k, worker);
        atomic_fetch_add(&j->done, end - i);
        if (worker) atomic_fetch_add(&helped, end - i);
    }
}

static void *helper(void *arg) {
    const int id = (int)(intptr_t)arg;      /* worker id - 1 */
    unsigned seen = atomic_load(&generation);
    for (;;) {
        const int64_t until = now_ns() + SPIN_NS;
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            _mm_pause();
            if (++spins % 64 == 0 && now_ns() > until) {
                atomic_fetch_add(&sleepers, 1);
                /* returns at once if a job was posted since the load above */
                syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
            }
        }
        seen = atomic_load(&generation);
        /* Dekker with pd_run's end: either it sees us holding, or we see NULL */
        atomic_store(&holding[id], 1);
        struct job *j = atomic_load(&current);
        if (j && id + 1 < j->workers) work(j, id + 1);
        atomic_store(&holding[id], 0);
    }
    return NULL;
}

static void forked_child(void) {        /* threads do not survive fork */
    helpers = 0;
    active = 1;
    atomic_flag_clear(&busy);
}

/* From now on share each job among `n` workers by default (at most
 * 1 + MAX_HELPERS): this thread and n - 1 helpers, started where fewer run.
 * Returns the workers it will share among. */
int pd_pool_share(int n) {
    pthread_mutex_lock(&start_lock);
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forked_child);
        registered = 1;
    }
    n = n < 1 ? 1 : n > 1 + MAX_HELPERS ? 1 + MAX_HELPERS : n;
    while (helpers < n - 1) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &a, helper, (void *)(intptr_t)helpers);
        pthread_attr_destroy(&a);
        if (failed) break;
        helpers++;
    }
    active = n < 1 + helpers ? n : 1 + helpers;
    const int share = active;
    pthread_mutex_unlock(&start_lock);
    return share;
}

/* items helpers have computed since the process began (to see that they do) */
long long pd_pool_helped(void) { return atomic_load(&helped); }

/* workers a job may have: the caller and the helpers */
int pd_pool_workers(void) { return 1 + helpers; }

/* fn(ctx, item, worker) for every item in [0, n), in chunks of `chunk`;
 * worker is 0 for the caller, 1.. for helpers (an index for per-worker
 * scratch, below pd_pool_workers()); at most `threads` workers take part
 * (1: the caller alone; 0: pd_pool_share's count). */
void pd_run(pd_task fn, void *ctx, int64_t n, int64_t chunk, int threads) {
    if (chunk < 1) chunk = 1;
    if (threads <= 0) threads = active;
    if (threads <= 1 || helpers == 0 || n <= chunk || atomic_flag_test_and_set(&busy)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    struct job j = {.fn = fn, .ctx = ctx, .n = n, .chunk = chunk, .workers = threads};
    atomic_init(&j.next, 0);
    atomic_init(&j.done, 0);
    atomic_store(&current, &j);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleepers))
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(&j, 0);
    while (atomic_load(&j.done) < n) _mm_pause();      /* chunks helpers are computing */
    atomic_store(&current, NULL);
    for (int i = 0; i < helpers; i++)
        while (atomic_load(&holding[i])) _mm_pause();   /* nobody still reads j */
    atomic_flag_clear(&busy);
}
