// fluxlike-native: sigmoid, tanh and exp, and their derivatives, as vectorised passes. MLX's
// CPU exp and tanh are scalar on the Linux wheel (about 30 ns an entry against 0.4 for an
// add): an LSTM's gates were a third of its training step; a language model's cross entropy
// over a vocabulary of 4096 at 512 tokens took 66 ms, forward and backward.
#pragma once

#include "primitive.h"

namespace fluxlike_native {

enum class Logistic { Sigmoid, Tanh, Exp };

// sigmoid(x) = 1 / (1 + exp(-x)) or tanh(x), for float32, bfloat16 or float16 x (computed in
// float32, rounded once), within 3 ulp of the exact function in float32 (dense sweeps: sigmoid
// 2.9, tanh 1.6). Both from
// t = exp(-|x|) (sigmoid) or exp(-2|x|) (tanh) with exp_nonpositive (common.h), which never
// overflows: sigmoid = 1 / (1 + t) or t / (1 + t) by x's sign; tanh = sign(x) (1 - t) / (1 + t)
// from |x| = 0.625, below it Cephes' odd polynomial (no cancellation in 1 - t). Special values
// as MLX's: sigmoid(inf) = 1, sigmoid(-inf) = 0, tanh(+-inf) = +-1, tanh(-0) = -0, NaN stays
// NaN. (sigmoid below -87.3365: 0, where the exact value is subnormal or just above.) Exp:
// exp(x) by exp_float32 (common.h), within 1 ulp of the exact value where it is normal (the
// losses' and logsumexp's exponentials, of values shifted by their maximum), subnormal
// results within a subnormal ulp, inf from 88.73, exp(-inf) = 0, NaN stays NaN.
mx::array logistic(const mx::array& x, Logistic kind, mx::StreamOrDevice s = {});

// The backward pass from the output y = f(x): g * y (1 - y) (sigmoid), g * (1 - y^2) (tanh)
// or g * y (exp), as MLX's own vjp of mx.sigmoid / mx.tanh / mx.exp takes it, in float32, rounded once (g and y of one
// shape and dtype). Its own derivatives are MLX's ops.
mx::array logistic_grad(const mx::array& g, const mx::array& y, Logistic kind,
                        mx::StreamOrDevice s = {});

class LogisticPrimitive : public mx::UnaryPrimitive {
 public:
  LogisticPrimitive(mx::Stream stream, Logistic kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.sigmoid/tanh/exp have no GPU kernel: use "
                           "mx.sigmoid, mx.tanh, mx.exp there")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  const char* name() const override {
    return kind_ == Logistic::Sigmoid ? "FluxlikeNativeSigmoid"
        : kind_ == Logistic::Tanh     ? "FluxlikeNativeTanh"
                                      : "FluxlikeNativeExp";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const LogisticPrimitive&>(other).kind_;
  }

 private:
  Logistic kind_;
};

class LogisticGrad : public mx::UnaryPrimitive {
 public:
  LogisticGrad(mx::Stream stream, Logistic kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native's sigmoid/tanh/exp gradients have no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  const char* name() const override {
    return kind_ == Logistic::Sigmoid ? "FluxlikeNativeSigmoidGrad"
        : kind_ == Logistic::Tanh     ? "FluxlikeNativeTanhGrad"
                                      : "FluxlikeNativeExpGrad";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const LogisticGrad&>(other).kind_;
  }

 private:
  Logistic kind_;
};

} // namespace fluxlike_native
