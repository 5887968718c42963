// fluxlike-native: the CPU as oneDNN sees it (its ISA, its version) and OpenMP's thread count
// while a primitive is created.
#pragma once

#include <string>

namespace fluxlike_native {

// oneDNN's effective ISA (respects ONEDNN_MAX_CPU_ISA), e.g. "avx512_core_bf16".
std::string cpu_isa();
// Whether oneDNN has bf16 dot-product kernels on this CPU (avx512_core_bf16 or better).
bool isa_has_bf16();
// Whether oneDNN has AVX-512 (core) kernels on this CPU.
bool isa_has_avx512();
// oneDNN's version, "major.minor.patch".
std::string onednn_version();

// Primitives for problems below this many multiply-adds are created on one OpenMP thread,
// so they also run on one: on two shared cores an OpenMP barrier can wait a whole
// scheduler tick (milliseconds) for a preempted team thread, far longer than the work.
constexpr double SINGLE_THREAD_MACS = 1 << 20;

// While alive (and `on`), oneDNN primitives created on this thread use one thread.
class OneThread {
 public:
  explicit OneThread(bool on);
  ~OneThread();
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_ = -1;
};

} // namespace fluxlike_native
