// fluxlike-native: the Adam and RMSprop updates as MLX primitives (see updates.h), float32 and
// bfloat16. A pass runs on MLX's CPU stream like the oneDNN kernels, split over OpenMP's
// threads (the libgomp oneDNN uses) for a large parameter. Built with -fno-math-errno (so that sqrt
// vectorises: it gives the same results, it only never sets errno), -ffp-contract=off (no
// fused multiply-add: each operation rounds, as MLX's ops do) and 512-bit vectors preferred
// in the AVX-512 build (the bfloat16 pass is compute-bound).

#include "updates.h"

#include <immintrin.h>

#include <cstring>
#include "common.h"
#include "cpu.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"

namespace fluxlike_native {

namespace {

struct Constants {
  float b1, omb1, b2, omb2, eps;
};

// Elements [lo, hi). ivdep: no element depends on another (GCC would otherwise version the
// loop for the 12 pairs of arrays that might overlap, more than it tests, and leave it scalar).
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

// Eight floats by two 16-byte non-temporal stores (32-byte alignment not needed).
__attribute__((target("avx2"))) inline void stream(float* to, __m256 x) {
  _mm_stream_ps(to, _mm256_castps256_ps128(x));
  _mm_stream_ps(to + 4, _mm256_extractf128_ps(x, 1));
}

// The same with its results written by non-temporal stores, for a parameter larger than the
// caches: the three outputs are new buffers (see prepare), so ordinary stores read each of
// their lines from memory before writing it, 12 of the 40 bytes an element moves. The
// arithmetic is the loop's above, op for op (IEEE's sqrt and division: any vector width gives
// the same bits). The outputs must be 16-byte aligned at one element index (MLX's buffers all
// lie 8 bytes past a 16-byte boundary); elements before it and after the last whole vector
// take the loop above. 2**24 elements of Adam: 18 against 10 ms on two threads, Intel Xeon
// with AMX (a standalone loop).
__attribute__((target("avx2"))) void adam_range_streaming(
    const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
    float* vo, int64_t lo, int64_t hi, float c1, float c2, float decay, Constants k) {
  int64_t i = lo;
  while (i < hi && reinterpret_cast<uintptr_t>(po + i) % 16 != 0) ++i;
  adam_range(p, g, m, v, po, mo, vo, lo, i, c1, c2, decay, k);
  auto b1 = _mm256_set1_ps(k.b1), omb1 = _mm256_set1_ps(k.omb1), b2 = _mm256_set1_ps(k.b2);
  auto omb2 = _mm256_set1_ps(k.omb2), eps = _mm256_set1_ps(k.eps), vc1 = _mm256_set1_ps(c1);
  auto vc2 = _mm256_set1_ps(c2), vdecay = _mm256_set1_ps(decay);
  for (; i + 8 <= hi; i += 8) {
    auto gi = _mm256_loadu_ps(g + i);
    auto mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(omb1, gi));
    auto vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)),
                            _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
    auto pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), vdecay);
    auto step = _mm256_div_ps(_mm256_mul_ps(vc1, mi),
                              _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), vc2), eps));
    stream(mo + i, mi);
    stream(vo + i, vi);
    stream(po + i, _mm256_sub_ps(pi, step));
  }
  adam_range(p, g, m, v, po, mo, vo, i, hi, c1, c2, decay, k);
  _mm_sfence();  // (the stores are weakly ordered: done before the task is)
}

// Whether a float32 pass of n elements streams its results: a parameter of 2**17 elements or
// more (512 KB; its pass moves 20 MB), on a CPU with AVX2, with the three outputs alike modulo
// 16 bytes. A model's update reads every parameter and moment once a step, so at these sizes
// nothing of it is still cached when the next step reads it: 48 parameters of 512 x 512,
// 28.9 -> 15.8 ms (the threshold at 2**20 against 2**17, Intel Xeon with AMX). Smaller ones
// (a small MLP's whole update fits in L2) keep ordinary stores.
bool streams(int64_t n, const void* po, const void* mo, const void* vo) {
  auto at = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16; };
  return n >= (int64_t{1} << 17) && has_avx2() && at(po) % 4 == 0 && at(po) == at(mo) &&
      at(po) == at(vo);
}

// x rounded to bfloat16 as MLX's CPU ops round each result (common.h: narrow), as a float.
inline float r(float x) {
  return widen(narrow(x));
}

FLN_VECTOR_CLONES void adam_range(const uint16_t* p, const uint16_t* g, const uint16_t* m,
                                  const uint16_t* v, uint16_t* po, uint16_t* mo, uint16_t* vo,
                                  int64_t lo, int64_t hi, float c1, float c2, float decay,
                                  Constants k) {
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    float gi = widen(g[i]);
    float mi = r(r(k.b1 * widen(m[i])) + r(k.omb1 * gi));
    float vi = r(r(k.b2 * widen(v[i])) + r(k.omb2 * r(gi * gi)));
    float pi = r(widen(p[i]) * decay);
    float step = r(r(c1 * mi) / r(r(r(std::sqrt(vi)) * c2) + k.eps));
    mo[i] = narrow(mi);
    vo[i] = narrow(vi);
    po[i] = narrow(pi - step);
  }
}

FLN_VECTOR_CLONES void rmsprop_range(const float* p, const float* g, const float* v, float* po,
                                     float* vo, int64_t lo, int64_t hi, float lr, float alpha,
                                     float oma, float eps) {
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    float gi = g[i];
    float vi = alpha * v[i] + oma * (gi * gi);
    vo[i] = vi;
    po[i] = p[i] - (lr * gi) / (std::sqrt(vi) + eps);
  }
}

FLN_VECTOR_CLONES void rmsprop_range(const uint16_t* p, const uint16_t* g, const uint16_t* v,
                                     uint16_t* po, uint16_t* vo, int64_t lo, int64_t hi,
                                     float lr, float alpha, float oma, float eps) {
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    float gi = widen(g[i]);
    float vi = r(r(alpha * widen(v[i])) + r(oma * r(gi * gi)));
    vo[i] = narrow(vi);
    po[i] = narrow(widen(p[i]) - r(r(lr * gi) / r(r(std::sqrt(vi)) + eps)));
  }
}

// One element of a pass takes about as long as this many multiply-adds of a float32 GEMM
// (bench/onethread.py, "adam" rows against "linear" rows): a pass of n elements runs on one
// thread where a GEMM of n * ELEMENT_MACS would (cpu.h: single_thread_macs); above, blocks
// of BLOCK elements are shared out.
constexpr double ELEMENT_MACS = 32;
constexpr int64_t BLOCK = 1 << 14;

// `fn` names the entry and `rule` the MLX optimiser to use instead in the messages.
struct Names {
  const char* fn;
  const char* rule;
};
const Names ADAM{"fluxlike_native.adam_step", "mlx.optimizers.Adam"};
const Names RMSPROP{"fluxlike_native.rmsprop_step", "mlx.optimizers.RMSprop"};

void check(const Names& n, const mx::array& x, const char* what, const mx::array& p) {
  FLN_CHECK(p.dtype() == mx::float32 || p.dtype() == mx::bfloat16, n.fn, ": expected a float32 "
            "or bfloat16 parameter, got ", dtype_str(p.dtype()), "; use ", n.rule);
  FLN_CHECK(x.dtype() == p.dtype(), n.fn, ": expected ", what, " of the parameter's dtype ",
            dtype_str(p.dtype()), ", got ", dtype_str(x.dtype()), "; cast it to ",
            dtype_str(p.dtype()), ", or use ", n.rule);
  FLN_CHECK(x.shape() == p.shape(), n.fn, ": ", what, " has shape ", shape_str(x.shape()),
            ", the parameter ", shape_str(p.shape()), "; they must have one shape");
}

void check_scalar(const Names& n, const mx::array& x, const char* what, const mx::array& p) {
  FLN_CHECK(x.dtype() == p.dtype() && x.ndim() == 0, n.fn, ": expected ", what, " to be a 0-d ",
            dtype_str(p.dtype()), " array (the parameter's dtype), got ", dtype_str(x.dtype()),
            " of shape ", shape_str(x.shape()), "; use ", n.rule,
            " for a broadcast learning rate");
}

mx::Stream cpu_stream(const Names& n, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, n.fn, ": this kernel runs on the CPU, the stream "
            "is on the GPU; use ", n.rule, "'s own update there");
  return stream;
}

// A Python float as MLX makes it an array of the parameter's dtype: to float32, then
// (bfloat16) rounded.
float constant(double x, bool bf16) {
  auto f = static_cast<float>(x);
  return bf16 ? r(f) : f;
}

// The first `n` inputs (the arrays the pass reads) row-contiguous: a strided one is copied
// first. The outputs get new buffers, and all are registered with the encoder. (Writing the
// outputs over their inputs would save a third of the pass's memory traffic, but MLX gives
// each output of a primitive its own copy of the inputs, so no input of one with several
// outputs is ever donatable.)
std::vector<mx::array> prepare(const std::vector<mx::array>& inputs, size_t n,
                               std::vector<mx::array>& outputs,
                               mx::cpu::CommandEncoder& encoder) {
  std::vector<mx::array> dense;
  for (size_t i = 0; i < n; ++i) {
    const auto& x = inputs[i];
    dense.push_back(x.flags().row_contiguous ? x : row_contiguous_copy(x, encoder));
  }
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  return dense;
}

// mx.vmap of an elementwise update: its first `n` inputs (the arrays) with the mapped axis
// moved to the front, each broadcast to the batched parameter's shape where it is not
// mapped; the rest (scalars) as they are, or, where one is mapped, shaped (size, 1, ..., 1)
// for the formula's broadcasting ops.
struct Batched {
  mx::Shape shape;
  std::vector<mx::array> operands;
  bool scalars_mapped = false;
};

Batched batch(const std::vector<mx::array>& inputs, const std::vector<int>& axes, size_t n,
              mx::Stream s) {
  int size = 0;  // the mapped axis's length
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      size = inputs[i].shape(axes[i]);
    }
  }
  Batched b;
  for (size_t i = 0; i < n && b.shape.empty(); ++i) {
    if (axes[i] >= 0) {
      b.shape = mx::moveaxis(inputs[i], axes[i], 0, s).shape();
    }
  }
  if (b.shape.empty()) {  // only scalars mapped
    b.shape = inputs[0].shape();
    b.shape.insert(b.shape.begin(), size);
  }
  for (size_t i = 0; i < n; ++i) {
    b.operands.push_back(axes[i] >= 0
                             ? mx::moveaxis(inputs[i], axes[i], 0, s)
                             : mx::broadcast_to(mx::expand_dims(inputs[i], 0, s), b.shape, s));
  }
  for (size_t i = n; i < inputs.size(); ++i) {
    b.scalars_mapped = b.scalars_mapped || axes[i] >= 0;
  }
  mx::Shape column(b.shape.size(), 1);
  column[0] = size;
  for (size_t i = n; i < inputs.size(); ++i) {
    b.operands.push_back(axes[i] >= 0 && b.scalars_mapped ? mx::reshape(inputs[i], column, s)
                                                          : inputs[i]);
  }
  return b;
}

// A value of one element as the pass reads it.
float value(const void* x, bool bf16) {
  return bf16 ? widen(*static_cast<const uint16_t*>(x)) : *static_cast<const float*>(x);
}

} // namespace

void UpdateStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " has no GPU kernel");
}

std::vector<mx::array> UpdateStep::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  return vjp_of([this](const std::vector<mx::array>& in) { return reference(in); }, primals,
                cotangents, argnums);
}

std::vector<mx::array> UpdateStep::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  return jvp_of([this](const std::vector<mx::array>& in) { return reference(in); }, primals,
                tangents, argnums, stream());
}

std::vector<mx::array> adam_step(
    const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
    const mx::array& c1, const mx::array& c2, const std::optional<mx::array>& decay,
    double b1, double b2, double eps, const std::optional<mx::array>& keep,
    mx::StreamOrDevice s) {
  check(ADAM, p, "the parameter", p);
  check(ADAM, g, "the gradient", p);
  check(ADAM, m, "m", p);
  check(ADAM, v, "v", p);
  check_scalar(ADAM, c1, "c1", p);
  check_scalar(ADAM, c2, "c2", p);
  if (decay) {
    check_scalar(ADAM, *decay, "decay", p);
  }
  auto stream = cpu_stream(ADAM, s);
  std::vector<mx::array> inputs{p, g, m, v, c1, c2};
  if (decay) {
    inputs.push_back(*decay);
  }
  if (keep) {
    FLN_CHECK(keep->ndim() == 0 && keep->dtype() == mx::bool_, ADAM.fn, ": keep must be a 0-d "
              "bool array, got shape ", shape_str(keep->shape()), " and dtype ",
              dtype_str(keep->dtype()));
    inputs.push_back(*keep);
  }
  bool bf16 = p.dtype() == mx::bfloat16;
  auto prim = std::make_shared<AdamStep>(
      stream, constant(b1, bf16), constant(1.0 - b1, bf16), constant(b2, bf16),
      constant(1.0 - b2, bf16), constant(eps, bf16), keep.has_value());
  auto dt = p.dtype();
  return mx::array::make_arrays({p.shape(), p.shape(), p.shape()}, {dt, dt, dt}, prim, inputs);
}

bool AdamStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AdamStep&>(other);
  return b1_ == o.b1_ && omb1_ == o.omb1_ && b2_ == o.b2_ && omb2_ == o.omb2_ &&
      eps_ == o.eps_ && has_keep_ == o.has_keep_;
}

void AdamStep::eval_cpu(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto dense = prepare(inputs, 4, outputs, encoder);
  if (outputs[0].size() == 0) {
    return;
  }
  bool has_decay = inputs.size() == 7 + (has_keep_ ? 1 : 0);
  encoder.dispatch([p = dense[0].data<void>(), g = dense[1].data<void>(),
                    m = dense[2].data<void>(), v = dense[3].data<void>(),
                    po = outputs[0].data<void>(), mo = outputs[1].data<void>(),
                    vo = outputs[2].data<void>(), c1 = inputs[4].data<void>(),
                    c2 = inputs[5].data<void>(),
                    decay = has_decay ? inputs[6].data<void>() : nullptr,
                    keep = has_keep_ ? inputs.back().data<bool>() : nullptr,
                    n = static_cast<int64_t>(outputs[0].size()),
                    bf16 = outputs[0].dtype() == mx::bfloat16,
                    k = Constants{b1_, omb1_, b2_, omb2_, eps_}]() {
    if (keep != nullptr && !*keep) {  // a skipped step: the state as it was
      size_t bytes = static_cast<size_t>(n) * (bf16 ? 2 : 4);
      std::memcpy(po, p, bytes);
      std::memcpy(mo, m, bytes);
      std::memcpy(vo, v, bytes);
      return;
    }
    // p * 1 is p exactly (NaN, infinities and -0 too; in bfloat16 p rounds to itself): Adam is
    // AdamW's pass with decay 1.
    float c1v = value(c1, bf16), c2v = value(c2, bf16);
    float d = decay != nullptr ? value(decay, bf16) : 1.0f;
    if (!bf16 && streams(n, po, mo, vo)) {
      auto f = [](void* x) { return static_cast<float*>(x); };
      shared_out(n, ELEMENT_MACS, BLOCK, [&](int64_t lo, int64_t hi) {
        adam_range_streaming(f(p), f(g), f(m), f(v), f(po), f(mo), f(vo), lo, hi, c1v, c2v, d,
                             k);
      });
      return;
    }
    auto run = [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      shared_out(n, ELEMENT_MACS, BLOCK, [&](int64_t lo, int64_t hi) {
        adam_range(static_cast<const T*>(p), static_cast<const T*>(g),
                   static_cast<const T*>(m), static_cast<const T*>(v), static_cast<T*>(po),
                   static_cast<T*>(mo), static_cast<T*>(vo), lo, hi, c1v, c2v, d, k);
      });
    };
    if (bf16) {
      run(static_cast<uint16_t*>(nullptr));
    } else {
      run(static_cast<float*>(nullptr));
    }
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> AdamStep::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto b = batch(inputs, axes, 4, s);
  if (b.scalars_mapped) {  // a learning rate per member: the formula in MLX's ops
    return {reference(b.operands), {0, 0, 0}};
  }
  auto dt = inputs[0].dtype();  // one learning rate for all: the same kernel over the batch
  auto prim = std::make_shared<AdamStep>(s, b1_, omb1_, b2_, omb2_, eps_, has_keep_);
  return {mx::array::make_arrays({b.shape, b.shape, b.shape}, {dt, dt, dt}, prim, b.operands),
          {0, 0, 0}};
}

std::vector<mx::array> AdamStep::reference(const std::vector<mx::array>& in) {
  auto s = stream();
  auto p = in.size() == 7 + (has_keep_ ? 1 : 0) ? mx::multiply(in[0], in[6], s) : in[0];
  const auto& g = in[1];
  auto scalar = [dt = in[0].dtype()](float x) { return mx::array(x, dt); };
  auto m = mx::add(mx::multiply(scalar(b1_), in[2], s), mx::multiply(scalar(omb1_), g, s), s);
  auto v = mx::add(mx::multiply(scalar(b2_), in[3], s),
                   mx::multiply(scalar(omb2_), mx::square(g, s), s), s);
  auto numerator = mx::multiply(in[4], m, s);
  auto denominator = mx::add(mx::multiply(mx::sqrt(v, s), in[5], s), scalar(eps_), s);
  auto p_new = mx::subtract(p, mx::divide(numerator, denominator, s), s);
  if (!has_keep_) {
    return {p_new, m, v};
  }
  const auto& keep = in.back();
  return {mx::where(keep, p_new, in[0], s), mx::where(keep, m, in[2], s),
          mx::where(keep, v, in[3], s)};
}

std::vector<mx::array> rmsprop_step(
    const mx::array& p, const mx::array& g, const mx::array& v, const mx::array& lr,
    double alpha, double eps, mx::StreamOrDevice s) {
  check(RMSPROP, p, "the parameter", p);
  check(RMSPROP, g, "the gradient", p);
  check(RMSPROP, v, "v", p);
  check_scalar(RMSPROP, lr, "lr", p);
  auto stream = cpu_stream(RMSPROP, s);
  bool bf16 = p.dtype() == mx::bfloat16;
  auto prim = std::make_shared<RmsPropStep>(stream, constant(alpha, bf16),
                                            constant(1.0 - alpha, bf16), constant(eps, bf16));
  auto dt = p.dtype();
  return mx::array::make_arrays({p.shape(), p.shape()}, {dt, dt}, prim, {p, g, v, lr});
}

bool RmsPropStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RmsPropStep&>(other);
  return alpha_ == o.alpha_ && oma_ == o.oma_ && eps_ == o.eps_;
}

void RmsPropStep::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto dense = prepare(inputs, 3, outputs, encoder);
  if (outputs[0].size() == 0) {
    return;
  }
  encoder.dispatch([p = dense[0].data<void>(), g = dense[1].data<void>(),
                    v = dense[2].data<void>(), po = outputs[0].data<void>(),
                    vo = outputs[1].data<void>(), lr = inputs[3].data<void>(),
                    n = static_cast<int64_t>(outputs[0].size()),
                    bf16 = outputs[0].dtype() == mx::bfloat16, alpha = alpha_, oma = oma_,
                    eps = eps_]() {
    float lrv = value(lr, bf16);
    auto run = [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      shared_out(n, ELEMENT_MACS, BLOCK, [&](int64_t lo, int64_t hi) {
        rmsprop_range(static_cast<const T*>(p), static_cast<const T*>(g),
                      static_cast<const T*>(v), static_cast<T*>(po), static_cast<T*>(vo), lo,
                      hi, lrv, alpha, oma, eps);
      });
    };
    if (bf16) {
      run(static_cast<uint16_t*>(nullptr));
    } else {
      run(static_cast<float*>(nullptr));
    }
  });
}

std::vector<mx::array> RmsPropStep::reference(const std::vector<mx::array>& in) {
  auto s = stream();
  auto scalar = [dt = in[0].dtype()](float x) { return mx::array(x, dt); };
  const auto& g = in[1];
  auto v = mx::add(mx::multiply(scalar(alpha_), in[2], s),
                   mx::multiply(scalar(oma_), mx::square(g, s), s), s);
  auto step = mx::divide(mx::multiply(in[3], g, s), mx::add(mx::sqrt(v, s), scalar(eps_), s), s);
  return {mx::subtract(in[0], step, s), v};
}

std::pair<std::vector<mx::array>, std::vector<int>> RmsPropStep::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto b = batch(inputs, axes, 3, s);
  if (b.scalars_mapped) {
    return {reference(b.operands), {0, 0}};
  }
  auto dt = inputs[0].dtype();
  auto prim = std::make_shared<RmsPropStep>(s, alpha_, oma_, eps_);
  return {mx::array::make_arrays({b.shape, b.shape}, {dt, dt}, prim, b.operands), {0, 0}};
}

} // namespace fluxlike_native
