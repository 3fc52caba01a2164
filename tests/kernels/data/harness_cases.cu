// Small kernels for testing the CPU harness itself. Each is either correct or carries exactly one
// deliberate defect, named after the kernel.
#if defined(BGH_CPU_HARNESS)
#define DYN_SMEM(type, name) type* name = reinterpret_cast<type*>(::bgh::dynamic_smem())
#else
#define DYN_SMEM(type, name) extern __shared__ type name[]
#endif

// Correct: reverses blockDim.x floats through shared memory.
extern "C" __global__ void block_reverse(float* out, const float* in) {
  DYN_SMEM(float, s);
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = in[blockIdx.x * n + t];
  __syncthreads();
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// Defect: the barrier between the shared-memory write and the read is missing.
extern "C" __global__ void block_reverse_no_sync(float* out, const float* in) {
  DYN_SMEM(float, s);
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = in[blockIdx.x * n + t];
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// Defect: only the first warp reaches the barrier.
extern "C" __global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Defect: two halves of the block wait at two different barriers.
extern "C" __global__ void barrier_in_branches(float* out) {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Defect: thread 0 runs one more barrier than the others.
extern "C" __global__ void extra_barrier(float* out) {
  for (int i = 0; i < (threadIdx.x == 0 ? 2 : 1); ++i) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Defect: half of the warp skips the shuffle.
extern "C" __global__ void divergent_shuffle(float* out) {
  float x = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) x = __shfl_xor_sync(0xffffffffu, x, 1);
  out[threadIdx.x] = x;
}

// Correct: each shuffle flavour, results written per lane.
extern "C" __global__ void shuffle_ops(int* out) {
  const int lane = threadIdx.x % 32;
  const int v = static_cast<int>(threadIdx.x) * 10;
  const int n = blockDim.x;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 5);
  out[n + threadIdx.x] = __shfl_sync(0xffffffffu, v, 3);
  out[2 * n + threadIdx.x] = __shfl_up_sync(0xffffffffu, v, 2);
  out[3 * n + threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 4);
  (void)lane;
}

// Defect: a data race. Every thread writes its slot, thread 0 sums them without a barrier.
extern "C" __global__ void racy_sum(float* out, const float* in) {
  DYN_SMEM(float, s);
  s[threadIdx.x] = in[threadIdx.x];
  if (threadIdx.x == 0) {
    float acc = 0.0f;
    for (unsigned int i = 0; i < blockDim.x; ++i) acc += s[i];
    out[0] = acc;
  }
}

// Defect: writes one float past the end of the dynamic shared memory.
extern "C" __global__ void smem_overflow(float* out, int n) {
  DYN_SMEM(float, s);
  if (threadIdx.x == 0) s[n] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = 0.0f;
}

// Reads through an index taken from the data: a wild pointer when idx is huge.
extern "C" __global__ void wild_read(float* out, const float* in, long long idx) {
  out[threadIdx.x] = in[threadIdx.x == 5 ? idx : threadIdx.x];
}
