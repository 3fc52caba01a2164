/* batchgen: fused element-wise operations for the CPU, threaded over rows.
 *
 * Built and loaded by batchgen/kernels/cpu/fused.py (through c_build.py). A decode step
 * of a small model runs a few dozen rows, where each torch element-wise op costs more in
 * dispatch and temporaries than in arithmetic. These replace chains of them with one pass:
 *
 *   batchgen_rms_norm_f32   y = w * (x * 1/sqrt(mean(x^2) + eps))      (RMSNorm, per row)
 *   batchgen_add_rms_norm_f32  s = x + h, then y = RMSNorm(s)          (a decoder layer's
 *                           residual add and its second norm, per row)
 *   batchgen_silu_mul_f32   y = silu(gate) * up, from one [m, 2n] row   (gated MLP)
 *   batchgen_greedy_f32     argmax, max and logsumexp of each row        (greedy sampling)
 *   batchgen_token_logprobs_f32  logsumexp and the target's rank per row (prompt logprobs)
 *   batchgen_rope_cache     rotate-half RoPE of the q and k heads of a fused qkv row, in
 *                           place, and the k and v heads copied into the paged KV cache
 *                           (attention; float32, and bfloat16 / float16 with AVX2 and F16C)
 *   batchgen_rms_norm_16, batchgen_add_rms_norm_16, batchgen_silu_mul_16: the same for
 *     bfloat16 / float16 tensors, in float32 arithmetic, rounded to the 16-bit type where the
 *     torch ops they replace round (see each).
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

/* Elements one chunk of rows should hold, at least, to pay for handing it out. */
#define GRAIN_ELEMS 16384

static int64_t row_grain(int64_t n) { return n >= GRAIN_ELEMS ? 1 : (GRAIN_ELEMS + n - 1) / n; }

/* 1 when the bfloat16 / float16 entry points are built (AVX2 and F16C). */
int batchgen_fused_has_16(void) { return HAVE_16; }

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

static inline float silu(float g) { return g / (1.0f + exp_f32(-g)); }

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

struct silu_args {
  const void *gu;
  void *y;
  int64_t ldgu, ldy, n;
  int dtype;
};

static void silu_rows_f32(void *ctx, int64_t begin, int64_t end) {
  const struct silu_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict g = (const float *)a->gu + i * a->ldgu;
    const float *restrict u = g + n;
    float *restrict yr = (float *)a->y + i * a->ldy;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yr[j] = silu(g[j]) * u[j];
  }
}

/* y[i, j] = silu(gu[i, j]) * gu[i, n + j], silu(g) = g / (1 + exp(-g)).
 * gu: [m, 2n] (gate columns, then up columns), row stride ldgu; y: [m, n], row stride ldy. */
void batchgen_silu_mul_f32(const float *gu, int64_t ldgu, float *y, int64_t ldy, int64_t m,
                           int64_t n) {
  struct silu_args a = {gu, y, ldgu, ldy, n, 0};
  bg_parallel_for(m, row_grain(n), silu_rows_f32, &a);
}

struct greedy_args {
  const float *logits;
  int64_t ld, n;
  int64_t *ids;
  float *maxes, *lse;
};

/* log(sum(exp(row))) of a row whose largest value is the finite top: the exps in float, summed
 * in double (a vocabulary-long float sum would lose ~1e-5 of the total) over RLANES lanes, then
 * the lanes in order. */
static float row_lse(const float *restrict row, int64_t n, float top) {
  double sums[RLANES] = {0}, total = 0.0;
  int64_t k = 0;
  for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
    for (int l = 0; l < RLANES; ++l) sums[l] += (double)exp_f32(row[k + l] - top);
  }
  for (int l = 0; k + l < n; ++l) sums[l] += (double)exp_f32(row[k + l] - top);
  for (int l = 0; l < RLANES; ++l) total += sums[l];
  return (float)((double)top + log(total));
}

static void greedy_rows(void *ctx, int64_t begin, int64_t end) {
  const struct greedy_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict row = a->logits + i * a->ld;
    /* the largest value (NaN never compares larger), then its first index */
    float tops[RLANES], top = -INFINITY;
    for (int l = 0; l < RLANES; ++l) tops[l] = -INFINITY;
    int64_t k = 0;
    for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
      for (int l = 0; l < RLANES; ++l) tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
    }
    for (int l = 0; k + l < n; ++l) tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
    for (int l = 0; l < RLANES; ++l) top = tops[l] > top ? tops[l] : top;
    int64_t arg = 0; /* an all -inf (or NaN) row: 0, like torch.argmax of all -inf */
    for (int64_t k = 0; k < n; ++k) {
      if (row[k] == top) {
        arg = k;
        break;
      }
    }
    a->ids[i] = arg;
    a->maxes[i] = top;
    a->lse[i] = top == -INFINITY || top == INFINITY ? top : row_lse(row, n, top);
  }
}

/* For each row of logits [m, n] (row stride ld): ids[i] = the first index of the row's
 * largest value, maxes[i] = that value, lse[i] = log(sum(exp(row))), within about 2e-7 of
 * the exact value (the exps are float, their sum double). NaN entries are never
 * chosen, but make lse NaN (the caller then falls back); an all -inf row gives max -inf. */
void batchgen_greedy_f32(const float *logits, int64_t ld, int64_t m, int64_t n, int64_t *ids,
                         float *maxes, float *lse) {
  struct greedy_args a = {logits, ld, n, ids, maxes, lse};
  bg_parallel_for(m, row_grain(n), greedy_rows, &a);
}

struct token_args {
  const float *logits;
  int64_t ld, n;
  const int64_t *targets;
  float *lse;
  int64_t *ranks;
};

/* One pass for the largest value and the count of values above the target's, then row_lse. */
static void token_rows(void *ctx, int64_t begin, int64_t end) {
  const struct token_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict row = a->logits + i * a->ld;
    const float t = row[a->targets[i]];
    float tops[RLANES], top = -INFINITY;
    int32_t above[RLANES] = {0};
    int64_t rank = 1;
    for (int l = 0; l < RLANES; ++l) tops[l] = -INFINITY;
    int64_t k = 0;
    for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
      for (int l = 0; l < RLANES; ++l) {
        tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
        above[l] += row[k + l] > t;
      }
    }
    for (int l = 0; k + l < n; ++l) {
      tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
      above[l] += row[k + l] > t;
    }
    for (int l = 0; l < RLANES; ++l) {
      top = tops[l] > top ? tops[l] : top;
      rank += above[l];
    }
    a->ranks[i] = rank;
    a->lse[i] = top == -INFINITY || top == INFINITY ? top : row_lse(row, n, top);
  }
}

/* For each row of logits [m, n] (row stride ld) and its target index targets[i] (0 <= t < n,
 * checked by the caller): lse[i] = log(sum(exp(row))), the same bits as batchgen_greedy_f32's,
 * and ranks[i] = 1 + the number of entries larger than the target's (vLLM's rank). A row with
 * NaN or infinities gets a lse that is not finite (the caller then falls back). Rows have
 * under 2^31 entries. */
void batchgen_token_logprobs_f32(const float *logits, int64_t ld, int64_t m, int64_t n,
                                 const int64_t *targets, float *lse, int64_t *ranks) {
  struct token_args a = {logits, ld, n, targets, lse, ranks};
  bg_parallel_for(m, row_grain(n), token_rows, &a);
}

/* ---- RoPE and the KV-cache write ----------------------------------------------------- */

struct rope_args {
  void *qkv;
  const void *cos, *sin;
  void *k_cache, *v_cache;
  const int64_t *slots;
  int64_t ld, ldc, lds, heads, kv_heads, d;
  int dtype;
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
    const size_t slot = (size_t)a->slots[i];
    memcpy((char *)a->k_cache + slot * kv * size, row + (size_t)(a->heads * d) * size, (size_t)kv * size);
    memcpy((char *)a->v_cache + slot * kv * size, row + (size_t)(a->heads * d + kv) * size, (size_t)kv * size);
  }
}

/* For each of m tokens: row i of qkv (row stride ld) holds `heads` query heads, then `kv_heads`
 * key heads, then `kv_heads` value heads, each of d values (d even); cos and sin rows i (row
 * strides ldc, lds) hold d values each. Rotates the query and key heads in place (see
 * rope_head_f32; bfloat16 / float16: each product and the sum rounded to the 16-bit type, as
 * torch does), then copies the rotated key heads and the value heads into row slots[i] of
 * k_cache and v_cache ([num_slots, kv_heads, d], contiguous). dtype 0 = float32, 1 = bfloat16,
 * 2 = float16. Returns 0, -1 when a slot lies outside [0, num_slots) (nothing is written), -2
 * for a 16-bit dtype this build lacks. Slots must be distinct. */
int batchgen_rope_cache(void *qkv, int64_t ld, const void *cos, int64_t ldc, const void *sin,
                        int64_t lds, void *k_cache, void *v_cache, const int64_t *slots,
                        int64_t num_slots, int64_t m, int64_t heads, int64_t kv_heads, int64_t d,
                        int dtype) {
  for (int64_t i = 0; i < m; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return -1;
  if (dtype != 0 && !HAVE_16) return -2;
  struct rope_args a = {qkv, cos, sin, k_cache, v_cache, slots, ld, ldc, lds, heads, kv_heads, d, dtype};
  bg_parallel_for(m, row_grain((heads + 2 * kv_heads) * d), rope_rows, &a);
  return 0;
}

#if HAVE_16
/* ---- bfloat16 / float16 -------------------------------------------------------------- */

/* 8 values of a 16-bit type as float32, and back (round to nearest even; a NaN stays a NaN). */
static inline __m256 load8(int dtype, const uint16_t *p) {
  __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

static inline __m128i narrow8(int dtype, __m256 v) {
  if (dtype == F16) return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* v rounded to the 16-bit type, as float32 again: where torch would store a 16-bit tensor */
static inline __m256 round8(int dtype, __m256 v) {
  __m128i h = narrow8(dtype, v);
  if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

/* Rows of at most this many elements are handled in 8-wide steps over a padded copy. */
#define TAIL_PAD 8

/* Copy of the last (n % 8) elements of a row into an 8-wide buffer (zeros after), so that every
 * step is a full vector; the results for the padding are dropped. */
static inline void tail_in(const uint16_t *src, int64_t count, uint16_t buf[TAIL_PAD]) {
  memset(buf, 0, TAIL_PAD * sizeof(uint16_t));
  memcpy(buf, src, (size_t)count * sizeof(uint16_t));
}

/* HF's RMSNorm on a 16-bit row x of n and weight w: the row in float32,
 * t = x * (1 / sqrt(mean(x^2) + eps)) rounded to the 16-bit type, then y = w * t rounded again
 * (torch's `weight * t.to(dtype)`). */
static void rms_row_16(int dtype, const uint16_t *xr, const uint16_t *w, uint16_t *yr, int64_t n, float eps) {
  const int64_t full = n / 8 * 8;
  uint16_t xt[TAIL_PAD], wt[TAIL_PAD], yt[TAIL_PAD];
  tail_in(xr + full, n - full, xt);
  tail_in(w + full, n - full, wt);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    __m256 v = load8(dtype, xr + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  if (full < n) {
    __m256 v = load8(dtype, xt);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float lanes[8], ss = 0.f;
  _mm256_storeu_ps(lanes, acc);
  for (int l = 0; l < 8; ++l) ss += lanes[l];
  const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / (float)n + eps));
  for (int64_t j = 0; j < full; j += 8) {
    __m256 t = round8(dtype, _mm256_mul_ps(load8(dtype, xr + j), inv));
    _mm_storeu_si128((__m128i *)(yr + j), narrow8(dtype, _mm256_mul_ps(load8(dtype, w + j), t)));
  }
  if (full < n) {
    __m256 t = round8(dtype, _mm256_mul_ps(load8(dtype, xt), inv));
    _mm_storeu_si128((__m128i *)yt, narrow8(dtype, _mm256_mul_ps(load8(dtype, wt), t)));
    memcpy(yr + full, yt, (size_t)(n - full) * sizeof(uint16_t));
  }
}

static void rms_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct rms_args *a = ctx;
  for (int64_t i = begin; i < end; ++i)
    rms_row_16(a->dtype, (const uint16_t *)a->x + i * a->ldx, a->w, (uint16_t *)a->y + i * a->ldy, a->n, a->eps);
}

/* As batchgen_rms_norm_f32, for 16-bit x, w and y (dtype 1 = bfloat16, 2 = float16). */
void batchgen_rms_norm_16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y,
                          int64_t ldy, int64_t m, int64_t n, float eps, int dtype) {
  struct rms_args a = {x, w, y, ldx, ldy, n, eps, dtype};
  bg_parallel_for(m, row_grain(n), rms_rows_16, &a);
}

/* s = x + h over one 16-bit row of n: the sum in float32, rounded to the 16-bit type (torch's
 * bfloat16 / float16 add). */
static void add_row_16(int dtype, const uint16_t *x, const uint16_t *h, uint16_t *s, int64_t n) {
  const int64_t full = n / 8 * 8;
  for (int64_t j = 0; j < full; j += 8)
    _mm_storeu_si128((__m128i *)(s + j), narrow8(dtype, _mm256_add_ps(load8(dtype, x + j), load8(dtype, h + j))));
  if (full < n) {
    uint16_t xt[TAIL_PAD], ht[TAIL_PAD], st[TAIL_PAD];
    tail_in(x + full, n - full, xt);
    tail_in(h + full, n - full, ht);
    _mm_storeu_si128((__m128i *)st, narrow8(dtype, _mm256_add_ps(load8(dtype, xt), load8(dtype, ht))));
    memcpy(s + full, st, (size_t)(n - full) * sizeof(uint16_t));
  }
}

static void add_rms_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct add_rms_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    uint16_t *sr = (uint16_t *)a->s + i * n;
    add_row_16(a->dtype, (const uint16_t *)a->x + i * a->ldx, (const uint16_t *)a->h + i * a->ldh, sr, n);
    rms_row_16(a->dtype, sr, a->w, (uint16_t *)a->y + i * n, n, a->eps);
  }
}

/* As batchgen_add_rms_norm_f32, for 16-bit tensors (dtype 1 = bfloat16, 2 = float16). */
void batchgen_add_rms_norm_16(const uint16_t *x, int64_t ldx, const uint16_t *h, int64_t ldh, const uint16_t *w,
                              uint16_t *s, uint16_t *y, int64_t m, int64_t n, float eps, int dtype) {
  struct add_rms_args a = {x, h, w, s, y, ldx, ldh, n, eps, dtype};
  bg_parallel_for(m, row_grain(n), add_rms_rows_16, &a);
}

static inline __m256 silu8(__m256 g) {
  float lanes[8];
  _mm256_storeu_ps(lanes, g);
#pragma omp simd
  for (int l = 0; l < 8; ++l) lanes[l] = silu(lanes[l]);
  return _mm256_loadu_ps(lanes);
}

/* torch's `silu(gate) * up` on 16-bit tensors: silu in float32 rounded to the 16-bit type, then
 * the product rounded again. */
static void silu_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct silu_args *a = ctx;
  const int64_t n = a->n, full = n / 8 * 8;
  const int dtype = a->dtype;
  for (int64_t i = begin; i < end; ++i) {
    const uint16_t *g = (const uint16_t *)a->gu + i * a->ldgu;
    const uint16_t *u = g + n;
    uint16_t *yr = (uint16_t *)a->y + i * a->ldy;
    for (int64_t j = 0; j < full; j += 8) {
      __m256 s = round8(dtype, silu8(load8(dtype, g + j)));
      _mm_storeu_si128((__m128i *)(yr + j), narrow8(dtype, _mm256_mul_ps(s, load8(dtype, u + j))));
    }
    if (full < n) {
      uint16_t gt[TAIL_PAD], ut[TAIL_PAD], yt[TAIL_PAD];
      tail_in(g + full, n - full, gt);
      tail_in(u + full, n - full, ut);
      __m256 s = round8(dtype, silu8(load8(dtype, gt)));
      _mm_storeu_si128((__m128i *)yt, narrow8(dtype, _mm256_mul_ps(s, load8(dtype, ut))));
      memcpy(yr + full, yt, (size_t)(n - full) * sizeof(uint16_t));
    }
  }
}

/* As batchgen_silu_mul_f32, for 16-bit gu and y (dtype 1 = bfloat16, 2 = float16). */
void batchgen_silu_mul_16(const uint16_t *gu, int64_t ldgu, uint16_t *y, int64_t ldy, int64_t m,
                          int64_t n, int dtype) {
  struct silu_args a = {gu, y, ldgu, ldy, n, dtype};
  bg_parallel_for(m, row_grain(n), silu_rows_16, &a);
}

/* 8 values of one half of a head: y1 = x1 * c1 + (-x2) * s1 and y2 = x2 * c2 + x1 * s1, each
 * product and each sum rounded to the 16-bit type (torch's bfloat16 / float16 ops compute in
 * float32 and round every result). y1, y2 may be x1, x2. */
static inline void rope8_16(int dtype, const uint16_t *x1, const uint16_t *x2, const uint16_t *c1,
                            const uint16_t *s1, const uint16_t *c2, const uint16_t *s2, uint16_t *y1,
                            uint16_t *y2) {
  const __m256 a = load8(dtype, x1), b = load8(dtype, x2);
  const __m256 neg_b = _mm256_xor_ps(b, _mm256_set1_ps(-0.0f));
  const __m256 ac = round8(dtype, _mm256_mul_ps(a, load8(dtype, c1)));
  const __m256 bs = round8(dtype, _mm256_mul_ps(neg_b, load8(dtype, s1)));
  const __m256 bc = round8(dtype, _mm256_mul_ps(b, load8(dtype, c2)));
  const __m256 as = round8(dtype, _mm256_mul_ps(a, load8(dtype, s2)));
  _mm_storeu_si128((__m128i *)y1, narrow8(dtype, _mm256_add_ps(ac, bs)));
  _mm_storeu_si128((__m128i *)y2, narrow8(dtype, _mm256_add_ps(bc, as)));
}

static void rope_head_16(int dtype, uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t h) {
  const int64_t full = h / 8 * 8;
  for (int64_t j = 0; j < full; j += 8) rope8_16(dtype, x + j, x + h + j, c + j, s + j, c + h + j, s + h + j, x + j, x + h + j);
  if (full < h) {
    const int64_t n = h - full;
    uint16_t t[6][TAIL_PAD];
    tail_in(x + full, n, t[0]);
    tail_in(x + h + full, n, t[1]);
    tail_in(c + full, n, t[2]);
    tail_in(s + full, n, t[3]);
    tail_in(c + h + full, n, t[4]);
    tail_in(s + h + full, n, t[5]);
    rope8_16(dtype, t[0], t[1], t[2], t[3], t[4], t[5], t[0], t[1]);
    memcpy(x + full, t[0], (size_t)n * sizeof(uint16_t));
    memcpy(x + h + full, t[1], (size_t)n * sizeof(uint16_t));
  }
}

#else
static void rope_head_16(int dtype, uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t h) {
  (void)dtype, (void)x, (void)c, (void)s, (void)h; /* not reached: batchgen_rope_cache refuses */
}
#endif
