/* batchgen: the vectorisable float exp shared by the CPU kernels (included, not built alone).
 *
 * exp(c) for c already clamped to [-87.33, 88.72], in plain arithmetic so that loops over it
 * vectorise: c = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf
 * coefficients), then 2^n as two factors 2^(n/2) 2^(n - n/2) built in the exponent bits (n
 * reaches 128 just below the overflow; each factor stays a normal float). Relative error about
 * 2e-7. NaN in, NaN out, with no undefined behaviour on the way (UBSan-checked by the tests).
 * Never built with -ffast-math (see c_build.py).
 */
#ifndef BATCHGEN_CPU_EXP_H
#define BATCHGEN_CPU_EXP_H
#include <stdint.h>
#include <string.h>

/* The constants of every width's exp below (the same operations on 1, 8 or 16 lanes give the
 * same bits): log2(e), ln 2 split in a high part exact in few bits and a low part, and Cephes'
 * polynomial for exp(r), highest degree first. */
#define BG_EXP_LOG2E 1.44269504088896341f
#define BG_EXP_LN2_HI 0.693359375f
#define BG_EXP_LN2_LO 2.12194440e-4f
#define BG_EXP_P0 1.9875691500e-4f
#define BG_EXP_P1 1.3981999507e-3f
#define BG_EXP_P2 8.3334519073e-3f
#define BG_EXP_P3 4.1665795894e-2f
#define BG_EXP_P4 1.6666665459e-1f
#define BG_EXP_P5 5.0000001201e-1f

static inline float batchgen_exp_clamped(float c) {
  /* round to nearest by adding and subtracting 1.5 * 2^23 */
  const float n = (c * BG_EXP_LOG2E + 12582912.0f) - 12582912.0f;
  const float r = (c - n * BG_EXP_LN2_HI) + n * BG_EXP_LN2_LO;
  float p = BG_EXP_P0;
  p = p * r + BG_EXP_P1;
  p = p * r + BG_EXP_P2;
  p = p * r + BG_EXP_P3;
  p = p * r + BG_EXP_P4;
  p = p * r + BG_EXP_P5;
  p = p * r * r + r + 1.0f;
  /* A NaN c (which the callers' clamps let through) gives a NaN p, hence a NaN result; its n
   * must still convert to an integer without undefined behaviour, and so must anything
   * outside the clamp: n is brought into [-126, 128] first (a no-op for clamped input), and
   * the exponent bits are shifted as unsigned. */
  const float nc = n >= -126.0f ? (n <= 128.0f ? n : 128.0f) : -126.0f; /* NaN -> -126 */
  const int32_t ni = (int32_t)nc, n1 = ni / 2, n2 = ni - n1;
  const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, sizeof s1);
  memcpy(&s2, &b2, sizeof s2);
  return p * s1 * s2;
}

/* The steps between n and 2^n, r = c - n ln2 (ln 2 in two parts) and p = exp(r) by the
 * polynomial, on a vector type T through its intrinsics (set1, add, sub, mul): the operations of
 * batchgen_exp_clamped above in the same order, so that every vector width's exp (the AVX-512
 * form below, the AVX2 softmax's in paged_attention_avx2.h) gives its bits. */
#define BG_EXP_POLY(T, set1, add, sub, mul, c, n, p)                                      \
  do {                                                                                    \
    const T r_ = add(sub(c, mul(n, set1(BG_EXP_LN2_HI))), mul(n, set1(BG_EXP_LN2_LO)));   \
    p = set1(BG_EXP_P0);                                                                  \
    p = add(mul(p, r_), set1(BG_EXP_P1));                                                 \
    p = add(mul(p, r_), set1(BG_EXP_P2));                                                 \
    p = add(mul(p, r_), set1(BG_EXP_P3));                                                 \
    p = add(mul(p, r_), set1(BG_EXP_P4));                                                 \
    p = add(mul(p, r_), set1(BG_EXP_P5));                                                 \
    p = add(add(mul(mul(p, r_), r_), r_), set1(1.0f));                                    \
  } while (0)

#if defined(__AVX512F__)
#include <immintrin.h>

/* batchgen_exp_clamped above on 16 lanes (AVX-512 builds), with the same bits (no contraction:
 * see the top); NaN in, NaN out, nothing undefined. Two of its steps take one AVX-512 instruction
 * each, with the same results: n, rounded to nearest even by adding and subtracting 1.5 * 2^23
 * there, by vrndscaleps (exact for |n| < 2^22, and the inputs are clamped far inside); and
 * p * 2^n1 * 2^n2 (n1 + n2 = nc, built in the exponent bits) by vscalefps(p, nc): the first
 * product there is exact (p is near 1, |n1| <= 64), so both round p * 2^nc once, to the
 * same float, subnormal or infinite included. On the Zen 4 the softmax's exps were 12 % of a
 * 2,048-token prefill's attention; the greedy pick's logsumexp (fused.c) takes them too. */
static inline __m512 batchgen_exp16_clamped(__m512 c) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(BG_EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p;
  BG_EXP_POLY(__m512, _mm512_set1_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, c, n, p);
  /* nc = n >= -126 ? (n <= 128 ? n : 128) : -126, NaN -> -126 (vmaxps returns its second
   * operand where either is NaN) */
  const __m512 nc = _mm512_min_ps(_mm512_max_ps(n, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(128.0f));
  return _mm512_scalef_ps(p, nc);
}
#endif

#endif
