// fluxlike-native: the gradient of a bias, in one pass and one graph node.
#pragma once

#include "primitive.h"

namespace fluxlike_native {

// The gradient of a bias added along the last axis of an output whose cotangent is `g`: g
// summed over its other axes with float32 accumulators, rounded to `round_dt` and given
// `bias_dt` (the bias's dtype): what MLX's ops compute,
//   astype(astype(sum(astype(g, float32), leading axes), round_dt), bias_dt),
// each column's rows added in row-major order into a float32 accumulator. For a cotangent
// that is row-major in memory (a product's or convolution's output, the usual case) or a
// 2-D view, that is MLX's CPU sum bit for bit (it adds rows in order, half-precision inputs
// included); for another view of three or more axes (a transposed output's cotangent) MLX
// adds in memory order, which can differ in the last bits, and where NaNs of both signs meet
// in a column the result's sign may differ. `round_dt` float32 (the default) rounds nothing
// more; a bias given a half-precision compute dtype by a fused cast passes it (matmul.cpp).
// On the CPU, where g has at least two rows and two columns, one primitive: MLX's ops make
// three or four nodes (the sum, its squeeze, the casts), a sizeable part of a small model's
// evaluation; elsewhere those ops (a sum over one column MLX orders otherwise).
mx::array bias_grad(const mx::array& g, mx::Dtype bias_dt, mx::StreamOrDevice s = {},
                    mx::Dtype round_dt = mx::float32);

// y[r, c] += bias[c] for a row-major float32 (rows, cols) y: the bias after a product or a
// convolution computed without one (vectorised for AVX-512, AVX2 and baseline, picked at load
// time: the lambda it replaced ran at 0.6 ns an entry, a third of a small convolution).
void add_bias_float32(float* y, const float* bias, size_t rows, size_t cols);

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
