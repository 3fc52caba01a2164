/* batchgen: quant.c's integer dot products of one unit of a panel's block against up to MR rows
 * of int8 q, exact int32, for each build: plain C over a decoded scratch (unit_dot), and, reading
 * the packed panel and decoding in registers, AVX-512 VNNI, AVX-VNNI and AVX2 (unit_dot_direct,
 * unit_dot_q5, unit_dot_q6). Defines MR (rows per tile) and BG_DIRECT (1: the direct kernels).
 *
 * Included by quant.c only, after quant_vec.h (vi, BG_ISA, BG_AVXVNNI, NR); not built alone.
 */
#ifndef BATCHGEN_CPU_QUANT_DOTS_H
#define BATCHGEN_CPU_QUANT_DOTS_H

/* ---- the integer dot products: up to MR rows x 16 columns over the groups of 4 k of a unit ----
 * MR: rows per tile (what the build's accumulators fit in its registers). */
#if BG_ISA == 2
#define MR 8
#elif BG_AVXVNNI
#define MR 4
#else
#define MR 4 /* the AVX2 build: 2 had each block decoded for half as many rows (the Zen 4, the AVX2
              * build forced: 4 rows 1.03-1.10x at 8-300 rows, 1.05-1.21x at 4; 3 rows mixed) */
#endif

/* Where each sum starts: row r's zero-point term z[r * ldz] (-(sx << zsh), see pair_sums in
 * quant_rows.h: dot - (sx << zsh) as (-(sx << zsh)) + dot, the same int32) or, z NULL, 0. The
 * subtraction then costs no vector operation of its own (the broadcast is a load). */
#define Z_OF(r) (z && (r) < mr ? z[(r) * ldz] : 0)

#if BG_ISA == 0
/* out[r] (16 lanes) = sum_{g, t} u[g][c][t] * q[r][4g + t], exact, over a decoded scratch. */
static inline void unit_dot(const int mr, const uint8_t *u, const int groups, const int8_t *q, int64_t ldq,
                            const int32_t *z, int64_t ldz, vi *out) {
  for (int r = 0; r < mr; r++)
    for (int c = 0; c < NR; c++) {
      int32_t s = Z_OF(r);
      for (int g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) s += (int32_t)u[64 * g + 4 * c + t] * (int32_t)q[r * ldq + 4 * g + t];
      out[r].v[c] = s;
    }
}
#endif

/* The same dot products read straight from the packed panel, decoding in registers (no
 * scratch): `kind` says how the 64-byte chunks at `src` hold the unit's 8 groups.
 *   K_Q4_32:  Q4_0/Q4_1: chunk i's low nibbles are group i, its high nibbles group i + 4 (i < 4)
 *   K_Q8:     Q8_0: chunk g is group g, u = w + 128 (flip the sign bit)
 *   K_Q4K_LO / K_Q4K_HI: Q4_K: chunk i's low (even sub-block) or high (odd) nibbles are group i */
enum { K_Q4_32, K_Q8, K_Q4K_LO, K_Q4K_HI };
#if BG_ISA == 1
/* Q6_K on 256 bits (the AVX2 and AVX-VNNI builds): half `half` (columns 0-7 or 8-15) of group
 * g's quants, the nibble `s` of ql chunk g and the two bits at `sh` of qh chunk g,
 * u = lo | hi << 4 <= 63. */
static inline __attribute__((always_inline)) __m256i q6_half(const uint8_t *ql, const uint8_t *qh, const int g,
                                                             const int half, const int s, const int sh) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 64 * g + 32 * half));
  __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 64 * g + 32 * half));
  l = _mm256_and_si256(s ? _mm256_srli_epi16(l, 4) : l, m4);
  h = _mm256_and_si256(sh <= 4 ? _mm256_slli_epi16(h, 4 - sh) : _mm256_srli_epi16(h, sh - 4), m30);
  return _mm256_or_si256(l, h);
}
/* Q5_0 and Q5_K on 256 bits: half `half` (columns 0-7 or 8-15) of group g's quants, as q5_w in
 * the AVX-512 build (u <= 31). */
static inline __attribute__((always_inline)) __m256i q5_half(const uint8_t *qs, const uint8_t *qh, const int j,
                                                             const int g, const int half) {
  const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);
  if (j < 0) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)(qs + 64 * (g % 4) + 32 * half));
    const __m256i lo = _mm256_and_si256(g < 4 ? c : _mm256_srli_epi16(c, 4), m4);
    const __m256i spread = _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404,
                                                             0x08080808, 0x0c0c0c0c),
                                           _mm256_set1_epi8((char)(g / 2)));
    const __m256i sel = _mm256_set1_epi32((int)(0x08040201u << (4 * (g % 2))));
    const __m256i hb = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(qh + 32 * half)), spread);
    return _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, sel), sel), m16));
  }
  const __m256i c = _mm256_loadu_si256((const __m256i *)(qs + 64 * g + 32 * half));
  const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 64 * g + 32 * half));
  const __m256i lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(c, 4) : c, m4);
  return _mm256_or_si256(lo, _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4), m16));
}
#endif
#if BG_ISA == 2
#define DPW(r, wv, g)                                                                  \
  if (mr > r)                                                                          \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0"                                             \
            : "+v"(a##r)                                                               \
            : "v"(wv), "m"(*(const int32_t *)(const void *)(q + (r) * ldq + 4 * (g))));
#define DPW_ALL(wv, g) DPW(0, wv, g) DPW(1, wv, g) DPW(2, wv, g) DPW(3, wv, g) DPW(4, wv, g) DPW(5, wv, g) DPW(6, wv, g) DPW(7, wv, g)
static inline __attribute__((always_inline)) void unit_dot_direct(const int mr, const uint8_t *src, const int kind,
                                                                  const int8_t *q, int64_t ldq, const int32_t *z,
                                                                  int64_t ldz, vi *out) {
  const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
  __m512i a0 = _mm512_set1_epi32(Z_OF(0)), a1 = _mm512_set1_epi32(Z_OF(1)), a2 = _mm512_set1_epi32(Z_OF(2)),
          a3 = _mm512_set1_epi32(Z_OF(3)), a4 = _mm512_set1_epi32(Z_OF(4)), a5 = _mm512_set1_epi32(Z_OF(5)),
          a6 = _mm512_set1_epi32(Z_OF(6)), a7 = _mm512_set1_epi32(Z_OF(7));
  if (kind == K_Q4_32) {
    for (int i = 0; i < 4; i++) {
      const __m512i c = _mm512_loadu_si512((const void *)(src + 64 * i));
      const __m512i lo = _mm512_and_si512(c, m4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
      DPW_ALL(lo, i)
      DPW_ALL(hi, i + 4)
    }
  } else {
    for (int g = 0; g < 8; g++) {
      const __m512i c = _mm512_loadu_si512((const void *)(src + 64 * g));
      const __m512i w = kind == K_Q8 ? _mm512_xor_si512(c, flip)
                        : kind == K_Q4K_LO ? _mm512_and_si512(c, m4)
                                           : _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
      DPW_ALL(w, g)
    }
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}
/* Q6_K, one unit of 16 k (4 groups): group t's quants are the nibble `s` of ql chunk t and the
 * two bits at `sh` of qh chunk t, u = lo | hi << 4 <= 63. */
static inline __attribute__((always_inline)) __m512i q6_w(const uint8_t *ql, const uint8_t *qh, const int s,
                                                          const int sh, const int g) {
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  __m512i l = _mm512_loadu_si512((const void *)(ql + 64 * g));
  __m512i h = _mm512_loadu_si512((const void *)(qh + 64 * g));
  l = _mm512_and_si512(s ? _mm512_srli_epi16(l, 4) : l, m4);
  h = _mm512_and_si512(sh <= 4 ? _mm512_slli_epi16(h, 4 - sh) : _mm512_srli_epi16(h, sh - 4), m30);
  return _mm512_or_si512(l, h);
}
static inline __attribute__((always_inline)) void unit_dot_q6(const int mr, const uint8_t *ql, const uint8_t *qh,
                                                              const int s, const int sh, const int8_t *q,
                                                              int64_t ldq, const int32_t *z, int64_t ldz, vi *out) {
  __m512i a0 = _mm512_set1_epi32(Z_OF(0)), a1 = _mm512_set1_epi32(Z_OF(1)), a2 = _mm512_set1_epi32(Z_OF(2)),
          a3 = _mm512_set1_epi32(Z_OF(3)), a4 = _mm512_set1_epi32(Z_OF(4)), a5 = _mm512_set1_epi32(Z_OF(5)),
          a6 = _mm512_set1_epi32(Z_OF(6)), a7 = _mm512_set1_epi32(Z_OF(7));
  for (int g = 0; g < 4; g++) {
    const __m512i w = q6_w(ql, qh, s, sh, g);
    DPW_ALL(w, g)
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}
/* Q5_0 and Q5_K: group g's quants, the nibble plus a fifth bit (u = lo | hi << 4 <= 31).
 *   j < 0 (Q5_0): chunk g % 4 of qs, its low nibbles for g < 4, high ones above; the fifth bits
 *     are bits 4g..4g+3 of each column's 32-bit qh (lane c of the one chunk at qh): byte g / 2
 *     of the lane spread to its 4 bytes, each tested against its own bit;
 *   j >= 0 (Q5_K, sub-block j): chunk g of qs (nibble j % 2) and bit j of qh chunk g. */
static inline __attribute__((always_inline)) __m512i q5_w(const uint8_t *qs, const uint8_t *qh, const int j,
                                                          const int g) {
  const __m512i m4 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(16);
  if (j < 0) {
    const __m512i c = _mm512_loadu_si512((const void *)(qs + 64 * (g % 4)));
    const __m512i lo = _mm512_and_si512(g < 4 ? c : _mm512_srli_epi16(c, 4), m4);
    const __m512i spread = _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0),
                                           _mm512_set1_epi8((char)(g / 2)));
    const __m512i hb = _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)qh), spread);
    const __mmask64 set = _mm512_test_epi8_mask(hb, _mm512_set1_epi32((int)(0x08040201u << (4 * (g % 2)))));
    return _mm512_mask_add_epi8(lo, set, lo, m16);
  }
  const __m512i c = _mm512_loadu_si512((const void *)(qs + 64 * g));
  const __m512i h = _mm512_loadu_si512((const void *)(qh + 64 * g));
  const __m512i lo = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(c, 4) : c, m4);
  return _mm512_or_si512(lo, _mm512_and_si512(j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4), m16));
}
static inline __attribute__((always_inline)) void unit_dot_q5(const int mr, const uint8_t *qs, const uint8_t *qh,
                                                              const int j, const int8_t *q, int64_t ldq,
                                                              const int32_t *z, int64_t ldz, vi *out) {
  __m512i a0 = _mm512_set1_epi32(Z_OF(0)), a1 = _mm512_set1_epi32(Z_OF(1)), a2 = _mm512_set1_epi32(Z_OF(2)),
          a3 = _mm512_set1_epi32(Z_OF(3)), a4 = _mm512_set1_epi32(Z_OF(4)), a5 = _mm512_set1_epi32(Z_OF(5)),
          a6 = _mm512_set1_epi32(Z_OF(6)), a7 = _mm512_set1_epi32(Z_OF(7));
  for (int g = 0; g < 8; g++) {
    const __m512i w = q5_w(qs, qh, j, g);
    DPW_ALL(w, g)
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}
#undef DPW_ALL
#undef DPW
#define BG_DIRECT 1
#elif BG_AVXVNNI
/* AVX-VNNI: vpdpbusd on 256 bits (VEX), two per row and group (columns 0-7 and 8-15). It adds
 * each column's 4 products u * q to its int32 lane, exactly (no int16 step, no saturation):
 * the same integers as the AVX2 pairs below, which never saturate either (u <= 63, |q| <= 127),
 * so the bits are the same. Q8_0's u (up to 255) goes in whole. */
static inline __attribute__((always_inline)) __m256i q_bcast(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
#define DP_ROWS(w0, w1, g)                                                               \
  for (int r = 0; r < MR; r++) {                                                         \
    if (r < mr) {                                                                        \
      const __m256i xb = q_bcast(q + r * ldq + 4 * (g));                                 \
      a[r] = _mm256_dpbusd_avx_epi32(a[r], (w0), xb);                                    \
      b[r] = _mm256_dpbusd_avx_epi32(b[r], (w1), xb);                                    \
    }                                                                                    \
  }
static inline __attribute__((always_inline)) void unit_dot_direct(const int mr, const uint8_t *src, const int kind,
                                                                  const int8_t *q, int64_t ldq, const int32_t *z,
                                                                  int64_t ldz, vi *out) {
  const __m256i m4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_set1_epi32(Z_OF(r));
  /* group g = 4h + t, chunk t (Q4_0/Q4_1) or g: fixed trip counts, whatever `kind` */
  for (int h = 0; h < 2; h++) {
    for (int t = 0; t < 4; t++) {
      const int g = 4 * h + t, chunk = kind == K_Q4_32 ? t : g;
      const __m256i c0 = _mm256_loadu_si256((const __m256i *)(src + 64 * chunk));
      const __m256i c1 = _mm256_loadu_si256((const __m256i *)(src + 64 * chunk + 32));
      __m256i w0, w1;
      if (kind == K_Q8) {
        w0 = _mm256_xor_si256(c0, flip), w1 = _mm256_xor_si256(c1, flip);
      } else { /* the nibble by a shift count, not a branch: `kind` is not a constant for Q4_K
                * (its units alternate low and high), and on a branch GCC loads and spills
                * every chunk first */
        const __m128i sh = _mm_cvtsi32_si128(kind == K_Q4K_HI || (kind == K_Q4_32 && h == 1) ? 4 : 0);
        w0 = _mm256_and_si256(_mm256_srl_epi16(c0, sh), m4), w1 = _mm256_and_si256(_mm256_srl_epi16(c1, sh), m4);
      }
      DP_ROWS(w0, w1, g)
    }
  }
  for (int r = 0; r < MR; r++)
    if (r < mr) out[r] = (vi){a[r], b[r]};
}
/* Q6_K (see the AVX-512 version): u = lo | hi << 4 <= 63. */
static inline __attribute__((always_inline)) void unit_dot_q6(const int mr, const uint8_t *ql, const uint8_t *qh,
                                                              const int s, const int sh, const int8_t *q,
                                                              int64_t ldq, const int32_t *z, int64_t ldz, vi *out) {
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_set1_epi32(Z_OF(r));
  for (int g = 0; g < 4; g++) {
    const __m256i w[2] = {q6_half(ql, qh, g, 0, s, sh), q6_half(ql, qh, g, 1, s, sh)};
    DP_ROWS(w[0], w[1], g)
  }
  for (int r = 0; r < MR; r++)
    if (r < mr) out[r] = (vi){a[r], b[r]};
}
/* Q5_0 and Q5_K (see q5_half): u <= 31. */
static inline __attribute__((always_inline)) void unit_dot_q5(const int mr, const uint8_t *qs, const uint8_t *qh,
                                                              const int j, const int8_t *q, int64_t ldq,
                                                              const int32_t *z, int64_t ldz, vi *out) {
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_set1_epi32(Z_OF(r));
  for (int g = 0; g < 8; g++) {
    const __m256i w[2] = {q5_half(qs, qh, j, g, 0), q5_half(qs, qh, j, g, 1)};
    DP_ROWS(w[0], w[1], g)
  }
  for (int r = 0; r < MR; r++)
    if (r < mr) out[r] = (vi){a[r], b[r]};
}
#undef DP_ROWS
#define BG_DIRECT 1
#elif BG_ISA == 1
/* An empty asm that takes and gives back the accumulators: the sums stay one chain each, in
 * registers. Without it GCC reassociates the integer adds of a unit into a tree over all its
 * products, which holds 2 x 8 vectors a row live at once: with 16 ymm registers the products
 * went to the stack and back (the AVX2 build's Q4_1 at 2 threads ran at a third of its ceiling).
 * The integers are exact, so the bits are the same either way. */
#define KEEP_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))
/* Q8_0 by the sign trick: |w| (unsigned) times q carrying w's sign, so a pair is at most
 * 2 * 128 * 127 = 32,512 (vpmaddubsw never saturates) and is widened at once. This sums w q
 * from 0, which is the other builds' -(sx << 7) + sum (w + 128) q: the same integer, so z is
 * not read. (Splitting u = w + 128 into nibbles took two vpmaddubsw, two vpmaddwd and an add a
 * row where this takes a vpsignb, a vpmaddubsw and a vpmaddwd.) */
static inline __attribute__((always_inline)) void unit_dot_q8_sign(const int mr, const uint8_t *src, const int8_t *q,
                                                                   int64_t ldq, vi *out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; r++) out[r] = (vi){_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int g = 0; g < 8; g++) {
    for (int h = 0; h < 2; h++) {
      const __m256i w = _mm256_loadu_si256((const __m256i *)(src + 64 * g + 32 * h)), aw = _mm256_abs_epi8(w);
      for (int r = 0; r < MR; r++) {
        if (r < mr) {
          int32_t xv;
          memcpy(&xv, q + r * ldq + 4 * g, 4);
          const __m256i xb = _mm256_set1_epi32(xv);
          const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w)), ones);
          if (h == 0)
            out[r].a = _mm256_add_epi32(out[r].a, t);
          else
            out[r].b = _mm256_add_epi32(out[r].b, t);
          KEEP_IN_REGISTERS(out[r].a, out[r].b);
        }
      }
    }
  }
}
static inline __attribute__((always_inline)) void unit_dot_direct(const int mr, const uint8_t *src, const int kind,
                                                                  const int8_t *q, int64_t ldq, const int32_t *z,
                                                                  int64_t ldz, vi *out) {
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
  if (kind == K_Q8) {
    unit_dot_q8_sign(mr, src, q, ldq, out);
    return;
  }
  for (int r = 0; r < MR; r++) out[r] = (vi){_mm256_set1_epi32(Z_OF(r)), _mm256_set1_epi32(Z_OF(r))};
  /* 4-bit: the 8 groups' pairs summed in int16 (at most 8 * 3810), widened once */
  __m256i p0[MR], p1[MR];
  for (int r = 0; r < MR; r++) p0[r] = p1[r] = _mm256_setzero_si256();
  for (int i = 0; i < (kind == K_Q4_32 ? 4 : 8); i++) {
    __m256i c0 = _mm256_loadu_si256((const __m256i *)(src + 64 * i));
    __m256i c1 = _mm256_loadu_si256((const __m256i *)(src + 64 * i + 32));
    for (int s = 0; s < (kind == K_Q4_32 ? 2 : 1); s++) {
      int hi = kind == K_Q4K_HI || s == 1, g = kind == K_Q4_32 ? i + 4 * s : i;
      __m256i w0 = hi ? _mm256_and_si256(_mm256_srli_epi16(c0, 4), m4) : _mm256_and_si256(c0, m4);
      __m256i w1 = hi ? _mm256_and_si256(_mm256_srli_epi16(c1, 4), m4) : _mm256_and_si256(c1, m4);
      for (int r = 0; r < MR; r++) {
        if (r < mr) {
          int32_t xv;
          memcpy(&xv, q + r * ldq + 4 * g, 4);
          __m256i xb = _mm256_set1_epi32(xv);
          p0[r] = _mm256_add_epi16(p0[r], _mm256_maddubs_epi16(w0, xb));
          p1[r] = _mm256_add_epi16(p1[r], _mm256_maddubs_epi16(w1, xb));
          KEEP_IN_REGISTERS(p0[r], p1[r]);
        }
      }
    }
  }
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      out[r].a = _mm256_add_epi32(out[r].a, _mm256_madd_epi16(p0[r], ones));
      out[r].b = _mm256_add_epi32(out[r].b, _mm256_madd_epi16(p1[r], ones));
    }
  }
}
/* The AVX2 dot products of one unit from its decoded quants: w[g] (columns 0-7, 8-15) for
 * `groups` groups of 4 k, each group's pairs (vpmaddubsw) summed in int16 `per` groups at a
 * time, then widened (vpmaddwd by 1) and added in int32: per * (2 * 127 * umax) must stay
 * below 32768 (Q6_K: umax 63, per 2; Q5_*: umax 31, per 4). Exact integers either way. */
static inline __attribute__((always_inline)) void dot_pairs_widen(const int mr, const __m256i (*w)[2], const int groups,
                                                                  const int per, const int8_t *q, int64_t ldq,
                                                                  const int32_t *z, int64_t ldz, vi *out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; r++) out[r] = (vi){_mm256_set1_epi32(Z_OF(r)), _mm256_set1_epi32(Z_OF(r))};
  for (int g0 = 0; g0 < groups; g0 += per) {
    __m256i p0[MR], p1[MR];
    for (int r = 0; r < MR; r++) p0[r] = p1[r] = _mm256_setzero_si256();
    for (int g = g0; g < g0 + per; g++) {
      for (int r = 0; r < MR; r++) {
        if (r < mr) {
          int32_t xv;
          memcpy(&xv, q + r * ldq + 4 * g, 4);
          __m256i xb = _mm256_set1_epi32(xv);
          p0[r] = _mm256_add_epi16(p0[r], _mm256_maddubs_epi16(w[g][0], xb));
          p1[r] = _mm256_add_epi16(p1[r], _mm256_maddubs_epi16(w[g][1], xb));
          KEEP_IN_REGISTERS(p0[r], p1[r]);
        }
      }
    }
    for (int r = 0; r < MR; r++) {
      if (r < mr) {
        out[r].a = _mm256_add_epi32(out[r].a, _mm256_madd_epi16(p0[r], ones));
        out[r].b = _mm256_add_epi32(out[r].b, _mm256_madd_epi16(p1[r], ones));
      }
    }
  }
}
/* Q6_K (see the AVX-512 version); u <= 63. */
static inline __attribute__((always_inline)) void unit_dot_q6(const int mr, const uint8_t *ql, const uint8_t *qh,
                                                              const int s, const int sh, const int8_t *q,
                                                              int64_t ldq, const int32_t *z, int64_t ldz, vi *out) {
  __m256i w[4][2];
  for (int g = 0; g < 4; g++) w[g][0] = q6_half(ql, qh, g, 0, s, sh), w[g][1] = q6_half(ql, qh, g, 1, s, sh);
  dot_pairs_widen(mr, (const __m256i(*)[2])w, 4, 2, q, ldq, z, ldz, out);
}
/* Q5_0 and Q5_K (see q5_half): u <= 31. */
static inline __attribute__((always_inline)) void unit_dot_q5(const int mr, const uint8_t *qs, const uint8_t *qh,
                                                              const int j, const int8_t *q, int64_t ldq,
                                                              const int32_t *z, int64_t ldz, vi *out) {
  __m256i w[8][2];
  for (int g = 0; g < 8; g++) w[g][0] = q5_half(qs, qh, j, g, 0), w[g][1] = q5_half(qs, qh, j, g, 1);
  dot_pairs_widen(mr, (const __m256i(*)[2])w, 8, 4, q, ldq, z, ldz, out);
}
#define BG_DIRECT 1
#else
#define BG_DIRECT 0
#endif
#undef Z_OF

#endif /* BATCHGEN_CPU_QUANT_DOTS_H */
