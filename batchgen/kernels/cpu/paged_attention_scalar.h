/* paged_attention.c's per-row arithmetic in plain C (neither AVX-512 nor AVX2).
 *
 * Part of paged_attention.c, which includes it at this point of its source, after its
 * configuration (HEAD_SIZE, GROUP, the ISA macros, the dtype codes): not a header of its own.
 */

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
