/* batchgen: the quantized linear layer y = x W^T (+ b), W in GGUF blocks (Q4_0, Q4_1, Q5_0,
 * Q8_0, Q4_K, Q5_K, Q6_K: one row each in FORMATS_LIST, below), x in float32; integer dot
 * products on the CPU, threaded on pool.h. A type not in the table is refused (-2).
 *
 * Built and loaded by batchgen/kernels/cpu/quant.py through c_build.py. The same source builds
 * four ways, picked by what the compiler targets: AVX512-VNNI (`vpdpbusd` on 16 output
 * columns), AVX2 with AVX-VNNI (the VEX `vpdpbusd` on two halves of 8: CPUs with AVX-VNNI but
 * no AVX-512), AVX2 (`vpmaddubsw` + `vpmaddwd` on two halves of 8), or plain C. All four
 * compute the same integers exactly and then the same float32 operations in the same order, so
 * they give the same bits (a test builds each and compares).
 *
 * Weight layout ("panels"). quant.py rearranges the file's bytes once, at load, without
 * widening them: output rows (= weight rows, "columns" of y) are taken 16 at a time (a panel,
 * zero rows past N), and within a panel, block by block, each field of the 16 blocks is
 * interleaved unit by unit: unit i of column c sits at field_offset * 16 + (i * 16 + c) * unit.
 * The fields (offset, length, unit) of each raw block are listed in quant_formats.py: the
 * fp16 scales in units of 2 bytes, everything else in units of 4 bytes: 16 columns' 4
 * consecutive bytes form one 64-byte vector (the quants: 4 k of 16 columns, what one vpdpbusd
 * takes; the K-quants' sub-block scales and Q5_0's 32 fifth bits: one 32-bit lane per column,
 * decoded by shifts, Q5_0's bits by a byte shuffle).
 * Where the CPU has AVX2 or AVX-512, the quants are decoded in registers as the dot products
 * read them; the plain C build goes through a decoded copy of each block (in L1).
 *
 * Activations. Each row of x is quantized, per block of BK values (32; 256 for the K-quants):
 *   if the block holds a NaN or an infinity: d = NaN, q = 0 (its outputs become NaN);
 *   else amax = max |x|, d = amax / 127, id = (d != 0 ? 1 / d : 0),
 *        q = round-half-even(x * id), clamped to [-127, 127];
 * and the sums of q over every 16 values are kept (exact integers). All of it is IEEE float32
 * (a division, a reciprocal, a product, one rounding), the same in every build and in torch.
 *
 * Integer dot products. A panel's block is decoded to unsigned bytes u (Q4_*: the nibble
 * 0..15; Q5_*: 0..31; Q8_0: w + 128; Q6_K: 0..63) laid out [group of 4 k][16 columns][4], and
 * dotted with the row's int8 q: exact int32, whatever the instructions. Then, per block b of
 * output (row i, column c), with dx = the row's scale of b and sx its sum of q over b:
 *   Q4_0:  n = dot - 8 sx;                 acc = acc + (d_c * dx) * (float)n
 *   Q5_0:  n = dot - 16 sx;                acc = acc + (d_c * dx) * (float)n
 *   Q8_0:  n = dot - 128 sx;               acc = acc + (d_c * dx) * (float)n
 *   Q4_1:  n = dot;                        acc = acc + ((d_c * dx) * (float)n + m_c * (dx * (float)sx))
 *   Q4_K, Q5_K:  n = sum_j sc_cj dot_j,  nm = sum_j mn_cj sx_j  (j: the 8 sub-blocks of 32)
 *                                          acc = acc + ((d_c * dx) * (float)n - (dmin_c * dx) * (float)nm)
 *   Q6_K:  n = sum_j sc_cj (dot_j - 32 sx_j)  (j: the 16 sub-blocks of 16)
 *                                          acc = acc + (d_c * dx) * (float)n
 * each product and sum rounded to float32 (no fused multiply-add: the expressions are written
 * out, and GCC's ISO C mode does not contract), acc from 0 over b = 0, 1, ... in order, then
 * y = acc + bias. The fp16 scales are converted exactly. So an output depends on its row of x
 * and its weight row alone: the tile, the row block, the thread and the other rows of the call
 * change no bit (batch-invariant).
 *
 * Passes. Each item reads its panel once, block by block (FORMAT_FNS): the bytes 8 KiB ahead
 * prefetched, each block's scales decoded once for every row of the item, then its dot products
 * and the epilogue above for each tile of rows. At most 4 rows (decode at batch 1-4) the
 * accumulators stay in registers (the GEMV path, bound by the memory); more rows take tiles of
 * MR, 256 values of k at a time. Which path a row takes changes none of its bits.
 *
 * Threads. The work is a grid of (block of up to MC rows, panel) items, split by bg_parallel_for
 * into contiguous runs (at batch 1, contiguous runs of panels: each thread streams its own part
 * of the weight); no item splits an output's sum over blocks.
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
/* The AVX2 build where the compiler also targets AVX-VNNI (-mavxvnni; -march=native on a CPU
 * that has it): the 256-bit code takes the VEX-encoded vpdpbusd for vpmaddubsw + vpmaddwd. */
#if BG_ISA == 1 && defined(__AVXVNNI__)
#define BG_AVXVNNI 1
#else
#define BG_AVXVNNI 0
#endif

#define NR 16  /* columns per panel */
#define MC 64  /* rows per item at most */
#define GRAIN_MACS (64 * 1024)

/* 3 = AVX-VNNI (the AVX2 build with vpdpbusd on 256 bits), 2 = AVX512-VNNI, 1 = AVX2, 0 = plain C */
int batchgen_quant_isa(void) { return BG_AVXVNNI ? 3 : BG_ISA; }

int batchgen_quant_cpu_ok(void) {
#if BG_ISA == 2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2");
#elif BG_ISA == 1
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && (!BG_AVXVNNI || __builtin_cpu_supports("avxvnni"));
#else
  return 1;
#endif
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
/* One block of bk values (a multiple of 16). */
static inline void quantize_block(const float *xb, int bk, int8_t *qb, float *d_out) {
#if BG_ISA == 2
  __m512 vmax = _mm512_setzero_ps();
  const __m512 fmax = _mm512_set1_ps(3.40282347e+38f);
  __mmask16 bad = 0;
  for (int t = 0; t < bk; t += 16) {
    __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb + t));
    bad |= _mm512_cmp_ps_mask(a, fmax, _CMP_NLE_UQ); /* NaN or infinity */
    vmax = _mm512_max_ps(vmax, a);
  }
  int finite = bad == 0;
  float amax = _mm512_reduce_max_ps(vmax);
#elif BG_ISA == 1
  __m256 vmax = _mm256_setzero_ps();
  const __m256 fmax = _mm256_set1_ps(3.40282347e+38f), sign = _mm256_set1_ps(-0.0f);
  int bad = 0;
  for (int t = 0; t < bk; t += 8) {
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + t));
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));
    vmax = _mm256_max_ps(vmax, a);
  }
  int finite = bad == 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.0f;
  for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#else
  int finite = 1;
  float amax = 0.0f;
  for (int t = 0; t < bk; t++) {
    float a = fabsf(xb[t]);
    finite &= a <= 3.40282347e+38f; /* false for NaN and infinities */
    amax = a > amax ? a : amax;
  }
#endif
  if (!finite) {
    *d_out = NAN;
    memset(qb, 0, (size_t)bk);
    return;
  }
  float db = amax / 127.0f;
  float id = db != 0.0f ? 1.0f / db : 0.0f;
  *d_out = db;
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

/* Quantize rows [r0, r1) of x ([m, k], row stride ldx) in blocks of bk: q [m][k], d [m][k/bk],
 * s16 [m][k/16] (sums of q over each 16). See the top for the arithmetic. */
static void quantize_rows(const float *x, int64_t ldx, int64_t k, int bk, int64_t r0, int64_t r1,
                          int8_t *q, float *d, int32_t *s16) {
  int64_t nb = k / bk;
  for (int64_t r = r0; r < r1; r++) {
    const float *xr = x + r * ldx;
    int8_t *qr = q + r * k;
    for (int64_t b = 0; b < nb; b++) quantize_block(xr + b * bk, bk, qr + b * bk, d + r * nb + b);
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

/* ---- the plain C build's scratch: a panel's block decoded to u ------------------------------
 * Each format's quants at `src` (16 * bytes, the panel's block) to unsigned bytes u laid out
 * [group of 4 k][16 columns][4] (the builds with AVX2 decode in registers instead, below). */

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
/* ---- 16 lanes of float32 / int32 (one per column of a panel) -------------------------------
 * The epilogue is written once on these; each build implements every op lane by lane with the
 * same IEEE operation (no fused multiply-add), so the builds give the same bits. */
#if BG_ISA == 2
typedef __m512 vf;
typedef __m512i vi;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi a) { _mm512_storeu_si512((void *)p, a); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
#define vi_srl(a, n) _mm512_srli_epi32((a), (n))
#define vi_sll(a, n) _mm512_slli_epi32((a), (n))
#define vi_sra(a, n) _mm512_srai_epi32((a), (n))
/* 16 fp16 values (32 bytes) -> float32, exact */
static inline vf vf_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif BG_ISA == 1
typedef struct { __m256 a, b; } vf;
typedef struct { __m256i a, b; } vi;
static inline vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf vf_add(vf x, vf y) { return (vf){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline vf vf_sub(vf x, vf y) { return (vf){_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline vf vf_mul(vf x, vf y) { return (vf){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline vi vi_load(const int32_t *p) {
  return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))};
}
static inline void vi_store(int32_t *p, vi x) {
  _mm256_storeu_si256((__m256i *)p, x.a);
  _mm256_storeu_si256((__m256i *)(p + 8), x.b);
}
static inline vi vi_zero(void) { return (vi){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi vi_set1(int32_t x) { return (vi){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
static inline vi vi_add(vi x, vi y) { return (vi){_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline vi vi_sub(vi x, vi y) { return (vi){_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
static inline vi vi_mul(vi x, vi y) { return (vi){_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
static inline vf vi_float(vi x) { return (vf){_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline vi vi_and(vi x, vi y) { return (vi){_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
static inline vi vi_or(vi x, vi y) { return (vi){_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
#define vi_srl(x, n) ((vi){_mm256_srli_epi32((x).a, (n)), _mm256_srli_epi32((x).b, (n))})
#define vi_sll(x, n) ((vi){_mm256_slli_epi32((x).a, (n)), _mm256_slli_epi32((x).b, (n))})
#define vi_sra(x, n) ((vi){_mm256_srai_epi32((x).a, (n)), _mm256_srai_epi32((x).b, (n))})
#if defined(__F16C__)
static inline vf vf_half(const uint8_t *p) {
  return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
#else
static inline vf vf_half(const uint8_t *p) {
  float t[NR];
  for (int c = 0; c < NR; c++) t[c] = half_to_float(load_u16(p + 2 * c));
  return vf_load(t);
}
#endif
#else
typedef struct { float v[NR]; } vf;
typedef struct { int32_t v[NR]; } vi;
#define LANES(expr) for (int c = 0; c < NR; c++) r.v[c] = (expr)
static inline vf vf_load(const float *p) { vf r; LANES(p[c]); return r; }
static inline void vf_store(float *p, vf x) { for (int c = 0; c < NR; c++) p[c] = x.v[c]; }
static inline vf vf_zero(void) { vf r; LANES(0.0f); return r; }
static inline vf vf_set1(float x) { vf r; LANES(x); return r; }
static inline vf vf_add(vf x, vf y) { vf r; LANES(x.v[c] + y.v[c]); return r; }
static inline vf vf_sub(vf x, vf y) { vf r; LANES(x.v[c] - y.v[c]); return r; }
static inline vf vf_mul(vf x, vf y) { vf r; LANES(x.v[c] * y.v[c]); return r; }
static inline vi vi_load(const int32_t *p) { vi r; LANES(p[c]); return r; }
static inline void vi_store(int32_t *p, vi x) { for (int c = 0; c < NR; c++) p[c] = x.v[c]; }
static inline vi vi_zero(void) { vi r; LANES(0); return r; }
static inline vi vi_set1(int32_t x) { vi r; LANES(x); return r; }
static inline vi vi_add(vi x, vi y) { vi r; LANES(x.v[c] + y.v[c]); return r; }
static inline vi vi_sub(vi x, vi y) { vi r; LANES(x.v[c] - y.v[c]); return r; }
static inline vi vi_mul(vi x, vi y) { vi r; LANES(x.v[c] * y.v[c]); return r; }
static inline vf vi_float(vi x) { vf r; LANES((float)x.v[c]); return r; }
static inline vi vi_and(vi x, vi y) { vi r; LANES(x.v[c] & y.v[c]); return r; }
static inline vi vi_or(vi x, vi y) { vi r; LANES(x.v[c] | y.v[c]); return r; }
static inline vi vi_srl(vi x, int n) { vi r; LANES((int32_t)((uint32_t)x.v[c] >> n)); return r; }
static inline vi vi_sll(vi x, int n) { vi r; LANES((int32_t)((uint32_t)x.v[c] << n)); return r; }
static inline vi vi_sra(vi x, int n) { vi r; LANES(x.v[c] >> n); return r; }
static inline vf vf_half(const uint8_t *p) { vf r; LANES(half_to_float(load_u16(p + 2 * c))); return r; }
#undef LANES
#endif

/* ---- the integer dot products: up to MR rows x 16 columns over the groups of 4 k of a unit ----
 * MR: rows per tile (what the build's accumulators fit in its registers). */
#if BG_ISA == 2
#define MR 8
#elif BG_AVXVNNI
#define MR 4
#else
#define MR 2
#endif

#if BG_ISA == 0
/* out[r] (16 lanes) = sum_{g, t} u[g][c][t] * q[r][4g + t], exact, over a decoded scratch. */
static inline void unit_dot(const int mr, const uint8_t *u, const int groups, const int8_t *q, int64_t ldq,
                            vi *out) {
  for (int r = 0; r < mr; r++)
    for (int c = 0; c < NR; c++) {
      int32_t s = 0;
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
                                                                  const int8_t *q, int64_t ldq, vi *out) {
  const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
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
static inline __attribute__((always_inline)) void unit_dot_q6(const int mr, const uint8_t *ql, const uint8_t *qh,
                                                              const int s, const int sh, const int8_t *q,
                                                              int64_t ldq, vi *out) {
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int g = 0; g < 4; g++) {
    __m512i l = _mm512_loadu_si512((const void *)(ql + 64 * g));
    __m512i h = _mm512_loadu_si512((const void *)(qh + 64 * g));
    l = _mm512_and_si512(s ? _mm512_srli_epi16(l, 4) : l, m4);
    h = _mm512_and_si512(sh <= 4 ? _mm512_slli_epi16(h, 4 - sh) : _mm512_srli_epi16(h, sh - 4), m30);
    const __m512i w = _mm512_or_si512(l, h);
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
                                                              const int j, const int8_t *q, int64_t ldq, vi *out) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
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
                                                                  const int8_t *q, int64_t ldq, vi *out) {
  const __m256i m4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_setzero_si256();
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
                                                              int64_t ldq, vi *out) {
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_setzero_si256();
  for (int g = 0; g < 4; g++) {
    const __m256i w[2] = {q6_half(ql, qh, g, 0, s, sh), q6_half(ql, qh, g, 1, s, sh)};
    DP_ROWS(w[0], w[1], g)
  }
  for (int r = 0; r < MR; r++)
    if (r < mr) out[r] = (vi){a[r], b[r]};
}
/* Q5_0 and Q5_K (see q5_half): u <= 31. */
static inline __attribute__((always_inline)) void unit_dot_q5(const int mr, const uint8_t *qs, const uint8_t *qh,
                                                              const int j, const int8_t *q, int64_t ldq, vi *out) {
  __m256i a[MR], b[MR];
  for (int r = 0; r < MR; r++) a[r] = b[r] = _mm256_setzero_si256();
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
static inline __attribute__((always_inline)) void unit_dot_direct(const int mr, const uint8_t *src, const int kind,
                                                                  const int8_t *q, int64_t ldq, vi *out) {
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16), m4 = _mm256_set1_epi8(15);
  for (int r = 0; r < MR; r++) out[r] = (vi){_mm256_setzero_si256(), _mm256_setzero_si256()};
  if (kind == K_Q8) { /* u up to 255: split in nibbles (see unit_dot) */
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int g = 0; g < 8; g++) {
      for (int h = 0; h < 2; h++) {
        __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + 64 * g + 32 * h)), flip);
        __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        for (int r = 0; r < MR; r++) {
          if (r < mr) {
            int32_t xv;
            memcpy(&xv, q + r * ldq + 4 * g, 4);
            __m256i xb = _mm256_set1_epi32(xv);
            __m256i t = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), sixteen));
            if (h == 0)
              out[r].a = _mm256_add_epi32(out[r].a, t);
            else
              out[r].b = _mm256_add_epi32(out[r].b, t);
          }
        }
      }
    }
    return;
  }
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
        }
      }
    }
  }
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      out[r].a = _mm256_madd_epi16(p0[r], ones);
      out[r].b = _mm256_madd_epi16(p1[r], ones);
    }
  }
}
/* The AVX2 dot products of one unit from its decoded quants: w[g] (columns 0-7, 8-15) for
 * `groups` groups of 4 k, each group's pairs (vpmaddubsw) summed in int16 `per` groups at a
 * time, then widened (vpmaddwd by 1) and added in int32: per * (2 * 127 * umax) must stay
 * below 32768 (Q6_K: umax 63, per 2; Q5_*: umax 31, per 4). Exact integers either way. */
static inline __attribute__((always_inline)) void dot_pairs_widen(const int mr, const __m256i (*w)[2], const int groups,
                                                                  const int per, const int8_t *q, int64_t ldq,
                                                                  vi *out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; r++) out[r] = (vi){_mm256_setzero_si256(), _mm256_setzero_si256()};
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
                                                              int64_t ldq, vi *out) {
  __m256i w[4][2];
  for (int g = 0; g < 4; g++) w[g][0] = q6_half(ql, qh, g, 0, s, sh), w[g][1] = q6_half(ql, qh, g, 1, s, sh);
  dot_pairs_widen(mr, (const __m256i(*)[2])w, 4, 2, q, ldq, out);
}
/* Q5_0 and Q5_K (see q5_half): u <= 31. */
static inline __attribute__((always_inline)) void unit_dot_q5(const int mr, const uint8_t *qs, const uint8_t *qh,
                                                              const int j, const int8_t *q, int64_t ldq, vi *out) {
  __m256i w[8][2];
  for (int g = 0; g < 8; g++) w[g][0] = q5_half(qs, qh, j, g, 0), w[g][1] = q5_half(qs, qh, j, g, 1);
  dot_pairs_widen(mr, (const __m256i(*)[2])w, 8, 4, q, ldq, out);
}
#define BG_DIRECT 1
#else
#define BG_DIRECT 0
#endif

/* ---- the layer ----------------------------------------------------------------------------- */

/* A few blocks of a panel decoded (slots pb = 0, 1, ..., the blocks FORMAT_FNS works on at a
 * time): per block the float scales and the K-quants' integer ones, and the plain C build's
 * quants u [bk / 4][64]. */
struct panel {
  const uint8_t *src; /* the packed panel itself (the direct dot products read it) */
  uint8_t *u;         /* decoded, where the dot products read a scratch (plain C) */
  float *dw, *mw;     /* [slot][16]: d, and Q4_1's m or the K-quants' dmin */
  int32_t *sc, *mn;   /* [slot][units][16], [slot][8][16] */
};

/* ---- each format's scales, decoded per block of the panel (16 columns at once) -------------- */

static inline void scales_d(const uint8_t *blk, int64_t b, struct panel *P) { vf_store(P->dw + b * NR, vf_half(blk)); }
static inline void scales_dm(const uint8_t *blk, int64_t b, struct panel *P) {
  vf_store(P->dw + b * NR, vf_half(blk));
  vf_store(P->mw + b * NR, vf_half(blk + 32));
}
/* Q4_K / Q5_K: d, dmin, and the 6-bit scales and mins: lane c = column c's bytes */
static inline void scales_k(const uint8_t *blk, int64_t b, struct panel *P) {
  scales_dm(blk, b, P);
  int32_t *sc = P->sc + b * 8 * NR, *mn = P->mn + b * 8 * NR;
  const vi six = vi_set1(63), four = vi_set1(15), top = vi_set1(3);
  const vi d = vi_load((const int32_t *)(const void *)(blk + 64)), m = vi_load((const int32_t *)(const void *)(blk + 128));
  const vi md = vi_load((const int32_t *)(const void *)(blk + 192));
  for (int j = 0; j < 4; j++) {
    vi dj = vi_srl(d, 8 * j), mj = vi_srl(m, 8 * j), mdj = vi_srl(md, 8 * j);
    vi_store(sc + j * NR, vi_and(dj, six));
    vi_store(mn + j * NR, vi_and(mj, six));
    vi_store(sc + (j + 4) * NR, vi_or(vi_and(mdj, four), vi_sll(vi_and(vi_srl(dj, 6), top), 4)));
    vi_store(mn + (j + 4) * NR, vi_or(vi_and(vi_srl(mdj, 4), four), vi_sll(vi_and(vi_srl(mj, 6), top), 4)));
  }
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

/* ---- each format's block: its dot products and their float32 combination (the top) ---------
 * mr rows (q, xd, xs at the tile's first row) against block b of the panel (its packed bytes at
 * blk), added to acc. */
#define AI __attribute__((always_inline))
#define STEP_ARGS                                                                                    \
  const int mr, const struct panel *P, const uint8_t *blk, const int64_t b, const int64_t pb, const int64_t nb, const int8_t *q, \
      const int64_t k, const float *xd, const int32_t *xs, vf *acc

/* Q4_0, Q5_0, Q8_0: n = dot - off sx (off = 1 << sh; sx in slot 2b, see pair_sums); acc += (d_c dx) n */
static inline AI void add_offset(const vi *d, const int sh, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR);
  (void)q, (void)blk;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const float dx = xd[r * nb + b];
      const vi o = vi_sll(vi_set1(xs[r * (k / 16) + 2 * b]), sh);
      acc[r] = vf_add(acc[r], vf_mul(vf_mul(dw, vf_set1(dx)), vi_float(vi_sub(d[r], o))));
    }
  }
}
/* a block's (or a unit's) dot products: the build's direct kernel, or the plain C build's scratch */
#if BG_DIRECT
#define DOT32(direct) direct
#define DOT_UNIT(direct, groups) direct
#else
#define DOT32(direct) unit_dot(mr, P->u + pb * 32 * NR, 8, q + b * 32, k, d)
#define DOT_UNIT(direct, groups) \
  unit_dot(mr, P->u + pb * 256 * NR + 64 * (groups) * j, (groups), q + b * 256 + 4 * (groups) * j, k, d)
#endif
static inline AI void step_q4_0(STEP_ARGS) {
  vi d[MR];
  DOT32(unit_dot_direct(mr, blk + 16 * 2, K_Q4_32, q + b * 32, k, d));
  add_offset(d, 3, mr, P, blk, b, pb, nb, q, k, xd, xs, acc);
}
static inline AI void step_q5_0(STEP_ARGS) {
  vi d[MR];
  DOT32(unit_dot_q5(mr, blk + 16 * 6, blk + 16 * 2, -1, q + b * 32, k, d));
  add_offset(d, 4, mr, P, blk, b, pb, nb, q, k, xd, xs, acc);
}
static inline AI void step_q8_0(STEP_ARGS) {
  vi d[MR];
  DOT32(unit_dot_direct(mr, blk + 32, K_Q8, q + b * 32, k, d));
  add_offset(d, 7, mr, P, blk, b, pb, nb, q, k, xd, xs, acc);
}
/* Q4_1: acc += (d_c dx) dot + m_c (dx sx) (dx sx: the float in slot 2b + 1, see pair_sums) */
static inline AI void step_q4_1(STEP_ARGS) {
  vi d[MR];
  (void)blk;
  DOT32(unit_dot_direct(mr, blk + 16 * 4, K_Q4_32, q + b * 32, k, d));
  const vf dw = vf_load(P->dw + pb * NR), mw = vf_load(P->mw + pb * NR);
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const float dx = xd[r * nb + b];
      float sxd;
      memcpy(&sxd, xs + r * (k / 16) + 2 * b + 1, sizeof sxd);
      vf t1 = vf_mul(vf_mul(dw, vf_set1(dx)), vi_float(d[r]));
      vf t2 = vf_mul(mw, vf_set1(sxd));
      acc[r] = vf_add(acc[r], vf_add(t1, t2));
    }
  }
}
/* Q4_K, Q5_K: is = sum_j sc_cj dot_j (given), nm = sum_j mn_cj sx_j;
 * acc += (d_c dx) is - (dmin_c dx) nm */
static inline AI void add_k(const vi *is, STEP_ARGS) {
  const vf dw = vf_load(P->dw + pb * NR), mw = vf_load(P->mw + pb * NR);
  const int32_t *mn = P->mn + pb * 8 * NR;
  (void)q, (void)blk;
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      const int32_t *xr = xs + r * (k / 16) + 16 * b;
      vi im = vi_zero();
      for (int j = 0; j < 8; j++) im = vi_add(im, vi_mul(vi_load(mn + j * NR), vi_set1(xr[2 * j])));
      const vf dx = vf_set1(xd[r * nb + b]);
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
    DOT_UNIT(unit_dot_direct(mr, blk + 16 * 16 + 64 * 8 * (j / 2), j % 2 ? K_Q4K_HI : K_Q4K_LO, q + b * 256 + 32 * j, k, d), 8);
    const vi scj = vi_load(P->sc + (pb * 8 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, d[r]));
  }
  add_k(is, mr, P, blk, b, pb, nb, q, k, xd, xs, acc);
}
static inline AI void step_q5_k(STEP_ARGS) {
  vi d[MR], is[MR];
  for (int r = 0; r < MR; r++) is[r] = vi_zero();
  for (int j = 0; j < 8; j++) {
    DOT_UNIT(unit_dot_q5(mr, blk + 16 * 48 + 64 * 8 * (j / 2), blk + 16 * 16, j, q + b * 256 + 32 * j, k, d), 8);
    const vi scj = vi_load(P->sc + (pb * 8 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, d[r]));
  }
  add_k(is, mr, P, blk, b, pb, nb, q, k, xd, xs, acc);
}
/* Q6_K: n = sum_j sc_cj (dot_j - 32 sx_j) over 16 units of 16; acc += (d_c dx) n */
static inline AI void step_q6_k(STEP_ARGS) {
  vi d[MR], is[MR];
  (void)blk;
  for (int r = 0; r < MR; r++) is[r] = vi_zero();
  for (int j = 0; j < 16; j++) { /* unit j of 16 k: see unit_dot_q6 and decode_q6_k */
    const int h = j / 8;
    (void)h;
    DOT_UNIT(unit_dot_q6(mr, blk + 64 * (16 * h + 4 * (j % 4)), blk + 16 * 128 + 64 * (8 * h + 4 * (j % 2)),
                         (j % 8) / 4, 2 * ((j % 8) / 2), q + b * 256 + 16 * j, k, d), 4);
    const vi scj = vi_load(P->sc + (pb * 16 + j) * NR);
    for (int r = 0; r < MR; r++)
      if (r < mr) is[r] = vi_add(is[r], vi_mul(scj, vi_sub(d[r], vi_sll(vi_set1(xs[r * (k / 16) + 16 * b + j]), 5))));
  }
  const vf dw = vf_load(P->dw + pb * NR);
  for (int r = 0; r < MR; r++) {
    if (r < mr) {
      vf t = vf_mul(vf_mul(dw, vf_set1(xd[r * nb + b])), vi_float(is[r]));
      acc[r] = vf_add(acc[r], t);
    }
  }
}

/* ---- each format's functions, and the table -----------------------------------------------
 * FORMATS_LIST holds one row per block type: its GGML type id (gguf.GGMLQuantizationType), its
 * name, weights and bytes per block, units (sub-blocks whose integer sums are scaled apart: 1,
 * 8 or 16), and its decode, scales and step functions above. FORMAT_FNS makes of a row two
 * functions over one panel (src: its packed bytes) and `rows` rows of x (q, xd, xs at the
 * first), each in ONE pass over the panel, block by block: the block's bytes PREFETCH_AHEAD
 * further on are asked for (the rest of this panel, then the next: panels lie one after the
 * other), its scales decoded once (and in the plain C build its quants) into a one-block
 * scratch that stays in L1, then the step for every row, each output's acc over b = 0, 1, ...
 * in order (so the same bits whatever the rows, the function or the build):
 *   gemv_<name>: at most GEMV_ROWS rows, acc in registers (batch 1-4: bound by the memory);
 *   rows_<name>: at most MC rows, MR a tile (then the rest), acc in an L1 array: each block's
 *     scales decoded once for all rows, its quants once per tile. */
typedef void rows_fn(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t k, const float *xd,
                     const int32_t *xs, float *out);

#define GEMV_ROWS 4
#define PREFETCH_AHEAD 8192
static inline AI void prefetch_ahead(const uint8_t *blk, const int bytes) {
  for (int o = 0; o < bytes; o += 64) __builtin_prefetch(blk + PREFETCH_AHEAD + o, 0, 3);
}

/* The scratch P of a format (BK, UNITS) for KC blocks: their scales, and the plain C build's
 * quants. rows_<name> takes the blocks KC_OF(BK) at a time (256 values), so that the acc of a
 * tile stays in registers over a few blocks of 32. */
#define KC_OF(BK) (256 / (BK))
#define BLOCK_SCRATCH(BK, UNITS)                                                                              \
  struct panel P;                                                                                             \
  uint8_t u_[BG_DIRECT ? 64 : KC_OF(BK) * (BK) * NR] __attribute__((aligned(64)));                            \
  float dw_[KC_OF(BK) * NR] __attribute__((aligned(64))), mw_[KC_OF(BK) * NR] __attribute__((aligned(64)));   \
  int32_t sc_[KC_OF(BK) * (UNITS) * NR] __attribute__((aligned(64))), mn_[8 * NR] __attribute__((aligned(64))); \
  P.src = src, P.u = u_, P.dw = dw_, P.mw = mw_, P.sc = sc_, P.mn = mn_
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
      STEP((mr_), &P, src + b * NR * (BYTES), b, b - b0, nb, q + (r0_) * k, k, xd + (r0_) * nb,               \
           xs + (r0_) * (k / 16), a_);                                                                        \
    }                                                                                                         \
    for (int r = 0; r < (mr_); r++) acc[(r0_) + r] = a_[r];                                                   \
  } while (0)
/* the GEMV path's step: mr_ rows from r0_ against block b (scratch slot 0) */
#define ROWS_STEP(STEP, mr_, r0_) \
  STEP((mr_), &P, blk, b, 0, nb, q + (r0_) * k, k, xd + (r0_) * nb, xs + (r0_) * (k / 16), acc + (r0_))
#define ROWS_REST(STEP, BYTES, n) \
  case n:                         \
    if (n < MR) ROWS_TILE(STEP, BYTES, n, r0); \
    break;

#define FORMAT_FNS(ID, name, BK, BYTES, UNITS, DECODE, SCALES, STEP)                                          \
  static inline AI void gemv_rows_##name(const int rows, const uint8_t *src, int64_t nb, const int8_t *q,     \
                                         int64_t k, const float *xd, const int32_t *xs, float *out) {         \
    BLOCK_SCRATCH(BK, UNITS);                                                                                 \
    vf acc[GEMV_ROWS];                                                                                        \
    for (int r = 0; r < GEMV_ROWS; r++) acc[r] = vf_zero();                                                   \
    for (int64_t b = 0; b < nb; b++) {                                                                        \
      BLOCK_START(BK, BYTES, DECODE, SCALES, 0);                                                              \
      prefetch_ahead(blk, NR * (BYTES));                                                                      \
      for (int r0 = 0; r0 < rows; r0 += MR) ROWS_STEP(STEP, rows - r0 < MR ? rows - r0 : MR, r0);             \
    }                                                                                                         \
    for (int r = 0; r < rows; r++) vf_store(out + r * NR, acc[r]);                                            \
  }                                                                                                           \
  static void gemv_##name(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t k,           \
                          const float *xd, const int32_t *xs, float *out) {                                   \
    switch (rows) {                                                                                           \
      case 1: gemv_rows_##name(1, src, nb, q, k, xd, xs, out); break;                                         \
      case 2: gemv_rows_##name(2, src, nb, q, k, xd, xs, out); break;                                         \
      case 3: gemv_rows_##name(3, src, nb, q, k, xd, xs, out); break;                                         \
      default: gemv_rows_##name(4, src, nb, q, k, xd, xs, out); break;                                        \
    }                                                                                                         \
  }                                                                                                           \
  static void rows_##name(int64_t rows, const uint8_t *src, int64_t nb, const int8_t *q, int64_t k,           \
                          const float *xd, const int32_t *xs, float *out) {                                   \
    BLOCK_SCRATCH(BK, UNITS);                                                                                 \
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
#define FORMATS_LIST(X)                                                   \
  X(2, q4_0, 32, 18, 1, decode_q4_0, scales_d, step_q4_0)                 \
  X(3, q4_1, 32, 20, 1, decode_q4_1, scales_dm, step_q4_1)                \
  X(6, q5_0, 32, 22, 1, decode_q5_0, scales_d, step_q5_0)                 \
  X(8, q8_0, 32, 34, 1, decode_q8_0, scales_d, step_q8_0)                 \
  X(12, q4_k, 256, 144, 8, decode_q4_k, scales_k, step_q4_k)              \
  X(13, q5_k, 256, 176, 8, decode_q5_k, scales_k, step_q5_k)              \
  X(14, q6_k, 256, 210, 16, decode_q6_k, scales_q6_k, step_q6_k)
FORMATS_LIST(FORMAT_FNS)

struct format {
  int qtype, bk, bytes, units; /* the row's numbers */
  rows_fn *gemv;               /* this build's panel against at most GEMV_ROWS rows */
  rows_fn *rows;               /* ... against at most MC rows */
};
#define FORMAT_ROW(ID, name, BK, BYTES, UNITS, ...) {ID, BK, BYTES, UNITS, gemv_##name, rows_##name},
static const struct format FORMATS[] = {FORMATS_LIST(FORMAT_ROW)};

/* The row of `qtype`, or NULL: an unknown type is refused, never read as another. */
static const struct format *format_of(int qtype) {
  for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
    if (FORMATS[i].qtype == qtype) return &FORMATS[i];
  return NULL;
}

/* ---- the threads ----------------------------------------------------------------------------- */

struct job {
  const struct format *f;
  int64_t m, k, n, nb, npanels, nrb;
  const int8_t *q;   /* [m][k] */
  const float *xd;   /* [m][k / bk] */
  const int32_t *xs; /* [m][k / 16] */
  const uint8_t *packed;
  const float *bias;
  float *y;
  int64_t ldy;
};

/* rows [r0, r0 + rows) of panel p's outputs (out [rows][NR]) to y, plus the bias */
static void store_out(const struct job *J, int64_t p, int64_t r0, int64_t rows, const float *out) {
  int64_t width = J->n - p * NR < NR ? J->n - p * NR : NR;
  for (int64_t r = 0; r < rows; r++) {
    float *yr = J->y + (r0 + r) * J->ldy + p * NR;
    const float *o = out + r * NR;
    for (int64_t c = 0; c < width; c++) yr[c] = J->bias ? o[c] + J->bias[p * NR + c] : o[c];
  }
}

/* Items (row block of up to MC rows, panel), a panel's row blocks one after the other. */
static void run_items(void *ctx, int64_t begin, int64_t end) {
  const struct job *J = (const struct job *)ctx;
  const int64_t k = J->k, nb = J->nb;
  float out[MC * NR] __attribute__((aligned(64)));
  for (int64_t item = begin; item < end; item++) {
    int64_t p = item / J->nrb, rb = item % J->nrb;
    int64_t r0 = rb * MC, rows = J->m - r0 < MC ? J->m - r0 : MC;
    J->f->rows(rows, J->packed + p * nb * NR * J->f->bytes, nb, J->q + r0 * k, k, J->xd + r0 * nb,
               J->xs + r0 * (k / 16), out);
    store_out(J, p, r0, rows, out);
  }
}

/* m <= GEMV_ROWS: every row at once, panel after panel, in one pass (no scratch). */
static void run_gemv(void *ctx, int64_t begin, int64_t end) {
  const struct job *J = (const struct job *)ctx;
  const int64_t nb = J->nb;
  float out[GEMV_ROWS * NR] __attribute__((aligned(64)));
  for (int64_t p = begin; p < end; p++) {
    J->f->gemv(J->m, J->packed + p * nb * NR * J->f->bytes, nb, J->q, J->k, J->xd, J->xs, out);
    store_out(J, p, 0, J->m, out);
  }
}

struct qjob {
  const float *x;
  int64_t ldx, k;
  int bk, units;
  int8_t *q;
  float *d;
  int32_t *s;
};

/* What the steps read of the sums, computed once per row instead of in every panel's inner loop
 * (batchgen_quant_rows returns the sums as they are): where a format scales sub-blocks of 32
 * (units 1 and 8), slot 2j of a row's s16 holds the sum over the 32 values j, s16[2j] +
 * s16[2j + 1]; with blocks of 32 (units 1), slot 2j + 1 then holds the float bits of d_j *
 * (float)sum_j (Q4_1's dx sx). The same integers and the same float product as before. */
static void pair_sums(int64_t k, int bk, int units, int64_t r0, int64_t r1, const float *d, int32_t *s16) {
  if (units == 16) return;
  for (int64_t r = r0; r < r1; r++) {
    int32_t *sr = s16 + r * (k / 16);
    for (int64_t j = 0; j < k / 32; j++) {
      const int32_t sx = sr[2 * j] + sr[2 * j + 1];
      sr[2 * j] = sx;
      if (bk == 32) {
        const float sxd = d[r * (k / 32) + j] * (float)sx;
        memcpy(sr + 2 * j + 1, &sxd, sizeof sxd);
      }
    }
  }
}

static void run_quantize(void *ctx, int64_t begin, int64_t end) {
  const struct qjob *Q = (const struct qjob *)ctx;
  quantize_rows(Q->x, Q->ldx, Q->k, Q->bk, begin, end, Q->q, Q->d, Q->s);
  pair_sums(Q->k, Q->bk, Q->units, begin, end, Q->d, Q->s);
}

/* y [m][ldy] = x [m][ldx] W^T (+ bias), W [n][k] packed as described at the top (npanels =
 * ceil(n / 16) panels). Returns 0, -1 (no memory), -2 (unknown type), -3 (k not whole blocks). */
int batchgen_quant_linear(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int qtype,
                          int64_t n, const float *bias, float *y, int64_t ldy) {
  const struct format *f = format_of(qtype);
  if (!f) return -2;
  if (k <= 0 || k % f->bk) return -3;
  if (m <= 0 || n <= 0) return 0;
  int64_t nb = k / f->bk;
  int8_t *q = (int8_t *)malloc((size_t)(m * k));
  float *d = (float *)malloc((size_t)(m * nb) * sizeof(float));
  int32_t *s = (int32_t *)malloc((size_t)(m * (k / 16)) * sizeof(int32_t));
  if (!q || !d || !s) {
    free(q);
    free(d);
    free(s);
    return -1;
  }
  struct qjob qj = {x, ldx, k, f->bk, f->units, q, d, s};
  int64_t qgrain = (64 * 1024) / k + 1;
  bg_parallel_for(m, qgrain, run_quantize, &qj);

  struct job J = {f, m, k, n, nb, (n + NR - 1) / NR, (m + MC - 1) / MC, q, d, s, packed, bias, y, ldy};
  int64_t items = J.npanels * J.nrb;
  int64_t macs_per_item = (m < MC ? m : MC) * NR * k;
  int64_t grain = GRAIN_MACS / (macs_per_item > 0 ? macs_per_item : 1);
  bg_parallel_for(items, grain < 1 ? 1 : grain, m <= GEMV_ROWS ? run_gemv : run_items, &J);
  free(q);
  free(d);
  free(s);
  return 0;
}
