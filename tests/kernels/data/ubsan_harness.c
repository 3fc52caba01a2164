/* Runs the fused CPU ops and the shared exp on NaN, infinities and extreme values, built with
 * -fsanitize=undefined by tests/kernels/test_cpu_ubsan.py: any undefined behaviour (a NaN
 * converted to an integer, a negative value shifted left...) aborts with UBSan's report. */
#include <math.h>
#include <stdio.h>

#include "fused.c"

int main(void) {
  const float special[] = {NAN, -NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 88.8f, -88.8f,
                           -87.4f, 87.4f, 0.0f, -0.0f, 1e-40f, -1e-40f, 3.0f, -3.0f};
  enum { N = sizeof special / sizeof special[0] };
  float sum = 0.0f;
  for (int i = 0; i < N; i++) sum += batchgen_exp_clamped(special[i]) + exp_f32(special[i]);

  float gu[2 * N], y[N], w[N], x[N];
  for (int i = 0; i < N; i++) {
    gu[i] = special[i];
    gu[N + i] = special[N - 1 - i];
    w[i] = 1.0f;
    x[i] = special[i];
  }
  batchgen_gated_mul_f32(gu, 2 * N, y, N, 1, N, 0);
  batchgen_gated_mul_f32(gu, 2 * N, y, N, 1, N, 1);
  batchgen_rms_norm_f32(x, N, w, y, N, 1, N, 1e-6f);
  int64_t id;
  float top, lse;
  batchgen_greedy_f32(x, N, 1, N, &id, &top, &lse);
  /* RoPE + cache write: one query, one key and one value head of N values; slot 1 of 2 */
  float qkv[3 * N], kc[2 * N], vc[2 * N];
  const int64_t slot = 1, bad_slot = 2;
  for (int i = 0; i < 3 * N; i++) qkv[i] = special[(i * 7) % N];
  int rope_ok = batchgen_rope_cache(qkv, 3 * N, special, N, x, N, kc, vc, &slot, 2, 1, 1, 1, N, 0, 0) == 0;
  rope_ok &= batchgen_rope_cache(qkv, 3 * N, special, N, x, N, kc, vc, &bad_slot, 2, 1, 1, 1, N, 0, 0) == -1;
  if (!rope_ok) return 1;
#if HAVE_16
  uint16_t g16[2 * N], y16[N], w16[N], x16[N];
  for (int i = 0; i < 2 * N; i++) {
    uint32_t bits;
    memcpy(&bits, &gu[i], sizeof bits);
    g16[i] = (uint16_t)(bits >> 16); /* bfloat16: the top half */
  }
  for (int i = 0; i < N; i++) {
    x16[i] = g16[i];
    w16[i] = 0x3f80; /* 1.0 */
  }
  batchgen_gated_mul_16(g16, 2 * N, y16, N, 1, N, BF16, 0);
  batchgen_gated_mul_16(g16, 2 * N, y16, N, 1, N, BF16, 1);
  batchgen_rms_norm_16(x16, N, w16, y16, N, 1, N, 1e-6f, BF16);
  batchgen_gated_mul_16(g16, 2 * N, y16, N, 1, N, F16, 0);
  batchgen_gated_mul_16(g16, 2 * N, y16, N, 1, N, F16, 1);
  /* 16-bit RoPE with a half head of 5 (a tail shorter than a vector): heads of 10 values */
  uint16_t qkv16[30], kc16[20], vc16[20];
  for (int i = 0; i < 30; i++) qkv16[i] = g16[(i * 5) % (2 * N)];
  for (int dtype = BF16; dtype <= F16; dtype++)
    if (batchgen_rope_cache(qkv16, 30, g16, 10, g16 + N, 10, kc16, vc16, &slot, 2, 1, 1, 1, 10, dtype, dtype)) return 1;
#endif
  printf("ok %d\n", isnan(sum) ? 1 : 0);
  return 0;
}
