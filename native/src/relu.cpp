// fluxlike-native: the fused ReLU's passes (see relu.h).

#include "relu.h"
#include "common.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>

#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

// Branch-free (a mask of the bits: random signs would mispredict a branch half the time),
// so that the compiler vectorises it. y[i] > 0 (positive and finite or +inf; not NaN) is
// y's bit pattern minus one below `inf`'s, the pattern of +inf in y's dtype.
template <typename G, typename Y>
void relu_grad_loop(const G* g, const Y* y, G* out, size_t n, Y inf) {
  for (size_t i = 0; i < n; ++i) {
    auto positive = static_cast<Y>(y[i] - Y(1)) < inf;
    out[i] = g[i] & static_cast<G>(G(0) - static_cast<G>(positive));
  }
}

// Its four instantiations, each built for AVX-512 and AVX2 as well (a template instantiated
// in the task's lambda was baseline x86-64 only: 14% of a small CNN's first-layer backward).
FLN_VECTOR_CLONES void relu_grad_hh(const uint16_t* g, const uint16_t* y, uint16_t* out,
                                    size_t n, uint16_t inf) {
  relu_grad_loop(g, y, out, n, inf);
}
FLN_VECTOR_CLONES void relu_grad_hf(const uint16_t* g, const uint32_t* y, uint16_t* out,
                                    size_t n, uint32_t inf) {
  relu_grad_loop(g, y, out, n, inf);
}
FLN_VECTOR_CLONES void relu_grad_fh(const uint32_t* g, const uint16_t* y, uint32_t* out,
                                    size_t n, uint16_t inf) {
  relu_grad_loop(g, y, out, n, inf);
}
FLN_VECTOR_CLONES void relu_grad_ff(const uint32_t* g, const uint32_t* y, uint32_t* out,
                                    size_t n, uint32_t inf) {
  relu_grad_loop(g, y, out, n, inf);
}

// +inf's bit pattern in a float32, bfloat16 or float16.
uint32_t inf_bits(mx::Dtype d) {
  return d == mx::float32 ? 0x7F800000u : d == mx::bfloat16 ? 0x7F80u : 0x7C00u;
}

} // namespace

// relu(y) as MLX's maximum(y, 0) computes it, in place: NaN stays NaN, -0 becomes 0 (oneDNN's
// ReLU post-op is a vmaxps that returns 0 for NaN, which would make a layer that diverged look
// finite). Branch-free, and built for AVX-512 and AVX2 as well, picked at load time: the pass
// runs after a GEMM, on one thread, over its whole output.
FLN_VECTOR_CLONES void relu_float32(float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float v = y[i];
    y[i] = ((v > 0.f) | (v != v)) ? v : 0.f;
  }
}

// The same for bfloat16 or float16 bits, `inf` the dtype's +inf (0x7F80, 0x7C00): kept where
// positive (b - 1 below inf as unsigned: neither zero nor negative nor inf or NaN above it) or
// NaN (magnitude above inf).
FLN_VECTOR_CLONES void relu_half(uint16_t* y, size_t n, uint16_t inf) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t b = y[i];
    uint16_t keep = static_cast<uint16_t>(static_cast<uint16_t>(b - 1u) < inf) |
        static_cast<uint16_t>((b & 0x7FFFu) > inf);
    y[i] = static_cast<uint16_t>(b & static_cast<uint16_t>(0u - keep));
  }
}

void relu_keeping_nan(void* y, size_t n, mx::Dtype dt) {
  if (dt == mx::float32) {
    relu_float32(static_cast<float*>(y), n);
  } else {
    relu_half(static_cast<uint16_t*>(y), n, static_cast<uint16_t>(inf_bits(dt)));
  }
}


mx::array relu_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (g.shape() != y.shape() || !float_or_half(g.dtype()) || !float_or_half(y.dtype())) {
    // Anything else (never built by Matmul::vjp): MLX's ops.
    auto mask = mx::greater(y, mx::array(0.0f, y.dtype()), stream);
    return mx::where(mask, g, mx::array(0.0f, g.dtype()), stream);
  }
  return mx::array(g.shape(), g.dtype(), std::make_shared<ReluGrad>(stream), {g, y});
}

void ReluGrad::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // A flat pass: operands not row-contiguous are copied first (references otherwise, so that
  // the cotangent stays donatable).
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor g(inputs[0], encoder), y(inputs[1], encoder);
  reuse_or_allocate(out, *g, g.copied());  // (the cotangent's buffer, if free)
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  size_t n = out.size();
  const void* pg = g->data<void>();
  const void* py = y->data<void>();
  void* po = out.data<void>();
  bool g16 = g->itemsize() == 2, y16 = y->itemsize() == 2;
  encoder.dispatch([pg, py, po, n, g16, y16, inf = inf_bits(y->dtype())]() {
    auto h = [](const void* p) { return static_cast<const uint16_t*>(p); };
    auto f = [](const void* p) { return static_cast<const uint32_t*>(p); };
    if (g16) {
      auto out = static_cast<uint16_t*>(po);
      y16 ? relu_grad_hh(h(pg), h(py), out, n, static_cast<uint16_t>(inf))
          : relu_grad_hf(h(pg), f(py), out, n, inf);
    } else {
      auto out = static_cast<uint32_t*>(po);
      y16 ? relu_grad_fh(f(pg), h(py), out, n, static_cast<uint16_t>(inf))
          : relu_grad_ff(f(pg), f(py), out, n, inf);
    }
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> ReluGrad::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto in = mapped_in_front(inputs, axes, stream());  // g, y
  return {{relu_grad(in[0], in[1], stream())}, {0}};
}

std::vector<mx::array> ReluGrad::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {  // linear in g; piecewise constant in y
    grads.push_back(arg == 0 ? relu_grad(cotangents[0], primals[1], stream())
                             : mx::zeros_like(primals[1], stream()));
  }
  return grads;
}

std::vector<mx::array> ReluGrad::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == 0) {
      return {relu_grad(tangents[i], primals[1], stream())};
    }
  }
  return {mx::zeros_like(primals[0], stream())};
}

} // namespace fluxlike_native
