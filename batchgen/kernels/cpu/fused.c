/* batchgen: fused float32 element-wise operations for the CPU, one thread.
 *
 * Built and loaded by batchgen/kernels/cpu/fused.py (through loader.py). A decode step
 * of a small model runs a few dozen rows, where each torch element-wise op costs more in
 * dispatch and temporaries than in arithmetic. These replace chains of them with one pass:
 *
 *   batchgen_rms_norm_f32   y = w * (x * 1/sqrt(mean(x^2) + eps))      (RMSNorm, per row)
 *   batchgen_silu_mul_f32   y = silu(gate) * up, from one [m, 2n] row   (gated MLP)
 *   batchgen_greedy_f32     argmax, max and logsumexp of each row        (greedy sampling)
 *
 * Rows are independent: a row's result never depends on the other rows of the call.
 * Never built with -ffast-math (that would set flush-to-zero for the whole process); the
 * reductions that may be reordered say so with `omp simd reduction` (-fopenmp-simd).
 */
#include <math.h>
#include <stdint.h>

#include "exp.h"

/* exp(x) over the whole float range (exp.h), relative error about 2e-7: +inf above 88.72
 * (where expf overflows), 0 below -87.33 (where expf goes subnormal, too small to matter in a
 * sum or a denominator 1 + e); NaN stays NaN. */
static inline float exp_f32(float x) {
  const float lo = -87.33654475f, hi = 88.72283905f;
  float e = batchgen_exp_clamped(x < lo ? lo : (x > hi ? hi : x));
  e = x < lo ? 0.0f : e;
  e = x > hi ? INFINITY : e;
  return x != x ? x : e;
}

/* y[i, :] = w * (x[i, :] * (1 / sqrt(mean(x[i, :]^2) + eps))), the order HF's RMSNorm uses.
 * x: [m, n], row stride ldx; y: [m, n], row stride ldy; w: [n]. */
void batchgen_rms_norm_f32(const float *restrict x, int64_t ldx, const float *restrict w,
                           float *restrict y, int64_t ldy, int64_t m, int64_t n, float eps) {
  for (int64_t i = 0; i < m; ++i) {
    const float *xr = x + i * ldx;
    float *yr = y + i * ldy;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

/* y[i, j] = silu(gu[i, j]) * gu[i, n + j], silu(g) = g / (1 + exp(-g)).
 * gu: [m, 2n] (gate columns, then up columns), row stride ldgu; y: [m, n], row stride ldy. */
void batchgen_silu_mul_f32(const float *restrict gu, int64_t ldgu, float *restrict y,
                           int64_t ldy, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    const float *g = gu + i * ldgu;
    const float *u = g + n;
    float *yr = y + i * ldy;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yr[j] = g[j] / (1.0f + exp_f32(-g[j])) * u[j];
  }
}

/* For each row of logits [m, n] (row stride ld): ids[i] = the first index of the row's
 * largest value, maxes[i] = that value, lse[i] = log(sum(exp(row))), within about 2e-7 of
 * the exact value (the exps are float, their sum double). NaN entries are never
 * chosen, but make lse NaN (the caller then falls back); an all -inf row gives max -inf. */
void batchgen_greedy_f32(const float *restrict logits, int64_t ld, int64_t m, int64_t n,
                         int64_t *restrict ids, float *restrict maxes, float *restrict lse) {
  for (int64_t i = 0; i < m; ++i) {
    const float *row = logits + i * ld;
    /* the largest value (NaN never compares larger), then its first index */
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t k = 0; k < n; ++k) top = row[k] > top ? row[k] : top;
    int64_t arg = 0; /* an all -inf (or NaN) row: 0, like torch.argmax of all -inf */
    for (int64_t k = 0; k < n; ++k) {
      if (row[k] == top) {
        arg = k;
        break;
      }
    }
    ids[i] = arg;
    maxes[i] = top;
    if (top == -INFINITY || top == INFINITY) {
      lse[i] = top;
      continue;
    }
    /* summed in double: a vocabulary-long float sum would lose ~1e-5 of the total */
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < n; ++k) total += (double)exp_f32(row[k] - top);
    lse[i] = (float)((double)top + log(total));
  }
}
