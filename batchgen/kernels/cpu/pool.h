/* batchgen: the thread pool of the CPU kernels (pthreads; no OpenMP runtime).
 *
 * Every kernel library includes this header and calls
 *
 *     bg_parallel_for(n, grain, fn, ctx);
 *
 * which runs fn(ctx, begin, end) over [0, n) split into contiguous chunks of at least `grain`
 * items, on up to batchgen_num_threads() threads (the caller is one of them), and returns
 * after every chunk ran. The chunking depends only on (n, grain, thread count); the results
 * must not depend on it: callers split over independent outputs, never over a reduction.
 *
 * One pool per process. The pool itself is built once, from pool.c (this header with
 * BG_POOL_IMPLEMENTATION defined); c_build.py hands its address to every kernel library
 * through batchgen_pool_attach(). A library not attached (a test harness, say) runs every
 * bg_parallel_for on the caller. One pool rather than one per library, so that a worker of
 * one library never spins on a core another library's worker needs.
 *
 * Scheduling, built for a machine shared with other processes:
 *   - up to 4 chunks per thread, claimed one at a time from a shared counter: the caller
 *     takes whatever chunks a late or descheduled worker has not claimed, and waits only for
 *     chunks that are already running. A worker that never wakes costs nothing;
 *   - an idle worker spins for a short, bounded time (BATCHGEN_POOL_SPIN_US, default 50 us;
 *     kernels of one model step follow each other closely), then keeps watching for work
 *     while yielding its core at every check (BATCHGEN_POOL_YIELD_US, default 1000 us: in a
 *     decode step the Python between two kernels often takes 50-200 us, and a worker that
 *     slept through it must be woken through the kernel), then sleeps on a condition
 *     variable. A yielding worker costs a quiet machine nothing and hands a loaded one's core
 *     to whatever else is runnable: an oversubscribed machine sees no busy-waiting;
 *   - a call made while the pool is busy (another thread's, or one nested in a task) runs on
 *     its caller alone, never deadlocks;
 *   - after fork() the child starts with no workers and makes new ones when needed.
 * Set the thread count between calls, not during one.
 */
#ifndef BATCHGEN_CPU_POOL_H
#define BATCHGEN_CPU_POOL_H

#include <stdint.h>

typedef void (*bg_task_fn)(void *ctx, int64_t begin, int64_t end);

/* The pool's entry points, as handed to each library. */
struct bg_pool_ops {
  int version;
  void (*parallel_for)(int64_t n, int64_t grain, bg_task_fn fn, void *ctx);
  void (*set_num_threads)(int n);
  int (*num_threads)(void);
};
#define BG_POOL_OPS_VERSION 1

#ifndef BG_POOL_IMPLEMENTATION
/* ---- the view of a kernel library -------------------------------------------------- */

static const struct bg_pool_ops *bg_pool_ops_attached;

/* Exported: c_build.py passes the process's pool (batchgen_pool_ops() of pool.c). Returns 0,
 * or -1 for a pool of another version (the library then stays on one thread). */
int batchgen_pool_attach(const struct bg_pool_ops *ops) {
  if (ops && ops->version != BG_POOL_OPS_VERSION) return -1;
  bg_pool_ops_attached = ops;
  return 0;
}

/* 1 = run on the caller only. */
void batchgen_set_num_threads(int n) {
  if (bg_pool_ops_attached) bg_pool_ops_attached->set_num_threads(n);
}

int batchgen_num_threads(void) {
  return bg_pool_ops_attached ? bg_pool_ops_attached->num_threads() : 1;
}

static inline void bg_parallel_for(int64_t n, int64_t grain, bg_task_fn fn, void *ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (bg_pool_ops_attached && n >= 2 * grain)
    bg_pool_ops_attached->parallel_for(n, grain, fn, ctx);
  else
    fn(ctx, 0, n);
}

#else
/* ---- the implementation (pool.c) --------------------------------------------------- */

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BG_CPU_RELAX() _mm_pause()
#else
#define BG_CPU_RELAX() ((void)0)
#endif

#define BG_MAX_THREADS 256
#define BG_CHUNKS_PER_THREAD 4
#define BG_SPIN_US 50    /* the default of BATCHGEN_POOL_SPIN_US */
#define BG_YIELD_US 1000 /* the default of BATCHGEN_POOL_YIELD_US */

#define BG_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define BG_LOAD_SC(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define BG_STORE_SC(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

/* The current job. `state` packs (epoch << 32 | next chunk): a worker claims chunk c of epoch
 * e by a compare-and-swap from (e, c) to (e, c + 1), so a worker that wakes late can never
 * claim a chunk of a job that has finished. The epoch is odd while the caller writes a new
 * job's fields (a seqlock): a worker reads the fields, then claims; the claim succeeding
 * proves the fields it read belong to its epoch (all of it in sequentially consistent
 * atomics, which cost a few cycles per call here and need no fences). */
struct bg_pool {
  uint64_t state;
  bg_task_fn fn;
  void *ctx;
  int64_t n, nchunks;
  int64_t done; /* chunks finished in the current job */

  pthread_mutex_t lock; /* guards the sleeping below, and thread start/stop */
  pthread_cond_t wake;  /* workers: a new epoch (or stop) */
  pthread_cond_t idle;  /* the caller: the last chunk finished */
  int sleepers;         /* workers asleep on `wake` (atomic) */
  int caller_sleeping;  /* the caller asleep on `idle` (atomic) */
  int stop_from;        /* workers with index >= this exit (atomic) */

  int busy;     /* a call is in progress (atomic; trylock against nesting) */
  int threads;  /* thread count asked for, the caller included */
  int started;  /* worker threads running */
  pthread_t workers[BG_MAX_THREADS];
  int64_t spin_ns;  /* an idle worker spins this long, */
  int64_t yield_ns; /* then spins yielding its core this long, then sleeps */
  int initialised;
};

static struct bg_pool bg_the_pool = {.threads = 1, .lock = PTHREAD_MUTEX_INITIALIZER,
                                     .wake = PTHREAD_COND_INITIALIZER,
                                     .idle = PTHREAD_COND_INITIALIZER};

static int64_t bg_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claim and run chunks of epoch `epoch` until none is left; returns the chunks run. */
static int64_t bg_run_chunks(struct bg_pool *p, uint32_t epoch) {
  int64_t ran = 0;
  for (;;) {
    uint64_t s = BG_LOAD(&p->state);
    if ((uint32_t)(s >> 32) != epoch) return ran;
    /* seq_cst: if any of these reads a newer job's field, the odd epoch stored before that
     * field precedes the claim below, which then fails */
    bg_task_fn fn = BG_LOAD_SC(&p->fn);
    void *ctx = BG_LOAD_SC(&p->ctx);
    int64_t n = BG_LOAD_SC(&p->n), nchunks = BG_LOAD_SC(&p->nchunks);
    int64_t c = (int64_t)(uint32_t)s;
    if (c >= nchunks) return ran;
    if (!__atomic_compare_exchange_n(&p->state, &s, s + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      continue; /* someone else claimed it, or a new epoch began: look again */
    fn(ctx, n * c / nchunks, n * (c + 1) / nchunks);
    ran++;
    if (__atomic_add_fetch(&p->done, 1, __ATOMIC_SEQ_CST) == nchunks &&
        __atomic_load_n(&p->caller_sleeping, __ATOMIC_SEQ_CST)) {
      pthread_mutex_lock(&p->lock);
      pthread_cond_signal(&p->idle);
      pthread_mutex_unlock(&p->lock);
    }
  }
}

static void *bg_worker_main(void *arg) {
  struct bg_pool *p = &bg_the_pool;
  int index = (int)(intptr_t)arg;
  uint32_t seen = (uint32_t)(BG_LOAD(&p->state) >> 32);
  for (;;) {
    /* wait for a new, published (even) epoch: spin a little, then sleep */
    uint32_t epoch;
    int64_t deadline = 0;
    for (int spins = 0;; spins++) {
      if (__atomic_load_n(&p->stop_from, __ATOMIC_ACQUIRE) <= index) return NULL;
      epoch = (uint32_t)(BG_LOAD(&p->state) >> 32);
      if (epoch != seen && !(epoch & 1)) break;
      if ((spins & 63) == 0) {
        int64_t now = bg_now_ns();
        if (deadline == 0) deadline = now + p->spin_ns;
        if (now >= deadline && now < deadline + p->yield_ns) {
          /* past the pure spin: keep watching, but hand the core to anything runnable */
          sched_yield();
          continue;
        }
        if (now >= deadline) {
          pthread_mutex_lock(&p->lock);
          __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
          for (;;) {
            epoch = (uint32_t)(__atomic_load_n(&p->state, __ATOMIC_SEQ_CST) >> 32);
            if ((epoch != seen && !(epoch & 1)) ||
                __atomic_load_n(&p->stop_from, __ATOMIC_SEQ_CST) <= index)
              break;
            pthread_cond_wait(&p->wake, &p->lock);
          }
          __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
          pthread_mutex_unlock(&p->lock);
          deadline = 0;
          continue;
        }
      }
      BG_CPU_RELAX();
    }
    seen = epoch;
    bg_run_chunks(p, epoch);
  }
}

/* Stop workers [keep, started) and wait for them. */
static void bg_stop_workers(struct bg_pool *p, int keep) {
  if (p->started <= keep) return;
  pthread_mutex_lock(&p->lock);
  __atomic_store_n(&p->stop_from, keep, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->lock);
  for (int i = keep; i < p->started; i++) pthread_join(p->workers[i], NULL);
  p->started = keep;
  __atomic_store_n(&p->stop_from, BG_MAX_THREADS, __ATOMIC_SEQ_CST);
}

/* Start workers up to threads - 1 (the caller is the other); fewer if the system refuses. */
static void bg_start_workers(struct bg_pool *p) {
  while (p->started < p->threads - 1) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    int rc = pthread_create(&p->workers[p->started], &attr, bg_worker_main,
                            (void *)(intptr_t)p->started);
    pthread_attr_destroy(&attr);
    if (rc != 0) break;
    p->started++;
  }
}

static void bg_atfork_child(void) {
  /* the workers did not survive the fork: forget them; the next call starts new ones */
  struct bg_pool *p = &bg_the_pool;
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->idle, NULL);
  p->started = 0;
  p->sleepers = 0;
  p->caller_sleeping = 0;
  p->busy = 0;
  p->stop_from = BG_MAX_THREADS;
}

/* Microseconds from the environment variable `name` (default `us`), within [0, 100 ms], in ns. */
static int64_t bg_env_ns(const char *name, long us) {
  const char *text = getenv(name);
  if (text && *text) us = strtol(text, NULL, 10);
  return (int64_t)(us < 0 ? 0 : us > 100000 ? 100000 : us) * 1000;
}

static void bg_init_once(void) {
  struct bg_pool *p = &bg_the_pool;
  p->spin_ns = bg_env_ns("BATCHGEN_POOL_SPIN_US", BG_SPIN_US);
  p->yield_ns = bg_env_ns("BATCHGEN_POOL_YIELD_US", BG_YIELD_US);
  p->stop_from = BG_MAX_THREADS;
  pthread_atfork(NULL, NULL, bg_atfork_child);
  p->initialised = 1;
}

static pthread_once_t bg_once = PTHREAD_ONCE_INIT;

static void bg_pool_set_num_threads(int n) {
  struct bg_pool *p = &bg_the_pool;
  pthread_once(&bg_once, bg_init_once);
  if (n < 1) n = 1;
  if (n > BG_MAX_THREADS) n = BG_MAX_THREADS;
  /* wait out a call in progress (another thread's) */
  int expected = 0;
  while (!__atomic_compare_exchange_n(&p->busy, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
    expected = 0;
    sched_yield();
  }
  __atomic_store_n(&p->threads, n, __ATOMIC_RELAXED);
  bg_stop_workers(p, n - 1); /* workers start on the next call */
  __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
}

static int bg_pool_num_threads(void) { return __atomic_load_n(&bg_the_pool.threads, __ATOMIC_RELAXED); }

static void bg_pool_parallel_for(int64_t n, int64_t grain, bg_task_fn fn, void *ctx) {
  struct bg_pool *p = &bg_the_pool;
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int threads = bg_pool_num_threads();
  int64_t nchunks = n / grain;
  if (nchunks > (int64_t)threads * BG_CHUNKS_PER_THREAD) nchunks = (int64_t)threads * BG_CHUNKS_PER_THREAD;
  if (threads <= 1 || nchunks <= 1) {
    fn(ctx, 0, n);
    return;
  }
  int expected = 0;
  if (!__atomic_compare_exchange_n(&p->busy, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
    /* the pool is busy (a nested call, or another thread's): the caller runs the same
     * chunks itself, in order */
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, n * c / nchunks, n * (c + 1) / nchunks);
    return;
  }
  pthread_once(&bg_once, bg_init_once);
  if (p->started < threads - 1) bg_start_workers(p);

  /* publish: odd epoch while the fields change, then the next even one */
  uint32_t epoch = (uint32_t)(BG_LOAD(&p->state) >> 32);
  BG_STORE_SC(&p->state, (uint64_t)(epoch + 1) << 32);
  BG_STORE_SC(&p->fn, fn);
  BG_STORE_SC(&p->ctx, ctx);
  BG_STORE_SC(&p->n, n);
  BG_STORE_SC(&p->nchunks, nchunks);
  BG_STORE_SC(&p->done, 0);
  epoch += 2;
  __atomic_store_n(&p->state, (uint64_t)epoch << 32, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) {
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
  }

  bg_run_chunks(p, epoch);

  /* wait for the chunks other threads claimed: spin a little, then sleep */
  if (BG_LOAD(&p->done) != nchunks) {
    int64_t deadline = bg_now_ns() + p->spin_ns;
    for (int spins = 1; BG_LOAD(&p->done) != nchunks; spins++) {
      if ((spins & 63) == 0 && bg_now_ns() >= deadline) {
        pthread_mutex_lock(&p->lock);
        __atomic_store_n(&p->caller_sleeping, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&p->done, __ATOMIC_SEQ_CST) != nchunks)
          pthread_cond_wait(&p->idle, &p->lock);
        __atomic_store_n(&p->caller_sleeping, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&p->lock);
        break;
      }
      BG_CPU_RELAX();
    }
  }
  __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
}

static const struct bg_pool_ops bg_pool_ops_impl = {BG_POOL_OPS_VERSION, bg_pool_parallel_for,
                                                   bg_pool_set_num_threads, bg_pool_num_threads};

/* Exported by the pool library: the address c_build.py hands to batchgen_pool_attach(). */
const struct bg_pool_ops *batchgen_pool_ops(void) { return &bg_pool_ops_impl; }
void batchgen_set_num_threads(int n) { bg_pool_set_num_threads(n); }
int batchgen_num_threads(void) { return bg_pool_num_threads(); }

/* For bg_parallel_for in code built together with the pool (a test harness). */
static inline void bg_parallel_for(int64_t n, int64_t grain, bg_task_fn fn, void *ctx) {
  bg_pool_parallel_for(n, grain, fn, ctx);
}

#endif /* BG_POOL_IMPLEMENTATION */
#endif /* BATCHGEN_CPU_POOL_H */
