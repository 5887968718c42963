// fluxlike-native: the gradient of a bias, in one pass and one graph node.
#pragma once

#include "primitive.h"

namespace fluxlike_native {

// The gradient of a bias added along the last axis of an output whose cotangent is `g`: g
// summed over its other axes with float32 accumulators, rounded to `round_dt` and given
// `bias_dt` (the bias's dtype): as MLX's ops compute
//   astype(astype(sum(astype(g, float32), leading axes), round_dt), bias_dt),
// bit for bit (MLX's CPU sum adds each column's rows in order into a float32 accumulator,
// half-precision inputs included). `round_dt` float32 (the default) rounds nothing more; a
// bias given a half-precision compute dtype by a fused cast passes it (matmul.cpp).
// On the CPU, where g has at least two rows and two columns, one primitive: MLX's ops make
// three or four nodes (the sum, its squeeze, the casts), a sizeable part of a small model's
// evaluation; elsewhere those ops (a sum over one column MLX orders otherwise).
mx::array bias_grad(const mx::array& g, mx::Dtype bias_dt, mx::StreamOrDevice s = {},
                    mx::Dtype round_dt = mx::float32);

// inputs: {g}; output: shape {g.shape(-1)}, in the bias's dtype.
class BiasGrad : public mx::UnaryPrimitive {
 public:
  BiasGrad(mx::Stream stream, mx::Dtype bias_dt, mx::Dtype round_dt)
      : mx::UnaryPrimitive(stream), bias_dt_(bias_dt), round_dt_(round_dt) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.bias_grad has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_NAME(BiasGrad)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  mx::Dtype bias_dt_;
  mx::Dtype round_dt_;
};

} // namespace fluxlike_native
