// fluxlike-native: the Adam (and AdamW) and RMSprop updates of one parameter as MLX
// primitives (CPU): one vectorised, threaded pass over the parameter, its gradient and its
// moments. MLX's CPU kernel compiler leaves the same arithmetic scalar (its sqrt may set
// errno; see bench/jit.py), and eagerly it is about ten ops, each a pass over memory.
#pragma once

#include <optional>
#include <vector>

#include "primitive.h"

namespace fluxlike_native {

// What mlx.optimizers.Adam(bias_correction=True).apply_single computes, bit for bit (each
// operation in float32 in its order, no fused multiply-add, its result rounded to the
// parameter's dtype, float32 or bfloat16, as MLX's CPU ops round it):
//
//   p  = p * decay                       (AdamW: decay = 1 - lr * weight_decay; else none)
//   m' = b1 * m + (1 - b1) * g
//   v' = b2 * v + (1 - b2) * g * g
//   p' = p - (c1 * m') / (sqrt(v') * c2 + eps)
//
// with c1 = lr / (1 - b1^t) and c2 = rsqrt(1 - b2^t) given as scalars of the parameter's dtype
// (arrays of one element, computed in the graph: a schedule's learning rate and the step
// count change them). b1, b2 and eps are the optimiser's Python floats; 1 - b1 and 1 - b2 are
// taken in double, as Python does, and all are then rounded to float32 (and to bfloat16 for a
// bfloat16 parameter), as MLX makes a Python float an array. p, g, m and v are arrays of one
// shape and dtype. Returns {p', m', v'}; with `keep` (a 0-d bool, read when the pass runs)
// false, {p, m, v} themselves: a training step that keeps its state where its gradients are
// not finite needs no selection of its own afterwards (mx.where over every parameter and
// moment: on a 4 x 2048 x 2048 MLP, Intel Xeon, 22 ms of a 43 ms update).
std::vector<mx::array> adam_step(
    const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
    const mx::array& c1, const mx::array& c2, const std::optional<mx::array>& decay,
    double b1, double b2, double eps, const std::optional<mx::array>& keep = std::nullopt,
    mx::StreamOrDevice s = {});

// What the update primitives share: their derivatives are those of the same formula in MLX's
// ops (`reference`: an update differentiated through, as in meta-learning, gets MLX's
// derivatives), and they run on the CPU only.
class UpdateStep : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  // The update in MLX's ops: the outputs of the primitive from its inputs.
  virtual std::vector<mx::array> reference(const std::vector<mx::array>& inputs) = 0;

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  FLN_DEFINE_GRADS()
};

// inputs: {p, g, m, v, c1, c2}, then decay (AdamW) and keep where given; outputs {p', m', v'}.
class AdamStep : public UpdateStep {
 public:
  AdamStep(mx::Stream stream, float b1, float one_minus_b1, float b2, float one_minus_b2,
           float eps, bool has_keep = false)
      : UpdateStep(stream), b1_(b1), omb1_(one_minus_b1), b2_(b2), omb2_(one_minus_b2),
        eps_(eps), has_keep_(has_keep) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  // Elementwise: the mapped axis moves to the front (broadcast where an operand is not
  // mapped), then the same kernel; scalars mapped too (one learning rate per member) take
  // the formula in MLX's ops.
  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape(), inputs[0].shape()};
  }
  FLN_DEFINE_NAME(AdamStep)
  // The constants only: mx.compile merges two steps only if their inputs are the same too
  // (the same arrays, hence the same count and dtypes).
  FLN_DEFINE_IS_EQUIVALENT()

  // The same update in MLX's ops (what the derivatives are taken of, and the reference the
  // tests hold the kernel to).
  std::vector<mx::array> reference(const std::vector<mx::array>& inputs) override;

 private:
  float b1_, omb1_, b2_, omb2_, eps_;
  bool has_keep_;  // a last input, a 0-d bool: false gives p, m and v back unchanged
};

// What mlx.optimizers.RMSprop.apply_single computes, bit for bit (as adam_step: each
// operation in float32, rounded to the parameter's dtype):
//
//   v' = alpha * v + (1 - alpha) * g * g
//   p' = p - (lr * g) / (sqrt(v') + eps)
//
// lr a 0-d array of the parameter's dtype; alpha and eps the optimiser's Python floats.
// Returns {p', v'}.
std::vector<mx::array> rmsprop_step(
    const mx::array& p, const mx::array& g, const mx::array& v, const mx::array& lr,
    double alpha, double eps, mx::StreamOrDevice s = {});

// inputs: {p, g, v, lr}; outputs {p', v'}.
class RmsPropStep : public UpdateStep {
 public:
  RmsPropStep(mx::Stream stream, float alpha, float one_minus_alpha, float eps)
      : UpdateStep(stream), alpha_(alpha), oma_(one_minus_alpha), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }
  FLN_DEFINE_NAME(RmsPropStep)
  FLN_DEFINE_IS_EQUIVALENT()

  std::vector<mx::array> reference(const std::vector<mx::array>& inputs) override;

 private:
  float alpha_, oma_, eps_;
};

} // namespace fluxlike_native
