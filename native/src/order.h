// fluxlike-native: an ordering dependency for backward passes.
#pragma once

#include <vector>

#include "primitive.h"

namespace fluxlike_native {

// `x`, evaluated only after `deps`: MLX's mx::depends, with output shapes (so that a
// shapeless mx.compile can replay it). Used in backward passes to order the evaluation:
// a layer's parameter gradients are computed while its cotangent is live.
mx::array order_after(const mx::array& x, const std::vector<mx::array>& deps,
                      mx::StreamOrDevice s = {});

// The gradient of a layer's input (the one for argument 0 in `argnums`) made to wait for the
// others (its weight's and bias's): they are computed now, while this layer's cotangent and
// input are live, instead of at the end of the backward pass with every layer's cotangent
// held until then (MLX evaluates depth first, from the outputs). Only where those gradients
// take no more memory than what computing them early frees (`freed`: the bytes of the
// cotangent and the input): a weight used at many steps (a recurrent layer's, tied weights)
// gets one gradient per use, summed by MLX at the end, and computed early they would all be
// held until then (an LSTM's step: 155 MiB at its peak against MLX's 97, where each use's
// weight gradient is 1 MiB and its cotangent and input 160 KiB).
void order_input_grad(std::vector<mx::array>& grads, const std::vector<int>& argnums,
                      size_t freed, mx::StreamOrDevice s = {});

// inputs: {x, *deps}; the output is x's buffer.
class OrderAfter : public mx::UnaryPrimitive {
 public:
  explicit OrderAfter(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  FLN_DEFINE_GRADS()
  // x as it is mapped, after the (mapped or not) deps; an unmapped x is broadcast over the
  // mapped axis (MLX's vmap takes no unmapped output of a mapped computation).
  FLN_DEFINE_VMAP()
  FLN_DEFINE_INPUT_OUTPUT_SHAPE()
  FLN_DEFINE_NAME(OrderAfter)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

} // namespace fluxlike_native
