/* batchgen: quant.c's 16 lanes of float32 / int32 (vf, vi: one lane per column of a panel), for
 * each build: AVX-512 (one __m512 / __m512i), AVX2 (two 256-bit halves) and plain C (arrays),
 * and the exact fp16 -> float32 conversion they load scales with (half_to_float, vf_half).
 *
 * Included by quant.c only, first of its quant_*.h (it needs BG_ISA and NR from there); not
 * built alone. quant_rows.h, quant_blocks.h, quant_dots.h and quant_steps.h use these types.
 */
#ifndef BATCHGEN_CPU_QUANT_VEC_H
#define BATCHGEN_CPU_QUANT_VEC_H

/* fp16 bits -> float32, exact (subnormals, infinities and NaN included). */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { /* subnormal: normalise */
    int e = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      e--;
    }
    bits = sign | ((uint32_t)e << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---- 16 lanes of float32 / int32 (one per column of a panel) -------------------------------
 * The epilogue is written once on these; each build implements every op lane by lane with the
 * same IEEE operation (no fused multiply-add), so the builds give the same bits. */
#if BG_ISA == 2
typedef __m512 vf;
typedef __m512i vi;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi a) { _mm512_storeu_si512((void *)p, a); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
#define vi_srl(a, n) _mm512_srli_epi32((a), (n))
#define vi_sll(a, n) _mm512_slli_epi32((a), (n))
#define vi_sra(a, n) _mm512_srai_epi32((a), (n))
/* acc + a.lo * b.lo + a.hi * b.hi, each lane's two signed 16-bit halves (exact: the callers' products
 * and sums fit int32) */
static inline vi vi_dot16(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
/* 16 fp16 values (32 bytes) -> float32, exact */
static inline vf vf_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif BG_ISA == 1
typedef struct { __m256 a, b; } vf;
typedef struct { __m256i a, b; } vi;
static inline vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf vf_add(vf x, vf y) { return (vf){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline vf vf_sub(vf x, vf y) { return (vf){_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline vf vf_mul(vf x, vf y) { return (vf){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline vi vi_load(const int32_t *p) {
  return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))};
}
static inline void vi_store(int32_t *p, vi x) {
  _mm256_storeu_si256((__m256i *)p, x.a);
  _mm256_storeu_si256((__m256i *)(p + 8), x.b);
}
static inline vi vi_zero(void) { return (vi){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi vi_set1(int32_t x) { return (vi){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
static inline vi vi_add(vi x, vi y) { return (vi){_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline vi vi_sub(vi x, vi y) { return (vi){_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
static inline vi vi_mul(vi x, vi y) { return (vi){_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
static inline vf vi_float(vi x) { return (vf){_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline vi vi_and(vi x, vi y) { return (vi){_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
static inline vi vi_or(vi x, vi y) { return (vi){_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
#define vi_srl(x, n) ((vi){_mm256_srli_epi32((x).a, (n)), _mm256_srli_epi32((x).b, (n))})
#define vi_sll(x, n) ((vi){_mm256_slli_epi32((x).a, (n)), _mm256_slli_epi32((x).b, (n))})
#define vi_sra(x, n) ((vi){_mm256_srai_epi32((x).a, (n)), _mm256_srai_epi32((x).b, (n))})
#if BG_AVXVNNI
static inline vi vi_dot16(vi acc, vi x, vi y) {
  return (vi){_mm256_dpwssd_avx_epi32(acc.a, x.a, y.a), _mm256_dpwssd_avx_epi32(acc.b, x.b, y.b)};
}
#else
static inline vi vi_dot16(vi acc, vi x, vi y) {
  return (vi){_mm256_add_epi32(acc.a, _mm256_madd_epi16(x.a, y.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(x.b, y.b))};
}
#endif
#if defined(__F16C__)
static inline vf vf_half(const uint8_t *p) {
  return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
#else
static inline vf vf_half(const uint8_t *p) {
  float t[NR];
  for (int c = 0; c < NR; c++) t[c] = half_to_float(load_u16(p + 2 * c));
  return vf_load(t);
}
#endif
#else
typedef struct { float v[NR]; } vf;
typedef struct { int32_t v[NR]; } vi;
#define LANES(expr) for (int c = 0; c < NR; c++) r.v[c] = (expr)
static inline vf vf_load(const float *p) { vf r; LANES(p[c]); return r; }
static inline void vf_store(float *p, vf x) { for (int c = 0; c < NR; c++) p[c] = x.v[c]; }
static inline vf vf_zero(void) { vf r; LANES(0.0f); return r; }
static inline vf vf_set1(float x) { vf r; LANES(x); return r; }
static inline vf vf_add(vf x, vf y) { vf r; LANES(x.v[c] + y.v[c]); return r; }
static inline vf vf_sub(vf x, vf y) { vf r; LANES(x.v[c] - y.v[c]); return r; }
static inline vf vf_mul(vf x, vf y) { vf r; LANES(x.v[c] * y.v[c]); return r; }
static inline vi vi_load(const int32_t *p) { vi r; LANES(p[c]); return r; }
static inline void vi_store(int32_t *p, vi x) { for (int c = 0; c < NR; c++) p[c] = x.v[c]; }
static inline vi vi_zero(void) { vi r; LANES(0); return r; }
static inline vi vi_set1(int32_t x) { vi r; LANES(x); return r; }
static inline vi vi_add(vi x, vi y) { vi r; LANES(x.v[c] + y.v[c]); return r; }
static inline vi vi_sub(vi x, vi y) { vi r; LANES(x.v[c] - y.v[c]); return r; }
static inline vi vi_mul(vi x, vi y) { vi r; LANES(x.v[c] * y.v[c]); return r; }
static inline vf vi_float(vi x) { vf r; LANES((float)x.v[c]); return r; }
static inline vi vi_and(vi x, vi y) { vi r; LANES(x.v[c] & y.v[c]); return r; }
static inline vi vi_or(vi x, vi y) { vi r; LANES(x.v[c] | y.v[c]); return r; }
static inline vi vi_srl(vi x, int n) { vi r; LANES((int32_t)((uint32_t)x.v[c] >> n)); return r; }
static inline vi vi_sll(vi x, int n) { vi r; LANES((int32_t)((uint32_t)x.v[c] << n)); return r; }
static inline vi vi_sra(vi x, int n) { vi r; LANES(x.v[c] >> n); return r; }
static inline int32_t lo16(int32_t a) { return (int16_t)(uint16_t)((uint32_t)a & 0xffffu); }
static inline int32_t hi16(int32_t a) { return (int16_t)(uint16_t)((uint32_t)a >> 16); }
static inline vi vi_dot16(vi acc, vi x, vi y) {
  vi r;
  LANES(acc.v[c] + (lo16(x.v[c]) * lo16(y.v[c]) + hi16(x.v[c]) * hi16(y.v[c])));
  return r;
}
static inline vf vf_half(const uint8_t *p) { vf r; LANES(half_to_float(load_u16(p + 2 * c))); return r; }
#undef LANES
#endif

#endif /* BATCHGEN_CPU_QUANT_VEC_H */
