// fluxlike-native: oneDNN convolution (channels-last, 1-3 spatial axes) as MLX primitives.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "primitive.h"

namespace fluxlike_native {

struct ConvParams {
  std::vector<int> stride, pad_lo, pad_hi, dilation;  // one per spatial axis; dilation >= 1
  int groups = 1;
  bool operator==(const ConvParams& o) const {
    return stride == o.stride && pad_lo == o.pad_lo && pad_hi == o.pad_hi &&
        dilation == o.dilation && groups == o.groups;
  }
};

// The convolution mx.conv_general computes (no input dilation, no flip): x (N, *spatial,
// C_in), w (C_out, *kernel, C_in / groups), bias (C_out,) -> (N, *out_spatial, C_out).
// float32, bfloat16 or float16 (float16 in oneDNN's float16 kernels where native_f16(), cpu.h,
// its weight gradient and cases oneDNN runs on its reference kernel in float32 kernels;
// float16 elsewhere, and bfloat16 with native_bf16 == false, in float32 kernels: the
// primitive upcasts its operands into float32 buffers of its own while it runs and rounds the
// result, so that the graph holds the half-precision operands only).
// relu == true: max(y, 0), fused into the primitive (a pass after oneDNN's kernel that keeps
// NaN, relu_keeping_nan; the backward pass masks the cotangent by the kept output, ReluGrad).
mx::array conv(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
               const ConvParams& p, bool native_bf16, bool relu = false,
               mx::StreamOrDevice s = {});

// The input gradient of that convolution (a transposed convolution): dy (N, *out_spatial,
// C_out), w as above, x_tail = (*spatial, C_in) of the convolution's input; -> (N, *x_tail).
mx::array conv_backward_data(const mx::array& dy, const mx::array& w, const mx::Shape& x_tail,
                             const ConvParams& p, bool native_bf16, mx::StreamOrDevice s = {});

enum class ConvKind { Forward, BackwardData, BackwardWeights };

// Forward: inputs (x, w[, bias]) -> y. BackwardData: (dy, w) -> dx, whose spatial shape
// (and channels) is fixed at construction. BackwardWeights: (x, dy) -> dw of fixed shape.
class Conv : public mx::UnaryPrimitive {
 public:
  Conv(mx::Stream stream, ConvKind kind, ConvParams p, bool has_bias, mx::Shape fixed,
       bool relu = false, bool upcast = false)
      : mx::UnaryPrimitive(stream),
        kind_(kind),
        p_(std::move(p)),
        has_bias_(has_bias),
        relu_(relu),
        upcast_(upcast),
        fixed_(std::move(fixed)) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.conv has no GPU kernel: build it on a CPU stream")
  FLN_DEFINE_GRADS()
  // Over x (Forward) or dy (BackwardData) alone: the mapped axis folded into the batch;
  // otherwise once per member (see vmap_rows).
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_IS_EQUIVALENT()

  const char* name() const override {
    return kind_ == ConvKind::Forward ? "FluxlikeNativeConv"
        : kind_ == ConvKind::BackwardData ? "FluxlikeNativeConvBackwardData"
                                          : "FluxlikeNativeConvBackwardWeights";
  }

 private:
  bool first_use_fits(const std::vector<mx::array>& inputs, const mx::array& out) const;
  bool first_use_on_mlx(const std::vector<mx::array>& inputs, mx::array& out);

  ConvKind kind_;
  ConvParams p_;
  bool has_bias_;
  bool relu_;  // Forward only: a fused ReLU
  bool upcast_;  // half-precision operands in float32 kernels (see conv above)
  mx::Shape fixed_;  // BackwardData: dx's shape without the batch; BackwardWeights: dw's
};

} // namespace fluxlike_native
