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
 * the input features, then the lanes summed in order; the expand sums over the rank in
 * order), so a row's delta does not depend on which rows or adapters share the call, nor on
 * the thread count (threads split the rows). */
#include <stdint.h>
#include <string.h>

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

static float dot(const float *x, const float *a, int64_t n) {
  float acc[LANES];
  for (int j = 0; j < LANES; j++) acc[j] = 0.0f;
  int64_t k = 0;
  for (; k + LANES <= n; k += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += x[k + j] * a[k + j];
  float sum = 0.0f;
  for (int j = 0; j < LANES; j++) sum += acc[j];
  for (; k < n; k++) sum += x[k] * a[k];
  return sum;
}

static void expand(const float *t, const float *bp, int32_t rp, int32_t width, float scale, float *y) {
  for (int32_t c = 0; c < width; c += COLS) {
    int32_t n = width - c < COLS ? width - c : COLS;
    float acc[COLS];
    for (int32_t j = 0; j < n; j++) acc[j] = 0.0f;
    for (int32_t i = 0; i < rp; i++) {
      const float ti = t[i];
      const float *row = bp + (int64_t)i * width + c;
      for (int32_t j = 0; j < n; j++) acc[j] += ti * row[j];
    }
    for (int32_t j = 0; j < n; j++) y[c + j] += acc[j] * scale;
  }
}

static void one_row(const struct lora_args *g, int64_t r) {
  const int32_t s = g->row_slot[r];
  if (s < 0 || g->rank[s] <= 0) return;
  const float *x = g->x + r * g->ldx;
  const float *a = (const float *)(intptr_t)g->a[s];
  const float *b = (const float *)(intptr_t)g->b[s];
  float t[MAX_RANK];
  const int32_t rank = g->rank[s];
  for (int32_t i = 0; i < rank; i++) t[i] = dot(x, a + (int64_t)i * g->in, g->in);
  float *y = g->y + r * g->ldy;
  const int32_t *parts = g->parts + (int64_t)s * g->num_parts * 4;
  for (int32_t p = 0; p < g->num_parts; p++) {
    const int32_t r0 = parts[4 * p], r1 = parts[4 * p + 1], c0 = parts[4 * p + 2], c1 = parts[4 * p + 3];
    if (r1 > r0) {
      expand(t + r0, b, r1 - r0, c1 - c0, g->scales[(int64_t)s * g->num_parts + p], y + c0);
      b += (int64_t)(r1 - r0) * (c1 - c0);
    }
  }
}

static void rows_task(void *ctx, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; r++) one_row((const struct lora_args *)ctx, r);
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
