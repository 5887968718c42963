// fluxlike-native: bfloat16 <-> float32 over whole buffers (common.h), for the primitives that
// run bfloat16 operands in float32 kernels. Built for AVX-512 and AVX2 as well, picked at
// load time.

#include "common.h"

#include <cstddef>
#include <cstdint>

namespace fluxlike_native {

FLN_VECTOR_CLONES void widen_all(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = widen(src[i]);
  }
}

FLN_VECTOR_CLONES void narrow_all(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = narrow(src[i]);
  }
}

} // namespace fluxlike_native
