/* Paged attention for the CPU (decode and prefill), compiled at run time by
 * batchgen.kernels.cpu.
 *
 * Contract: batchgen.kernels.reference.paged_decode_attention and paged_prefill_attention, for
 * float32, bfloat16 and float16 tensors (one dtype for the query and the output, one for the
 * two caches, which may differ: a 16-bit cache under a float32 query; every sum and
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
 * rows of bfloat16 and float16 converted into float32 once per block; with AVX-512 the V rows
 * are widened in the register as P.V reads them instead):
 *   - scores: with AVX-512, the 16 dot products of one query row with a key block run as 16
 *     accumulators side by side; their reduction trees run together as a transpose (each add
 *     of the tree above, for 16 keys per instruction), leaving the 16 scores in one register.
 *     A key block that many rows of a tile read is transposed once instead (keys as lanes):
 *     accumulator l of a row then holds lane l of all 16 dot products, and the tree is 15 adds
 *     of whole registers; 4 rows share each load of the transposed block.
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
 * Key rows are prefetched into L2 two key blocks ahead, and a block's V rows while its scores
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
/* AVX-512: a key block that at least this many of a tile's rows read is transposed once and
 * scored SR rows at a time without shuffles (scores_t); fewer rows, as in every decode, reduce
 * their own trees (scores16). The same bits either way. 16: a long context's tiles (48 rows on
 * SmolLM2); W32's 12-row tiles gained nothing from it. */
#define TRANSPOSE_ROWS 16
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

#include "paged_attention_convert.h" /* element conversions */

/* ---------------------------------------------------------------- work items */
typedef struct {
  void *out;
  const void *query, *k_cache, *v_cache;
  const int32_t *block_tables, *query_start_loc, *context_lens;
  const int64_t *item_start; /* [num_seqs + 1]: first work item of each sequence */
  int64_t num_seqs, num_kv_heads, block_size, max_blocks, q_stride_tok, q_stride_head;
  float scale;
  int dtype;      /* the query's and the output's */
  int kv_dtype;   /* the caches' */
  int64_t window; /* 0: none */
  float softcap;  /* 0: none */
  volatile int failed; /* set by an item that could not get scratch memory */
} Args;

#include "paged_attention_rows.h" /* key blocks, prefetch */

/* ---------------------------------------------------------------- the per-row arithmetic */
#ifdef BG_AVX512
#include "paged_attention_avx512.h"
#elif defined(BG_AVX2)
#include "paged_attention_avx2.h"
#else /* plain C */
#include "paged_attention_scalar.h"
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

/* One item's tile: query rows r0 .. r0 + nq - 1 of sequence s, KV head h, as GROUP rows a
 * token (row r = i * GROUP + g: token r0 + i, query head h * GROUP + g), and its scratch. Key
 * indices count from k0, the first key the tile's first row sees (0 without a window). */
typedef struct {
  int rows;            /* nq * GROUP */
  int64_t base;        /* row 0 sees keys 0 .. base */
  int64_t nmax;        /* keys the tile's last row sees */
  int64_t ss;          /* a row of scores: whole key blocks (and one more with a window) */
  int64_t *off;        /* [ss]: element offset of key p's rows in the caches */
  float *q;            /* [rows][HSP]: the query rows, scaled */
  float *kbuf, *vbuf;  /* [KB][HSP]: a converted key (value) block */
  float *kt;           /* [HSP][KB]: a key block transposed (AVX-512) */
  float *scores;       /* [rows][ss], then acc [rows][HSP] (plain C and AVX2), then AVX2's V segment */
  int64_t lim[ROWS];   /* the last key each row sees */
  int64_t first[ROWS]; /* the first key each row sees */
  float inv[ROWS];     /* 1 / the softmax sum of each row */
  void *dst[ROWS];     /* each row's output */
} Tile;

/* The tile's keys (their offsets through the block table), its query rows (converted and
 * scaled) and each row's first and last key and output; 4 when no scratch could be had. */
static int tile_setup(const Args *a, int64_t s, int64_t h, int64_t r0, int nq, Tile *t) {
  const int64_t ctx = a->context_lens[s];
  const int64_t q0 = a->query_start_loc ? a->query_start_loc[s] : s;
  const int64_t q_len = a->query_start_loc ? a->query_start_loc[s + 1] - q0 : 1;
  const int64_t pos0 = ctx - q_len + (r0 - q0); /* position of row r0 */
  const int64_t win = a->window;
  const int64_t k0 = win > 0 && pos0 >= win ? pos0 - win + 1 : 0;
  t->base = pos0 - k0;
  t->nmax = t->base + nq;
  /* a row's softmax with a window starts at its own first key and reads and writes whole vectors
   * from there: one more key block */
  t->ss = (t->nmax + KB - 1) / KB * KB + (win > 0 ? KB : 0);
  t->rows = nq * GROUP;
  float *buf = scratch(2 * t->ss + (int64_t)ROWS * HSP * 2 + 3 * KB * HSP + (int64_t)ROWS * t->ss + SEG_FLOATS);
  if (buf == NULL) return 4;
  t->off = (int64_t *)buf;
  t->q = buf + 2 * t->ss;
  t->kbuf = t->q + ROWS * HSP;
  t->vbuf = t->kbuf + KB * HSP;
  t->kt = t->vbuf + KB * HSP;
  t->scores = t->kt + KB * HSP;
  const int32_t *table = a->block_tables + s * a->max_blocks;
  const int64_t tok_stride = a->num_kv_heads * HEAD_SIZE, bs = a->block_size;
  for (int64_t p = 0, b = k0 / bs, o = k0 % bs; p < t->nmax; ++b, o = 0) {
    const int64_t at = (int64_t)table[b] * bs * tok_stride + h * HEAD_SIZE;
    for (; o < bs && p < t->nmax; ++o, ++p) t->off[p] = at + o * tok_stride;
  }
  PREFETCH_ROWS(a->k_cache, elem_size(a->kv_dtype), t->off, 0, t->nmax < 2 * KB ? t->nmax : 2 * KB, 3);
  const int64_t num_heads = a->num_kv_heads * GROUP, qs = elem_size(a->dtype);
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < GROUP; ++g) {
      const int r = i * GROUP + g;
      const char *src = (const char *)a->query +
                        ((r0 + i) * a->q_stride_tok + (h * GROUP + g) * a->q_stride_head) * qs;
      float *qr = t->q + r * HSP;
      convert_row(src, a->dtype, qr);
      for (int d = 0; d < HEAD_SIZE; ++d) qr[d] = qr[d] * a->scale;
      t->lim[r] = t->base + i;
      t->first[r] = win > 0 && pos0 + i >= win ? pos0 + i - win + 1 - k0 : 0;
      t->dst[r] = (char *)a->out + ((r0 + i) * num_heads + h * GROUP + g) * HEAD_SIZE * qs;
    }
  return 0;
}

/* Scores, key block by key block; a row's scores past its last key are not used. */
static void tile_scores(const Args *a, Tile *t) {
  const int64_t es = elem_size(a->kv_dtype), nmax = t->nmax, ss = t->ss;
  const float *krows[KB];
  for (int64_t kb = 0; kb < nmax; kb += KB) {
    const int n = nmax - kb < KB ? (int)(nmax - kb) : KB;
    /* keys two blocks ahead and this block's values (for the second pass) into L2: keys asked
     * for into L1 held its miss buffers (on the Zen 4, decode of 256 sequences x 150 keys in
     * float16 1.6x, 64 x 1,000 2x slower than this; the first two blocks still go to L1) */
    PREFETCH_ROWS(a->k_cache, es, t->off, kb + 2 * KB, nmax < kb + 3 * KB ? nmax : kb + 3 * KB, 2);
    PREFETCH_ROWS(a->v_cache, es, t->off, kb, kb + n, 2);
    key_block(a->k_cache, a->kv_dtype, t->off + kb, n, t->kbuf, krows);
    int r = kb > t->base ? (int)(kb - t->base) * GROUP : 0;
    float *sc = t->scores + kb;
#if defined(BG_AVX512)
    if (t->rows - r >= TRANSPOSE_ROWS) {
      transpose_block(krows, t->kt);
      scores_rows_t(t->q, r, t->rows, t->kt, sc, ss);
    } else {
      for (; r < t->rows; ++r) _mm512_storeu_ps(sc + r * ss, scores16(t->q + r * HSP, krows));
    }
#elif defined(BG_AVX2)
    for (; r < t->rows; ++r) {
      _mm256_storeu_ps(sc + r * ss, scores8(t->q + r * HSP, krows, 0));
      if (n > 8) _mm256_storeu_ps(sc + r * ss + 8, scores8(t->q + r * HSP, krows, 8));
    }
#else
    for (; r < t->rows; ++r)
      for (int j = 0; j < n; ++j) sc[r * ss + j] = dot_head(t->q + r * HSP, krows[j]);
#endif
  }
}

/* Each row's scores over its own keys into softmax numerators (the soft cap first), its sum's
 * inverse to inv, and 0 for the keys before its window. */
static void tile_softmax(const Args *a, Tile *t) {
  for (int r = 0; r < t->rows; ++r) {
    float *restrict sr = t->scores + r * t->ss;
    const int64_t f = t->first[r];
    if (a->softcap > 0.f) soft_cap_row(sr + f, t->lim[r] + 1 - f, a->softcap);
    t->inv[r] = 1.f / softmax_row(sr + f, t->lim[r] + 1 - f);
    for (int64_t p = 0; p < f; ++p) sr[p] = 0.f; /* keys before the row's window */
  }
}

/* acc_r = sum_p e_rp v_p, in order of p, times inv_r, to each row's output. */
static void tile_pv(const Args *a, Tile *t) {
#if defined(BG_AVX512)
  const PvJob job = {a->v_cache, a->kv_dtype, a->dtype, t->ss, t->off, t->scores, t->lim, t->inv, t->dst};
  pv(&job, t->rows);
#elif defined(BG_AVX2)
  PvJob job = {a->v_cache, a->kv_dtype, a->dtype, t->ss, t->off, t->scores, t->lim, t->inv, t->dst,
               t->scores + (int64_t)ROWS * t->ss + (int64_t)ROWS * HSP, t->scores + (int64_t)ROWS * t->ss, 0, 0, 0, 0};
  pv(&job, t->rows, t->nmax);
#else
  float *restrict acc = t->scores + (int64_t)ROWS * t->ss; /* [rows][HSP] */
  for (int64_t j = 0; j < (int64_t)t->rows * HSP; ++j) acc[j] = 0.f;
  const float *vrows[KB];
  for (int64_t kb = 0; kb < t->nmax; kb += KB) {
    const int n = t->nmax - kb < KB ? (int)(t->nmax - kb) : KB;
    key_block(a->v_cache, a->kv_dtype, t->off + kb, n, t->vbuf, vrows);
    for (int j = 0; j < n; ++j) {
      const int64_t p = kb + j;
      const float *vp = vrows[j];
      for (int r = p > t->base ? (int)(p - t->base) * GROUP : 0; r < t->rows; ++r) {
        const float w = t->scores[r * t->ss + p];
        float *ar = acc + r * HSP;
        for (int d = 0; d < HEAD_SIZE; ++d) ar[d] = MADD(w, vp[d], ar[d]);
      }
    }
  }
  for (int r = 0; r < t->rows; ++r) store_row(t->dst[r], a->dtype, acc + r * HSP, t->inv[r]);
#endif
}

/* Query rows r0 .. r0 + nq - 1 of sequence s, KV head h: scores, softmax, P.V. */
static int attend(const Args *a, int64_t s, int64_t h, int64_t r0, int nq) {
  Tile t;
  if (tile_setup(a, s, h, r0, nq, &t) != 0) return 4;
  tile_scores(a, &t);
  tile_softmax(a, &t);
  tile_pv(a, &t);
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
    int64_t num_blocks, int dtype, int kv_dtype, int64_t window, float softcap) {
  if (dtype != DT_F32 && dtype != DT_BF16 && dtype != DT_F16) return 5;
  if (kv_dtype != DT_F32 && kv_dtype != DT_BF16 && kv_dtype != DT_F16) return 5;
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
            q_stride_head, scale, dtype, kv_dtype, window, softcap, 0};
  bg_parallel_for(item_start[num_seqs], 1, run_items, &a);
  return a.failed ? 4 : 0;
}
