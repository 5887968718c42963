// fluxlike-native: the all-finite check of several arrays (see finite.h).

#include "finite.h"
#include "common.h"
#include "cpu.h"

#include <cstdint>
#include <cstring>
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

// Its two widths, built for AVX-512 and AVX2 too (the template alone is baseline x86-64).
FLN_VECTOR_CLONES bool any_nonfinite32(const uint32_t* x, int64_t n) {
  return any_nonfinite(x, n, 0x7F800000u);
}

FLN_VECTOR_CLONES bool any_nonfinite16(const uint16_t* x, int64_t n, uint16_t mask) {
  return any_nonfinite(x, n, mask);
}

bool any_nonfinite(const Span& s, int64_t lo, int64_t hi) {
  if (s.dtype == mx::float32) {
    return any_nonfinite32(static_cast<const uint32_t*>(s.data) + lo, hi - lo);
  }
  auto mask = static_cast<uint16_t>(s.dtype == mx::bfloat16 ? 0x7F80u : 0x7C00u);
  return any_nonfinite16(static_cast<const uint16_t*>(s.data) + lo, hi - lo, mask);
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

bool all_finite(const void* data, size_t n, mx::Dtype dtype) {
  return !any_nonfinite(std::vector<Span>{{data, static_cast<int64_t>(n), dtype}});
}

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

mx::array keep_if(const mx::array& flag, const mx::array& taken, const mx::array& kept,
                  mx::StreamOrDevice s) {
  const char* fn = "fluxlike_native.keep_if";
  FLN_CHECK(flag.ndim() == 0 && flag.dtype() == mx::bool_, fn, ": flag must be a 0-d bool "
            "array, got shape ", shape_str(flag.shape()), " and dtype ", dtype_str(flag.dtype()));
  FLN_CHECK(taken.shape() == kept.shape() && taken.dtype() == kept.dtype(), fn, ": taken and "
            "kept must have one shape and dtype, got ", shape_str(taken.shape()), " ",
            dtype_str(taken.dtype()), " and ", shape_str(kept.shape()), " ",
            dtype_str(kept.dtype()), "; use mx.where to broadcast");
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, fn, ": this kernel runs on the CPU, the stream "
            "is on the GPU; use mx.where there");
  return mx::array(taken.shape(), taken.dtype(), std::make_shared<KeepIf>(stream),
                   {flag, taken, kept});
}

void KeepIf::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto& flag = inputs[0];
  // (References, not copied handles: an input held twice is never donatable.)
  RowMajor taken(inputs[1], encoder), kept(inputs[2], encoder);
  for (const auto& x : inputs) {
    encoder.set_input_array(x);
  }
  size_t bytes = out.nbytes();
  if (!taken.copied() && taken->is_donatable()) {
    out.copy_shared_buffer(*taken);
    encoder.set_output_array(out);
    encoder.dispatch([flag = flag.data<bool>(), dst = out.data<void>(),
                      src = kept->data<void>(), bytes]() {
      if (!*flag && bytes != 0) std::memcpy(dst, src, bytes);
    });
    return;
  }
  out.set_data(mx::allocator::malloc(bytes));
  encoder.set_output_array(out);
  encoder.dispatch([flag = flag.data<bool>(), dst = out.data<void>(),
                    yes = taken->data<void>(), no = kept->data<void>(), bytes]() {
    if (bytes != 0) std::memcpy(dst, *flag ? yes : no, bytes);
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> KeepIf::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto front = [&](int i) {
    return axes[i] >= 0 ? mx::moveaxis(inputs[i], axes[i], 0, s) : inputs[i];
  };
  auto flag = front(0);
  if (axes[0] >= 0) {  // one flag per member: (members, 1, ...) against each member's array
    int ndim = inputs[1].ndim() - (axes[1] >= 0 ? 1 : 0);
    mx::Shape shape(static_cast<size_t>(ndim) + 1, 1);
    shape[0] = flag.shape(0);
    flag = mx::reshape(flag, shape, s);
  }
  return {{mx::where(flag, front(1), front(2), s)}, {0}};
}

std::vector<mx::array> KeepIf::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      grads.push_back(mx::zeros_like(primals[0], s));
    } else {
      auto zero = mx::zeros_like(cotangents[0], s);
      grads.push_back(arg == 1 ? mx::where(primals[0], cotangents[0], zero, s)
                               : mx::where(primals[0], zero, cotangents[0], s));
    }
  }
  return grads;
}

std::vector<mx::array> KeepIf::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  std::optional<mx::array> out;
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == 0) continue;
    auto zero = mx::zeros_like(tangents[i], s);
    auto t = argnums[i] == 1 ? mx::where(primals[0], tangents[i], zero, s)
                             : mx::where(primals[0], zero, tangents[i], s);
    out = out ? mx::add(*out, t, s) : t;
  }
  return {out ? *out : mx::zeros_like(primals[1], s)};
}

} // namespace fluxlike_native
