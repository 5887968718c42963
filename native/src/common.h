// fluxlike-native: what every op's file uses - oneDNN's CPU engine, shapes in messages, an
// aligned temporary buffer for a primitive's scratchpad (or reordered operands), and a
// row-contiguous copy of a strided operand.
#pragma once

#include <cstdlib>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"
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

// dst[i] = the i-th element of a strided array in row-major order (any strides, negative or
// zero too; MLX does not export its CPU copy to extensions).
template <typename T>
inline void gather(const T* src, T* dst, const mx::Shape& shape, const mx::Strides& strides) {
  size_t n = 1;
  for (auto d : shape) {
    n *= static_cast<size_t>(d);
  }
  int nd = static_cast<int>(shape.size());
  std::vector<int64_t> index(nd, 0);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    dst[i] = src[offset];
    for (int d = nd - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      index[d] = 0;
    }
  }
}

// x's elements in a new row-contiguous array, copied by a task queued on the encoder before
// the kernel that reads it (and kept alive until then as a temporary); float32 or bfloat16.
inline mx::array row_contiguous_copy(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  mx::array copy(x.shape(), x.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  encoder.add_temporary(copy);
  encoder.dispatch([src = x.data<void>(), dst = copy.data<void>(), shape = x.shape(),
                    strides = x.strides(), two = x.itemsize() == 2]() {
    if (two) {
      gather(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), shape, strides);
    } else {
      gather(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), shape, strides);
    }
  });
  return copy;
}

// A primitive's derivatives taken of the same computation written in MLX's ops (`fn`: the
// inputs to the outputs): the cotangents of the inputs in `argnums` (vjp), and the outputs'
// tangents given those of the inputs in `argnums` (jvp; the other inputs held constant).
using OpsFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

inline std::vector<mx::array> vjp_of(const OpsFn& fn, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents,
                                     const std::vector<int>& argnums) {
  auto grads = mx::vjp(fn, primals, cotangents).second;
  std::vector<mx::array> picked;
  for (int arg : argnums) {
    picked.push_back(grads[arg]);
  }
  return picked;
}

inline std::vector<mx::array> jvp_of(const OpsFn& fn, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& tangents,
                                     const std::vector<int>& argnums, mx::Stream s) {
  std::vector<mx::array> full;
  for (const auto& x : primals) {
    full.push_back(mx::zeros_like(x, s));
  }
  for (size_t j = 0; j < argnums.size(); ++j) {
    full[argnums[j]] = tangents[j];
  }
  return mx::jvp(fn, primals, full).second;
}

} // namespace fluxlike_native
