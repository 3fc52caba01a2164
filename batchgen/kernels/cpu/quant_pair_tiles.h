/* batchgen quant.c: the AVX-512 build's loops over two panels at once (pair_<name>, over the
 * steps of quant_pairs.h) for the rows of FORMATS_LIST with pair = 1, and PAIR_OF, the table's
 * pointer to them (NULL in the other builds); included by quant.c after FORMATS_LIST. */
/* The AVX-512 build's pairs of panels (quant_pairs.h): pair_<name>, the tiles of rows_<name> over
 * panels src0 and src1 at once, PAIR_MR rows a tile (then the rest), each block's scales decoded
 * once per panel for all rows. */
typedef void pair_fn(int64_t rows, const uint8_t *src0, const uint8_t *src1, int64_t nb, const int8_t *q, int64_t ldq,
                     const float *xd, const int32_t *xs, float *out0, float *out1);
#if BG_ISA == 2
/* mr_ rows from r0_ over blocks [b0, b1) of both panels, their acc in registers meanwhile */
#define PAIR_TILE(STEP2, BYTES, mr_, r0_)                                                                     \
  do {                                                                                                        \
    vf a_[PAIR_MR], c_[PAIR_MR];                                                                              \
    for (int r = 0; r < PAIR_MR; r++)                                                                         \
      a_[r] = r < (mr_) ? acc0[(r0_) + r] : vf_zero(), c_[r] = r < (mr_) ? acc1[(r0_) + r] : vf_zero();       \
    for (int64_t b = b0; b < b1; b++) {                                                                       \
      if ((r0_) == 0) prefetch_ahead(src0 + b * NR * (BYTES), NR * (BYTES));                                  \
      if ((r0_) == 0) prefetch_ahead(src1 + b * NR * (BYTES), NR * (BYTES));                                  \
      STEP2((mr_), &P0, &P1, src0 + b * NR * (BYTES), src1 + b * NR * (BYTES), b, b - b0, nb, q + (r0_) * ldq, ldq, \
            xd + rg_at((r0_), 0, nb), xs + rg_at((r0_), 0, ks), a_, c_, RG);                                  \
    }                                                                                                         \
    for (int r = 0; r < (mr_); r++) acc0[(r0_) + r] = a_[r], acc1[(r0_) + r] = c_[r];                         \
  } while (0)
#define PAIR_REST(STEP2, BYTES, n) \
  case n:                          \
    PAIR_TILE(STEP2, BYTES, n, r0); \
    break;
#define PAIR_FNS(ID, name, BK, BYTES, UNITS, ZSH, PAIR, DECODE, SCALES, STEP) \
  PAIR_FNS_##PAIR(name, BK, BYTES, UNITS, SCALES)
#define PAIR_FNS_0(name, BK, BYTES, UNITS, SCALES) /* pair = 0: none */
#define PAIR_FNS_1(name, BK, BYTES, UNITS, SCALES)                                                            \
  static void pair_##name(int64_t rows, const uint8_t *src0, const uint8_t *src1, int64_t nb, const int8_t *q, \
                          int64_t ldq, const float *xd, const int32_t *xs, float *out0, float *out1) {          \
    BLOCK_SCRATCH_OF(BK, UNITS, P0, src0);                                                                    \
    BLOCK_SCRATCH_OF(BK, UNITS, P1, src1);                                                                    \
    const int64_t ks = nb * (BK) / 16; /* the sums' slots a row (xs) */                                       \
    vf acc0[MC], acc1[MC];                                                                                    \
    for (int64_t r = 0; r < rows; r++) acc0[r] = acc1[r] = vf_zero();                                         \
    for (int64_t b0 = 0; b0 < nb; b0 += KC_OF(BK)) {                                                          \
      const int64_t b1 = b0 + KC_OF(BK) < nb ? b0 + KC_OF(BK) : nb;                                           \
      for (int64_t b = b0; b < b1; b++) {                                                                     \
        SCALES(src0 + b * NR * (BYTES), b - b0, &P0);                                                         \
        SCALES(src1 + b * NR * (BYTES), b - b0, &P1);                                                         \
      }                                                                                                       \
      int64_t r0 = 0;                                                                                         \
      for (; r0 + PAIR_MR <= rows; r0 += PAIR_MR) PAIR_TILE(step2_##name, BYTES, PAIR_MR, r0);                \
      switch (rows - r0) {                                                                                    \
        PAIR_REST(step2_##name, BYTES, 1) PAIR_REST(step2_##name, BYTES, 2) PAIR_REST(step2_##name, BYTES, 3) \
        default: break;                                                                                       \
      }                                                                                                       \
    }                                                                                                         \
    for (int64_t r = 0; r < rows; r++) vf_store(out0 + r * NR, acc0[r]), vf_store(out1 + r * NR, acc1[r]);   \
  }
FORMATS_LIST(PAIR_FNS)
#define PAIR_OF(name, PAIR) PAIR_OF_##PAIR(name)
#define PAIR_OF_1(name) pair_##name
#else
#define PAIR_OF(name, PAIR) PAIR_OF_0(name)
#endif
#define PAIR_OF_0(name) NULL
