// fluxlike-native: GELU and its derivative (see gelu.h).

#include "gelu.h"
#include "common.h"

#include <cmath>
#include <cstddef>
#include <memory>
#include <optional>

#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.gelu";
constexpr float SQRT1_2 = 0.70710678118654752f;
constexpr float INV_SQRT_2PI = 0.39894228040143268f;

// Phi(-|x|) = erfc(|x| / sqrt 2) / 2 by Abramowitz and Stegun 7.1.26 (MLX's erf), and
// exp(-x^2 / 2); branch-free, to vectorise.
inline float lower_tail(float x, float& density) {
  float z = std::fabs(x) * SQRT1_2;
  float t = 1.0f / (1.0f + 0.3275911f * z);
  float r = 1.061405429f;
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  density = exp_nonpositive(-z * z);
  return 0.5f * t * r * density;
}

FLN_VECTOR_CLONES void gelu_loop(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float v = x[i], e;
    float tail = lower_tail(v, e);
    y[i] = v * (v > 0.0f ? 1.0f - tail : tail);
  }
}

FLN_VECTOR_CLONES void gelu_grad_loop(const float* g, const float* x, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float v = x[i], e;
    float tail = lower_tail(v, e);
    out[i] = g[i] * ((v > 0.0f ? 1.0f - tail : tail) + v * e * INV_SQRT_2PI);
  }
}

// The passes over any of the three dtypes: half precision through float32 chunks on the
// stack, rounded once.
void gelu_pass(const void* x, void* y, mx::Dtype dt, size_t n) {
  unary_in_float32(gelu_loop, x, y, dt, n);
}

void gelu_grad_pass(const void* g, const void* x, void* out, mx::Dtype dt, size_t n) {
  binary_in_float32(gelu_grad_loop, g, x, out, dt, n);
}

// gelu'(x) in MLX's ops (float32, rounded to x's dtype): for the derivatives of gelu_grad.
mx::array gelu_prime_ops(const mx::array& x, mx::StreamOrDevice s) {
  auto xf = mx::astype(x, mx::float32, s);
  auto cdf = mx::multiply(
      mx::add(mx::erf(mx::multiply(xf, mx::array(SQRT1_2), s), s), mx::array(1.0f), s),
      mx::array(0.5f), s);
  auto pdf = mx::multiply(
      mx::exp(mx::multiply(mx::square(xf, s), mx::array(-0.5f), s), s),
      mx::array(INV_SQRT_2PI), s);
  return mx::add(cdf, mx::multiply(xf, pdf, s), s);
}

} // namespace

mx::array gelu(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": the kernel runs on the CPU, the stream "
            "is on the GPU; use mlx.nn.gelu there");
  FLN_CHECK(float_or_half(x.dtype()), FN, ": x must be float32, bfloat16 or float16, got ",
            dtype_str(x.dtype()), "; use mlx.nn.gelu");
  return mx::array(x.shape(), x.dtype(), std::make_shared<Gelu>(stream), {x});
}

mx::array gelu_grad(const mx::array& g, const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, "fluxlike_native.gelu_grad: the kernel runs on "
            "the CPU, the stream is on the GPU");
  FLN_CHECK(float_or_half(g.dtype()) && float_or_half(x.dtype()), "fluxlike_native.gelu_grad: "
            "g and x must be float32, bfloat16 or float16, got ", dtype_str(g.dtype()), " and ",
            dtype_str(x.dtype()));
  if (g.shape() != x.shape() || g.dtype() != x.dtype()) {
    // (never built by Gelu's derivatives, whose cotangents and tangents have x's dtype)
    return mx::astype(mx::multiply(mx::astype(g, mx::float32, stream),
                                   gelu_prime_ops(x, stream), stream),
                      g.dtype(), stream);
  }
  return mx::array(g.shape(), g.dtype(), std::make_shared<GeluGrad>(stream), {g, x});
}

void Gelu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor x(inputs[0], encoder);
  reuse_or_allocate(out, *x, x.copied());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([px = x->data<void>(), py = out.data<void>(), dt = out.dtype(),
                    n = out.size()]() { gelu_pass(px, py, dt, n); });
}

void GeluGrad::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor g(inputs[0], encoder), x(inputs[1], encoder);
  reuse_or_allocate(out, *g, g.copied());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  encoder.dispatch([pg = g->data<void>(), px = x->data<void>(), po = out.data<void>(),
                    dt = out.dtype(), n = out.size()]() {
    gelu_grad_pass(pg, px, po, dt, n);
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> Gelu::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  return {{gelu(inputs[0], stream())}, {axes[0]}};  // elementwise: the axis stays
}

std::vector<mx::array> Gelu::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>&,
    const std::vector<mx::array>&) {
  return {gelu_grad(cotangents[0], primals[0], stream())};
}

std::vector<mx::array> Gelu::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>&) {
  return {gelu_grad(tangents[0], primals[0], stream())};
}

std::pair<std::vector<mx::array>, std::vector<int>> GeluGrad::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto in = mapped_in_front(inputs, axes, stream());  // g, x
  return {{gelu_grad(in[0], in[1], stream())}, {0}};
}

namespace {

std::vector<mx::array> grad_ops(const std::vector<mx::array>& in, mx::Stream s) {
  return {mx::astype(mx::multiply(mx::astype(in[0], mx::float32, s), gelu_prime_ops(in[1], s),
                                  s),
                     in[0].dtype(), s)};
}

} // namespace

std::vector<mx::array> GeluGrad::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  return vjp_of([s](const std::vector<mx::array>& in) { return grad_ops(in, s); }, primals,
                cotangents, argnums);
}

std::vector<mx::array> GeluGrad::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  return jvp_of([s](const std::vector<mx::array>& in) { return grad_ops(in, s); }, primals,
                tangents, argnums, s);
}

} // namespace fluxlike_native
