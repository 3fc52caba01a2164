/* paged_attention.c's access to the K/V rows: the element size of a dtype, a key block's rows as
 * float32 (the cache's own rows, or converted), and the prefetch of scattered rows.
 *
 * Part of paged_attention.c, which includes it at this point of its source, after its
 * configuration (HEAD_SIZE, KB, HSP, the dtype codes) and the element conversions
 * (paged_attention_convert.h): not a header of its own.
 */
static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* The rows of n keys (1 <= n <= KB) at element offsets off[0 .. n - 1] of `cache` (k_cache or
 * v_cache) as float32: the cache's own rows for float32, else converted into buf ([KB][HSP]).
 * rows[n .. KB - 1] repeat row n - 1 (read, never used). */
static inline void key_block(const void *cache, int dtype, const int64_t *off, int n,
                             float *restrict buf, const float **rows) {
  if (dtype == DT_F32) {
    for (int j = 0; j < n; ++j) rows[j] = (const float *)cache + off[j];
  } else {
    for (int j = 0; j < n; ++j) {
      convert_row((const uint16_t *)cache + off[j], dtype, buf + j * HSP);
      rows[j] = buf + j * HSP;
    }
  }
  for (int j = n; j < KB; ++j) rows[j] = rows[n - 1];
}

/* Ask for the rows of keys p0 .. p1 - 1 of `cache` (element offsets off[p]) ahead of their use,
 * into every cache level (locality 3) or into L2 and beyond (locality 2). They lie in scattered
 * blocks that the hardware prefetchers cannot guess; in a model step they come from memory
 * (every layer's weights stream through the caches between two calls for one layer). A macro:
 * the locality must be a constant. */
#define PREFETCH_ROWS(cache, es, off, p0, p1, locality)                                       \
  do {                                                                                        \
    for (int64_t p_ = (p0); p_ < (p1); ++p_) {                                                \
      const char *row_ = (const char *)(cache) + (off)[p_] * (es);                            \
      for (int64_t x_ = 0; x_ < HEAD_SIZE * (es); x_ += 64) __builtin_prefetch(row_ + x_, 0, locality); \
    }                                                                                         \
  } while (0)
