/* linear.c's register tiles: tile_f32 (float32 sums over float32, bfloat16 or float16 weights;
 * 12 x 16 on AVX-512, 6 x 16 on AVX2, MR32 its height) and, with AVX512-BF16, tile_bf16 (up to
 * 12 x 16 by vdpbf16ps). Each runs one accumulation chain per output element over k in order.
 *
 * Part of linear.c, which includes it at this point of its source, after its configuration
 * (NR, the dtype codes, BG_NATIVE_BF16) and the output conversion (store_16): not a header of
 * its own.
 */
/* ---- the float32 tile (also the 16-bit weights' tile without native bfloat16) --------- */

#if defined(__AVX512F__)
/* AVX-512: up to 12 x 16, one zmm accumulator per row (twelve chains cover the FMA latency of
 * two 512-bit pipes). The packed layout is the AVX2 one: a k-step of a panel is one zmm. */
#define MR32 12

static inline __m512 load_b512(const int wt, const char *src) {
  if (wt == F32) return _mm512_loadu_ps((const float *)src);
  __m256i w16 = _mm256_loadu_si256((const __m256i *)src);
  if (wt == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
  return _mm512_cvtph_ps(w16);
}

#define ROW(r)                                                                              \
  if (mr > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * ldx + kk]), b, c##r);
#define STORE(r)                                                                            \
  if (mr > r) {                                                                             \
    __m512 v = c##r;                                                                        \
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));                                  \
    if (yt == F32)                                                                          \
      _mm512_mask_storeu_ps((float *)y + (r) * ldy, (__mmask16)((1u << width) - 1), v);     \
    else                                                                                    \
      store_16((uint16_t *)y + (r) * ldy, _mm512_castps512_ps256(v),                        \
               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), yt, width); \
  }

static inline __attribute__((always_inline)) void
tile_f32(const int mr, const int wt, const int yt, const float *x, int64_t ldx, const void *panel,
         int64_t k, const float *bias, void *y, int64_t ldy, int64_t width, const char *pf,
         int64_t pf_step) {
  const int64_t esize = wt == F32 ? 4 : 2;
  const char *bp = (const char *)panel;
  int64_t pf_next = 0;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t kk = 0; kk < k; kk++) {
    __m512 b = load_b512(wt, bp + kk * NR * esize);
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
    /* one 64-byte line per prefetch: a float32 k-step is one line, a 16-bit one half */
    if (pf && kk == pf_next) {
      _mm_prefetch(pf + kk * NR * esize, _MM_HINT_T1);
      pf_next += pf_step * (wt == F32 ? 1 : 2);
    }
  }
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
  STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) STORE(11)
}
#undef ROW
#undef STORE

#else
/* AVX2: 6 x 16, two ymm accumulators per row: twelve chains keep both FMA ports busy. */
#define MR32 6
/* 16 weights of one k, as float32, for weight type `wt` (F32: floats; BF16/F16: 16-bit). */
#define LOAD_B(wt, src, b0, b1)                                                             \
  if (wt == F32) {                                                                          \
    b0 = _mm256_loadu_ps((const float *)(src));                                             \
    b1 = _mm256_loadu_ps((const float *)(src) + 8);                                         \
  } else if (wt == BF16) {                                                                  \
    __m256i w16 = _mm256_loadu_si256((const __m256i *)(src));                               \
    b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w16)), 16)); \
    b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w16, 1)), 16)); \
  } else {                                                                                  \
    __m256i w16 = _mm256_loadu_si256((const __m256i *)(src));                               \
    b0 = _mm256_cvtph_ps(_mm256_castsi256_si128(w16));                                      \
    b1 = _mm256_cvtph_ps(_mm256_extracti128_si256(w16, 1));                                 \
  }

#define ROW(r)                                                                              \
  if (mr > r) {                                                                             \
    __m256 av = _mm256_broadcast_ss(x + (r) * ldx + kk);                                    \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                                             \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                                             \
  }
#define STORE(r)                                                                            \
  if (mr > r) {                                                                             \
    __m256 lo = c##r##0, hi = c##r##1;                                                      \
    if (bias) {                                                                             \
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));                                        \
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));                                    \
    }                                                                                       \
    if (yt == F32) {                                                                        \
      float *yr = (float *)y + (r) * ldy;                                                   \
      if (width == NR) {                                                                    \
        _mm256_storeu_ps(yr, lo);                                                           \
        _mm256_storeu_ps(yr + 8, hi);                                                       \
      } else {                                                                              \
        float tmp[NR];                                                                      \
        _mm256_storeu_ps(tmp, lo);                                                          \
        _mm256_storeu_ps(tmp + 8, hi);                                                      \
        memcpy(yr, tmp, (size_t)width * sizeof(float));                                     \
      }                                                                                     \
    } else {                                                                                \
      store_16((uint16_t *)y + (r) * ldy, lo, hi, yt, width);                               \
    }                                                                                       \
  }

/* Rows [0, mr) of a tile; mr <= MR and the weight/output types are compile-time constants once
 * inlined, so the guarded rows fold away. x: float32 rows; panel: `wt` weights; y: `yt`
 * outputs. `pf` (or NULL) is the first line this tile prefetches; then every `pf_step`-th. */
static inline __attribute__((always_inline)) void
tile_f32(const int mr, const int wt, const int yt, const float *x, int64_t ldx, const void *panel,
         int64_t k, const float *bias, void *y, int64_t ldy, int64_t width, const char *pf,
         int64_t pf_step) {
  const int64_t esize = wt == F32 ? 4 : 2;
  const char *bp = (const char *)panel;
  int64_t pf_next = 0;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t kk = 0; kk < k; kk++) {
    __m256 b0, b1;
    LOAD_B(wt, bp + kk * NR * esize, b0, b1)
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    /* one 64-byte line per prefetch: a float32 k-step is one line, a 16-bit one half */
    if (pf && kk == pf_next) {
      _mm_prefetch(pf + kk * NR * esize, _MM_HINT_T1);
      pf_next += pf_step * (wt == F32 ? 1 : 2);
    }
  }
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

#undef ROW
#undef STORE
#endif

#if BG_NATIVE_BF16
/* ---- the bfloat16 tile: AVX512-BF16 ---------------------------------------------------- */

#define ROWB(r)                                                                             \
  if (mr > r) {                                                                             \
    int32_t pair;                                                                           \
    memcpy(&pair, x + (r) * ldx + 2 * kp, sizeof pair);                                     \
    c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(pair), b);                    \
  }
#define ROWB_TAIL(r)                                                                        \
  if (mr > r) {                                                                             \
    int32_t pair = x[(r) * ldx + k - 1]; /* the odd last k, paired with a zero */           \
    c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(pair), b);                    \
  }
#define STOREB(r)                                                                           \
  if (mr > r) {                                                                             \
    __m512 v = c##r;                                                                        \
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));                                  \
    store_16(y + (r) * ldy, _mm512_castps512_ps256(v),                                      \
             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), BF16, width); \
  }

static inline __attribute__((always_inline)) void
tile_bf16(const int mr, const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k,
          const float *bias, uint16_t *y, int64_t ldy, int64_t width, const char *pf,
          int64_t pf_step) {
  int64_t pf_next = 0, pairs = k / 2;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t kp = 0; kp < pairs; kp++) {
    __m512bh b = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * NR);
    ROWB(0) ROWB(1) ROWB(2) ROWB(3) ROWB(4) ROWB(5)
    ROWB(6) ROWB(7) ROWB(8) ROWB(9) ROWB(10) ROWB(11)
    if (pf && kp == pf_next) { /* a pair of k is one 64-byte line */
      _mm_prefetch(pf + kp * 2 * NR * 2, _MM_HINT_T1);
      pf_next += pf_step;
    }
  }
  if (k % 2) {
    __m512bh b = (__m512bh)_mm512_loadu_si512(panel + pairs * 2 * NR);
    ROWB_TAIL(0) ROWB_TAIL(1) ROWB_TAIL(2) ROWB_TAIL(3) ROWB_TAIL(4) ROWB_TAIL(5)
    ROWB_TAIL(6) ROWB_TAIL(7) ROWB_TAIL(8) ROWB_TAIL(9) ROWB_TAIL(10) ROWB_TAIL(11)
  }
  STOREB(0) STOREB(1) STOREB(2) STOREB(3) STOREB(4) STOREB(5)
  STOREB(6) STOREB(7) STOREB(8) STOREB(9) STOREB(10) STOREB(11)
}
#endif
