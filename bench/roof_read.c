/* bench: the machine's read bandwidth, a STREAM-like read of a buffer far larger than the
 * last-level cache (built and run by bench/roofline.py; one call per thread, each on its own
 * slice). Eight independent accumulators of full-width loads, so the loop is bound by the
 * loads, not by the adds; the sum is returned so that nothing is optimised away.
 *
 *   roof_read512: zmm loads (64 bytes each), AVX-512F
 *   roof_read256: ymm loads (32 bytes each), AVX
 *
 * `n` is the number of floats, a multiple of 128 (512 bytes, one unrolled iteration);
 * the slice is read `passes` times.
 */
#include <immintrin.h>
#include <stdint.h>

__attribute__((target("avx512f"))) double roof_read512(const float *p, int64_t n, int passes) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int r = 0; r < passes; r++) {
    for (int64_t i = 0; i < n; i += 128) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
      a4 = _mm512_add_ps(a4, _mm512_loadu_ps(p + i + 64));
      a5 = _mm512_add_ps(a5, _mm512_loadu_ps(p + i + 80));
      a6 = _mm512_add_ps(a6, _mm512_loadu_ps(p + i + 96));
      a7 = _mm512_add_ps(a7, _mm512_loadu_ps(p + i + 112));
    }
  }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return (double)_mm512_reduce_add_ps(s);
}

__attribute__((target("avx"))) double roof_read256(const float *p, int64_t n, int passes) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int r = 0; r < passes; r++) {
    for (int64_t i = 0; i < n; i += 64) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
      a4 = _mm256_add_ps(a4, _mm256_loadu_ps(p + i + 32));
      a5 = _mm256_add_ps(a5, _mm256_loadu_ps(p + i + 40));
      a6 = _mm256_add_ps(a6, _mm256_loadu_ps(p + i + 48));
      a7 = _mm256_add_ps(a7, _mm256_loadu_ps(p + i + 56));
    }
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  float t[8];
  _mm256_storeu_ps(t, s);
  return (double)(t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]);
}
