// fluxlike-native: the CPU as oneDNN sees it (its ISA, its version) and OpenMP's thread count
// while a primitive is created.
#pragma once

#include <string>

namespace fluxlike_native {

// oneDNN's effective ISA (respects ONEDNN_MAX_CPU_ISA), e.g. "avx512_core_bf16".
std::string cpu_isa();
// Whether oneDNN has bf16 dot-product kernels on this CPU (avx512_core_bf16 or better).
bool isa_has_bf16();
// Whether oneDNN has float16 kernels that convert with AVX512-FP16 and accumulate in float32
// (avx512_core_fp16 or better), as fast as its float32 ones.
bool isa_has_fp16();
// Whether float16 products and convolutions run in those kernels (isa_has_fp16(), unless
// set_native_f16(false) - FLUXLIKE_NATIVE_F16=float32 - holds them to float32 kernels, which
// round results the same way).
bool native_f16();
// Sets it (true takes effect only where isa_has_fp16()); returns the old setting.
bool set_native_f16(bool on);
// Whether oneDNN has AVX-512 (core) kernels on this CPU.
bool isa_has_avx512();
// Whether oneDNN's bfloat16 kernels run on AMX tiles on this CPU (avx512_core_amx or better).
bool isa_has_amx();
// oneDNN's version, "major.minor.patch".
std::string onednn_version();

// Primitives for problems below this many multiply-adds are created on one OpenMP thread,
// and run on one (engine.h: Prepared::one_thread): on two shared cores an OpenMP barrier can
// wait a whole scheduler tick (milliseconds) for a preempted team thread, far longer than
// the work. 2**22 (bench/onethread.py, AMD EPYC Zen 3, AVX2, 2 cores, 2026-12-04): alone a
// float32 GEMM gains from a second thread from ~2**21 (1.2x at 2**22, 1.6-2x from 2**23);
// beside one busy process one thread is as fast or faster up to 2**24; over training steps
// of the seed MLP, the small CNN and a charlm-sized LM, 2**22 was the best compromise.
constexpr double SINGLE_THREAD_MACS = 1 << 22;

// A bfloat16 product on AMX tiles counts 1/AMX_MACS_SCALE of its multiply-adds against the
// threshold: per thread it runs ~6x faster than float32 on AVX-512, and waking a sleeping
// second thread (OpenMP's passive wait) costs ~50 us on these VMs. In-graph products, Intel
// Xeon with AMX, 2 cores, 2026-12-04 (bench/results/2026-12-04-amx.md), one thread against
// two, us: 2**20 multiply-adds 8 / 62, 2**23 28 / 74, 2**26 117 / 152, 2**27 231 / 229,
// 2**28 449 / 346.
constexpr double AMX_MACS_SCALE = 32;

// The threshold in use (SINGLE_THREAD_MACS unless set_single_thread_macs changed it).
double single_thread_macs();
// Whether a kernel of `macs` multiply-adds runs on one thread: below the threshold, a
// bfloat16 one on AMX (`amx_bf16`) counted at 1/AMX_MACS_SCALE.
bool one_thread_for(double macs, bool amx_bf16 = false);
// Sets it; returns the old one. Primitives already cached keep the thread count they were
// created with (the binding clears the cache).
double set_single_thread_macs(double macs);
// OpenMP's thread count for a parallel region started on this thread now (1 without libgomp).
int omp_max_threads();

// While alive, OpenMP regions started on this thread, and oneDNN primitives created on it,
// use `threads` threads (0: unchanged).
class OmpThreads {
 public:
  explicit OmpThreads(int threads);
  ~OmpThreads();
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int saved_ = -1;
};

// While alive (and `on`), one thread (as OmpThreads(1)).
class OneThread : public OmpThreads {
 public:
  explicit OneThread(bool on) : OmpThreads(on ? 1 : 0) {}
};

} // namespace fluxlike_native
