/* batchgen fused.c: the bfloat16 / float16 entry points (RMSNorm, the residual add and norm,
 * SiLU·up, RoPE of 16-bit heads), built where the compiler targets AVX2 and F16C (HAVE_16);
 * included by fused.c at its end. */
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

/* The sum of squares of a 16-bit row of n in float32 (8 lanes, FMA, then the lanes in order). */
static float sum_squares_16(int dtype, const uint16_t *xr, int64_t n) {
  const int64_t full = n / 8 * 8;
  uint16_t xt[TAIL_PAD];
  tail_in(xr + full, n - full, xt);
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
  return ss;
}

/* 8 outputs of the norm from x, the row's inv and the weight at w: HF's RMSNorm, t = x * inv
 * rounded to the 16-bit type, then w * t rounded again (torch's `weight * t.to(dtype)`); with
 * W_F32 in code, Gemma's, (x * inv) * w in float32 (w = 1 + weight), rounded once. */
static inline __m128i norm8(int code, const uint16_t *x, const void *w, __m256 inv) {
  const int dtype = code & DT_MASK;
  const __m256 t = _mm256_mul_ps(load8(dtype, x), inv);
  if (code & W_F32) return narrow8(dtype, _mm256_mul_ps(t, _mm256_loadu_ps((const float *)w)));
  return narrow8(dtype, _mm256_mul_ps(load8(dtype, (const uint16_t *)w), round8(dtype, t)));
}

/* The RMSNorm of a 16-bit row x of n (its weight w 16-bit, or float32 with W_F32 in code; see
 * norm8): the row in float32, inv = 1 / sqrt(mean(x^2) + eps), then 8 outputs at a time. */
static void rms_row_16(int code, const uint16_t *xr, const void *w, uint16_t *yr, int64_t n, float eps) {
  const int dtype = code & DT_MASK;
  const int64_t full = n / 8 * 8, wsize = code & W_F32 ? 4 : 2;
  const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(sum_squares_16(dtype, xr, n) / (float)n + eps));
  for (int64_t j = 0; j < full; j += 8)
    _mm_storeu_si128((__m128i *)(yr + j), norm8(code, xr + j, (const char *)w + j * wsize, inv));
  if (full < n) {
    uint16_t xt[TAIL_PAD], yt[TAIL_PAD];
    float wt[TAIL_PAD] = {0}; /* room for 8 float32 or 16-bit weights */
    tail_in(xr + full, n - full, xt);
    memcpy(wt, (const char *)w + full * wsize, (size_t)((n - full) * wsize));
    _mm_storeu_si128((__m128i *)yt, norm8(code, xt, wt, inv));
    memcpy(yr + full, yt, (size_t)(n - full) * sizeof(uint16_t));
  }
}

static void rms_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct rms_args *a = ctx;
  for (int64_t i = begin; i < end; ++i)
    rms_row_16(a->dtype, (const uint16_t *)a->x + i * a->ldx, a->w, (uint16_t *)a->y + i * a->ldy, a->n, a->eps);
}

/* As batchgen_rms_norm_f32, for 16-bit x and y (dtype 1 = bfloat16, 2 = float16) and a 16-bit w,
 * or a float32 w with W_F32 or'ed into dtype (Gemma's norm; see norm8). */
void batchgen_rms_norm_16(const uint16_t *x, int64_t ldx, const void *w, uint16_t *y,
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

struct add_args {
  const uint16_t *x, *h;
  uint16_t *s;
  int64_t n;
  int dtype;
};

static void add_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct add_args *a = ctx;
  for (int64_t i = begin; i < end; ++i) add_row_16(a->dtype, a->x + i * a->n, a->h + i * a->n, a->s + i * a->n, a->n);
}

/* s = x + h over m contiguous 16-bit rows of n (torch's bfloat16 / float16 add; s may be x). */
void batchgen_add_16(const uint16_t *x, const uint16_t *h, uint16_t *s, int64_t m, int64_t n, int dtype) {
  struct add_args a = {x, h, s, n, dtype};
  bg_parallel_for(m, row_grain(n), add_rows_16, &a);
}

static void add_rms_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct add_rms_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    uint16_t *sr = (uint16_t *)a->s + i * n;
    add_row_16(a->dtype & DT_MASK, (const uint16_t *)a->x + i * a->ldx, (const uint16_t *)a->h + i * a->ldh, sr, n);
    rms_row_16(a->dtype, sr, a->w, (uint16_t *)a->y + i * n, n, a->eps);
  }
}

/* As batchgen_add_rms_norm_f32, for 16-bit tensors (dtype 1 = bfloat16, 2 = float16), w as in
 * batchgen_rms_norm_16. */
void batchgen_add_rms_norm_16(const uint16_t *x, int64_t ldx, const uint16_t *h, int64_t ldh, const void *w,
                              uint16_t *s, uint16_t *y, int64_t m, int64_t n, float eps, int dtype) {
  struct add_rms_args a = {x, h, w, s, y, ldx, ldh, n, eps, dtype};
  bg_parallel_for(m, row_grain(n), add_rms_rows_16, &a);
}

static inline __m256 act8(int act, __m256 g) {
  float lanes[8];
  _mm256_storeu_ps(lanes, g);
  if (act == ACT_GELU_TANH) {
#pragma omp simd
    for (int l = 0; l < 8; ++l) lanes[l] = gelu_tanh(lanes[l]);
  } else {
#pragma omp simd
    for (int l = 0; l < 8; ++l) lanes[l] = silu(lanes[l]);
  }
  return _mm256_loadu_ps(lanes);
}

/* torch's `act(gate) * up` on 16-bit tensors: the activation in float32 rounded to the 16-bit
 * type, then the product rounded again. */
static void gated_rows_16(void *ctx, int64_t begin, int64_t end) {
  const struct gated_args *a = ctx;
  const int64_t n = a->n, full = n / 8 * 8;
  const int dtype = a->dtype;
  for (int64_t i = begin; i < end; ++i) {
    const uint16_t *g = (const uint16_t *)a->gu + i * a->ldgu;
    const uint16_t *u = g + n;
    uint16_t *yr = (uint16_t *)a->y + i * a->ldy;
    for (int64_t j = 0; j < full; j += 8) {
      __m256 s = round8(dtype, act8(a->act, load8(dtype, g + j)));
      _mm_storeu_si128((__m128i *)(yr + j), narrow8(dtype, _mm256_mul_ps(s, load8(dtype, u + j))));
    }
    if (full < n) {
      uint16_t gt[TAIL_PAD], ut[TAIL_PAD], yt[TAIL_PAD];
      tail_in(g + full, n - full, gt);
      tail_in(u + full, n - full, ut);
      __m256 s = round8(dtype, act8(a->act, load8(dtype, gt)));
      _mm_storeu_si128((__m128i *)yt, narrow8(dtype, _mm256_mul_ps(s, load8(dtype, ut))));
      memcpy(yr + full, yt, (size_t)(n - full) * sizeof(uint16_t));
    }
  }
}

/* As batchgen_gated_mul_f32, for 16-bit gu and y (dtype 1 = bfloat16, 2 = float16). */
void batchgen_gated_mul_16(const uint16_t *gu, int64_t ldgu, uint16_t *y, int64_t ldy, int64_t m,
                           int64_t n, int dtype, int act) {
  struct gated_args a = {gu, y, ldgu, ldy, n, dtype, act};
  bg_parallel_for(m, row_grain(n), gated_rows_16, &a);
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

/* n float32 values rounded to a 16-bit type (torch's `.to()`: nearest even, NaN kept): a
 * float32 model's K/V rows written into a 16-bit cache. */
static void narrow_row(int dtype, const float *x, uint16_t *y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(y + i), narrow8(dtype, _mm256_loadu_ps(x + i)));
  if (i < n) {
    float t[8] = {0};
    uint16_t u[8];
    memcpy(t, x + i, (size_t)(n - i) * sizeof(float));
    _mm_storeu_si128((__m128i *)u, narrow8(dtype, _mm256_loadu_ps(t)));
    memcpy(y + i, u, (size_t)(n - i) * sizeof(uint16_t));
  }
}

#else
static void rope_head_16(int dtype, uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t h) {
  (void)dtype, (void)x, (void)c, (void)s, (void)h; /* not reached: batchgen_rope_cache refuses */
}
static void narrow_row(int dtype, const float *x, uint16_t *y, int64_t n) {
  (void)dtype, (void)x, (void)y, (void)n; /* not reached: batchgen_rope_cache refuses */
}
#endif
