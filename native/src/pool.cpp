// fluxlike-native: oneDNN max pooling as MLX primitives (forward with its workspace, and
// backward), channels-last activations.
//
// As in conv.cpp: eval_cpu looks up (or creates) a cached oneDNN primitive for the exact
// shapes, dtype and parameters, on the evaluating thread, and dispatches its execution to
// MLX's CPU stream. The forward pass writes oneDNN's workspace (where each window's maximum
// is) as a second output, which the backward pass reads: the gradient is one scatter of the
// cotangent, instead of MLX's strided view, comparison and division.

#include "pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <type_traits>

#include "cache.h"
#include "cast.h"
#include "common.h"
#include "cpu.h"
#include "matmul.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.max_pool";
using dims = dnnl::memory::dims;

// The workspace's dtype: oneDNN keeps a window offset per output, in one byte for windows of
// fewer than 256 entries.
mx::Dtype workspace_dtype(const PoolParams& p) {
  int64_t n = 1;
  for (int k : p.kernel) n *= k;
  return n < 256 ? mx::uint8 : mx::int32;
}

dims to_dims(const std::vector<int>& v) {
  return dims(v.begin(), v.end());
}

std::shared_ptr<const Prepared> lookup(bool backward, const PoolParams& p, const mx::Shape& xs,
                                       const mx::Shape& ys, mx::Dtype dt,
                                       bool defer_first = false) {
  CacheKey key{backward, static_cast<int64_t>(dt.val()), static_cast<int64_t>(xs.size())};
  key.insert(key.end(), xs.begin(), xs.end());
  key.insert(key.end(), ys.begin(), ys.end());
  for (auto* v : {&p.kernel, &p.stride, &p.pad_lo, &p.pad_hi}) {
    key.insert(key.end(), v->begin(), v->end());
  }
  return cached<Prepared>(Op::MaxPool, std::move(key), FN, "max pooling", [&] {
    auto x_md = act_md(xs, dt), y_md = act_md(ys, dt);
    auto attr = user_scratchpad();
    auto& eng = engine();
    auto kernel = to_dims(p.kernel), strides = to_dims(p.stride);
    auto pl = to_dims(p.pad_lo), pr = to_dims(p.pad_hi);
    dims dil(kernel.size(), 0);
    double work = 1;
    for (auto d : ys) work *= d;
    for (int k : p.kernel) work *= k;
    OneThread one(work < single_thread_macs());
    auto fwd = dnnl::pooling_forward::primitive_desc(
        eng, dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, x_md, y_md,
        strides, kernel, dil, pl, pr, attr);
    // The workspace travels as an MLX array of y's shape (workspace_dtype): check that
    // oneDNN's is exactly that big.
    size_t ws_bytes = 1;
    for (auto d : ys) ws_bytes *= d;
    ws_bytes *= workspace_dtype(p).size();
    if (fwd.workspace_desc().get_size() != ws_bytes) {
      throw std::runtime_error(std::string(FN) + ": internal error: oneDNN's workspace (" +
                               std::to_string(fwd.workspace_desc().get_size()) + " bytes) is " +
                               "not one entry per output (" + std::to_string(ws_bytes) +
                               " bytes)");
    }
    if (!backward) {
      return std::make_shared<const Prepared>(
          prepare(fwd, {DNNL_ARG_SRC, DNNL_ARG_DST, DNNL_ARG_WORKSPACE}));
    }
    auto pd = dnnl::pooling_backward::primitive_desc(
        eng, dnnl::algorithm::pooling_max, x_md, y_md, strides, kernel, dil, pl, pr, fwd, attr);
    return std::make_shared<const Prepared>(
        prepare(pd, {DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC, DNNL_ARG_WORKSPACE}));
  }, defer_first, [&] {
    return std::function<void()>([backward, p, xs, ys, dt] { lookup(backward, p, xs, ys, dt); });
  });
}


// NaN in a window makes its maximum NaN, as MLX's max and PyTorch's max pooling give it;
// oneDNN's pooling compares with vmaxps, which drops NaN (a diverged activation would vanish).
// After the kernel: one vectorisable pass looks for NaN in x, and only where there is one
// are the outputs whose windows hold it set to NaN. U: the dtype's bits (float32, bfloat16).
template <typename U>
bool any_nan(const U* x, size_t n, U magnitude, U inf) {
  using S = std::make_signed_t<U>;  // (both sides non-negative: a signed compare, one
  U found = 0;                      // instruction where an unsigned one is three)
  for (size_t i = 0; i < n; ++i) {
    found |= static_cast<U>(static_cast<S>(x[i] & magnitude) > static_cast<S>(inf));
  }
  return found != 0;
}

// Its two widths, built for AVX-512 and AVX2 too (the template alone is baseline x86-64).
FLN_VECTOR_CLONES bool any_nan16(const uint16_t* x, size_t n) {
  return any_nan<uint16_t>(x, n, 0x7FFF, 0x7F80);
}

FLN_VECTOR_CLONES bool any_nan32(const uint32_t* x, size_t n) {
  return any_nan<uint32_t>(x, n, 0x7FFFFFFFu, 0x7F800000u);
}

// Sets output i's workspace entry (uint8 or int32) to `offset`, the maximum's place in its
// window (row-major over the window's axes, padding counted), as oneDNN writes it: the jvp
// and the tied windows' gradients read it.
struct Workspace {
  void* p;
  bool wide;
  void set(size_t i, int64_t offset) const {
    if (wide) {
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(offset);
    } else {
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(offset);
    }
  }
  int64_t get(size_t i) const {
    return wide ? static_cast<const int32_t*>(p)[i] : static_cast<const uint8_t*>(p)[i];
  }
  // Entries first .. first + n from `offsets`.
  void set_all(size_t first, const int32_t* offsets, size_t n) const {
    if (wide) {
      std::copy(offsets, offsets + n, static_cast<int32_t*>(p) + first);
    } else {
      auto* to = static_cast<uint8_t*>(p) + first;
      for (size_t i = 0; i < n; ++i) to[i] = static_cast<uint8_t>(offsets[i]);
    }
  }
};

template <typename U>
void nan_windows(const U* x, U* y, Workspace ws, const mx::Shape& xs, const mx::Shape& ys,
                 const PoolParams& p, U magnitude, U inf, U quiet_nan) {
  int k = static_cast<int>(xs.size()) - 2;
  size_t n = 1;
  for (auto d : xs) n *= static_cast<size_t>(d);
  std::vector<int64_t> at(xs.size()), lo(k), hi(k), o(k);
  size_t m = 1;
  for (auto d : ys) m *= static_cast<size_t>(d);
  std::vector<char> marked(m, 0);
  for (size_t i = 0; i < n; ++i) {
    if ((x[i] & magnitude) <= inf) continue;
    int64_t rest = static_cast<int64_t>(i);
    for (int d = static_cast<int>(xs.size()) - 1; d >= 0; --d) {
      at[d] = rest % xs[d];
      rest /= xs[d];
    }
    bool none = false;
    for (int a = 0; a < k; ++a) {  // the outputs o with o * stride - pad_lo <= at < + kernel
      int64_t s = at[a + 1] + p.pad_lo[a], first = s - p.kernel[a] + 1;
      lo[a] = first <= 0 ? 0 : (first + p.stride[a] - 1) / p.stride[a];
      hi[a] = std::min<int64_t>(s / p.stride[a], ys[a + 1] - 1);
      none = none || lo[a] > hi[a];
    }
    if (none) continue;
    o = lo;
    for (;;) {
      int64_t off = at[0], in_window = 0;
      for (int a = 0; a < k; ++a) {
        off = off * ys[a + 1] + o[a];
        in_window = in_window * p.kernel[a] + at[a + 1] + p.pad_lo[a] - o[a] * p.stride[a];
      }
      size_t out = static_cast<size_t>(off * ys.back() + at.back());
      // The first NaN of the window is its maximum (as MLX's argmax takes it): x is visited
      // in order, so the first to reach an output is the window's first.
      if (!marked[out]) {
        marked[out] = 1;
        ws.set(out, in_window);
      }
      y[out] = quiet_nan;
      int a = k - 1;
      while (a >= 0 && ++o[a] > hi[a]) {
        o[a] = lo[a];
        --a;
      }
      if (a < 0) break;
    }
  }
}

// oneDNN starts each maximum at the dtype's lowest finite value: a window of -inf (float32)
// comes out as -FLT_MAX where MLX's max gives -inf. Outputs equal to the lowest value whose
// window does not hold it are set to -inf (a scan of y first; windows only where it is).
template <typename U>
void lowest_windows(const U* x, U* y, Workspace ws, const mx::Shape& xs, const mx::Shape& ys,
                    const PoolParams& p, U lowest, U neg_inf) {
  size_t m = 1;
  for (auto d : ys) m *= static_cast<size_t>(d);
  U seen = 0;
  for (size_t i = 0; i < m; ++i) {
    seen |= static_cast<U>(y[i] == lowest);
  }
  if (!seen) return;
  int k = static_cast<int>(xs.size()) - 2;
  std::vector<int64_t> at(ys.size()), lo(k), hi(k), pos(k);
  for (size_t i = 0; i < m; ++i) {
    if (y[i] != lowest) continue;
    int64_t rest = static_cast<int64_t>(i);
    for (int d = static_cast<int>(ys.size()) - 1; d >= 0; --d) {
      at[d] = rest % ys[d];
      rest /= ys[d];
    }
    for (int a = 0; a < k; ++a) {  // the window in x, padding left out
      int64_t first = at[a + 1] * p.stride[a] - p.pad_lo[a];
      lo[a] = std::max<int64_t>(first, 0);
      hi[a] = std::min<int64_t>(first + p.kernel[a] - 1, xs[a + 1] - 1);
    }
    bool held = false;
    pos = lo;
    for (;;) {
      int64_t off = at[0], in_window = 0;
      for (int a = 0; a < k; ++a) {
        off = off * xs[a + 1] + pos[a];
        in_window = in_window * p.kernel[a] + pos[a] - (at[a + 1] * p.stride[a] - p.pad_lo[a]);
      }
      held = x[off * xs.back() + at.back()] == lowest;
      // oneDNN starts at the lowest value and keeps its first index, which may be padding:
      // the first real entry holding it is the maximum.
      if (held) ws.set(i, in_window);
      int a = k - 1;
      while (a >= 0 && ++pos[a] > hi[a]) {
        pos[a] = lo[a];
        --a;
      }
      if (a < 0 || held) break;
    }
    if (!held) y[i] = neg_inf;
  }
}

// A float32 forward pass's first use at a shape, without a primitive (creating one, about
// 0.2 ms on AVX2, costs more than a small pooling): oneDNN's algorithm in plain loops, so that
// the output and the workspace are what the primitive writes, bit for bit (a maximum is
// exact): each maximum starts at the lowest finite value with the window's first offset
// (which may be padding), and only a strictly greater real entry replaces it (NaN never
// does). keep_nan then corrects both as it corrects the primitive's.
void max_pool_loops(const float* x, float* y, Workspace ws, const mx::Shape& xs,
                    const mx::Shape& ys, const PoolParams& p) {
  int k = static_cast<int>(xs.size()) - 2;
  int64_t channels = xs.back();
  int64_t outputs = 1, entries = 1;
  for (int a = 0; a < k; ++a) {
    outputs *= ys[a + 1];
    entries *= p.kernel[a];
  }
  // Each window offset's position along each axis, row-major (no division in the loops).
  auto window = window_positions(std::vector<int64_t>(p.kernel.begin(), p.kernel.end()),
                                 std::vector<int64_t>(p.kernel.size(), 1));
  std::vector<int64_t> o(k, 0);  // the output's position, advanced as an odometer
  std::vector<int32_t> best_at(static_cast<size_t>(channels));
  for (int64_t n = 0; n < xs[0]; ++n) {
    for (int64_t out = 0; out < outputs; ++out) {
      float* __restrict best = y + ((n * outputs + out) * channels);
      std::fill(best, best + channels, std::numeric_limits<float>::lowest());
      std::fill(best_at.begin(), best_at.end(), 0);
      for (int64_t e = 0; e < entries; ++e) {  // the window's offsets, row-major
        const int64_t* pos = &window[static_cast<size_t>(e * k)];
        int64_t off = n;
        bool pad = false;
        for (int a = 0; a < k; ++a) {
          int64_t c = o[a] * p.stride[a] - p.pad_lo[a] + pos[a];
          pad = pad || c < 0 || c >= xs[a + 1];
          off = off * xs[a + 1] + c;
        }
        if (pad) continue;
        const float* __restrict row = x + off * channels;
        int32_t* __restrict at = best_at.data();
        int32_t entry = static_cast<int32_t>(e);
        // Branch-free, the offset selected with a mask (a `greater ? entry : at[c]` is a
        // branch to GCC: scalar, mispredicted on random data, 5x slower); NaN never wins.
        for (int64_t c = 0; c < channels; ++c) {
          float r = row[c], b = best[c];
          int32_t mask = -static_cast<int32_t>(r > b);
          best[c] = r > b ? r : b;
          at[c] = (at[c] & ~mask) | (entry & mask);
        }
      }
      size_t first = static_cast<size_t>((n * outputs + out) * channels);
      ws.set_all(first, best_at.data(), static_cast<size_t>(channels));
      for (int a = k - 1; a >= 0 && ++o[a] == ys[a + 1]; --a) {
        o[a] = 0;
      }
    }
  }
}

// The float32 backward pass's first use at a shape, without a primitive (as the forward's):
// dx = 0, then each output's cotangent added to the entry its workspace names, outputs in
// row-major order (an entry its window recorded in the padding, which only a held-back
// window can have, is skipped). Where windows do not overlap each dx entry gets one term, the
// primitive's result bit for bit; where they do, the same terms summed in another order than
// oneDNN's (neither output order reversed matches it): float32 rounding apart.
void max_pool_backward_loops(const float* dy, Workspace ws, float* dx, const mx::Shape& xs,
                             const mx::Shape& ys, const PoolParams& p) {
  int k = static_cast<int>(xs.size()) - 2;
  int64_t channels = xs.back(), outputs = 1, entries = 1;
  for (int a = 0; a < k; ++a) {
    outputs *= ys[a + 1];
    entries *= p.kernel[a];
  }
  size_t size = 1;
  for (auto d : xs) size *= static_cast<size_t>(d);
  std::fill(dx, dx + size, 0.0f);
  auto window = window_positions(std::vector<int64_t>(p.kernel.begin(), p.kernel.end()),
                                 std::vector<int64_t>(p.kernel.size(), 1));
  std::vector<int64_t> o(k, 0);
  size_t i = 0;
  for (int64_t n = 0; n < xs[0]; ++n) {
    for (int64_t out = 0; out < outputs; ++out) {
      for (int64_t c = 0; c < channels; ++c, ++i) {
        int64_t e = ws.get(i), off = n;
        bool pad = e < 0 || e >= entries;
        for (int a = 0; a < k && !pad; ++a) {
          int64_t at = o[a] * p.stride[a] - p.pad_lo[a] + window[static_cast<size_t>(e * k + a)];
          pad = at < 0 || at >= xs[a + 1];
          off = off * xs[a + 1] + at;
        }
        if (!pad) dx[off * channels + c] += dy[i];
      }
      for (int a = k - 1; a >= 0 && ++o[a] == ys[a + 1]; --a) {
        o[a] = 0;
      }
    }
  }
}

void keep_nan(const void* x, void* y, Workspace ws, const mx::Shape& xs, const mx::Shape& ys,
              const PoolParams& p, bool bf16, size_t n) {
  if (bf16) {
    auto* bits = static_cast<const uint16_t*>(x);
    if (any_nan16(bits, n)) {
      nan_windows<uint16_t>(bits, static_cast<uint16_t*>(y), ws, xs, ys, p, 0x7FFF, 0x7F80, 0x7FC0);
    }
    lowest_windows<uint16_t>(bits, static_cast<uint16_t*>(y), ws, xs, ys, p, 0xFF7F, 0xFF80);
  } else {
    auto* bits = static_cast<const uint32_t*>(x);
    if (any_nan32(bits, n)) {
      nan_windows<uint32_t>(bits, static_cast<uint32_t*>(y), ws, xs, ys, p, 0x7FFFFFFFu,
                            0x7F800000u, 0x7FC00000u);
    }
    lowest_windows<uint32_t>(bits, static_cast<uint32_t*>(y), ws, xs, ys, p, 0xFF7FFFFFu,
                             0xFF800000u);
  }
}

// A float32 (U = uint32_t) or bfloat16 (U = uint16_t) value's bits, to and from float; to
// bfloat16 rounding to nearest even, a NaN kept quiet (common.h).
template <typename U>
struct Bits {
  static float get(U b) {
    if constexpr (sizeof(U) == 2) {
      return widen(b);
    } else {
      return std::bit_cast<float>(b);
    }
  }
  static U put(float f) {
    if constexpr (sizeof(U) == 2) {
      return narrow_keeping_nan(f);
    } else {
      return std::bit_cast<U>(f);
    }
  }
  static constexpr U magnitude = sizeof(U) == 2 ? U(0x7FFF) : U(0x7FFFFFFFu);
  static constexpr U inf = sizeof(U) == 2 ? U(0x7F80) : U(0x7F800000u);
  static constexpr U neg_inf = sizeof(U) == 2 ? U(0xFF80) : U(0xFF800000u);
  static constexpr U lowest = sizeof(U) == 2 ? U(0xFF7F) : U(0xFF7FFFFFu);
};

// MLX's max pooling (mx.max over windows padded with -inf) shares each output's cotangent
// among the window's entries equal to its maximum, padding included: (g / count) * (entry ==
// max) to each, NaN to every entry where the count is 0 (a NaN maximum) or g is not finite.
// oneDNN sends g to one entry: the first maximum (documented, as PyTorch's) where the maximum is
// finite and g too; but a -inf maximum ties with the padding, a maximum at the lowest finite
// value (oneDNN's starting value) may be recorded in the padding, and NaN is no maximum at all.
// Those windows, and those whose g is not finite, are held back from oneDNN's pass (a copy of
// dy with zeros there) and shared here, as MLX shares them; a scan of y and dy finds them.
// Branch-free (an or of comparisons), so that a scan of it vectorises.
template <typename U>
bool special_window(U y, U g) {
  using B = Bits<U>;
  // (bfloat16's lowest too as float32: overlapping bfloat16 windows share in float32.)
  return static_cast<bool>(
      static_cast<unsigned>((y & B::magnitude) > B::inf) |
      static_cast<unsigned>(y == B::neg_inf) | static_cast<unsigned>(y == B::lowest) |
      static_cast<unsigned>(sizeof(U) == 4 && y == static_cast<U>(0xFF7F0000u)) |
      static_cast<unsigned>((g & B::magnitude) >= B::inf));
}

// Whether any of m windows is special: a scan the compiler vectorises, built for AVX-512 and
// AVX2 too. (special_window with short-circuits, scanned with `any = any || ...`, was scalar:
// 0.2-0.45 ms over a small CNN's first bfloat16 pooling, 64 x 14 x 14 x 16 outputs, its time
// doubling with the code's placement from one build to the next; Intel Xeon with AMX.)
template <typename U>
bool any_special(const U* y, const U* g, size_t m) {
  unsigned hit = 0;
  for (size_t i = 0; i < m; ++i) hit |= static_cast<unsigned>(special_window<U>(y[i], g[i]));
  return hit != 0;
}

FLN_VECTOR_CLONES bool any_special_windows(const uint16_t* y, const uint16_t* g, size_t m) {
  return any_special(y, g, m);
}

FLN_VECTOR_CLONES bool any_special_windows(const uint32_t* y, const uint32_t* g, size_t m) {
  return any_special(y, g, m);
}

// (e: the primitive, or nullptr for max_pool_backward_loops, float32 only.)
template <typename U>
void backward_sharing(const Prepared* e, const void* pd, void* pw, const void* px,
                      const void* py, void* po, const mx::Shape& xs, const mx::Shape& ys,
                      const PoolParams& p) {
  using B = Bits<U>;
  auto pass = [&](const void* g) {
    if (e != nullptr) {
      execute(*e, {{DNNL_ARG_DIFF_DST, const_cast<void*>(g)}, {DNNL_ARG_DIFF_SRC, po},
                   {DNNL_ARG_WORKSPACE, pw}}, FN);
    } else {
      max_pool_backward_loops(static_cast<const float*>(g), Workspace{pw, workspace_dtype(p) !=
                              mx::uint8}, static_cast<float*>(po), xs, ys, p);
    }
  };
  auto* dy = static_cast<const U*>(pd);
  auto* y = static_cast<const U*>(py);
  size_t m = 1;
  for (auto d : ys) m *= static_cast<size_t>(d);
  // A window of one entry: MLX's max over it is the entry itself, its gradient g.
  int64_t entries = 1;
  for (int q : p.kernel) entries *= q;
  if (entries == 1 || !any_special_windows(y, dy, m)) {
    pass(pd);
    return;
  }
  std::vector<U> held(dy, dy + m);
  for (size_t i = 0; i < m; ++i) {
    if (special_window<U>(y[i], dy[i])) held[i] = 0;
  }
  pass(held.data());
  auto* x = static_cast<const U*>(px);
  auto* dx = static_cast<U*>(po);
  int k = static_cast<int>(xs.size()) - 2;
  std::vector<int64_t> at(ys.size()), first(k), pos(k);
  for (size_t i = 0; i < m; ++i) {
    if (!special_window<U>(y[i], dy[i])) continue;
    int64_t rest = static_cast<int64_t>(i);
    for (int d = static_cast<int>(ys.size()) - 1; d >= 0; --d) {
      at[d] = rest % ys[d];
      rest /= ys[d];
    }
    for (int a = 0; a < k; ++a) first[a] = at[a + 1] * p.stride[a] - p.pad_lo[a];
    // Visits the window's entries: f(offset into x, or -1 for padding).
    auto each = [&](auto&& f) {
      for (int a = 0; a < k; ++a) pos[a] = 0;
      for (;;) {
        int64_t off = at[0];
        bool pad = false;
        for (int a = 0; a < k; ++a) {
          int64_t c = first[a] + pos[a];
          pad = pad || c < 0 || c >= xs[a + 1];
          off = off * xs[a + 1] + c;
        }
        f(pad ? int64_t{-1} : off * xs.back() + at.back());
        int a = k - 1;
        while (a >= 0 && ++pos[a] >= p.kernel[a]) {
          pos[a] = 0;
          --a;
        }
        if (a < 0) break;
      }
    };
    float v = B::get(y[i]);
    int64_t count = 0;
    each([&](int64_t o) { count += o < 0 ? v == -INFINITY : B::get(x[o]) == v; });
    // MLX: (g / count) in g's dtype (count converted to it), times the mask.
    float share = B::get(B::put(B::get(dy[i]) / B::get(B::put(static_cast<float>(count)))));
    each([&](int64_t o) {
      if (o < 0) return;
      float add = B::get(B::put(share * (B::get(x[o]) == v ? 1.0f : 0.0f)));
      dx[o] = B::put(B::get(dx[o]) + add);
    });
  }
}

mx::Shape pool_out_shape(const mx::Shape& xs, const PoolParams& p) {
  int k = static_cast<int>(xs.size()) - 2;
  FLN_CHECK(k >= 1 && k <= 3, FN, ": expected x (N, *spatial, C) with 1-3 spatial axes, got ",
            shape_str(xs));
  for (auto* v : {&p.kernel, &p.stride, &p.pad_lo, &p.pad_hi}) {
    FLN_CHECK(static_cast<int>(v->size()) == k, FN, ": kernel, stride and padding need ", k,
              " values each (x ", shape_str(xs), "), got ", vec_str(*v));
  }
  mx::Shape out{xs[0]};
  for (int i = 0; i < k; ++i) {
    FLN_CHECK(p.kernel[i] >= 1 && p.stride[i] >= 1 && p.pad_lo[i] >= 0 && p.pad_hi[i] >= 0 &&
                  p.pad_lo[i] < p.kernel[i] && p.pad_hi[i] < p.kernel[i],
              FN, ": kernel and stride must be >= 1 and padding >= 0 and smaller than the "
              "kernel, got kernel ", vec_str(p.kernel), ", stride ", vec_str(p.stride),
              ", padding ", vec_str(p.pad_lo), " / ", vec_str(p.pad_hi));
    int span = xs[i + 1] + p.pad_lo[i] + p.pad_hi[i] - p.kernel[i];
    FLN_CHECK(span >= 0, FN, ": the window ", vec_str(p.kernel), " is larger than the padded "
              "input ", shape_str(xs), " on spatial axis ", i);
    out.push_back(span / p.stride[i] + 1);
  }
  out.push_back(xs.back());
  return out;
}

// dx from dy and the workspace; x and y (of dy's dtype) for the windows shared as MLX shares
// them (see share_special).
mx::array backward(const mx::array& dy, const mx::array& ws, const mx::array& x,
                   const mx::array& y, const mx::Shape& x_tail, const PoolParams& p,
                   mx::Stream s) {
  mx::Shape shape{dy.shape(0)};
  shape.insert(shape.end(), x_tail.begin(), x_tail.end());
  auto as_dy = [&](const mx::array& a) {
    return a.dtype() == dy.dtype() ? a : mx::astype(a, dy.dtype(), s);
  };
  // (made row-contiguous in eval_cpu where not)
  return mx::array(std::move(shape), dy.dtype(),
                   std::make_shared<MaxPoolBackward>(s, p, x_tail), {dy, ws, as_dy(x), as_dy(y)});
}

// v (N, *spatial, C) at each window's maximum -> (N, *out, C): the workspace holds the
// maximum's index within its window (row-major over the window's axes, as oneDNN's
// reference pooling writes it). The forward-mode derivative of the pooling, and the
// transpose of its backward pass, in MLX's ops (neither is a hot path).
mx::array gather_at_max(const mx::array& v, const mx::array& ws, const PoolParams& p,
                        mx::Stream s) {
  // Each output's maximum as a flat index into the padded v's spatial axes: the window's
  // origin (the output's position times the stride) plus the maximum's offset in its window,
  // decoded from the workspace axis by axis. Gather ops only (no strided view), so that
  // mx.vmap goes through.
  int k = static_cast<int>(p.kernel.size());
  std::vector<std::pair<int, int>> pads{{0, 0}};
  for (int i = 0; i < k; ++i) pads.emplace_back(p.pad_lo[i], p.pad_hi[i]);
  pads.emplace_back(0, 0);
  auto vp = mx::pad(v, pads, mx::array(0, v.dtype()), "constant", s);
  auto w = mx::astype(ws, mx::int32, s);
  int ndim = static_cast<int>(ws.ndim());
  mx::array flat = mx::zeros_like(w, s);
  int after = 1;  // the window's entries after axis i (row-major), then the padded extent
  int extent = 1;
  for (int i = k - 1; i >= 0; --i) {
    auto off = mx::remainder(mx::floor_divide(w, mx::array(after, mx::int32), s),
                             mx::array(p.kernel[i], mx::int32), s);
    mx::Shape along(ndim, 1);
    along[i + 1] = ws.shape(i + 1);
    auto origin = mx::reshape(
        mx::multiply(mx::arange(ws.shape(i + 1), mx::int32, s), mx::array(p.stride[i]), s),
        along, s);
    flat = mx::add(flat, mx::multiply(mx::add(origin, off, s), mx::array(extent), s), s);
    after *= p.kernel[i];
    extent *= vp.shape(i + 1);
  }
  int n = vp.shape(0), c = vp.shape(-1);
  auto rows = mx::reshape(vp, {n, extent, c}, s);
  auto picked = mx::take_along_axis(rows, mx::reshape(flat, {n, -1, c}, s), 1, s);
  return mx::reshape(picked, ws.shape(), s);
}

} // namespace

mx::array max_pool(const mx::array& x, const PoolParams& p, bool native_bf16,
                   mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU, the "
            "stream is on the GPU");
  auto dt = x.dtype();
  FLN_CHECK(float_or_half(dt), FN, ": x must be "
            "float32, bfloat16 or float16, got ", dt);
  auto shape = pool_out_shape(x.shape(), p);
  FLN_CHECK(x.size() != 0, FN, ": empty input ", shape_str(x.shape()));
  // oneDNN 3.2's bfloat16 pooling loses the window offset when it needs an int32 workspace
  // (windows of 256 entries or more: every gradient went to the window's first entry).
  bool wide = workspace_dtype(p) != mx::uint8;
  if (in_float32_kernels(dt, native_bf16 && isa_has_bf16() && !wide)) {
    // The maximum is exact in any dtype: through float32 kernels, rounded back exactly.
    // (float16: MLX's own float16 pooling, a strided view and a max reduction, is ten times
    // slower than these casts and float32 kernels; the casts vectorised, cast.h.)
    return convert(max_pool(convert(x, mx::float32, stream), p, false, stream), dt, stream);
  }
  auto outs = mx::array::make_arrays(
      {shape, shape}, {dt, workspace_dtype(p)}, std::make_shared<MaxPool>(stream, p), {x});
  return outs[0];
}

// Whether a pooling (or its backward pass) with output (or cotangent) `y` runs the loops above
// on a shape's first uses: float32, up to 2**17 window entries visited (above, the primitive's
// creation is the smaller cost), not in matmul_mode "primitive" (first_use_deferred); its
// primitive is used from the fourth (queued at the third, cache.h: cached()).
bool loops_first(const mx::array& y, const PoolParams& p) {
  double visits = static_cast<double>(y.size());
  for (int k : p.kernel) visits *= k;
  return y.dtype() == mx::float32 && visits <= (1 << 17) && first_use_deferred();
}

void MaxPool::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& ws = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  ws.set_data(mx::allocator::malloc(ws.nbytes()));
  if (y.size() == 0) return;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto x = row_contiguous_all(inputs, encoder)[0];
  auto entry = lookup(false, p_, x.shape(), y.shape(), x.dtype(), loops_first(y, p_));
  encoder.dispatch([entry, px = const_cast<void*>(x.data<void>()), py = y.data<void>(),
                    pw = ws.data<void>(), xs = x.shape(), ys = y.shape(), p = p_,
                    bf16 = x.dtype() == mx::bfloat16, n = x.size()]() {
    Workspace w{pw, workspace_dtype(p) != mx::uint8};
    if (entry) {
      execute(*entry, {{DNNL_ARG_SRC, px}, {DNNL_ARG_DST, py}, {DNNL_ARG_WORKSPACE, pw}}, FN);
    } else {
      max_pool_loops(static_cast<const float*>(px), static_cast<float*>(py), w, xs, ys, p);
    }
    keep_nan(px, py, w, xs, ys, p, bf16, n);
  });
}

std::vector<mx::Shape> MaxPool::output_shapes(const std::vector<mx::array>& inputs) {
  auto s = pool_out_shape(inputs[0].shape(), p_);
  return {s, s};
}

bool MaxPool::is_equivalent(const mx::Primitive& other) const {
  return p_ == static_cast<const MaxPool&>(other).p_;
}

std::vector<mx::array> MaxPool::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>&,
    const std::vector<mx::array>& outputs) {
  auto& x = primals[0];
  auto c = cotangents[0].dtype() == x.dtype() ? cotangents[0]
                                              : mx::astype(cotangents[0], x.dtype(), stream());
  mx::Shape tail(x.shape().begin() + 1, x.shape().end());
  bool overlap = false;
  for (size_t i = 0; i < p_.kernel.size(); ++i) overlap |= p_.stride[i] < p_.kernel[i];
  if (overlap && x.dtype() == mx::bfloat16) {
    // Overlapping windows add cotangents: oneDNN's bfloat16 backward pass would round each
    // sum; in float32 they are accumulated and rounded once (the workspace is the same).
    auto dx = backward(mx::astype(c, mx::float32, stream()), outputs[1], x, outputs[0], tail,
                       p_, stream());
    return {mx::astype(dx, mx::bfloat16, stream())};
  }
  return {backward(c, outputs[1], x, outputs[0], tail, p_, stream())};
}

std::pair<std::vector<mx::array>, std::vector<int>> MaxPool::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto apply = [this, s](const std::vector<mx::array>& in) {
    auto shape = pool_out_shape(in[0].shape(), p_);
    return mx::array::make_arrays({shape, shape}, {in[0].dtype(), workspace_dtype(p_)},
                                  std::make_shared<MaxPool>(s, p_),
                                  {in[0]});
  };
  return vmap_rows(inputs, axes, {true}, apply, s);
}

std::pair<std::vector<mx::array>, std::vector<int>> MaxPoolBackward::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto apply = [this, s](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{backward(in[0], in[1], in[2], in[3], x_tail_, p_, s)};
  };
  return vmap_rows(inputs, axes, {true, true, true, true}, apply, s);
}

std::vector<mx::array> MaxPool::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>&) {
  // The tangent at each window's maximum (the workspace of a second forward pass).
  auto& x = primals[0];
  auto shape = pool_out_shape(x.shape(), p_);
  auto outs = mx::array::make_arrays({shape, shape}, {x.dtype(), workspace_dtype(p_)},
                                     std::make_shared<MaxPool>(stream(), p_), {x});
  auto t = tangents[0].dtype() == x.dtype() ? tangents[0]
                                            : mx::astype(tangents[0], x.dtype(), stream());
  return {gather_at_max(t, outs[1], p_, stream())};
}

void MaxPoolBackward::eval_cpu(const std::vector<mx::array>& operands, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto inputs = row_contiguous_all(operands, encoder);
  auto& dy = inputs[0];
  auto& ws = inputs[1];
  auto entry = lookup(true, p_, out.shape(), dy.shape(), dy.dtype(), loops_first(dy, p_));
  encoder.dispatch([entry, pd = dy.data<void>(), pw = const_cast<void*>(ws.data<void>()),
                    px = inputs[2].data<void>(), py = inputs[3].data<void>(),
                    po = out.data<void>(), xs = out.shape(), ys = dy.shape(), p = p_,
                    bf16 = dy.dtype() == mx::bfloat16]() {
    if (bf16) {
      backward_sharing<uint16_t>(entry.get(), pd, pw, px, py, po, xs, ys, p);
    } else {
      backward_sharing<uint32_t>(entry.get(), pd, pw, px, py, po, xs, ys, p);
    }
  });
}

std::vector<mx::Shape> MaxPoolBackward::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s{inputs[0].shape(0)};
  s.insert(s.end(), x_tail_.begin(), x_tail_.end());
  return {s};
}

bool MaxPoolBackward::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MaxPoolBackward&>(other);
  return p_ == o.p_ && x_tail_ == o.x_tail_;
}

std::vector<mx::array> MaxPoolBackward::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  // dx is linear in dy (a scatter to each window's maximum): its transpose is the gather.
  auto& dy = primals[0];
  auto c = cotangents[0].dtype() == dy.dtype() ? cotangents[0]
                                               : mx::astype(cotangents[0], dy.dtype(), stream());
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    grads.push_back(arg == 0 ? gather_at_max(c, primals[1], p_, stream())
                             : mx::zeros_like(primals[arg], stream()));
  }
  return grads;
}

std::vector<mx::array> MaxPoolBackward::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == 0) {
      auto& dy = primals[0];
      auto t = tangents[i].dtype() == dy.dtype() ? tangents[i]
                                                 : mx::astype(tangents[i], dy.dtype(), stream());
      return {backward(t, primals[1], primals[2], primals[3], x_tail_, p_, stream())};
    }
  }
  mx::Shape shape{primals[0].shape(0)};
  shape.insert(shape.end(), x_tail_.begin(), x_tail_.end());
  return {mx::zeros(shape, primals[0].dtype(), stream())};
}

} // namespace fluxlike_native
