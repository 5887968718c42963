// fluxlike-native: casts between float32, bfloat16 and float16 in one vectorised pass.
#pragma once

#include "primitive.h"

namespace fluxlike_native {

// x as dtype `dt`, as mx::astype gives it bit for bit (widened exactly, narrowed to nearest
// even, NaN as MLX's casts give it), where x and dt are float32, bfloat16 or float16 and the
// stream is the CPU's; elsewhere (or when x already has dtype `dt`) mx::astype itself. MLX's
// CPU casts to and from float16 convert one value at a time in software (1.95 ms to narrow
// 800,000 values on an AVX2 EPYC); these use F16C, eight at a time (0.14 ms), and bfloat16's
// bit operations vectorised (0.15 against MLX's 0.33).
mx::array convert(const mx::array& x, mx::Dtype dt, mx::StreamOrDevice s = {});

class Convert : public mx::UnaryPrimitive {
 public:
  explicit Convert(mx::Stream stream, mx::Dtype dt) : mx::UnaryPrimitive(stream), dt_(dt) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.convert has no GPU kernel: use mx.astype there")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  FLN_DEFINE_NAME(Convert)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  mx::Dtype dt_;
};

} // namespace fluxlike_native
