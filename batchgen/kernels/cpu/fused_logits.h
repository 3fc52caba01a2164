/* batchgen fused.c: the reductions over a row of logits, included by fused.c in place: the
 * greedy pick (batchgen_greedy_f32: first argmax, the row's max and logsumexp) and the prompt
 * logprobs' logsumexp and rank of a target (batchgen_token_logprobs_f32). */
#if defined(__AVX512F__) && RLANES == 16
/* row_lse's lanes over the whole vectors of a row (the first n rounded down to 16), written out
 * for AVX-512: exp_f32(x) for x = row - top <= 0 is exp.h's batchgen_exp16_clamped of x (the
 * same bits), 0 below the clamp and x itself for a NaN; lanes 0-7 and 8-15 widened to double
 * and added in the same order. Returns the values taken. GCC's vectorised exp_f32 kept the
 * overflow branches for every lane and reloaded its constants: with this and first_index_of the
 * greedy pick of 32 rows of 49,152 logits went from 0.86-1.15 to 0.54-0.56 ms, the prompt
 * logprobs of 64 rows from 1.42-1.60 to 1.10-1.18 ms (Zen 4, 2 threads, 3 interleaved runs). */
static int64_t row_exp_sums16(const float *restrict row, int64_t n, float top, double *sums) {
  const __m512 vtop = _mm512_set1_ps(top), lo = _mm512_set1_ps(EXP_F32_LO);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(row + k), vtop);
    __m512 e = batchgen_exp16_clamped(_mm512_max_ps(x, lo));
    e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), e); /* x < lo: 0 */
    e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); /* NaN: x */
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  _mm512_storeu_pd(sums, s0);
  _mm512_storeu_pd(sums + 8, s1);
  return k;
}
#endif

/* The first k with row[k] == top, or 0 (an all -inf or NaN row, like torch.argmax of all -inf). */
static int64_t first_index_of(const float *restrict row, int64_t n, float top) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 vtop = _mm512_set1_ps(top);
  for (; k + 16 <= n; k += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + k), vtop, _CMP_EQ_OQ);
    if (eq) return k + __builtin_ctz((unsigned)eq);
  }
#endif
  for (; k < n; ++k)
    if (row[k] == top) return k;
  return 0;
}

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
#if defined(__AVX512F__) && RLANES == 16
  k = row_exp_sums16(row, n, top, sums);
#else
  for (; k + RLANES <= n; k += RLANES) {
#pragma omp simd
    for (int l = 0; l < RLANES; ++l) sums[l] += (double)exp_f32(row[k + l] - top);
  }
#endif
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
    a->ids[i] = first_index_of(row, n, top);
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
