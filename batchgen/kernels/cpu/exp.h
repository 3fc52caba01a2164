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

static inline float batchgen_exp_clamped(float c) {
  /* round to nearest by adding and subtracting 1.5 * 2^23 */
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
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

#endif
