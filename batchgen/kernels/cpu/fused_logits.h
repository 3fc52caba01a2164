/* batchgen fused.c: the reductions over a row of logits, included by fused.c in place: the
 * greedy pick (batchgen_greedy_f32: first argmax, the row's max and logsumexp) and the prompt
 * logprobs' logsumexp and rank of a target (batchgen_token_logprobs_f32). */
struct greedy_args {
  const float *logits;
  int64_t ld, n;
  int64_t *ids;
  float *maxes, *lse;
};

/* log(sum(exp(row))) of a row whose largest value is the finite top: the exps in float, summed
 * in double (a vocabulary-long float sum would lose ~1e-5 of the total) over RLANES lanes, then
 * the lanes in order. */
static float row_lse(const float *restrict row, int64_t n, float top) {
  double sums[RLANES] = {0}, total = 0.0;
  int64_t k = 0;
  for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
    for (int l = 0; l < RLANES; ++l) sums[l] += (double)exp_f32(row[k + l] - top);
  }
  for (int l = 0; k + l < n; ++l) sums[l] += (double)exp_f32(row[k + l] - top);
  for (int l = 0; l < RLANES; ++l) total += sums[l];
  return (float)((double)top + log(total));
}

static void greedy_rows(void *ctx, int64_t begin, int64_t end) {
  const struct greedy_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict row = a->logits + i * a->ld;
    /* the largest value (NaN never compares larger), then its first index */
    float tops[RLANES], top = -INFINITY;
    for (int l = 0; l < RLANES; ++l) tops[l] = -INFINITY;
    int64_t k = 0;
    for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
      for (int l = 0; l < RLANES; ++l) tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
    }
    for (int l = 0; k + l < n; ++l) tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
    for (int l = 0; l < RLANES; ++l) top = tops[l] > top ? tops[l] : top;
    int64_t arg = 0; /* an all -inf (or NaN) row: 0, like torch.argmax of all -inf */
    for (int64_t k = 0; k < n; ++k) {
      if (row[k] == top) {
        arg = k;
        break;
      }
    }
    a->ids[i] = arg;
    a->maxes[i] = top;
    a->lse[i] = top == -INFINITY || top == INFINITY ? top : row_lse(row, n, top);
  }
}

/* For each row of logits [m, n] (row stride ld): ids[i] = the first index of the row's
 * largest value, maxes[i] = that value, lse[i] = log(sum(exp(row))), within about 2e-7 of
 * the exact value (the exps are float, their sum double). NaN entries are never
 * chosen, but make lse NaN (the caller then falls back); an all -inf row gives max -inf. */
void batchgen_greedy_f32(const float *logits, int64_t ld, int64_t m, int64_t n, int64_t *ids,
                         float *maxes, float *lse) {
  struct greedy_args a = {logits, ld, n, ids, maxes, lse};
  bg_parallel_for(m, row_grain(n), greedy_rows, &a);
}

struct token_args {
  const float *logits;
  int64_t ld, n;
  const int64_t *targets;
  float *lse;
  int64_t *ranks;
};

/* One pass for the largest value and the count of values above the target's, then row_lse. */
static void token_rows(void *ctx, int64_t begin, int64_t end) {
  const struct token_args *a = ctx;
  const int64_t n = a->n;
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict row = a->logits + i * a->ld;
    const float t = row[a->targets[i]];
    float tops[RLANES], top = -INFINITY;
    int32_t above[RLANES] = {0};
    int64_t rank = 1;
    for (int l = 0; l < RLANES; ++l) tops[l] = -INFINITY;
    int64_t k = 0;
    for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
      for (int l = 0; l < RLANES; ++l) {
        tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
        above[l] += row[k + l] > t;
      }
    }
    for (int l = 0; k + l < n; ++l) {
      tops[l] = row[k + l] > tops[l] ? row[k + l] : tops[l];
      above[l] += row[k + l] > t;
    }
    for (int l = 0; l < RLANES; ++l) {
      top = tops[l] > top ? tops[l] : top;
      rank += above[l];
    }
    a->ranks[i] = rank;
    a->lse[i] = top == -INFINITY || top == INFINITY ? top : row_lse(row, n, top);
  }
}

/* For each row of logits [m, n] (row stride ld) and its target index targets[i] (0 <= t < n,
 * checked by the caller): lse[i] = log(sum(exp(row))), the same bits as batchgen_greedy_f32's,
 * and ranks[i] = 1 + the number of entries larger than the target's (vLLM's rank). A row with
 * NaN or infinities gets a lse that is not finite (the caller then falls back). Rows have
 * under 2^31 entries. */
void batchgen_token_logprobs_f32(const float *logits, int64_t ld, int64_t m, int64_t n,
                                 const int64_t *targets, float *lse, int64_t *ranks) {
  struct token_args a = {logits, ld, n, targets, lse, ranks};
  bg_parallel_for(m, row_grain(n), token_rows, &a);
}
