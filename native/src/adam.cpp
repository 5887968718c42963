// fluxlike-native: the Adam update as an MLX primitive (see adam.h). The pass runs on MLX's
// CPU stream like the oneDNN kernels, split over OpenMP's threads (the libgomp oneDNN uses)
// for a large parameter. Built with -fno-math-errno (so that sqrt vectorises: it gives the
// same results, it only never sets errno) and -ffp-contract=off (no fused multiply-add: each
// operation rounds, as MLX's ops do).

#include "adam.h"
#include "common.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.adam_step";

struct Constants {
  float b1, omb1, b2, omb2, eps;
};

// Elements [lo, hi). Outputs may be their inputs (a donated buffer: the same element is read
// before it is written), hence ivdep rather than restrict.
FLN_VECTOR_CLONES void adam_range(const float* p, const float* g, const float* m,
                                  const float* v, float* po, float* mo, float* vo, int64_t lo,
                                  int64_t hi, float c1, float c2, float decay, Constants k) {
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    float gi = g[i];
    float mi = k.b1 * m[i] + k.omb1 * gi;
    float vi = k.b2 * v[i] + k.omb2 * (gi * gi);
    float pi = p[i] * decay;
    mo[i] = mi;
    vo[i] = vi;
    po[i] = pi - (c1 * mi) / (std::sqrt(vi) * c2 + k.eps);
  }
}

// Below this many elements one thread does the whole pass (a parallel region costs more
// than it saves); above, blocks of BLOCK elements are shared out.
constexpr int64_t PARALLEL_MIN = 1 << 16;
constexpr int64_t BLOCK = 1 << 14;

void adam_pass(const float* p, const float* g, const float* m, const float* v, float* po,
               float* mo, float* vo, int64_t n, float c1, float c2, float decay, Constants k) {
  if (n < PARALLEL_MIN) {
    adam_range(p, g, m, v, po, mo, vo, 0, n, c1, c2, decay, k);
    return;
  }
  int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t lo = b * BLOCK;
    int64_t hi = lo + BLOCK < n ? lo + BLOCK : n;
    adam_range(p, g, m, v, po, mo, vo, lo, hi, c1, c2, decay, k);
  }
}

void check(const mx::array& x, const char* what, const mx::array& p) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument(std::string(FN) + ": expected " + what + " to be float32");
  }
  if (x.shape() != p.shape()) {
    throw std::invalid_argument(std::string(FN) + ": " + what + " has shape " +
                                shape_str(x.shape()) + ", the parameter " +
                                shape_str(p.shape()));
  }
}

void check_scalar(const mx::array& x, const char* what) {
  if (x.dtype() != mx::float32 || x.size() != 1) {
    throw std::invalid_argument(std::string(FN) + ": expected " + what +
                                " to be a float32 array of one element");
  }
}

mx::array scalar(float value) {
  return mx::array(value, mx::float32);
}

} // namespace

std::vector<mx::array> adam_step(
    const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
    const mx::array& c1, const mx::array& c2, const std::optional<mx::array>& decay,
    double b1, double b2, double eps, mx::StreamOrDevice s) {
  check(p, "the parameter", p);
  check(g, "the gradient", p);
  check(m, "m", p);
  check(v, "v", p);
  check_scalar(c1, "c1");
  check_scalar(c2, "c2");
  if (decay) {
    check_scalar(*decay, "decay");
  }
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(std::string(FN) + ": this kernel runs on the CPU, the stream "
                                "is on the GPU; use mlx.optimizers.Adam's own update there");
  }
  std::vector<mx::array> inputs{p, g, m, v, c1, c2};
  if (decay) {
    inputs.push_back(*decay);
  }
  auto prim = std::make_shared<AdamStep>(
      stream, static_cast<float>(b1), static_cast<float>(1.0 - b1), static_cast<float>(b2),
      static_cast<float>(1.0 - b2), static_cast<float>(eps));
  return mx::array::make_arrays({p.shape(), p.shape(), p.shape()},
                                {mx::float32, mx::float32, mx::float32}, prim, inputs);
}

bool AdamStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AdamStep&>(other);
  return b1_ == o.b1_ && omb1_ == o.omb1_ && b2_ == o.b2_ && omb2_ == o.omb2_ &&
      eps_ == o.eps_;
}

void AdamStep::eval_cpu(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // p, g, m, v as the pass reads them: row-contiguous (a strided one is copied first).
  std::vector<mx::array> dense;
  for (int i = 0; i < 4; ++i) {
    const auto& x = inputs[i];
    dense.push_back(x.flags().row_contiguous ? x : row_contiguous_copy(x, encoder));
  }
  // p' into p's buffer, m' into m's, v' into v's where they can be donated.
  const int source[3] = {0, 2, 3};
  for (int k = 0; k < 3; ++k) {
    const auto& in = inputs[source[k]];
    if (in.is_donatable() && in.flags().row_contiguous && in.size() == outputs[k].size()) {
      outputs[k].copy_shared_buffer(in);
    } else {
      outputs[k].set_data(mx::allocator::malloc(outputs[k].nbytes()));
    }
  }
  if (outputs[0].size() == 0) {
    return;
  }
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  bool has_decay = inputs.size() == 7;
  encoder.dispatch([p = dense[0].data<float>(), g = dense[1].data<float>(),
                    m = dense[2].data<float>(), v = dense[3].data<float>(),
                    po = outputs[0].data<float>(), mo = outputs[1].data<float>(),
                    vo = outputs[2].data<float>(), c1 = inputs[4].data<float>(),
                    c2 = inputs[5].data<float>(),
                    decay = has_decay ? inputs[6].data<float>() : nullptr,
                    n = static_cast<int64_t>(outputs[0].size()),
                    k = Constants{b1_, omb1_, b2_, omb2_, eps_}]() {
    // p * 1 is p exactly (NaN, infinities and -0 too): Adam is AdamW's pass with decay 1.
    adam_pass(p, g, m, v, po, mo, vo, n, *c1, *c2, decay ? *decay : 1.0f, k);
  });
}

void AdamStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(FN) + " has no GPU kernel");
}

std::vector<mx::array> AdamStep::reference(const std::vector<mx::array>& in) {
  auto s = stream();
  auto p = in.size() == 7 ? mx::multiply(in[0], in[6], s) : in[0];
  const auto& g = in[1];
  auto m = mx::add(mx::multiply(scalar(b1_), in[2], s), mx::multiply(scalar(omb1_), g, s), s);
  auto v = mx::add(mx::multiply(scalar(b2_), in[3], s),
                   mx::multiply(scalar(omb2_), mx::square(g, s), s), s);
  auto numerator = mx::multiply(in[4], m, s);
  auto denominator = mx::add(mx::multiply(mx::sqrt(v, s), in[5], s), scalar(eps_), s);
  return {mx::subtract(p, mx::divide(numerator, denominator, s), s), m, v};
}

std::vector<mx::array> AdamStep::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto fn = [this](const std::vector<mx::array>& in) { return reference(in); };
  auto grads = mx::vjp(fn, primals, cotangents).second;
  std::vector<mx::array> picked;
  for (int arg : argnums) {
    picked.push_back(grads[arg]);
  }
  return picked;
}

std::vector<mx::array> AdamStep::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  std::vector<mx::array> full;
  for (const auto& x : primals) {
    full.push_back(mx::zeros_like(x, stream()));
  }
  for (size_t j = 0; j < argnums.size(); ++j) {
    full[argnums[j]] = tangents[j];
  }
  auto fn = [this](const std::vector<mx::array>& in) { return reference(in); };
  return mx::jvp(fn, primals, full).second;
}

} // namespace fluxlike_native
