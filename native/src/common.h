// fluxlike-native: what every op's file uses - argument checks, shapes and dtypes in
// messages, oneDNN's descriptions of MLX's arrays, bfloat16 conversions, a row-contiguous
// copy of a strided operand, and derivatives and mx.vmap taken through MLX's ops.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"
#include "oneapi/dnnl/dnnl.hpp"

#include "cpu.h"

namespace mx = mlx::core;

// Elementwise passes are built for AVX-512 and AVX2 too (GCC picks one when the module loads):
// the module itself targets the baseline x86-64. The AVX-512 clone is x86-64-v4 (AVX512F, BW,
// CD, DQ, VL), chosen by the CPU's features: an "arch=skylake-avx512" clone is chosen by CPU
// model, so that no other AVX-512 processor (an Intel Xeon with AMX, AMD Zen 4) ever ran it.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FLN_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FLN_VECTOR_CLONES __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
#endif

namespace fluxlike_native {

// Throws std::invalid_argument (Python's ValueError) whose message is `parts` written one
// after the other, unless `cond` holds: FLN_CHECK(n > 0, FN, ": n must be positive, got ", n).
#define FLN_CHECK(cond, ...)                              \
  do {                                                    \
    if (!(cond)) {                                        \
      ::fluxlike_native::throw_invalid(__VA_ARGS__);      \
    }                                                     \
  } while (0)

template <class... Parts>
[[noreturn]] void throw_invalid(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw std::invalid_argument(os.str());
}

// "(2, 3)", "(4,)": a shape as Python writes a tuple, for error messages.
inline std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) {
    os << s[i] << (s.size() == 1 ? "," : (i + 1 < s.size() ? ", " : ""));
  }
  os << ")";
  return os.str();
}

inline std::string vec_str(const std::vector<int>& v) {
  return shape_str(mx::Shape(v.begin(), v.end()));
}

// "float32", "bfloat16": a dtype as Python names it, for error messages.
inline std::string dtype_str(mx::Dtype d) {
  if (d == mx::float32) return "float32";
  if (d == mx::bfloat16) return "bfloat16";
  if (d == mx::float16) return "float16";
  if (d == mx::float64) return "float64";
  std::ostringstream os;
  os << d;
  return os.str();
}

// oneDNN's type for a float32, bfloat16 or float16 array; `fn` names the caller otherwise.
inline dnnl::memory::data_type dnnl_type(mx::Dtype d, const char* fn = "fluxlike_native") {
  if (d == mx::float32) return dnnl::memory::data_type::f32;
  if (d == mx::bfloat16) return dnnl::memory::data_type::bf16;
  if (d == mx::float16) return dnnl::memory::data_type::f16;
  throw std::invalid_argument(std::string(fn) + ": no oneDNN type for " + dtype_str(d));
}

// (N, *spatial, C) channels-last, as oneDNN's (N, C, *spatial) with strides.
inline dnnl::memory::desc act_md(const mx::Shape& s, mx::Dtype dt) {
  int k = static_cast<int>(s.size()) - 2;
  int64_t c = s.back();
  dnnl::memory::dims d{s[0], c}, st{0, 1};
  int64_t acc = c;
  std::vector<int64_t> sp(k);
  for (int i = k - 1; i >= 0; --i) {
    sp[i] = acc;
    acc *= s[i + 1];
  }
  st[0] = acc;
  for (int i = 0; i < k; ++i) {
    d.push_back(s[i + 1]);
    st.push_back(sp[i]);
  }
  return dnnl::memory::desc(d, dnnl_type(dt), st);
}

// dst[i] = the i-th element of a strided array in row-major order (any strides, negative or
// zero too; MLX does not export its CPU copy to extensions). Axes of size 1 are dropped and an
// axis that continues the next one's run is merged into it; the last axis left is copied as
// a run (memcpy where its stride is 1), the others stepped once per run: an attention head's
// transposed (B, H, L, D) view of a (B, L, H, D) array is B x H x L runs of D elements.
template <typename T>
inline void gather(const T* src, T* dst, const mx::Shape& shape, const mx::Strides& strides) {
  std::vector<int64_t> dims, steps;  // the collapsed axes, outermost first
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) {
      return;
    }
    if (shape[d] == 1) {
      continue;
    }
    if (!dims.empty() && steps.back() == strides[d] * shape[d]) {
      dims.back() *= shape[d];  // (axis d continues the previous one's run)
      steps.back() = strides[d];
    } else {
      dims.push_back(shape[d]);
      steps.push_back(strides[d]);
    }
  }
  if (dims.empty()) {
    dst[0] = src[0];
    return;
  }
  int outer = static_cast<int>(dims.size()) - 1;
  int64_t run = dims.back(), step = steps.back();
  int64_t runs = 1;
  for (int d = 0; d < outer; ++d) {
    runs *= dims[d];
  }
  std::vector<int64_t> index(static_cast<size_t>(outer), 0);
  int64_t offset = 0;
  for (int64_t r = 0; r < runs; ++r, dst += run) {
    if (step == 1) {
      std::memcpy(dst, src + offset, static_cast<size_t>(run) * sizeof(T));
    } else {
      for (int64_t j = 0; j < run; ++j) {
        dst[j] = src[offset + j * step];
      }
    }
    for (int d = outer - 1; d >= 0; --d) {
      if (++index[d] < dims[d]) {
        offset += steps[d];
        break;
      }
      offset -= steps[d] * (dims[d] - 1);
      index[d] = 0;
    }
  }
}

// bfloat16 as MLX's CPU ops convert it: widened exactly; narrowed to nearest even, any NaN
// becoming 0x7FC0 (mlx/types/bf16.h). Branch-free, so that loops of them vectorise.
inline float widen(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t narrow(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// exp(x - k ln 2), |x - k ln 2| <= ln 2 / 2: the reduction (ln 2 in two parts, Cody-Waite's)
// and Cephes' degree-6 polynomial that exp_nonpositive and exp_float32 share.
inline float exp_reduced(float x, int32_t k) {
  float n = static_cast<float>(k);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * (r * r) + r + 1.0f;
}

// exp(d) for d <= 0 (softmax: x minus its row's maximum; GELU: -x^2/2), within 2 ulp: Cody-Waite reduction to
// d = n ln 2 + r, |r| <= ln 2 / 2, Cephes' degree-6 polynomial for exp(r), 2^n from its
// bits; 0 below -87.3 (where exp(d) leaves float32's normal range), -inf included. NaN is
// taken as -87.3 inside (the float-to-int conversion stays defined) and gives 0. Branch-free,
// so that a loop over it vectorises (with -fno-trapping-math, see CMakeLists.txt).
inline float exp_nonpositive(float d) {
  constexpr float low = -87.3365f;
  float x = std::min(std::max(low, d), 0.0f);
  // (x <= 0: truncating x log2(e) - 1/2 rounds x log2(e) to the nearest integer)
  int32_t k = static_cast<int32_t>(x * 1.44269504088896341f - 0.5f);
  float e = exp_reduced(x, k);
  int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale * static_cast<float>(d >= low);
}

// exp(d) for any float32 d, within 1 ulp where the result is normal (0.96 over every 97th
// float32), within a subnormal ulp below: as exp_nonpositive, with
// 2^n as two normal factors, so that results down to the subnormals and up to overflow (inf
// from 88.73) come out of the same branch-free code. NaN stays NaN, exp(-inf) = 0.
inline float exp_float32(float d) {
  float x = std::min(std::max(-104.0f, d), 89.0f);  // (NaN: -104 inside, restored below)
  float half = std::copysign(0.5f, x);  // truncating x log2(e) +- 1/2: to the nearest integer
  int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + half);
  float e = exp_reduced(x, k);
  int32_t k1 = k >> 1;  // k in [-150, 129]: both halves' powers of two normal
  int32_t bits1 = (k1 + 127) << 23, bits2 = (k - k1 + 127) << 23;
  float scale1, scale2;
  std::memcpy(&scale1, &bits1, sizeof scale1);
  std::memcpy(&scale2, &bits2, sizeof scale2);
  float y = e * scale1 * scale2;
  // NaN stays NaN: a mask of bits (`d != d ? d : y` leaves GCC's loop over this scalar)
  uint32_t y_bits = std::bit_cast<uint32_t>(y), d_bits = std::bit_cast<uint32_t>(d);
  uint32_t nan = 0u - static_cast<uint32_t>(d != d);
  return std::bit_cast<float>((y_bits & ~nan) | (d_bits & nan));
}

// To bfloat16 rounding to nearest even, a NaN keeping its sign and payload (quieted): the
// scalar loops that reproduce a kernel's outputs bit for bit (conv.cpp, pool.cpp).
inline uint16_t narrow_keeping_nan(float x) {
  uint32_t w = std::bit_cast<uint32_t>(x);
  if ((w & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((w >> 16) | 0x40);
  }
  return static_cast<uint16_t>((w + 0x7FFFu + ((w >> 16) & 1)) >> 16);
}

// The dtypes the elementwise passes, the checks and the conversions take: float32, bfloat16,
// float16.
inline bool float_or_half(mx::Dtype d) {
  return d == mx::float32 || d == mx::bfloat16 || d == mx::float16;
}

// Whether operands of dtype `dt` run in oneDNN's float32 kernels, upcast inside the primitive:
// float16 always (the pooling; products and convolutions take oneDNN's float16 kernels where
// native_f16(): matmul.cpp, conv.cpp), bfloat16 where its own kernels are not taken
// (`bf16_kernels`: asked for, and not declined by the op for a case they get wrong).
inline bool in_float32_kernels(mx::Dtype dt, bool bf16_kernels) {
  return dt == mx::float16 || (dt == mx::bfloat16 && !bf16_kernels);
}

// n values each way, as above (convert.cpp).
void widen_all(const uint16_t* src, float* dst, size_t n);
void narrow_all(const float* src, uint16_t* dst, size_t n);
// n values of dtype `dt` (float32, bfloat16 or float16, as MLX converts each) to float32, and
// back.
void widen_all(const void* src, mx::Dtype dt, float* dst, size_t n);
void narrow_all(const float* src, mx::Dtype dt, void* dst, size_t n);
// n values of dtype `from` at src as dtype `to` at dst, all three float dtypes (as MLX converts
// each: a half dtype to the other through float32).
void convert_all(const void* src, mx::Dtype from, void* dst, mx::Dtype to, size_t n);
// Whether the CPU itself has AVX2 (whatever oneDNN's ISA is held to): the hand-written
// vector loops' condition.
bool has_avx2();
// The same for bfloat16 -> float32 with non-temporal stores, where a cast of `total` elements
// (n of them here) is larger than the caches and the CPU has AVX2; false (nothing done)
// elsewhere.
bool convert_streaming(const void* src, mx::Dtype from, void* dst, mx::Dtype to, size_t n,
                       size_t total);
// n float32 values in place rounded to dtype `dt` (bfloat16 or float16; float32: unchanged),
// as astype to it and back rounds them.
void round_all(float* x, mx::Dtype dt, size_t n);

// An elementwise pass over n values of dtype `dt` (float32, bfloat16 or float16): `loop`
// (const float* in, float* out, size_t n) on float32 data directly; half precision widened
// into float32 chunks on the stack, the loop, and rounded once (the result in `dt`).
template <class Loop>
void unary_in_float32(Loop&& loop, const void* x, void* y, mx::Dtype dt, size_t n) {
  if (dt == mx::float32) {
    loop(static_cast<const float*>(x), static_cast<float*>(y), n);
    return;
  }
  constexpr size_t chunk = 512;
  float buf[chunk];
  auto src = static_cast<const uint16_t*>(x);
  auto dst = static_cast<uint16_t*>(y);
  for (size_t i = 0; i < n; i += chunk) {
    size_t c = std::min(chunk, n - i);
    widen_all(src + i, dt, buf, c);
    loop(buf, buf, c);
    narrow_all(buf, dt, dst + i, c);
  }
}

// The same over two inputs of one dtype: `loop`(const float* a, const float* b, float* out,
// size_t n) (a backward pass: the cotangent and x or y).
template <class Loop>
void binary_in_float32(Loop&& loop, const void* a, const void* b, void* y, mx::Dtype dt,
                       size_t n) {
  if (dt == mx::float32) {
    loop(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(y), n);
    return;
  }
  constexpr size_t chunk = 512;
  float ab[chunk], bb[chunk];
  auto as = static_cast<const uint16_t*>(a);
  auto bs = static_cast<const uint16_t*>(b);
  auto dst = static_cast<uint16_t*>(y);
  for (size_t i = 0; i < n; i += chunk) {
    size_t c = std::min(chunk, n - i);
    widen_all(as + i, dt, ab, c);
    widen_all(bs + i, dt, bb, c);
    loop(ab, bb, ab, c);
    narrow_all(ab, dt, dst + i, c);
  }
}

// A window's positions (row-major over its k axes) as one offset per axis, each times its
// `step` (a convolution's dilation; 1 for pooling): result[e * k + a].
inline std::vector<int64_t> window_positions(const std::vector<int64_t>& extent,
                                             const std::vector<int64_t>& step) {
  int k = static_cast<int>(extent.size());
  int64_t entries = 1;
  for (auto d : extent) entries *= d;
  std::vector<int64_t> positions(static_cast<size_t>(entries * k));
  for (int64_t e = 0; e < entries; ++e) {
    int64_t r = e;
    for (int a = k - 1; a >= 0; --a) {
      positions[static_cast<size_t>(e * k + a)] = (r % extent[a]) * step[a];
      r /= extent[a];
    }
  }
  return positions;
}

// range(lo, hi) over [0, n) for an elementwise pass whose element costs about as much as
// `element_macs` multiply-adds of a float32 GEMM: on this thread where such a GEMM would run on
// one (cpu.h: single_thread_macs), else in blocks of `block` elements shared out over OpenMP's
// threads.
template <typename Range>
void shared_out(int64_t n, double element_macs, int64_t block, const Range& range) {
  if (n <= block || static_cast<double>(n) * element_macs < single_thread_macs()) {
    range(0, n);
    return;
  }
  int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t lo = b * block;
    range(lo, lo + block < n ? lo + block : n);
  }
}

// x's elements in a new row-contiguous array, copied by a task queued on the encoder before
// the kernel that reads it (and kept alive until then as a temporary); any 1-, 2-, 4- or
// 8-byte dtype.
inline mx::array row_contiguous_copy(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  mx::array copy(x.shape(), x.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  encoder.add_temporary(copy);
  encoder.dispatch([src = x.data<void>(), dst = copy.data<void>(), shape = x.shape(),
                    strides = x.strides(), size = x.itemsize()]() {
    switch (size) {
      case 1:
        gather(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), shape, strides);
        break;
      case 2:
        gather(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), shape, strides);
        break;
      case 4:
        gather(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), shape, strides);
        break;
      default:
        gather(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), shape, strides);
    }
  });
  return copy;
}

// A working buffer of a task while it runs (the float32 copies of half-precision operands, a
// float32 result before its rounding, an operand's aligned copy), from MLX's allocator
// (thread-safe), freed into MLX's buffer cache when the task ends: recycled from one step to
// the next. (From std::aligned_alloc, one over glibc's mmap threshold, 32 MiB at most, was
// mapped afresh and faulted in page by page on every call: a (512, 512) x (32000, 512)
// bfloat16 product's forward pass took 275 ms where float32's took 147; from MLX's cache 140
// against 131, AMD EPYC Zen 3.) Allocated in the task, not when the node is evaluated: MLX
// evaluates nodes ahead of their tasks, and buffers taken then would all be held at once.
// get() is 64-byte aligned (MLX's own CPU buffers are 8 bytes past a 16-byte boundary), and
// nullptr for no bytes.
class Scratch {
 public:
  // `fn` names the kernel in the out-of-memory error, `what` the buffer.
  Scratch(size_t bytes, const char* fn, const char* what = "a working buffer") {
    if (bytes != 0) {
      data_.emplace(mx::allocator::malloc(bytes + ALIGN - 1));
      if (data_->buffer().ptr() == nullptr) {
        throw std::runtime_error(std::string(fn) + ": out of memory for " + what + " of " +
                                 std::to_string(bytes) + " bytes");
      }
    }
  }

  void* get() {
    if (!data_) return nullptr;
    auto p = reinterpret_cast<uintptr_t>(data_->buffer().raw_ptr());
    return reinterpret_cast<void*>((p + ALIGN - 1) / ALIGN * ALIGN);
  }

  static constexpr uintptr_t ALIGN = 64;

 private:
  std::optional<mx::allocator::Data> data_;  // (freed into MLX's cache with it)
};

// A float32 Scratch of `count` entries.
class Float32Scratch : public Scratch {
 public:
  Float32Scratch(size_t count, const char* fn)
      : Scratch(count * sizeof(float), fn, "a float32 working buffer") {}
  float* get() { return static_cast<float*>(Scratch::get()); }
};

// Whether `p` is on a cache line's boundary (64 bytes).
inline bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % Scratch::ALIGN == 0;
}

// `x` as a kernel reading a dense row-major buffer needs it: `x` itself where it is
// row-contiguous, else its row_contiguous_copy. A reference to `x` (which must outlive the
// view: the node's input), not a copied handle: an input held twice is never donatable, so an
// elementwise pass could not write its output over it (reuse_or_allocate).
class RowMajor {
 public:
  RowMajor(const mx::array& x, mx::cpu::CommandEncoder& encoder) : x_(&x) {
    if (!x.flags().row_contiguous) copy_ = row_contiguous_copy(x, encoder);
  }
  RowMajor(const mx::array&&, mx::cpu::CommandEncoder&) = delete;  // (would dangle)

  const mx::array& operator*() const { return copy_ ? *copy_ : *x_; }
  const mx::array* operator->() const { return &**this; }
  // Whether the view is a copy (whose buffer the pass may not write its output over).
  bool copied() const { return copy_.has_value(); }

 private:
  const mx::array* x_;
  std::optional<mx::array> copy_;
};

// `inputs` as a kernel reading dense row-major buffers needs them: each one that is not
// row-contiguous replaced by its row_contiguous_copy (the originals stay the node's inputs,
// kept until its tasks ran). In place of an mx::contiguous node per operand, which MLX
// evaluates on every call even where it only shares the buffer (3-5 us a node in a small
// model: a small convolution's first use was 15% slower than MLX's own for its three).
inline std::vector<mx::array> row_contiguous_all(const std::vector<mx::array>& inputs,
                                                 mx::cpu::CommandEncoder& encoder) {
  std::vector<mx::array> dense;
  dense.reserve(inputs.size());
  for (const auto& x : inputs) {
    dense.push_back(x.flags().row_contiguous ? x : row_contiguous_copy(x, encoder));
  }
  return dense;
}

// A new row-major buffer for `out` whose data starts on a cache line: 64 bytes more, the data
// that far into it. MLX's own buffers lie 8 bytes past a 16-byte boundary, which oneDNN's AMX
// kernels read ~1.45x slower, so a product copies such a source first (matmul.cpp:
// run_product; 0.2 ms of a 2.2 ms 512 x 2048 x 2048 bfloat16 product, Intel Xeon with AMX):
// a product whose source is a native op's output reads it where it is.
inline void set_aligned_data(mx::array& out) {
  constexpr uintptr_t LINE = 64;
  auto data = mx::allocator::malloc(out.nbytes() + LINE);
  auto at = reinterpret_cast<uintptr_t>(data.buffer().raw_ptr());
  auto offset = static_cast<int64_t>((LINE - at % LINE) % LINE);
  mx::Strides strides(out.ndim(), 1);
  for (int i = out.ndim() - 2; i >= 0; --i) strides[i] = strides[i + 1] * out.shape(i + 1);
  int64_t largest = 1;
  for (auto d : out.shape()) largest = std::max<int64_t>(largest, d);
  mx::array::Flags flags{};
  flags.contiguous = true;
  flags.row_contiguous = true;
  flags.col_contiguous = out.size() <= 1 || static_cast<int64_t>(out.size()) == largest;
  out.set_data(std::move(data), out.size(), std::move(strides), flags, offset);
}

// An elementwise pass's output buffer: its input's where nothing else holds it (and it was
// not `copied` for the pass), as MLX's elementwise ops do (a new buffer per layer would raise
// the peak of a backward pass that MLX's scheduler queues ahead), else a new one on a
// cache line.
inline void reuse_or_allocate(mx::array& out, const mx::array& in, bool copied) {
  if (!copied && in.is_donatable() && in.itemsize() == out.itemsize() &&
      in.buffer_size() <= out.nbytes() + 16384) {
    out.copy_shared_buffer(in);
  } else {
    set_aligned_data(out);
  }
}

// A primitive's derivatives taken of the same computation written in MLX's ops (`fn`: the
// inputs to the outputs): the cotangents of the inputs in `argnums` (vjp), and the outputs'
// tangents given those of the inputs in `argnums` (jvp; the other inputs held constant).
using OpsFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

inline std::vector<mx::array> vjp_of(const OpsFn& fn, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents,
                                     const std::vector<int>& argnums) {
  auto grads = mx::vjp(fn, primals, cotangents).second;
  std::vector<mx::array> picked;
  for (int arg : argnums) {
    picked.push_back(grads[arg]);
  }
  return picked;
}

inline std::vector<mx::array> jvp_of(const OpsFn& fn, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& tangents,
                                     const std::vector<int>& argnums, mx::Stream s) {
  std::vector<mx::array> full;
  for (const auto& x : primals) {
    full.push_back(mx::zeros_like(x, s));
  }
  for (size_t j = 0; j < argnums.size(); ++j) {
    full[argnums[j]] = tangents[j];
  }
  return mx::jvp(fn, primals, full).second;
}

// A primitive's operands under mx.vmap, each with the mapped axis in front, broadcast over it
// where one is not mapped (the result is mapped on axis 0): the other axes keep their order,
// so a reduction over the last axis still reduces the operand's own last axis.
inline std::vector<mx::array> mapped_in_front(const std::vector<mx::array>& inputs,
                                              const std::vector<int>& axes, mx::Stream s) {
  int size = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) size = inputs[i].shape(axes[i]);
  }
  std::vector<mx::array> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      out.push_back(mx::moveaxis(inputs[i], axes[i], 0, s));
    } else {
      auto shape = inputs[i].shape();
      shape.insert(shape.begin(), size);
      out.push_back(mx::broadcast_to(mx::expand_dims(inputs[i], 0, s), shape, s));
    }
  }
  return out;
}

// mx.vmap for a primitive over rows: `apply` builds the primitive's outputs from its inputs,
// and the inputs marked in `batched` carry the batch on their first axis, each row computed
// on its own (a convolution's or a pooling's input and output gradient). Where only batched
// inputs are mapped, the mapped axis is folded into the batch: one call of the same kernel
// (an unmapped batched input is broadcast over the mapped axis first). Otherwise (a mapped
// weight; a batch reduced away, as in a weight gradient) the primitive runs once per member
// of the mapped axis, and the results are stacked. The outputs are mapped on their axis 0.
using ApplyFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

inline std::pair<std::vector<mx::array>, std::vector<int>> vmap_rows(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes,
    const std::vector<bool>& batched, const ApplyFn& apply, mx::Stream s) {
  int size = 0;
  bool foldable = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      size = inputs[i].shape(axes[i]);
      foldable = foldable && batched[i];
    }
  }
  if (size == 0) {
    throw std::invalid_argument("fluxlike_native: mx.vmap over an axis of length 0");
  }
  std::vector<mx::array> outs;
  if (foldable) {
    int rows = -1;  // the batch of the mapped inputs
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (axes[i] >= 0) {
        rows = mx::moveaxis(inputs[i], axes[i], 0, s).shape(1);
      }
    }
    std::vector<mx::array> folded;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!batched[i]) {
        folded.push_back(inputs[i]);
        continue;
      }
      mx::array x = axes[i] >= 0 ? mx::moveaxis(inputs[i], axes[i], 0, s) : inputs[i];
      if (axes[i] < 0) {
        auto shape = x.shape();
        shape.insert(shape.begin(), size);
        x = mx::broadcast_to(mx::expand_dims(x, 0, s), shape, s);
      }
      auto shape = x.shape();
      shape.erase(shape.begin());
      shape[0] = size * rows;
      folded.push_back(mx::reshape(x, shape, s));
    }
    for (auto& y : apply(folded)) {
      auto shape = y.shape();
      shape[0] /= size;
      shape.insert(shape.begin(), size);
      outs.push_back(mx::reshape(y, shape, s));
    }
  } else {
    std::vector<std::vector<mx::array>> members;
    for (int k = 0; k < size; ++k) {
      std::vector<mx::array> member;
      for (size_t i = 0; i < inputs.size(); ++i) {
        member.push_back(axes[i] >= 0 ? mx::take(inputs[i], k, axes[i], s) : inputs[i]);
      }
      members.push_back(apply(member));
    }
    for (size_t j = 0; j < members[0].size(); ++j) {
      std::vector<mx::array> column;
      for (auto& m : members) {
        column.push_back(m[j]);
      }
      outs.push_back(mx::stack(column, 0, s));
    }
  }
  return {outs, std::vector<int>(outs.size(), 0)};
}

} // namespace fluxlike_native
