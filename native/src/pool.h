// fluxlike-native: oneDNN max pooling (channels-last, 1-3 spatial axes) as MLX primitives.
#pragma once

#include <utility>
#include <vector>

#include "primitive.h"

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
// float32, bfloat16 or float16 (float16, and bfloat16 with native_bf16 == false, through
// float32 kernels; the maximum is exact either way). Its gradient sends each output's cotangent to the first maximum of
// its window (oneDNN's workspace records which), as PyTorch does.
mx::array max_pool(const mx::array& x, const PoolParams& p, bool native_bf16,
                   mx::StreamOrDevice s = {});

// Forward: x -> (y, workspace); the workspace (uint8, or int32 for windows of 256 entries
// or more, y's shape) says where each window's maximum is, for the backward pass.
class MaxPool : public mx::Primitive {
 public:
  MaxPool(mx::Stream stream, PoolParams p) : mx::Primitive(stream), p_(std::move(p)) {}

  FLN_DEFINE_EVAL_CPU_ONLY_MULTI(
      "fluxlike_native.max_pool has no GPU kernel: build it on a CPU stream")
  FLN_DEFINE_GRADS()
  // The mapped axis folded into the batch (see vmap_rows).
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_NAME(MaxPool)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  PoolParams p_;
};

// Backward: (dy, workspace) -> dx of x's shape (its spatial axes and channels fixed at
// construction, the batch taken from dy).
class MaxPoolBackward : public mx::UnaryPrimitive {
 public:
  MaxPoolBackward(mx::Stream stream, PoolParams p, mx::Shape x_tail)
      : mx::UnaryPrimitive(stream), p_(std::move(p)), x_tail_(std::move(x_tail)) {}

  FLN_DEFINE_EVAL_CPU_ONLY(
      "fluxlike_native.max_pool has no GPU kernel: build it on a CPU stream")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_NAME(MaxPoolBackward)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  PoolParams p_;
  mx::Shape x_tail_;
};

} // namespace fluxlike_native
