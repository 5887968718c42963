// fluxlike-native: whether every element of several arrays is finite, as one primitive - the
// check a training step makes of its gradients before it keeps the step.
#pragma once

#include <vector>

#include "primitive.h"

namespace fluxlike_native {

// A 0-d bool: whether no element of `xs` (float32, bfloat16 or float16 arrays of any shapes;
// at least one) is inf or nan. In MLX's ops that is, per array, isfinite, all, and the ands
// between them: 2n + 1 graph nodes (a step of a small model spends a sizeable part of its
// time scheduling nodes); here one node and one pass over the bits, branch-free, on OpenMP's
// threads for a large total. Its derivatives are zero (the output is a bool).
mx::array all_finite(const std::vector<mx::array>& xs, mx::StreamOrDevice s = {});

class AllFinite : public mx::UnaryPrimitive {
 public:
  explicit AllFinite(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.all_finite has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return {mx::Shape{}};
  }
  FLN_DEFINE_NAME(AllFinite)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

} // namespace fluxlike_native
