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
 *
 * Files. This file holds the setup (the build's ISA), each format's functions and the table
 * (FORMAT_FNS, FORMATS_LIST), the threads and the exported entry points; the rest is in local
 * headers it includes (in this order, each needing the ones before; c_build.py hashes them into
 * the build's identity): quant_vec.h (vf, vi: the 16 lanes of each build; fp16 -> float32),
 * quant_rows.h (the activations), quant_blocks.h (the plain C decoders, struct panel, each
 * format's scales), quant_dots.h (the integer dot products of each build) and quant_steps.h
 * (each format's step: dot products and epilogue), then quant_pairs.h (the AVX-512 build's steps
 * over two panels at once).
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
#define MC 64  /* rows per item at most (sampling/logprobs.py ROW_BLOCK: the logits chunks) */
#define GRAIN_MACS (64 * 1024)
/* the weight bytes of the units (panels, or pairs) a group of items goes over, row block after
 * row block: about a quarter of a 1-2 MiB L2 */
#define GROUP_BYTES (256 * 1024)

#define AI __attribute__((always_inline)) /* the steps (quant_steps.h) and FORMAT_FNS below */

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

#include "quant_vec.h"    /* vf, vi: 16 lanes in each build; fp16 -> float32 */
#include "quant_rows.h"   /* the activations: quantize_rows, pair_sums */
#include "quant_blocks.h" /* a block decoded: the plain C decoders, struct panel, the scales */
#include "quant_lookup.h" /* a row's raw blocks de-quantized: dequant_<name> */
#include "quant_dots.h"   /* the integer dot products of each build; MR, BG_DIRECT */
#include "quant_steps.h"  /* each format's step: its dot products and epilogue */
#include "quant_pairs.h"  /* the AVX-512 build's steps over two panels at once */

/* ---- each format's functions, and the table -----------------------------------------------
 * FORMATS_LIST holds one row per block type: its GGML type id (gguf.GGMLQuantizationType), its
 * name, weights and bytes per block, units (sub-blocks whose integer sums are scaled apart: 1,
 * 8 or 16), zsh (its quants' zero point is 1 << zsh: u = w + (1 << zsh); 0 for none, the formats
 * with a min), pair (1: the AVX-512 build tiles two panels at once, quant_pairs.h's step2_<name>;
 * chosen by measurement, see there), and its decode, scales (quant_blocks.h) and step
 * (quant_steps.h) functions; dequant_<name> (quant_lookup.h) is found by the row's name.
 * FORMAT_FNS makes of a row two functions over one panel (src: its packed bytes) and `rows`
 * rows of x (q, xd, xs at the first), each in ONE pass over the panel, block by block: the block's bytes PREFETCH_AHEAD
 * further on are asked for (the rest of this panel, then the next: panels lie one after the
 * other), its scales decoded once (and in the plain C build its quants) into a one-block
 * scratch that stays in L1, then the step for every row, each output's acc over b = 0, 1, ...
 * in order (so the same bits whatever the rows, the function or the build):
 *   gemv_<name>: at most GEMV_ROWS rows, acc in registers (batch 1-4: bound by the memory);
 *   rows_<name>: at most MC rows, MR a tile (then the rest), acc in an L1 array: each block's
 *     scales decoded once for all rows, its quants once per tile. */
#include "quant_tiles.h"       /* FORMAT_FNS: a format's loops over one panel */

#define FORMATS_LIST(X)                                                   \
  X(2, q4_0, 32, 18, 1, 3, 1, decode_q4_0, scales_d, step_q4_0)              \
  X(3, q4_1, 32, 20, 1, 0, 0, decode_q4_1, scales_dm, step_q4_1)             \
  X(6, q5_0, 32, 22, 1, 4, 0, decode_q5_0, scales_d, step_q5_0)              \
  X(8, q8_0, 32, 34, 1, 7, 1, decode_q8_0, scales_d, step_q8_0)              \
  X(12, q4_k, 256, 144, 8, 0, 0, decode_q4_k, scales_k, step_q4_k)           \
  X(13, q5_k, 256, 176, 8, 0, 0, decode_q5_k, scales_k, step_q5_k)           \
  X(14, q6_k, 256, 210, 16, 5, 0, decode_q6_k, scales_q6_k, step_q6_k)
FORMATS_LIST(FORMAT_FNS)

#include "quant_pair_tiles.h"  /* pair_<name>: the AVX-512 build's loops over two panels */

struct format {
  int qtype, bk, bytes, units, zsh; /* the row's numbers */
  rows_fn *gemv;               /* this build's panel against at most GEMV_ROWS rows */
  rows_fn *rows;               /* ... against at most MC rows */
  pair_fn *pair;               /* ... on two panels at once, or NULL (the builds without AVX-512) */
  dequant_fn *dequant;         /* a raw block to float32 (quant_lookup.h) */
};
#define FORMAT_ROW(ID, name, BK, BYTES, UNITS, ZSH, PAIR, ...) \
  {ID, BK, BYTES, UNITS, ZSH, gemv_##name, rows_##name, PAIR_OF(name, PAIR), dequant_##name},
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
  int pairs; /* items over pairs of panels (pair_<name>) */
  const int8_t *q;   /* [m][ldq] (q_stride) */
  int64_t ldq;
  const float *xd;   /* k / bk a row, in groups of RG rows (rg_at; of m rows up to GEMV_ROWS) */
  const int32_t *xs; /* k / 16 a row, likewise */
  const uint8_t *packed;
  const float *bias;
  float *y;
  int64_t ldy;
  int64_t panel_units; /* what an item takes of the weight: panels, or pairs of them */
  int64_t group; /* panel units a group of items (run_items) */
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

/* Ask for the item's output lines for writing (prefetchw) before its dot products: stored
 * after them, a row block's 64 lines missed at once (y is rows x n floats, past the caches at
 * prefill sizes) and the stores waited on their reads */
static inline void prefetch_out(const struct job *J, int64_t p, int64_t r0, int64_t rows, int two) {
  for (int64_t r = 0; r < rows; r++) {
    float *yr = J->y + (r0 + r) * J->ldy + p * NR;
    __builtin_prefetch(yr, 1, 3);
    if (two) __builtin_prefetch(yr + NR, 1, 3);
  }
}

/* Items (row block of up to MC rows, panel), in groups of panels (below); where
 * the build has pair_<name>, (row block, pair of panels 2i and 2i + 1), the last panel of an
 * odd count alone. Which function an output goes through changes none of its bits. */
static void run_items(void *ctx, int64_t begin, int64_t end) {
  const struct job *J = (const struct job *)ctx;
  const int64_t k = J->k, ldq = J->ldq, nb = J->nb, pbytes = nb * NR * J->f->bytes;
  const int pairs = J->pairs;
  float out[MC * NR] __attribute__((aligned(64))), out1[MC * NR] __attribute__((aligned(64)));
  const int64_t units = J->panel_units, group = J->group;
  for (int64_t item = begin; item < end; item++) {
    /* `group` units a group; in a group, row block after row block, each over the group's
     * units: their weights stay in L2 while a row block's activations are read once for all
     * of them from L1 (a panel's row blocks one after the other read every row's activations
     * again for each panel, from L2 or L3) */
    const int64_t g = item / (J->nrb * group), in = item % (J->nrb * group);
    const int64_t gu = units - g * group < group ? units - g * group : group;
    int64_t p = (g * group + in % gu) << pairs, rb = in / gu;
    int64_t r0 = rb * MC, rows = J->m - r0 < MC ? J->m - r0 : MC;
    const float *xd = J->xd + rg_at(r0, 0, nb);
    const int32_t *xs = J->xs + rg_at(r0, 0, k / 16);
    const int two = pairs && p + 1 < J->npanels;
    prefetch_out(J, p, r0, rows, two);
    if (two) {
      J->f->pair(rows, J->packed + p * pbytes, J->packed + (p + 1) * pbytes, nb, J->q + r0 * ldq, ldq, xd, xs, out, out1);
      store_out(J, p + 1, r0, rows, out1);
    } else {
      J->f->rows(rows, J->packed + p * pbytes, nb, J->q + r0 * ldq, ldq, xd, xs, out);
    }
    store_out(J, p, r0, rows, out);
  }
}

/* m <= GEMV_ROWS: every row at once, panel after panel, in one pass (no scratch). */
static void run_gemv(void *ctx, int64_t begin, int64_t end) {
  const struct job *J = (const struct job *)ctx;
  const int64_t nb = J->nb;
  float out[GEMV_ROWS * NR] __attribute__((aligned(64)));
  for (int64_t p = begin; p < end; p++) {
    J->f->gemv(J->m, J->packed + p * nb * NR * J->f->bytes, nb, J->q, J->ldq, J->xd, J->xs, out);
    store_out(J, p, 0, J->m, out);
  }
}

struct qjob {
  const float *x;
  int64_t ldx, k;
  int bk, units, zsh;
  int64_t g; /* rows a group of d and s (grp_at) */
  int8_t *q;
  int64_t ldq;
  float *d;
  int32_t *s;
};


static void run_quantize(void *ctx, int64_t begin, int64_t end) {
  const struct qjob *Q = (const struct qjob *)ctx;
  quantize_rows(Q->x, Q->ldx, Q->k, Q->bk, begin, end, Q->q, Q->ldq, Q->d, Q->s, Q->g);
  pair_sums(Q->k, Q->bk, Q->units, Q->zsh, Q->g, begin, end, Q->d, Q->s);
}

struct lookup {
  const struct format *f;
  const uint8_t *packed;
  const int32_t *inverse;
  const int64_t *idx;
  int64_t nb, k;
  float *y;
};

static void run_lookup(void *ctx, int64_t begin, int64_t end) {
  const struct lookup *L = (const struct lookup *)ctx;
  const int bytes = L->f->bytes;
  uint8_t raw[256]; /* one raw block: the largest, Q6_K's, is 210 bytes */
  for (int64_t i = begin; i < end; i++) {
    const int64_t r = L->idx[i];
    const int32_t *at = L->inverse + (r % NR) * bytes;
    const uint8_t *panel = L->packed + (r / NR) * L->nb * NR * bytes;
    for (int64_t b = 0; b < L->nb; b++) {
      const uint8_t *blk = panel + b * NR * bytes;
      for (int t = 0; t < bytes; t++) raw[t] = blk[at[t]];
      L->f->dequant(raw, L->y + i * L->k + b * L->f->bk);
    }
  }
}

/* y [n][k] = rows idx[0 .. n) of a packed weight of `qtype` (n_rows rows of k values),
 * de-quantized (quant_lookup.h). inverse [NR][bytes]: where byte t of column c's raw block sits
 * in a panel's block (quant_panels.py's inverse_int32). Returns 0, -2 (unknown type), -3 (k not
 * whole blocks), -4 (an index outside [0, n_rows); nothing written). */
int batchgen_quant_lookup(const uint8_t *packed, int qtype, int64_t n_rows, int64_t k, const int32_t *inverse,
                          const int64_t *idx, int64_t n, float *y) {
  const struct format *f = format_of(qtype);
  if (!f) return -2;
  if (k <= 0 || k % f->bk) return -3;
  for (int64_t i = 0; i < n; i++)
    if (idx[i] < 0 || idx[i] >= n_rows) return -4;
  struct lookup L = {f, packed, inverse, idx, k / f->bk, k, y};
  bg_parallel_for(n, 16384 / k + 1, run_lookup, &L);
  return 0;
}

/* For the tests: the activation quantization alone. */
void batchgen_quant_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int bk, int8_t *q, float *d,
                         int32_t *s16) {
  quantize_rows(x, ldx, k, bk, 0, m, q, k, d, s16, 1);
}

/* The row stride of the quantized activations q: k rounded up to whole cache lines, an odd
 * number of them. A tile's MR rows are read side by side (one 4-byte broadcast per row and
 * group), and at a stride of a multiple of 2048 bytes (k = 2048, 4096, 8192: the 1B model's
 * hidden and MLP sizes) they share L1 sets: on the Zen 5, a loop of vpdpbusd with such
 * broadcasts ran at 4.3 (2048) and 2.0 (8192) a ns against 7.4-7.6 at an odd number of lines
 * (2112, 8256; 1 thread, bench's microbenchmark). The padding is never read. */
static int64_t q_stride(int64_t k) {
  const int64_t lines = (k + 63) / 64;
  return 64 * (lines % 2 ? lines : lines + 1);
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
  const int64_t g = m <= GEMV_ROWS ? m : RG, mg = (m + g - 1) / g * g; /* d and s in whole groups */
  const int64_t ldq = q_stride(k);
  int8_t *q = (int8_t *)malloc((size_t)(m * ldq));
  float *d = (float *)malloc((size_t)(mg * nb) * sizeof(float));
  int32_t *s = (int32_t *)malloc((size_t)(mg * (k / 16)) * sizeof(int32_t));
  if (!q || !d || !s) {
    free(q);
    free(d);
    free(s);
    return -1;
  }
  struct qjob qj = {x, ldx, k, f->bk, f->units, f->zsh, g, q, ldq, d, s};
  int64_t qgrain = (64 * 1024) / k + 1;
  bg_parallel_for(m, qgrain, run_quantize, &qj);

  struct job J = {f, m, k, n, nb, (n + NR - 1) / NR, (m + MC - 1) / MC, 0, q, ldq, d, s, packed, bias, y, ldy};
  /* pairs of panels only past one row block: up to MC rows the panels stream from memory once,
   * and two streams a thread measured slower (Q8_0 at 32 rows, 1 thread: -11 %); past it a
   * panel's later row blocks read it from the caches (+4-11 % at 128-512 rows) */
  const int pairs = J.pairs = f->pair != NULL && m > MC;
  const int64_t unit_bytes = (int64_t)nb * NR * f->bytes << pairs;
  J.panel_units = pairs ? (J.npanels + 1) / 2 : J.npanels;
  J.group = GROUP_BYTES / unit_bytes > 1 ? GROUP_BYTES / unit_bytes : 1;
  int64_t items = J.panel_units * J.nrb;
  int64_t macs_per_item = (m < MC ? m : MC) * (pairs ? 2 * NR : NR) * k;
  int64_t grain = GRAIN_MACS / (macs_per_item > 0 ? macs_per_item : 1);
  bg_parallel_for(items, grain < 1 ? 1 : grain, m <= GEMV_ROWS ? run_gemv : run_items, &J);
  free(q);
  free(d);
  free(s);
  return 0;
}
