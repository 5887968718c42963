// fluxlike-native: oneDNN softmax (last axis, float32) as an MLX primitive. As in
// matmul.cpp: the oneDNN primitive for a shape is created on the evaluating thread, kept in a
// mutex-guarded cache, and executed on MLX's CPU stream with its own scratchpad.

#include "softmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include "cache.h"
#include "common.h"
#include "matmul.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.softmax";

dnnl::softmax_forward::primitive_desc forward_desc(const dnnl::memory::desc& md,
                                                   const dnnl::primitive_attr& attr = {}) {
  return dnnl::softmax_forward::primitive_desc(engine(), dnnl::prop_kind::forward_training,
                                               dnnl::algorithm::softmax_accurate, md, md, 1,
                                               attr);
}

dnnl::softmax_backward::primitive_desc backward_desc(
    const dnnl::memory::desc& md, const dnnl::softmax_forward::primitive_desc& fwd,
    const dnnl::primitive_attr& attr = {}) {
  return dnnl::softmax_backward::primitive_desc(engine(), dnnl::algorithm::softmax_accurate, md,
                                                md, md, 1, fwd, attr);
}

// Which softmaxes run the loops below instead of a primitive (whose creation, about 0.2 ms on
// AVX2, costs more than a small softmax): up to 2**14 entries always (the loops are as fast
// there as the primitive, measured: 62 against 63 us at 2**14, 25 against 46 at 2**10), so
// that generation's scores, a column longer per token, create nothing; up to 2**16 a shape's
// first uses (its primitive from the fourth, cache.h: cached()); in matmul_mode "primitive",
// none.
constexpr int64_t LOOPS_MAX_ELEMENTS = int64_t{1} << 14;
constexpr int64_t FIRST_USE_LOOPS_MAX_ELEMENTS = int64_t{1} << 16;

// The primitive for the shape, or nullptr where the loops run (never without `may_defer`).
std::shared_ptr<const Prepared> lookup(bool backward, int64_t rows, int64_t cols,
                                       bool may_defer = true) {
  if (backward && softmax_backward_is_reference()) {
    return nullptr;
  }
  bool deferred = may_defer && first_use_deferred();
  if (deferred && rows * cols <= LOOPS_MAX_ELEMENTS) {
    return nullptr;
  }
  bool defer_first = deferred && rows * cols <= FIRST_USE_LOOPS_MAX_ELEMENTS;
  return cached<Prepared>(Op::Softmax, {backward, rows, cols}, FN, "softmax", [&] {
    dnnl::memory::desc md({rows, cols}, dnnl::memory::data_type::f32, {cols, 1});
    auto attr = user_scratchpad();
    auto fwd = forward_desc(md, attr);
    if (!backward) {
      return std::make_shared<const Prepared>(prepare(fwd, {DNNL_ARG_SRC, DNNL_ARG_DST}));
    }
    auto bwd = backward_desc(md, fwd, attr);
    return std::make_shared<const Prepared>(
        prepare(bwd, {DNNL_ARG_DIFF_DST, DNNL_ARG_DST, DNNL_ARG_DIFF_SRC}));
  }, defer_first, [&] {
    return std::function<void()>([backward, rows, cols] { lookup(backward, rows, cols, false); });
  });
}

// The primitive's algorithms as plain loops, float32 throughout (see lookup for where they
// run): softmax_accurate (the row's maximum subtracted first) and its gradient y * (g - sum(g *
// y)). Written to vectorise (eight partial sums and maxima; exp as below), so that they run
// at about the primitive's speed. Rows holding NaN or +inf, or all -inf, come out as garbage
// here: nan_rows sets them to NaN after, as after the primitive.
constexpr int LANES = 8;

FLN_VECTOR_CLONES void softmax_row(const float* in, float* out, int64_t cols) {
  float lane_top[LANES];
  for (float& t : lane_top) t = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + LANES <= cols; j += LANES) {
    for (int l = 0; l < LANES; ++l) {
      lane_top[l] = in[j + l] > lane_top[l] ? in[j + l] : lane_top[l];
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  for (; j < cols; ++j) top = in[j] > top ? in[j] : top;
  for (float t : lane_top) top = t > top ? t : top;
  for (j = 0; j < cols; ++j) out[j] = exp_nonpositive(in[j] - top);
  float lane_sum[LANES] = {};
  for (j = 0; j + LANES <= cols; j += LANES) {
    for (int l = 0; l < LANES; ++l) lane_sum[l] += out[j + l];
  }
  float sum = 0.0f;
  for (; j < cols; ++j) sum += out[j];
  for (float t : lane_sum) sum += t;
  float inverse = 1.0f / sum;
  for (j = 0; j < cols; ++j) out[j] *= inverse;
}

void softmax_loops(const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    softmax_row(x + r * cols, y + r * cols, cols);
  }
}

FLN_VECTOR_CLONES void softmax_grad_row(const float* g, const float* y, float* dx,
                                         int64_t cols) {
  float lane_dot[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= cols; j += LANES) {
    for (int l = 0; l < LANES; ++l) lane_dot[l] += g[j + l] * y[j + l];
  }
  float dot = 0.0f;
  for (; j < cols; ++j) dot += g[j] * y[j];
  for (float t : lane_dot) dot += t;
  for (j = 0; j < cols; ++j) dx[j] = y[j] * (g[j] - dot);
}

void softmax_grad_loops(const float* g, const float* y, float* dx, int64_t rows,
                        int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    softmax_grad_row(g + r * cols, y + r * cols, dx + r * cols, cols);
  }
}

// log_sum_exp's passes (see softmax.h): the exponentials summed in eight lanes, never stored.
FLN_VECTOR_CLONES float log_sum_exp_row(const float* x, float top, int64_t cols) {
  float lane_sum[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= cols; j += LANES) {
    for (int l = 0; l < LANES; ++l) lane_sum[l] += exp_float32(x[j + l] - top);
  }
  float sum = 0.0f;
  for (; j < cols; ++j) sum += exp_float32(x[j] - top);
  for (float t : lane_sum) sum += t;
  return std::log(sum);
}

FLN_VECTOR_CLONES void log_sum_exp_grad_row(float g, const float* x, float top, float out,
                                             float* dx, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) dx[j] = g * exp_float32((x[j] - top) - out);
}

// The same in MLX's ops: the derivatives of both passes.
std::vector<mx::array> log_sum_exp_ops(const std::vector<mx::array>& in, mx::Stream s) {
  return {mx::log(mx::sum(mx::exp(mx::subtract(in[0], in[1], s), s), -1, true, s), s)};
}

std::vector<mx::array> log_sum_exp_grad_ops(const std::vector<mx::array>& in, mx::Stream s) {
  auto shifted = mx::subtract(mx::subtract(in[1], in[2], s), in[3], s);
  return {mx::multiply(in[0], mx::exp(shifted, s), s)};
}

void check(const mx::array& x, const char* what) {
  FLN_CHECK(x.dtype() == mx::float32 && x.ndim() >= 1, FN, ": expected ", what,
            " to be a float32 array of one or more axes");
}

// The backward pass in MLX's ops: what the primitive's own derivatives are made of.
mx::array grad_ops(const mx::array& g, const mx::array& y, mx::Stream s) {
  auto gy = mx::sum(mx::multiply(g, y, s), -1, true, s);
  return mx::multiply(y, mx::subtract(g, gy, s), s);
}

// Rows that MLX's softmax makes all NaN: one holding NaN or +inf (inf - inf), or all -inf.
// oneDNN's max ignores NaN (vmaxps) and leaves finite probabilities in such a row, which
// would hide a diverged score. One pass over x after the kernel; such rows are set to NaN.
FLN_VECTOR_CLONES bool row_is_nan(const uint32_t* x, int64_t cols) {
  uint32_t bad = 0, all_neg_inf = 1;
  for (int64_t j = 0; j < cols; ++j) {
    uint32_t b = x[j];
    bad |= static_cast<uint32_t>((b & 0x7FFFFFFFu) > 0x7F800000u) |
        static_cast<uint32_t>(b == 0x7F800000u);
    all_neg_inf &= static_cast<uint32_t>(b == 0xFF800000u);
  }
  return (bad | all_neg_inf) != 0;
}

void nan_rows(const void* x, void* y, int64_t rows, int64_t cols) {
  auto* in = static_cast<const uint32_t*>(x);
  auto* out = static_cast<uint32_t*>(y);
  for (int64_t r = 0; r < rows; ++r) {
    if (row_is_nan(in + r * cols, cols)) {
      std::fill(out + r * cols, out + (r + 1) * cols, 0x7FC00000u);
    }
  }
}

void on_the_cpu(const mx::Stream& stream) {
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU, the stream "
            "is on the GPU; use MLX's own softmax there (mx.softmax)");
}

} // namespace

bool softmax_backward_is_reference() {
  static const bool reference = [] {
    try {
      dnnl::memory::desc md({8, 128}, dnnl::memory::data_type::f32, {128, 1});
      auto bwd = backward_desc(md, forward_desc(md));
      return std::string(bwd.impl_info_str()).rfind("ref", 0) == 0;
    } catch (const dnnl::error&) {
      return false;  // (then the lookup's creation raises, with its message)
    }
  }();
  return reference;
}

mx::array softmax(const mx::array& x, mx::StreamOrDevice s) {
  check(x, "x");
  auto stream = mx::to_stream(s);
  on_the_cpu(stream);
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(stream, false), {x});
}

mx::array softmax_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s) {
  check(g, "g");
  check(y, "y");
  FLN_CHECK(g.shape() == y.shape(), FN, "_grad: g and y must have one shape");
  auto stream = mx::to_stream(s);
  on_the_cpu(stream);
  return mx::array(g.shape(), mx::float32, std::make_shared<Softmax>(stream, true), {g, y});
}

void Softmax::eval_cpu(const std::vector<mx::array>& operands, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  int64_t cols = out.shape().back();
  int64_t rows = static_cast<int64_t>(out.size()) / cols;
  auto entry = lookup(backward_, rows, cols);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto inputs = row_contiguous_all(operands, encoder);
  void* in1 = backward_ ? const_cast<void*>(inputs[1].data<void>()) : nullptr;
  encoder.dispatch([entry, backward = backward_, in0 = const_cast<void*>(inputs[0].data<void>()),
                    in1, dst = out.data<void>(), rows, cols]() {
    if (backward) {  // in0 = g (diff_dst), in1 = y (dst)
      if (entry) {
        execute(*entry,
                {{DNNL_ARG_DIFF_DST, in0}, {DNNL_ARG_DST, in1}, {DNNL_ARG_DIFF_SRC, dst}}, FN);
      } else {
        softmax_grad_loops(static_cast<const float*>(in0), static_cast<const float*>(in1),
                           static_cast<float*>(dst), rows, cols);
      }
    } else {
      if (entry) {
        execute(*entry, {{DNNL_ARG_SRC, in0}, {DNNL_ARG_DST, dst}}, FN);
      } else {
        softmax_loops(static_cast<const float*>(in0), static_cast<float*>(dst), rows, cols);
      }
      nan_rows(in0, dst, rows, cols);
    }
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> Softmax::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  // Over the last axis: a mapped axis elsewhere is one more leading axis, and stays where it
  // is; the last one moves to the front. The backward pass's two operands are aligned first.
  auto s = stream();
  int ndim = static_cast<int>(inputs[0].ndim());
  if (!backward_) {
    if (axes[0] == ndim - 1) {
      return {{softmax(mx::moveaxis(inputs[0], axes[0], 0, s), s)}, {0}};
    }
    return {{softmax(inputs[0], s)}, {axes[0]}};
  }
  auto front = [&](int i, const mx::array& other, int other_axis) {
    if (axes[i] >= 0) {
      return mx::moveaxis(inputs[i], axes[i], 0, s);
    }
    auto shape = mx::moveaxis(other, other_axis, 0, s).shape();
    return mx::broadcast_to(mx::expand_dims(inputs[i], 0, s), shape, s);
  };
  auto g = front(0, inputs[1], axes[1]);
  auto y = front(1, inputs[0], axes[0]);
  return {{softmax_grad(g, y, s)}, {0}};
}

std::vector<mx::array> Softmax::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  if (!backward_) {
    return {softmax_grad(cotangents[0], outputs[0], s)};
  }
  auto fn = [s](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{grad_ops(in[0], in[1], s)};
  };
  return vjp_of(fn, primals, cotangents, argnums);
}

std::vector<mx::array> Softmax::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  if (!backward_) {
    return {softmax_grad(tangents[0], softmax(primals[0], s), s)};
  }
  auto fn = [s](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{grad_ops(in[0], in[1], s)};
  };
  return jvp_of(fn, primals, tangents, argnums, s);
}

namespace {

const char* LSE = "fluxlike_native.log_sum_exp";

void check_rows(const mx::array& a, const mx::array& x, const char* what) {
  auto rows = x.shape();
  rows.back() = 1;
  FLN_CHECK(a.dtype() == mx::float32 && a.shape() == rows, LSE, ": expected ", what,
            " to be float32 of shape ", shape_str(rows), " (x's ", shape_str(x.shape()),
            " with its last axis 1), got ", dtype_str(a.dtype()), " ", shape_str(a.shape()));
}

void check_x(const mx::array& x) {
  FLN_CHECK(x.dtype() == mx::float32 && x.ndim() >= 1, LSE, ": expected x to be a float32 "
            "array of one or more axes, got ", dtype_str(x.dtype()), " ", shape_str(x.shape()));
}

} // namespace

mx::array log_sum_exp(const mx::array& x, const mx::array& top, mx::StreamOrDevice s) {
  check_x(x);
  check_rows(top, x, "top");
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, LSE, ": the kernel runs on the CPU, the stream "
            "is on the GPU; use mx.logsumexp there");
  return mx::array(top.shape(), mx::float32, std::make_shared<LogSumExp>(stream, false),
                   {x, top});
}

mx::array log_sum_exp_grad(const mx::array& g, const mx::array& x, const mx::array& top,
                           const mx::array& out, mx::StreamOrDevice s) {
  check_x(x);
  check_rows(g, x, "g");
  check_rows(top, x, "top");
  check_rows(out, x, "out");
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, LSE, "_grad: the kernel runs on the CPU, the "
            "stream is on the GPU");
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSumExp>(stream, true),
                   {g, x, top, out});
}

void LogSumExp::eval_cpu(const std::vector<mx::array>& operands, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  int64_t cols = operands[backward_ ? 1 : 0].shape().back();  // x's
  int64_t rows = static_cast<int64_t>(backward_ ? out.size() / cols : out.size());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto inputs = row_contiguous_all(operands, encoder);
  std::vector<const float*> in;
  for (const auto& a : inputs) in.push_back(a.data<float>());
  encoder.dispatch([backward = backward_, in, dst = out.data<float>(), rows, cols]() {
    if (!backward) {  // in: x, top
      for (int64_t r = 0; r < rows; ++r) {
        dst[r] = log_sum_exp_row(in[0] + r * cols, in[1][r], cols);
      }
      if (cols == 0) {  // (an empty row: log(0))
        std::fill(dst, dst + rows, -std::numeric_limits<float>::infinity());
      }
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {  // in: g, x, top, out
      log_sum_exp_grad_row(in[0][r], in[1] + r * cols, in[2][r], in[3][r], dst + r * cols,
                           cols);
    }
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> LogSumExp::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto in = mapped_in_front(inputs, axes, s);  // (the last axis stays the reduced one)
  return {{backward_ ? log_sum_exp_grad(in[0], in[1], in[2], in[3], s)
                     : log_sum_exp(in[0], in[1], s)},
          {0}};
}

std::vector<mx::array> LogSumExp::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  if (backward_) {
    return vjp_of([s](const std::vector<mx::array>& in) { return log_sum_exp_grad_ops(in, s); },
                  primals, cotangents, argnums);
  }
  std::vector<mx::array> grads;
  for (int arg : argnums) {  // d/dx: g * exp(x - top - out); d/dtop: -g
    grads.push_back(arg == 0 ? log_sum_exp_grad(cotangents[0], primals[0], primals[1],
                                                outputs[0], s)
                             : mx::negative(cotangents[0], s));
  }
  return grads;
}

std::vector<mx::array> LogSumExp::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  auto backward = backward_;
  return jvp_of([s, backward](const std::vector<mx::array>& in) {
    return backward ? log_sum_exp_grad_ops(in, s) : log_sum_exp_ops(in, s);
  }, primals, tangents, argnums, s);
}

} // namespace fluxlike_native
