/* batchgen: quant.c's activation quantization: each row of x to int8 q per block, its scale d
 * and its sums of q over every 16 (quantize_block, quantize_rows; the arithmetic is at the top
 * of quant.c), and the pair sums the steps read instead (pair_sums).
 *
 * Included by quant.c only, after quant_vec.h (it needs BG_ISA from quant.c); not built alone.
 */
#ifndef BATCHGEN_CPU_QUANT_ROWS_H
#define BATCHGEN_CPU_QUANT_ROWS_H

/* The layer's scales and sums of the activations (d, s16: c values a row) lie with the rows in
 * groups of g: value i of row r at grp_at(g, r, i, c), a group's rows side by side. A tile (MR
 * rows, MR dividing g, from a multiple of MR) then reads its rows' values at one pointer plus
 * constant offsets, rather than a pointer per row (what GCC otherwise keeps in vector
 * registers and on the stack for want of general ones). g is RG for the tiles, the call's rows
 * (1-4) for the GEMV path (a row's values then no further apart than needed: with groups of 8,
 * one row's spread over 8 times the cache lines, and Q4_0 at batch 1 ran 5 % slower), 1 for
 * the plain layout batchgen_quant_rows returns. */
#define RG 8
static inline int64_t grp_at(int64_t g, int64_t r, int64_t i, int64_t c) { return (r / g) * g * c + g * i + r % g; }
static inline int64_t rg_at(int64_t r, int64_t i, int64_t c) { return grp_at(RG, r, i, c); }

/* max |x| over one block of bk values (a multiple of 16); *finite = 0 if it holds a NaN or an
 * infinity. Any order: max is exact. */
static inline float block_amax(const float *xb, int bk, int *finite) {
#if BG_ISA == 2
  __m512 vmax = _mm512_setzero_ps();
  const __m512 fmax = _mm512_set1_ps(3.40282347e+38f);
  __mmask16 bad = 0;
  for (int t = 0; t < bk; t += 16) {
    __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb + t));
    bad |= _mm512_cmp_ps_mask(a, fmax, _CMP_NLE_UQ); /* NaN or infinity */
    vmax = _mm512_max_ps(vmax, a);
  }
  *finite = bad == 0;
  return _mm512_reduce_max_ps(vmax);
#elif BG_ISA == 1
  __m256 vmax = _mm256_setzero_ps();
  const __m256 fmax = _mm256_set1_ps(3.40282347e+38f), sign = _mm256_set1_ps(-0.0f);
  int bad = 0;
  for (int t = 0; t < bk; t += 8) {
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + t));
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));
    vmax = _mm256_max_ps(vmax, a);
  }
  *finite = bad == 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.0f;
  for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
  return amax;
#else
  int ok = 1;
  float amax = 0.0f;
  for (int t = 0; t < bk; t++) {
    float a = fabsf(xb[t]);
    ok &= a <= 3.40282347e+38f; /* false for NaN and infinities */
    amax = a > amax ? a : amax;
  }
  *finite = ok;
  return amax;
#endif
}

/* q = round-half-even(x * id), clamped to [-127, 127], over one block of bk values. */
static inline void round_block(const float *xb, int bk, float id, int8_t *qb) {
#if BG_ISA == 2
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int t = 0; t < bk; t += 16) {
    __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + t), vid)); /* nearest, ties even */
    i = _mm512_min_epi32(_mm512_max_epi32(i, lo), hi);
    _mm_storeu_si128((__m128i *)(qb + t), _mm512_cvtepi32_epi8(i));
  }
#elif BG_ISA == 1
  const __m256 vid = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int t = 0; t < bk; t += 8) {
    __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + t), vid)); /* nearest, ties even */
    i = _mm256_min_epi32(_mm256_max_epi32(i, lo), hi);
    __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)(qb + t), _mm_packs_epi16(w16, w16));
  }
#else
  for (int t = 0; t < bk; t++) {
    float v = nearbyintf(xb[t] * id); /* the default rounding mode: nearest, ties even */
    v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
    qb[t] = (int8_t)v;
  }
#endif
}

/* One block of bk values (a multiple of 16): its scale to *d_out and its quants to qb (quant.c's
 * top); NaN and q = 0 for a block with a NaN or an infinity. */
static inline void quantize_block(const float *xb, int bk, int8_t *qb, float *d_out) {
  int finite;
  const float amax = block_amax(xb, bk, &finite);
  if (!finite) {
    *d_out = NAN;
    memset(qb, 0, (size_t)bk);
    return;
  }
  float db = amax / 127.0f;
  float id = db != 0.0f ? 1.0f / db : 0.0f;
  *d_out = db;
  round_block(xb, bk, id, qb);
}

/* Quantize rows [r0, r1) of x ([m, k], row stride ldx) in blocks of bk: q [m][ldq], d (k/bk a row),
 * s16 (k/16 a row: sums of q over each 16), in groups of g rows (grp_at; 1: row after row).
 * See the top of quant.c for the arithmetic. */
static void quantize_rows(const float *x, int64_t ldx, int64_t k, int bk, int64_t r0, int64_t r1,
                          int8_t *q, int64_t ldq, float *d, int32_t *s16, int64_t g) {
  int64_t nb = k / bk;
  for (int64_t r = r0; r < r1; r++) {
    const float *xr = x + r * ldx;
    int8_t *qr = q + r * ldq;
    for (int64_t b = 0; b < nb; b++) quantize_block(xr + b * bk, bk, qr + b * bk, d + grp_at(g, r, b, nb));
    for (int64_t j = 0; j < k / 16; j++) {
      int32_t s = 0;
      for (int t = 0; t < 16; t++) s += qr[j * 16 + t];
      s16[grp_at(g, r, j, k / 16)] = s;
    }
  }
}

/* What the steps read of the sums, computed once per row instead of in every panel's inner loop
 * (batchgen_quant_rows returns the sums as they are). A format whose quants carry a zero point
 * (u = w + (1 << zsh): FORMATS_LIST's zsh, 0 for none) subtracts sx << zsh from each dot; that
 * term is kept here, negated, for the dots to start from (Z_OF in quant_dots.h):
 *   units 16 (Q6_K): slot j holds -(s16[j] << zsh);
 *   units 1 and 8 (sub-blocks of 32): slot 2j holds sx_j, the sum over the 32 values j
 *     (s16[2j] + s16[2j + 1]); with blocks of 32 (units 1), slot 2j + 1 then holds -(sx_j << zsh)
 *     or, without a zero point (Q4_1), the float bits of d_j * (float)sx_j (its dx sx); with
 *     blocks of 256 (Q4_K, Q5_K), slot 4i + 1 of a block holds its sums 2i and 2i + 1 as 16-bit
 *     halves (|sx| <= 32 * 127 fits), the pairs add_k takes with vi_dot16.
 * The same integers and the same float product as the steps computed before. d and s16 in
 * groups of g rows (grp_at). */
static void pair_sums(int64_t k, int bk, int units, int zsh, int64_t g, int64_t r0, int64_t r1, const float *d,
                      int32_t *s16) {
  for (int64_t r = r0; r < r1; r++) {
    int32_t *sr = s16 + grp_at(g, r, 0, k / 16); /* slot i at sr[g * i] */
    if (units == 16) {
      for (int64_t j = 0; zsh && j < k / 16; j++) sr[g * j] = -(sr[g * j] * (1 << zsh));
      continue;
    }
    for (int64_t j = 0; j < k / 32; j++) {
      const int32_t sx = sr[g * 2 * j] + sr[g * (2 * j + 1)];
      sr[g * 2 * j] = sx;
      if (bk == 256 && j % 2) { /* pair (j - 1, j): slot 2(j - 1) + 1 */
        const uint32_t lo = (uint32_t)sr[g * 2 * (j - 1)] & 0xffffu, hi = (uint32_t)sx << 16;
        sr[g * (2 * (j - 1) + 1)] = (int32_t)(lo | hi);
      } else if (bk == 32 && zsh) {
        sr[g * (2 * j + 1)] = -(sx * (1 << zsh));
      } else if (bk == 32) {
        const float sxd = d[grp_at(g, r, j, k / 32)] * (float)sx;
        memcpy(sr + g * (2 * j + 1), &sxd, sizeof sxd);
      }
    }
  }
}

#endif /* BATCHGEN_CPU_QUANT_ROWS_H */
