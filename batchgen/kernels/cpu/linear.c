/* batchgen: linear layer y = x W^T (+ b) on the CPU, threaded, in float32, bfloat16 and float16.
 *
 * Built and loaded by batchgen/kernels/cpu/c_build.py (with -march=native: the instructions
 * are those of the machine it runs on, and the build cache is keyed on the CPU's flags).
 * The register tiles are in linear_tiles.h, included below (c_build.py hashes it with this file).
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

#include "linear_tiles.h" /* tile_f32 (MR32 rows), tile_bf16: the register tiles */

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
