/* batchgen: the process's thread pool for the CPU kernels, built as a library of its own by
 * c_build.py, which hands batchgen_pool_ops() to every kernel library (see pool.h). */
#define _GNU_SOURCE /* clock_gettime, pthread_atfork under -std=c99 */
#define BG_POOL_IMPLEMENTATION
#include "pool.h"
