/* batchgen: quant.c's tiles over a pair of panels (32 output columns), the AVX-512 VNNI build's
 * alone: the dot products of up to PAIR_MR rows against both panels' block at once
 * (unit_dot2_direct) and the step over the pair of each format whose FORMATS_LIST row says
 * pair = 1 (step2_q4_0, step2_q8_0: the names PAIR_FNS pastes).
 *
 * Why: a tile over one panel needs a broadcast of the row's 4 values for every vpdpbusd, and
 * on Zen 5 those loads bound it (a loop of vpdpbusd with one broadcast each ran at 5.8 a ns,
 * the same loop over two panels sharing each broadcast at 7.8, against about 8 with no loads).
 * Here one broadcast feeds both panels. PAIR_MR is 4, not MR's 8: 2 x 8 rows hold 16 int32 and
 * 16 float32 accumulators, more than the 32 registers with the weights (GCC spilled them, and
 * the tile ran slower than one panel's). Each output's arithmetic is the single panel's, in the
 * same order (the epilogues of quant_steps.h, panel by panel), so the bits are the same.
 *
 * Measured (300 rows x 2048 x 2048, 1 thread, CPU-time medians interleaved with the one-panel
 * tiles, the machine loaded): Q8_0 +4-8 %, Q4_0 +3-6 % (64 to 512 rows). The pair halves
 * the rows sharing each decoded weight vector (8 -> 4), so the formats whose quants take more
 * operations to decode gained nothing or lost: Q4_K -7 to +6 % over several runs (equal on a
 * calmer one), Q6_K -2 to +2 %, Q5_0 and Q4_1 -4 %, Q5_K -22 %; they keep the one-panel tiles
 * (pair = 0), and their two-panel steps were dropped.
 *
 * Included by quant.c only, after quant_steps.h; not built alone.
 */
#ifndef BATCHGEN_CPU_QUANT_PAIRS_H
#define BATCHGEN_CPU_QUANT_PAIRS_H

#if BG_ISA == 2
#define PAIR_MR 4
#define Z_OF(r) (z && (r) < mr ? z[(r) * ldz] : 0) /* as in quant_dots.h */
/* row r, group g: one broadcast (kept a register: GCC would fold a set1 into both dot products'
 * memory operands again) into panel 0's a_r and panel 1's c_r */
#define DPW2(r, g)                                                                                    \
  if (mr > r) {                                                                                       \
    __m512i x_;                                                                                       \
    __asm__("vpbroadcastd %1, %0" : "=v"(x_) : "m"(*(const int32_t *)(const void *)(q + (r) * ldq + 4 * (g)))); \
    a##r = _mm512_dpbusd_epi32(a##r, w0, x_);                                                         \
    c##r = _mm512_dpbusd_epi32(c##r, w1, x_);                                                         \
  }
#define DPW2_ALL(g) DPW2(0, g) DPW2(1, g) DPW2(2, g) DPW2(3, g)
#define PAIR_START                                                                                            \
  __m512i a0 = _mm512_set1_epi32(Z_OF(0)), a1 = _mm512_set1_epi32(Z_OF(1)), a2 = _mm512_set1_epi32(Z_OF(2)), \
          a3 = _mm512_set1_epi32(Z_OF(3));                                                                    \
  __m512i c0 = a0, c1 = a1, c2 = a2, c3 = a3
#define PAIR_END                                  \
  out0[0] = a0, out0[1] = a1, out0[2] = a2, out0[3] = a3; \
  out1[0] = c0, out1[1] = c1, out1[2] = c2, out1[3] = c3
#define PAIR_DOT_ARGS const int8_t *q, int64_t ldq, const int32_t *z, int64_t ldz, vi *out0, vi *out1

/* unit_dot_direct's kinds (quant_dots.h) over panels s0 and s1 */
static inline AI __m512i pair_w(const __m512i c, const int kind, const int hi) {
  const __m512i m4 = _mm512_set1_epi8(15);
  return kind == K_Q8 ? _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80))
         : hi         ? _mm512_and_si512(_mm512_srli_epi16(c, 4), m4)
                      : _mm512_and_si512(c, m4);
}
static inline AI void unit_dot2_direct(const int mr, const uint8_t *s0, const uint8_t *s1, const int kind,
                                       PAIR_DOT_ARGS) {
  PAIR_START;
  for (int i = 0; i < (kind == K_Q4_32 ? 4 : 8); i++) {
    const __m512i x0 = _mm512_loadu_si512((const void *)(s0 + 64 * i));
    const __m512i x1 = _mm512_loadu_si512((const void *)(s1 + 64 * i));
    for (int h = 0; h < (kind == K_Q4_32 ? 2 : 1); h++) { /* Q4_0/Q4_1: low nibbles group i, high i + 4 */
      const int hi = kind == K_Q4K_HI || h == 1, g = i + 4 * h;
      const __m512i w0 = pair_w(x0, kind, hi), w1 = pair_w(x1, kind, hi);
      DPW2_ALL(g)
    }
  }
  PAIR_END;
}
/* ---- each format's step over the pair: quant_steps.h's STEP_ARGS with two panels, their blocks
 * and two tiles of acc; the dot products of both, then each panel's epilogue */
#define STEP2_ARGS                                                                                             \
  const int mr, const struct panel *P0, const struct panel *P1, const uint8_t *blk0, const uint8_t *blk1,     \
      const int64_t b, const int64_t pb, const int64_t nb, const int8_t *q, const int64_t ldq, const float *xd, \
      const int32_t *xs, vf *acc0, vf *acc1, const int G
#define EPI2(EPI, n0, n1)                                       \
  EPI(n0, mr, P0, blk0, b, pb, nb, q, ldq, xd, xs, acc0, G);         \
  EPI(n1, mr, P1, blk1, b, pb, nb, q, ldq, xd, xs, acc1, G)
/* Q4_0, Q8_0: unit_dot2_direct of `kind` at offset `off` of each block, sums from z */
#define STEP2_DIRECT(name, off, kind, z_, EPI)                         \
  static inline AI void step2_##name(STEP2_ARGS) {                     \
    vi d0[MR], d1[MR];                                                 \
    const int32_t *z = (z_);                                           \
    unit_dot2_direct(mr, blk0 + (off), blk1 + (off), kind, q + b * 32, ldq, z, 1, d0, d1); \
    EPI2(EPI, d0, d1);                                                 \
  }
STEP2_DIRECT(q4_0, 16 * 2, K_Q4_32, xs + G * (2 * b + 1), add_offset)
STEP2_DIRECT(q8_0, 32, K_Q8, xs + G * (2 * b + 1), add_offset)
#undef STEP2_DIRECT
#undef PAIR_DOT_ARGS
#undef PAIR_END
#undef PAIR_START
#undef DPW2_ALL
#undef DPW2
#undef Z_OF
#endif

#endif /* BATCHGEN_CPU_QUANT_PAIRS_H */
