/* bench: what `vdpbf16ps` computes, lane by lane, on this CPU (AVX512-BF16), against the
 * float32 forms another build could emulate it with. docs/kernels.md cites its output.
 *
 *   cc -O2 -march=native -o /tmp/bf16_dot_semantics bench/bf16_dot_semantics.c && /tmp/bf16_dot_semantics
 *
 * 1. 200,000 calls x 16 lanes of random normal values (exponents 2^-27 .. 2^22, random signs):
 *    how many lanes equal (acc + a1 b1) + a0 b0 (the odd pair first, each add rounded to
 *    nearest even: Intel's pseudo-code), the even pair first, one rounding of the whole sum, and
 *    the pair summed first. The products of two bfloat16 values are exact in float32.
 * 2. Subnormals: an accumulator or an input that is subnormal, a product or a sum that would be.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint32_t state = 12345;
static uint32_t next(void) { /* xorshift32 */
  state ^= state << 13;
  state ^= state >> 17;
  state ^= state << 5;
  return state;
}
static float bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float widen(uint16_t h) { return bits((uint32_t)h << 16); }
static uint16_t random_bf16(void) { return (uint16_t)(((next() & 1) << 15) | ((100 + next() % 50) << 7) | (next() & 0x7F)); }
static float random_f32(void) { return bits(((next() & 1) << 31) | ((100 + next() % 50) << 23) | (next() & 0x7FFFFF)); }

__attribute__((target("avx512f,avx512bf16"))) static void dot(const float *acc, const uint16_t *a, const uint16_t *b, float *out) {
  const __m512 r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  _mm512_storeu_ps(out, r);
}

static float dot1(float acc, uint16_t a0, uint16_t b0, uint16_t a1, uint16_t b1) {
  float c[16] = {acc}, o[16];
  uint16_t a[32] = {a0, a1}, b[32] = {b0, b1};
  dot(c, a, b, o);
  return o[0];
}

int main(void) {
  if (!__builtin_cpu_supports("avx512bf16")) {
    puts("no AVX512-BF16 on this CPU");
    return 0;
  }
  long n = 0, odd_first = 0, even_first = 0, one_rounding = 0, pair_first = 0;
  for (int it = 0; it < 200000; ++it) {
    uint16_t a[32], b[32];
    float acc[16], out[16];
    for (int i = 0; i < 32; ++i) a[i] = random_bf16(), b[i] = random_bf16();
    for (int i = 0; i < 16; ++i) acc[i] = random_f32();
    dot(acc, a, b, out);
    for (int l = 0; l < 16; ++l) {
      const float p0 = widen(a[2 * l]) * widen(b[2 * l]), p1 = widen(a[2 * l + 1]) * widen(b[2 * l + 1]);
      const float forms[4] = {(acc[l] + p1) + p0, (acc[l] + p0) + p1,
                              (float)((double)acc[l] + (double)p0 + (double)p1), acc[l] + (p0 + p1)};
      ++n;
      odd_first += of(forms[0]) == of(out[l]);
      even_first += of(forms[1]) == of(out[l]);
      one_rounding += of(forms[2]) == of(out[l]);
      pair_first += of(forms[3]) == of(out[l]);
    }
  }
  printf("lanes %ld: odd pair first %ld, even pair first %ld, one rounding %ld, pair summed first %ld\n",
         n, odd_first, even_first, one_rounding, pair_first);
  printf("subnormal accumulator 0x00000100 + 0        -> %08x\n", of(dot1(bits(0x100), 0, 0, 0, 0)));
  printf("subnormal input 0x0040 x 2^100               -> %08x\n", of(dot1(0.f, 0x0040, 0x7180, 0, 0)));
  printf("product 2^-70 x 2^-70 = 2^-140 (subnormal)   -> %08x\n", of(dot1(0.f, 0x1C80, 0x1C80, 0, 0)));
  printf("sum 1.5 x 2^-126 - 2^-126 = 2^-127 (subnormal) -> %08x\n", of(dot1(bits(0x00C00000), 0x8080, 0x3F80, 0, 0)));
  return 0;
}
