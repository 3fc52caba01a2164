/* Paged decode attention for the CPU, compiled at run time by batchgen.kernels.cpu.
 *
 * Contract: the same as batchgen.kernels.reference.paged_decode_attention, for float32.
 * One query token per sequence attends over its context, read in place from the paged
 * K/V pools through the block table: nothing is gathered and no position past a sequence's
 * own context is touched.
 *
 * Compile-time constants (-D): HEAD_SIZE (elements per head) and GROUP (query heads per KV
 * head). With both fixed the compiler keeps a whole query head group and its output
 * accumulators in vector registers and unrolls the head_size loops.
 *
 * Layout (see reference.py):
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, HEAD_SIZE], contiguous.
 *   query: [num_seqs, num_kv_heads * GROUP, HEAD_SIZE], last dim contiguous, other strides
 *          given (attention layers hand over transposed views).
 *   out:   [num_seqs, num_kv_heads * GROUP, HEAD_SIZE], contiguous.
 *   block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32, >= 1.
 *   scratch: scratch_len floats, private to this call (the scores of one KV head's group,
 *            [GROUP][context_len]).
 *
 * Every index the kernel would follow is checked first, before anything is computed: it
 * returns 0, or 1 for a context length outside [1, max_blocks * block_size] or longer than
 * the scratch holds, or 2 for a block id outside [0, num_blocks) among the blocks a sequence
 * reads (padding past them is never read). Checking here costs one pass over the tables
 * instead of several torch reductions per layer.
 *
 * Sequences are computed one after another, each on its own, so a sequence's output does not
 * depend on the rest of the batch.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"

#if !defined(HEAD_SIZE) || !defined(GROUP)
#error "compile with -DHEAD_SIZE=<n> -DGROUP=<n>"
#endif

/* Never built with -ffast-math: linking a shared library with it sets flush-to-zero for the
 * whole process. The reductions that may be reordered say so with `omp simd reduction`
 * (-fopenmp-simd: vectorisation only, no OpenMP runtime). */
#define LANES 16

/* exp(x) for x <= 0 (softmax numerators); relative error about 2e-7 (exp.h). */
static inline float exp_nonpos(float x) { return batchgen_exp_clamped(x < -87.0f ? -87.0f : x); }

static inline float dot_head(const float *restrict a, const float *restrict b) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < HEAD_SIZE; ++d) s += a[d] * b[d];
  return s;
}

int batchgen_head_size(void) { return HEAD_SIZE; }
int batchgen_group(void) { return GROUP; }

int batchgen_paged_decode_f32(
    float *restrict out, const float *restrict query, const float *restrict k_cache,
    const float *restrict v_cache, const int32_t *restrict block_tables,
    const int32_t *restrict context_lens, int64_t num_seqs,
    int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, int64_t q_stride_seq,
    int64_t q_stride_head, float scale, float *restrict scratch, int64_t num_blocks,
    int64_t scratch_len) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = context_lens[s];
    if (ctx < 1 || ctx > max_blocks * block_size || ctx * GROUP > scratch_len) return 1;
    const int32_t *table = block_tables + s * max_blocks;
    for (int64_t b = 0; b * block_size < ctx; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return 2;
  }
  const int64_t num_heads = num_kv_heads * GROUP;
  const int64_t tok_stride = num_kv_heads * HEAD_SIZE;
  const int64_t blk_stride = block_size * tok_stride;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = context_lens[s];
    const int32_t *table = block_tables + s * max_blocks;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      float q[GROUP][HEAD_SIZE];
      for (int g = 0; g < GROUP; ++g) {
        const float *src = query + s * q_stride_seq + (h * GROUP + g) * q_stride_head;
        for (int d = 0; d < HEAD_SIZE; ++d) q[g][d] = src[d] * scale;
      }
      /* Pass 1: scores[g][p] = q_g . k_p, and each head's maximum. */
      float *scores = scratch;
      float max_score[GROUP];
      for (int g = 0; g < GROUP; ++g) max_score[g] = -FLT_MAX;
      int64_t p = 0;
      for (int64_t b = 0; p < ctx; ++b) {
        const float *kb = k_cache + (int64_t)table[b] * blk_stride + h * HEAD_SIZE;
        const int64_t n = ctx - p < block_size ? ctx - p : block_size;
        for (int64_t o = 0; o < n; ++o, ++p) {
          const float *kp = kb + o * tok_stride;
          for (int g = 0; g < GROUP; ++g) {
            const float v = dot_head(q[g], kp);
            scores[g * ctx + p] = v;
            max_score[g] = v > max_score[g] ? v : max_score[g];
          }
        }
      }
      /* Softmax numerators in place, and their sums (LANES partial sums, then added). */
      float sum[GROUP];
      for (int g = 0; g < GROUP; ++g) {
        float *sc = scores + g * ctx;
        const float mg = max_score[g];
        float lanes[LANES] = {0.f};
        int64_t i = 0;
        for (; i + LANES <= ctx; i += LANES) {
          for (int j = 0; j < LANES; ++j) {
            const float e = exp_nonpos(sc[i + j] - mg);
            sc[i + j] = e;
            lanes[j] += e;
          }
        }
        float total = 0.f;
        for (; i < ctx; ++i) {
          sc[i] = exp_nonpos(sc[i] - mg);
          total += sc[i];
        }
        for (int j = 0; j < LANES; ++j) total += lanes[j];
        sum[g] = total;
      }
      /* Pass 2: out_g = sum_p w_pg v_p / sum_g. */
      float acc[GROUP][HEAD_SIZE];
      for (int g = 0; g < GROUP; ++g)
        for (int d = 0; d < HEAD_SIZE; ++d) acc[g][d] = 0.f;
      p = 0;
      for (int64_t b = 0; p < ctx; ++b) {
        const float *vb = v_cache + (int64_t)table[b] * blk_stride + h * HEAD_SIZE;
        const int64_t n = ctx - p < block_size ? ctx - p : block_size;
        for (int64_t o = 0; o < n; ++o, ++p) {
          const float *vp = vb + o * tok_stride;
          for (int g = 0; g < GROUP; ++g) {
            const float w = scores[g * ctx + p];
            for (int d = 0; d < HEAD_SIZE; ++d) acc[g][d] += w * vp[d];
          }
        }
      }
      for (int g = 0; g < GROUP; ++g) {
        float *dst = out + (s * num_heads + h * GROUP + g) * HEAD_SIZE;
        const float inv = 1.f / sum[g];
        for (int d = 0; d < HEAD_SIZE; ++d) dst[d] = acc[g][d] * inv;
      }
    }
  }
  return 0;
}
