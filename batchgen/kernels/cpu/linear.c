/* batchgen: linear layer y = x W^T (+ b) on the CPU, threaded, in float32, bfloat16 and float16.
 *
 * Built and loaded by batchgen/kernels/cpu/c_build.py (with -march=native: the instructions
 * are those of the machine it runs on, and the build cache is keyed on the CPU's flags).
 *
 * Packing. The weight W [N, K] is packed once, at model load, into panels of NR = 16 output
 * columns, zero past N:
 *   float32                    packed[p][k][j]        = W[p*16 + j][k]
 *   bfloat16 with AVX512-BF16  packed[p][k/2][j][k%2] = W[p*16 + j][k]  (pairs of k, zero past K)
 *   bfloat16 / float16 else    packed[p][k][j]        = W[p*16 + j][k]  (16-bit values)
 *
 * Register tiles, over one panel and up to MR rows of x:
 *   float32: 6 x 16, AVX2 FMA; twelve independent chains keep both FMA ports busy.
 *   bfloat16 with AVX512-BF16: up to 12 x 16, one zmm accumulator per row; each `vdpbf16ps`
 *     adds the products of one pair of k (the input rounded to bfloat16, as the model's own
 *     activations are) to 16 float32 sums.
 *   bfloat16 / float16 without it: the input converted to float32 once per call, each weight
 *     converted to float32 as it is loaded (a 16-bit shift for bfloat16, F16C for float16),
 *     then the float32 tile.
 * Sums are float32; bfloat16/float16 outputs are rounded once, to nearest even, after the
 * bias is added.
 *
 * Numerics. Every output element is one accumulation chain over k = 0 .. K-1 (pairs of k for
 * vdpbf16ps), in that order, started from zero, with the bias added last. The tile height, the
 * row block, the thread and the chunk an element falls in change nothing: a row's result never
 * depends on how many other rows are in the call, where it sits among them, or how many
 * threads run. The layer is batch-invariant and bit-identical at any thread count.
 *
 * Threads (pool.h). The work is a grid of (row block, panel) items, row blocks of MC rows
 * sized so that the block of x stays in L2; bg_parallel_for splits it into contiguous runs of
 * items, never the reduction over k. At decode sizes (a few dozen rows, one row block) the
 * threads take disjoint sets of output columns.
 *
 * Prefetch. A model's weights are far larger than the caches, so at decode sizes the first
 * tile over a panel would wait on memory. Instead, while the tiles of one item run, they
 * prefetch the next item's panel into L2, one cache line every `ntiles` k-steps, tile t
 * taking lines t, t + ntiles, ...: the next panel arrives spread over the current one's time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the batchgen CPU linear kernel needs AVX2, FMA and F16C (x86-64, built with -march=native)"
#endif
#include <immintrin.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define BG_NATIVE_BF16 1
#else
#define BG_NATIVE_BF16 0
#endif

#define NR 16
#define MR_BF16 12
#define L2_BYTES_FOR_X (192 * 1024)
#define MAX_MC 240 /* rows per block at most (a multiple of every tile height) */
/* the least work (multiply-adds) one chunk of items should carry, to pay for handing it out */
#define GRAIN_MACS (256 * 1024)

enum { F32 = 0, BF16 = 1, F16 = 2 };

int64_t batchgen_linear_panel_width(void) { return NR; }

/* 1 when bfloat16 runs on AVX512-BF16 dot products, 0 when it converts to float32 (AVX2). */
int batchgen_linear_native_bf16(void) { return BG_NATIVE_BF16; }

/* Whether this CPU runs the instructions the library was built for (a cache built for
 * another machine is refused, never run into an illegal instruction). Plain code: safe to
 * call anywhere. */
int batchgen_linear_cpu_ok(void) {
  __builtin_cpu_init();
  int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#if BG_NATIVE_BF16
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512bf16");
#endif
  return ok;
}

/* Size, in elements of the weight's dtype, of the packed form of an [n, k] weight. */
int64_t batchgen_linear_packed_numel(int64_t n, int64_t k, int dtype) {
  int64_t kk = (dtype == BF16 && BG_NATIVE_BF16) ? (k + 1) / 2 * 2 : k;
  return (n + NR - 1) / NR * NR * kk;
}

/* ---- packing ------------------------------------------------------------------------- */

void batchgen_linear_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
  int64_t num_panels = (n + NR - 1) / NR;
  for (int64_t p = 0; p < num_panels; p++) {
    float *dst = packed + p * k * NR;
    for (int64_t j = 0; j < NR; j++) {
      int64_t row = p * NR + j;
      for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = row < n ? w[row * k + kk] : 0.0f;
    }
  }
}

/* 16-bit weights (bfloat16 or float16 bits); `dtype` picks the layout (see the top). */
void batchgen_linear_pack_16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int dtype) {
  int64_t num_panels = (n + NR - 1) / NR;
  int pairs = dtype == BF16 && BG_NATIVE_BF16;
  int64_t kp = pairs ? (k + 1) / 2 * 2 : k;
  for (int64_t p = 0; p < num_panels; p++) {
    uint16_t *dst = packed + p * kp * NR;
    for (int64_t j = 0; j < NR; j++) {
      int64_t row = p * NR + j;
      for (int64_t kk = 0; kk < kp; kk++) {
        uint16_t v = row < n && kk < k ? w[row * k + kk] : 0;
        if (pairs)
          dst[(kk / 2) * 2 * NR + j * 2 + (kk % 2)] = v;
        else
          dst[kk * NR + j] = v;
      }
    }
  }
}

/* ---- output conversion --------------------------------------------------------------- */

/* float32 -> bfloat16 bits, round to nearest even; NaN -> quiet NaN (torch's rule). */
static inline __m128i f32_to_bf16_8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  /* 8 x 32-bit (each < 2^16) -> 8 x 16-bit */
  __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

static inline void store_16(uint16_t *dst, __m256 lo, __m256 hi, int dtype, int64_t width) {
  __m128i a, b;
  if (dtype == BF16) {
    a = f32_to_bf16_8(lo);
    b = f32_to_bf16_8(hi);
  } else {
    a = _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (width == NR) {
    _mm_storeu_si128((__m128i *)dst, a);
    _mm_storeu_si128((__m128i *)(dst + 8), b);
  } else {
    uint16_t tmp[NR];
    _mm_storeu_si128((__m128i *)tmp, a);
    _mm_storeu_si128((__m128i *)(tmp + 8), b);
    memcpy(dst, tmp, (size_t)width * sizeof(uint16_t));
  }
}

/* ---- the float32 tile (also the 16-bit weights' tile without native bfloat16) --------- */

#if defined(__AVX512F__)
/* AVX-512: up to 12 x 16, one zmm accumulator per row (twelve chains cover the FMA latency of
 * two 512-bit pipes). The packed layout is the AVX2 one: a k-step of a panel is one zmm. */
#define MR32 12

static inline __m512 load_b512(const int wt, const char *src) {
  if (wt == F32) return _mm512_loadu_ps((const float *)src);
  __m256i w16 = _mm256_loadu_si256((const __m256i *)src);
  if (wt == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
  return _mm512_cvtph_ps(w16);
}

#define ROW(r)                                                                              \
  if (mr > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * ldx + kk]), b, c##r);
#define STORE(r)                                                                            \
  if (mr > r) {                                                                             \
    __m512 v = c##r;                                                                        \
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));                                  \
    if (yt == F32)                                                                          \
      _mm512_mask_storeu_ps((float *)y + (r) * ldy, (__mmask16)((1u << width) - 1), v);     \
    else                                                                                    \
      store_16((uint16_t *)y + (r) * ldy, _mm512_castps512_ps256(v),                        \
               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), yt, width); \
  }

static inline __attribute__((always_inline)) void
tile_f32(const int mr, const int wt, const int yt, const float *x, int64_t ldx, const void *panel,
         int64_t k, const float *bias, void *y, int64_t ldy, int64_t width, const char *pf,
         int64_t pf_step) {
  const int64_t esize = wt == F32 ? 4 : 2;
  const char *bp = (const char *)panel;
  int64_t pf_next = 0;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t kk = 0; kk < k; kk++) {
    __m512 b = load_b512(wt, bp + kk * NR * esize);
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
    /* one 64-byte line per prefetch: a float32 k-step is one line, a 16-bit one half */
    if (pf && kk == pf_next) {
      _mm_prefetch(pf + kk * NR * esize, _MM_HINT_T1);
      pf_next += pf_step * (wt == F32 ? 1 : 2);
    }
  }
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
  STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) STORE(11)
}
#undef ROW
#undef STORE

#else
/* AVX2: 6 x 16, two ymm accumulators per row: twelve chains keep both FMA ports busy. */
#define MR32 6
/* 16 weights of one k, as float32, for weight type `wt` (F32: floats; BF16/F16: 16-bit). */
#define LOAD_B(wt, src, b0, b1)                                                             \
  if (wt == F32) {                                                                          \
    b0 = _mm256_loadu_ps((const float *)(src));                                             \
    b1 = _mm256_loadu_ps((const float *)(src) + 8);                                         \
  } else if (wt == BF16) {                                                                  \
    __m256i w16 = _mm256_loadu_si256((const __m256i *)(src));                               \
    b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w16)), 16)); \
    b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w16, 1)), 16)); \
  } else {                                                                                  \
    __m256i w16 = _mm256_loadu_si256((const __m256i *)(src));                               \
    b0 = _mm256_cvtph_ps(_mm256_castsi256_si128(w16));                                      \
    b1 = _mm256_cvtph_ps(_mm256_extracti128_si256(w16, 1));                                 \
  }

#define ROW(r)                                                                              \
  if (mr > r) {                                                                             \
    __m256 av = _mm256_broadcast_ss(x + (r) * ldx + kk);                                    \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                                             \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                                             \
  }
#define STORE(r)                                                                            \
  if (mr > r) {                                                                             \
    __m256 lo = c##r##0, hi = c##r##1;                                                      \
    if (bias) {                                                                             \
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));                                        \
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));                                    \
    }                                                                                       \
    if (yt == F32) {                                                                        \
      float *yr = (float *)y + (r) * ldy;                                                   \
      if (width == NR) {                                                                    \
        _mm256_storeu_ps(yr, lo);                                                           \
        _mm256_storeu_ps(yr + 8, hi);                                                       \
      } else {                                                                              \
        float tmp[NR];                                                                      \
        _mm256_storeu_ps(tmp, lo);                                                          \
        _mm256_storeu_ps(tmp + 8, hi);                                                      \
        memcpy(yr, tmp, (size_t)width * sizeof(float));                                     \
      }                                                                                     \
    } else {                                                                                \
      store_16((uint16_t *)y + (r) * ldy, lo, hi, yt, width);                               \
    }                                                                                       \
  }

/* Rows [0, mr) of a tile; mr <= MR and the weight/output types are compile-time constants once
 * inlined, so the guarded rows fold away. x: float32 rows; panel: `wt` weights; y: `yt`
 * outputs. `pf` (or NULL) is the first line this tile prefetches; then every `pf_step`-th. */
static inline __attribute__((always_inline)) void
tile_f32(const int mr, const int wt, const int yt, const float *x, int64_t ldx, const void *panel,
         int64_t k, const float *bias, void *y, int64_t ldy, int64_t width, const char *pf,
         int64_t pf_step) {
  const int64_t esize = wt == F32 ? 4 : 2;
  const char *bp = (const char *)panel;
  int64_t pf_next = 0;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t kk = 0; kk < k; kk++) {
    __m256 b0, b1;
    LOAD_B(wt, bp + kk * NR * esize, b0, b1)
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    /* one 64-byte line per prefetch: a float32 k-step is one line, a 16-bit one half */
    if (pf && kk == pf_next) {
      _mm_prefetch(pf + kk * NR * esize, _MM_HINT_T1);
      pf_next += pf_step * (wt == F32 ? 1 : 2);
    }
  }
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

#undef ROW
#undef STORE
#endif

#if BG_NATIVE_BF16
/* ---- the bfloat16 tile: AVX512-BF16 ---------------------------------------------------- */

#define ROWB(r)                                                                             \
  if (mr > r) {                                                                             \
    int32_t pair;                                                                           \
    memcpy(&pair, x + (r) * ldx + 2 * kp, sizeof pair);                                     \
    c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(pair), b);                    \
  }
#define ROWB_TAIL(r)                                                                        \
  if (mr > r) {                                                                             \
    int32_t pair = x[(r) * ldx + k - 1]; /* the odd last k, paired with a zero */           \
    c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(pair), b);                    \
  }
#define STOREB(r)                                                                           \
  if (mr > r) {                                                                             \
    __m512 v = c##r;                                                                        \
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));                                  \
    store_16(y + (r) * ldy, _mm512_castps512_ps256(v),                                      \
             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), BF16, width); \
  }

static inline __attribute__((always_inline)) void
tile_bf16(const int mr, const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k,
          const float *bias, uint16_t *y, int64_t ldy, int64_t width, const char *pf,
          int64_t pf_step) {
  int64_t pf_next = 0, pairs = k / 2;
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  for (int64_t kp = 0; kp < pairs; kp++) {
    __m512bh b = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * NR);
    ROWB(0) ROWB(1) ROWB(2) ROWB(3) ROWB(4) ROWB(5)
    ROWB(6) ROWB(7) ROWB(8) ROWB(9) ROWB(10) ROWB(11)
    if (pf && kp == pf_next) { /* a pair of k is one 64-byte line */
      _mm_prefetch(pf + kp * 2 * NR * 2, _MM_HINT_T1);
      pf_next += pf_step;
    }
  }
  if (k % 2) {
    __m512bh b = (__m512bh)_mm512_loadu_si512(panel + pairs * 2 * NR);
    ROWB_TAIL(0) ROWB_TAIL(1) ROWB_TAIL(2) ROWB_TAIL(3) ROWB_TAIL(4) ROWB_TAIL(5)
    ROWB_TAIL(6) ROWB_TAIL(7) ROWB_TAIL(8) ROWB_TAIL(9) ROWB_TAIL(10) ROWB_TAIL(11)
  }
  STOREB(0) STOREB(1) STOREB(2) STOREB(3) STOREB(4) STOREB(5)
  STOREB(6) STOREB(7) STOREB(8) STOREB(9) STOREB(10) STOREB(11)
}
#endif

/* ---- the driver ---------------------------------------------------------------------- */

struct gemm {
  int kind;           /* F32, BF16 or F16: the weight and output type */
  int native;         /* bfloat16 through tile_bf16 */
  const void *x;      /* float32 rows (converted), or bfloat16 rows for tile_bf16 */
  int64_t ldx;
  const char *packed; /* the packed weight */
  int64_t panel_bytes;
  const float *bias;  /* NULL, or padded to whole panels */
  void *y;
  int64_t ldy, m, n, k, mc, num_panels;
};

/* The tile heights of a row block of `rows` rows for tiles of at most `mr`: full tiles, then
 * the rest, a short last tile (1..mr/2 rows) merged with the one before into two near-equal
 * tiles (a short tile runs too few chains to fill the pipes). */
static inline int64_t plan_tiles(int64_t rows, int mr, int heights[]) {
  int64_t full = rows / mr, rest = rows % mr, t = 0;
  if (rest >= 1 && rest <= mr / 2 && full > 0) {
    full -= 1;
    rest += mr;
  }
  for (int64_t f = 0; f < full; f++) heights[t++] = mr;
  if (rest > mr) {
    heights[t++] = (int)(rest - rest / 2);
    heights[t++] = (int)(rest / 2);
  } else if (rest > 0) {
    heights[t++] = (int)rest;
  }
  return t;
}

#define T32(h, wt, yt) case h: tile_f32(h, wt, yt, xr, g->ldx, panel, g->k, b, yr, g->ldy, width, PF, nt); break;
#if MR32 == 12
#define F32_TILE_CASES(wt, yt)                                                              \
  switch (h) {                                                                              \
  T32(12, wt, yt) T32(11, wt, yt) T32(10, wt, yt) T32(9, wt, yt) T32(8, wt, yt) T32(7, wt, yt) \
  T32(6, wt, yt) T32(5, wt, yt) T32(4, wt, yt) T32(3, wt, yt) T32(2, wt, yt)                 \
  default: tile_f32(1, wt, yt, xr, g->ldx, panel, g->k, b, yr, g->ldy, width, PF, nt); break; \
  }
#else
#define F32_TILE_CASES(wt, yt)                                                              \
  switch (h) {                                                                              \
  T32(6, wt, yt) T32(5, wt, yt) T32(4, wt, yt) T32(3, wt, yt) T32(2, wt, yt)                 \
  default: tile_f32(1, wt, yt, xr, g->ldx, panel, g->k, b, yr, g->ldy, width, PF, nt); break; \
  }
#endif

/* One item: the rows [i0, i1) over panel p, prefetching `next` (or NULL). */
static void run_item(const struct gemm *g, int64_t i0, int64_t i1, int64_t p, const char *next) {
  const char *panel = g->packed + p * g->panel_bytes;
  const float *b = g->bias ? g->bias + p * NR : NULL;
  int64_t width = g->n - p * NR < NR ? g->n - p * NR : NR;
  int heights[MAX_MC / 2 + 2];
#if BG_NATIVE_BF16
  if (g->native) {
    int64_t nt = plan_tiles(i1 - i0, MR_BF16, heights), i = i0;
    for (int64_t t = 0; t < nt; t++) {
      const uint16_t *xr = (const uint16_t *)g->x + i * g->ldx;
      uint16_t *yr = (uint16_t *)g->y + i * g->ldy + p * NR;
      const uint16_t *pp = (const uint16_t *)panel;
      const char *pf = next ? next + t * 64 : NULL;
      switch (heights[t]) {
#define CASE(h) case h: tile_bf16(h, xr, g->ldx, pp, g->k, b, yr, g->ldy, width, pf, nt); break;
      CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2)
      default: tile_bf16(1, xr, g->ldx, pp, g->k, b, yr, g->ldy, width, pf, nt); break;
#undef CASE
      }
      i += heights[t];
    }
    return;
  }
#endif
  int64_t nt = plan_tiles(i1 - i0, MR32, heights), i = i0;
  int64_t esize = g->kind == F32 ? 4 : 2;
  for (int64_t t = 0; t < nt; t++) {
    int h = heights[t];
    const float *xr = (const float *)g->x + i * g->ldx;
    void *yr = (char *)g->y + (i * g->ldy + p * NR) * esize;
#define PF (next ? next + t * 64 : NULL)
    if (g->kind == F32) {
      F32_TILE_CASES(F32, F32)
    } else if (g->kind == BF16) {
      F32_TILE_CASES(BF16, BF16)
    } else {
      F32_TILE_CASES(F16, F16)
    }
#undef PF
    i += h;
  }
}

static void run_items(void *ctx, int64_t begin, int64_t end) {
  const struct gemm *g = ctx;
  for (int64_t item = begin; item < end; item++) {
    int64_t block = item / g->num_panels, p = item % g->num_panels;
    int64_t i0 = block * g->mc, i1 = i0 + g->mc < g->m ? i0 + g->mc : g->m;
    const char *next = NULL;
    if (item + 1 < end) next = g->packed + ((item + 1) % g->num_panels) * g->panel_bytes;
    run_item(g, i0, i1, p, next);
  }
}

static void run_gemm(struct gemm *g, int64_t x_elem_bytes) {
  g->num_panels = (g->n + NR - 1) / NR;
  int64_t mc = L2_BYTES_FOR_X / (g->k * x_elem_bytes) / 12 * 12;
  g->mc = mc < 12 ? 12 : mc;
  if (g->mc > MAX_MC) g->mc = MAX_MC;
  int64_t blocks = (g->m + g->mc - 1) / g->mc;
  int64_t rows = g->m < g->mc ? g->m : g->mc;
  int64_t macs = rows * NR * g->k; /* per item */
  int64_t grain = macs >= GRAIN_MACS ? 1 : (GRAIN_MACS + macs - 1) / macs;
  bg_parallel_for(blocks * g->num_panels, grain, run_items, g);
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), float32.
 *   x: [m, k] with row stride ldx (unit column stride); y: [m, n] with row stride ldy.
 *   packed: batchgen_linear_pack_f32's output for W.
 *   bias: NULL, or padded to a multiple of NR floats (the padding is never stored). */
void batchgen_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                         float *y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0) return;
  struct gemm g = {F32, 0, x, ldx, (const char *)packed, k * NR * 4, bias, y, ldy, m, n, k, 0, 0};
  run_gemm(&g, 4);
}

struct widen {
  const uint16_t *x;
  int64_t ldx, k;
  float *out;
  int dtype;
};

static void widen_rows(void *ctx, int64_t begin, int64_t end) {
  const struct widen *w = ctx;
  for (int64_t i = begin; i < end; i++) {
    const uint16_t *src = w->x + i * w->ldx;
    float *dst = w->out + i * w->k;
    int64_t j = 0;
    for (; j + 8 <= w->k; j += 8) {
      __m128i h = _mm_loadu_si128((const __m128i *)(src + j));
      __m256 v = w->dtype == BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                  : _mm256_cvtph_ps(h);
      _mm256_storeu_ps(dst + j, v);
    }
    for (; j < w->k; j++) {
      if (w->dtype == BF16) {
        uint32_t bits = (uint32_t)src[j] << 16;
        memcpy(dst + j, &bits, sizeof bits);
      } else {
        dst[j] = _cvtsh_ss(src[j]);
      }
    }
  }
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 16-bit x, W and y (dtype BF16 = 1 or
 * F16 = 2), float32 sums; as batchgen_linear_f32 otherwise, with packed from
 * batchgen_linear_pack_16 and the strides in elements. Returns 0, or -1 when it cannot get
 * the memory for the input's float32 copy (y is then untouched). */
int batchgen_linear_16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias,
                       uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int dtype) {
  if (m <= 0 || n <= 0) return 0;
#if BG_NATIVE_BF16
  if (dtype == BF16) {
    struct gemm g = {BF16, 1, x, ldx, (const char *)packed, (k + 1) / 2 * 2 * NR * 2, bias, y,
                     ldy, m, n, k, 0, 0};
    run_gemm(&g, 2);
    return 0;
  }
#endif
  float *wide = malloc((size_t)(m * k) * sizeof(float));
  if (!wide) return -1;
  struct widen w = {x, ldx, k, wide, dtype};
  bg_parallel_for(m, 64, widen_rows, &w);
  struct gemm g = {dtype, 0, wide, k, (const char *)packed, k * NR * 2, bias, y, ldy, m, n, k, 0, 0};
  run_gemm(&g, 4);
  free(wide);
  return 0;
}
