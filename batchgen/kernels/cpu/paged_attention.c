/* Paged attention for the CPU (decode and prefill), compiled at run time by
 * batchgen.kernels.cpu.
 *
 * Contract: batchgen.kernels.reference.paged_decode_attention and paged_prefill_attention, for
 * float32, bfloat16 and float16 tensors (one dtype for query, caches and output; every sum and
 * product in float32). Each query token attends over its own context, read in place from the
 * paged K/V pools through the block table: nothing is gathered and no position past a query's
 * own context is touched.
 *
 * One routine serves both. Sequence s owns query rows query_start_loc[s] .. [s+1] (one row per
 * sequence when query_start_loc is NULL: decode); they are its last q_len tokens, so the row
 * at position p attends to positions 0..p. The arithmetic of one query row is a function of
 * its query vector and of the K/V rows of positions 0..p alone:
 *
 *   s_k   = dot(q * scale, k_k)           16 partial sums over d (lane d % 16), FMA chains in
 *                                         order of d, then a fixed pairwise tree
 *   m     = max_k s_k
 *   e_k   = exp(s_k - m)                  exp.h's polynomial
 *   sum   = 16 partial sums over k (lane k % 16) for k < 16 * floor(n / 16), the rest added
 *           in order to a 17th, then the 16 lanes added to it in order
 *   acc   = sum over k in order of e_k * v_k   (one FMA chain per dimension)
 *   out   = acc * (1 / sum), rounded to the output dtype
 *
 * No step depends on the batch, on whether the row came as a decode or in a prefill chunk (or
 * which chunk), on the tile of rows computed together, or on the thread that ran it. So a
 * token's attention output is bit-identical whenever it is computed: alone or in any batch,
 * first by decode and later recomputed by prefill after a preemption, with any thread count.
 * Only the build (compiler, flags, CPU) may change the bits. No reduction is left to the
 * compiler to reorder (no `omp simd reduction`); every order above is written out, and FMA is
 * spelled fmaf where the target has it, never left to contraction.
 *
 * Compile-time constants (-D): HEAD_SIZE (elements per head) and GROUP (query heads per KV
 * head). With both fixed the compiler unrolls the head loops.
 *
 * Layout (see reference.py):
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, HEAD_SIZE], contiguous.
 *   query: [num_tokens, num_kv_heads * GROUP, HEAD_SIZE], last dim contiguous, other strides
 *          given (attention layers hand over transposed views).
 *   out:   [num_tokens, num_kv_heads * GROUP, HEAD_SIZE], contiguous.
 *   block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32, >= 1;
 *   query_start_loc: [num_seqs + 1] int32 or NULL.
 *
 * Threads: the work is split into items of (sequence, query tile, KV head) and spread over
 * batchgen's thread pool; every item writes its own output rows.
 *
 * Every index the kernel would follow is checked first, before anything is computed: it
 * returns 0; 1 for a context length outside [1, max_blocks * block_size]; 2 for a block id
 * outside [0, num_blocks) among the blocks a sequence reads (padding past them is never read);
 * 3 for query_start_loc not rising from 0 to num_tokens or a q_len above its context length;
 * 4 when scratch memory cannot be had; 5 for an unknown dtype code.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "pool.h"

#if !defined(HEAD_SIZE) || !defined(GROUP)
#error "compile with -DHEAD_SIZE=<n> -DGROUP=<n>"
#endif

/* Never built with -ffast-math: linking a shared library with it sets flush-to-zero for the
 * whole process. Multiply-adds are explicit: fmaf where the target has FMA (one instruction),
 * a multiply then an add otherwise; the same everywhere in one build. */
#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define LANES 16 /* partial sums of a dot product and of the softmax denominator */
/* Query rows computed together over one read of each K/V row (prefill); a decode has one. The
 * per-row arithmetic is the same whatever the tile. */
#ifndef TILE
#define TILE ((GROUP) * (HEAD_SIZE) <= 1024 ? 4 : 1)
#endif
#define ROWS (TILE * GROUP)

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

int batchgen_head_size(void) { return HEAD_SIZE; }
int batchgen_group(void) { return GROUP; }

/* ---------------------------------------------------------------- element conversions */
static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
static inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  memcpy(&x, &h, sizeof x);
  return (float)x;
}
static inline uint16_t f32_to_f16(float f) {
  const _Float16 x = (_Float16)f;
  uint16_t h;
  memcpy(&h, &x, sizeof h);
  return h;
}
#else
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else { /* zero or subnormal: man * 2^-24, exact in float */
    const float v = (float)man * 5.9604644775390625e-8f;
    memcpy(&u, &v, sizeof u);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint16_t f32_to_f16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;               /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00u;              /* rounds to infinity */
  if (a < 0x38800000u) {                                    /* subnormal or zero in half */
    float af;
    memcpy(&af, &a, sizeof af);
    const float scaled = af * 16777216.0f;                  /* exact: units of 2^-24 */
    uint32_t m = (uint32_t)scaled;
    const float rest = scaled - (float)m;
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return sign | (uint16_t)m;
  }
  const uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);       /* round the 13 dropped bits */
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}
#endif

/* A row of HEAD_SIZE elements of `dtype` as float32: the row itself for float32, else
 * converted (exactly) into buf. */
static inline const float *row_f32(const void *src, int dtype, float *restrict buf) {
  if (dtype == DT_F32) return (const float *)src;
  const uint16_t *h = (const uint16_t *)src;
  if (dtype == DT_BF16) {
    for (int d = 0; d < HEAD_SIZE; ++d) buf[d] = bf16_to_f32(h[d]);
  } else {
    for (int d = 0; d < HEAD_SIZE; ++d) buf[d] = f16_to_f32(h[d]);
  }
  return buf;
}

static inline void store_row(void *dst, int dtype, const float *restrict acc, float inv) {
  if (dtype == DT_F32) {
    float *o = (float *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = acc[d] * inv;
  } else if (dtype == DT_BF16) {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = f32_to_bf16(acc[d] * inv);
  } else {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = f32_to_f16(acc[d] * inv);
  }
}

/* ---------------------------------------------------------------- the per-row arithmetic */
/* exp(x) for x <= 0 (softmax numerators); relative error about 2e-7 (exp.h). */
static inline float exp_nonpos(float x) { return batchgen_exp_clamped(x < -87.0f ? -87.0f : x); }

/* a . b, by definition: lane j (of 16) sums a[d] * b[d] for d = j, j + 16, ... in order of d,
 * one fused multiply-add each, from zero; then the lanes are added pairwise, j + (j + 8), then
 * j + (j + 4), j + (j + 2), 0 + 1. Written with AVX-512 or AVX2 where the build has them, in
 * plain C otherwise: the same operations in the same order, so the same bits. */
#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
static inline float dot_head(const float *restrict a, const float *restrict b) {
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + 16 <= HEAD_SIZE; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
#if HEAD_SIZE % 16
  {
    const __mmask16 m = (__mmask16)((1u << (HEAD_SIZE % 16)) - 1);
    acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc, m);
  }
#endif
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float dot_head(const float *restrict a, const float *restrict b) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps(); /* lanes 0-7, 8-15 */
  int d = 0;
  for (; d + 16 <= HEAD_SIZE; d += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
  }
  float l[16];
  _mm256_storeu_ps(l, lo);
  _mm256_storeu_ps(l + 8, hi);
  for (int j = 0; d + j < HEAD_SIZE; ++j) l[j] = fmaf(a[d + j], b[d + j], l[j]);
  const __m256 s8 = _mm256_add_ps(_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
static inline float dot_head(const float *restrict a, const float *restrict b) {
  float p[LANES];
  for (int j = 0; j < LANES; ++j) p[j] = 0.f;
  int d = 0;
  for (; d + LANES <= HEAD_SIZE; d += LANES)
    for (int j = 0; j < LANES; ++j) p[j] = MADD(a[d + j], b[d + j], p[j]);
  for (int j = 0; d + j < HEAD_SIZE; ++j) p[j] = MADD(a[d + j], b[d + j], p[j]);
  for (int j = 0; j < 8; ++j) p[j] += p[j + 8];
  for (int j = 0; j < 4; ++j) p[j] += p[j + 4];
  p[0] += p[2];
  p[1] += p[3];
  return p[0] + p[1];
}
#endif

/* Turn n scores into softmax numerators exp(s - max) in place; return their sum. */
static inline float exp_and_sum(float *restrict sc, int64_t n, float mx) {
  float lanes[LANES];
  for (int j = 0; j < LANES; ++j) lanes[j] = 0.f;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int j = 0; j < LANES; ++j) {
      const float e = exp_nonpos(sc[i + j] - mx);
      sc[i + j] = e;
      lanes[j] += e;
    }
  }
  float total = 0.f;
  for (; i < n; ++i) {
    sc[i] = exp_nonpos(sc[i] - mx);
    total += sc[i];
  }
  for (int j = 0; j < LANES; ++j) total += lanes[j];
  return total;
}

/* ---------------------------------------------------------------- work items */
typedef struct {
  void *out;
  const void *query, *k_cache, *v_cache;
  const int32_t *block_tables, *query_start_loc, *context_lens;
  const int64_t *item_start; /* [num_seqs + 1]: first work item of each sequence */
  int64_t num_seqs, num_kv_heads, block_size, max_blocks, q_stride_tok, q_stride_head;
  float scale;
  int dtype;
  volatile int failed; /* set by an item that could not get scratch memory */
} Args;

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* Per-thread scratch, kept between calls (pool threads live as long as the process). */
static __thread float *tls_buf;
static __thread int64_t tls_cap;

static float *scratch(int64_t floats) {
  if (floats > tls_cap) {
    free(tls_buf);
    tls_buf = NULL;
    tls_cap = 0;
    int64_t cap = floats + floats / 2 + 1024;
    tls_buf = (float *)malloc((size_t)cap * sizeof(float));
    if (tls_buf == NULL) return NULL;
    tls_cap = cap;
  }
  return tls_buf;
}

/* Query rows r0 .. r0 + nq - 1 of sequence s (positions base .. base + nq - 1), KV head h. */
static int attend(const Args *a, int64_t s, int64_t h, int64_t r0, int nq) {
  const int64_t ctx = a->context_lens[s];
  const int64_t q0 = a->query_start_loc ? a->query_start_loc[s] : s;
  const int64_t q_len = a->query_start_loc ? a->query_start_loc[s + 1] - q0 : 1;
  const int64_t base = ctx - q_len + (r0 - q0); /* row r0 sees keys 0 .. base */
  const int64_t nmax = base + nq;               /* keys the tile's last row sees */
  const int64_t es = elem_size(a->dtype);
  const int64_t tok_stride = a->num_kv_heads * HEAD_SIZE;
  const int64_t blk_stride = a->block_size * tok_stride;
  const int32_t *table = a->block_tables + s * a->max_blocks;

  float *buf = scratch((int64_t)ROWS * HEAD_SIZE * 2 + HEAD_SIZE + (int64_t)ROWS * nmax + 64);
  if (buf == NULL) return 4;
  float *restrict q = buf;                        /* [nq][GROUP][HEAD_SIZE], scaled */
  float *restrict acc = q + ROWS * HEAD_SIZE;     /* [nq][GROUP][HEAD_SIZE] */
  float *restrict conv = acc + ROWS * HEAD_SIZE;  /* one converted K or V row */
  float *restrict scores = conv + HEAD_SIZE;      /* [nq * GROUP][nmax] */

  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < GROUP; ++g) {
      const char *src = (const char *)a->query +
                        ((r0 + i) * a->q_stride_tok + (h * GROUP + g) * a->q_stride_head) * es;
      const float *qr = row_f32(src, a->dtype, conv);
      float *dst = q + (i * GROUP + g) * HEAD_SIZE;
      for (int d = 0; d < HEAD_SIZE; ++d) dst[d] = qr[d] * a->scale;
    }

  /* Pass 1: scores and each row's maximum. Row i sees key p when p <= base + i. */
  float max_score[ROWS];
  for (int r = 0; r < nq * GROUP; ++r) max_score[r] = -FLT_MAX;
  int64_t p = 0;
  for (int64_t b = 0; p < nmax; ++b) {
    const char *kb = (const char *)a->k_cache + ((int64_t)table[b] * blk_stride + h * HEAD_SIZE) * es;
    const int64_t n = nmax - p < a->block_size ? nmax - p : a->block_size;
    for (int64_t o = 0; o < n; ++o, ++p) {
      const float *kp = row_f32(kb + o * tok_stride * es, a->dtype, conv);
      for (int i = p > base ? (int)(p - base) : 0; i < nq; ++i)
        for (int g = 0; g < GROUP; ++g) {
          const int r = i * GROUP + g;
          const float v = dot_head(q + r * HEAD_SIZE, kp);
          scores[r * nmax + p] = v;
          max_score[r] = v > max_score[r] ? v : max_score[r];
        }
    }
  }
  float inv[ROWS];
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < GROUP; ++g) {
      const int r = i * GROUP + g;
      inv[r] = 1.f / exp_and_sum(scores + r * nmax, base + i + 1, max_score[r]);
    }

  /* Pass 2: acc_r = sum_p e_rp v_p, in order of p. */
  for (int64_t j = 0; j < (int64_t)nq * GROUP * HEAD_SIZE; ++j) acc[j] = 0.f;
  p = 0;
  for (int64_t b = 0; p < nmax; ++b) {
    const char *vb = (const char *)a->v_cache + ((int64_t)table[b] * blk_stride + h * HEAD_SIZE) * es;
    const int64_t n = nmax - p < a->block_size ? nmax - p : a->block_size;
    for (int64_t o = 0; o < n; ++o, ++p) {
      const float *vp = row_f32(vb + o * tok_stride * es, a->dtype, conv);
      for (int i = p > base ? (int)(p - base) : 0; i < nq; ++i)
        for (int g = 0; g < GROUP; ++g) {
          const int r = i * GROUP + g;
          const float w = scores[r * nmax + p];
          float *ar = acc + r * HEAD_SIZE;
          for (int d = 0; d < HEAD_SIZE; ++d) ar[d] = MADD(w, vp[d], ar[d]);
        }
    }
  }
  const int64_t num_heads = a->num_kv_heads * GROUP;
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < GROUP; ++g) {
      const int r = i * GROUP + g;
      char *dst = (char *)a->out + ((r0 + i) * num_heads + h * GROUP + g) * HEAD_SIZE * es;
      store_row(dst, a->dtype, acc + r * HEAD_SIZE, inv[r]);
    }
  return 0;
}

/* Items are numbered sequence by sequence; within one, tile by tile from the last (the
 * longest contexts first, so the pool's last chunks are the cheapest), then KV head by head. */
static void run_items(void *ctx, int64_t begin, int64_t end) {
  Args *a = (Args *)ctx;
  int64_t s = 0, lo = 0, hi = a->num_seqs; /* the sequence of item `begin` */
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a->item_start[mid + 1] <= begin) lo = mid + 1; else hi = mid;
  }
  s = lo;
  for (int64_t it = begin; it < end; ++it) {
    while (a->item_start[s + 1] <= it) ++s;
    const int64_t k = it - a->item_start[s];
    const int64_t q0 = a->query_start_loc ? a->query_start_loc[s] : s;
    const int64_t q_len = a->query_start_loc ? a->query_start_loc[s + 1] - q0 : 1;
    const int64_t tile = (q_len + TILE - 1) / TILE - 1 - k / a->num_kv_heads, h = k % a->num_kv_heads;
    const int64_t r0 = q0 + tile * TILE;
    const int nq = (int)(q_len - tile * TILE < TILE ? q_len - tile * TILE : TILE);
    if (attend(a, s, h, r0, nq) != 0) a->failed = 1;
  }
}

int batchgen_paged_attention(
    void *out, const void *query, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *context_lens,
    int64_t num_seqs, int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
    int64_t max_blocks, int64_t q_stride_tok, int64_t q_stride_head, float scale,
    int64_t num_blocks, int dtype) {
  if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return 5;
  if (query_start_loc ? query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens
                      : num_tokens != num_seqs)
    return 3;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = context_lens[s];
    if (ctx < 1 || ctx > max_blocks * block_size) return 1;
    if (query_start_loc) {
      const int64_t q_len = (int64_t)query_start_loc[s + 1] - query_start_loc[s];
      if (q_len < 0 || q_len > ctx) return 3;
    }
    const int32_t *table = block_tables + s * max_blocks;
    for (int64_t b = 0; b * block_size < ctx; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return 2;
  }
  int64_t *item_start = (int64_t *)malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
  if (item_start == NULL) return 4;
  item_start[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc ? query_start_loc[s + 1] - query_start_loc[s] : 1;
    item_start[s + 1] = item_start[s] + (q_len + TILE - 1) / TILE * num_kv_heads;
  }
  Args a = {out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
            item_start, num_seqs, num_kv_heads, block_size, max_blocks, q_stride_tok,
            q_stride_head, scale, dtype, 0};
  bg_parallel_for(item_start[num_seqs], 1, run_items, &a);
  free(item_start);
  return a.failed ? 4 : 0;
}
