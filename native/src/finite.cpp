// fluxlike-native: the all-finite check of several arrays (see finite.h).

#include "finite.h"
#include "common.h"
#include "cpu.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

// Whether any of the n values has its exponent all ones (inf or nan): `mask` is the exponent
// field of T's floating type. Branch-free (an or of comparisons), so that it vectorises.
template <typename T>
bool any_nonfinite(const T* x, int64_t n, T mask) {
  T bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad |= static_cast<T>((x[i] & mask) == mask);
  }
  return bad != 0;
}

struct Span {
  const void* data;
  int64_t size;
  mx::Dtype dtype;
};

bool any_nonfinite(const Span& s, int64_t lo, int64_t hi) {
  if (s.dtype == mx::float32) {
    return any_nonfinite(static_cast<const uint32_t*>(s.data) + lo, hi - lo, 0x7F800000u);
  }
  auto mask = static_cast<uint16_t>(s.dtype == mx::bfloat16 ? 0x7F80u : 0x7C00u);
  return any_nonfinite(static_cast<const uint16_t*>(s.data) + lo, hi - lo, mask);
}

// An element of the check counts as this many multiply-adds against the one-thread threshold
// (cpu.h: single_thread_macs; an estimate, not measured: a load, an and and a compare per
// element, memory-bound): arrays below it are read on this thread (2**20 float32 elements
// and fewer), larger ones in blocks shared out over OpenMP's.
constexpr double ELEMENT_MACS = 4;
constexpr int64_t BLOCK = 1 << 16;

bool any_nonfinite(const std::vector<Span>& spans) {
  bool bad = false;
  for (const auto& s : spans) {
    if (static_cast<double>(s.size) * ELEMENT_MACS < single_thread_macs() || s.size <= BLOCK) {
      bad = bad || any_nonfinite(s, 0, s.size);
      continue;
    }
    int64_t blocks = (s.size + BLOCK - 1) / BLOCK;
    int found = 0;
#pragma omp parallel for schedule(static) reduction(| : found)
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t lo = b * BLOCK;
      found |= any_nonfinite(s, lo, lo + BLOCK < s.size ? lo + BLOCK : s.size) ? 1 : 0;
    }
    bad = bad || found != 0;
  }
  return bad;
}

// The check in MLX's ops (for vmap): per array, whether all its elements along every axis but
// the first (the mapped one) are finite; anded.
mx::array reference(const std::vector<mx::array>& xs, mx::Stream s) {
  std::optional<mx::array> out;
  for (const auto& x : xs) {
    std::vector<int> axes;
    for (int i = 1; i < x.ndim(); ++i) {
      axes.push_back(i);
    }
    auto one = mx::all(mx::isfinite(x, s), axes, false, s);
    out = out ? mx::logical_and(*out, one, s) : one;
  }
  return *out;
}

} // namespace

mx::array all_finite(const std::vector<mx::array>& xs, mx::StreamOrDevice s) {
  FLN_CHECK(!xs.empty(), "fluxlike_native.all_finite: expected at least one array, got none");
  for (const auto& x : xs) {
    FLN_CHECK(float_or_half(x.dtype()), "fluxlike_native.all_finite: expected float32, "
              "bfloat16 or float16 arrays, got ", dtype_str(x.dtype()),
              "; use mx.all(mx.isfinite(x)) for other dtypes");
  }
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, "fluxlike_native.all_finite: this kernel runs on "
            "the CPU, the stream is on the GPU; use mx.all(mx.isfinite(x)) there");
  return mx::array({}, mx::bool_, std::make_shared<AllFinite>(stream), xs);
}

void AllFinite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // An array whose buffer holds exactly its elements (in any order) is read as it is; any
  // other view (a slice, a broadcast) is copied first, so that no element outside it is read.
  std::vector<Span> spans;
  for (const auto& x : inputs) {
    const auto& dense = x.flags().contiguous && x.data_size() == x.size()
                            ? x
                            : row_contiguous_copy(x, encoder);
    spans.push_back({dense.data<void>(), static_cast<int64_t>(dense.size()), dense.dtype()});
    encoder.set_input_array(x);
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  encoder.dispatch([spans = std::move(spans), result = out.data<bool>()]() {
    *result = !any_nonfinite(spans);
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> AllFinite::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  // Per member: an unmapped array is the same for every member, its check a scalar that
  // broadcasts against the others'.
  auto s = stream();
  std::vector<mx::array> mapped, shared;
  for (size_t i = 0; i < inputs.size(); ++i) {
    (axes[i] >= 0 ? mapped : shared)
        .push_back(axes[i] >= 0 ? mx::moveaxis(inputs[i], axes[i], 0, s) : inputs[i]);
  }
  auto out = reference(mapped, s);
  if (!shared.empty()) {
    out = mx::logical_and(out, all_finite(shared, s), s);
  }
  return {{out}, {0}};
}

std::vector<mx::array> AllFinite::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>&,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {  // a bool of its inputs: piecewise constant
    grads.push_back(mx::zeros_like(primals[arg], stream()));
  }
  return grads;
}

std::vector<mx::array> AllFinite::jvp(
    const std::vector<mx::array>&,
    const std::vector<mx::array>&,
    const std::vector<int>&) {
  return {mx::zeros({}, mx::bool_, stream())};
}

} // namespace fluxlike_native
