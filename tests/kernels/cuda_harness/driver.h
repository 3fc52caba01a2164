// Stand-alone driver for sanitizer runs: the kernel module is built as an executable (with
// -fsanitize=thread or address) instead of being loaded into Python, and one launch is read from
// a request file written by the Python loader:
//   kernel NAME / grid X Y Z / block X Y Z / smem BYTES / schedule S / poison P / seed N
//   arg buf PATH NBYTES | arg i32 V | arg i64 V | arg f32 BITS
// Each buffer is read from PATH into a heap allocation of exactly NBYTES (so AddressSanitizer
// bounds it) and written back to PATH after the launch. Exit status: 0 success, 3 harness error
// (message on stderr), 2 bad request; sanitizer reports use the sanitizer's own exit status.
#pragma once
#include <fstream>
#include <sstream>

struct BghKernelEntry {
  const char* name;
  void (*thunk)(void**);
};

inline int bgh_driver_main(int argc, char** argv, const BghKernelEntry* table, int count) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s REQUEST\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  std::string word, kernel;
  dim3 grid{1, 1, 1}, block{1, 1, 1};
  std::size_t smem = 0;
  int schedule = ::bgh::kThreads, poison = ::bgh::kPoisonNaN;
  unsigned seed = 0;
  struct Buf {
    std::string path;
    std::vector<unsigned char> data;
  };
  std::vector<Buf> bufs;
  std::vector<std::uint64_t> scalars;
  std::vector<int> kinds;  // 0 = buffer index, 1 = scalar index
  std::vector<int> where;
  while (in >> word) {
    if (word == "kernel") {
      in >> kernel;
    } else if (word == "grid") {
      in >> grid.x >> grid.y >> grid.z;
    } else if (word == "block") {
      in >> block.x >> block.y >> block.z;
    } else if (word == "smem") {
      in >> smem;
    } else if (word == "schedule") {
      in >> schedule;
    } else if (word == "poison") {
      in >> poison;
    } else if (word == "seed") {
      in >> seed;
    } else if (word == "arg") {
      std::string kind;
      in >> kind;
      if (kind == "buf") {
        Buf b;
        std::size_t n = 0;
        in >> b.path >> n;
        b.data.resize(n);
        std::ifstream f(b.path, std::ios::binary);
        f.read(reinterpret_cast<char*>(b.data.data()), static_cast<std::streamsize>(n));
        if (!f) {
          std::fprintf(stderr, "cannot read %zu bytes from %s\n", n, b.path.c_str());
          return 2;
        }
        kinds.push_back(0);
        where.push_back(static_cast<int>(bufs.size()));
        bufs.push_back(std::move(b));
      } else {
        std::uint64_t bits = 0;
        if (kind == "i32") {
          long long v;
          in >> v;
          const std::int32_t x = static_cast<std::int32_t>(v);
          std::memcpy(&bits, &x, 4);
        } else if (kind == "i64") {
          long long v;
          in >> v;
          std::memcpy(&bits, &v, 8);
        } else if (kind == "f32") {
          std::uint32_t v;
          in >> v;
          std::memcpy(&bits, &v, 4);
        } else {
          std::fprintf(stderr, "unknown argument kind %s\n", kind.c_str());
          return 2;
        }
        kinds.push_back(1);
        where.push_back(static_cast<int>(scalars.size()));
        scalars.push_back(bits);
      }
    } else {
      std::fprintf(stderr, "unknown request word %s\n", word.c_str());
      return 2;
    }
  }
  void (*thunk)(void**) = nullptr;
  for (int i = 0; i < count; ++i)
    if (kernel == table[i].name) thunk = table[i].thunk;
  if (!thunk) {
    std::fprintf(stderr, "no kernel named %s\n", kernel.c_str());
    return 2;
  }
  // Kernel parameters are addresses of the argument values, as cuLaunchKernel takes them.
  std::vector<void*> ptrs(kinds.size());
  std::vector<void*> args(kinds.size());
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == 0) {
      ptrs[i] = bufs[where[i]].data.data();
      args[i] = &ptrs[i];
    } else {
      args[i] = &scalars[where[i]];
    }
  }
  char err[1024] = {0};
  const int rc = ::bgh::launch(thunk, args.data(), grid, block, smem, schedule, poison, seed, err, sizeof err);
  if (rc != 0) {
    std::fprintf(stderr, "%s\n", err);
    return 3;
  }
  for (auto& b : bufs) {
    std::ofstream f(b.path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b.data.data()), static_cast<std::streamsize>(b.data.size()));
  }
  return 0;
}
