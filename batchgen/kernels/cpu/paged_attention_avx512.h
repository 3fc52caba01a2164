/* paged_attention.c's per-row arithmetic on AVX-512 (BG_AVX512): the score tree, the exp and
 * softmax, P.V over 16-float vectors.
 *
 * Part of paged_attention.c, which includes it at this point of its source, after its
 * configuration (HEAD_SIZE, GROUP, the ISA macros, the dtype codes): not a header of its own.
 */
/* The first three steps of the tree (lane l + (l + 8), l + (l + 4), l + (l + 2)) of 8 slots
 * (one query row's accumulators against 8 keys) at once: a shuffle and a blend line up the
 * lanes to add, an add adds them; a slot's lanes are only added to the same slot's. Leaves in 128-bit
 * quarter q the two partial sums of two slots: q0 slots 0, 1; q1 4, 5; q2 2, 3; q3 6, 7. */
static inline __m512 tree8(const __m512 *acc) {
  __m512 t[4], u[2];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) /* [m.q0 + m.q2, m.q1 + m.q3, (m+4).q2 + (m+4).q0, (m+4).q3 + (m+4).q1] */
    t[m] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, acc[m], acc[m + 4]),
                         _mm512_shuffle_f32x4(acc[m], acc[m + 4], 0x4E));
#pragma GCC unroll 2
  for (int n = 0; n < 2; ++n) /* quarters: slots [n, n + 4, n + 2, n + 6] */
    u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(t[n], t[n + 2], 0x88),
                         _mm512_shuffle_f32x4(t[n], t[n + 2], 0xDD));
  /* in each quarter: lanes 0 + 2, 1 + 3 of u[0], then of u[1] */
  return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, u[0], u[1]), _mm512_shuffle_ps(u[0], u[1], 0x4E));
}

/* The last step (0 + 1) of two tree8 results, a's slots and b's: lane L then holds the slot
 * KEY_A (a) or KEY_B (b) assigns key L. */
static const int KEY_A[8] = {0, 1, 8, 9, 4, 5, 12, 13};
static const int KEY_B[8] = {2, 3, 10, 11, 6, 7, 14, 15};

static inline __m512 tree_last(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* One query row against 8 keys (rows[slot[0 .. 7]]), up to tree8: accumulator j, lane l sums
 * q[d] k[d] over d = l (mod 16) in order of d, one FMA each, from zero (dot_head's lanes). */
static inline __m512 half8(const float *restrict q, const float *const *rows, const int *slot) {
  const float *k[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) k[j] = rows[slot[j]];
  __m512 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < NFULL; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[j] + 16 * c), acc[j]);
  }
#if HEAD_SIZE % 16
  {
    const __mmask16 m = (__mmask16)((1u << (HEAD_SIZE % 16)) - 1);
    const __m512 qc = _mm512_maskz_loadu_ps(m, q + 16 * NFULL);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm512_mask3_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k[j] + 16 * NFULL), acc[j], m);
  }
#endif
  return tree8(acc);
}

/* The 16 scores q . k_j (j < 16) of one query row, lane j: each exactly dot_head's. */
static inline __m512 scores16(const float *restrict q, const float *const *rows) {
  return tree_last(half8(q, rows, KEY_A), half8(q, rows, KEY_B));
}

/* A key block transposed: kt[16 d + j] = rows[j][d] for d < HSP (dimensions past HEAD_SIZE 0),
 * by four 16 x 16 transposes (32-bit, then 64-bit interleaves within 128-bit quarters, then
 * the quarters): 64 shuffles per 16 dimensions, once per key block, shared by the tile's rows. */
static inline void transpose_block(const float *const *rows, float *restrict kt) {
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) {
    const __mmask16 m = (HEAD_SIZE % 16) && c == NFULL ? (__mmask16)((1u << (HEAD_SIZE % 16)) - 1) : 0xFFFF;
    __m512 r[16], a[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_ps(m, rows[j] + 16 * c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) { /* quarter L: r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1] and 4L+2, 4L+3 */
      a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) { /* r[4i + n], quarter L: dimension 4L + n of rows 4i .. 4i + 3 */
      const __m512d x0 = _mm512_castps_pd(a[4 * i]), x1 = _mm512_castps_pd(a[4 * i + 1]);
      const __m512d x2 = _mm512_castps_pd(a[4 * i + 2]), x3 = _mm512_castps_pd(a[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
    }
    float *out = kt + 256 * c;
#pragma GCC unroll 4
    for (int n = 0; n < 4; ++n) { /* dimension 4L + n gathers quarter L of r[n], r[4 + n], r[8 + n], r[12 + n] */
      const __m512 c0 = _mm512_shuffle_f32x4(r[n], r[4 + n], 0x44), c1 = _mm512_shuffle_f32x4(r[n], r[4 + n], 0xEE);
      const __m512 c2 = _mm512_shuffle_f32x4(r[8 + n], r[12 + n], 0x44), c3 = _mm512_shuffle_f32x4(r[8 + n], r[12 + n], 0xEE);
      _mm512_storeu_ps(out + 16 * n, _mm512_shuffle_f32x4(c0, c2, 0x88));
      _mm512_storeu_ps(out + 16 * (4 + n), _mm512_shuffle_f32x4(c0, c2, 0xDD));
      _mm512_storeu_ps(out + 16 * (8 + n), _mm512_shuffle_f32x4(c1, c3, 0x88));
      _mm512_storeu_ps(out + 16 * (12 + n), _mm512_shuffle_f32x4(c1, c3, 0xDD));
    }
  }
}

/* Scores of SR query rows at once against a transposed key block (transpose_block): lane j of
 * out[i] is scores16's bits for row q[i] and key j. Accumulator l of a row holds lane l of its
 * 16 dot products (q[d] k_j[d] over d = l (mod 16), in order of d, from zero), so the tree adds
 * whole registers, no shuffles; each kt vector loaded feeds SR rows. The lanes are computed in
 * the tree's own order, depth first (l and l + 8, then their sum, ...), so at most 5 registers
 * a row are live. */
#define SR 4

static inline __attribute__((always_inline)) void lane_t(const float *const *q, const float *restrict kt, int l, __m512 *p) {
#pragma GCC unroll 8
  for (int i = 0; i < SR; ++i) p[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c)
    if (c < NFULL || l < HEAD_SIZE % 16) {
      const __m512 k = _mm512_loadu_ps(kt + 16 * (16 * c + l));
#pragma GCC unroll 8
      for (int i = 0; i < SR; ++i) p[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][16 * c + l]), k, p[i]);
    }
}

/* The tree's levels, each lane l + (l + step) of the level below: step 8 over the lanes'
 * accumulators, then 4 and 2 (scores_t adds the last, 0 + 1). */
#define TREE_LEVEL(name, below, step)                                                                   \
  static inline __attribute__((always_inline)) void name(const float *const *q, const float *restrict kt, \
                                                         int l, __m512 *s) {                            \
    __m512 b_[SR];                                                                                      \
    below(q, kt, l, s);                                                                                 \
    below(q, kt, l + (step), b_);                                                                       \
    _Pragma("GCC unroll 8") for (int i = 0; i < SR; ++i) s[i] = _mm512_add_ps(s[i], b_[i]);           \
  }
TREE_LEVEL(s8_t, lane_t, 8)
TREE_LEVEL(s4_t, s8_t, 4)
TREE_LEVEL(s2_t, s4_t, 2)
#undef TREE_LEVEL

static inline void scores_t(const float *const *q, const float *restrict kt, float *const *out) {
  __m512 a[SR], b[SR];
  s2_t(q, kt, 0, a);
  s2_t(q, kt, 1, b);
#pragma GCC unroll 8
  for (int i = 0; i < SR; ++i) _mm512_storeu_ps(out[i], _mm512_add_ps(a[i], b[i]));
}

/* Scores of query rows r .. rows - 1 (q + i * HSP) against a transposed key block, into score
 * rows sc + i * ss: SR rows a call, a last call short of rows repeating its last row. */
static void scores_rows_t(const float *q, int r, const int rows, const float *restrict kt, float *sc, const int64_t ss) {
  for (; r < rows; r += SR) {
    const float *qi[SR];
    float *out[SR];
    for (int i = 0; i < SR; ++i) {
      const int ri = r + i < rows ? r + i : rows - 1;
      qi[i] = q + ri * HSP;
      out[i] = sc + ri * ss;
    }
    scores_t(qi, kt, out);
  }
}

/* Turn the n scores of a row into softmax numerators exp(s - max) in place; return their
 * sum. sc has room for n rounded up to 16. */
static inline float softmax_row(float *restrict sc, int64_t n) {
  const int64_t nf = n & ~(int64_t)15;
  const __mmask16 tail = (__mmask16)((1u << (n - nf)) - 1);
  __m512 mv = _mm512_set1_ps(-FLT_MAX);
  for (int64_t i = 0; i < nf; i += 16) mv = _mm512_max_ps(_mm512_loadu_ps(sc + i), mv); /* s > m ? s : m */
  if (tail) mv = _mm512_mask_max_ps(mv, tail, _mm512_loadu_ps(sc + nf), mv);
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv)); /* no NaN in mv: any order */
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __m512 lanes = _mm512_setzero_ps();
  int64_t i = 0;
  /* four vectors' exps side by side (independent chains for the out-of-order core), added to
   * the lanes in order of i as below */
  for (; i + 64 <= nf; i += 64) {
    __m512 e[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + i + 16 * u), mx);
      x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
      e[u] = batchgen_exp16_clamped(x);
      _mm512_storeu_ps(sc + i + 16 * u, e[u]);
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) lanes = _mm512_add_ps(lanes, e[u]);
  }
  for (; i < nf; i += 16) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + i), mx);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
    const __m512 e = batchgen_exp16_clamped(x);
    _mm512_storeu_ps(sc + i, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  float total = 0.f;
  if (tail) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + nf), mx);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
    _mm512_storeu_ps(sc + nf, batchgen_exp16_clamped(x));
    for (int64_t i = nf; i < n; ++i) total += sc[i];
  }
  float l[LANES];
  _mm512_storeu_ps(l, lanes);
  for (int j = 0; j < LANES; ++j) total += l[j];
  return total;
}

/* Output elements d0 .. d0 + 15 (fewer at the row's end) of acc * inv in the output dtype. */
static inline void store16(void *dst, int dtype, int64_t d0, __m512 acc, float inv) {
  const __m512 x = _mm512_mul_ps(acc, _mm512_set1_ps(inv));
  const int n = HEAD_SIZE - d0 < 16 ? (int)(HEAD_SIZE - d0) : 16;
  if (dtype == DT_F32) {
    _mm512_mask_storeu_ps((float *)dst + d0, (__mmask16)((1u << n) - 1), x);
    return;
  }
  __m256i h;
  if (dtype == DT_BF16) { /* round to nearest even; NaN -> 0x7FC0 (f32_to_bf16) */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (n == 16) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + d0), h);
  } else {
    uint16_t tmp[16];
    _mm256_storeu_si256((__m256i *)tmp, h);
    memcpy((uint16_t *)dst + d0, tmp, (size_t)n * sizeof tmp[0]);
  }
}

/* acc and output over dimensions [16 * c0, 16 * (c0 + nc)) of query rows r .. r + nr - 1 of
 * a tile, the nr * nc accumulators in registers through the whole context. Rows are ordered
 * by the last key they see, lim[r]. */
#define PV_REGS 24 /* accumulators held at once */
#define PV_DC (NV < 8 ? NV : 8)
#define PV_RB (PV_REGS / PV_DC < 8 ? PV_REGS / PV_DC : 8)

typedef struct {
  const void *v_cache;
  int dtype;             /* the V cache's */
  int out_dtype;         /* the output's (the query's) */
  int64_t ss;
  const int64_t *off;    /* element offset of each key's row */
  const float *w;        /* numerators [rows][ss] */
  const int64_t *lim;    /* last key of each row */
  const float *inv;      /* 1 / sum of each row */
  void *const *dst;      /* output row of each row */
} PvJob;

/* Vector c (dimensions 16 c ..) of the V row at element offset o of the cache, as float32,
 * converted in the register as it is read (exact: float16 and bfloat16 widen without rounding);
 * `partial`: only the HEAD_SIZE % 16 dimensions of the last vector, the rest 0. */
static inline __attribute__((always_inline)) __m512 v_vec(const void *cache, const int dtype, const int64_t o,
                                                          const int c, const int partial) {
  if (dtype == DT_F32) {
    const float *p = (const float *)cache + o + 16 * c;
    return partial ? _mm512_maskz_loadu_ps((__mmask16)((1u << (HEAD_SIZE % 16)) - 1), p) : _mm512_loadu_ps(p);
  }
  const uint16_t *p = (const uint16_t *)cache + o + 16 * c;
  __m256i h;
  if (partial) {
    uint16_t tmp[16] = {0};
    memcpy(tmp, p, (HEAD_SIZE % 16) * sizeof tmp[0]);
    h = _mm256_loadu_si256((const __m256i *)tmp);
  } else {
    h = _mm256_loadu_si256((const __m256i *)p);
  }
  if (dtype == DT_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* `dtype` is the V cache's, a constant where pv() calls this (one copy per dtype): a 16-bit
 * row is widened in the register as it is read, once for the nr rows (converting each key
 * block into a buffer for every group of rows cost a float16 prefill a quarter of P.V on the
 * Zen 4). */
static inline __attribute__((always_inline)) void pv_rows(const PvJob *job, const int dtype, const int r,
                                                          const int nr, const int c0, const int nc) {
  __m512 acc[PV_RB][PV_DC];
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_setzero_ps();
  const int64_t first = job->lim[r], last = job->lim[r + nr - 1], ss = job->ss;
  const float *w = job->w + r * ss;
  const int tail_vec = (HEAD_SIZE % 16) && c0 + nc == NV; /* the last vector is partial */
  for (int64_t kb = 0; kb <= last; kb += KB) {
    const int n = last + 1 - kb < KB ? (int)(last + 1 - kb) : KB;
    const int all = first + 1 - kb >= n ? n : (int)(first + 1 - kb); /* keys every row sees */
    const int64_t *off = job->off + kb;
    const float *wk = w + kb;
    for (int j = 0; j < n; ++j) {
      __m512 v[PV_DC];
#pragma GCC unroll 8
      for (int c = 0; c < nc; ++c) v[c] = v_vec(job->v_cache, dtype, off[j], c0 + c, tail_vec && c == nc - 1);
      if (j < all) {
#pragma GCC unroll 8
        for (int i = 0; i < nr; ++i) {
          const __m512 e = _mm512_set1_ps(wk[i * ss + j]);
#pragma GCC unroll 8
          for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_fmadd_ps(e, v[c], acc[i][c]);
        }
      } else { /* prefill: rows whose context ends before key kb + j skip it */
#pragma GCC unroll 8
        for (int i = 0; i < nr; ++i) {
          if (kb + j > job->lim[r + i]) continue;
          const __m512 e = _mm512_set1_ps(wk[i * ss + j]);
#pragma GCC unroll 8
          for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_fmadd_ps(e, v[c], acc[i][c]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      store16(job->dst[r + i], job->out_dtype, 16 * (c0 + c), acc[i][c], job->inv[r + i]);
}

/* Rows r .. r + nr - 1 (nr <= PV_RB), every dimension. */
static inline __attribute__((always_inline)) void pv_rows_all(const PvJob *job, const int dtype, int r,
                                                              const int nr) {
#pragma GCC unroll 8
  for (int c0 = 0; c0 < NV; c0 += PV_DC) pv_rows(job, dtype, r, nr, c0, NV - c0 < PV_DC ? NV - c0 : PV_DC);
}

static inline __attribute__((always_inline)) void pv_of(const PvJob *job, const int dtype, int rows) {
  for (int r = 0; r < rows; r += PV_RB) {
    switch (rows - r < PV_RB ? rows - r : PV_RB) {
#define PV_CASE(k) case k: if (k <= PV_RB) pv_rows_all(job, dtype, r, k <= PV_RB ? k : 1); break;
      PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
#undef PV_CASE
      default: break;
    }
  }
}

static void pv(const PvJob *job, int rows) {
  if (job->dtype == DT_F32) pv_of(job, DT_F32, rows);
  else if (job->dtype == DT_F16) pv_of(job, DT_F16, rows);
  else pv_of(job, DT_BF16, rows);
}

