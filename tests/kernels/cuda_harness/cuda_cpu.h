// CPU execution harness for CUDA kernels.
//
// Force-included (g++ -include cuda_cpu.h) in front of an unmodified .cu file, it maps the CUDA
// built-ins the batchgen kernels use onto CPU fibers or threads:
//   threadIdx / blockIdx / blockDim / gridDim, dynamic shared memory (bgh::dynamic_smem()),
//   __syncthreads, __syncwarp, __shfl_sync / __shfl_xor_sync / __shfl_up_sync / __shfl_down_sync,
//   __half / __nv_bfloat16 and their conversions, the bit-cast and fast-math intrinsics.
//
// Blocks run one after another. Within a block every CUDA thread is either a fiber (the
// deterministic schedules) or an OS thread (schedule "threads", used under ThreadSanitizer and
// AddressSanitizer). All synchronisation goes through one state machine that knows where every
// thread is, so a barrier or shuffle that not every thread can reach is reported as an error
// naming the source lines, never as a hang.
//
// Schedules (fiber mode):
//   warp          warps in ascending order; a warp runs as far as it can (until all its lanes
//                 wait at a __syncthreads) before the next warp starts
//   warp_reverse  the same with warps and lanes in descending order
//   round_robin   one thread advances to its next synchronisation point, then the next thread
//   random        a seeded random ready thread each time
// An access to unmapped memory (SIGSEGV or SIGBUS) in a fiber schedule ends the launch with an
// error naming the block and thread, as a GPU reports an illegal address, instead of killing the
// process.
// Dynamic shared memory is filled with a poison pattern (NaN or a huge finite float) at the start
// of every block, as on a GPU where it holds whatever the previous block left.
#pragma once
#define BGH_CPU_HARNESS 1

#include <algorithm>
#include <cmath>
#include <math.h>  // expf, fmaxf, ... in the global namespace, as CUDA has them
#include <condition_variable>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

// ---------------------------------------------------------------------------------------------
// Vector and reduced-precision types.
struct dim3 {
  unsigned int x, y, z;
};
struct uint4 {
  unsigned int x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};
struct float2 {
  float x, y;
};
// Storage-only 16-bit types: kernels touch them only through the conversion intrinsics.
struct __half {
  unsigned short bits_;
};
struct __nv_bfloat16 {
  unsigned short bits_;
};
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit storage types");

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}

// float16 through the compiler's IEEE binary16 type: conversions round to nearest even, like
// __float2half_rn on the GPU.
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits_, 2);
  return static_cast<float>(v);
}
inline __half __float2half_rn(float f) {
  _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.bits_, &v, 2);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits_; }

inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned int>(b.bits_) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<unsigned short>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return __nv_bfloat16{static_cast<unsigned short>(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits_; }

// Fast-math intrinsics: the CPU computes them exactly; the GPU's approximations are within the
// kernel tests' tolerances.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

// ---------------------------------------------------------------------------------------------
// Execution state.
namespace bgh {

enum class State { kReady, kBarrier, kWarpSync, kDone };
enum class ShflKind { kIdx, kUp, kDown, kXor, kSyncWarp };
enum Schedule { kWarp = 0, kWarpReverse = 1, kRoundRobin = 2, kRandom = 3, kThreads = 4 };
enum Poison { kPoisonNone = 0, kPoisonNaN = 1, kPoisonHuge = 2 };

struct Abort {};  // unwinds an OS thread out of a kernel after an error (thread mode only)

struct ThreadCtx {
  dim3 thread_idx{0, 0, 0};
  dim3 block_idx{0, 0, 0};
  int linear = 0;  // x + y * bx + z * bx * by
  State state = State::kReady;
  int line = 0;  // source line of the barrier or warp operation being waited at
  // Warp operation in flight.
  ShflKind kind = ShflKind::kIdx;
  unsigned int mask = 0;
  int arg = 0;
  int width = 32;
  int size = 0;
  std::uint64_t value = 0;
  std::uint64_t result = 0;
  // Fiber.
  void* sp = nullptr;
  char* stack = nullptr;
};

struct Launch {
  void (*thunk)(void**) = nullptr;
  void** args = nullptr;
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  int nthreads = 0;
  int schedule = kWarp;
  std::vector<unsigned char> smem;  // exactly the requested dynamic shared memory
  std::vector<ThreadCtx> threads;
  std::string error;
  std::mutex mu;                    // thread mode: guards every field below threads
  std::condition_variable cv;
  void* sched_sp = nullptr;         // fiber mode: the scheduler's saved stack pointer
};

inline Launch* g_launch = nullptr;
inline thread_local ThreadCtx* cur = nullptr;

inline void* dynamic_smem() { return g_launch->smem.empty() ? nullptr : g_launch->smem.data(); }

inline std::string describe(const ThreadCtx& t) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", t.thread_idx.x,
                t.thread_idx.y, t.thread_idx.z, t.block_idx.x, t.block_idx.y, t.block_idx.z);
  return buf;
}

inline const char* state_name(const ThreadCtx& t) {
  switch (t.state) {
    case State::kReady: return "running";
    case State::kBarrier: return "at __syncthreads";
    case State::kWarpSync: return "at a warp shuffle/sync";
    case State::kDone: return "exited";
  }
  return "?";
}

inline void fail(Launch& L, const std::string& msg) {
  if (L.error.empty()) L.error = msg;
}

// Releases every warp operation and barrier that all its participants have reached, and
// reports the ones that can never complete. Called after every state change (under L.mu in
// thread mode). Returns true if some thread was released.
inline bool resolve(Launch& L) {
  bool released = false;
  const int n = L.nthreads;
  for (int w0 = 0; w0 < n; w0 += 32) {
    const int w1 = std::min(n, w0 + 32);
    int at_warp = 0, ready = 0, first = -1, other = -1;
    for (int i = w0; i < w1; ++i) {
      const ThreadCtx& t = L.threads[i];
      if (t.state == State::kWarpSync) {
        ++at_warp;
        if (first < 0) first = i;
      } else if (t.state == State::kReady) {
        ++ready;
      } else if (other < 0) {
        other = i;
      }
    }
    if (at_warp == 0) continue;
    if (at_warp < w1 - w0) {
      if (ready == 0) {
        const ThreadCtx& a = L.threads[first];
        const ThreadCtx& b = L.threads[other];
        fail(L, "divergent warp operation: " + describe(a) + " waits at a shuffle/syncwarp on line " +
                    std::to_string(a.line) + " while " + describe(b) + " is " + state_name(b) +
                    (b.state == State::kBarrier ? " on line " + std::to_string(b.line) : ""));
        return released;
      }
      continue;  // some lanes are still running towards it
    }
    if (w1 - w0 != 32) {
      fail(L, "warp operation in a partial warp (blockDim not a multiple of 32) on line " +
                  std::to_string(L.threads[w0].line));
      return released;
    }
    const ThreadCtx& a = L.threads[w0];
    for (int i = w0; i < w1; ++i) {
      const ThreadCtx& t = L.threads[i];
      if (t.line != a.line || t.kind != a.kind || t.size != a.size) {
        fail(L, "divergent warp operation: lanes of warp " + std::to_string(w0 / 32) +
                    " of block (" + std::to_string(a.block_idx.x) + "," +
                    std::to_string(a.block_idx.y) + "," + std::to_string(a.block_idx.z) +
                    ") wait at different shuffles (lines " + std::to_string(a.line) + " and " +
                    std::to_string(t.line) + ")");
        return released;
      }
      if (t.mask != 0xffffffffu) {
        fail(L, "shuffle on line " + std::to_string(t.line) +
                    " uses a partial mask; the harness supports full-warp masks only");
        return released;
      }
      if (t.width != 32) {
        fail(L, "shuffle on line " + std::to_string(t.line) + " uses width != 32 (unsupported)");
        return released;
      }
    }
    for (int i = w0; i < w1; ++i) {
      ThreadCtx& t = L.threads[i];
      const int lane = i - w0;
      int src = lane;
      switch (t.kind) {
        case ShflKind::kIdx: src = t.arg & 31; break;
        case ShflKind::kXor: src = (lane ^ t.arg) & 31; break;
        case ShflKind::kUp: src = lane - t.arg >= 0 ? lane - t.arg : lane; break;
        case ShflKind::kDown: src = lane + t.arg < 32 ? lane + t.arg : lane; break;
        case ShflKind::kSyncWarp: break;
      }
      t.result = L.threads[w0 + src].value;
    }
    for (int i = w0; i < w1; ++i) L.threads[i].state = State::kReady;
    released = true;
  }

  int ready = 0, barrier = 0, warp = 0, done = 0, first_barrier = -1, first_done = -1;
  for (int i = 0; i < n; ++i) {
    switch (L.threads[i].state) {
      case State::kReady: ++ready; break;
      case State::kWarpSync: ++warp; break;
      case State::kBarrier:
        ++barrier;
        if (first_barrier < 0) first_barrier = i;
        break;
      case State::kDone:
        ++done;
        if (first_done < 0) first_done = i;
        break;
    }
  }
  if (barrier > 0 && ready == 0 && warp == 0) {
    const ThreadCtx& a = L.threads[first_barrier];
    if (done > 0) {
      fail(L, "divergent __syncthreads: " + describe(a) + " waits on line " +
                  std::to_string(a.line) + " but " + describe(L.threads[first_done]) +
                  " has exited (" + std::to_string(done) + " of " + std::to_string(n) +
                  " threads exited)");
      return released;
    }
    for (int i = 0; i < n; ++i) {
      if (L.threads[i].line != a.line) {
        fail(L, "divergent __syncthreads: " + describe(a) + " waits on line " +
                    std::to_string(a.line) + " while " + describe(L.threads[i]) +
                    " waits on line " + std::to_string(L.threads[i].line));
        return released;
      }
    }
    for (int i = 0; i < n; ++i) L.threads[i].state = State::kReady;
    return true;
  }
  if (!released && ready == 0 && done < n && L.error.empty()) {
    fail(L, "deadlock: no thread can make progress (" + std::to_string(barrier) +
                " at __syncthreads, " + std::to_string(warp) + " at warp operations, " +
                std::to_string(done) + " exited)");
  }
  return released;
}

// ------------------------------------------------------------------------- fiber switching
#if defined(__x86_64__) && !defined(BGH_NO_FIBERS)
// bgh_ctx_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores the stack pointer in *save and resumes the context whose stack
// pointer is `to`. bgh_ctx_entry starts a new fiber: fn in r13, argument in r12.
asm(R"(
.text
.p2align 4
.globl bgh_ctx_switch
.hidden bgh_ctx_switch
.type bgh_ctx_switch,@function
bgh_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw (%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw (%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size bgh_ctx_switch,.-bgh_ctx_switch
.p2align 4
.globl bgh_ctx_entry
.hidden bgh_ctx_entry
.type bgh_ctx_entry,@function
bgh_ctx_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
.size bgh_ctx_entry,.-bgh_ctx_entry
)");
extern "C" void bgh_ctx_switch(void** save, void* to);
extern "C" void bgh_ctx_entry();
#define BGH_HAVE_FIBERS 1
constexpr std::size_t kFiberStack = 64 * 1024;  // kernels keep small frames

[[noreturn]] inline void fiber_main(ThreadCtx* t) {
  Launch& L = *g_launch;
  t->state = State::kReady;
  L.thunk(L.args);
  t->state = State::kDone;
  resolve(L);
  void* dead = nullptr;
  bgh_ctx_switch(&dead, L.sched_sp);
  __builtin_unreachable();
}

inline void fiber_init(ThreadCtx& t) {
  // Stack image popped by bgh_ctx_switch: fp control words, r15..r12, rbx, rbp, return address.
  auto top = reinterpret_cast<std::uintptr_t>(t.stack + kFiberStack) & ~std::uintptr_t(15);
  const std::uintptr_t a = top - 16;  // rsp at bgh_ctx_entry: 16-byte aligned before its call
  auto put = [](std::uintptr_t addr, std::uint64_t v) { std::memcpy(reinterpret_cast<void*>(addr), &v, 8); };
  put(a - 8, reinterpret_cast<std::uint64_t>(&bgh_ctx_entry));
  put(a - 16, 0);                                            // rbp
  put(a - 24, 0);                                            // rbx
  put(a - 32, reinterpret_cast<std::uint64_t>(&t));          // r12: argument
  put(a - 40, reinterpret_cast<std::uint64_t>(&fiber_main));  // r13: function
  put(a - 48, 0);                                            // r14
  put(a - 56, 0);                                            // r15
  put(a - 64, 0x1f80);                                       // MXCSR default
  put(a - 72, 0x037f);                                       // x87 control word default
  t.sp = reinterpret_cast<void*>(a - 72);
}

// Runs every thread of the current block as a fiber until all exit or an error is found.
inline void run_block_fibers(Launch& L, unsigned seed) {
  const int n = L.nthreads;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  if (L.schedule == kWarpReverse) std::reverse(order.begin(), order.end());
  std::mt19937 rng(seed);
  for (auto& t : L.threads) fiber_init(t);
  int last = -1;
  for (;;) {
    int pick = -1;
    if (L.schedule == kRandom) {
      std::vector<int> ready;
      for (int i = 0; i < n; ++i)
        if (L.threads[i].state == State::kReady) ready.push_back(i);
      if (!ready.empty()) pick = ready[rng() % ready.size()];
    } else {
      const int start = L.schedule == kRoundRobin ? last + 1 : 0;
      for (int k = 0; k < n; ++k) {
        const int pos = (start + k) % n;
        if (L.threads[order[pos]].state == State::kReady) {
          pick = order[pos];
          last = pos;
          break;
        }
      }
    }
    if (pick < 0) {
      bool all_done = true;
      for (auto& t : L.threads) all_done = all_done && t.state == State::kDone;
      if (all_done) return;
      if (!resolve(L)) {
        fail(L, "deadlock: no thread can make progress");
        return;
      }
      continue;
    }
    cur = &L.threads[pick];
    bgh_ctx_switch(&L.sched_sp, L.threads[pick].sp);
    if (!L.error.empty()) return;  // abandon the remaining fibers of this launch
  }
}
#endif

// Blocks the calling CUDA thread at a barrier or warp operation until it is released.
inline void wait_released(ThreadCtx* me) {
  Launch& L = *g_launch;
  if (L.schedule == kThreads) {
    std::unique_lock<std::mutex> lock(L.mu, std::adopt_lock);
    if (resolve(L) || !L.error.empty()) L.cv.notify_all();
    L.cv.wait(lock, [&] { return me->state == State::kReady || !L.error.empty(); });
    const bool failed = !L.error.empty();
    lock.unlock();
    if (failed) throw Abort{};
    return;
  }
#ifdef BGH_HAVE_FIBERS
  resolve(L);
  bgh_ctx_switch(&me->sp, L.sched_sp);  // the scheduler resumes us only once we are ready
#endif
}

inline void barrier(int line) {
  ThreadCtx* me = cur;
  if (g_launch->schedule == kThreads) g_launch->mu.lock();  // released by wait_released
  me->state = State::kBarrier;
  me->line = line;
  wait_released(me);
}

template <class T>
inline T warp_op(int line, ShflKind kind, unsigned int mask, T value, int arg, int width) {
  static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
  ThreadCtx* me = cur;
  if (g_launch->schedule == kThreads) g_launch->mu.lock();
  me->state = State::kWarpSync;
  me->line = line;
  me->kind = kind;
  me->mask = mask;
  me->arg = arg;
  me->width = width;
  me->size = static_cast<int>(sizeof(T));
  me->value = 0;
  std::memcpy(&me->value, &value, sizeof(T));
  wait_released(me);
  T out;
  std::memcpy(&out, &me->result, sizeof(T));
  return out;
}

// Fault recovery of the fiber schedules: the handler jumps back to launch(), abandoning the
// block's fibers (their stacks are plain memory owned by launch()).
inline sigjmp_buf g_fault_env;
inline volatile int g_fault_armed = 0;
extern "C" inline void bgh_on_fault(int sig) {
  if (!g_fault_armed) {  // not ours: restore the default action and re-raise
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_fault_armed = 0;
  siglongjmp(g_fault_env, sig);
}

// Runs a whole grid. Returns 0, or 1 with a message in err.
inline int launch(void (*thunk)(void**), void** args, dim3 grid, dim3 block, std::size_t smem_bytes,
                  int schedule, int poison, unsigned seed, char* err, std::size_t errlen) {
  Launch L;
  L.thunk = thunk;
  L.args = args;
  L.grid = grid;
  L.block = block;
  L.schedule = schedule;
  L.nthreads = static_cast<int>(block.x * block.y * block.z);
  auto report = [&](const std::string& msg) {
    std::snprintf(err, errlen, "%s", msg.c_str());
    return 1;
  };
  if (L.nthreads <= 0 || L.nthreads > 1024) return report("invalid block size: " + std::to_string(L.nthreads) + " threads");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return report("invalid grid: a dimension is 0");
  if (smem_bytes > 227 * 1024) return report("dynamic shared memory " + std::to_string(smem_bytes) + " B exceeds 227 KiB");
#ifndef BGH_HAVE_FIBERS
  if (schedule != kThreads) return report("fiber schedules need x86-64; use schedule 'threads'");
#endif
  L.smem.resize(smem_bytes);
  L.threads.resize(L.nthreads);
  std::unique_ptr<char[]> stacks;  // uninitialised on purpose: fiber_init writes what is read
#ifdef BGH_HAVE_FIBERS
  if (schedule != kThreads) {
    stacks.reset(new char[static_cast<std::size_t>(L.nthreads) * kFiberStack]);
    for (int i = 0; i < L.nthreads; ++i) L.threads[i].stack = stacks.get() + i * kFiberStack;
  }
#endif
  g_launch = &L;
  struct sigaction on_fault {}, old_segv {}, old_bus {};
  volatile const bool catch_faults = schedule != kThreads;
  if (catch_faults) {
    on_fault.sa_handler = bgh_on_fault;
    sigemptyset(&on_fault.sa_mask);
    on_fault.sa_flags = SA_NODEFER;
    sigaction(SIGSEGV, &on_fault, &old_segv);
    sigaction(SIGBUS, &on_fault, &old_bus);
    if (const int sig = sigsetjmp(g_fault_env, 1)) {
      sigaction(SIGSEGV, &old_segv, nullptr);
      sigaction(SIGBUS, &old_bus, nullptr);
      const std::string who = cur ? describe(*cur) : std::string("a thread");
      g_launch = nullptr;
      return report(std::string("illegal memory access (") + (sig == SIGBUS ? "SIGBUS" : "SIGSEGV") +
                    ") by " + who);
    }
    g_fault_armed = 1;
  }
  const float pattern = poison == kPoisonNaN ? __uint_as_float(0x7fc00000u) : 1.0e30f;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        for (std::size_t i = 0; i + 4 <= L.smem.size(); i += 4) {
          if (poison != kPoisonNone) std::memcpy(&L.smem[i], &pattern, 4);
        }
        for (int i = 0; i < L.nthreads; ++i) {
          ThreadCtx& t = L.threads[i];
          t.linear = i;
          t.thread_idx = dim3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
          t.block_idx = dim3{bx, by, bz};
          t.state = State::kReady;
          t.line = 0;
        }
        if (schedule == kThreads) {
          std::vector<std::thread> pool;
          pool.reserve(L.nthreads);
          for (int i = 0; i < L.nthreads; ++i) {
            pool.emplace_back([&L, i] {
              cur = &L.threads[i];
              try {
                L.thunk(L.args);
              } catch (const Abort&) {
              }
              std::lock_guard<std::mutex> lock(L.mu);
              L.threads[i].state = State::kDone;
              resolve(L);
              L.cv.notify_all();
            });
          }
          for (auto& th : pool) th.join();
        } else {
#ifdef BGH_HAVE_FIBERS
          run_block_fibers(L, seed + bx + 7919u * (by + 7919u * bz));
#endif
        }
        if (!L.error.empty()) {
          g_fault_armed = 0;
          if (catch_faults) {
            sigaction(SIGSEGV, &old_segv, nullptr);
            sigaction(SIGBUS, &old_bus, nullptr);
          }
          g_launch = nullptr;
          return report(L.error);
        }
      }
    }
  }
  g_fault_armed = 0;
  if (catch_faults) {
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
  }
  g_launch = nullptr;
  return 0;
}

}  // namespace bgh

#define threadIdx (::bgh::cur->thread_idx)
#define blockIdx (::bgh::cur->block_idx)
#define blockDim (::bgh::g_launch->block)
#define gridDim (::bgh::g_launch->grid)
#define __syncthreads() ::bgh::barrier(__LINE__)
#define __syncwarp(...) ((void)::bgh::warp_op(__LINE__, ::bgh::ShflKind::kSyncWarp, 0xffffffffu, 0, 0, 32))

template <class T>
inline T bgh_shfl(int line, ::bgh::ShflKind kind, unsigned int mask, T v, int arg, int width = 32) {
  return ::bgh::warp_op(line, kind, mask, v, arg, width);
}
#define __shfl_sync(...) bgh_shfl(__LINE__, ::bgh::ShflKind::kIdx, __VA_ARGS__)
#define __shfl_xor_sync(...) bgh_shfl(__LINE__, ::bgh::ShflKind::kXor, __VA_ARGS__)
#define __shfl_up_sync(...) bgh_shfl(__LINE__, ::bgh::ShflKind::kUp, __VA_ARGS__)
#define __shfl_down_sync(...) bgh_shfl(__LINE__, ::bgh::ShflKind::kDown, __VA_ARGS__)
