/* batchgen: the quantized linear layer y = x W^T (+ b), W in GGUF blocks (Q4_0, Q4_1, Q8_0,
 * Q4_K, Q6_K), x in float32; integer dot products on the CPU, threaded on pool.h.
 *
 * Built and loaded by batchgen/kernels/cpu/quant.py through loader.py. The same source builds
 * three ways, picked by what the compiler targets: AVX512-VNNI (`vpdpbusd` on 16 output
 * columns), AVX2 (`vpmaddubsw` + `vpmaddwd` on two halves of 8), or plain C. All three compute
 * the same integers exactly and then the same float32 operations in the same order, so they
 * give the same bits (a test builds all three and compares).
 *
 * Weight layout ("panels"). quant.py rearranges the file's bytes once, at load, without
 * widening them: output rows (= weight rows, "columns" of y) are taken 16 at a time (a panel,
 * zero rows past N), and within a panel, block by block, each field of the 16 blocks is
 * interleaved unit by unit: unit i of column c sits at field_offset * 16 + (i * 16 + c) * unit.
 * The fields (offset, length, unit) of each raw block are listed in quant.py (FIELDS): the
 * fp16 scales in units of 2 bytes, the quants in units of 4 bytes (so that 16 columns' 4
 * consecutive bytes form one 64-byte vector), Q4_K's 12 scale bytes and Q6_K's 16 as whole units.
 *
 * Activations. Each row of x is quantized, per block of BK values (32; 256 for the K-quants):
 *   if the block holds a NaN or an infinity: d = NaN, q = 0 (its outputs become NaN);
 *   else amax = max |x|, d = amax / 127, id = (d != 0 ? 1 / d : 0),
 *        q = round-half-even(x * id), clamped to [-127, 127];
 * and the sums of q over every 16 values are kept (exact integers). All of it is IEEE float32
 * (a division, a reciprocal, a product, one rounding), the same in every build and in torch.
 *
 * Integer dot products. A panel's block is decoded to unsigned bytes u (Q4_*: the nibble
 * 0..15; Q8_0: w + 128; Q4_K: 0..15; Q6_K: 0..63) laid out [group of 4 k][16 columns][4], and
 * dotted with the row's int8 q: exact int32, whatever the instructions. Then, per block b of
 * output (row i, column c), with dx = the row's scale of b and sx its sum of q over b:
 *   Q4_0:  n = dot - 8 sx;                 acc = acc + (d_c * dx) * (float)n
 *   Q8_0:  n = dot - 128 sx;               acc = acc + (d_c * dx) * (float)n
 *   Q4_1:  n = dot;                        acc = acc + ((d_c * dx) * (float)n + m_c * (dx * (float)sx))
 *   Q4_K:  n = sum_j sc_cj dot_j,  nm = sum_j mn_cj sx_j  (j: the 8 sub-blocks of 32)
 *                                          acc = acc + ((d_c * dx) * (float)n - (dmin_c * dx) * (float)nm)
 *   Q6_K:  n = sum_j sc_cj (dot_j - 32 sx_j)  (j: the 16 sub-blocks of 16)
 *                                          acc = acc + (d_c * dx) * (float)n
 * each product and sum rounded to float32 (no fused multiply-add: the expressions are written
 * out, and GCC's ISO C mode does not contract), acc from 0 over b = 0, 1, ... in order, then
 * y = acc + bias. The fp16 scales are converted exactly. So an output depends on its row of x
 * and its weight row alone: the tile, the row block, the thread and the other rows of the call
 * change no bit (batch-invariant).
 *
 * Threads. The work is a grid of (block of up to MC rows, panel) items, split by bg_parallel_for
 * into contiguous runs; no item splits an output's sum over blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#pragma STDC FP_CONTRACT OFF

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(BG_QUANT_PLAIN)
#define BG_ISA 2
#include <immintrin.h>
#elif defined(__AVX2__) && !defined(BG_QUANT_PLAIN)
#define BG_ISA 1
#include <immintrin.h>
#else
#define BG_ISA 0
#endif

/* GGML type ids (gguf.GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

#define NR 16  /* columns per panel */
#define MC 64  /* rows per item at most */
#define MR 8   /* rows per register tile */
#define GRAIN_MACS (64 * 1024)

/* 2 = AVX512-VNNI, 1 = AVX2, 0 = plain C */
int batchgen_quant_isa(void) { return BG_ISA; }

int batchgen_quant_cpu_ok(void) {
#if BG_ISA == 2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2");
#elif BG_ISA == 1
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return 1;
#endif
}

/* ---- formats --------------------------------------------------------------------------- */

struct format {
  int bk;        /* weights per block */
  int bytes;     /* bytes per raw block */
  int units;     /* sub-blocks whose integer sums are scaled apart (1, 8 or 16) */
  int groups;    /* groups of 4 k per unit */
};

static int format_of(int qtype, struct format *f) {
  switch (qtype) {
    case T_Q4_0: *f = (struct format){32, 18, 1, 8}; return 0;
    case T_Q4_1: *f = (struct format){32, 20, 1, 8}; return 0;
    case T_Q8_0: *f = (struct format){32, 34, 1, 8}; return 0;
    case T_Q4_K: *f = (struct format){256, 144, 8, 8}; return 0;
    case T_Q6_K: *f = (struct format){256, 210, 16, 4}; return 0;
    default: return -1;
  }
}

/* fp16 bits -> float32, exact (subnormals, infinities and NaN included). */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { /* subnormal: normalise */
    int e = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      e--;
    }
    bits = sign | ((uint32_t)e << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---- activations -------------------------------------------------------------------------- */

/* Quantize rows [r0, r1) of x ([m, k], row stride ldx) in blocks of bk: q [m][k], d [m][k/bk],
 * s16 [m][k/16] (sums of q over each 16). See the top for the arithmetic. */
static void quantize_rows(const float *x, int64_t ldx, int64_t k, int bk, int64_t r0, int64_t r1,
                          int8_t *q, float *d, int32_t *s16) {
  int64_t nb = k / bk;
  for (int64_t r = r0; r < r1; r++) {
    const float *xr = x + r * ldx;
    int8_t *qr = q + r * k;
    for (int64_t b = 0; b < nb; b++) {
      const float *xb = xr + b * bk;
      int8_t *qb = qr + b * bk;
      int finite = 1;
      float amax = 0.0f;
      for (int t = 0; t < bk; t++) {
        float a = fabsf(xb[t]);
        finite &= a <= 3.40282347e+38f; /* false for NaN and infinities */
        amax = a > amax ? a : amax;
      }
      float db, id;
      if (!finite) {
        db = NAN;
        id = 0.0f;
      } else {
        db = amax / 127.0f;
        id = db != 0.0f ? 1.0f / db : 0.0f;
      }
      for (int t = 0; t < bk; t++) {
        float v = nearbyintf(xb[t] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        qb[t] = finite ? (int8_t)v : 0;
      }
      d[r * nb + b] = db;
    }
    int32_t *sr = s16 + r * (k / 16);
    for (int64_t g = 0; g < k / 16; g++) {
      int32_t s = 0;
      for (int t = 0; t < 16; t++) s += qr[g * 16 + t];
      sr[g] = s;
    }
  }
}

/* For the tests: the activation quantization alone. */
void batchgen_quant_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int bk, int8_t *q, float *d,
                         int32_t *s16) {
  quantize_rows(x, ldx, k, bk, 0, m, q, d, s16);
}

/* ---- decoding one panel's block ------------------------------------------------------------ */

/* Per-column scales of one decoded block. */
struct scales {
  float d[NR], m[NR];             /* d, and Q4_1's m or Q4_K's dmin */
  int32_t sc[16][NR], mn[8][NR];  /* K-quants: per sub-block, [j][c] */
};

/* Decode the panel's block at `src` (16 * bytes) to u [groups_total][NR * 4] and scales. */
static void decode_block(int qtype, const uint8_t *src, uint8_t *restrict u, struct scales *s) {
  switch (qtype) {
    case T_Q4_0:
    case T_Q4_1: {
      int qoff = qtype == T_Q4_0 ? 2 : 4;
      for (int c = 0; c < NR; c++) s->d[c] = half_to_float(load_u16(src + 2 * c));
      if (qtype == T_Q4_1)
        for (int c = 0; c < NR; c++) s->m[c] = half_to_float(load_u16(src + 32 + 2 * c));
      const uint8_t *qs = src + 16 * qoff;
      for (int i = 0; i < 4; i++)
        for (int b = 0; b < 64; b++) {
          u[i * 64 + b] = qs[i * 64 + b] & 15;
          u[(i + 4) * 64 + b] = qs[i * 64 + b] >> 4;
        }
      break;
    }
    case T_Q8_0: {
      for (int c = 0; c < NR; c++) s->d[c] = half_to_float(load_u16(src + 2 * c));
      const uint8_t *qs = src + 32;
      for (int b = 0; b < 8 * 64; b++) u[b] = qs[b] ^ 0x80;
      break;
    }
    case T_Q4_K: {
      for (int c = 0; c < NR; c++) {
        s->d[c] = half_to_float(load_u16(src + 2 * c));
        s->m[c] = half_to_float(load_u16(src + 32 + 2 * c));
        const uint8_t *q = src + 64 + 12 * c;
        for (int j = 0; j < 4; j++) {
          s->sc[j][c] = q[j] & 63;
          s->mn[j][c] = q[j + 4] & 63;
          s->sc[j + 4][c] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
          s->mn[j + 4][c] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
        }
      }
      const uint8_t *qs = src + 16 * 16;
      for (int i = 0; i < 32; i++) {
        int lo = 16 * (i / 8) + i % 8, hi = lo + 8;
        for (int b = 0; b < 64; b++) {
          u[lo * 64 + b] = qs[i * 64 + b] & 15;
          u[hi * 64 + b] = qs[i * 64 + b] >> 4;
        }
      }
      break;
    }
    case T_Q6_K: {
      const uint8_t *ql = src, *qh = src + 16 * 128;
      for (int c = 0; c < NR; c++) {
        for (int j = 0; j < 16; j++) s->sc[j][c] = (int8_t)src[16 * 192 + 16 * c + j];
        s->d[c] = half_to_float(load_u16(src + 16 * 208 + 2 * c));
      }
      for (int g = 0; g < 64; g++) {
        int h = g / 32, r = (4 * g) % 128;
        const uint8_t *l = ql + (16 * h + (r % 64) / 4) * 64, *hb = qh + (8 * h + (r % 32) / 4) * 64;
        int sl = 4 * (r / 64), sh = 2 * (r / 32);
        for (int b = 0; b < 64; b++) u[g * 64 + b] = (uint8_t)(((l[b] >> sl) & 15) | (((hb[b] >> sh) & 3) << 4));
      }
      break;
    }
  }
}

/* ---- the integer dot products: rows x 16 columns over `groups` groups of 4 k ----------------- */

/* out[r][c] = sum_{g, t} u[g][c][t] * q[r][4g + t], exact. `big` says how large u gets:
 * 0: u <= 15 (Q4_0, Q4_1, Q4_K), 1: u <= 63 (Q6_K), 2: u <= 255 (Q8_0). */
#if BG_ISA == 2
static inline __attribute__((always_inline)) void dot_tile(const int mr, const uint8_t *u, int groups, const int8_t *q,
                                                           int64_t ldq, int big, int32_t *out) {
  (void)big;
  __m512i acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_si512();
  for (int g = 0; g < groups; g++) {
    __m512i w = _mm512_loadu_si512((const void *)(u + 64 * g));
    for (int r = 0; r < MR; r++) {
      if (r < mr) {
        int32_t xv;
        memcpy(&xv, q + r * ldq + 4 * g, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(xv));
      }
    }
  }
  for (int r = 0; r < MR; r++)
    if (r < mr) _mm512_storeu_si512((void *)(out + NR * r), acc[r]);
}
#elif BG_ISA == 1
/* Without VNNI: vpmaddubsw (u8 x s8 pairs -> int16) then vpmaddwd by 1 (-> int32). A pair is at
 * most 63 * 127 * 2 = 16002 for u <= 63, so int16 cannot saturate; Q4 (u <= 15) pairs of 8 groups
 * are summed in int16 first (at most 8 * 3810 = 30480). Q8_0's u (up to 255) is split in nibbles. */
static inline __attribute__((always_inline)) void dot_tile(const int mr, const uint8_t *u, int groups, const int8_t *q,
                                                           int64_t ldq, int big, int32_t *out) {
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16), low4 = _mm256_set1_epi8(15);
  __m256i acc[2 * (MR / 2)];
  const int rows = MR / 2; /* 8 ymm accumulators: tiles of 4 rows */
  for (int r0 = 0; r0 < mr; r0 += rows) {
    int n = mr - r0 < rows ? mr - r0 : rows;
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_si256();
    if (big == 2) {
      for (int g = 0; g < groups; g++) {
        for (int h = 0; h < 2; h++) {
          __m256i w = _mm256_loadu_si256((const __m256i *)(u + 64 * g + 32 * h));
          __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
          for (int r = 0; r < rows; r++) {
            if (r < n) {
              int32_t xv;
              memcpy(&xv, q + (r0 + r) * ldq + 4 * g, 4);
              __m256i xb = _mm256_set1_epi32(xv);
              __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones);
              __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), sixteen);
              acc[2 * r + h] = _mm256_add_epi32(acc[2 * r + h], _mm256_add_epi32(a, b));
            }
          }
        }
      }
    } else {
      int step = big == 0 && groups % 8 == 0 ? 8 : 2; /* groups summed in int16 (see above) */
      for (int g0 = 0; g0 < groups; g0 += step) {
        for (int h = 0; h < 2; h++) {
          __m256i p[MR / 2];
          for (int r = 0; r < rows; r++) p[r] = _mm256_setzero_si256();
          for (int g = g0; g < g0 + step; g++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(u + 64 * g + 32 * h));
            for (int r = 0; r < rows; r++) {
              if (r < n) {
                int32_t xv;
                memcpy(&xv, q + (r0 + r) * ldq + 4 * g, 4);
                p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(xv)));
              }
            }
          }
          for (int r = 0; r < rows; r++)
            if (r < n) acc[2 * r + h] = _mm256_add_epi32(acc[2 * r + h], _mm256_madd_epi16(p[r], ones));
        }
      }
    }
    for (int r = 0; r < rows; r++) {
      if (r < n) {
        _mm256_storeu_si256((__m256i *)(out + NR * (r0 + r)), acc[2 * r]);
        _mm256_storeu_si256((__m256i *)(out + NR * (r0 + r) + 8), acc[2 * r + 1]);
      }
    }
  }
}
#else
static inline void dot_tile(const int mr, const uint8_t *u, int groups, const int8_t *q, int64_t ldq, int big,
                            int32_t *out) {
  (void)big;
  for (int r = 0; r < mr; r++)
    for (int c = 0; c < NR; c++) {
      int32_t s = 0;
      for (int g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) s += (int32_t)u[64 * g + 4 * c + t] * (int32_t)q[r * ldq + 4 * g + t];
      out[NR * r + c] = s;
    }
}
#endif

/* The rows of one item, in tiles of MR. */
static void dot_rows(int64_t rows, const uint8_t *u, int groups, const int8_t *q, int64_t ldq, int big,
                     int32_t *out) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) dot_tile(MR, u, groups, q + r * ldq, ldq, big, out + NR * r);
  switch (rows - r) {
    case 0: break;
    case 1: dot_tile(1, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    case 2: dot_tile(2, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    case 3: dot_tile(3, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    case 4: dot_tile(4, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    case 5: dot_tile(5, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    case 6: dot_tile(6, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
    default: dot_tile(7, u, groups, q + r * ldq, ldq, big, out + NR * r); break;
  }
}

/* ---- the layer ----------------------------------------------------------------------------- */

struct job {
  int qtype;
  struct format f;
  int64_t m, k, n, nb, npanels, nrb;
  const int8_t *q;   /* [m][k] */
  const float *xd;   /* [m][k / bk] */
  const int32_t *xs; /* [m][k / 16] */
  const uint8_t *packed;
  const float *bias;
  float *y;
  int64_t ldy;
};

static void run_items(void *ctx, int64_t begin, int64_t end) {
  const struct job *J = (const struct job *)ctx;
  const struct format f = J->f;
  const int64_t k = J->k, nb = J->nb, s16n = k / 16;
  const int big = J->qtype == T_Q8_0 ? 2 : J->qtype == T_Q6_K ? 1 : 0;
  uint8_t u[64 * 64] __attribute__((aligned(64)));
  struct scales s;
  float acc[MC][NR];
  int32_t dot[MC][NR], isum[MC][NR], imin[MC][NR];
  for (int64_t item = begin; item < end; item++) {
    int64_t rb = item / J->npanels, p = item % J->npanels;
    int64_t r0 = rb * MC, rows = J->m - r0 < MC ? J->m - r0 : MC;
    const uint8_t *panel = J->packed + p * nb * NR * f.bytes;
    for (int64_t r = 0; r < rows; r++)
      for (int c = 0; c < NR; c++) acc[r][c] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
      decode_block(J->qtype, panel + b * NR * f.bytes, u, &s);
      const int8_t *qb = J->q + r0 * k + b * f.bk;
      const int32_t *xs = J->xs + r0 * s16n + b * (f.bk / 16);
      const float *xd = J->xd + r0 * nb + b;
      if (f.units == 1) {
        dot_rows(rows, u, f.groups, qb, k, big, &dot[0][0]);
        for (int64_t r = 0; r < rows; r++) {
          const float dx = xd[r * nb];
          const int32_t sx = xs[r * s16n] + xs[r * s16n + 1];
          if (J->qtype == T_Q4_1) {
            const float sxd = dx * (float)sx;
            for (int c = 0; c < NR; c++) {
              float t1 = (s.d[c] * dx) * (float)dot[r][c];
              float t2 = s.m[c] * sxd;
              acc[r][c] = acc[r][c] + (t1 + t2);
            }
          } else {
            const int32_t off = (J->qtype == T_Q4_0 ? 8 : 128) * sx;
            for (int c = 0; c < NR; c++) {
              float t = (s.d[c] * dx) * (float)(dot[r][c] - off);
              acc[r][c] = acc[r][c] + t;
            }
          }
        }
      } else {
        for (int64_t r = 0; r < rows; r++)
          for (int c = 0; c < NR; c++) isum[r][c] = imin[r][c] = 0;
        for (int j = 0; j < f.units; j++) {
          dot_rows(rows, u + 64 * f.groups * j, f.groups, qb + 4 * f.groups * j, k, big, &dot[0][0]);
          if (J->qtype == T_Q4_K) {
            for (int64_t r = 0; r < rows; r++) {
              const int32_t sx = xs[r * s16n + 2 * j] + xs[r * s16n + 2 * j + 1];
              for (int c = 0; c < NR; c++) {
                isum[r][c] += s.sc[j][c] * dot[r][c];
                imin[r][c] += s.mn[j][c] * sx;
              }
            }
          } else {
            for (int64_t r = 0; r < rows; r++) {
              const int32_t off = 32 * xs[r * s16n + j];
              for (int c = 0; c < NR; c++) isum[r][c] += s.sc[j][c] * (dot[r][c] - off);
            }
          }
        }
        for (int64_t r = 0; r < rows; r++) {
          const float dx = xd[r * nb];
          if (J->qtype == T_Q4_K) {
            for (int c = 0; c < NR; c++) {
              float t1 = (s.d[c] * dx) * (float)isum[r][c];
              float t2 = (s.m[c] * dx) * (float)imin[r][c];
              acc[r][c] = acc[r][c] + (t1 - t2);
            }
          } else {
            for (int c = 0; c < NR; c++) {
              float t = (s.d[c] * dx) * (float)isum[r][c];
              acc[r][c] = acc[r][c] + t;
            }
          }
        }
      }
    }
    int64_t width = J->n - p * NR < NR ? J->n - p * NR : NR;
    for (int64_t r = 0; r < rows; r++) {
      float *yr = J->y + (r0 + r) * J->ldy + p * NR;
      for (int64_t c = 0; c < width; c++) yr[c] = J->bias ? acc[r][c] + J->bias[p * NR + c] : acc[r][c];
    }
  }
}

struct qjob {
  const float *x;
  int64_t ldx, k;
  int bk;
  int8_t *q;
  float *d;
  int32_t *s;
};

static void run_quantize(void *ctx, int64_t begin, int64_t end) {
  const struct qjob *Q = (const struct qjob *)ctx;
  quantize_rows(Q->x, Q->ldx, Q->k, Q->bk, begin, end, Q->q, Q->d, Q->s);
}

/* y [m][ldy] = x [m][ldx] W^T (+ bias), W [n][k] packed as described at the top (npanels =
 * ceil(n / 16) panels). Returns 0, -1 (no memory), -2 (unknown type), -3 (k not whole blocks). */
int batchgen_quant_linear(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int qtype,
                          int64_t n, const float *bias, float *y, int64_t ldy) {
  struct format f;
  if (format_of(qtype, &f)) return -2;
  if (k <= 0 || k % f.bk) return -3;
  if (m <= 0 || n <= 0) return 0;
  int64_t nb = k / f.bk;
  int8_t *q = (int8_t *)malloc((size_t)(m * k));
  float *d = (float *)malloc((size_t)(m * nb) * sizeof(float));
  int32_t *s = (int32_t *)malloc((size_t)(m * (k / 16)) * sizeof(int32_t));
  if (!q || !d || !s) {
    free(q);
    free(d);
    free(s);
    return -1;
  }
  struct qjob qj = {x, ldx, k, f.bk, q, d, s};
  int64_t qgrain = (64 * 1024) / k + 1;
  bg_parallel_for(m, qgrain, run_quantize, &qj);

  struct job J = {qtype, f, m, k, n, nb, (n + NR - 1) / NR, (m + MC - 1) / MC, q, d, s, packed, bias, y, ldy};
  int64_t items = J.npanels * J.nrb;
  int64_t macs_per_item = (m < MC ? m : MC) * NR * k;
  int64_t grain = GRAIN_MACS / (macs_per_item > 0 ? macs_per_item : 1);
  bg_parallel_for(items, grain < 1 ? 1 : grain, run_items, &J);
  free(q);
  free(d);
  free(s);
  return 0;
}
