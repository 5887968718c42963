// fluxlike-native: oneDNN matrix multiplication as an MLX primitive (CPU).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace fluxlike_native {

// ---- the CPU, as oneDNN sees it ---------------------------------------------------------

// oneDNN's effective ISA (respects ONEDNN_MAX_CPU_ISA), e.g. "avx512_core_bf16".
std::string cpu_isa();
// Whether oneDNN has bf16 dot-product kernels on this CPU (avx512_core_bf16 or better).
bool isa_has_bf16();
// Whether oneDNN has AVX-512 (core) kernels on this CPU.
bool isa_has_avx512();
// oneDNN's version, "major.minor.patch".
std::string onednn_version();
// The number of cached oneDNN primitives, and how to drop them.
size_t cache_size();
void clear_cache();
// Each cached primitive's implementation name (e.g. "brg:avx512_core_bf16") and count.
std::vector<std::pair<std::string, int>> cache_impls();

// Primitives for problems below this many multiply-adds are created on one OpenMP thread,
// so they also run on one: on two shared cores an OpenMP barrier can wait a whole
// scheduler tick (milliseconds) for a preempted team thread, far longer than the work.
constexpr double SINGLE_THREAD_MACS = 1 << 20;

// While alive (and `on`), oneDNN primitives created on this thread use one thread.
class OneThread {
 public:
  explicit OneThread(bool on);
  ~OneThread();
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_ = -1;
};

// ---- the op -------------------------------------------------------------------------------

// act(op(a) @ op(b) + bias), op transposing the last two axes where asked.
//
// batched == false: `a` has any number of leading axes (flattened into rows; a transposed
//   `a` must be 2-D), `b` is 2-D; the result has a's leading axes and N columns.
// batched == true: `a` and `b` have the same number (>= 3) of axes, batch axes equal or 1
//   (broadcast).
// Operands float32 or bfloat16 (both the same); bias (N,) of their dtype or float32;
// out_dtype float32 or the operands' dtype (default). native_bf16 == false runs bfloat16
// operands in float32 kernels (upcast, float32 result, rounded to bfloat16 if asked).
mx::array matmul(
    const mx::array& a,
    const mx::array& b,
    const std::optional<mx::array>& bias,
    bool trans_a,
    bool trans_b,
    bool relu,
    std::optional<mx::Dtype> out_dtype,
    bool batched,
    bool native_bf16,
    mx::StreamOrDevice s = {});

class Matmul : public mx::UnaryPrimitive {
 public:
  Matmul(
      mx::Stream stream,
      bool trans_a,
      bool trans_b,
      bool has_bias,
      bool relu,
      bool batched,
      mx::Dtype out_dtype)
      : mx::UnaryPrimitive(stream),
        trans_a_(trans_a),
        trans_b_(trans_b),
        has_bias_(has_bias),
        relu_(relu),
        batched_(batched),
        out_dtype_(out_dtype) {}

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

  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "FluxlikeNativeMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool trans_a_;
  bool trans_b_;
  bool has_bias_;
  bool relu_;
  bool batched_;
  mx::Dtype out_dtype_;
};

// max(y, 0) in place on n float32 (or bfloat16) values, as MLX's maximum computes it: NaN
// stays NaN. The primitives apply their fused ReLU with it after oneDNN's kernel, not as
// oneDNN's ReLU post-op, a vmaxps that returns 0 for NaN (a diverged layer would look finite).
void relu_keeping_nan(void* y, size_t n, bool bf16);

// relu'(y) * g: `g` where `y > 0`, else 0, in one pass (g and y of one shape, float32 or
// bfloat16 each; the result has g's dtype). The backward pass of a fused ReLU.
mx::array relu_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s = {});

class ReluGrad : public mx::UnaryPrimitive {
 public:
  explicit ReluGrad(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

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

  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  const char* name() const override {
    return "FluxlikeNativeReluGrad";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// `x`, evaluated only after `deps`: MLX's mx::depends, with output shapes (so that a
// shapeless mx.compile can replay it). Used in backward passes to order the evaluation:
// a layer's parameter gradients are computed while its cotangent is live.
mx::array after(const mx::array& x, const std::vector<mx::array>& deps, mx::StreamOrDevice s = {});

class After : public mx::UnaryPrimitive {
 public:
  explicit After(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

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

  // x as it is mapped, after the (mapped or not) deps; an unmapped x is broadcast over the
  // mapped axis (MLX's vmap takes no unmapped output of a mapped computation).
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override {
    return "FluxlikeNativeAfter";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

} // namespace fluxlike_native
