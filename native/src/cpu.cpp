// fluxlike-native: the CPU as oneDNN sees it, and OpenMP's thread count (see cpu.h).

#include "cpu.h"

#include <dlfcn.h>

#include <atomic>
#include <sstream>

#include "oneapi/dnnl/dnnl.hpp"

namespace fluxlike_native {

namespace {

// OpenMP's thread count, through the libgomp that oneDNN loaded.
struct Omp {
  int (*get_max_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
  Omp() {
    void* lib = dlopen("libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (lib != nullptr) {
      get_max_threads = reinterpret_cast<int (*)()>(dlsym(lib, "omp_get_max_threads"));
      set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(lib, "omp_set_num_threads"));
      if (get_max_threads == nullptr || set_num_threads == nullptr) {
        get_max_threads = nullptr;
        set_num_threads = nullptr;
      }
    }
  }
};

const Omp& omp() {
  static Omp o;
  return o;
}

std::atomic<double> threshold{SINGLE_THREAD_MACS};

} // namespace

double single_thread_macs() {
  return threshold.load(std::memory_order_relaxed);
}

double set_single_thread_macs(double macs) {
  return threshold.exchange(macs);
}

int omp_max_threads() {
  return omp().get_max_threads != nullptr ? omp().get_max_threads() : 1;
}

OmpThreads::OmpThreads(int threads) {
  if (threads > 0 && omp().set_num_threads != nullptr) {
    saved_ = omp().get_max_threads();
    omp().set_num_threads(threads);
  }
}

OmpThreads::~OmpThreads() {
  if (saved_ > 0) {
    omp().set_num_threads(saved_);
  }
}

std::string cpu_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    default: return "default";
  }
}

bool isa_has_fp16() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_fp16:
    case dnnl::cpu_isa::avx512_core_amx:
    case dnnl::cpu_isa::avx512_core_amx_fp16:
      return true;
    default:
      return false;
  }
}

bool isa_has_bf16() {  // (every ISA with float16 kernels has bfloat16 ones)
  return isa_has_fp16() || dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_bf16;
}

namespace {
std::atomic<bool> g_native_f16{true};
} // namespace

bool native_f16() {
  return g_native_f16.load(std::memory_order_relaxed) && isa_has_fp16();
}

bool set_native_f16(bool on) {
  return g_native_f16.exchange(on);
}

bool isa_has_avx512() {
  return isa_has_bf16() || dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core ||
      dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_vnni;
}

bool isa_has_amx() {
  auto isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_amx || isa == dnnl::cpu_isa::avx512_core_amx_fp16;
}

bool one_thread_for(double macs, bool amx_bf16) {
  return (amx_bf16 && isa_has_amx() ? macs / AMX_MACS_SCALE : macs) < single_thread_macs();
}

std::string onednn_version() {
  auto v = dnnl::version();
  std::ostringstream os;
  os << v->major << "." << v->minor << "." << v->patch;
  return os.str();
}

} // namespace fluxlike_native
