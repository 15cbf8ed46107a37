// What every JSON line of a standalone CUDA benchmark carries besides its numbers: the device's
// name and the date, with COMMIT and COMMAND from the command line (usage: BENCH OUT.jsonl
// COMMIT COMMAND; bench_dram_pattern, bench_int4_pattern). CK: a failed CUDA call prints its
// error and exits.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

struct BenchRecord {
  FILE* out = nullptr;  // argv[1], appended to
  cudaDeviceProp prop{};
  char date[32] = {};  // UTC, strftime(date_format)
  const char* commit = "";
  const char* command = "";
};

// False (after printing the usage) when the arguments are missing or OUT cannot be opened.
inline bool open_bench_record(int argc, char** argv, const char* date_format, BenchRecord& r) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s OUT.jsonl COMMIT COMMAND\n", argv[0]);
    return false;
  }
  r.out = std::fopen(argv[1], "a");
  if (!r.out) {
    std::fprintf(stderr, "%s: cannot open %s\n", argv[0], argv[1]);
    return false;
  }
  CK(cudaGetDeviceProperties(&r.prop, 0));
  const std::time_t now = std::time(nullptr);
  std::strftime(r.date, sizeof r.date, date_format, std::gmtime(&now));
  r.commit = argv[2], r.command = argv[3];
  return true;
}
