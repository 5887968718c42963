// fluxlike-native: GELU (exact form, x * Phi(x)) and its derivative as vectorised passes.
// MLX's CPU erf and exp are scalar on the Linux wheel (GELU forward and backward took about
// half of a small transformer's training step); these compute the same function with MLX's
// approximation of erf, eight lanes at a time.
#pragma once

#include "primitive.h"

namespace fluxlike_native {

// gelu(x) = x * Phi(x), Phi the standard normal distribution function, for float32, bfloat16
// or float16 x (computed in float32, rounded once). Phi by Abramowitz and Stegun 7.1.26, the
// approximation MLX's erf uses (|error| <= 1.5e-7), written as the tail erfc(|x| / sqrt 2) / 2
// so that negative x keep their relative accuracy (MLX's 1 + erf(z) cancels there). Special
// values as MLX's nn.gelu: gelu(inf) = inf, gelu(-inf) = NaN (-inf * 0), NaN stays NaN.
mx::array gelu(const mx::array& x, mx::StreamOrDevice s = {});

// g * gelu'(x) = g * (Phi(x) + x phi(x)) (g and x of one shape and dtype): gelu's backward pass.
// Its own derivatives (second order) are MLX's ops, with MLX's erf.
mx::array gelu_grad(const mx::array& g, const mx::array& x, mx::StreamOrDevice s = {});

class Gelu : public mx::UnaryPrimitive {
 public:
  explicit Gelu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.gelu has no GPU kernel: use mlx.nn.gelu there")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  FLN_DEFINE_NAME(Gelu)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

class GeluGrad : public mx::UnaryPrimitive {
 public:
  explicit GeluGrad(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.gelu_grad has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  FLN_DEFINE_NAME(GeluGrad)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

} // namespace fluxlike_native
