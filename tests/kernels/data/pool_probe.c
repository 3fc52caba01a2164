/* A probe of the CPU kernels' thread pool (batchgen/kernels/cpu/pool.h), built by the tests
 * beside a copy of pool.h: each chunk records its extent and the thread that ran it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "pool.h"

struct probe {
  int64_t *count;  /* [n]: times item i ran */
  int64_t *extent; /* [n]: end - begin at a chunk's first item, else 0 */
  int64_t *thread; /* [n]: the thread that ran a chunk, at its first item */
  int64_t sleep_ns;
  int nested;
};

static void mark(void *ctx, int64_t begin, int64_t end) {
  struct probe *p = ctx;
  p->extent[begin] = end - begin;
  p->thread[begin] = (int64_t)pthread_self();
  for (int64_t i = begin; i < end; i++) __atomic_add_fetch(&p->count[i], 1, __ATOMIC_RELAXED);
  if (p->sleep_ns) {
    struct timespec ts = {0, p->sleep_ns};
    nanosleep(&ts, NULL);
  }
}

static void outer(void *ctx, int64_t begin, int64_t end) {
  struct probe *p = ctx;
  for (int64_t i = begin; i < end; i++) { /* a call nested in a task runs on its thread */
    struct probe inner = {p->count + i * p->nested, p->extent + i * p->nested,
                          p->thread + i * p->nested, 0, 0};
    bg_parallel_for(p->nested, 1, mark, &inner);
  }
}

/* nested > 0: run [0, n) where each item runs a nested bg_parallel_for over `nested` items
 * (the arrays then hold n * nested entries). */
void probe_run(int64_t n, int64_t grain, int64_t *count, int64_t *extent, int64_t *thread,
               int64_t sleep_ns, int nested) {
  struct probe p = {count, extent, thread, sleep_ns, nested};
  bg_parallel_for(n, grain, nested ? outer : mark, &p);
}
