// Shared definitions of the paged-attention kernels.
//
// Compile-time configuration (passed as -D options by the loader, one module per combination):
//   BG_DTYPE       0 = float32, 1 = float16, 2 = bfloat16 (cache, query and output dtype)
//   BG_HEAD_SIZE   64, 80, 96, 128 or 256 (any multiple of 16 bytes / element size works)
//   BG_BLOCK_SIZE  tokens per cache block: 8, 16 or 32
//
// The same source is compiled three ways: by NVRTC (cupy.RawModule) on a GPU, by nvcc for the
// static checks, and by g++ against tests/kernels/cuda_harness/cuda_cpu.h for execution on the
// CPU. It therefore keeps to the subset the harness implements: no inline PTX, no tensor-core
// instructions, no cooperative groups, full-warp shuffles only, and shared memory only through
// BG_DYNAMIC_SMEM (so the harness can poison it and sanitizers can bound it).
#pragma once

#if defined(BGH_CPU_HARNESS)
// cuda_cpu.h is force-included by the harness build; nothing to include here.
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

#ifndef BG_DTYPE
#error "BG_DTYPE must be defined (0 = float32, 1 = float16, 2 = bfloat16)"
#endif
#ifndef BG_HEAD_SIZE
#error "BG_HEAD_SIZE must be defined"
#endif
#ifndef BG_BLOCK_SIZE
#error "BG_BLOCK_SIZE must be defined"
#endif

// Launch geometry. cuda_attention.py mirrors these values (and a test pins the two together).
#define BG_NUM_THREADS 128      // threads per block of the decode and reduce kernels
#define BG_NUM_WARPS (BG_NUM_THREADS / 32)
#define BG_MAX_GROUP 8          // query heads served by one block (one KV head's GQA group)
#define BG_TILE 64              // context tokens scored per tile of the online softmax
#define BG_LANES_PER_TOKEN 4    // lanes that cooperate on one token's q.k in the QK phase
#define BG_TOKENS_PER_WARP (32 / BG_LANES_PER_TOKEN)
#if BG_TILE != 64
#error "the softmax phase assumes BG_TILE == 64 (two logits per lane)"
#endif
// -inf without math.h (NVRTC has no INFINITY macro).
#define BG_NEG_INF __int_as_float(0xff800000)

#if defined(BGH_CPU_HARNESS)
#define BG_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::bgh::dynamic_smem())
#else
#define BG_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

#if BG_DTYPE == 0
typedef float scalar_t;
#define BG_VEC 4
__device__ __forceinline__ float bg_to_float(scalar_t x) { return x; }
__device__ __forceinline__ scalar_t bg_from_float(float x) { return x; }
#elif BG_DTYPE == 1
typedef __half scalar_t;
#define BG_VEC 8
__device__ __forceinline__ float bg_to_float(scalar_t x) { return __half2float(x); }
__device__ __forceinline__ scalar_t bg_from_float(float x) { return __float2half_rn(x); }
#elif BG_DTYPE == 2
typedef __nv_bfloat16 scalar_t;
#define BG_VEC 8
__device__ __forceinline__ float bg_to_float(scalar_t x) { return __bfloat162float(x); }
__device__ __forceinline__ scalar_t bg_from_float(float x) { return __float2bfloat16_rn(x); }
#else
#error "BG_DTYPE must be 0, 1 or 2"
#endif

// 16-byte vectors per head row; the loader rejects head sizes that are not a multiple of BG_VEC.
#define BG_NVEC (BG_HEAD_SIZE / BG_VEC)
#if BG_NVEC * BG_VEC != BG_HEAD_SIZE
#error "BG_HEAD_SIZE must be a multiple of 16 bytes"
#endif
// Vectors of one K row held by each of the BG_LANES_PER_TOKEN lanes (the last may be partial).
#define BG_VEC_PER_LANE ((BG_NVEC + BG_LANES_PER_TOKEN - 1) / BG_LANES_PER_TOKEN)
// QK phase: tokens of a tile each lane scores (all its K loads are issued before the first use).
#define BG_K_TOKENS (BG_TILE / (BG_NUM_WARPS * BG_TOKENS_PER_WARP))
// PV phase: thread tid reads 16-byte vector tid % BG_NVEC of the V rows of tokens
// tid / BG_NVEC, + BG_V_SLOTS, ...: BG_V_SLOTS tokens are read side by side, each by BG_NVEC
// threads, and every thread (but the BG_NUM_THREADS % BG_NVEC left over) has work at every head
// size. BG_V_BATCH of a thread's loads are in flight before the first is used.
#define BG_V_SLOTS (BG_NUM_THREADS / BG_NVEC)
#define BG_V_TOKENS ((BG_TILE + BG_V_SLOTS - 1) / BG_V_SLOTS)
#define BG_V_BATCH (BG_V_TOKENS < 8 ? BG_V_TOKENS : 8)
#if BG_V_SLOTS < 1
#error "a V row must fit in BG_NUM_THREADS 16-byte vectors"
#endif

// 16 bytes (BG_VEC elements, 16-byte aligned) as raw bits: one 128-bit load. Kept raw until
// used, so a load in flight holds four registers whatever the dtype.
__device__ __forceinline__ uint4 bg_load16(const scalar_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ uint4 bg_zero16() {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}

// The BG_VEC elements of a raw 16-byte vector as floats.
__device__ __forceinline__ void bg_unpack16(const uint4& u, float* out) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if BG_DTYPE == 0
    out[i] = __uint_as_float(w[i]);
#elif BG_DTYPE == 1
    out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
#else
    // bfloat16 is the top half of a float32.
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#endif
  }
}

__device__ __forceinline__ float bg_warp_max(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

__device__ __forceinline__ float bg_warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
