/* batchgen: quant.c's rows of a packed weight de-quantized to float32, the token embedding's
 * lookups (batchgen/gguf/embedding.py): each row's raw GGUF blocks gathered back from the panels,
 * then dequant_<name> of its format, with the operations of quant_formats.py's de-quantizers
 * (gguf's), one rounding each, in the same order, so the same bits:
 *   Q4_0  d * (q - 8)          Q4_1  d * q + m          Q5_0  d * (q - 16)      Q8_0  q * d
 *   Q4_K, Q5_K  (d * sc_j) * q - (dmin * m_j)           Q6_K  (d * sc_j) * (q - 32)
 * A decode step looks up one row: in torch that was 0.2 ms of gathers and small ops with warm
 * caches and 0.5 ms after the step's weights had streamed through them (1B Q4_K, Zen 4).
 *
 * Included by quant.c only, after quant_vec.h (half_to_float, load_u16) and NR; not built alone.
 */
#ifndef BATCHGEN_CPU_QUANT_LOOKUP_H
#define BATCHGEN_CPU_QUANT_LOOKUP_H

typedef void dequant_fn(const uint8_t *raw, float *restrict y);

static inline float raw_half(const uint8_t *p) { return half_to_float(load_u16(p)); }

/* Q4_0 / Q4_1's 16 bytes of nibbles: value j < 16 the low nibble of byte j, j >= 16 the high
 * nibble of byte j - 16. */
static inline int nibble32(const uint8_t *qs, int j) { return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4; }

static void dequant_q4_0(const uint8_t *raw, float *restrict y) {
  const float d = raw_half(raw);
  for (int j = 0; j < 32; j++) y[j] = d * (float)(nibble32(raw + 2, j) - 8);
}
static void dequant_q4_1(const uint8_t *raw, float *restrict y) {
  const float d = raw_half(raw), m = raw_half(raw + 2);
  for (int j = 0; j < 32; j++) y[j] = d * (float)nibble32(raw + 4, j) + m;
}
static void dequant_q5_0(const uint8_t *raw, float *restrict y) {
  const float d = raw_half(raw);
  const uint32_t qh = (uint32_t)raw[2] | (uint32_t)raw[3] << 8 | (uint32_t)raw[4] << 16 | (uint32_t)raw[5] << 24;
  for (int j = 0; j < 32; j++) y[j] = d * (float)((nibble32(raw + 6, j) | (int)((qh >> j) & 1) << 4) - 16);
}
static void dequant_q8_0(const uint8_t *raw, float *restrict y) {
  const float d = raw_half(raw);
  for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)raw[2 + j] * d;
}
/* The K-quants' 6-bit scale and min of sub-block j from their 12 bytes s. */
static inline void scale_min_k(const uint8_t *s, int j, int *sc, int *mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
    *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  }
}
/* Q4_K and Q5_K: sub-block j's 32 values, the low nibbles of bytes 32 (j / 2) .. for even j,
 * the high ones for odd j; Q5_K's fifth bit of value l is bit j of qh[l]. */
static inline void dequant_k(const uint8_t *raw, const uint8_t *qh, const uint8_t *qs, float *restrict y) {
  const float d = raw_half(raw), dmin = raw_half(raw + 2);
  for (int j = 0; j < 8; j++) {
    int sc, mn;
    scale_min_k(raw + 4, j, &sc, &mn);
    const float ds = d * (float)sc, dm = dmin * (float)mn;
    const uint8_t *q = qs + 32 * (j / 2);
    for (int l = 0; l < 32; l++) {
      int v = j % 2 ? q[l] >> 4 : q[l] & 15;
      if (qh) v |= ((qh[l] >> j) & 1) << 4;
      y[32 * j + l] = ds * (float)v - dm;
    }
  }
}
static void dequant_q4_k(const uint8_t *raw, float *restrict y) { dequant_k(raw, NULL, raw + 16, y); }
static void dequant_q5_k(const uint8_t *raw, float *restrict y) { dequant_k(raw, raw + 16, raw + 48, y); }
/* Q6_K: value 128 h + e of half h: low 4 bits from ql[64 h + e % 64] (low nibble for e < 64),
 * high 2 bits from qh[32 h + e % 32] at bit 2 (e / 32); sub-block (128 h + e) / 16's scale. */
static void dequant_q6_k(const uint8_t *raw, float *restrict y) {
  const uint8_t *ql = raw, *qh = raw + 128;
  const int8_t *scales = (const int8_t *)(raw + 192);
  const float d = raw_half(raw + 208);
  for (int h = 0; h < 2; h++)
    for (int e = 0; e < 128; e++) {
      const int lo = e < 64 ? ql[64 * h + e] & 15 : ql[64 * h + e - 64] >> 4;
      const int hi = (qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
      const int i = 128 * h + e;
      y[i] = (d * (float)scales[i / 16]) * (float)((lo | hi << 4) - 32);
    }
}

#endif
