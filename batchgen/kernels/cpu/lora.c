/* batchgen: LoRA deltas on the CPU, one adapter per row, batched (float32).
 *
 * For each row r of x whose slot s = row_slot[r] is >= 0:
 *   shrink: t[i] = dot(x[r, :], A_s[i, :])                 for i < rank[s]
 *   expand: y[r, c0 + j] += scale_p * sum_i t[r0 + i] * B_p[i, j]
 * for each part p = (r0, r1, c0, c1) of slot s (a merged q/k/v or gate/up layer has one part
 * per projection: its rank range in the stacked A_s and its column range in y), with
 * B_p [r1 - r0, c1 - c0] the part's lora_B transposed, stored after the previous parts' in b[s].
 *
 * Row invariance (the needle rule): every output is computed from its own row and its own
 * adapter's weights only, in an order fixed by the shapes (the dot products in 16 lanes over
 * the input features, then the lanes summed as a fixed tree; the expand sums over the rank in
 * order), so a row's delta does not depend on which rows or adapters share the call, nor on
 * the thread count (threads split the rows). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pool.h"

#define LANES 16
#define COLS 64
#define MAX_RANK 4096

struct lora_args {
  const float *x;
  int64_t ldx;
  float *y;
  int64_t ldy;
  int64_t in;
  const int32_t *row_slot;
  const int64_t *a;      /* per slot: the address of A_s [rank, in], or 0 */
  const int64_t *b;      /* per slot: the address of its parts' B_p, one after the other */
  const int32_t *rank;   /* per slot */
  const int32_t *parts;  /* per slot, per part: r0, r1, c0, c1 */
  const float *scales;   /* per slot, per part */
  int32_t num_parts;
};

/* Rows are computed TILE at a time when they share an adapter (each row's adapter weights are
 * then read once per tile, not once per row); every row's sums run in the same order whatever
 * its tile, so a tile changes no bit. A tile of fewer rows repeats its last row. */
#define TILE 4

/* The 16 lanes summed as a tree (lane j with j + 8, then + 4, + 2, + 1): the same order in
 * every build, and a chain of 4 additions rather than 16. */
static inline float lane_sum(float *v) {
  for (int half = LANES / 2; half > 0; half /= 2)
    for (int j = 0; j < half; j++) v[j] = v[j] + v[j + half];
  return v[0];
}

/* The products are fused multiply-adds (fmaf, or the same instruction on 16 lanes), so the
 * AVX-512 code and the plain C give the same bits. */
static void shrink(const float *const *x, const float *a, int64_t n, float *const *out) {
  float lanes[TILE][LANES];
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 acc[TILE];
  for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
  for (; k + LANES <= n; k += LANES) {
    const __m512 av = _mm512_loadu_ps(a + k);
    for (int r = 0; r < TILE; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + k), av, acc[r]);
  }
  for (int r = 0; r < TILE; r++) _mm512_storeu_ps(lanes[r], acc[r]);
#else
  for (int r = 0; r < TILE; r++)
    for (int j = 0; j < LANES; j++) lanes[r][j] = 0.0f;
  for (; k + LANES <= n; k += LANES)
    for (int r = 0; r < TILE; r++)
      for (int j = 0; j < LANES; j++) lanes[r][j] = fmaf(x[r][k + j], a[k + j], lanes[r][j]);
#endif
  for (int r = 0; r < TILE; r++) {
    float sum = lane_sum(lanes[r]);
    for (int64_t q = k; q < n; q++) sum = fmaf(x[r][q], a[q], sum);
    *out[r] = sum;
  }
}

/* y[r][j] += scale * sum_i t[r][i] * B[i][j] for j < width, i < rp in order. */
static void expand(const float *const *t, const float *bp, int32_t rp, int32_t width, float scale,
                   float *const *y, int nrows) {
  int32_t c = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(scale);
  for (; c + COLS <= width; c += COLS) {
    __m512 acc[TILE][4];
    for (int r = 0; r < TILE; r++)
      for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    for (int32_t i = 0; i < rp; i++) {
      const float *row = bp + (int64_t)i * width + c;
      const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);
      const __m512 b2 = _mm512_loadu_ps(row + 32), b3 = _mm512_loadu_ps(row + 48);
      for (int r = 0; r < TILE; r++) {
        const __m512 ti = _mm512_set1_ps(t[r][i]);
        acc[r][0] = _mm512_fmadd_ps(ti, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(ti, b1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(ti, b2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(ti, b3, acc[r][3]);
      }
    }
    for (int r = 0; r < nrows; r++)
      for (int q = 0; q < 4; q++) {
        float *dst = y[r] + c + 16 * q;
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_mul_ps(acc[r][q], sv)));
      }
  }
#endif
  for (; c < width; c += COLS) {
    int32_t n = width - c < COLS ? width - c : COLS;
    float acc[TILE][COLS];
    for (int r = 0; r < TILE; r++)
      for (int32_t j = 0; j < n; j++) acc[r][j] = 0.0f;
    for (int32_t i = 0; i < rp; i++) {
      const float *row = bp + (int64_t)i * width + c;
      for (int r = 0; r < TILE; r++) {
        const float ti = t[r][i];
        for (int32_t j = 0; j < n; j++) acc[r][j] = fmaf(ti, row[j], acc[r][j]);
      }
    }
    for (int r = 0; r < nrows; r++)
      for (int32_t j = 0; j < n; j++) {
        const float d = acc[r][j] * scale;
        y[r][c + j] = y[r][c + j] + d;
      }
  }
}

/* Rows rows[0..nrows) (nrows <= TILE), all of slot s. */
static void tile(const struct lora_args *g, const int64_t *rows, int nrows, int32_t s) {
  const float *a = (const float *)(intptr_t)g->a[s];
  const float *b = (const float *)(intptr_t)g->b[s];
  const int32_t rank = g->rank[s];
  static __thread float t[TILE][MAX_RANK];
  const float *x[TILE], *tp[TILE];
  float *y[TILE];
  for (int r = 0; r < TILE; r++) {
    int64_t row = rows[r < nrows ? r : nrows - 1];
    x[r] = g->x + row * g->ldx;
    y[r] = g->y + row * g->ldy;
  }
  for (int32_t i = 0; i < rank; i++)
  {
    float *out[TILE] = {&t[0][i], &t[1][i], &t[2][i], &t[3][i]};
    shrink(x, a + (int64_t)i * g->in, g->in, out);
  }
  for (int r = 0; r < TILE; r++) tp[r] = t[r];
  const int32_t *parts = g->parts + (int64_t)s * g->num_parts * 4;
  for (int32_t p = 0; p < g->num_parts; p++) {
    const int32_t r0 = parts[4 * p], r1 = parts[4 * p + 1], c0 = parts[4 * p + 2], c1 = parts[4 * p + 3];
    if (r1 > r0) {
      const float *tr[TILE];
      float *yc[TILE];
      for (int r = 0; r < TILE; r++) tr[r] = tp[r] + r0, yc[r] = y[r] + c0;
      expand(tr, b, r1 - r0, c1 - c0, g->scales[(int64_t)s * g->num_parts + p], yc, nrows);
      b += (int64_t)(r1 - r0) * (c1 - c0);
    }
  }
}

static void rows_task(void *ctx, int64_t begin, int64_t end) {
  const struct lora_args *g = (const struct lora_args *)ctx;
  int64_t pending[TILE];
  int32_t done_upto = -1;
  /* one pass per slot present in [begin, end), its rows TILE at a time */
  for (;;) {
    int32_t s = -1;
    for (int64_t r = begin; r < end; r++) {
      int32_t rs = g->row_slot[r];
      if (rs > done_upto && g->rank[rs] > 0 && (s < 0 || rs < s)) s = rs;
    }
    if (s < 0) return;
    int n = 0;
    for (int64_t r = begin; r < end; r++) {
      if (g->row_slot[r] != s) continue;
      pending[n++] = r;
      if (n == TILE) tile(g, pending, n, s), n = 0;
    }
    if (n) tile(g, pending, n, s);
    done_upto = s;
  }
}

/* Adds each row's delta to y in place. Returns 0, or -1 for a rank above MAX_RANK. */
int batchgen_lora_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t rows, int64_t in,
                      const int32_t *row_slot, const int64_t *a, const int64_t *b, const int32_t *rank,
                      const int32_t *parts, const float *scales, int32_t num_slots, int32_t num_parts,
                      int64_t work_per_row) {
  for (int32_t s = 0; s < num_slots; s++)
    if (rank[s] > MAX_RANK) return -1;
  struct lora_args g = {x, ldx, y, ldy, in, row_slot, a, b, rank, parts, scales, num_parts};
  int64_t grain = work_per_row >= 65536 ? 1 : 65536 / (work_per_row > 0 ? work_per_row : 1);
  bg_parallel_for(rows, grain, rows_task, &g);
  return 0;
}

int batchgen_lora_max_rank(void) { return MAX_RANK; }
