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
 *                                         order of d, then a fixed pairwise tree: lane j plus
 *                                         lane j + 8, then j + (j + 4), j + (j + 2), 0 + 1
 *   m     = max_k s_k
 *   e_k   = exp(s_k - m)                  exp.h's polynomial, operation for operation
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
 * spelled fmaf where the target has it, never left to contraction (the loader compiles in ISO
 * C mode, -std=c99, where GCC contracts nothing: a multiply then an add stay two roundings).
 *
 * How it is computed (the order above is kept exactly by every build; AVX-512, AVX2 and plain
 * C give the same bits, pinned by the tests). Keys are taken 16 at a time (a key block; K/V
 * rows of bfloat16 and float16 converted into float32 once per block):
 *   - scores: with AVX-512, the 16 dot products of one query row with a key block run as 16
 *     accumulators side by side; their reduction trees run together as a transpose (each add
 *     of the tree above, for 16 keys per instruction), leaving the 16 scores in one register.
 *     With AVX2, the same per 8 keys: 4 keys' lanes as two 8-float accumulators each, lane
 *     l + (l + 8) added per key, then the other three steps of 8 trees as a transpose
 *     (permute2f128 and two shuffles), leaving 8 scores in one register. Plain C: one dot
 *     product at a time, with the same lanes and tree;
 *   - softmax numerators and their sum: 16 scores per instruction (8 twice with AVX2; exp.h's
 *     operations on a vector; the sum's 16 lanes are the vector's lanes);
 *   - acc: the accumulators of several query rows stay in registers over the whole context
 *     (rows x dimensions tiled to fit), each V row loaded once per tile and added to every
 *     row that sees it, in order of k (AVX2: over segments of the context, a 16-bit segment's
 *     V rows converted once, the accumulators kept in memory between segments).
 * Key rows are prefetched two key blocks ahead, and a block's V rows into L2 while its scores
 * are computed (the blocks are scattered; in a model step they come from memory).
 *
 * Two per-call options, as the torch reference defines them (one branch per row, none per key):
 *   window W > 0: the row at position p sees keys max(0, p - W + 1) .. p only. A tile's keys
 *     are counted from the first key its first row sees (k0); every sum above runs over a
 *     row's own keys, its softmax lanes counted from its own first key, and a key of the tile
 *     before a row's first gets a numerator of exactly 0 (adding 0 * v to an accumulator that
 *     is still 0 leaves it 0), so a windowed row's bits depend on its own keys alone, as above.
 *   softcap c > 0: s_k = tanhf(s_k / c) * c over a row's keys before the softmax.
 *
 * Compile-time constants (-D): HEAD_SIZE (elements per head) and GROUP (query heads per KV
 * head). With both fixed the compiler unrolls the head loops.
 *
 * Layout (see batchgen/kernels/ops.py):
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
 * 4 when scratch memory cannot be had; 5 for an unknown dtype code; 6 for a negative window or
 * a soft cap that is negative or NaN. With a window, only the blocks that hold keys some row
 * sees are checked (and read): a sequence's blocks wholly before its window may be freed.
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

#if defined(__AVX512F__) && defined(__FMA__)
#define BG_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BG_AVX2 1
#include <immintrin.h>
#endif

#define LANES 16 /* partial sums of a dot product and of the softmax denominator */
#define KB 16    /* keys per key block */
#define NV ((HEAD_SIZE + 15) / 16)   /* 16-float vectors per head row */
#define NFULL (HEAD_SIZE / 16)       /* of which full */
#define HSP (NV * 16)                /* a head row padded to whole vectors (scratch rows) */
/* Query tokens computed together over one read of each K/V row (prefill); a decode has one.
 * The per-row arithmetic is the same whatever the tile. A sequence whose context reaches
 * LONG_CONTEXT takes TILE_LONG tokens a tile: its K/V rows (2048 x 64 floats of K and of V per
 * KV head at 2048 tokens, more than the L2 holds beside the scores) are then read a quarter as
 * often, while a short context keeps TILE (less work past each row's last key). */
#ifndef TILE
#define TILE ((GROUP) * (HEAD_SIZE) <= 1024 ? 4 : 1)
#endif
#ifndef TILE_LONG
#define TILE_LONG (TILE > 1 ? 4 * TILE : 1)
#endif
#define LONG_CONTEXT 1024
#define ROWS (TILE_LONG * GROUP) /* the most rows of one tile */

static inline int64_t tile_of(int64_t context_len) { return context_len >= LONG_CONTEXT ? TILE_LONG : TILE; }

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

int batchgen_head_size(void) { return HEAD_SIZE; }
int batchgen_group(void) { return GROUP; }

/* Which of the source's variants this build runs: 2 AVX-512, 1 AVX2 (with FMA and F16C), 0
 * plain C. The tests force each build and check that it reports the variant they asked for. */
int batchgen_attention_isa(void) {
#if defined(BG_AVX512)
  return 2;
#elif defined(BG_AVX2)
  return 1;
#else
  return 0;
#endif
}

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

/* A row of HEAD_SIZE elements of `dtype` into float32 (exactly), zero-padded to HSP. */
static inline void convert_row(const void *src, int dtype, float *restrict dst) {
  const uint16_t *h = (const uint16_t *)src;
  int d = 0;
#ifdef BG_AVX512
  if (dtype == DT_F32) {
    for (; d < NFULL * 16; d += 16) _mm512_storeu_ps(dst + d, _mm512_loadu_ps((const float *)src + d));
  } else if (dtype == DT_BF16) {
    for (; d < NFULL * 16; d += 16) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + d)));
      _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  } else {
    for (; d < NFULL * 16; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
  }
#elif defined(BG_AVX2)
  if (dtype == DT_F32) {
    for (; d + 8 <= HEAD_SIZE; d += 8) _mm256_storeu_ps(dst + d, _mm256_loadu_ps((const float *)src + d));
  } else if (dtype == DT_BF16) {
    for (; d + 8 <= HEAD_SIZE; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + d)));
      _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else {
    for (; d + 8 <= HEAD_SIZE; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
  }
#endif
  if (dtype == DT_F32)
    for (; d < HEAD_SIZE; ++d) dst[d] = ((const float *)src)[d];
  else if (dtype == DT_BF16)
    for (; d < HEAD_SIZE; ++d) dst[d] = bf16_to_f32(h[d]);
  else
    for (; d < HEAD_SIZE; ++d) dst[d] = f16_to_f32(h[d]);
  for (; d < HSP; ++d) dst[d] = 0.f;
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
  int64_t window; /* 0: none */
  float softcap;  /* 0: none */
  volatile int failed; /* set by an item that could not get scratch memory */
} Args;

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* The rows of n keys (1 <= n <= KB) at element offsets off[0 .. n - 1] of `cache` (k_cache or
 * v_cache) as float32: the cache's own rows for float32, else converted into buf ([KB][HSP]).
 * rows[n .. KB - 1] repeat row n - 1 (read, never used). */
static inline void key_block(const void *cache, int dtype, const int64_t *off, int n,
                             float *restrict buf, const float **rows) {
  if (dtype == DT_F32) {
    for (int j = 0; j < n; ++j) rows[j] = (const float *)cache + off[j];
  } else {
    for (int j = 0; j < n; ++j) {
      convert_row((const uint16_t *)cache + off[j], dtype, buf + j * HSP);
      rows[j] = buf + j * HSP;
    }
  }
  for (int j = n; j < KB; ++j) rows[j] = rows[n - 1];
}

/* Ask for the rows of keys p0 .. p1 - 1 of `cache` (element offsets off[p]) ahead of their use,
 * into every cache level (locality 3) or into L2 and beyond (locality 2). They lie in scattered
 * blocks that the hardware prefetchers cannot guess; in a model step they come from memory
 * (every layer's weights stream through the caches between two calls for one layer). A macro:
 * the locality must be a constant. */
#define PREFETCH_ROWS(cache, es, off, p0, p1, locality)                                       \
  do {                                                                                        \
    for (int64_t p_ = (p0); p_ < (p1); ++p_) {                                                \
      const char *row_ = (const char *)(cache) + (off)[p_] * (es);                            \
      for (int64_t x_ = 0; x_ < HEAD_SIZE * (es); x_ += 64) __builtin_prefetch(row_ + x_, 0, locality); \
    }                                                                                         \
  } while (0)

/* ---------------------------------------------------------------- the per-row arithmetic */
#ifdef BG_AVX512
/* The first three steps of the tree (lane l + (l + 8), l + (l + 4), l + (l + 2)) of 8 slots
 * (one query row's accumulators against 8 keys) at once: a shuffle and a blend line up the
 * lanes to add, an add adds them; a slot's lanes are only added to the same slot's. Leaves in 128-bit
 * quarter q the two partial sums of two slots: q0 slots 0, 1; q1 4, 5; q2 2, 3; q3 6, 7. */
static inline __m512 tree8(const __m512 *acc) {
  __m512 t[4], u[2];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) /* [m.q0 + m.q2, m.q1 + m.q3, (m+4).q2 + (m+4).q0, (m+4).q3 + (m+4).q1] */
    t[m] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, acc[m], acc[m + 4]),
                         _mm512_shuffle_f32x4(acc[m], acc[m + 4], 0x4E));
#pragma GCC unroll 2
  for (int n = 0; n < 2; ++n) /* quarters: slots [n, n + 4, n + 2, n + 6] */
    u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(t[n], t[n + 2], 0x88),
                         _mm512_shuffle_f32x4(t[n], t[n + 2], 0xDD));
  /* in each quarter: lanes 0 + 2, 1 + 3 of u[0], then of u[1] */
  return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, u[0], u[1]), _mm512_shuffle_ps(u[0], u[1], 0x4E));
}

/* The last step (0 + 1) of two tree8 results, a's slots and b's: lane L then holds the slot
 * KEY_A (a) or KEY_B (b) assigns key L. */
static const int KEY_A[8] = {0, 1, 8, 9, 4, 5, 12, 13};
static const int KEY_B[8] = {2, 3, 10, 11, 6, 7, 14, 15};

static inline __m512 tree_last(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* One query row against 8 keys (rows[slot[0 .. 7]]), up to tree8: accumulator j, lane l sums
 * q[d] k[d] over d = l (mod 16) in order of d, one FMA each, from zero (dot_head's lanes). */
static inline __m512 half8(const float *restrict q, const float *const *rows, const int *slot) {
  const float *k[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) k[j] = rows[slot[j]];
  __m512 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < NFULL; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[j] + 16 * c), acc[j]);
  }
#if HEAD_SIZE % 16
  {
    const __mmask16 m = (__mmask16)((1u << (HEAD_SIZE % 16)) - 1);
    const __m512 qc = _mm512_maskz_loadu_ps(m, q + 16 * NFULL);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm512_mask3_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, k[j] + 16 * NFULL), acc[j], m);
  }
#endif
  return tree8(acc);
}

/* The 16 scores q . k_j (j < 16) of one query row, lane j: each exactly dot_head's. */
static inline __m512 scores16(const float *restrict q, const float *const *rows) {
  return tree_last(half8(q, rows, KEY_A), half8(q, rows, KEY_B));
}

/* exp.h's batchgen_exp_clamped on 16 lanes: the same operations in the same order (no
 * contraction: see the header), so the same bits; NaN in, NaN out, nothing undefined. */
static inline __m512 exp16(__m512 c) {
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)), big), big);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(c, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  /* nc = n >= -126 ? (n <= 128 ? n : 128) : -126, NaN -> -126 */
  const __mmask16 ge = _mm512_cmp_ps_mask(n, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __mmask16 le = _mm512_cmp_ps_mask(n, _mm512_set1_ps(128.0f), _CMP_LE_OQ);
  const __m512 nc = _mm512_mask_blend_ps(ge, _mm512_set1_ps(-126.0f),
                                         _mm512_mask_blend_ps(le, _mm512_set1_ps(128.0f), n));
  const __m512i ni = _mm512_cvttps_epi32(nc);
  const __m512i n1 = _mm512_srai_epi32(_mm512_add_epi32(ni, _mm512_srli_epi32(ni, 31)), 1); /* ni / 2 */
  const __m512i n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}

/* Turn the n scores of a row into softmax numerators exp(s - max) in place; return their
 * sum. sc has room for n rounded up to 16. */
static inline float softmax_row(float *restrict sc, int64_t n) {
  const int64_t nf = n & ~(int64_t)15;
  const __mmask16 tail = (__mmask16)((1u << (n - nf)) - 1);
  __m512 mv = _mm512_set1_ps(-FLT_MAX);
  for (int64_t i = 0; i < nf; i += 16) mv = _mm512_max_ps(_mm512_loadu_ps(sc + i), mv); /* s > m ? s : m */
  if (tail) mv = _mm512_mask_max_ps(mv, tail, _mm512_loadu_ps(sc + nf), mv);
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv)); /* no NaN in mv: any order */
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < nf; i += 16) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + i), mx);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
    const __m512 e = exp16(x);
    _mm512_storeu_ps(sc + i, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  float total = 0.f;
  if (tail) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + nf), mx);
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), lo);
    _mm512_storeu_ps(sc + nf, exp16(x));
    for (int64_t i = nf; i < n; ++i) total += sc[i];
  }
  float l[LANES];
  _mm512_storeu_ps(l, lanes);
  for (int j = 0; j < LANES; ++j) total += l[j];
  return total;
}

/* Output elements d0 .. d0 + 15 (fewer at the row's end) of acc * inv in the output dtype. */
static inline void store16(void *dst, int dtype, int64_t d0, __m512 acc, float inv) {
  const __m512 x = _mm512_mul_ps(acc, _mm512_set1_ps(inv));
  const int n = HEAD_SIZE - d0 < 16 ? (int)(HEAD_SIZE - d0) : 16;
  if (dtype == DT_F32) {
    _mm512_mask_storeu_ps((float *)dst + d0, (__mmask16)((1u << n) - 1), x);
    return;
  }
  __m256i h;
  if (dtype == DT_BF16) { /* round to nearest even; NaN -> 0x7FC0 (f32_to_bf16) */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (n == 16) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + d0), h);
  } else {
    uint16_t tmp[16];
    _mm256_storeu_si256((__m256i *)tmp, h);
    memcpy((uint16_t *)dst + d0, tmp, (size_t)n * sizeof tmp[0]);
  }
}

/* acc and output over dimensions [16 * c0, 16 * (c0 + nc)) of query rows r .. r + nr - 1 of
 * a tile, the nr * nc accumulators in registers through the whole context. Rows are ordered
 * by the last key they see, lim[r]. */
#define PV_REGS 24 /* accumulators held at once */
#define PV_DC (NV < 8 ? NV : 8)
#define PV_RB (PV_REGS / PV_DC < 8 ? PV_REGS / PV_DC : 8)

typedef struct {
  const void *v_cache;
  int dtype;
  int64_t ss;
  const int64_t *off;    /* element offset of each key's row */
  const float *w;        /* numerators [rows][ss] */
  const int64_t *lim;    /* last key of each row */
  const float *inv;      /* 1 / sum of each row */
  void *const *dst;      /* output row of each row */
  float *vbuf;           /* [KB][HSP] */
} PvJob;

static inline __attribute__((always_inline)) void pv_rows(const PvJob *job, const int r, const int nr,
                                                          const int c0, const int nc) {
  __m512 acc[PV_RB][PV_DC];
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_setzero_ps();
  const int64_t first = job->lim[r], last = job->lim[r + nr - 1], ss = job->ss;
  const float *w = job->w + r * ss;
  const int tail_vec = (HEAD_SIZE % 16) && c0 + nc == NV; /* the last vector is partial */
  const __mmask16 tail = (__mmask16)((1u << (HEAD_SIZE % 16)) - 1);
  const float *rows[KB];
  for (int64_t kb = 0; kb <= last; kb += KB) {
    const int n = last + 1 - kb < KB ? (int)(last + 1 - kb) : KB;
    const int all = first + 1 - kb >= n ? n : (int)(first + 1 - kb); /* keys every row sees */
    key_block(job->v_cache, job->dtype, job->off + kb, n, job->vbuf, rows);
    const float *wk = w + kb;
    for (int j = 0; j < n; ++j) {
      __m512 v[PV_DC];
      const float *vr = rows[j] + 16 * c0;
#pragma GCC unroll 8
      for (int c = 0; c < nc; ++c)
        v[c] = tail_vec && c == nc - 1 ? _mm512_maskz_loadu_ps(tail, vr + 16 * c) : _mm512_loadu_ps(vr + 16 * c);
      if (j < all) {
#pragma GCC unroll 8
        for (int i = 0; i < nr; ++i) {
          const __m512 e = _mm512_set1_ps(wk[i * ss + j]);
#pragma GCC unroll 8
          for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_fmadd_ps(e, v[c], acc[i][c]);
        }
      } else { /* prefill: rows whose context ends before key kb + j skip it */
#pragma GCC unroll 8
        for (int i = 0; i < nr; ++i) {
          if (kb + j > job->lim[r + i]) continue;
          const __m512 e = _mm512_set1_ps(wk[i * ss + j]);
#pragma GCC unroll 8
          for (int c = 0; c < nc; ++c) acc[i][c] = _mm512_fmadd_ps(e, v[c], acc[i][c]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      store16(job->dst[r + i], job->dtype, 16 * (c0 + c), acc[i][c], job->inv[r + i]);
}

/* Rows r .. r + nr - 1 (nr <= PV_RB), every dimension. */
static inline __attribute__((always_inline)) void pv_rows_all(const PvJob *job, int r, const int nr) {
#pragma GCC unroll 8
  for (int c0 = 0; c0 < NV; c0 += PV_DC) pv_rows(job, r, nr, c0, NV - c0 < PV_DC ? NV - c0 : PV_DC);
}

static void pv(const PvJob *job, int rows) {
  for (int r = 0; r < rows; r += PV_RB) {
    switch (rows - r < PV_RB ? rows - r : PV_RB) {
#define PV_CASE(k) case k: if (k <= PV_RB) pv_rows_all(job, r, k <= PV_RB ? k : 1); break;
      PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
#undef PV_CASE
      default: break;
    }
  }
}

#elif defined(BG_AVX2)
/* The AVX2 variant: the AVX-512 one's steps on 8-float vectors, in the same order. */

/* Lanes l < t of a vector set (a constant mask; t a compile-time constant). */
#define LANES_BELOW(t) _mm256_setr_epi32((t) > 0 ? -1 : 0, (t) > 1 ? -1 : 0, (t) > 2 ? -1 : 0, (t) > 3 ? -1 : 0, \
                                         (t) > 4 ? -1 : 0, (t) > 5 ? -1 : 0, (t) > 6 ? -1 : 0, (t) > 7 ? -1 : 0)

/* One query row against 4 keys k[0 .. 3]: lane l of 16 sums q[d] k[d] over d = l (mod 16) in
 * order of d, one FMA each, from zero (as two 8-lane accumulators, lanes 0-7 and 8-15), then
 * the tree's first step, lane l + (l + 8): s8[j] holds key j's 8 partial sums. */
static inline void dot4(const float *restrict q, const float *const *k, __m256 *s8) {
  __m256 lo[4], hi[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < NFULL; ++c) {
    const __m256 ql = _mm256_loadu_ps(q + 16 * c), qh = _mm256_loadu_ps(q + 16 * c + 8);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[j] + 16 * c), lo[j]);
      hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[j] + 16 * c + 8), hi[j]);
    }
  }
#if HEAD_SIZE % 16
  { /* the last HEAD_SIZE % 16 dimensions: one more FMA in lanes l < HEAD_SIZE % 16 only (a
     * blend keeps the other lanes' sums as they are, bit for bit) */
#define TAIL16 (HEAD_SIZE % 16)
    const float *qt = q + 16 * NFULL; /* the scaled query row is zero-padded to HSP */
    const __m256i ml = LANES_BELOW(TAIL16), mh = LANES_BELOW(TAIL16 - 8);
    const __m256 ql = _mm256_loadu_ps(qt), qh = _mm256_loadu_ps(qt + 8);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const float *kt = k[j] + 16 * NFULL; /* the cache's own row: no reads past HEAD_SIZE */
      lo[j] = _mm256_blendv_ps(lo[j], _mm256_fmadd_ps(ql, _mm256_maskload_ps(kt, ml), lo[j]), _mm256_castsi256_ps(ml));
      if (TAIL16 > 8)
        hi[j] = _mm256_blendv_ps(hi[j], _mm256_fmadd_ps(qh, _mm256_maskload_ps(kt + 8, mh), hi[j]),
                                 _mm256_castsi256_ps(mh));
    }
#undef TAIL16
  }
#endif
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) s8[j] = _mm256_add_ps(lo[j], hi[j]);
}

/* The rest of the tree (lane l + (l + 4), l + (l + 2), 0 + 1) of 8 slots at once, each add
 * adding the same two partial sums of the same slot as the scalar tree; lane L of the result
 * holds slot 2L (L < 4) or 2(L - 4) + 1. */
static inline __m256 tree8(const __m256 *s8) {
  __m256 t[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) /* [slot 2m's l + (l + 4), slot 2m + 1's] */
    t[m] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * m], s8[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(s8[2 * m], s8[2 * m + 1], 0x31));
  /* per 128-bit half: lanes 0 + 2, 1 + 3 of two slots */
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
}

/* The key each slot takes, so that lane L of tree8's result is key L. */
static const int KEY8[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* The scores q . k_j of one query row for keys j0 .. j0 + 7 of a block, lane j - j0: each
 * exactly the plain C dot_head's. */
static inline __m256 scores8(const float *restrict q, const float *const *rows, int j0) {
  const float *k[8];
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) k[s] = rows[j0 + KEY8[s]];
  __m256 s8[8];
  dot4(q, k, s8);
  dot4(q, k + 4, s8 + 4);
  return tree8(s8);
}

/* exp.h's batchgen_exp_clamped on 8 lanes: the same operations in the same order. */
static inline __m256 exp8(__m256 c) {
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)), big), big);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(c, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  /* nc = n >= -126 ? (n <= 128 ? n : 128) : -126, NaN -> -126 */
  const __m256 ge = _mm256_cmp_ps(n, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m256 le = _mm256_cmp_ps(n, _mm256_set1_ps(128.0f), _CMP_LE_OQ);
  const __m256 nc = _mm256_blendv_ps(_mm256_set1_ps(-126.0f), _mm256_blendv_ps(_mm256_set1_ps(128.0f), n, le), ge);
  const __m256i ni = _mm256_cvttps_epi32(nc);
  const __m256i n1 = _mm256_srai_epi32(_mm256_add_epi32(ni, _mm256_srli_epi32(ni, 31)), 1); /* ni / 2 */
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* exp(max(x, -87)) of 8 lanes: the softmax numerators' clamp, then exp8. */
static inline __m256 exp8_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  return exp8(_mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ)));
}

/* Turn the n scores of a row into softmax numerators exp(s - max) in place; return their
 * sum (lanes 0-7 and 8-15 of the 16 lane sums as two vectors). sc has room for n rounded up
 * to 16; the entries past n are not used (they may hold anything). */
static inline float softmax_row(float *restrict sc, int64_t n) {
  const int64_t nf = n & ~(int64_t)15;
  const int t = (int)(n - nf);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 tl = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t), idx));
  const __m256 th = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t - 8), idx));
  const __m256 floor_ = _mm256_set1_ps(-FLT_MAX);
  __m256 ml = floor_, mh = floor_;
  for (int64_t i = 0; i < nf; i += 16) { /* s > m ? s : m */
    ml = _mm256_max_ps(_mm256_loadu_ps(sc + i), ml);
    mh = _mm256_max_ps(_mm256_loadu_ps(sc + i + 8), mh);
  }
  if (t) {
    ml = _mm256_max_ps(_mm256_blendv_ps(floor_, _mm256_loadu_ps(sc + nf), tl), ml);
    mh = _mm256_max_ps(_mm256_blendv_ps(floor_, _mm256_loadu_ps(sc + nf + 8), th), mh);
  }
  /* no NaN in ml, mh: any order */
  __m256 m8 = _mm256_max_ps(ml, mh);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const __m256 mx = _mm256_broadcastss_ps(m4);
  __m256 sl = _mm256_setzero_ps(), sh = _mm256_setzero_ps();
  for (int64_t i = 0; i < nf; i += 16) {
    const __m256 el = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mx));
    const __m256 eh = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + i + 8), mx));
    _mm256_storeu_ps(sc + i, el);
    _mm256_storeu_ps(sc + i + 8, eh);
    sl = _mm256_add_ps(sl, el);
    sh = _mm256_add_ps(sh, eh);
  }
  float total = 0.f;
  if (t) {
    _mm256_storeu_ps(sc + nf, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + nf), mx)));
    if (t > 8) _mm256_storeu_ps(sc + nf + 8, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + nf + 8), mx)));
    for (int64_t i = nf; i < n; ++i) total += sc[i];
  }
  float l[LANES];
  _mm256_storeu_ps(l, sl);
  _mm256_storeu_ps(l + 8, sh);
  for (int j = 0; j < LANES; ++j) total += l[j];
  return total;
}

/* Output elements d0 .. d0 + 7 (fewer at the row's end) of acc * inv in the output dtype. */
static inline void store8(void *dst, int dtype, int64_t d0, __m256 acc, float inv) {
  const __m256 x = _mm256_mul_ps(acc, _mm256_set1_ps(inv));
  const int n = HEAD_SIZE - d0 < 8 ? (int)(HEAD_SIZE - d0) : 8;
  if (dtype == DT_F32) {
    if (n == 8)
      _mm256_storeu_ps((float *)dst + d0, x);
    else
      _mm256_maskstore_ps((float *)dst + d0, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), x);
    return;
  }
  __m128i h;
  if (dtype == DT_BF16) { /* round to nearest even; NaN -> 0x7FC0 (f32_to_bf16) */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (n == 8) {
    _mm_storeu_si128((__m128i *)((uint16_t *)dst + d0), h);
  } else {
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, h);
    memcpy((uint16_t *)dst + d0, tmp, (size_t)n * sizeof tmp[0]);
  }
}

/* acc and output over dimensions [8 * c0, 8 * (c0 + nc)) of query rows r .. r + nr - 1 of a
 * tile, the nr * nc accumulators in registers through the whole context (16 registers: the
 * accumulators, a V row's nc vectors and a broadcast weight). Rows are ordered by the last key
 * they see, lim[r]. */
#define NV8 ((HEAD_SIZE + 7) / 8) /* 8-float vectors per head row */
#ifndef PV_REGS
#define PV_REGS 8                 /* accumulators held at once */
#endif
#define PV_DC (NV8 < 4 ? NV8 : 4)
#define PV_RB (PV_REGS / PV_DC < 8 ? PV_REGS / PV_DC : 8)

/* P.V runs over segments of the context: a 16-bit segment's V rows are converted once into
 * float32 (vseg, SEG_KEYS x HSP floats, kept in L2), then read by every pass of rows and
 * dimensions; between segments the accumulators wait in memory (accbuf), which changes no bit.
 * float32 rows are read in place, in one segment. */
#define SEG_KEYS ((16384 / HSP) / KB * KB > KB ? (16384 / HSP) / KB * KB : KB)

typedef struct {
  const void *v_cache;
  int dtype;
  int64_t ss;
  const int64_t *off;    /* element offset of each key's row */
  const float *w;        /* numerators [rows][ss] */
  const int64_t *lim;    /* last key of each row */
  const float *inv;      /* 1 / sum of each row */
  void *const *dst;      /* output row of each row */
  float *vseg;           /* [SEG_KEYS][HSP]: a segment's V rows in float32 (16-bit caches) */
  float *accbuf;         /* [rows][HSP]: the accumulators between segments */
  int64_t k0, k1;        /* this segment's keys */
  int first_seg, last_seg;
} PvJob;

static inline __attribute__((always_inline)) void pv_rows(const PvJob *job, const int r, const int nr,
                                                          const int c0, const int nc) {
  __m256 acc[PV_RB][PV_DC];
  const __m256i tail = LANES_BELOW(HEAD_SIZE % 8);
  const int tail_vec = (HEAD_SIZE % 8) && c0 + nc == NV8; /* the last vector is partial */
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      acc[i][c] = job->first_seg ? _mm256_setzero_ps() : _mm256_loadu_ps(job->accbuf + (r + i) * HSP + 8 * (c0 + c));
  const int64_t first = job->lim[r], ss = job->ss, k0 = job->k0;
  const int64_t last = job->lim[r + nr - 1] < job->k1 - 1 ? job->lim[r + nr - 1] : job->k1 - 1;
  const float *w = job->w + r * ss;
  const int f32 = job->dtype == DT_F32;
  for (int64_t p = k0; p <= last; ++p) {
    const float *vr = (f32 ? (const float *)job->v_cache + job->off[p] : job->vseg + (p - k0) * HSP) + 8 * c0;
    __m256 v[PV_DC];
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c)
      v[c] = tail_vec && c == nc - 1 ? _mm256_maskload_ps(vr + 8 * c, tail) : _mm256_loadu_ps(vr + 8 * c);
    if (p <= first) {
#pragma GCC unroll 8
      for (int i = 0; i < nr; ++i) {
        const __m256 e = _mm256_broadcast_ss(w + i * ss + p);
#pragma GCC unroll 8
        for (int c = 0; c < nc; ++c) acc[i][c] = _mm256_fmadd_ps(e, v[c], acc[i][c]);
      }
    } else { /* prefill: rows whose context ends before key p skip it */
#pragma GCC unroll 8
      for (int i = 0; i < nr; ++i) {
        if (p > job->lim[r + i]) continue;
        const __m256 e = _mm256_broadcast_ss(w + i * ss + p);
#pragma GCC unroll 8
        for (int c = 0; c < nc; ++c) acc[i][c] = _mm256_fmadd_ps(e, v[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < nr; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < nc; ++c) {
      if (job->last_seg)
        store8(job->dst[r + i], job->dtype, 8 * (c0 + c), acc[i][c], job->inv[r + i]);
      else
        _mm256_storeu_ps(job->accbuf + (r + i) * HSP + 8 * (c0 + c), acc[i][c]);
    }
}

/* Rows r .. r + nr - 1 (nr <= PV_RB), every dimension. */
static inline __attribute__((always_inline)) void pv_rows_all(const PvJob *job, int r, const int nr) {
#pragma GCC unroll 8
  for (int c0 = 0; c0 < NV8; c0 += PV_DC) pv_rows(job, r, nr, c0, NV8 - c0 < PV_DC ? NV8 - c0 : PV_DC);
}

static void pv_segment(const PvJob *job, int rows) {
  for (int r = 0; r < rows; r += PV_RB) {
    switch (rows - r < PV_RB ? rows - r : PV_RB) {
#define PV_CASE(k) case k: if (k <= PV_RB) pv_rows_all(job, r, k <= PV_RB ? k : 1); break;
      PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
#undef PV_CASE
      default: break;
    }
  }
}

/* acc_r = sum_p e_rp v_p over keys 0 .. nmax - 1, in order of p, then the output rows. */
static void pv(PvJob *job, int rows, int64_t nmax) {
  const int64_t seg = job->dtype == DT_F32 ? nmax : SEG_KEYS;
  for (int64_t k0 = 0; k0 < nmax; k0 += seg) {
    const int64_t k1 = nmax - k0 < seg ? nmax : k0 + seg;
    if (job->dtype != DT_F32)
      for (int64_t p = k0; p < k1; ++p)
        convert_row((const uint16_t *)job->v_cache + job->off[p], job->dtype, job->vseg + (p - k0) * HSP);
    job->k0 = k0;
    job->k1 = k1;
    job->first_seg = k0 == 0;
    job->last_seg = k1 == nmax;
    pv_segment(job, rows);
  }
}

#else /* plain C */

/* a . b, by definition: lane j (of 16) sums a[d] * b[d] for d = j, j + 16, ... in order of d,
 * one fused multiply-add each, from zero; then the lanes are added pairwise, j + (j + 8), then
 * j + (j + 4), j + (j + 2), 0 + 1: the same operations in the same order as the AVX-512
 * scores16 and the AVX2 scores8, so the same bits. */
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

/* exp(x) for x <= 0 (softmax numerators); relative error about 2e-7 (exp.h). */
static inline float exp_nonpos(float x) { return batchgen_exp_clamped(x < -87.0f ? -87.0f : x); }

/* Turn the n scores of a row into softmax numerators exp(s - max) in place; return their sum. */
static inline float softmax_row(float *restrict sc, int64_t n) {
  float mx = -FLT_MAX;
  for (int64_t i = 0; i < n; ++i) mx = sc[i] > mx ? sc[i] : mx;
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
#endif

#ifdef BG_AVX2
#define SEG_FLOATS ((int64_t)SEG_KEYS * HSP) /* P.V's converted V segment */
#else
#define SEG_FLOATS 0
#endif

/* Per-thread scratch, kept between calls (pool threads live as long as the process); 64-byte
 * aligned. */
static __thread float *tls_buf;
static __thread int64_t tls_cap;

static float *scratch(int64_t floats) {
  if (floats > tls_cap) {
    free(tls_buf);
    tls_buf = NULL;
    tls_cap = 0;
    int64_t cap = floats + floats / 2 + 1024;
    tls_buf = (float *)malloc((size_t)(cap + 16) * sizeof(float));
    if (tls_buf == NULL) return NULL;
    tls_cap = cap;
  }
  return (float *)(((uintptr_t)tls_buf + 63) & ~(uintptr_t)63);
}

/* x = tanhf(x / c) * c over n scores (HF's soft cap: a division, tanh, a product). */
static void soft_cap_row(float *restrict x, int64_t n, float c) {
  for (int64_t i = 0; i < n; ++i) x[i] = tanhf(x[i] / c) * c;
}

/* Query rows r0 .. r0 + nq - 1 of sequence s, KV head h. Key indices count from k0, the first
 * key the tile's first row sees (0 without a window). */
static int attend(const Args *a, int64_t s, int64_t h, int64_t r0, int nq) {
  const int64_t ctx = a->context_lens[s];
  const int64_t q0 = a->query_start_loc ? a->query_start_loc[s] : s;
  const int64_t q_len = a->query_start_loc ? a->query_start_loc[s + 1] - q0 : 1;
  const int64_t pos0 = ctx - q_len + (r0 - q0);  /* position of row r0 */
  const int64_t win = a->window;
  const int64_t k0 = win > 0 && pos0 >= win ? pos0 - win + 1 : 0;
  const int64_t base = pos0 - k0;               /* row r0 sees keys 0 .. base */
  const int64_t nmax = base + nq;               /* keys the tile's last row sees */
  /* a row of scores, whole key blocks (and one more with a window: a row's softmax starts at
   * its own first key and reads and writes whole vectors from there) */
  const int64_t ss = (nmax + KB - 1) / KB * KB + (win > 0 ? KB : 0);
  const int64_t es = elem_size(a->dtype);
  const int32_t *table = a->block_tables + s * a->max_blocks;
  const int rows = nq * GROUP; /* row r = i * GROUP + g: token r0 + i, query head h * GROUP + g */

  float *buf = scratch(2 * ss + (int64_t)ROWS * HSP * 2 + 2 * KB * HSP + (int64_t)ROWS * ss + SEG_FLOATS);
  if (buf == NULL) return 4;
  int64_t *restrict off = (int64_t *)buf;          /* [ss]: element offset of key p's rows */
  float *restrict q = buf + 2 * ss;                /* [rows][HSP], scaled */
  float *restrict kbuf = q + ROWS * HSP;           /* [KB][HSP]: a converted key block */
  float *restrict vbuf = kbuf + KB * HSP;          /* [KB][HSP]: a converted value block */
  float *restrict scores = vbuf + KB * HSP;        /* [rows][ss], then acc [rows][HSP] (plain C and
                                                      AVX2), then AVX2's V segment */
  int64_t lim[ROWS];                               /* the last key each row sees */
  int64_t first[ROWS];                             /* the first key each row sees */
  float inv[ROWS];
  void *dst[ROWS];

  const int64_t tok_stride = a->num_kv_heads * HEAD_SIZE, bs = a->block_size;
  for (int64_t p = 0, b = k0 / bs, o = k0 % bs; p < nmax; ++b, o = 0) {
    const int64_t at = (int64_t)table[b] * bs * tok_stride + h * HEAD_SIZE;
    for (; o < bs && p < nmax; ++o, ++p) off[p] = at + o * tok_stride;
  }
  PREFETCH_ROWS(a->k_cache, es, off, 0, nmax < 2 * KB ? nmax : 2 * KB, 3);
  const int64_t num_heads = a->num_kv_heads * GROUP;
  const float scale = a->scale;
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < GROUP; ++g) {
      const int r = i * GROUP + g;
      const char *src = (const char *)a->query +
                        ((r0 + i) * a->q_stride_tok + (h * GROUP + g) * a->q_stride_head) * es;
      float *qr = q + r * HSP;
      convert_row(src, a->dtype, qr);
      for (int d = 0; d < HEAD_SIZE; ++d) qr[d] = qr[d] * scale;
      lim[r] = base + i;
      first[r] = win > 0 && pos0 + i >= win ? pos0 + i - win + 1 - k0 : 0;
      dst[r] = (char *)a->out + ((r0 + i) * num_heads + h * GROUP + g) * HEAD_SIZE * es;
    }

  /* Scores, key block by key block; a row's scores past its last key are not used. */
  const float *krows[KB];
  for (int64_t kb = 0; kb < nmax; kb += KB) {
    const int n = nmax - kb < KB ? (int)(nmax - kb) : KB;
    /* keys two blocks ahead into L1, this block's values into L2 for the second pass */
    PREFETCH_ROWS(a->k_cache, es, off, kb + 2 * KB, nmax < kb + 3 * KB ? nmax : kb + 3 * KB, 3);
    PREFETCH_ROWS(a->v_cache, es, off, kb, kb + n, 2);
    key_block(a->k_cache, a->dtype, off + kb, n, kbuf, krows);
    int r = kb > base ? (int)(kb - base) * GROUP : 0;
#if defined(BG_AVX512)
    for (; r < rows; ++r) _mm512_storeu_ps(scores + r * ss + kb, scores16(q + r * HSP, krows));
#elif defined(BG_AVX2)
    for (; r < rows; ++r) {
      _mm256_storeu_ps(scores + r * ss + kb, scores8(q + r * HSP, krows, 0));
      if (n > 8) _mm256_storeu_ps(scores + r * ss + kb + 8, scores8(q + r * HSP, krows, 8));
    }
#else
    for (; r < rows; ++r)
      for (int j = 0; j < n; ++j) scores[r * ss + kb + j] = dot_head(q + r * HSP, krows[j]);
#endif
  }
  for (int r = 0; r < rows; ++r) {
    float *restrict sr = scores + r * ss;
    const int64_t f = first[r];
    if (a->softcap > 0.f) soft_cap_row(sr + f, lim[r] + 1 - f, a->softcap);
    inv[r] = 1.f / softmax_row(sr + f, lim[r] + 1 - f);
    for (int64_t p = 0; p < f; ++p) sr[p] = 0.f; /* keys before the row's window */
  }

  /* acc_r = sum_p e_rp v_p, in order of p. */
#if defined(BG_AVX512)
  const PvJob job = {a->v_cache, a->dtype, ss, off, scores, lim, inv, dst, vbuf};
  pv(&job, rows);
#elif defined(BG_AVX2)
  PvJob job = {a->v_cache, a->dtype, ss, off, scores, lim, inv, dst,
               scores + (int64_t)ROWS * ss + (int64_t)ROWS * HSP, scores + (int64_t)ROWS * ss, 0, 0, 0, 0};
  pv(&job, rows, nmax);
#else
  float *restrict acc = scores + (int64_t)ROWS * ss; /* [rows][HSP] */
  for (int64_t j = 0; j < (int64_t)rows * HSP; ++j) acc[j] = 0.f;
  const float *vrows[KB];
  for (int64_t kb = 0; kb < nmax; kb += KB) {
    const int n = nmax - kb < KB ? (int)(nmax - kb) : KB;
    key_block(a->v_cache, a->dtype, off + kb, n, vbuf, vrows);
    for (int j = 0; j < n; ++j) {
      const int64_t p = kb + j;
      const float *vp = vrows[j];
      for (int r = p > base ? (int)(p - base) * GROUP : 0; r < rows; ++r) {
        const float w = scores[r * ss + p];
        float *ar = acc + r * HSP;
        for (int d = 0; d < HEAD_SIZE; ++d) ar[d] = MADD(w, vp[d], ar[d]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) store_row(dst[r], a->dtype, acc + r * HSP, inv[r]);
#endif
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
    const int64_t t = tile_of(a->context_lens[s]);
    const int64_t tile = (q_len + t - 1) / t - 1 - k / a->num_kv_heads, h = k % a->num_kv_heads;
    const int64_t r0 = q0 + tile * t;
    const int nq = (int)(q_len - tile * t < t ? q_len - tile * t : t);
    if (attend(a, s, h, r0, nq) != 0) a->failed = 1;
  }
}

/* The calling thread's item table, kept between calls. */
static __thread int64_t *tls_items;
static __thread int64_t tls_items_cap;

int batchgen_paged_attention(
    void *out, const void *query, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *context_lens,
    int64_t num_seqs, int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
    int64_t max_blocks, int64_t q_stride_tok, int64_t q_stride_head, float scale,
    int64_t num_blocks, int dtype, int64_t window, float softcap) {
  if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return 5;
  if (window < 0 || !(softcap >= 0.f)) return 6;
  if (query_start_loc ? query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens
                      : num_tokens != num_seqs)
    return 3;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = context_lens[s];
    if (ctx < 1 || ctx > max_blocks * block_size) return 1;
    const int64_t q_len = query_start_loc ? (int64_t)query_start_loc[s + 1] - query_start_loc[s] : 1;
    if (q_len < 0 || q_len > ctx) return 3;
    const int32_t *table = block_tables + s * max_blocks;
    /* with a window, the blocks before the first key any row reads are not read either */
    const int64_t lo = window > 0 && ctx - q_len >= window ? ctx - q_len - window + 1 : 0;
    for (int64_t b = lo / block_size; b * block_size < ctx; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return 2;
  }
  if (num_seqs + 1 > tls_items_cap) {
    free(tls_items);
    tls_items_cap = 0;
    tls_items = (int64_t *)malloc((size_t)(num_seqs + 1 + 256) * sizeof(int64_t));
    if (tls_items == NULL) return 4;
    tls_items_cap = num_seqs + 1 + 256;
  }
  int64_t *item_start = tls_items;
  item_start[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start_loc ? query_start_loc[s + 1] - query_start_loc[s] : 1;
    const int64_t t = tile_of(context_lens[s]);
    item_start[s + 1] = item_start[s] + (q_len + t - 1) / t * num_kv_heads;
  }
  Args a = {out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
            item_start, num_seqs, num_kv_heads, block_size, max_blocks, q_stride_tok,
            q_stride_head, scale, dtype, window, softcap, 0};
  bg_parallel_for(item_start[num_seqs], 1, run_items, &a);
  return a.failed ? 4 : 0;
}
