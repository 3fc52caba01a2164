/* batchgen quant.c: FORMAT_FNS, a format's loops over one panel (gemv_<name>, rows_<name>),
 * included by quant.c after the steps (quant_steps.h); quant.c describes the layout, the table
 * (FORMATS_LIST) and the order of the sums. */
typedef void rows_fn(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t ldq, const float *xd,
                     const int32_t *xs, float *out);

#define GEMV_ROWS 4
#define PREFETCH_AHEAD 8192
/* The weights' lines PREFETCH_AHEAD on, asked for into L2 (prefetcht1), not L1: a block's 5-36
 * lines asked for into L1 at once held the L1 miss buffers that the loads need, and on the
 * Zen 4 the K-quants streamed from memory at 6-10 GB/s a thread at 4-8 rows where the same
 * panels from L3 ran at 10-20 (2 threads, quant_gemv against prefetcht0: Q4_K 1.4x at 1 row,
 * 1.6x at 8, 1.3x at 32; Q6_K 1.9x at 1 row; Q8_0 1.4x at 8 rows; Q4_1 and 300 rows the same).
 * The GEMV path asks for half a block's lines before its step and the rest after it: one burst
 * before the step delayed the step's own loads (Zen 4, 2 threads, against the burst: Q6_K 1.25x
 * at 1 row and 1.08x at 4, Q5_K 1.07-1.09x, Q4_K 1.02-1.07x, Q8_0 1.02-1.04x, Q4_1 0.97-0.99x;
 * the whole burst after the step: Q6_K 1.18x but Q4_K 0.89-0.97x) */
static inline AI void prefetch_ahead(const uint8_t *blk, const int bytes) {
  for (int o = 0; o < bytes; o += 64) __builtin_prefetch(blk + PREFETCH_AHEAD + o, 0, 2);
}

/* The scratch P of a format (BK, UNITS) for KC blocks: their scales, and the plain C build's
 * quants. rows_<name> takes the blocks KC_OF(BK) at a time (256 values), so that the acc of a
 * tile stays in registers over a few blocks of 32. */
#define KC_OF(BK) (256 / (BK))
#define BLOCK_SCRATCH_OF(BK, UNITS, P, SRC)                                                                   \
  struct panel P;                                                                                             \
  uint8_t P##u_[BG_DIRECT ? 64 : KC_OF(BK) * (BK) * NR] __attribute__((aligned(64)));                         \
  float P##dw_[KC_OF(BK) * NR] __attribute__((aligned(64))), P##mw_[KC_OF(BK) * NR] __attribute__((aligned(64))); \
  int32_t P##sc_[KC_OF(BK) * (UNITS) * NR] __attribute__((aligned(64)));                                      \
  int32_t P##mn_[4 * NR] __attribute__((aligned(64)));                                                        \
  P.src = (SRC), P.u = P##u_, P.dw = P##dw_, P.mw = P##mw_, P.sc = P##sc_, P.mn = P##mn_
#define BLOCK_SCRATCH(BK, UNITS) BLOCK_SCRATCH_OF(BK, UNITS, P, src)
/* block b (scratch slot pb): its bytes, its scales (and quants) */
#define BLOCK_START(BK, BYTES, DECODE, SCALES, pb)                                                            \
  const uint8_t *blk = src + b * NR * (BYTES);                                                                \
  if (!BG_DIRECT) DECODE(blk, P.u + (pb) * (BK) * NR);                                                        \
  SCALES(blk, (pb), &P)
/* mr_ rows from r0_ over blocks [b0, b1), their acc in registers meanwhile; the first tile asks
 * for the bytes PREFETCH_AHEAD on, a block at a time between its steps (a burst of a chunk's
 * prefetches at once is partly dropped: Q8_0 at 8 rows streamed at a third of its speed) */
#define ROWS_TILE(STEP, BYTES, mr_, r0_)                                                                      \
  do {                                                                                                        \
    vf a_[MR];                                                                                                \
    for (int r = 0; r < MR; r++) a_[r] = r < (mr_) ? acc[(r0_) + r] : vf_zero();                              \
    for (int64_t b = b0; b < b1; b++) {                                                                       \
      if ((r0_) == 0) prefetch_ahead(src + b * NR * (BYTES), NR * (BYTES));                                   \
      STEP((mr_), &P, src + b * NR * (BYTES), b, b - b0, nb, q + (r0_) * ldq, ldq, xd + rg_at((r0_), 0, nb),      \
           xs + rg_at((r0_), 0, ks), a_, RG);                                                             \
    }                                                                                                         \
    for (int r = 0; r < (mr_); r++) acc[(r0_) + r] = a_[r];                                                   \
  } while (0)
/* the GEMV path's step: mr_ rows from r0_ against block b (scratch slot 0) */
#define ROWS_STEP(STEP, mr_, r0_) \
  STEP((mr_), &P, blk, b, 0, nb, q + (r0_) * ldq, ldq, xd + (r0_), xs + (r0_), acc + (r0_), rows) /* groups of `rows` */
#define ROWS_REST(STEP, BYTES, n) \
  case n:                         \
    if (n < MR) ROWS_TILE(STEP, BYTES, n, r0); \
    break;

#define FORMAT_FNS(ID, name, BK, BYTES, UNITS, ZSH, PAIR, DECODE, SCALES, STEP)                                          \
  static inline AI void gemv_rows_##name(const int rows, const uint8_t *src, int64_t nb, const int8_t *q,     \
                                         int64_t ldq, const float *xd, const int32_t *xs, float *out) {         \
    BLOCK_SCRATCH(BK, UNITS);                                                                                 \
    vf acc[GEMV_ROWS];                                                                                        \
    for (int r = 0; r < GEMV_ROWS; r++) acc[r] = vf_zero();                                                   \
    for (int64_t b = 0; b < nb; b++) {                                                                        \
      BLOCK_START(BK, BYTES, DECODE, SCALES, 0);                                                              \
      prefetch_ahead(blk, NR * (BYTES) / 128 * 64);                                                           \
      for (int r0 = 0; r0 < rows; r0 += MR) ROWS_STEP(STEP, rows - r0 < MR ? rows - r0 : MR, r0);             \
      prefetch_ahead(blk + NR * (BYTES) / 128 * 64, NR * (BYTES) - NR * (BYTES) / 128 * 64);                  \
    }                                                                                                         \
    for (int r = 0; r < rows; r++) vf_store(out + r * NR, acc[r]);                                            \
  }                                                                                                           \
  static void gemv_##name(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t ldq,         \
                          const float *xd, const int32_t *xs, float *out) {                                   \
    switch (rows) {                                                                                           \
      case 1: gemv_rows_##name(1, src, nb, q, ldq, xd, xs, out); break;                                         \
      case 2: gemv_rows_##name(2, src, nb, q, ldq, xd, xs, out); break;                                         \
      case 3: gemv_rows_##name(3, src, nb, q, ldq, xd, xs, out); break;                                         \
      default: gemv_rows_##name(4, src, nb, q, ldq, xd, xs, out); break;                                        \
    }                                                                                                         \
  }                                                                                                           \
  static void rows_##name(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t ldq,         \
                          const float *xd, const int32_t *xs, float *out) {                                   \
    BLOCK_SCRATCH(BK, UNITS);                                                                                 \
    const int64_t ks = nb * (BK) / 16; /* the sums' slots a row (xs) */                                       \
    vf acc[MC];                                                                                               \
    for (int64_t r = 0; r < rows; r++) acc[r] = vf_zero();                                                    \
    for (int64_t b0 = 0; b0 < nb; b0 += KC_OF(BK)) {                                                          \
      const int64_t b1 = b0 + KC_OF(BK) < nb ? b0 + KC_OF(BK) : nb;                                           \
      for (int64_t b = b0; b < b1; b++) {                                                                     \
        BLOCK_START(BK, BYTES, DECODE, SCALES, b - b0);                                                       \
      }                                                                                                       \
      int64_t r0 = 0;                                                                                         \
      for (; r0 + MR <= rows; r0 += MR) ROWS_TILE(STEP, BYTES, MR, r0);                                       \
      switch (rows - r0) {                                                                                    \
        ROWS_REST(STEP, BYTES, 1) ROWS_REST(STEP, BYTES, 2) ROWS_REST(STEP, BYTES, 3)                         \
        ROWS_REST(STEP, BYTES, 4) ROWS_REST(STEP, BYTES, 5) ROWS_REST(STEP, BYTES, 6)                         \
        ROWS_REST(STEP, BYTES, 7)                                                                             \
        default: break;                                                                                       \
      }                                                                                                       \
    }                                                                                                         \
    for (int64_t r = 0; r < rows; r++) vf_store(out + r * NR, acc[r]);                                        \
  }
