/* paged_attention.c's per-row arithmetic on AVX2 with FMA and F16C (BG_AVX2): the AVX-512
 * variant's steps on 8-float vectors, in the same order.
 *
 * Part of paged_attention.c, which includes it at this point of its source, after its
 * configuration (HEAD_SIZE, GROUP, the ISA macros, the dtype codes): not a header of its own.
 */
/* The AVX2 variant: the AVX-512 one's steps on 8-float vectors, in the same order. */

/* Lanes l < t of a vector set (a constant mask; t a compile-time constant). */
#define LANES_BELOW(t) _mm256_setr_epi32((t) > 0 ? -1 : 0, (t) > 1 ? -1 : 0, (t) > 2 ? -1 : 0, (t) > 3 ? -1 : 0, \
                                         (t) > 4 ? -1 : 0, (t) > 5 ? -1 : 0, (t) > 6 ? -1 : 0, (t) > 7 ? -1 : 0)

/* One query row against 4 keys k[0 .. 3]: lane l of 16 sums q[d] k[d] over d = l (mod 16) in
 * order of d, one FMA each, from zero (as two 8-lane accumulators, lanes 0-7 and 8-15), then
 * the tree's first step, lane l + (l + 8): s8[j] holds key j's 8 partial sums. */
static inline void dot4(const float *restrict q, const float *const *k, __m256 *s8) {
  __m256 lo[4], hi[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < NFULL; ++c) {
    const __m256 ql = _mm256_loadu_ps(q + 16 * c), qh = _mm256_loadu_ps(q + 16 * c + 8);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[j] + 16 * c), lo[j]);
      hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[j] + 16 * c + 8), hi[j]);
    }
  }
#if HEAD_SIZE % 16
  { /* the last HEAD_SIZE % 16 dimensions: one more FMA in lanes l < HEAD_SIZE % 16 only (a
     * blend keeps the other lanes' sums as they are, bit for bit) */
#define TAIL16 (HEAD_SIZE % 16)
    const float *qt = q + 16 * NFULL; /* the scaled query row is zero-padded to HSP */
    const __m256i ml = LANES_BELOW(TAIL16), mh = LANES_BELOW(TAIL16 - 8);
    const __m256 ql = _mm256_loadu_ps(qt), qh = _mm256_loadu_ps(qt + 8);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const float *kt = k[j] + 16 * NFULL; /* the cache's own row: no reads past HEAD_SIZE */
      lo[j] = _mm256_blendv_ps(lo[j], _mm256_fmadd_ps(ql, _mm256_maskload_ps(kt, ml), lo[j]), _mm256_castsi256_ps(ml));
      if (TAIL16 > 8)
        hi[j] = _mm256_blendv_ps(hi[j], _mm256_fmadd_ps(qh, _mm256_maskload_ps(kt + 8, mh), hi[j]),
                                 _mm256_castsi256_ps(mh));
    }
#undef TAIL16
  }
#endif
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) s8[j] = _mm256_add_ps(lo[j], hi[j]);
}

/* The rest of the tree (lane l + (l + 4), l + (l + 2), 0 + 1) of 8 slots at once, each add
 * adding the same two partial sums of the same slot as the scalar tree; lane L of the result
 * holds slot 2L (L < 4) or 2(L - 4) + 1. */
static inline __m256 tree8(const __m256 *s8) {
  __m256 t[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) /* [slot 2m's l + (l + 4), slot 2m + 1's] */
    t[m] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * m], s8[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(s8[2 * m], s8[2 * m + 1], 0x31));
  /* per 128-bit half: lanes 0 + 2, 1 + 3 of two slots */
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
}

/* The key each slot takes, so that lane L of tree8's result is key L. */
static const int KEY8[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* The scores q . k_j of one query row for keys j0 .. j0 + 7 of a block, lane j - j0: each
 * exactly the plain C dot_head's. */
static inline __m256 scores8(const float *restrict q, const float *const *rows, int j0) {
  const float *k[8];
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) k[s] = rows[j0 + KEY8[s]];
  __m256 s8[8];
  dot4(q, k, s8);
  dot4(q, k + 4, s8 + 4);
  return tree8(s8);
}

/* exp(max(x, -87)) of 8 lanes for x <= 0 (the softmax numerators): the bits of exp.h's
 * batchgen_exp_clamped, in fewer operations that hold on this range only. c = max(x, -87) lies
 * in [-87, 0], so n lies in [-126, 0] and the clamp of n changes nothing; n is rounded to
 * nearest even by vroundps (exact for |n| < 2^22, as adding and subtracting 1.5 * 2^23); and
 * p * 2^n1 * 2^n2 is p * 2^n in one product: 2^n is a normal float, and the first product is
 * exact (p is near 1, 2^n1 >= 2^-63), so both round p * 2^n once (as the AVX-512 form's
 * vscalefps). A NaN x stays NaN (its p is NaN). */
static inline __m256 exp8_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 c = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(BG_EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 p;
  BG_EXP_POLY(__m256, _mm256_set1_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, c, n, p);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Turn the n scores of a row into softmax numerators exp(s - max) in place; return their
 * sum (lanes 0-7 and 8-15 of the 16 lane sums as two vectors). sc has room for n rounded up
 * to 16; the entries past n are not used (they may hold anything). */
static inline float softmax_row(float *restrict sc, int64_t n) {
  const int64_t nf = n & ~(int64_t)15;
  const int t = (int)(n - nf);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 tl = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t), idx));
  const __m256 th = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t - 8), idx));
  const __m256 floor_ = _mm256_set1_ps(-FLT_MAX);
  __m256 ml = floor_, mh = floor_;
  for (int64_t i = 0; i < nf; i += 16) { /* s > m ? s : m */
    ml = _mm256_max_ps(_mm256_loadu_ps(sc + i), ml);
    mh = _mm256_max_ps(_mm256_loadu_ps(sc + i + 8), mh);
  }
  if (t) {
    ml = _mm256_max_ps(_mm256_blendv_ps(floor_, _mm256_loadu_ps(sc + nf), tl), ml);
    mh = _mm256_max_ps(_mm256_blendv_ps(floor_, _mm256_loadu_ps(sc + nf + 8), th), mh);
  }
  /* no NaN in ml, mh: any order */
  __m256 m8 = _mm256_max_ps(ml, mh);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const __m256 mx = _mm256_broadcastss_ps(m4);
  __m256 sl = _mm256_setzero_ps(), sh = _mm256_setzero_ps();
  for (int64_t i = 0; i < nf; i += 16) {
    const __m256 el = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mx));
    const __m256 eh = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + i + 8), mx));
    _mm256_storeu_ps(sc + i, el);
    _mm256_storeu_ps(sc + i + 8, eh);
    sl = _mm256_add_ps(sl, el);
    sh = _mm256_add_ps(sh, eh);
  }
  float total = 0.f;
  if (t) {
    _mm256_storeu_ps(sc + nf, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + nf), mx)));
    if (t > 8) _mm256_storeu_ps(sc + nf + 8, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + nf + 8), mx)));
    for (int64_t i = nf; i < n; ++i) total += sc[i];
  }
  float l[LANES];
  _mm256_storeu_ps(l, sl);
  _mm256_storeu_ps(l + 8, sh);
  for (int j = 0; j < LANES; ++j) total += l[j];
  return total;
}

/* Output elements d0 .. d0 + 7 (fewer at the row's end) of acc * inv in the output dtype. */
static inline void store8(void *dst, int dtype, int64_t d0, __m256 acc, float inv) {
  const __m256 x = _mm256_mul_ps(acc, _mm256_set1_ps(inv));
  const int n = HEAD_SIZE - d0 < 8 ? (int)(HEAD_SIZE - d0) : 8;
  if (dtype == DT_F32) {
    if (n == 8)
      _mm256_storeu_ps((float *)dst + d0, x);
    else
      _mm256_maskstore_ps((float *)dst + d0, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), x);
    return;
  }
  __m128i h;
  if (dtype == DT_BF16) { /* round to nearest even; NaN -> 0x7FC0 (f32_to_bf16) */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (n == 8) {
    _mm_storeu_si128((__m128i *)((uint16_t *)dst + d0), h);
  } else {
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, h);
    memcpy((uint16_t *)dst + d0, tmp, (size_t)n * sizeof tmp[0]);
  }
}

/* acc and output over dimensions [8 * c0, 8 * (c0 + nc)) of query rows r .. r + nr - 1 of a
 * tile, the nr * nc accumulators in registers through the whole context (16 registers: the
 * accumulators, a V row's nc vectors and a broadcast weight). Rows are ordered by the last key
 * they see, lim[r]. */
#define NV8 ((HEAD_SIZE + 7) / 8) /* 8-float vectors per head row */
#ifndef PV_REGS
#define PV_REGS 8                 /* accumulators held at once */
#endif
#define PV_DC (NV8 < 4 ? NV8 : 4)
#define PV_RB (PV_REGS / PV_DC < 8 ? PV_REGS / PV_DC : 8)

/* P.V runs over segments of the context: a 16-bit segment's V rows are converted once into
 * float32 (vseg, SEG_KEYS x HSP floats, kept in L2), then read by every pass of rows and
 * dimensions; between segments the accumulators wait in memory (accbuf), which changes no bit.
 * float32 rows are read in place, in one segment. */
#define SEG_KEYS ((16384 / HSP) / KB * KB > KB ? (16384 / HSP) / KB * KB : KB)

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
  float *vseg;           /* [SEG_KEYS][HSP]: a segment's V rows in float32 (16-bit caches) */
  float *accbuf;         /* [rows][HSP]: the accumulators between segments */
  int64_t k0, k1;        /* this segment's keys */
  int first_seg, last_seg;
} PvJob;

static inline __attribute__((always_inline)) void pv_rows(const PvJob *job, const int r, const int nr,
                                                          const int c0, const int nc) {
  __m256 acc[PV_RB][PV_DC];
  const __m256i tail = LANES_BELOW(HEAD_SIZE % 8);
  const int tail_vec = (HEAD_SIZE % 8) && c0 + nc == NV8; /* the last vector is partial */
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      acc[i][c] = job->first_seg ? _mm256_setzero_ps() : _mm256_loadu_ps(job->accbuf + (r + i) * HSP + 8 * (c0 + c));
  const int64_t first = job->lim[r], ss = job->ss, k0 = job->k0;
  const int64_t last = job->lim[r + nr - 1] < job->k1 - 1 ? job->lim[r + nr - 1] : job->k1 - 1;
  const float *w = job->w + r * ss;
  const int f32 = job->dtype == DT_F32;
  for (int64_t p = k0; p <= last; ++p) {
    const float *vr = (f32 ? (const float *)job->v_cache + job->off[p] : job->vseg + (p - k0) * HSP) + 8 * c0;
    __m256 v[PV_DC];
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      v[c] = tail_vec && c == nc - 1 ? _mm256_maskload_ps(vr + 8 * c, tail) : _mm256_loadu_ps(vr + 8 * c);
    if (p <= first) {
#pragma GCC unroll 8
      for (int i = 0; i < nr; ++i) {
        const __m256 e = _mm256_broadcast_ss(w + i * ss + p);
#pragma GCC unroll 8
        for (int c = 0; c < nc; ++c) acc[i][c] = _mm256_fmadd_ps(e, v[c], acc[i][c]);
      }
    } else { /* prefill: rows whose context ends before key p skip it */
#pragma GCC unroll 8
      for (int i = 0; i < nr; ++i) {
        if (p > job->lim[r + i]) continue;
        const __m256 e = _mm256_broadcast_ss(w + i * ss + p);
#pragma GCC unroll 8
        for (int c = 0; c < nc; ++c) acc[i][c] = _mm256_fmadd_ps(e, v[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c) {
      if (job->last_seg)
        store8(job->dst[r + i], job->out_dtype, 8 * (c0 + c), acc[i][c], job->inv[r + i]);
      else
        _mm256_storeu_ps(job->accbuf + (r + i) * HSP + 8 * (c0 + c), acc[i][c]);
    }
}

/* Rows r .. r + nr - 1 (nr <= PV_RB), every dimension. */
static inline __attribute__((always_inline)) void pv_rows_all(const PvJob *job, int r, const int nr) {
#pragma GCC unroll 8
  for (int c0 = 0; c0 < NV8; c0 += PV_DC) pv_rows(job, r, nr, c0, NV8 - c0 < PV_DC ? NV8 - c0 : PV_DC);
}

static void pv_segment(const PvJob *job, int rows) {
  for (int r = 0; r < rows; r += PV_RB) {
    switch (rows - r < PV_RB ? rows - r : PV_RB) {
#define PV_CASE(k) case k: if (k <= PV_RB) pv_rows_all(job, r, k <= PV_RB ? k : 1); break;
      PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
#undef PV_CASE
      default: break;
    }
  }
}

/* acc_r = sum_p e_rp v_p over keys 0 .. nmax - 1, in order of p, then the output rows. */
static void pv(PvJob *job, int rows, int64_t nmax) {
  const int64_t seg = job->dtype == DT_F32 ? nmax : SEG_KEYS;
  for (int64_t k0 = 0; k0 < nmax; k0 += seg) {
    const int64_t k1 = nmax - k0 < seg ? nmax : k0 + seg;
    if (job->dtype != DT_F32)
      for (int64_t p = k0; p < k1; ++p)
        convert_row((const uint16_t *)job->v_cache + job->off[p], job->dtype, job->vseg + (p - k0) * HSP);
    job->k0 = k0;
    job->k1 = k1;
    job->first_seg = k0 == 0;
    job->last_seg = k1 == nmax;
    pv_segment(job, rows);
  }
}

