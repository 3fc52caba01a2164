/* batchgen: quant.c's step of each format: one block of a panel against a tile of rows, its dot
 * products (quant_dots.h) and their float32 combination into acc (the epilogue at the top of
 * quant.c): step_q4_0 ... step_q6_k, the names FORMATS_LIST gives.
 *
 * Included by quant.c only, after quant_blocks.h (struct panel) and quant_dots.h; not built
 * alone.
 */
#ifndef BATCHGEN_CPU_QUANT_STEPS_H
#define BATCHGEN_CPU_QUANT_STEPS_H

/* ---- each format's block: its dot products and their float32 combination (quant.c's top) -
 * mr rows (q, xd, xs at the tile's first row) against block b of the panel (its packed bytes at
 * blk), added to acc. */
#define STEP_ARGS                                                                                    \
  const int mr, const struct panel *P, const uint8_t *blk, const int64_t b, const int64_t pb, const int64_t nb, const int8_t *q, \
      const int64_t ldq, const float *xd, const int32_t *xs, vf *acc, const int G /* xd, xs: rows G apart (grp_at) */

/* Q4_0, Q5_0, Q8_0: n = dot - (sx << zsh), the sums started at slot 2b + 1's -(sx << zsh) (see
 * pair_sums and Z_OF); acc += (d_c dx) n */
static inline AI void add_offset(const vi *n, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR);
  (void)q, (void)blk, (void)xs, (void)nb;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const float dx = xd[G * b + r];
      acc[r] = vf_add(acc[r], vf_mul(vf_mul(dw, vf_set1(dx)), vi_float(n[r])));
    }
  }
}
/* a block's (or a unit's) dot products: the build's direct kernel, or the plain C build's scratch */
#if BG_DIRECT
#define DOT32(direct, z) direct
#define DOT_UNIT(direct, groups, z) direct
#else
#define DOT32(direct, z) unit_dot(mr, P->u + pb * 32 * NR, 8, q + b * 32, ldq, (z), 1, d)
#define DOT_UNIT(direct, groups, z) \
  unit_dot(mr, P->u + pb * 256 * NR + 64 * (groups) * j, (groups), q + b * 256 + 4 * (groups) * j, ldq, (z), 1, d)
#endif
static inline AI void step_q4_0(STEP_ARGS) {
  vi d[MR];
  const int32_t *z = xs + G * (2 * b + 1);
  DOT32(unit_dot_direct(mr, blk + 16 * 2, K_Q4_32, q + b * 32, ldq, z, 1, d), z);
  add_offset(d, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
static inline AI void step_q5_0(STEP_ARGS) {
  vi d[MR];
  const int32_t *z = xs + G * (2 * b + 1);
  DOT32(unit_dot_q5(mr, blk + 16 * 6, blk + 16 * 2, -1, q + b * 32, ldq, z, 1, d), z);
  add_offset(d, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
static inline AI void step_q8_0(STEP_ARGS) {
  vi d[MR];
  const int32_t *z = xs + G * (2 * b + 1);
  DOT32(unit_dot_direct(mr, blk + 32, K_Q8, q + b * 32, ldq, z, 1, d), z);
  add_offset(d, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
/* Q4_1: acc += (d_c dx) dot + m_c (dx sx) (dx sx: the float in slot 2b + 1, see pair_sums) */
static inline AI void add_q4_1(const vi *d, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR), mw = vf_load(P->mw + pb * NR);
  (void)q, (void)blk, (void)nb, (void)ldq;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const float dx = xd[G * b + r];
      float sxd;
      memcpy(&sxd, xs + G * (2 * b + 1) + r, sizeof sxd);
      vf t1 = vf_mul(vf_mul(dw, vf_set1(dx)), vi_float(d[r]));
      vf t2 = vf_mul(mw, vf_set1(sxd));
      acc[r] = vf_add(acc[r], vf_add(t1, t2));
    }
  }
}
static inline AI void step_q4_1(STEP_ARGS) {
  vi d[MR];
  DOT32(unit_dot_direct(mr, blk + 16 * 4, K_Q4_32, q + b * 32, ldq, NULL, 0, d), NULL);
  add_q4_1(d, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
/* Q4_K, Q5_K: is = sum_j sc_cj dot_j (given), nm = sum_j mn_cj sx_j, in 4 pairs of j (one
 * vi_dot16 each: the mins paired by scales_k, the sums by pair_sums; exact integers, so the
 * same as 8 products and sums, in any order); acc += (d_c dx) is - (dmin_c dx) nm. nm in two
 * chains of two vi_dot16: one chain of four cost Q4_K 6-11 % at 8-300 rows on the Zen 4 (four
 * chains of one, or nm made before the dot products, gained less: 1-5 %) */
static inline AI void add_k(const vi *is, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR), mw = vf_load(P->mw + pb * NR);
  const int32_t *mn = P->mn + pb * 4 * NR;
  (void)q, (void)blk, (void)nb;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const int32_t *xr = xs + G * 16 * b + r;
      vi im0 = vi_dot16(vi_zero(), vi_load(mn), vi_set1(xr[G * 1]));
      vi im1 = vi_dot16(vi_zero(), vi_load(mn + 2 * NR), vi_set1(xr[G * 9]));
      im0 = vi_dot16(im0, vi_load(mn + NR), vi_set1(xr[G * 5]));
      im1 = vi_dot16(im1, vi_load(mn + 3 * NR), vi_set1(xr[G * 13]));
      const vi im = vi_add(im0, im1);
      const vf dx = vf_set1(xd[G * b + r]);
      vf t1 = vf_mul(vf_mul(dw, dx), vi_float(is[r]));
      vf t2 = vf_mul(vf_mul(mw, dx), vi_float(im));
      acc[r] = vf_add(acc[r], vf_sub(t1, t2));
    }
  }
}
static inline AI void step_q4_k(STEP_ARGS) {
  vi d[MR], is[MR];
  for (int r = 0; r < MR; r++) is[r] = vi_zero();
  for (int j = 0; j < 8; j++) {
    DOT_UNIT(unit_dot_direct(mr, blk + 16 * 16 + 64 * 8 * (j / 2), j % 2 ? K_Q4K_HI : K_Q4K_LO, q + b * 256 + 32 * j, ldq, NULL, 0, d), 8, NULL);
    const vi scj = vi_load(P->sc + (pb * 8 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, d[r]));
  }
  add_k(is, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
static inline AI void step_q5_k(STEP_ARGS) {
  vi d[MR], is[MR];
  for (int r = 0; r < MR; r++) is[r] = vi_zero();
  for (int j = 0; j < 8; j++) {
    DOT_UNIT(unit_dot_q5(mr, blk + 16 * 48 + 64 * 8 * (j / 2), blk + 16 * 16, j, q + b * 256 + 32 * j, ldq, NULL, 0, d), 8, NULL);
    const vi scj = vi_load(P->sc + (pb * 8 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, d[r]));
  }
  add_k(is, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}
/* Q6_K: n = sum_j sc_cj (dot_j - 32 sx_j) over 16 units of 16 (each dot started at slot j's
 * -(sx_j << 5), see pair_sums); acc += (d_c dx) n */
static inline AI void add_q6_k(const vi *is, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR);
  (void)q, (void)blk, (void)nb, (void)ldq, (void)xs;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      vf t = vf_mul(vf_mul(dw, vf_set1(xd[G * b + r])), vi_float(is[r]));
      acc[r] = vf_add(acc[r], t);
    }
  }
}
static inline AI void step_q6_k(STEP_ARGS) {
  vi d[MR], is[MR];
  (void)blk;
  for (int r = 0; r < MR; r++) is[r] = vi_zero();
  for (int j = 0; j < 16; j++) { /* unit j of 16 k: see unit_dot_q6 and decode_q6_k */
    const int h = j / 8;
    (void)h;
    DOT_UNIT(unit_dot_q6(mr, blk + 64 * (16 * h + 4 * (j % 4)), blk + 16 * 128 + 64 * (8 * h + 4 * (j % 2)),
                         (j % 8) / 4, 2 * ((j % 8) / 2), q + b * 256 + 16 * j, ldq, xs + G * (16 * b + j), 1, d),
             4, xs + G * (16 * b + j));
    const vi scj = vi_load(P->sc + (pb * 16 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, d[r]));
  }
  add_q6_k(is, mr, P, blk, b, pb, nb, q, ldq, xd, xs, acc, G);
}

#endif /* BATCHGEN_CPU_QUANT_STEPS_H */
