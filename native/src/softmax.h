// fluxlike-native: oneDNN's softmax over the last axis as an MLX primitive (CPU), forward
// and backward. MLX's CPU softmax runs a scalar exp (the Linux wheel is built without AVX);
// oneDNN's is vectorised.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace fluxlike_native {

// softmax(x) over the last axis of a float32 array (oneDNN's softmax_accurate: the row's
// maximum subtracted first, as mx.softmax(precise=True)); any leading axes.
mx::array softmax(const mx::array& x, mx::StreamOrDevice s = {});

// The softmax's backward pass, y * (g - sum(g * y, last axis)) for y = softmax(x), float32.
mx::array softmax_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s = {});

size_t softmax_cache_size();
void softmax_clear_cache();

// inputs: {x} (forward) or {g, y} (backward).
class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream stream, bool backward) : mx::UnaryPrimitive(stream), backward_(backward) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override {
    return backward_ ? "FluxlikeNativeSoftmaxGrad" : "FluxlikeNativeSoftmax";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return backward_ == static_cast<const Softmax&>(other).backward_;
  }

 private:
  bool backward_;
};

} // namespace fluxlike_native
