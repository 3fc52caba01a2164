/* batchgen: fused element-wise operations for the CPU, threaded over rows.
 *
 * Built and loaded by batchgen/kernels/cpu/fused.py (through c_build.py). A decode step
 * of a small model runs a few dozen rows, where each torch element-wise op costs more in
 * dispatch and temporaries than in arithmetic. These replace chains of them with one pass:
 *
 *   batchgen_rms_norm_f32   y = w * (x * 1/sqrt(mean(x^2) + eps))      (RMSNorm, per row)
 *   batchgen_add_rms_norm_f32  s = x + h, then y = RMSNorm(s)          (a decoder layer's
 *                           residual add and its second norm, per row)
 *   batchgen_gated_mul_f32  y = act(gate) * up, from one [m, 2n] row    (gated MLP; act is
 *                           SiLU, or GELU's tanh form: ACT_* below)
 *   batchgen_greedy_f32     argmax, max and logsumexp of each row        (greedy sampling)
 *   batchgen_token_logprobs_f32  logsumexp and the target's rank per row (prompt logprobs)
 *   batchgen_rope_cache     rotate-half RoPE of the q and k heads of a fused qkv row, in
 *                           place, and the k and v heads copied into the paged KV cache
 *                           (attention; float32, and bfloat16 / float16 with AVX2 and F16C)
 *   batchgen_rms_norm_16, batchgen_add_rms_norm_16, batchgen_gated_mul_16: the same for
 *     bfloat16 / float16 tensors, in float32 arithmetic, rounded to the 16-bit type where the
 *     torch ops they replace round (see each); the norms with a float32 weight too (W_F32).
 *
 * Rows are independent and each row is computed by one thread, in one fixed order: a row's
 * result never depends on the other rows of the call, nor on the thread count.
 * Never built with -ffast-math (that would set flush-to-zero for the whole process). The
 * reductions are written out over a fixed number of lanes (RLANES) and summed in a fixed order,
 * and every other loop is element-wise, so an AVX-512, an AVX2 and a plain-C build give the
 * same bits (tests/kernels/test_avx2_parity.py); the 16-bit paths are AVX2 (with F16C) in both
 * vector builds.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"
#include "pool.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_16 1
#else
#define HAVE_16 0
#endif

enum { BF16 = 1, F16 = 2 };
/* Or'ed into the 16-bit norms' dtype code: the weight is float32 and scales the float32 row
 * before its one rounding (Gemma's RMSNorm, `(x * inv) * (1 + w.float())` then `.type_as(x)`),
 * where HF's other RMSNorms round the row first and multiply by a 16-bit weight. */
enum { W_F32 = 16, DT_MASK = 15 };

/* Elements one chunk of rows should hold, at least, to pay for handing it out. */
#define GRAIN_ELEMS 16384

static int64_t row_grain(int64_t n) { return n >= GRAIN_ELEMS ? 1 : (GRAIN_ELEMS + n - 1) / n; }

/* 1 when the bfloat16 / float16 entry points are built (AVX2 and F16C). */
int batchgen_fused_has_16(void) { return HAVE_16; }

/* exp(x) over the whole float range (exp.h), relative error about 2e-7: +inf above 88.72
 * (where expf overflows), 0 below -87.33 (where expf goes subnormal, too small to matter in a
 * sum or a denominator 1 + e); NaN stays NaN. */
#define EXP_F32_LO -87.33654475f
static inline float exp_f32(float x) {
  const float lo = EXP_F32_LO, hi = 88.72283905f;
  float e = batchgen_exp_clamped(x < lo ? lo : (x > hi ? hi : x));
  e = x < lo ? 0.0f : e;
  e = x > hi ? INFINITY : e;
  return x != x ? x : e;
}

static inline float silu(float g) { return g / (1.0f + exp_f32(-g)); }

/* GELU's tanh form, 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3), written as
 * g sigmoid(2 z) = g / (1 + exp(-2 z)) (the same function; no cancellation near 1 + tanh = 0):
 * torch's gelu(approximate="tanh") within float32 rounding. g^3 overflowing gives +-inf in z,
 * hence g or -0, as torch's. */
static inline float gelu_tanh(float g) {
  const float z2 = 1.5957691216057308f * (g + 0.044715f * g * g * g); /* 2 sqrt(2/pi) (...) */
  return g / (1.0f + exp_f32(-z2));
}

/* The gated MLP's activations (fused.py's ACTIVATIONS mirrors these codes). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* ---- float32 ------------------------------------------------------------------------- */

struct rms_args {
  const void *x, *w;
  void *y;
  int64_t ldx, ldy, n;
  float eps;
  int dtype;
};

/* Lanes of the written-out reductions (RMSNorm's sum of squares, the greedy pick's max and sum):
 * loops over a fixed number of lanes are element-wise, so the compiler's vector width (AVX-512,
 * AVX2 or none) changes no bit; only the lanes' final sum has an order, written out. */
#define RLANES 16

/* yr = w * (xr * (1 / sqrt(mean(xr^2) + eps))) over one row of n, the order HF's RMSNorm uses. */
static void rms_row_f32(const float *restrict xr, const float *restrict w, float *restrict yr, int64_t n,
                        float eps) {
  /* the sum of squares in RLANES lanes (element j into lane j % RLANES, in order of j), then
   * the lanes in order: one order in every build (AVX-512, AVX2, plain C) */
  float lanes[RLANES] = {0}, ss = 0.f;
  int64_t j = 0;
  for (; j + RLANES <= n; j += RLANES) {
#pragma omp simd
    for (int l = 0; l < RLANES; ++l) lanes[l] += xr[j + l] * xr[j + l];
  }
  for (int l = 0; j + l < n; ++l) lanes[l] += xr[j + l] * xr[j + l];
  for (int l = 0; l < RLANES; ++l) ss += lanes[l];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) yr[j] = w[j] * (xr[j] * inv);
}

static void rms_rows_f32(void *ctx, int64_t begin, int64_t end) {
  const struct rms_args *a = ctx;
  for (int64_t i = begin; i < end; ++i)
    rms_row_f32((const float *)a->x + i * a->ldx, a->w, (float *)a->y + i * a->ldy, a->n, a->eps);
}

/* x: [m, n], row stride ldx; y: [m, n], row stride ldy; w: [n]. */
void batchgen_rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,
                           int64_t m, int64_t n, float eps) {
  struct rms_args a = {x, w, y, ldx, ldy, n, eps, 0};
  bg_parallel_for(m, row_grain(n), rms_rows_f32, &a);
}

/* The residual add before a decoder layer's second norm: s = x + h, then y = RMSNorm(s) (s and
 * y contiguous rows of n). */
struct add_rms_args {
  const void *x, *h, *w;
  void *s, *y;
  int64_t ldx, ldh, n;
  float eps;
  int dtype;
};

static void add_rms_rows_f32(void *ctx, int64_t begin, int64_t end) {
  const struct add_rms_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict xr = (const float *)a->x + i * a->ldx;
    const float *restrict hr = (const float *)a->h + i * a->ldh;
    float *restrict sr = (float *)a->s + i * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sr[j] = xr[j] + hr[j];
    rms_row_f32(sr, a->w, (float *)a->y + i * n, n, a->eps);
  }
}

/* s = x + h and y = RMSNorm(s) with weight w: x [m, n] (row stride ldx), h [m, n] (row stride
 * ldh), s and y [m, n] contiguous. s is torch's float32 x + h, y what batchgen_rms_norm_f32
 * gives for s. */
void batchgen_add_rms_norm_f32(const float *x, int64_t ldx, const float *h, int64_t ldh, const float *w,
                               float *s, float *y, int64_t m, int64_t n, float eps) {
  struct add_rms_args a = {x, h, w, s, y, ldx, ldh, n, eps, 0};
  bg_parallel_for(m, row_grain(n), add_rms_rows_f32, &a);
}

struct gated_args {
  const void *gu;
  void *y;
  int64_t ldgu, ldy, n;
  int dtype, act;
};

static void gated_rows_f32(void *ctx, int64_t begin, int64_t end) {
  const struct gated_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict g = (const float *)a->gu + i * a->ldgu;
    const float *restrict u = g + n;
    float *restrict yr = (float *)a->y + i * a->ldy;
    if (a->act == ACT_GELU_TANH) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = gelu_tanh(g[j]) * u[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = silu(g[j]) * u[j];
    }
  }
}

/* y[i, j] = act(gu[i, j]) * gu[i, n + j]: act ACT_SILU, silu(g) = g / (1 + exp(-g)), or
 * ACT_GELU_TANH (gelu_tanh above). gu: [m, 2n] (gate columns, then up columns), row stride
 * ldgu; y: [m, n], row stride ldy. */
void batchgen_gated_mul_f32(const float *gu, int64_t ldgu, float *y, int64_t ldy, int64_t m,
                            int64_t n, int act) {
  struct gated_args a = {gu, y, ldgu, ldy, n, 0, act};
  bg_parallel_for(m, row_grain(n), gated_rows_f32, &a);
}

#include "fused_logits.h" /* the greedy pick, the prompt logprobs' logsumexp and rank */

/* ---- RoPE and the KV-cache write ----------------------------------------------------- */

struct rope_args {
  void *qkv;
  const void *cos, *sin;
  void *k_cache, *v_cache;
  const int64_t *slots;
  int64_t ld, ldc, lds, heads, kv_heads, d;
  int dtype, kv_dtype; /* the rows', the caches' (float32 rows into a 16-bit cache, or the same) */
};

/* One head x[0, d) in place: x = x * c + rotate_half(x) * s, rotate_half(x) = (-x2, x1) for the
 * halves x1 = x[0, d/2), x2 = x[d/2, d): torch's `q * cos + rotate_half(q) * sin` in float32,
 * which rounds each product and the sum. Contracting a product and the sum into one fused
 * multiply-add would round once less and change the bits: each product is its own statement
 * (GCC's ISO C mode, -std=c99, does not contract at all; clang contracts only within an
 * expression, and the pragma turns even that off). */
static void rope_head_f32(float *x, const float *c, const float *s, int64_t h) {
#pragma STDC FP_CONTRACT OFF
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    const float x1 = x[j], x2 = x[j + h];
    const float x1c = x1 * c[j];
    const float x2s = -x2 * s[j];
    const float x2c = x2 * c[j + h];
    const float x1s = x1 * s[j + h];
    x[j] = x1c + x2s;
    x[j + h] = x2c + x1s;
  }
}

static void rope_head_16(int dtype, uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t h);
static void narrow_row(int dtype, const float *x, uint16_t *y, int64_t n);

/* n values of a row into a cache row: copied, or float32 narrowed to the cache's 16-bit type. */
static void cache_row(const struct rope_args *a, void *dst, const char *src, int64_t n) {
  if (a->kv_dtype == a->dtype)
    memcpy(dst, src, (size_t)n * (a->dtype ? sizeof(uint16_t) : sizeof(float)));
  else
    narrow_row(a->kv_dtype, (const float *)src, dst, n);
}

static void rope_rows(void *ctx, int64_t begin, int64_t end) {
  const struct rope_args *a = ctx;
  const size_t size = a->dtype ? sizeof(uint16_t) : sizeof(float);
  const int64_t d = a->d, kv = a->kv_heads * d;
  for (int64_t i = begin; i < end; ++i) {
    char *row = (char *)a->qkv + (size_t)(i * a->ld) * size;
    const void *c = (const char *)a->cos + (size_t)(i * a->ldc) * size;
    const void *s = (const char *)a->sin + (size_t)(i * a->lds) * size;
    for (int64_t head = 0; head < a->heads + a->kv_heads; ++head) {
      void *x = row + (size_t)(head * d) * size;
      if (a->dtype)
        rope_head_16(a->dtype, x, c, s, d / 2);
      else
        rope_head_f32(x, c, s, d / 2);
    }
    const size_t slot = (size_t)a->slots[i], cs = a->kv_dtype ? sizeof(uint16_t) : sizeof(float);
    cache_row(a, (char *)a->k_cache + slot * kv * cs, row + (size_t)(a->heads * d) * size, kv);
    cache_row(a, (char *)a->v_cache + slot * kv * cs, row + (size_t)(a->heads * d + kv) * size, kv);
  }
}

/* For each of m tokens: row i of qkv (row stride ld) holds `heads` query heads, then `kv_heads`
 * key heads, then `kv_heads` value heads, each of d values (d even); cos and sin rows i (row
 * strides ldc, lds) hold d values each. Rotates the query and key heads in place (see
 * rope_head_f32; bfloat16 / float16: each product and the sum rounded to the 16-bit type, as
 * torch does), then copies the rotated key heads and the value heads into row slots[i] of
 * k_cache and v_cache ([num_slots, kv_heads, d], contiguous) of kv_dtype: dtype's own, or a
 * 16-bit one under float32 rows (rounded to nearest even). dtype 0 = float32, 1 = bfloat16,
 * 2 = float16. Returns 0, -1 when a slot lies outside [0, num_slots) (nothing is written), -2
 * for a 16-bit dtype this build lacks, -3 for another pair of dtypes. Slots must be distinct. */
int batchgen_rope_cache(void *qkv, int64_t ld, const void *cos, int64_t ldc, const void *sin,
                        int64_t lds, void *k_cache, void *v_cache, const int64_t *slots,
                        int64_t num_slots, int64_t m, int64_t heads, int64_t kv_heads, int64_t d,
                        int dtype, int kv_dtype) {
  for (int64_t i = 0; i < m; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return -1;
  if ((dtype != 0 || kv_dtype != 0) && !HAVE_16) return -2;
  if (kv_dtype != dtype && dtype != 0) return -3;
  struct rope_args a = {qkv, cos, sin, k_cache, v_cache, slots, ld, ldc, lds, heads, kv_heads, d, dtype, kv_dtype};
  bg_parallel_for(m, row_grain((heads + 2 * kv_heads) * d), rope_rows, &a);
  return 0;
}

#include "fused_half.h" /* the bfloat16 / float16 entry points */
