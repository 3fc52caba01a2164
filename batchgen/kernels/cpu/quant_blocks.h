/* batchgen: quant.c's decoding of a panel's block, per format: the plain C build's decoders
 * of the quants to unsigned bytes (decode_q4_0 ... decode_q6_k; the builds with AVX2 decode in
 * registers instead, in quant_dots.h), the scratch of decoded blocks (struct panel) and each
 * format's scales decoded into it (scales_d, scales_dm, scales_k, scales_q6_k).
 *
 * Included by quant.c only, after quant_vec.h (vf, vi, NR); not built alone.
 */
#ifndef BATCHGEN_CPU_QUANT_BLOCKS_H
#define BATCHGEN_CPU_QUANT_BLOCKS_H

/* ---- the plain C build's scratch: a panel's block decoded to u ------------------------------
 * Each format's quants at `src` (16 * bytes, the panel's block) to unsigned bytes u laid out
 * [group of 4 k][16 columns][4] (the builds with AVX2 decode in registers instead, quant_dots.h). */

/* Q4_0 / Q4_1's 16 bytes of nibbles (4 chunks of 64): chunk i's low nibbles are group i, its
 * high nibbles group i + 4. */
static inline void decode_nibbles32(const uint8_t *qs, uint8_t *restrict u) {
  for (int i = 0; i < 4; i++)
    for (int b = 0; b < 64; b++) {
      u[i * 64 + b] = qs[i * 64 + b] & 15;
      u[(i + 4) * 64 + b] = qs[i * 64 + b] >> 4;
    }
}
static inline void decode_q4_0(const uint8_t *src, uint8_t *restrict u) { decode_nibbles32(src + 16 * 2, u); }
static inline void decode_q4_1(const uint8_t *src, uint8_t *restrict u) { decode_nibbles32(src + 16 * 4, u); }
/* Q5_0: Q4_0's nibbles plus a fifth bit, bit 4g + t of the column's 32-bit qh (lane c) */
static inline void decode_q5_0(const uint8_t *src, uint8_t *restrict u) {
  const uint8_t *qh = src + 16 * 2;
  decode_nibbles32(src + 16 * 6, u);
  for (int g = 0; g < 8; g++)
    for (int b = 0; b < 64; b++) {
      const int bit = 4 * g + b % 4;
      u[g * 64 + b] |= (uint8_t)(((qh[4 * (b / 4) + bit / 8] >> (bit % 8)) & 1) << 4);
    }
}
static inline void decode_q8_0(const uint8_t *src, uint8_t *restrict u) {
  for (int b = 0; b < 8 * 64; b++) u[b] = src[32 + b] ^ 0x80;
}
/* Q4_K: 32 chunks of nibbles; chunk i's low nibbles are group i % 8 of sub-block 2 (i / 8), its
 * high nibbles of sub-block 2 (i / 8) + 1. */
static inline void decode_q4_k(const uint8_t *src, uint8_t *restrict u) {
  const uint8_t *qs = src + 16 * 16;
  for (int i = 0; i < 32; i++) {
    int lo = 16 * (i / 8) + i % 8, hi = lo + 8;
    for (int b = 0; b < 64; b++) {
      u[lo * 64 + b] = qs[i * 64 + b] & 15;
      u[hi * 64 + b] = qs[i * 64 + b] >> 4;
    }
  }
}
/* Q5_K: Q4_K's nibbles (after the 32 bytes of qh) plus a fifth bit: bit j of qh chunk g for
 * group g of sub-block j. */
static inline void decode_q5_k(const uint8_t *src, uint8_t *restrict u) {
  const uint8_t *qh = src + 16 * 16, *qs = src + 16 * 48;
  for (int i = 0; i < 32; i++) {
    int j = 2 * (i / 8), g = i % 8, lo = 8 * j + g, hi = lo + 8;
    for (int b = 0; b < 64; b++) {
      u[lo * 64 + b] = (uint8_t)((qs[i * 64 + b] & 15) | (((qh[g * 64 + b] >> j) & 1) << 4));
      u[hi * 64 + b] = (uint8_t)((qs[i * 64 + b] >> 4) | (((qh[g * 64 + b] >> (j + 1)) & 1) << 4));
    }
  }
}
static inline void decode_q6_k(const uint8_t *src, uint8_t *restrict u) {
  const uint8_t *ql = src, *qh = src + 16 * 128;
  for (int g = 0; g < 64; g++) {
    int h = g / 32, r = (4 * g) % 128;
    const uint8_t *l = ql + (16 * h + (r % 64) / 4) * 64, *hb = qh + (8 * h + (r % 32) / 4) * 64;
    int sl = 4 * (r / 64), sh = 2 * (r / 32);
    for (int b = 0; b < 64; b++) u[g * 64 + b] = (uint8_t)(((l[b] >> sl) & 15) | (((hb[b] >> sh) & 3) << 4));
  }
}

/* A few blocks of a panel decoded (slots pb = 0, 1, ..., the blocks FORMAT_FNS works on at a
 * time): per block the float scales and the K-quants' integer ones, and the plain C build's
 * quants u [bk / 4][64]. */
struct panel {
  const uint8_t *src; /* the packed panel itself (the direct dot products read it) */
  uint8_t *u;         /* decoded, where the dot products read a scratch (plain C) */
  float *dw, *mw;     /* [slot][16]: d, and Q4_1's m or the K-quants' dmin */
  int32_t *sc, *mn;   /* [slot][units][16], [slot][4][16] (the K-quants' mins in pairs: scales_k) */
};

/* ---- each format's scales, decoded per block of the panel (16 columns at once) -------------- */

static inline void scales_d(const uint8_t *blk, int64_t b, struct panel *P) { vf_store(P->dw + b * NR, vf_half(blk)); }
static inline void scales_dm(const uint8_t *blk, int64_t b, struct panel *P) {
  vf_store(P->dw + b * NR, vf_half(blk));
  vf_store(P->mw + b * NR, vf_half(blk + 32));
}
/* Q4_K / Q5_K: d, dmin, and the 6-bit scales and mins: lane c = column c's bytes. The mins go
 * in pairs, sub-blocks 2i and 2i + 1 in the low and high 16 bits of pair i's lane (add_k takes
 * them with vi_dot16 against the row's sums, paired the same way by pair_sums). */
static inline void scales_k(const uint8_t *blk, int64_t b, struct panel *P) {
  scales_dm(blk, b, P);
  int32_t *sc = P->sc + b * 8 * NR, *mn = P->mn + b * 4 * NR;
  const vi six = vi_set1(63), four = vi_set1(15), top = vi_set1(3);
  const vi d = vi_load((const int32_t *)(const void *)(blk + 64)), m = vi_load((const int32_t *)(const void *)(blk + 128));
  const vi md = vi_load((const int32_t *)(const void *)(blk + 192));
  vi mins[8];
  for (int j = 0; j < 4; j++) {
    vi dj = vi_srl(d, 8 * j), mj = vi_srl(m, 8 * j), mdj = vi_srl(md, 8 * j);
    vi_store(sc + j * NR, vi_and(dj, six));
    mins[j] = vi_and(mj, six);
    vi_store(sc + (j + 4) * NR, vi_or(vi_and(mdj, four), vi_sll(vi_and(vi_srl(dj, 6), top), 4)));
    mins[j + 4] = vi_or(vi_and(vi_srl(mdj, 4), four), vi_sll(vi_and(vi_srl(mj, 6), top), 4));
  }
  for (int i = 0; i < 4; i++) vi_store(mn + i * NR, vi_or(mins[2 * i], vi_sll(mins[2 * i + 1], 16)));
}
/* Q6_K: d last, 16 int8 scales per column, 4 per lane in each of 4 chunks */
static inline void scales_q6_k(const uint8_t *blk, int64_t b, struct panel *P) {
  vf_store(P->dw + b * NR, vf_half(blk + 16 * 208));
  int32_t *sc = P->sc + b * 16 * NR;
  for (int t = 0; t < 4; t++) {
    vi v = vi_load((const int32_t *)(const void *)(blk + 16 * 192 + 64 * t));
    for (int j = 0; j < 4; j++) vi_store(sc + (4 * t + j) * NR, vi_sra(vi_sll(v, 24 - 8 * j), 24));
  }
}

#endif /* BATCHGEN_CPU_QUANT_BLOCKS_H */
