// fluxlike-native: oneDNN max pooling (channels-last, 1-3 spatial axes) as MLX primitives.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace fluxlike_native {

struct PoolParams {
  std::vector<int> kernel, stride, pad_lo, pad_hi;  // one per spatial axis
  bool operator==(const PoolParams& o) const {
    return kernel == o.kernel && stride == o.stride && pad_lo == o.pad_lo &&
        pad_hi == o.pad_hi;
  }
};

// The maximum over each window of x (N, *spatial, C) -> (N, *out, C), out = (spatial +
// pad_lo + pad_hi - kernel) / stride + 1; padded entries are ignored (never the maximum).
// float32 or bfloat16 (native_bf16 == false: bfloat16 through float32 kernels; the maximum
// is exact either way). Its gradient sends each output's cotangent to the first maximum of
// its window (oneDNN's workspace records which), as PyTorch does.
mx::array max_pool(const mx::array& x, const PoolParams& p, bool native_bf16,
                   mx::StreamOrDevice s = {});

size_t pool_cache_size();
void pool_clear_cache();
std::vector<std::pair<std::string, int>> pool_cache_impls();

// Forward: x -> (y, workspace); the workspace (uint8, or int32 for windows of 256 entries
// or more, y's shape) says where each window's maximum is, for the backward pass.
class MaxPool : public mx::Primitive {
 public:
  MaxPool(mx::Stream stream, PoolParams p) : mx::Primitive(stream), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

  // The mapped axis folded into the batch (see vmap_rows).
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "FluxlikeNativeMaxPool";
  }

  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  PoolParams p_;
};

// Backward: (dy, workspace) -> dx of x's shape (its spatial axes and channels fixed at
// construction, the batch taken from dy).
class MaxPoolBackward : public mx::UnaryPrimitive {
 public:
  MaxPoolBackward(mx::Stream stream, PoolParams p, mx::Shape x_tail)
      : mx::UnaryPrimitive(stream), p_(std::move(p)), x_tail_(std::move(x_tail)) {}

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

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "FluxlikeNativeMaxPoolBackward";
  }

  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  PoolParams p_;
  mx::Shape x_tail_;
};

} // namespace fluxlike_native
