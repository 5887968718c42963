// fluxlike-native: a linear layer's weights in the layout oneDNN's kernels prefer, reordered
// once, and the product that reads them - for inference, where the same weights serve call
// after call.
//
// oneDNN's brgemm matmul copies a plain weights matrix into its own blocked layout as it runs
// (on an Intel Xeon with AMX, 2026-12-04: a 512 x 2048 x 2048 bfloat16 product 1.85-1.97 ms
// from plain weights, 1.66-1.79 from weights reordered once; 128 x 256 x 256 15 us against
// 10; bench/matmul.py). The blocked layout depends on the weights' shape and dtype, not on the
// row count (checked for 1 to 2048 rows): one packing serves every batch.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "primitive.h"

namespace fluxlike_native {

struct PackedLayout;  // (packed.cpp: the layout of one weights shape, made once)

// `w` (out, in) - a linear layer's bfloat16 weights, as the product x @ w.T reads them - in
// oneDNN's preferred layout: a 1-D uint8 array (the packed bytes at a cache line's boundary,
// their offset in its first byte), or nothing where this CPU's kernel takes the plain layout
// anyway, no bfloat16 kernel exists or the packing would pass 2**31 bytes (the caller keeps
// the plain product). Not differentiable (a constant of w: the product's gradient reaches w
// through its plain input). packed_linear checks the packing's size, not its values: it
// must be pack_weights of the w it is given.
std::optional<mx::array> pack_weights(const mx::array& w, mx::StreamOrDevice s = {});

// act(x @ w.T + bias) for bfloat16 x (.., in), w (out, in) and `packed` = pack_weights(w),
// read from the packed bytes; bias (out,) bfloat16 or float32 or none; relu fused where asked;
// the result in out_dtype (bfloat16 or float32). The same bits as fluxlike_native.matmul's
// native bfloat16 product (tests/native/test_packed.py); its derivatives, vmap and the GPU
// are that product's.
mx::array packed_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                        const mx::array& packed, bool relu, mx::Dtype out_dtype,
                        mx::StreamOrDevice s = {});

class PackWeights : public mx::UnaryPrimitive {
 public:
  PackWeights(mx::Stream stream, int bytes, std::shared_ptr<const PackedLayout> layout)
      : mx::UnaryPrimitive(stream), bytes_(bytes), layout_(std::move(layout)) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.pack_weights has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return {mx::Shape{bytes_}};
  }
  FLN_DEFINE_NAME(PackWeights)
  FLN_DEFINE_DEFAULT_IS_EQUIVALENT()

 private:
  int bytes_;  // the packed layout's size and 64 to align it
  std::shared_ptr<const PackedLayout> layout_;
};

// inputs {x, w, bias?, packed}.
class PackedLinear : public mx::UnaryPrimitive {
 public:
  PackedLinear(mx::Stream stream, bool has_bias, bool relu, mx::Dtype out_dtype,
               std::shared_ptr<const PackedLayout> layout)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias), relu_(relu), out_dtype_(out_dtype),
        layout_(std::move(layout)) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.packed_linear has no GPU kernel")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_NAME(PackedLinear)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  bool has_bias_;
  bool relu_;
  mx::Dtype out_dtype_;
  std::shared_ptr<const PackedLayout> layout_;  // the weights' packed layout

  // The same product on the plain weights (what the derivatives and vmap are taken of).
  mx::array plain(const std::vector<mx::array>& inputs);
};

} // namespace fluxlike_native
