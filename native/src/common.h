// fluxlike-native: what every op's file uses - oneDNN's CPU engine, shapes in messages, and
// an aligned temporary buffer for a primitive's scratchpad (or reordered operands).
#pragma once

#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mx = mlx::core;

// Elementwise passes are built for AVX-512 and AVX2 too (GCC picks one when the module loads):
// the module itself targets the baseline x86-64.
#define FLN_VECTOR_CLONES __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))

namespace fluxlike_native {

// The one oneDNN CPU engine of the process.
inline dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

// "(2, 3)", "(4,)": a shape as Python writes a tuple, for error messages.
inline std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) {
    os << s[i] << (s.size() == 1 ? "," : (i + 1 < s.size() ? ", " : ""));
  }
  os << ")";
  return os.str();
}

inline std::string vec_str(const std::vector<int>& v) {
  return shape_str(mx::Shape(v.begin(), v.end()));
}

// `bytes` of 64-byte-aligned memory (none for 0), freed on scope exit; `fn` and `what` name
// it when there is no memory for it.
struct Buffer {
  void* p = nullptr;
  Buffer(size_t bytes, const char* fn, const char* what = "oneDNN's scratchpad") {
    if (bytes > 0) {
      p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      if (p == nullptr) {
        throw std::runtime_error(std::string(fn) + ": out of memory for " + what);
      }
    }
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

} // namespace fluxlike_native
