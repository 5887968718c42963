// fluxlike-native: oneDNN matrix multiplication as an MLX primitive (CPU).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "engine.h"
#include "primitive.h"

namespace fluxlike_native {

// ---- the op -------------------------------------------------------------------------------

// act(op(a) @ op(b) + bias), op transposing the last two axes where asked.
//
// batched == false: `a` has any number of leading axes (flattened into rows; a transposed
//   `a` must be 2-D), `b` is 2-D; the result has a's leading axes and N columns.
// batched == true: `a` and `b` have the same number (>= 3) of axes, batch axes equal or 1
//   (broadcast).
// Operands float32, bfloat16 or float16 (both the same); bias (N,) of their dtype or float32;
// out_dtype float32 or the operands' dtype (default). float16 operands run in oneDNN's float16
// kernels where native_f16() (cpu.h: AVX512-FP16; a float16 bias is widened to float32 for
// them, and a case they would run on oneDNN's reference kernel runs as below). float16
// operands elsewhere, and bfloat16 ones with native_bf16 == false, run in float32 kernels:
// one primitive that upcasts them
// (exactly) into float32 buffers of its own while it runs and rounds the float32 result to
// the half dtype if asked, so that the graph holds the half-precision operands only (a
// backward pass keeps those, not float32 copies) and one node per product.
//
// compute (bfloat16 or float16), where given: the casts to it fused into the product, which
// then always runs in float32 kernels as above. Operands (bias included) may each be float32
// or `compute`; a float32 one is read rounded to `compute`, as astype would round it, so the
// graph needs no cast node (autocast's float32 weights). out_dtype is `compute` (default) or
// float32; `rounded` rounds a float32 result to `compute` too (what astype to it and back
// gives: the gradient of a float32 operand). Every gradient and tangent is what the casts and
// the product would give, bit for bit; an operand's gradient has its dtype. (Not fused: in
// bfloat16 or float16 kernels an unbatched product's operand or bias that is convert()'s cast
// of a float32 array gets the float32 product or sum as its gradient, not rounded: matmul.cpp.)
mx::array matmul(const mx::array& a, const mx::array& b, const std::optional<mx::array>& bias,
                 bool trans_a, bool trans_b, bool relu, std::optional<mx::Dtype> out_dtype,
                 bool batched, bool native_bf16, mx::StreamOrDevice s = {},
                 std::optional<mx::Dtype> compute = std::nullopt, bool rounded = false);

// How unbatched float32 products run (process-wide; tests and benchmarks switch it):
// - Gemm: on oneDNN's GEMM (dnnl_sgemm) without a primitive, for any row count;
// - Reused: a shape's first uses on that GEMM, a cached primitive from its fourth use on
//   (queued on the creator's thread at the third, cache.h: cached(); a shape seen twice
//   creates nothing; one that comes back gets the primitive's kernel);
// - Primitive: a cached primitive per shape from its first use (as before 2026-12-04);
// - Auto (the default): Gemm on every CPU (below AVX-512 the float32 matmul primitive is
//   that GEMM anyway, `gemm:jit:f32`; on AVX-512 Reused mixed two kernels' roundings over a
//   shape's calls: matmul.cpp, effective_mode), but for a linear layer's forward product of
//   2**29 or more multiply-adds where the primitive is brgemm: its primitive (matmul.cpp:
//   large_forward).
enum class MatmulMode { Auto = 0, Primitive = 1, Gemm = 2, Reused = 3 };
MatmulMode set_matmul_mode(MatmulMode mode);  // returns the old mode
MatmulMode matmul_mode();
// The mode Auto stands for here (or the mode set).
MatmulMode effective_mode();
// Whether a shape's first use may run without creating its primitive (matmul_mode() is not
// Primitive): the products (Reused), a small softmax, a float32 convolution's forward pass.
bool first_use_deferred();
// Whether unbatched float32 products run on the GEMM without a primitive now (Gemm).
bool direct_gemm_in_use();
// Whether oneDNN's float32 matmul primitive is its jit GEMM on this CPU (probed once).
bool primitive_is_jit_gemm();

// oneDNN's matmul for these descriptions of its source, weights and destination (a bias of
// `bias_dt` broadcast over the rows where given), created with a user scratchpad on one
// OpenMP thread below the threshold (cpu.h: one_thread_for; a bfloat16 source counts as
// AMX's where the CPU has it) or as `one_thread` says (descriptions with runtime dimensions,
// whose size the caller knows); `fn` names the op in oneDNN's refusal.
std::shared_ptr<const Prepared> prepared_matmul(const dnnl::memory::desc& a,
                                                const dnnl::memory::desc& b,
                                                std::optional<mx::Dtype> bias_dt,
                                                const dnnl::memory::desc& dst, const char* fn,
                                                std::optional<bool> one_thread = std::nullopt);

// Runs the matmul `entry` on src (dense, src_bytes long), weights, bias (or null) into dst,
// waiting for it; an AMX kernel reads an aligned copy of a source off a cache line
// (engine.h: Prepared::amx); `actual` describes the operands an entry for any row count or
// shape runs on (engine.h: execute). `fn` names the op in an out-of-memory error.
void run_product(const Prepared& entry, void* src, size_t src_bytes, void* weights, void* bias,
                 void* dst, const char* fn, const ExecMds& actual = {});

// ---- bfloat16 products for any row count (matmul.cpp) ---------------------------------------

// Whether bfloat16 products may run on a primitive made for any row count (oneDNN's runtime
// dimension): oneDNN's kernel for it is brgemm here (AMX), and matmul_mode() is not Primitive.
// (Small batched bfloat16 products then run on one for any shape too: matmul.cpp, any_shape.)
bool any_rows_kernel();
// The fewest rows (besides 1) a product runs on it with (8 unless set; set returns the old).
int64_t set_any_rows_min(int64_t rows);
int64_t any_rows_min();

struct AnyRows {
  std::shared_ptr<const Prepared> entry;
  int64_t rows;  // the row count to run it with; -1 for a primitive of the shape

  // The descriptions its source and result take for the call (none for a shape's own).
  ExecMds actual() const;
};

// The primitive for a bfloat16 product of `rows` rows: `for_any_rows()` (the cached one for
// any row count, made once per weight shape and thread count) where any_rows_kernel() and
// `rows` is 1 or at least any_rows_min(); else `per_shape()`. Which of the two a product
// gets depends on its shape only: its bits are the same on every call (matmul.cpp).
AnyRows any_rows(int64_t rows, const std::function<std::shared_ptr<const Prepared>()>& per_shape,
                 const std::function<std::shared_ptr<const Prepared>()>& for_any_rows);

// A oneDNN matmul timed outside MLX (bench/matmul.py's "standalone" rows): see matmul.cpp.
struct StandaloneTiming {
  double seconds;    // the fastest call
  std::string impl;  // oneDNN's implementation name
};
StandaloneTiming standalone_matmul(int64_t m, int64_t k, int64_t n, mx::Dtype dt,
                                   bool transposed_b, bool any_layout, int reps);

class Matmul : public mx::UnaryPrimitive {
 public:
  Matmul(
      mx::Stream stream,
      bool trans_a,
      bool trans_b,
      bool has_bias,
      bool relu,
      bool batched,
      mx::Dtype out_dtype,
      bool upcast = false,
      mx::Dtype compute = mx::float32,
      bool fused = false,
      bool round_f32 = false)
      : mx::UnaryPrimitive(stream),
        trans_a_(trans_a),
        trans_b_(trans_b),
        has_bias_(has_bias),
        relu_(relu),
        batched_(batched),
        out_dtype_(out_dtype),
        upcast_(upcast),
        cdt_(compute),
        fused_(fused),
        round_f32_(round_f32) {}

  FLN_DEFINE_EVAL_CPU_ONLY("fluxlike_native.matmul has no GPU kernel: build it on a CPU stream")
  FLN_DEFINE_GRADS()
  FLN_DEFINE_VMAP()
  FLN_DEFINE_OUTPUT_SHAPES()
  FLN_DEFINE_NAME(Matmul)
  FLN_DEFINE_IS_EQUIVALENT()

 private:
  bool trans_a_;
  bool trans_b_;
  bool has_bias_;
  bool relu_;
  bool batched_;
  mx::Dtype out_dtype_;
  bool upcast_;  // half-precision operands in float32 kernels (see matmul above)
  mx::Dtype cdt_;  // the compute dtype: the operands' (or the fused casts')
  bool fused_;  // float32 operands (bias included) read rounded to cdt_ (matmul's compute)
  bool round_f32_;  // a float32 result rounded to cdt_

  // What to give matmul() for a product of this one's vjp/jvp/vmap: native_bf16, compute.
  bool native() const {
    return cdt_ != mx::float32 && !upcast_;
  }
  std::optional<mx::Dtype> compute() const {
    return fused_ ? std::optional<mx::Dtype>(cdt_) : std::nullopt;
  }

  void eval_upcast(const std::vector<mx::array>& inputs, mx::array& out);
};

} // namespace fluxlike_native
