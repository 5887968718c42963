// fluxlike-native: oneDNN's softmax over the last axis as an MLX primitive (CPU), forward
// and backward. MLX's CPU softmax runs a scalar exp (the Linux wheel is built without AVX);
// oneDNN's is vectorised.
#pragma once

#include <vector>

#include "primitive.h"

namespace fluxlike_native {

// softmax(x) over the last axis of a float32 array (oneDNN's softmax_accurate: the row's
// maximum subtracted first, as mx.softmax(precise=True)); any leading axes.
mx::array softmax(const mx::array& x, mx::StreamOrDevice s = {});

// The softmax's backward pass, y * (g - sum(g * y, last axis)) for y = softmax(x), float32.
mx::array softmax_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s = {});

// Whether oneDNN's softmax backward pass is its reference implementation on this CPU (oneDNN
// 3.2 below AVX-512: `ref:any`, scalar, 3.6 ms at 4096x128 on AMD EPYC Zen 3 against 0.4 for
// the forward pass). Then the backward pass always runs the vectorised loops of softmax.cpp,
// whatever the shape or matmul mode, and makes no primitive.
bool softmax_backward_is_reference();

// inputs: {x} (forward) or {g, y} (backward).
class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream stream, bool backward) : mx::UnaryPrimitive(stream), backward_(backward) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.softmax has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()

  const char* name() const override {
    return backward_ ? "FluxlikeNativeSoftmaxGrad" : "FluxlikeNativeSoftmax";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return backward_ == static_cast<const Softmax&>(other).backward_;
  }

 private:
  bool backward_;
};

// log(sum(exp(x - top))) over the last axis of a float32 array: top (the row's maximum, with
// the last axis kept, shape x.shape[:-1] + [1]; the caller's, its gradient stopped) given, the
// result of top's shape. One vectorised pass (exp_float32, eight partial sums) that stores no
// exponential, and no oneDNN primitive: MLX's logsumexp runs a scalar exp on the CPU, forward
// and backward. Taken literally: a row of
// -inf against a top of 0 gives -inf, a +inf or NaN in the row inf or NaN. Its gradient in x
// is g * exp(x - top - out) (one pass, log_sum_exp_grad), in top -g.
mx::array log_sum_exp(const mx::array& x, const mx::array& top, mx::StreamOrDevice s = {});
mx::array log_sum_exp_grad(const mx::array& g, const mx::array& x, const mx::array& top,
                           const mx::array& out, mx::StreamOrDevice s = {});

// inputs: {x, top} (forward) or {g, x, top, out} (backward: the result of x's shape).
class LogSumExp : public mx::UnaryPrimitive {
 public:
  LogSumExp(mx::Stream stream, bool backward) : mx::UnaryPrimitive(stream), backward_(backward) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.log_sum_exp has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};  // top's (forward), x's (backward)
  }
  const char* name() const override {
    return backward_ ? "FluxlikeNativeLogSumExpGrad" : "FluxlikeNativeLogSumExp";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return backward_ == static_cast<const LogSumExp&>(other).backward_;
  }

 private:
  bool backward_;
};

} // namespace fluxlike_native
