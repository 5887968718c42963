// fluxlike-native: the ReLU the matmul and convolution primitives fuse - its forward pass
// after the kernel, and its backward pass as a primitive of its own.
#pragma once

#include <cstddef>

#include "primitive.h"

namespace fluxlike_native {

// max(y, 0) in place on n values of dtype `dt` (float32, bfloat16 or float16), as MLX's
// maximum computes it: NaN stays NaN. The primitives apply their fused ReLU with it after
// oneDNN's kernel, not as oneDNN's ReLU post-op, a vmaxps that returns 0 for NaN (a diverged
// layer would look finite).
void relu_keeping_nan(void* y, size_t n, mx::Dtype dt);

// relu'(y) * g: `g` where `y > 0`, else 0, in one pass (g and y of one shape, float32,
// bfloat16 or float16 each; the result has g's dtype). The backward pass of a fused ReLU.
mx::array relu_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s = {});

class ReluGrad : public mx::UnaryPrimitive {
 public:
  explicit ReluGrad(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.relu_grad has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  FLN_DEFINE_NAME(ReluGrad)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

} // namespace fluxlike_native
