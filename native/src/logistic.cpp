// fluxlike-native: sigmoid, tanh and exp as vectorised passes (see logistic.h).

#include "logistic.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.sigmoid/tanh/exp";

// Branch-free (both sides computed, one selected), so that the loops vectorise.
inline float sigmoid_one(float x) {
  float t = exp_nonpositive(-std::fabs(x));
  float s = 1.0f / (1.0f + t);
  float y = x >= 0.0f ? s : t * s;
  return x != x ? x : y;
}

inline float tanh_one(float x) {
  float a = std::fabs(x);
  float t = exp_nonpositive(-2.0f * a);
  float big = (1.0f - t) / (1.0f + t);
  float z = x * x;  // Cephes' tanhf below 0.625 (relative error 1.4e-7 there)
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * x + x;
  // (the sign from x: tanh(-0) = -0, which the polynomial loses; NaN takes the small side)
  return std::copysign(a >= 0.625f ? big : small, x);
}

FLN_VECTOR_CLONES void sigmoid_loop(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = sigmoid_one(x[i]);
}

FLN_VECTOR_CLONES void tanh_loop(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = tanh_one(x[i]);
}

FLN_VECTOR_CLONES void exp_loop(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = exp_float32(x[i]);
}

// out = g * f'(x) from y = f(x).
FLN_VECTOR_CLONES void sigmoid_grad_loop(const float* g, const float* y, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = g[i] * (y[i] * (1.0f - y[i]));
}

FLN_VECTOR_CLONES void tanh_grad_loop(const float* g, const float* y, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = g[i] * (1.0f - y[i] * y[i]);
}

FLN_VECTOR_CLONES void exp_grad_loop(const float* g, const float* y, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = g[i] * y[i];
}

void forward_pass(Logistic kind, const void* x, void* y, mx::Dtype dt, size_t n) {
  unary_in_float32(kind == Logistic::Sigmoid ? sigmoid_loop
                       : kind == Logistic::Tanh ? tanh_loop
                                                : exp_loop,
                   x, y, dt, n);
}

void grad_pass(Logistic kind, const void* g, const void* y, void* out, mx::Dtype dt, size_t n) {
  binary_in_float32(kind == Logistic::Sigmoid ? sigmoid_grad_loop
                        : kind == Logistic::Tanh ? tanh_grad_loop
                                                 : exp_grad_loop,
                    g, y, out, dt, n);
}

// f'(x) from y in MLX's ops (float32): the derivatives of LogisticGrad.
mx::array derivative_ops(const mx::array& y, Logistic kind, mx::StreamOrDevice s) {
  auto yf = mx::astype(y, mx::float32, s);
  switch (kind) {
    case Logistic::Sigmoid: return mx::multiply(yf, mx::subtract(mx::array(1.0f), yf, s), s);
    case Logistic::Tanh: return mx::subtract(mx::array(1.0f), mx::square(yf, s), s);
    default: return yf;
  }
}

std::vector<mx::array> grad_ops(const std::vector<mx::array>& in, Logistic kind, mx::Stream s) {
  return {mx::astype(mx::multiply(mx::astype(in[0], mx::float32, s),
                                  derivative_ops(in[1], kind, s), s),
                     in[0].dtype(), s)};
}

} // namespace

mx::array logistic(const mx::array& x, Logistic kind, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": the kernel runs on the CPU, the stream "
            "is on the GPU; use mx.sigmoid, mx.tanh or mx.exp there");
  FLN_CHECK(float_or_half(x.dtype()), FN, ": x must be float32, bfloat16 or float16, got ",
            dtype_str(x.dtype()), "; use mx.sigmoid, mx.tanh or mx.exp");
  return mx::array(x.shape(), x.dtype(), std::make_shared<LogisticPrimitive>(stream, kind), {x});
}

mx::array logistic_grad(const mx::array& g, const mx::array& y, Logistic kind,
                        mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, "_grad: the kernel runs on the CPU, the "
            "stream is on the GPU");
  FLN_CHECK(float_or_half(g.dtype()) && float_or_half(y.dtype()), FN, "_grad: g and y must be "
            "float32, bfloat16 or float16, got ", dtype_str(g.dtype()), " and ",
            dtype_str(y.dtype()));
  if (g.shape() != y.shape() || g.dtype() != y.dtype()) {
    // (never built by the primitives' derivatives, whose cotangents have y's dtype)
    return grad_ops({g, y}, kind, stream)[0];
  }
  return mx::array(g.shape(), g.dtype(), std::make_shared<LogisticGrad>(stream, kind), {g, y});
}

void LogisticPrimitive::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto& in = inputs[0];
  if (!in.flags().row_contiguous && in.ndim() >= 2 && in.strides().back() == 1 &&
      in.shape().back() > 1) {
    // Rows contiguous, strided between (an LSTM's gates: mx.split of one product): row by row
    // into a new buffer, without gathering a copy first.
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.dispatch([kind = kind_, px = static_cast<const char*>(in.data<void>()),
                      py = static_cast<char*>(out.data<void>()), dt = out.dtype(),
                      shape = in.shape(), strides = in.strides(), size = in.itemsize()]() {
      size_t cols = static_cast<size_t>(shape.back());
      size_t rows = 1;
      for (size_t a = 0; a + 1 < shape.size(); ++a) rows *= static_cast<size_t>(shape[a]);
      std::vector<int64_t> at(shape.size() - 1, 0);
      for (size_t r = 0; r < rows; ++r) {
        int64_t offset = 0;
        for (size_t a = 0; a < at.size(); ++a) offset += at[a] * strides[a];
        forward_pass(kind, px + offset * static_cast<int64_t>(size), py + r * cols * size, dt,
                     cols);
        for (int a = static_cast<int>(at.size()) - 1; a >= 0 && ++at[a] == shape[a]; --a) {
          at[a] = 0;
        }
      }
    });
    return;
  }
  RowMajor x(in, encoder);
  reuse_or_allocate(out, *x, x.copied());
  encoder.dispatch([kind = kind_, px = x->data<void>(), py = out.data<void>(), dt = out.dtype(),
                    n = out.size()]() { forward_pass(kind, px, py, dt, n); });
}

void LogisticGrad::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor g(inputs[0], encoder), y(inputs[1], encoder);
  reuse_or_allocate(out, *g, g.copied());
  encoder.dispatch([kind = kind_, pg = g->data<void>(), py = y->data<void>(),
                    po = out.data<void>(), dt = out.dtype(), n = out.size()]() {
    grad_pass(kind, pg, py, po, dt, n);
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> LogisticPrimitive::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  return {{logistic(inputs[0], kind_, stream())}, {axes[0]}};  // elementwise: the axis stays
}

std::vector<mx::array> LogisticPrimitive::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>&,
    const std::vector<mx::array>& outputs) {
  return {logistic_grad(cotangents[0], outputs[0], kind_, stream())};
}

std::vector<mx::array> LogisticPrimitive::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>&) {
  return {logistic_grad(tangents[0], logistic(primals[0], kind_, stream()), kind_, stream())};
}

std::pair<std::vector<mx::array>, std::vector<int>> LogisticGrad::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto in = mapped_in_front(inputs, axes, stream());  // g, y
  return {{logistic_grad(in[0], in[1], kind_, stream())}, {0}};
}

std::vector<mx::array> LogisticGrad::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  auto kind = kind_;
  return vjp_of([s, kind](const std::vector<mx::array>& in) { return grad_ops(in, kind, s); },
                primals, cotangents, argnums);
}

std::vector<mx::array> LogisticGrad::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  auto kind = kind_;
  return jvp_of([s, kind](const std::vector<mx::array>& in) { return grad_ops(in, kind, s); },
                primals, tangents, argnums, s);
}

} // namespace fluxlike_native
