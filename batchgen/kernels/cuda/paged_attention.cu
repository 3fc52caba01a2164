// Paged-attention kernels: decode attention (single pass and split-K), the split-K reduce,
// the cache write and the copy-on-write block copy. Contracts: batchgen/kernels/torch_attention.py.
// Layout: a layer's K (or V) pool is [num_blocks, block_size, num_kv_heads, head_size],
// contiguous; a token's slot is block_id * block_size + offset.
#include "paged_attention.cuh"

// Shared-memory layout of paged_decode, in 4-byte words (cuda_attention.py computes the same size):
//   m, l   [BG_MAX_GROUP] each            running max and running denominator per head
//   alpha  [BG_MAX_GROUP]                 rescale factor of the last tile per head
//   row    [BG_TILE] (int)                cache row (slot) of each token of the tile
//   q      [BG_MAX_GROUP][BG_HEAD_SIZE]  queries of the group, pre-scaled, as float
//   p      [BG_MAX_GROUP][BG_TILE]       a tile's logits, then its softmax numerators
// After the last tile, q and p are reused by
//   red    [BG_V_SLOTS][BG_MAX_GROUP][BG_HEAD_SIZE]  each token slot's partial P V, summed in
//                                                    slot order by the epilogue
#define BG_SMEM_M 0
#define BG_SMEM_L (BG_SMEM_M + BG_MAX_GROUP)
#define BG_SMEM_ALPHA (BG_SMEM_L + BG_MAX_GROUP)
#define BG_SMEM_ROW (BG_SMEM_ALPHA + BG_MAX_GROUP)
#define BG_SMEM_Q (BG_SMEM_ROW + BG_TILE)
#define BG_SMEM_P (BG_SMEM_Q + BG_MAX_GROUP * BG_HEAD_SIZE)
#define BG_SMEM_RED BG_SMEM_Q
#define BG_SMEM_LOOP_END (BG_SMEM_P + BG_MAX_GROUP * BG_TILE)
#define BG_SMEM_RED_END (BG_SMEM_RED + BG_V_SLOTS * BG_MAX_GROUP * BG_HEAD_SIZE)
#define BG_SMEM_WORDS (BG_SMEM_LOOP_END > BG_SMEM_RED_END ? BG_SMEM_LOOP_END : BG_SMEM_RED_END)

// Attention of one query token per sequence over its paged context.
//
// Grid: x = num_kv_heads * ceil(group / BG_MAX_GROUP), y = num_seqs, z = max partitions.
// Block: BG_NUM_THREADS threads, BG_SMEM_WORDS * 4 bytes of dynamic shared memory.
// One block serves up to BG_MAX_GROUP query heads of one KV head (all of them for GQA groups of
// at most BG_MAX_GROUP), so each K/V row of the partition is read from memory once.
//
// The query (the last token of its context, position ctx - 1) sees the keys [lo, ctx): lo = 0,
// or with a sliding window (window > 0) lo = max(0, ctx - window), HF's kv > q - window. With a
// soft cap (softcap > 0) each scaled logit x becomes tanhf(x / softcap) * softcap first.
//
// A sequence that sees n = ctx - lo keys is cut into ceil(n / partition_size) partitions of
// partition_size tokens; partition z covers tokens [lo + z * partition_size, ...). When a sequence
// has a single partition the block writes the normalised result straight to `out`; otherwise
// it writes its partition's normalised output, max and denominator to part_out / part_ml and
// paged_decode_reduce combines them. The partition count depends only on the sequence's own
// context length, so a sequence's result never depends on the rest of the batch.
//
// Memory-level parallelism (the kernel is bound by the bytes of K and V it reads):
//   * every K and V read is a 16-byte vector load, kept as raw bits until used;
//   * K is prefetched one tile ahead: the loads of tile i + 1 are issued right after tile i's
//     logits, and stay in flight through tile i's softmax and P V phases;
//   * a thread's V loads of a tile (up to BG_V_BATCH) are issued together, the first batch
//     before the softmax phase, which hides part of their latency behind it.
//
// __launch_bounds__(.., 1): without a minimum-blocks hint ptxas caps the registers of the smaller
// head sizes and spills; with it every variant fits in registers (checked by the static test).
extern "C" __global__ void __launch_bounds__(BG_NUM_THREADS, 1) paged_decode(
    scalar_t* __restrict__ out,               // [num_seqs, num_heads, head_size]
    float* __restrict__ part_out,             // [num_seqs, num_heads, max_parts, head_size]
    float* __restrict__ part_ml,              // [num_seqs, num_heads, max_parts, 2]
    const scalar_t* __restrict__ query,       // [num_seqs, num_heads, head_size]
    const scalar_t* __restrict__ k_cache,     // [num_blocks, block_size, num_kv_heads, head]
    const scalar_t* __restrict__ v_cache,
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens,     // [num_seqs]
    float scale, int num_heads, int num_kv_heads, int max_blocks_per_seq, int partition_size,
    int max_parts, int window, float softcap) {
  BG_DYNAMIC_SMEM(float, smem);
  float* m_s = smem + BG_SMEM_M;
  float* l_s = smem + BG_SMEM_L;
  float* alpha_s = smem + BG_SMEM_ALPHA;
  int* row_s = reinterpret_cast<int*>(smem + BG_SMEM_ROW);
  float* q_s = smem + BG_SMEM_Q;
  float* p_s = smem + BG_SMEM_P;
  float* red_s = smem + BG_SMEM_RED;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = num_heads / num_kv_heads;
  const int chunks = (group + BG_MAX_GROUP - 1) / BG_MAX_GROUP;
  const int kv_head = blockIdx.x / chunks;
  const int head0 = kv_head * group + (blockIdx.x % chunks) * BG_MAX_GROUP;
  const int num_g = min(BG_MAX_GROUP, kv_head * group + group - head0);
  const int seq = blockIdx.y;
  const int part = blockIdx.z;

  const int ctx = context_lens[seq];
  const int lo = window > 0 && ctx > window ? ctx - window : 0;  // the first key the query sees
  // Written without overflow for partition_size up to INT_MAX (the single-pass launch).
  const int num_parts = ctx > 0 ? (ctx - lo - 1) / partition_size + 1 : 0;
  if (ctx <= 0) {
    // Contract violation (context_lens >= 1); define the output instead of leaving garbage.
    if (part == 0) {
      for (int i = tid; i < num_g * BG_HEAD_SIZE; i += BG_NUM_THREADS) {
        out[(static_cast<long long>(seq) * num_heads + head0) * BG_HEAD_SIZE + i] =
            bg_from_float(0.0f);
      }
    }
    return;
  }
  if (part >= num_parts) return;  // uniform across the block: no barrier has been reached
  const int start = lo + part * partition_size;
  const int end = (ctx - start < partition_size) ? ctx : start + partition_size;

  const long long row_stride = static_cast<long long>(num_kv_heads) * BG_HEAD_SIZE;
  const scalar_t* k_head = k_cache + kv_head * BG_HEAD_SIZE;
  const scalar_t* v_head = v_cache + kv_head * BG_HEAD_SIZE;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const int tok_lane = lane / BG_LANES_PER_TOKEN;  // which token of the warp's group of tokens
  const int sub = lane % BG_LANES_PER_TOKEN;       // which slice of the head this lane reads
  const int v_slot = tid / BG_NVEC;                // PV phase: token slot of this thread
  const int v_vec = tid % BG_NVEC;                 // PV phase: 16-byte vector of the V row
  const bool v_active = v_slot < BG_V_SLOTS;

  // K rows of this lane's BG_K_TOKENS tokens of the next tile to score (raw 16-byte vectors),
  // and their cache rows (-1 past the end of the partition).
  uint4 kraw[BG_K_TOKENS][BG_VEC_PER_LANE];
  int krow[BG_K_TOKENS];
#define BG_LOAD_K_TILE(tile_start)                                                          \
  _Pragma("unroll") for (int k = 0; k < BG_K_TOKENS; ++k) {                                 \
    const int pos = (tile_start) + warp * BG_TOKENS_PER_WARP + tok_lane +                   \
                    k * (BG_NUM_WARPS * BG_TOKENS_PER_WARP);                                \
    krow[k] = -1;                                                                           \
    if (pos < end) krow[k] = table[pos / BG_BLOCK_SIZE] * BG_BLOCK_SIZE + pos % BG_BLOCK_SIZE; \
    const scalar_t* kp = k_head + (pos < end ? krow[k] : 0) * row_stride;                   \
    _Pragma("unroll") for (int i = 0; i < BG_VEC_PER_LANE; ++i) {                           \
      const int v = sub + i * BG_LANES_PER_TOKEN;                                           \
      kraw[k][i] = (pos < end && v < BG_NVEC) ? bg_load16(kp + v * BG_VEC) : bg_zero16();   \
    }                                                                                       \
  }
  BG_LOAD_K_TILE(start)

  for (int i = tid; i < num_g * BG_HEAD_SIZE; i += BG_NUM_THREADS) {
    q_s[i] = bg_to_float(query[(static_cast<long long>(seq) * num_heads + head0) * BG_HEAD_SIZE +
                               i]) * scale;
  }
  if (tid < BG_MAX_GROUP) {
    m_s[tid] = BG_NEG_INF;
    l_s[tid] = 0.0f;
  }
  // acc[g][e]: unnormalised output of head g at dimension v_vec * BG_VEC + e, summed over the
  // tokens of slot v_slot.
  float acc[BG_MAX_GROUP][BG_VEC];
#pragma unroll
  for (int g = 0; g < BG_MAX_GROUP; ++g) {
#pragma unroll
    for (int e = 0; e < BG_VEC; ++e) acc[g][e] = 0.0f;
  }
  __syncthreads();

  for (int tile = start; tile < end; tile += BG_TILE) {
    // Phase 1: logits of the tile. BG_LANES_PER_TOKEN lanes share one token; each holds its
    // slice of the K row in registers and reuses it for every query head of the group.
#pragma unroll
    for (int k = 0; k < BG_K_TOKENS; ++k) {
      const int t = warp * BG_TOKENS_PER_WARP + tok_lane + k * (BG_NUM_WARPS * BG_TOKENS_PER_WARP);
      const bool valid = tile + t < end;
      if (sub == 0) row_s[t] = krow[k];
      float kf[BG_VEC_PER_LANE * BG_VEC];
#pragma unroll
      for (int i = 0; i < BG_VEC_PER_LANE; ++i) bg_unpack16(kraw[k][i], kf + i * BG_VEC);
      // Every lane runs the same number of iterations (num_g is uniform), so the shuffles
      // below are never divergent, even for tokens past the end of the context.
      for (int g = 0; g < num_g; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < BG_VEC_PER_LANE; ++i) {
          const int v = sub + i * BG_LANES_PER_TOKEN;
          if (v < BG_NVEC) {
#pragma unroll
            for (int e = 0; e < BG_VEC; ++e) {
              dot += kf[i * BG_VEC + e] * q_s[g * BG_HEAD_SIZE + v * BG_VEC + e];
            }
          }
        }
#pragma unroll
        for (int m = 1; m < BG_LANES_PER_TOKEN; m <<= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, m);
        }
        if (softcap > 0.0f) dot = tanhf(dot / softcap) * softcap;  // uniform: no divergence
        if (sub == 0) p_s[g * BG_TILE + t] = valid ? dot : BG_NEG_INF;
      }
    }
    // Prefetch: the next tile's K rows stay in flight through this tile's softmax and P V.
    BG_LOAD_K_TILE(tile + BG_TILE)
    __syncthreads();

    // The first batch of this thread's V rows, in flight during the softmax phase.
    const int tile_len = min(BG_TILE, end - tile);
    uint4 vraw[BG_V_BATCH];
#define BG_LOAD_V_BATCH(b0)                                                                 \
  _Pragma("unroll") for (int b = 0; b < BG_V_BATCH; ++b) {                                  \
    const int t = v_slot + ((b0) + b) * BG_V_SLOTS;                                         \
    const bool ok = v_active && (b0) + b < BG_V_TOKENS && t < tile_len;                     \
    vraw[b] = ok ? bg_load16(v_head + row_s[t] * row_stride + v_vec * BG_VEC) : bg_zero16(); \
  }
    BG_LOAD_V_BATCH(0)

    // Phase 2: online-softmax update, one warp per query head.
    for (int g = warp; g < num_g; g += BG_NUM_WARPS) {
      const float x0 = p_s[g * BG_TILE + lane];
      const float x1 = p_s[g * BG_TILE + lane + 32];
      const float m_old = m_s[g];
      // The tile holds at least one valid token, so m_new is finite.
      const float m_new = fmaxf(m_old, bg_warp_max(fmaxf(x0, x1)));
      const float e0 = __expf(x0 - m_new);  // exp(-inf) = 0 for masked tokens
      const float e1 = __expf(x1 - m_new);
      p_s[g * BG_TILE + lane] = e0;
      p_s[g * BG_TILE + lane + 32] = e1;
      const float sum = bg_warp_sum(e0 + e1);
      if (lane == 0) {
        const float alpha = __expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // Phase 3: acc = acc * alpha + P V over this thread's tokens of the tile.
#pragma unroll
    for (int g = 0; g < BG_MAX_GROUP; ++g) {
      if (g < num_g) {
        const float alpha = alpha_s[g];
#pragma unroll
        for (int e = 0; e < BG_VEC; ++e) acc[g][e] *= alpha;
      }
    }
#pragma unroll 1
    for (int b0 = 0; b0 < BG_V_TOKENS; b0 += BG_V_BATCH) {
      if (b0 > 0) {
        BG_LOAD_V_BATCH(b0)
      }
#pragma unroll
      for (int b = 0; b < BG_V_BATCH; ++b) {
        const int t = v_slot + (b0 + b) * BG_V_SLOTS;
        if (v_active && b0 + b < BG_V_TOKENS && t < tile_len) {
          float vf[BG_VEC];
          bg_unpack16(vraw[b], vf);
#pragma unroll
          for (int g = 0; g < BG_MAX_GROUP; ++g) {
            if (g < num_g) {
              const float p = p_s[g * BG_TILE + t];
#pragma unroll
              for (int e = 0; e < BG_VEC; ++e) acc[g][e] += p * vf[e];
            }
          }
        }
      }
    }
#undef BG_LOAD_V_BATCH
    __syncthreads();  // p_s, alpha_s and row_s are rewritten by the next tile
  }
#undef BG_LOAD_K_TILE

  // Epilogue: the token slots' partial sums meet in shared memory (q and p are free now) and
  // are added in slot order, so the result does not depend on the schedule.
  if (v_active) {
#pragma unroll
    for (int g = 0; g < BG_MAX_GROUP; ++g) {
      if (g < num_g) {
#pragma unroll
        for (int e = 0; e < BG_VEC; ++e) {
          red_s[(v_slot * BG_MAX_GROUP + g) * BG_HEAD_SIZE + v_vec * BG_VEC + e] = acc[g][e];
        }
      }
    }
  }
  __syncthreads();
  // l_s > 0: the token holding the maximum contributes exp(0) = 1.
  for (int i = tid; i < num_g * BG_HEAD_SIZE; i += BG_NUM_THREADS) {
    const int g = i / BG_HEAD_SIZE;
    const int d = i % BG_HEAD_SIZE;
    float o = 0.0f;
#pragma unroll
    for (int s = 0; s < BG_V_SLOTS; ++s) o += red_s[(s * BG_MAX_GROUP + g) * BG_HEAD_SIZE + d];
    o /= l_s[g];
    const long long head = static_cast<long long>(seq) * num_heads + head0 + g;
    if (num_parts == 1) {
      out[head * BG_HEAD_SIZE + d] = bg_from_float(o);
    } else {
      part_out[(head * max_parts + part) * BG_HEAD_SIZE + d] = o;
    }
  }
  if (num_parts > 1 && tid < num_g) {
    const long long head = static_cast<long long>(seq) * num_heads + head0 + tid;
    part_ml[(head * max_parts + part) * 2] = m_s[tid];
    part_ml[(head * max_parts + part) * 2 + 1] = l_s[tid];
  }
}

// Combines the partitions of split sequences: out = sum_p w_p o_p / sum_p w_p with
// w_p = exp(m_p - max_p m_p) * l_p. Sequences with one partition were finished by paged_decode.
// Grid: x = num_heads, y = num_seqs. Block: BG_NUM_THREADS threads,
// (2 * BG_NUM_WARPS + max_parts) * 4 bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(BG_NUM_THREADS) paged_decode_reduce(
    scalar_t* __restrict__ out, const float* __restrict__ part_out,
    const float* __restrict__ part_ml, const int* __restrict__ context_lens, int num_heads,
    int partition_size, int max_parts, int window) {
  BG_DYNAMIC_SMEM(float, smem);
  float* red_s = smem;                     // [2][BG_NUM_WARPS] per-warp max, then sum
  float* w_s = smem + 2 * BG_NUM_WARPS;    // [max_parts] partition weights
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int seq = blockIdx.y;
  const long long head = static_cast<long long>(seq) * num_heads + blockIdx.x;
  const int ctx = context_lens[seq];
  const int lo = window > 0 && ctx > window ? ctx - window : 0;  // as paged_decode
  const int num_parts = ctx > 0 ? (ctx - lo - 1) / partition_size + 1 : 0;
  if (num_parts <= 1) return;  // uniform across the block
  const float* ml = part_ml + head * max_parts * 2;

  float mx = BG_NEG_INF;
  for (int p = tid; p < num_parts; p += BG_NUM_THREADS) mx = fmaxf(mx, ml[2 * p]);
  mx = bg_warp_max(mx);
  if (lane == 0) red_s[warp] = mx;
  __syncthreads();
  mx = red_s[0];
#pragma unroll
  for (int w = 1; w < BG_NUM_WARPS; ++w) mx = fmaxf(mx, red_s[w]);

  float sum = 0.0f;
  for (int p = tid; p < num_parts; p += BG_NUM_THREADS) {
    const float w = __expf(ml[2 * p] - mx) * ml[2 * p + 1];
    w_s[p] = w;
    sum += w;
  }
  sum = bg_warp_sum(sum);
  if (lane == 0) red_s[BG_NUM_WARPS + warp] = sum;
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < BG_NUM_WARPS; ++w) sum += red_s[BG_NUM_WARPS + w];
  const float inv = 1.0f / sum;

  const float* po = part_out + head * max_parts * BG_HEAD_SIZE;
  for (int d = tid; d < BG_HEAD_SIZE; d += BG_NUM_THREADS) {
    float o = 0.0f;
    for (int p = 0; p < num_parts; ++p) o += w_s[p] * po[p * BG_HEAD_SIZE + d];
    out[head * BG_HEAD_SIZE + d] = bg_from_float(o * inv);
  }
}

// Scatters new K/V rows into the pools. Grid: x = num_tokens. Block: any multiple of 32.
// Tokens whose slot is negative are skipped (padding).
extern "C" __global__ void reshape_and_cache(
    const scalar_t* __restrict__ key,    // [num_tokens, num_kv_heads, head_size], rows at key_stride
    const scalar_t* __restrict__ value,  // same shape, rows at value_stride
    scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, int num_kv_heads, long long key_stride,
    long long value_stride) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int n = num_kv_heads * BG_HEAD_SIZE;
  const scalar_t* k = key + blockIdx.x * key_stride;
  const scalar_t* v = value + blockIdx.x * value_stride;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    k_cache[slot * n + i] = k[i];
    v_cache[slot * n + i] = v[i];
  }
}

// Copy-on-write: dst <- src for every (src, dst) pair, K and V, in every layer, in one launch.
// Grid: x = num_pairs, y = num_layers * 2. Block: any multiple of 32.
// kv_cache is viewed as 16-byte words; words_per_block = block bytes / 16 (a whole number since
// head_size * element size is a multiple of 16).
extern "C" __global__ void copy_blocks(uint4* __restrict__ kv_cache,
                                       const long long* __restrict__ block_mapping,
                                       long long words_per_block, long long num_blocks) {
  const long long src = block_mapping[2 * blockIdx.x];
  const long long dst = block_mapping[2 * blockIdx.x + 1];
  uint4* pool = kv_cache + static_cast<long long>(blockIdx.y) * num_blocks * words_per_block;
  for (long long i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    pool[dst * words_per_block + i] = pool[src * words_per_block + i];
  }
}
