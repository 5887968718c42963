// fluxlike-native: oneDNN matrix multiplication as an MLX primitive (CPU).
//
// The primitive's eval_cpu runs on the thread that evaluates the graph: it describes the
// operands to oneDNN (shapes, strides, dtypes), finds or creates the oneDNN matmul for that
// description in a process-wide cache (guarded by a mutex) and hands its execution to MLX's
// CPU stream through the command encoder, like MLX's own CPU kernels. Each execution gets
// its own scratchpad (oneDNN's "user" scratchpad mode) and stream, so one cached primitive
// may run from several threads at once.

#include "matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "bias.h"
#include "cache.h"
#include "cast.h"
#include "common.h"
#include "cpu.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "order.h"
#include "relu.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.matmul";

// The result's shape, or a clear error.
mx::Shape out_shape(const mx::Shape& as, const mx::Shape& bs, bool ta, bool tb, bool batched) {
  if (!batched) {
    FLN_CHECK(bs.size() == 2 && !as.empty(), FN, ": expected a of 1 or more axes and a 2-D b, "
              "got a ", shape_str(as), " and b ", shape_str(bs), "; use batched=True for "
              "batch axes on both operands");
    FLN_CHECK(!ta || as.size() == 2, FN, ": trans_a needs a 2-D a, got ", shape_str(as));
    int ka = ta ? as[0] : as.back();
    int kb = tb ? bs[1] : bs[0];
    int n = tb ? bs[0] : bs[1];
    FLN_CHECK(ka == kb, FN, ": inner dimensions differ: a ", shape_str(as),
              ta ? " (transposed)" : "", " has ", ka, ", b ", shape_str(bs),
              tb ? " (transposed)" : "", " has ", kb);
    mx::Shape out;
    if (ta) {
      out = {as[1], n};
    } else {
      out = mx::Shape(as.begin(), as.end() - 1);
      out.push_back(n);
    }
    return out;
  }
  FLN_CHECK(as.size() >= 3 && as.size() == bs.size(), FN, ": batched=True expects a and b of "
            "the same number (>= 3) of axes, got a ", shape_str(as), " and b ", shape_str(bs));
  FLN_CHECK(as.size() <= 12, FN, ": at most 12 axes (oneDNN's limit), got ", as.size());
  size_t nd = as.size();
  int m = ta ? as[nd - 1] : as[nd - 2];
  int ka = ta ? as[nd - 2] : as[nd - 1];
  int kb = tb ? bs[nd - 1] : bs[nd - 2];
  int n = tb ? bs[nd - 2] : bs[nd - 1];
  FLN_CHECK(ka == kb, FN, ": inner dimensions differ: a ", shape_str(as), " has ", ka, ", b ",
            shape_str(bs), " has ", kb);
  mx::Shape out;
  for (size_t i = 0; i + 2 < nd; ++i) {
    FLN_CHECK(as[i] == bs[i] || as[i] == 1 || bs[i] == 1, FN, ": batch axes of a ",
              shape_str(as), " and b ", shape_str(bs), " do not broadcast (axis ", i, ")");
    out.push_back(std::max(as[i], bs[i]));
  }
  out.push_back(m);
  out.push_back(n);
  return out;
}

struct View {
  dnnl::memory::dims dims, strides;
};

// How oneDNN sees an operand: its (possibly flattened) dims and strides, the last two axes
// swapped for a transposed operand.
View view(const mx::array& x, bool trans, bool flatten) {
  View v;
  if (flatten && x.ndim() != 2) {
    if (!x.flags().row_contiguous) {
      throw std::runtime_error(
          std::string(FN) + ": internal error: an operand to flatten is not row-contiguous");
    }
    int64_t last = x.shape().back();
    int64_t rows = last == 0 ? 0 : static_cast<int64_t>(x.size()) / last;
    v.dims = {rows, last};
    v.strides = {last, 1};
  } else {
    if (!x.flags().row_contiguous && !x.flags().col_contiguous) {
      throw std::runtime_error(
          std::string(FN) + ": internal error: operand is not contiguous");
    }
    v.dims.assign(x.shape().begin(), x.shape().end());
    v.strides.assign(x.strides().begin(), x.strides().end());
  }
  if (trans) {
    auto n = v.dims.size();
    std::swap(v.dims[n - 1], v.dims[n - 2]);
    std::swap(v.strides[n - 1], v.strides[n - 2]);
  }
  // An axis of size 1 is never stepped, so MLX leaves its stride as it came (0 for a
  // broadcast, L * D for the last row of a (1, L, D) array): given the stride that continues
  // the next axis, one shape has one description - its key, its kernel (a 1-row product on
  // the primitive for any row count whatever its source) and a stride oneDNN takes at
  // execution (a broadcast's 0 was refused where a runtime-stride primitive ran).
  for (int i = static_cast<int>(v.dims.size()) - 1; i >= 0; --i) {
    if (v.dims[i] == 1) {
      v.strides[i] = i + 1 < static_cast<int>(v.dims.size())
          ? v.strides[i + 1] * std::max<int64_t>(v.dims[i + 1], 1) : 1;
    }
  }
  return v;
}

dnnl::memory::dims row_major(const dnnl::memory::dims& dims) {
  dnnl::memory::dims s(dims.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= std::max<int64_t>(dims[i], 1);
  }
  return s;
}

// How oneDNN sees a row-major operand of `shape` (flattened to 2-D where asked), the last two
// axes swapped for a transposed one: the float32 copies of bfloat16 operands (eval_upcast).
View row_major_view(const mx::Shape& shape, bool trans, bool flatten) {
  View v;
  if (flatten && shape.size() != 2) {
    int64_t last = shape.back(), size = 1;
    for (auto d : shape) {
      size *= d;
    }
    v.dims = {last == 0 ? 0 : size / last, last};
  } else {
    v.dims.assign(shape.begin(), shape.end());
  }
  v.strides = row_major(v.dims);
  if (trans) {
    auto n = v.dims.size();
    std::swap(v.dims[n - 1], v.dims[n - 2]);
    std::swap(v.strides[n - 1], v.strides[n - 2]);
  }
  return v;
}

// An input of an upcasting product as its task reads it.
struct Operand {
  const void* data;
  mx::Shape shape;
  mx::Strides strides;
  size_t size;
  bool row_contiguous;
  mx::Dtype dtype;  // bfloat16, float16, or float32
  mx::Dtype round_to;  // a float32 operand's values rounded to this dtype (float32: none)
};

Operand operand(const mx::array& x, mx::Dtype round_to = mx::float32) {
  return {x.data<void>(), x.shape(), x.strides(), x.size(), x.flags().row_contiguous,
          x.dtype(), round_to};
}

// x's elements, row-major, as float32 into dst: half precision widened exactly, float32
// rounded to x.round_to as astype to it and back would.
void to_float32(const Operand& x, float* dst) {
  if (x.dtype == mx::float32) {
    if (x.row_contiguous) {
      std::copy_n(static_cast<const float*>(x.data), x.size, dst);
    } else {
      gather(static_cast<const uint32_t*>(x.data), reinterpret_cast<uint32_t*>(dst), x.shape,
             x.strides);
    }
    round_all(dst, x.round_to, x.size);
    return;
  }
  const void* src = x.data;
  Buffer packed(x.row_contiguous ? 0 : x.size * sizeof(uint16_t), FN, "an operand's copy");
  if (!x.row_contiguous) {
    gather(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(packed.p), x.shape,
           x.strides);
    src = packed.p;
  }
  widen_all(src, x.dtype, dst, x.size);
}

std::shared_ptr<const Prepared> lookup(
    const View& a,
    const View& b,
    const dnnl::memory::dims& dst_dims,
    mx::Dtype in_dt,
    mx::Dtype out_dt,
    std::optional<mx::Dtype> bias_dt,
    bool defer_first = false,
    std::optional<bool> one_thread = std::nullopt) {
  CacheKey key;
  key.reserve(9 + 5 * a.dims.size());
  key.push_back(static_cast<int64_t>(in_dt.val()));
  key.push_back(static_cast<int64_t>(out_dt.val()));
  key.push_back(bias_dt ? static_cast<int64_t>(bias_dt->val()) : -1);
  key.push_back(static_cast<int64_t>(a.dims.size()));
  for (auto* part : {&a.dims, &a.strides, &b.dims, &b.strides, &dst_dims}) {
    key.insert(key.end(), part->begin(), part->end());
  }
  if (one_thread) {  // (a key one longer: no shape's)
    key.push_back(*one_thread);
  }
  return cached<Prepared>(Op::Matmul, std::move(key), FN, "matmul", [&] {
    auto dt = dnnl_type(in_dt, FN);
    dnnl::memory::desc a_md(a.dims, dt, a.strides), b_md(b.dims, dt, b.strides);
    dnnl::memory::desc dst_md(dst_dims, dnnl_type(out_dt, FN), row_major(dst_dims));
    return prepared_matmul(a_md, b_md, bias_dt, dst_md, FN, one_thread);
  }, defer_first, [&] {
    return std::function<void()>([a, b, dst_dims, in_dt, out_dt, bias_dt] {
      lookup(a, b, dst_dims, in_dt, out_dt, bias_dt);
    });
  });
}

// ---- float32 products on oneDNN's GEMM, without a primitive ----------------------------------
//
// Where oneDNN's float32 matmul primitive is its jit GEMM anyway (`gemm:jit:f32`: oneDNN 3.2
// below AVX-512, e.g. on AVX2), an unbatched float32 product calls that GEMM directly
// (dnnl_sgemm): the same kernel, the same results bit for bit (tests/native/test_shapes.py),
// but no primitive to create for a new row count (0.2-0.6 ms each) and less work per call
// (2.8 against 14 us at 4x64x128; bench/results/2026-12-04-shapes.md). The bias is added after
// the product, as the primitive adds it (adding it first, as beta = 1 on a bias-filled
// output, changes the sum's order once K is blocked).

std::atomic<int> g_mode{static_cast<int>(MatmulMode::Auto)};

// The name of oneDNN's matmul for a (rows x 64) @ (64 x 64, read transposed) product of `dt`
// operands (rows: 64, or DNNL_RUNTIME_DIM_VAL for any row count); "" where it has none.
std::string probe_impl(int64_t rows, dnnl::memory::data_type dt) {
  dnnl::memory::desc a({rows, 64}, dt, dnnl::memory::dims{64, 1});
  dnnl::memory::desc b({64, 64}, dt, dnnl::memory::dims{1, 64});
  dnnl::memory::desc c({rows, 64}, dt, dnnl::memory::dims{64, 1});
  try {
    return dnnl::matmul::primitive_desc(engine(), a, b, c, user_scratchpad()).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

bool probe_jit_gemm() {
  static const bool jit =
      probe_impl(64, dnnl::memory::data_type::f32).rfind("gemm:jit", 0) == 0;
  return jit;
}

// How dnnl_sgemm (row-major) reads a 2-D view: 'N' with leading dimension ld for row-major,
// 'T' for column-major; trans 0 where it cannot.
struct Lead {
  char trans = 0;
  int64_t ld = 0;
};

Lead lead(const View& v) {
  int64_t r = v.dims[0], c = v.dims[1], s0 = v.strides[0], s1 = v.strides[1];
  if ((c == 1 || s1 == 1) && (r == 1 || s0 >= c)) {
    return {'N', r == 1 ? std::max<int64_t>(c, 1) : s0};
  }
  if ((r == 1 || s0 == 1) && (c == 1 || s1 >= r)) {
    return {'T', c == 1 ? std::max<int64_t>(r, 1) : s1};
  }
  return {};
}

// dst (M x N, row-major) = a @ b (+ bias), a (M x K) and b (K x N) as `lead` reads them.
void direct_gemm(const float* a, Lead la, const float* b, Lead lb, const float* bias,
                 float* dst, int64_t m, int64_t n, int64_t k) {
  // The thread count as the primitive's (one below the threshold, cpu.h): the GEMM splits K
  // among threads for few rows and columns, so another count changes the sum's order (e.g. at
  // 5x2048x64) and the results would differ from the primitive's.
  double macs = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  OneThread one(macs < single_thread_macs());
  auto status = dnnl_sgemm(la.trans, lb.trans, m, n, k, 1.0f, a, la.ld, b, lb.ld, 0.0f, dst, n);
  if (status != dnnl_success) {
    throw std::runtime_error(std::string(FN) + ": oneDNN's GEMM failed (status " +
                             std::to_string(static_cast<int>(status)) + ")");
  }
  if (bias != nullptr) {
    add_bias_float32(dst, bias, static_cast<size_t>(m), static_cast<size_t>(n));
  }
}

mx::array reduce_to(const mx::array& x, const mx::Shape& shape, mx::StreamOrDevice s) {
  if (x.shape() == shape) {
    return x;
  }
  std::vector<int> axes;
  for (int i = 0; i < static_cast<int>(shape.size()); ++i) {
    if (shape[i] == 1 && x.shape(i) != 1) {
      axes.push_back(i);
    }
  }
  auto r = mx::sum(mx::astype(x, mx::float32, s), axes, /*keepdims=*/true, s);
  return mx::astype(r, x.dtype(), s);
}

// op(x) as plain MLX ops (for empty operands, which oneDNN does not take).
mx::array swap_last(const mx::array& x, bool t, mx::StreamOrDevice s) {
  return t ? mx::swapaxes(x, -1, -2, s) : x;
}

// A float32 product `y` as the output of a product computing in `dt` gives it: in `odt`,
// rounded to `dt` where that is a half dtype and odt is, or `round_f32` asks.
mx::array result_in(const mx::array& y, mx::Dtype dt, mx::Dtype odt, bool round_f32,
                    mx::StreamOrDevice s) {
  auto r = odt != mx::float32 || round_f32 ? mx::astype(y, dt, s) : y;
  return mx::astype(r, odt, s);
}

} // namespace

std::shared_ptr<const Prepared> prepared_matmul(const dnnl::memory::desc& a,
                                                const dnnl::memory::desc& b,
                                                std::optional<mx::Dtype> bias_dt,
                                                const dnnl::memory::desc& dst, const char* fn,
                                                std::optional<bool> one_thread) {
  auto dst_dims = dst.get_dims();
  if (!one_thread) {
    double macs = static_cast<double>(a.get_dims().back());
    for (auto d : dst_dims) macs *= static_cast<double>(d);
    one_thread = one_thread_for(macs, a.get_data_type() == dnnl::memory::data_type::bf16);
  }
  OneThread one(*one_thread);
  auto attr = user_scratchpad();
  dnnl::matmul::primitive_desc pd;
  if (bias_dt) {
    dnnl::memory::dims bdims(dst_dims.size(), 1);
    bdims.back() = dst_dims.back();
    dnnl::memory::desc bias_md(bdims, dnnl_type(*bias_dt, fn), row_major(bdims));
    pd = dnnl::matmul::primitive_desc(engine(), a, b, bias_md, dst, attr);
  } else {
    pd = dnnl::matmul::primitive_desc(engine(), a, b, dst, attr);
  }
  // (Without a bias, its description is empty and no buffer is passed for it.)
  return std::make_shared<const Prepared>(
      prepare(pd, {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_BIAS, DNNL_ARG_DST}));
}

void run_product(const Prepared& entry, void* src, size_t src_bytes, void* weights, void* bias,
                 void* dst, const char* fn, const ExecMds& actual) {
  Scratch copy(entry.amx && !aligned(src) ? src_bytes : 0, fn, "an aligned copy of the source");
  if (copy.get() != nullptr) {
    src = std::memcpy(copy.get(), src, src_bytes);
  }
  execute(entry, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_BIAS, bias},
                  {DNNL_ARG_DST, dst}}, fn, actual);
}

// ---- bfloat16 products for any row count -------------------------------------------------
//
// oneDNN 3.2 makes a bfloat16 matmul for a row count given at each call (DNNL_RUNTIME_DIM_VAL):
// on AMX its brgemm kernel, as fast as a primitive per shape from 8 rows (0.98-1.2x at 8 to
// 63 rows, 0.90-1.11x at 64 to 2,048; faster at 1 row, 0.76-0.92x; 1.1-2.3x slower at 2 to 7)
// - bench/results/2026-12-05-any-rows.md. So a layer whose batch or sequence length varies
// needs one primitive per weight shape and thread count (two at most), not one per row count.
// It rounds like the shape's own primitive except in a last row past a block (rows 2-7, 9,
// 17, 33, 65, ..., 2,049 differ in float32 results by an ulp or so); a shape always runs on
// the same kernel, so a product keeps its bits from call to call. Not used without AMX
// (avx512_core_bf16 gets oneDNN's jit GEMM for it: 1.00-1.07x, its rounding not checked), nor
// for a product over a varying depth (a weight gradient's sum over the rows): runtime K gave
// the jit GEMM, 1.3-3.5x slower than brgemm.

namespace {

std::atomic<int64_t> g_any_rows_min{8};

bool any_rows_usable() {
  static const bool usable =
      probe_impl(DNNL_RUNTIME_DIM_VAL, dnnl::memory::data_type::bf16).rfind("brg", 0) == 0;
  return usable;
}

} // namespace

bool any_rows_kernel() {
  return any_rows_usable() && matmul_mode() != MatmulMode::Primitive;
}

int64_t set_any_rows_min(int64_t rows) {
  return g_any_rows_min.exchange(rows);
}

int64_t any_rows_min() {
  return g_any_rows_min.load();
}

ExecMds AnyRows::actual() const {
  if (rows < 0) {
    return {};
  }
  return {{DNNL_ARG_SRC, sized(entry->md(DNNL_ARG_SRC), rows)},
          {DNNL_ARG_DST, sized(entry->md(DNNL_ARG_DST), rows)}};
}

AnyRows any_rows(int64_t rows, const std::function<std::shared_ptr<const Prepared>()>& per_shape,
                 const std::function<std::shared_ptr<const Prepared>()>& for_any_rows) {
  if (any_rows_kernel() && (rows == 1 || rows >= any_rows_min())) {
    try {
      auto entry = for_any_rows();
      if (entry->impl.rfind("brg", 0) == 0) {
        return {entry, rows};
      }
    } catch (const std::runtime_error&) {
      // (oneDNN refused these operands for any row count: the shape's own primitive)
    }
  }
  return {per_shape(), -1};
}

namespace {

// ---- small batched bfloat16 products for any shape ---------------------------------------
//
// Attention's products (q @ k^T, p @ v) change their row, column and inner sizes with the
// sequence length, so a primitive per shape is made for every new length (two a token in
// generation, shared by the layers: 0.1-0.8 ms each, against a 1-8 us product). oneDNN 3.2
// makes one for sizes and strides given at each call, with each operand's unit stride fixed:
// its jit GEMM (`gemm:jit:bf16`; all strides at runtime gives its reference kernel), 1.6-4.8x
// the brgemm per-shape primitive's time at these sizes (1 x 4 heads x L x 32, L = 1-128: 2-21
// against 1.1-12 us, one thread) and the same bits in bfloat16 results
// (bench/results/2026-12-05-any-rows.md). So a batched bfloat16 product of at most
// ANY_SHAPE_MACS multiply-adds runs on it, one per batch shape and operand layout; larger
// ones, where the kernel's time outweighs a creation, keep a primitive per shape. A given
// shape always runs the same kernel (its bits the same on every call).
constexpr double ANY_SHAPE_MACS = 1 << 20;

// The primitive for batched operands of va's and vb's batch dims and unit-stride axes, any
// sizes of the last two axes (nullptr where oneDNN's kernel for it is its reference one).
std::shared_ptr<const Prepared> any_shape(const View& va, const View& vb, mx::Dtype in_dt,
                                          mx::Dtype out_dt) {
  constexpr auto R = DNNL_RUNTIME_DIM_VAL;
  size_t nd = va.dims.size();
  auto unit = [&](const View& v) { return v.strides[nd - 1] == 1 ? nd - 1 : nd - 2; };
  size_t ua = unit(va), ub = unit(vb);
  CacheKey key{-9, static_cast<int64_t>(in_dt.val()), static_cast<int64_t>(out_dt.val()),
               static_cast<int64_t>(nd), static_cast<int64_t>(ua), static_cast<int64_t>(ub)};
  key.insert(key.end(), va.dims.begin(), va.dims.end() - 2);
  key.insert(key.end(), vb.dims.begin(), vb.dims.end() - 2);
  auto entry = cached<Prepared>(Op::Matmul, std::move(key), FN, "matmul", [&] {
    // dims: the batch dims, then two runtime ones; strides: runtime but the unit one
    auto runtime = [&](dnnl::memory::dims dims, size_t u, dnnl::memory::data_type dt) {
      dims.resize(nd - 2);
      dims.push_back(R);
      dims.push_back(R);
      dnnl::memory::dims strides(nd, R);
      strides[u] = 1;
      return dnnl::memory::desc(dims, dt, strides);
    };
    auto dt = dnnl_type(in_dt, FN);
    dnnl::memory::dims dst(nd);
    for (size_t i = 0; i + 2 < nd; ++i) {
      dst[i] = std::max(va.dims[i], vb.dims[i]);
    }
    return prepared_matmul(runtime(va.dims, ua, dt), runtime(vb.dims, ub, dt), std::nullopt,
                           runtime(dst, nd - 1, dnnl_type(out_dt, FN)), FN, true);
  });
  return entry->impl.rfind("ref", 0) == 0 ? nullptr : entry;
}

} // namespace

MatmulMode set_matmul_mode(MatmulMode mode) {
  return static_cast<MatmulMode>(g_mode.exchange(static_cast<int>(mode)));
}

bool primitive_is_jit_gemm() {
  return probe_jit_gemm();
}

MatmulMode matmul_mode() {
  return static_cast<MatmulMode>(g_mode.load());
}

bool first_use_deferred() {
  return matmul_mode() != MatmulMode::Primitive;
}

MatmulMode effective_mode() {
  auto mode = matmul_mode();
  if (mode != MatmulMode::Auto) {
    return mode;
  }
  // Gemm on every CPU: where the primitive is brgemm (AVX-512), Reused gave a shape's first
  // two uses the GEMM's sums and later ones the primitive's, which round differently, so the
  // same product changed in its last bits from its third call on (two identical trainings in
  // one process ended apart). The GEMM: no creation for any row count, the same bits on
  // every call, 0.77-1.11x the brgemm primitive's time (Intel Xeon with AMX, 2026-12-04:
  // 32 x 64 x 128 8.9 / 11.5 us, 512 x 512 x 512 774 / 725, 512 x 2048 x 2048 11.9 / 10.7 ms).
  return MatmulMode::Gemm;
}

bool direct_gemm_in_use() {
  return effective_mode() == MatmulMode::Gemm;
}

mx::array matmul(const mx::array& a, const mx::array& b, const std::optional<mx::array>& bias,
                 bool trans_a, bool trans_b, bool relu, std::optional<mx::Dtype> out_dtype,
                 bool batched, bool native_bf16, mx::StreamOrDevice s,
                 std::optional<mx::Dtype> compute, bool rounded) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU, the "
            "stream is on the GPU; use MLX's own kernels there (mx.matmul)");
  bool fused = compute.has_value();
  auto dt = compute.value_or(a.dtype());
  if (fused) {
    FLN_CHECK(dt == mx::bfloat16 || dt == mx::float16, FN, ": compute_dtype must be bfloat16 "
              "or float16, got ", dtype_str(dt), "; leave it None for float32 products");
    for (auto* x : {&a, &b}) {
      FLN_CHECK(x->dtype() == dt || x->dtype() == mx::float32, FN, ": with compute_dtype ",
                dtype_str(dt), " each operand must be float32 or ", dtype_str(dt), ", got ",
                dtype_str(x->dtype()), "; cast it with astype");
    }
  } else {
    auto half = [](mx::Dtype d) { return d == mx::bfloat16 || d == mx::float16; };
    bool f32_and_half = (dt == mx::float32 && half(b.dtype())) ||
        (b.dtype() == mx::float32 && half(dt));
    FLN_CHECK(b.dtype() == dt, FN, ": a and b must have one dtype, got ", dtype_str(dt),
              " and ", dtype_str(b.dtype()), "; cast one with astype",
              f32_and_half ? ", or pass the half dtype as compute_dtype" : "");
  }
  FLN_CHECK(float_or_half(dt), FN, ": operands "
            "must be float32, bfloat16 or float16, got ", dtype_str(dt), " (no fast oneDNN "
            "kernel for it on this CPU; use mx.matmul)");
  auto odt = out_dtype.value_or(dt);
  FLN_CHECK(odt == dt || odt == mx::float32, FN, ": out_dtype must be float32 or the ",
            fused ? "compute dtype " : "operands' ", dtype_str(dt), ", got ", dtype_str(odt));
  auto shape = out_shape(a.shape(), b.shape(), trans_a, trans_b, batched);
  if (bias) {
    FLN_CHECK(bias->ndim() == 1 && bias->shape(0) == shape.back(), FN, ": bias must have "
              "shape (", shape.back(), ",), got ", shape_str(bias->shape()));
    FLN_CHECK(bias->dtype() == dt || bias->dtype() == mx::float32, FN, ": bias must be ",
              dtype_str(dt), " or float32, got ", dtype_str(bias->dtype()));
  }
  bool round_f32 = rounded && odt == mx::float32 && dt != mx::float32;
  // A bfloat16 product over one entry (K == 1) in oneDNN 3.2's bfloat16 kernels gave NaN for
  // an infinite operand (the K pair is padded; seen in tests/native/test_hostile.py): float32.
  int k_len = a.ndim() == 0 ? 1 : (trans_a && a.ndim() >= 2 ? a.shape(-2) : a.shape(-1));
  // (Fused casts read float32 operands: float32 kernels too.)
  // (float16's K = 1 likewise: its AMX kernels, on AMX-FP16 CPUs, were not measured.)
  bool upcast = dt == mx::float16 ? fused || !native_f16() || k_len == 1
                                  : in_float32_kernels(dt, native_bf16 && !fused && k_len != 1);
  FLN_CHECK(dt != mx::bfloat16 || upcast || isa_has_bf16(), FN, ": native bfloat16 kernels "
            "were asked for, but oneDNN's CPU ISA is ", cpu_isa(), " (no avx512_core_bf16); "
            "pass native_bf16=False to run bfloat16 in float32 kernels");
  if (a.size() == 0 || b.size() == 0) {  // oneDNN takes no empty operands
    // Each operand as the product reads it, in float32.
    auto read = [&](const mx::array& x, bool rounds) {
      auto r = rounds && x.dtype() != dt ? mx::astype(x, dt, stream) : x;
      return mx::astype(r, mx::float32, stream);
    };
    auto y = mx::matmul(read(swap_last(a, trans_a, stream), true),
                        read(swap_last(b, trans_b, stream), true), stream);
    if (bias) {
      y = mx::add(y, read(*bias, fused), stream);
    }
    if (relu) {
      y = mx::maximum(y, mx::array(0.0f), stream);
    }
    return result_in(mx::reshape(y, shape, stream), dt, odt, round_f32, stream);
  }
  // Operands that are not laid out as oneDNN takes them are copied when the primitive runs
  // (Matmul::eval_cpu), as MLX's own matmul does, rather than by Contiguous ops in the
  // graph: each of those costs a node to build and to run on every call.
  std::vector<mx::array> inputs{a, b};
  if (bias) {
    inputs.push_back(*bias);
  }
  return mx::array(
      shape, odt,
      std::make_shared<Matmul>(
          stream, trans_a, trans_b, bias.has_value(), relu, batched, odt, upcast, dt, fused,
          round_f32),
      std::move(inputs));
}

namespace {

// How a product runs: its result's dims, and either oneDNN's GEMM without a primitive
// (`direct`, with how it reads each operand) or a cached primitive (`entry`).
struct Plan {
  dnnl::memory::dims dst_dims;
  std::shared_ptr<const Prepared> entry;
  Lead la, lb;
  bool direct = false;
  ExecMds actual;  // the operands' descriptions where `entry` is for any row count or shape
};

// Whether matmul_mode "auto" runs a float32 product on its primitive rather than the GEMM:
// where the primitive is not the GEMM (brgemm, AVX-512), a linear layer's forward layout (a
// row-major, b read transposed) of at least AUTO_PRIMITIVE_MACS multiply-adds. There the
// brgemm primitive takes 0.77-0.91x the GEMM's time (512 x 2048 x 2048 11.8 against 13.3 ms,
// 128 x 2048 x 2048 3.1 against 4.1; Intel Xeon with AMX, 2026-12-05) and its creation
// (0.3 ms) less than that difference, so even a shape's first call is no slower; at 2**27
// (512 x 512 x 512: 0.88x) a creation would make the first call 1.25x the GEMM's. The
// products of the backward layouts (dx = dy W, dW = dy^T x) are 1.07-1.18x slower on the
// primitive at these sizes and stay on the GEMM. The choice depends on the shape and layout
// only: a product gives the same bits on every call.
constexpr double AUTO_PRIMITIVE_MACS = 1 << 29;

bool large_forward(const Lead& la, const Lead& lb, const View& va, const View& vb) {
  if (matmul_mode() != MatmulMode::Auto || primitive_is_jit_gemm() || la.trans != 'N' ||
      lb.trans != 'T') {
    return false;
  }
  double macs = static_cast<double>(va.dims[0]) * static_cast<double>(va.dims[1]) *
      static_cast<double>(vb.dims[1]);
  return macs >= AUTO_PRIMITIVE_MACS;
}

// The plan for operands seen as `va` and `vb`: an unbatched float32 product (`gemm_ok`) on
// the GEMM always (Gemm), or for a shape's first uses (Reused: its primitive from its third
// use, cache.h: cached()), where the GEMM can read both operands; else the primitive for the description.
Plan plan(const View& va, const View& vb, const mx::array& out, bool batched, bool gemm_ok,
          mx::Dtype in_dt, mx::Dtype out_dt, std::optional<mx::Dtype> bias_dt) {
  Plan p;
  if (batched) {
    p.dst_dims.assign(out.shape().begin(), out.shape().end());
  } else {
    p.dst_dims = {va.dims[0], vb.dims[1]};
  }
  if (gemm_ok) {
    p.la = lead(va);
    p.lb = lead(vb);
    if (p.la.trans != 0 && p.lb.trans != 0) {
      auto mode = effective_mode();
      if (mode == MatmulMode::Reused) {
        p.entry = lookup(va, vb, p.dst_dims, in_dt, out_dt, bias_dt, /*defer_first=*/true);
      }
      p.direct = mode == MatmulMode::Gemm || (mode == MatmulMode::Reused && !p.entry);
      if (p.direct && large_forward(p.la, p.lb, va, vb)) {
        p.direct = false;  // (the primitive, per shape, below)
      }
    }
  }
  // A bfloat16 product over row-major rows: its primitive for any row count where that is as
  // fast (see any_rows).
  int64_t k = va.dims.back();
  if (!p.direct && !p.entry && !batched && in_dt == mx::bfloat16 && va.strides[0] == k &&
      va.strides[1] == 1) {
    int64_t m = va.dims[0], n = vb.dims[1];
    auto chosen = any_rows(m, [&] {
      return lookup(va, vb, p.dst_dims, in_dt, out_dt, bias_dt);
    }, [&] {
      View a{{DNNL_RUNTIME_DIM_VAL, k}, va.strides};
      bool one = one_thread_for(static_cast<double>(m) * k * n, true);
      return lookup(a, vb, {DNNL_RUNTIME_DIM_VAL, n}, in_dt, out_dt, bias_dt, false, one);
    });
    p.entry = chosen.entry;
    p.actual = chosen.actual();
  }
  if (!p.direct && !p.entry && batched && in_dt == mx::bfloat16 && !bias_dt &&
      any_rows_kernel()) {
    double macs = static_cast<double>(va.dims.back());
    for (auto d : p.dst_dims) {
      macs *= static_cast<double>(d);
    }
    if (macs <= ANY_SHAPE_MACS) {
      if (auto entry = any_shape(va, vb, in_dt, out_dt)) {
        p.entry = entry;
        auto dt = dnnl_type(in_dt, FN);
        p.actual = {{DNNL_ARG_SRC, dnnl::memory::desc(va.dims, dt, va.strides)},
                    {DNNL_ARG_WEIGHTS, dnnl::memory::desc(vb.dims, dt, vb.strides)},
                    {DNNL_ARG_DST, dnnl::memory::desc(p.dst_dims, dnnl_type(out_dt, FN),
                                                      row_major(p.dst_dims))}};
      }
    }
  }
  if (!p.direct && !p.entry) {
    p.entry = lookup(va, vb, p.dst_dims, in_dt, out_dt, bias_dt);
  }
  return p;
}

} // namespace

void Matmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  set_aligned_data(out);  // (the next product's source, read in place)
  if (out.size() == 0) {
    return;
  }
  if (upcast_) {
    eval_upcast(inputs, out);
    return;
  }
  // Row-contiguous operands pass as they are, and column-major ones (a transposed view) where
  // the kernel reads them with their strides: a 2-D first operand, an unbatched second one.
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto laid_out = [&](const mx::array& x, bool col_major_ok) -> mx::array {
    if (x.flags().row_contiguous || (col_major_ok && x.flags().col_contiguous)) {
      return x;
    }
    return row_contiguous_copy(x, encoder);
  };
  const mx::array a = laid_out(inputs[0], !batched_ && inputs[0].ndim() == 2);
  const mx::array b = laid_out(inputs[1], !batched_);
  const mx::array bias = has_bias_ ? laid_out(inputs[2], false) : inputs[0];
  View va = view(a, trans_a_, !batched_);
  View vb = view(b, trans_b_, false);
  std::optional<mx::Dtype> bias_dt;
  if (has_bias_) {
    bias_dt = inputs[2].dtype();
  }
  // oneDNN 3.2's float16 kernels take a float32 bias only (a float16 one gets its reference
  // implementation, ~1,000x slower): a float16 bias is widened (exactly) when the task runs.
  bool widen_bias = bias_dt == mx::float16;
  if (widen_bias) {
    bias_dt = mx::float32;
  }
  bool gemm_ok = !batched_ && a.dtype() == mx::float32 && out.dtype() == mx::float32 &&
      (!has_bias_ || bias.dtype() == mx::float32);
  auto pl = plan(va, vb, out, batched_, gemm_ok, a.dtype(), out.dtype(), bias_dt);
  if (pl.entry && pl.entry->impl.rfind("ref", 0) == 0 && a.dtype() != mx::float32) {
    // No fast half kernel for this case (a layout oneDNN's float16 brgemm declines):
    // float32 kernels, as a CPU without them runs it.
    eval_upcast(inputs, out);
    return;
  }
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  void* pbias = has_bias_ ? const_cast<void*>(bias.data<void>()) : nullptr;
  if (pl.direct) {
    encoder.dispatch([pa = a.data<float>(), la = pl.la, pb = b.data<float>(), lb = pl.lb,
                      pbias = static_cast<const float*>(pbias), pdst = out.data<float>(),
                      m = pl.dst_dims[0], n = pl.dst_dims[1], k = va.dims[1], relu = relu_]() {
      direct_gemm(pa, la, pb, lb, pbias, pdst, m, n, k);
      if (relu) {
        relu_keeping_nan(pdst, static_cast<size_t>(m * n), mx::float32);
      }
    });
    return;
  }
  encoder.dispatch([entry = pl.entry,
                    actual = std::move(pl.actual),
                    pa = const_cast<void*>(a.data<void>()),
                    a_bytes = a.nbytes(),
                    pb = const_cast<void*>(b.data<void>()),
                    pbias,
                    bias_n = widen_bias ? bias.size() : 0,
                    pdst = out.data<void>(),
                    relu = relu_,
                    odt = out.dtype(),
                    n = out.size()]() mutable {
    Float32Scratch wide(bias_n, FN);
    if (bias_n > 0) {
      widen_all(pbias, mx::float16, wide.get(), bias_n);
      pbias = wide.get();
    }
    // (a is dense, row- or column-major: its bytes copied keep its layout.)
    run_product(*entry, pa, a_bytes, pb, pbias, pdst, FN, actual);
    if (relu) {
      relu_keeping_nan(pdst, n, odt);
    }
  });
}

// Half-precision operands in float32 kernels: the task upcasts them (exactly) into float32
// buffers of its own, runs the float32 product as eval_cpu would (the GEMM without a
// primitive, or a cached float32 primitive), applies the ReLU, and rounds the result to
// the output's dtype where that is a half one - what astype, a float32 product and astype
// compute, in one node whose float32 copies live only while it runs.
void Matmul::eval_upcast(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  View va = row_major_view(inputs[0].shape(), trans_a_, !batched_);
  View vb = row_major_view(inputs[1].shape(), trans_b_, false);
  std::optional<mx::Dtype> bias_dt;
  if (has_bias_) {
    bias_dt = mx::float32;
  }
  auto pl = plan(va, vb, out, batched_, !batched_, mx::float32, mx::float32, bias_dt);
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  // Fused casts: float32 operands read rounded to the compute dtype (a legacy float32 bias
  // beside half operands is added as it is).
  auto rounding = fused_ ? cdt_ : mx::float32;
  std::optional<Operand> bias;
  if (has_bias_) {
    bias = operand(inputs[2], rounding);
  }
  encoder.dispatch([a = operand(inputs[0], rounding), b = operand(inputs[1], rounding),
                    bias = std::move(bias), entry = pl.entry, la = pl.la, lb = pl.lb,
                    direct = pl.direct, relu = relu_, pdst = out.data<void>(),
                    odt = out.dtype(), n_out = out.size(), m = pl.dst_dims[0],
                    n = pl.dst_dims.back(), k = va.dims.back(),
                    round_f32 = round_f32_ ? cdt_ : mx::float32]() {
    bool half = odt != mx::float32;
    Float32Scratch a_copy(a.size, FN), b_copy(b.size, FN), bias_copy(bias ? bias->size : 0, FN);
    Float32Scratch y_copy(half ? n_out : 0, FN);
    float *a32 = a_copy.get(), *b32 = b_copy.get(), *bias32 = bias_copy.get();
    to_float32(a, a32);
    to_float32(b, b32);
    if (bias) {
      to_float32(*bias, bias32);
    }
    auto dst = half ? y_copy.get() : static_cast<float*>(pdst);
    if (direct) {
      direct_gemm(a32, la, b32, lb, bias32, dst, m, n, k);
    } else {
      execute(*entry, {{DNNL_ARG_SRC, a32}, {DNNL_ARG_WEIGHTS, b32},
                       {DNNL_ARG_BIAS, bias32}, {DNNL_ARG_DST, dst}}, FN);
    }
    if (relu) {
      relu_keeping_nan(dst, n_out, mx::float32);
    }
    if (half) {
      narrow_all(dst, odt, pdst, n_out);
    } else {
      round_all(dst, round_f32, n_out);
    }
  });
}

// mx.vmap: the vmapped axis of each operand moves to the front. Only the first operand
// mapped (per-sample inputs through shared weights): the same kernel, the axis one more
// leading row axis. Otherwise MLX's ops in float32 (the same numerics: exact upcasts, float32
// accumulation, one rounding), which broadcast the mapped axis.
std::pair<std::vector<mx::array>, std::vector<int>> Matmul::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto front = [&](int i) {
    return axes[i] >= 0 ? mx::moveaxis(inputs[i], axes[i], 0, s) : inputs[i];
  };
  bool a_only = axes[0] >= 0 && axes[1] < 0 && (!has_bias_ || axes[2] < 0);
  if (a_only && !batched_ && !trans_a_) {
    std::optional<mx::array> bias;
    if (has_bias_) {
      bias = inputs[2];
    }
    return {{matmul(front(0), inputs[1], bias, false, trans_b_, relu_, out_dtype_, false,
                    native(), s, compute(), round_f32_)},
            {0}};
  }
  int mapped = -1;  // the size of the mapped axis
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      mapped = inputs[i].shape(axes[i]);
    }
  }
  // Operand i as the product reads it, in float32 (a fused cast rounds a float32 one).
  auto read = [&](int i) {
    auto x = front(i);
    if ((i < 2 || fused_) && x.dtype() != cdt_) {
      x = mx::astype(x, cdt_, s);
    }
    return mx::astype(x, mx::float32, s);
  };
  auto operand = [&](int i, bool trans) {
    auto x = read(i);
    if (axes[i] < 0) {
      x = mx::expand_dims(x, 0, s);  // broadcast over the mapped axis
    }
    if (!batched_ && x.ndim() > 3) {  // unbatched: the rows' leading axes as one
      auto shape = x.shape();
      x = mx::reshape(x, {shape[0], -1, shape.back()}, s);
    }
    return trans ? mx::swapaxes(x, -1, -2, s) : x;
  };
  auto y = mx::matmul(operand(0, trans_a_), operand(1, trans_b_), s);
  if (has_bias_) {
    auto bias = read(2);
    mx::Shape shape(y.ndim(), 1);
    shape[0] = axes[2] >= 0 ? mapped : 1;
    shape.back() = bias.shape(-1);
    y = mx::add(y, mx::reshape(bias, shape, s), s);
  }
  if (relu_) {
    y = mx::maximum(y, mx::array(0.0f), s);
  }
  auto unmapped = [&](int i) {  // operand i's shape without the mapped axis
    auto shape = inputs[i].shape();
    if (axes[i] >= 0) {
      shape.erase(shape.begin() + axes[i]);
    }
    return shape;
  };
  mx::Shape out = out_shape(unmapped(0), unmapped(1), trans_a_, trans_b_, batched_);
  out.insert(out.begin(), mapped);  // y's rows are (mapped, rows...) in that order
  return {{result_in(mx::reshape(y, out, s), cdt_, out_dtype_, round_f32_, s)}, {0}};
}

std::vector<mx::Shape> Matmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {out_shape(inputs[0].shape(), inputs[1].shape(), trans_a_, trans_b_, batched_)};
}

bool Matmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Matmul&>(other);
  return trans_a_ == o.trans_a_ && trans_b_ == o.trans_b_ && has_bias_ == o.has_bias_ &&
      relu_ == o.relu_ && batched_ == o.batched_ && out_dtype_ == o.out_dtype_ &&
      upcast_ == o.upcast_ && cdt_ == o.cdt_ && fused_ == o.fused_ &&
      round_f32_ == o.round_f32_;
}

namespace {

// Whether `x` is a bfloat16 or float16 operand narrowed from float32 in the graph by
// fluxlike's cast (autocast's cast of a float32 weight, or of a float32 layer's output), not
// yet evaluated: an unbatched product in that dtype's kernels then gives it its gradient as
// the float32 product itself, which the cast's gradient passes on unchanged, instead of
// rounding it to the half dtype for the cast to widen again (as Megatron-LM's fused weight
// gradient accumulates into float32). More accurate by the half dtype's rounding, and
// cheaper: oneDNN's kernel accumulates in float32 anyway (writing float32 took 3.1 ms of a
// 2048 x 512 x 2048 bfloat16 weight gradient on AMX, bfloat16 3.4, and the cast back 0.4
// more; Intel Xeon, 2026-12-05).
bool narrowed_from_f32(const mx::array& x) {
  if ((x.dtype() != mx::bfloat16 && x.dtype() != mx::float16) || !x.has_primitive() ||
      x.inputs().size() != 1 || x.inputs()[0].dtype() != mx::float32) {
    return false;
  }
  // (fluxlike's cast only: MLX's AsType refuses a cotangent of another dtype than its output)
  return typeid(x.primitive()) == typeid(Convert);
}

} // namespace

// The gradients are the products (and sums) the casts and the product in float32 would
// differentiate to, with this product's kernels: a half cotangent, each operand's gradient
// rounded to the compute dtype, then given its dtype (a fused float32 operand's gradient is
// float32 holding the rounded values, as astype's gradient gives it).
// Except, in bfloat16 or float16 kernels, an unbatched product's operand or bias narrowed from
// float32 in the graph (narrowed_from_f32): its gradient is the float32 product (or sum), not
// rounded.
std::vector<mx::array> Matmul::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto cdt = cdt_;
  bool native = this->native();  // its products run as this one does
  auto comp = compute();
  auto g = cotangents[0];
  if (relu_) {  // relu'(y) is y > 0 (the output is kept in the compute dtype)
    // One pass, no temporaries (MLX's where, or a product with the mask, take 3-4 passes
    // and a mask array, several times slower on bfloat16).
    g = relu_grad(g, outputs[0], s);
  }
  auto gc = g.dtype() == cdt ? g : mx::astype(g, cdt, s);
  std::vector<mx::array> grads;
  // A batched operand broadcast over batch axes gets its gradient summed over them: upcast,
  // the products stay float32 until that sum is rounded once (as the casts it replaces do).
  bool unrounded = batched_ && upcast_;
  auto in_dtype_of = [&](const mx::array& x, const mx::Dtype& computed) {
    return x.dtype() == computed ? x : mx::astype(x, computed, s);
  };
  auto reduced = [&](const mx::array& x, const mx::array& primal) {
    auto r = in_dtype_of(reduce_to(x, primal.shape(), s), cdt);
    return in_dtype_of(r, primal.dtype());
  };
  // Whether the gradient of `primal` is a float32 product left unrounded: to be summed over
  // broadcast batch axes, or for fluxlike's cast of a float32 array (narrowed_from_f32).
  auto exact = [&](const mx::array& primal) {
    return unrounded || (native && !batched_ && narrowed_from_f32(primal));
  };
  // A product's output for the gradient of `primal`: float32 where exact, else the primal's
  // dtype rounded to the compute dtype.
  auto odt = [&](const mx::array& primal) {
    return exact(primal) ? mx::float32 : primal.dtype();
  };
  for (int arg : argnums) {
    if (arg == 0) {
      mx::array da = trans_a_
          ? matmul(b, gc, std::nullopt, trans_b_, true, false, odt(a), batched_, native, s,
                   comp, !exact(a))
          : matmul(gc, b, std::nullopt, false, !trans_b_, false, odt(a), batched_, native, s,
                   comp, !exact(a));
      grads.push_back(batched_ ? reduced(da, a) : da);
    } else if (arg == 1) {
      mx::array db = a;  // placeholder, assigned below
      if (batched_) {
        db = trans_b_
            ? matmul(gc, a, std::nullopt, true, trans_a_, false, odt(b), true, native, s,
                     comp, !unrounded)
            : matmul(a, gc, std::nullopt, !trans_a_, false, false, odt(b), true, native, s,
                     comp, !unrounded);
        db = reduced(db, b);
      } else {
        // Rows of a and of the cotangent, as 2-D matrices (Flatten keeps shapeless traces).
        auto a2 = a.ndim() == 1 ? mx::expand_dims(a, 0, s)
            : a.ndim() > 2      ? mx::flatten(a, 0, a.ndim() - 2, s)
                                : a;
        auto g2 = gc.ndim() == 1 ? mx::expand_dims(gc, 0, s)
            : gc.ndim() > 2      ? mx::flatten(gc, 0, gc.ndim() - 2, s)
                                 : gc;
        db = trans_b_
            ? matmul(g2, a2, std::nullopt, true, trans_a_, false, odt(b), false, native, s,
                     comp, !exact(b))
            : matmul(a2, g2, std::nullopt, !trans_a_, false, false, odt(b), false, native,
                     s, comp, !exact(b));
      }
      grads.push_back(db);
    } else if (fused_) {
      // The bias's cast differentiated: the cotangent summed (in float32) and rounded, in the
      // bias's dtype. The cotangent as the casts give it: a rounded float32 result's is
      // rounded by the cast back to float32; an unrounded one's is not.
      auto summed = out_dtype_ == mx::float32 && !round_f32_ ? g : gc;
      grads.push_back(bias_grad(summed, primals[2].dtype(), s, cdt));
    } else {  // (a bias narrowed from float32 likewise gets the float32 sum, not rounded)
      auto& bias = primals[2];
      grads.push_back(bias_grad(g, exact(bias) ? mx::float32 : bias.dtype(), s));
    }
  }
  order_input_grad(grads, argnums, gc.nbytes() + a.nbytes(), s);
  return grads;
}

std::vector<mx::array> Matmul::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto cdt = cdt_;
  bool native = this->native();
  auto comp = compute();
  auto shape = out_shape(a.shape(), b.shape(), trans_a_, trans_b_, batched_);
  // Tangents are summed in float32 and given the output's dtype.
  std::optional<mx::array> t;
  for (size_t i = 0; i < argnums.size(); ++i) {
    auto tan = tangents[i];
    mx::array ti = tan;
    if (argnums[i] == 0) {
      ti = matmul(mx::astype(tan, cdt, s), b, std::nullopt, trans_a_, trans_b_, false,
                  mx::float32, batched_, native, s, comp);
    } else if (argnums[i] == 1) {
      ti = matmul(a, mx::astype(tan, cdt, s), std::nullopt, trans_a_, trans_b_, false,
                  mx::float32, batched_, native, s, comp);
    } else {  // a fused cast rounds the bias's tangent as astype's tangent is rounded
      auto tb = fused_ ? mx::astype(tan, cdt, s) : tan;
      ti = mx::broadcast_to(mx::astype(tb, mx::float32, s), shape, s);
    }
    t = t ? mx::add(*t, ti, s) : ti;
  }
  std::optional<mx::array> bias;
  if (has_bias_) {
    bias = primals[2];
  }
  if (relu_) {
    auto y = matmul(a, b, bias, trans_a_, trans_b_, false, mx::float32, batched_, native, s,
                    comp);
    t = mx::where(mx::greater(y, mx::array(0.0f), s), *t, mx::array(0.0f), s);
  }
  return {result_in(*t, cdt, out_dtype_, round_f32_, s)};
}

} // namespace fluxlike_native

namespace fluxlike_native {

// The oneDNN matmul of an unbatched (m x k) @ (k x n) product (b given transposed, as a
// linear layer's (n x k) weights are, where `transposed_b`), run outside MLX on buffers of
// its own filled with values in [-1, 1): the fastest of `reps` calls, in seconds. The
// primitive is described as Matmul::eval_cpu describes it (plain layouts, user scratchpad,
// one thread below the threshold), or with the weights in the layout oneDNN prefers
// (`format_tag::any`, reordered once) where `any_layout`.
StandaloneTiming standalone_matmul(int64_t m, int64_t k, int64_t n, mx::Dtype dt,
                                   bool transposed_b, bool any_layout, int reps) {
  FLN_CHECK(m > 0 && k > 0 && n > 0 && reps > 0, "fluxlike_native.standalone_matmul: m, k, n "
            "and reps must be positive, got ", m, ", ", k, ", ", n, ", ", reps);
  FLN_CHECK(float_or_half(dt), "fluxlike_native.standalone_matmul: dtype must be float32, "
            "bfloat16 or float16, got ", dtype_str(dt));
  using tag = dnnl::memory::format_tag;
  auto& eng = engine();
  auto odt = dnnl_type(dt, FN);
  dnnl::memory::desc a_md({m, k}, odt, tag::ab), dst_md({m, n}, odt, tag::ab);
  dnnl::memory::desc w_user({k, n}, odt, transposed_b ? tag::ba : tag::ab);
  dnnl::memory::desc w_md = any_layout ? dnnl::memory::desc({k, n}, odt, tag::any) : w_user;
  auto prepared = prepared_matmul(a_md, w_md, std::nullopt, dst_md, FN);
  dnnl::stream strm(eng);
  auto filled = [&](const dnnl::memory::desc& md) {
    dnnl::memory f32(dnnl::memory::desc(md.get_dims(), dnnl::memory::data_type::f32, tag::ab),
                     eng);
    auto* p = static_cast<float*>(f32.get_data_handle());
    uint32_t state = 12345;
    for (int64_t i = 0, size = md.get_dims()[0] * md.get_dims()[1]; i < size; ++i) {
      state = state * 1664525u + 1013904223u;
      p[i] = static_cast<float>(state >> 8) / static_cast<float>(1 << 24) * 2.0f - 1.0f;
    }
    dnnl::memory out(md, eng);
    dnnl::reorder(f32, out).execute(strm, f32, out);
    strm.wait();
    return out;
  };
  auto a = filled(a_md), w_plain = filled(w_user);
  auto w = any_layout ? dnnl::memory(prepared->md(DNNL_ARG_WEIGHTS), eng) : w_plain;
  if (any_layout) {
    dnnl::reorder(w_plain, w).execute(strm, w_plain, w);
    strm.wait();
  }
  dnnl::memory dst(dst_md, eng);
  std::memset(dst.get_data_handle(), 0, dst_md.get_size());
  auto run = [&] {
    execute(*prepared, {{DNNL_ARG_SRC, a.get_data_handle()}, {DNNL_ARG_WEIGHTS,
            w.get_data_handle()}, {DNNL_ARG_DST, dst.get_data_handle()}}, FN);
  };
  run();
  run();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  return {best, prepared->impl};
}

} // namespace fluxlike_native
