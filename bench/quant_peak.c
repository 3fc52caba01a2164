/* bench: the machine's integer and float ceilings, as tight loops of independent chains with
 * no memory traffic (built and run by bench/quant_kernel.py). Each function runs `iters`
 * iterations and returns a value that depends on every chain, so nothing is optimised away.
 *
 *   vnni512:  12 chains of vpdpbusd zmm            (64 u8 x s8 products per instruction)
 *   maddubs:  12 chains of vpmaddubsw + vpaddw ymm (32 products per vpmaddubsw: the inner loop of
 *             quant.c's AVX2 path for 4-bit weights, whose int16 sums are widened once a block)
 *   fma512 / fma256: 12 chains of vfmadd231ps zmm / ymm (16 / 8 float32 multiply-adds)
 *   bf16dot512: 12 chains of vdpbf16ps zmm (32 bfloat16 products summed into 16 float32 lanes,
 *             AVX512-BF16: the ceiling an attention in bfloat16 dot products would have)
 */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t bench_vnni512(int64_t iters, int seed) {
  __m512i w = _mm512_set1_epi8((char)(seed | 1)), x = _mm512_set1_epi8(3);
#define INIT(i) __m512i a##i = _mm512_set1_epi32(i + seed);
  CHAINS(INIT)
#undef INIT
  for (int64_t it = 0; it < iters; it++) {
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
    CHAINS(STEP)
#undef STEP
    __asm__ volatile("" : "+v"(w), "+v"(x));
  }
  __m512i s = _mm512_setzero_si512();
#define SUM(i) s = _mm512_add_epi32(s, a##i);
  CHAINS(SUM)
#undef SUM
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2"))) int64_t bench_maddubs(int64_t iters, int seed) {
  __m256i w = _mm256_set1_epi8((char)(seed & 7)), x = _mm256_set1_epi8(1);
#define INIT(i) __m256i a##i = _mm256_set1_epi16((short)(i + seed));
  CHAINS(INIT)
#undef INIT
  for (int64_t it = 0; it < iters; it++) {
    /* the barrier after each step makes w a new value to the compiler: without it the 12
     * chains' vpmaddubsw(w, x), all alike, were folded into one (a vpaddw loop, not a ceiling) */
#define STEP(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(w, x)); __asm__ volatile("" : "+x"(w));
    CHAINS(STEP)
#undef STEP
    __asm__ volatile("" : "+x"(w), "+x"(x));
  }
  __m256i s = _mm256_setzero_si256();
#define SUM(i) s = _mm256_add_epi16(s, a##i);
  CHAINS(SUM)
#undef SUM
  return _mm256_extract_epi16(s, 0) + _mm256_extract_epi16(s, 15);
}

/* the 512-bit float loops: 12 chains a_i = STEP(a_i, w, x), then their sum (w, x in scope) */
#define F512_INIT(i) __m512 a##i = _mm512_set1_ps((float)(i + seed));
#define F512_SUM(i) s = _mm512_add_ps(s, a##i);
#define F512_LOOP(STEP)                         \
  CHAINS(F512_INIT)                             \
  for (int64_t it = 0; it < iters; it++) {      \
    CHAINS(STEP)                                \
    __asm__ volatile("" : "+v"(w), "+v"(x));    \
  }                                             \
  __m512 s = _mm512_setzero_ps();               \
  CHAINS(F512_SUM)                              \
  return (int64_t)_mm512_reduce_add_ps(s);

#define FMA512_STEP(i) a##i = _mm512_fmadd_ps(a##i, w, x);
__attribute__((target("avx512f"))) int64_t bench_fma512(int64_t iters, int seed) {
  __m512 w = _mm512_set1_ps(0.999f), x = _mm512_set1_ps(1e-3f);
  F512_LOOP(FMA512_STEP)
}

__attribute__((target("avx2,fma"))) int64_t bench_fma256(int64_t iters, int seed) {
  __m256 w = _mm256_set1_ps(0.999f), x = _mm256_set1_ps(1e-3f);
#define INIT(i) __m256 a##i = _mm256_set1_ps((float)(i + seed));
  CHAINS(INIT)
#undef INIT
  for (int64_t it = 0; it < iters; it++) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, w, x);
    CHAINS(STEP)
#undef STEP
    __asm__ volatile("" : "+x"(w), "+x"(x));
  }
  __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, a##i);
  CHAINS(SUM)
#undef SUM
  float t[8];
  _mm256_storeu_ps(t, s);
  return (int64_t)(t[0] + t[7]);
}

#define BF16DOT512_STEP(i) a##i = _mm512_dpbf16_ps(a##i, w, x);
__attribute__((target("avx512f,avx512bf16"))) int64_t bench_bf16dot512(int64_t iters, int seed) {
  __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f7f), x = (__m512bh)_mm512_set1_epi16(0x3a83); /* 0.996, 1e-3 */
  F512_LOOP(BF16DOT512_STEP)
}
