/* paged_attention.c's element conversions: bfloat16 and float16 to and from float32, and a
 * head row's load into float32 and store from float32 accumulators.
 *
 * Part of paged_attention.c, which includes it at this point of its source, after its
 * configuration (HEAD_SIZE, GROUP, the ISA macros, the dtype codes): not a header of its own.
 */
/* ---------------------------------------------------------------- element conversions */
static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
static inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  memcpy(&x, &h, sizeof x);
  return (float)x;
}
static inline uint16_t f32_to_f16(float f) {
  const _Float16 x = (_Float16)f;
  uint16_t h;
  memcpy(&h, &x, sizeof h);
  return h;
}
#else
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else { /* zero or subnormal: man * 2^-24, exact in float */
    const float v = (float)man * 5.9604644775390625e-8f;
    memcpy(&u, &v, sizeof u);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint16_t f32_to_f16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;               /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00u;              /* rounds to infinity */
  if (a < 0x38800000u) {                                    /* subnormal or zero in half */
    float af;
    memcpy(&af, &a, sizeof af);
    const float scaled = af * 16777216.0f;                  /* exact: units of 2^-24 */
    uint32_t m = (uint32_t)scaled;
    const float rest = scaled - (float)m;
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return sign | (uint16_t)m;
  }
  const uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);       /* round the 13 dropped bits */
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}
#endif

static inline void store_row(void *dst, int dtype, const float *restrict acc, float inv) {
  if (dtype == DT_F32) {
    float *o = (float *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = acc[d] * inv;
  } else if (dtype == DT_BF16) {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = f32_to_bf16(acc[d] * inv);
  } else {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < HEAD_SIZE; ++d) o[d] = f32_to_f16(acc[d] * inv);
  }
}

/* A row of HEAD_SIZE elements of `dtype` into float32 (exactly), zero-padded to HSP. */
static inline void convert_row(const void *src, int dtype, float *restrict dst) {
  const uint16_t *h = (const uint16_t *)src;
  int d = 0;
#ifdef BG_AVX512
  if (dtype == DT_F32) {
    for (; d < NFULL * 16; d += 16) _mm512_storeu_ps(dst + d, _mm512_loadu_ps((const float *)src + d));
  } else if (dtype == DT_BF16) {
    for (; d < NFULL * 16; d += 16) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + d)));
      _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  } else {
    for (; d < NFULL * 16; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
  }
#elif defined(BG_AVX2)
  if (dtype == DT_F32) {
    for (; d + 8 <= HEAD_SIZE; d += 8) _mm256_storeu_ps(dst + d, _mm256_loadu_ps((const float *)src + d));
  } else if (dtype == DT_BF16) {
    for (; d + 8 <= HEAD_SIZE; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + d)));
      _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else {
    for (; d + 8 <= HEAD_SIZE; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
  }
#endif
  if (dtype == DT_F32)
    for (; d < HEAD_SIZE; ++d) dst[d] = ((const float *)src)[d];
  else if (dtype == DT_BF16)
    for (; d < HEAD_SIZE; ++d) dst[d] = bf16_to_f32(h[d]);
  else
    for (; d < HEAD_SIZE; ++d) dst[d] = f16_to_f32(h[d]);
  for (; d < HSP; ++d) dst[d] = 0.f;
}
