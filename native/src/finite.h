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
// The same check of n values of `dtype` (float32, bfloat16 or float16) at `data`, as a task
// runs it.
bool all_finite(const void* data, size_t n, mx::Dtype dtype);

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

// `flag ? taken : kept` for a 0-d bool `flag` and two arrays of one shape and dtype: the
// selection that keeps a training step's parameters and optimiser state where its gradients
// are not finite. mx.where reads both and writes a third array (on a 4 x 2048 x 2048 MLP's
// Adam step, 32 of 53 ms); here, where `taken` is dense and nothing else holds it (an
// optimiser's fresh output), the result takes over its buffer and is overwritten with `kept`
// only if the flag is false: nothing is read or written on a kept step. Otherwise one copy of
// the chosen array. Derivatives: those of mx.where (the flag's none).
mx::array keep_if(const mx::array& flag, const mx::array& taken, const mx::array& kept,
                  mx::StreamOrDevice s = {});

class KeepIf : public mx::UnaryPrimitive {
 public:
  explicit KeepIf(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.keep_if has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }
  FLN_DEFINE_NAME(KeepIf)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()
};

} // namespace fluxlike_native
