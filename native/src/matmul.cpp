// fluxlike-native: oneDNN matrix multiplication as an MLX primitive (CPU).
//
// The primitive's eval_cpu runs on the thread that evaluates the graph: it describes the
// operands to oneDNN (shapes, strides, dtypes), finds or creates the oneDNN matmul for that
// description in a process-wide cache (guarded by a mutex) and hands its execution to MLX's
// CPU stream through the command encoder, like MLX's own CPU kernels. Each execution gets
// its own scratchpad (oneDNN's "user" scratchpad mode) and stream, so one cached primitive
// may run from several threads at once.

#include "matmul.h"
#include "common.h"

#include "cache.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/allocator.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.matmul";

// The result's shape, or a clear error.
mx::Shape out_shape(
    const mx::Shape& as,
    const mx::Shape& bs,
    bool ta,
    bool tb,
    bool batched) {
  std::ostringstream err;
  err << FN << ": ";
  if (!batched) {
    if (bs.size() != 2 || as.empty()) {
      err << "expected a of 1 or more axes and a 2-D b, got a " << shape_str(as)
          << " and b " << shape_str(bs)
          << "; use batched=True for batch axes on both operands";
      throw std::invalid_argument(err.str());
    }
    if (ta && as.size() != 2) {
      err << "trans_a needs a 2-D a, got " << shape_str(as);
      throw std::invalid_argument(err.str());
    }
    int ka = ta ? as[0] : as.back();
    int kb = tb ? bs[1] : bs[0];
    int n = tb ? bs[0] : bs[1];
    if (ka != kb) {
      err << "inner dimensions differ: a " << shape_str(as) << (ta ? " (transposed)" : "")
          << " has " << ka << ", b " << shape_str(bs) << (tb ? " (transposed)" : "")
          << " has " << kb;
      throw std::invalid_argument(err.str());
    }
    mx::Shape out;
    if (ta) {
      out = {as[1], n};
    } else {
      out = mx::Shape(as.begin(), as.end() - 1);
      out.push_back(n);
    }
    return out;
  }
  if (as.size() < 3 || as.size() != bs.size()) {
    err << "batched=True expects a and b of the same number (>= 3) of axes, got a "
        << shape_str(as) << " and b " << shape_str(bs);
    throw std::invalid_argument(err.str());
  }
  if (as.size() > 12) {
    err << "at most 12 axes (oneDNN's limit), got " << as.size();
    throw std::invalid_argument(err.str());
  }
  size_t nd = as.size();
  int m = ta ? as[nd - 1] : as[nd - 2];
  int ka = ta ? as[nd - 2] : as[nd - 1];
  int kb = tb ? bs[nd - 1] : bs[nd - 2];
  int n = tb ? bs[nd - 2] : bs[nd - 1];
  if (ka != kb) {
    err << "inner dimensions differ: a " << shape_str(as) << " has " << ka << ", b "
        << shape_str(bs) << " has " << kb;
    throw std::invalid_argument(err.str());
  }
  mx::Shape out;
  for (size_t i = 0; i + 2 < nd; ++i) {
    if (as[i] != bs[i] && as[i] != 1 && bs[i] != 1) {
      err << "batch axes of a " << shape_str(as) << " and b " << shape_str(bs)
          << " do not broadcast (axis " << i << ")";
      throw std::invalid_argument(err.str());
    }
    out.push_back(std::max(as[i], bs[i]));
  }
  out.push_back(m);
  out.push_back(n);
  return out;
}

// ---- OpenMP's thread count, through the libgomp that oneDNN loaded -------------------------

struct Omp {
  int (*get_max_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
  Omp() {
    void* lib = dlopen("libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (lib != nullptr) {
      get_max_threads = reinterpret_cast<int (*)()>(dlsym(lib, "omp_get_max_threads"));
      set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(lib, "omp_set_num_threads"));
      if (get_max_threads == nullptr || set_num_threads == nullptr) {
        get_max_threads = nullptr;
        set_num_threads = nullptr;
      }
    }
  }
};

const Omp& omp() {
  static Omp o;
  return o;
}

// ---- the primitive cache ------------------------------------------------------------------

struct Entry {
  dnnl::matmul prim;
  dnnl::memory::desc a_md, b_md, bias_md, dst_md, scratch_md;
  size_t scratch_bytes;
  std::string impl;
};

PrimitiveCache<Entry> cache(4096);

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

std::shared_ptr<Entry> lookup(
    const View& a,
    const View& b,
    const dnnl::memory::dims& dst_dims,
    mx::Dtype in_dt,
    mx::Dtype out_dt,
    std::optional<mx::Dtype> bias_dt) {
  std::vector<int64_t> key;
  key.reserve(8 + 5 * a.dims.size());
  key.push_back(static_cast<int64_t>(in_dt.val()));
  key.push_back(static_cast<int64_t>(out_dt.val()));
  key.push_back(bias_dt ? static_cast<int64_t>(bias_dt->val()) : -1);
  key.push_back(static_cast<int64_t>(a.dims.size()));
  for (auto* part : {&a.dims, &a.strides, &b.dims, &b.strides, &dst_dims}) {
    key.insert(key.end(), part->begin(), part->end());
  }
  if (auto hit = cache.find(key)) {
    return hit;
  }
  // Created outside the cache's lock: two threads may both create one; the first stored wins.
  auto e = std::make_shared<Entry>();
  auto dt = dnnl_type(in_dt, FN);
  e->a_md = dnnl::memory::desc(a.dims, dt, a.strides);
  e->b_md = dnnl::memory::desc(b.dims, dt, b.strides);
  e->dst_md = dnnl::memory::desc(dst_dims, dnnl_type(out_dt, FN), row_major(dst_dims));
  if (bias_dt) {
    dnnl::memory::dims bdims(dst_dims.size(), 1);
    bdims.back() = dst_dims.back();
    e->bias_md = dnnl::memory::desc(bdims, dnnl_type(*bias_dt, FN), row_major(bdims));
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  double macs = static_cast<double>(a.dims.back());
  for (auto d : dst_dims) macs *= static_cast<double>(d);
  OneThread one(macs < SINGLE_THREAD_MACS);
  dnnl::matmul::primitive_desc pd;
  try {
    pd = bias_dt ? dnnl::matmul::primitive_desc(
                       engine(), e->a_md, e->b_md, e->bias_md, e->dst_md, attr)
                 : dnnl::matmul::primitive_desc(engine(), e->a_md, e->b_md, e->dst_md, attr);
  } catch (const dnnl::error& err) {
    throw std::runtime_error(
        std::string(FN) + ": oneDNN has no matmul for these operands (" + err.what() + ")");
  }
  e->scratch_md = pd.scratchpad_desc();
  e->scratch_bytes = e->scratch_md.get_size();
  e->impl = pd.impl_info_str();
  e->prim = dnnl::matmul(pd);
  return cache.insert(std::move(key), e);
}

void run(const Entry& e, void* a, void* b, void* bias, void* dst) {
  auto& eng = engine();
  dnnl::stream strm(eng);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, dnnl::memory(e.a_md, eng, a)},
      {DNNL_ARG_WEIGHTS, dnnl::memory(e.b_md, eng, b)},
      {DNNL_ARG_DST, dnnl::memory(e.dst_md, eng, dst)}};
  if (bias != nullptr) {
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(e.bias_md, eng, bias));
  }
  Buffer scratch(e.scratch_bytes, FN);
  if (scratch.p) {
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(e.scratch_md, eng, scratch.p));
  }
  e.prim.execute(strm, args);
  strm.wait();
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

} // namespace

OneThread::OneThread(bool on) {
  if (on && omp().set_num_threads != nullptr) {
    saved_ = omp().get_max_threads();
    omp().set_num_threads(1);
  }
}

OneThread::~OneThread() {
  if (saved_ > 0) {
    omp().set_num_threads(saved_);
  }
}

// ---- the CPU ------------------------------------------------------------------------------

std::string cpu_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    default: return "default";
  }
}

bool isa_has_bf16() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_bf16:
    case dnnl::cpu_isa::avx512_core_fp16:
    case dnnl::cpu_isa::avx512_core_amx:
    case dnnl::cpu_isa::avx512_core_amx_fp16:
      return true;
    default:
      return false;
  }
}

bool isa_has_avx512() {
  return isa_has_bf16() || dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core ||
      dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_vnni;
}

std::string onednn_version() {
  auto v = dnnl::version();
  std::ostringstream os;
  os << v->major << "." << v->minor << "." << v->patch;
  return os.str();
}

size_t cache_size() {
  return cache.size();
}

void clear_cache() {
  cache.clear();
}

std::vector<std::pair<std::string, int>> cache_impls() {
  return cache.impls();
}

// ---- the op -------------------------------------------------------------------------------

mx::array matmul(
    const mx::array& a,
    const mx::array& b,
    const std::optional<mx::array>& bias,
    bool trans_a,
    bool trans_b,
    bool relu,
    std::optional<mx::Dtype> out_dtype,
    bool batched,
    bool native_bf16,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(
        std::string(FN) + ": oneDNN kernels run on the CPU, the stream is on the GPU; "
        "use MLX's own kernels there (mx.matmul)");
  }
  auto dt = a.dtype();
  if (b.dtype() != dt) {
    throw std::invalid_argument(
        std::string(FN) + ": a and b must have one dtype, got " + dtype_str(dt) + " and " +
        dtype_str(b.dtype()) + "; cast one with astype");
  }
  if (dt != mx::float32 && dt != mx::bfloat16) {
    throw std::invalid_argument(
        std::string(FN) + ": operands must be float32 or bfloat16, got " + dtype_str(dt) +
        " (no fast oneDNN kernel for it on this CPU; use mx.matmul)");
  }
  auto odt = out_dtype.value_or(dt);
  if (odt != dt && odt != mx::float32) {
    throw std::invalid_argument(
        std::string(FN) + ": out_dtype must be float32 or the operands' " + dtype_str(dt) +
        ", got " + dtype_str(odt));
  }
  auto shape = out_shape(a.shape(), b.shape(), trans_a, trans_b, batched);
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != shape.back()) {
      throw std::invalid_argument(
          std::string(FN) + ": bias must have shape (" + std::to_string(shape.back()) +
          ",), got " + shape_str(bias->shape()));
    }
    if (bias->dtype() != dt && bias->dtype() != mx::float32) {
      throw std::invalid_argument(
          std::string(FN) + ": bias must be " + dtype_str(dt) + " or float32, got " +
          dtype_str(bias->dtype()));
    }
  }
  if (dt == mx::bfloat16 && !native_bf16) {  // bfloat16 numerics on float32 kernels
    std::optional<mx::array> bias32;
    if (bias) {
      bias32 = mx::astype(*bias, mx::float32, stream);
    }
    auto y = matmul(
        mx::astype(a, mx::float32, stream), mx::astype(b, mx::float32, stream), bias32,
        trans_a, trans_b, relu, mx::float32, batched, false, stream);
    return odt == mx::float32 ? y : mx::astype(y, odt, stream);
  }
  if (dt == mx::bfloat16 && !isa_has_bf16()) {
    throw std::invalid_argument(
        std::string(FN) + ": native bfloat16 kernels were asked for, but oneDNN's CPU ISA is " +
        cpu_isa() + " (no avx512_core_bf16); pass native_bf16=False to run bfloat16 in float32 "
        "kernels");
  }
  if (a.size() == 0 || b.size() == 0) {  // oneDNN takes no empty operands
    auto y = mx::matmul(
        mx::astype(swap_last(a, trans_a, stream), mx::float32, stream),
        mx::astype(swap_last(b, trans_b, stream), mx::float32, stream), stream);
    if (bias) {
      y = mx::add(y, mx::astype(*bias, mx::float32, stream), stream);
    }
    if (relu) {
      y = mx::maximum(y, mx::array(0.0f), stream);
    }
    return mx::astype(mx::reshape(y, shape, stream), odt, stream);
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
          stream, trans_a, trans_b, bias.has_value(), relu, batched, odt),
      std::move(inputs));
}

// ---- the primitive ------------------------------------------------------------------------

namespace {

// Whether the float32 / bfloat16 bit pattern is > 0 (positive and finite or +inf; not NaN).
inline bool positive(uint32_t bits) {
  return bits - 1u < 0x7F800000u;
}
inline bool positive(uint16_t bits) {
  return static_cast<uint16_t>(bits - 1u) < 0x7F80u;
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

FLN_VECTOR_CLONES void relu_bfloat16(uint16_t* y, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t b = y[i];
    uint16_t keep = static_cast<uint16_t>(static_cast<uint16_t>(b - 1u) < 0x7F80u) |
        static_cast<uint16_t>((b & 0x7FFFu) > 0x7F80u);
    y[i] = static_cast<uint16_t>(b & static_cast<uint16_t>(0u - keep));
  }
}

void relu_keeping_nan(void* y, size_t n, bool bf16) {
  if (bf16) {
    relu_bfloat16(static_cast<uint16_t*>(y), n);
  } else {
    relu_float32(static_cast<float*>(y), n);
  }
}

void Matmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
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
  dnnl::memory::dims dst_dims;
  if (batched_) {
    dst_dims.assign(out.shape().begin(), out.shape().end());
  } else {
    dst_dims = {va.dims[0], vb.dims[1]};
  }
  std::optional<mx::Dtype> bias_dt;
  if (has_bias_) {
    bias_dt = inputs[2].dtype();
  }
  auto entry = lookup(va, vb, dst_dims, a.dtype(), out.dtype(), bias_dt);

  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  void* pbias = has_bias_ ? const_cast<void*>(bias.data<void>()) : nullptr;
  encoder.dispatch([entry,
                    pa = const_cast<void*>(a.data<void>()),
                    pb = const_cast<void*>(b.data<void>()),
                    pbias,
                    pdst = out.data<void>(),
                    relu = relu_,
                    bf16 = out.dtype() == mx::bfloat16,
                    n = out.size()]() {
    run(*entry, pa, pb, pbias, pdst);
    if (relu) {
      relu_keeping_nan(pdst, n, bf16);
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
    bool native = inputs[0].dtype() == mx::bfloat16;
    return {{matmul(front(0), inputs[1], bias, false, trans_b_, relu_, out_dtype_, false,
                    native, s)},
            {0}};
  }
  int mapped = -1;  // the size of the mapped axis
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      mapped = inputs[i].shape(axes[i]);
    }
  }
  auto operand = [&](int i, bool trans) {
    auto x = mx::astype(front(i), mx::float32, s);
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
    auto bias = mx::astype(front(2), mx::float32, s);
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
  return {{mx::astype(mx::reshape(y, out, s), out_dtype_, s)}, {0}};
}

void Matmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "fluxlike_native.matmul has no GPU kernel: build it on a CPU stream");
}

std::vector<mx::Shape> Matmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {out_shape(inputs[0].shape(), inputs[1].shape(), trans_a_, trans_b_, batched_)};
}

bool Matmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Matmul&>(other);
  return trans_a_ == o.trans_a_ && trans_b_ == o.trans_b_ && has_bias_ == o.has_bias_ &&
      relu_ == o.relu_ && batched_ == o.batched_ && out_dtype_ == o.out_dtype_;
}

std::vector<mx::array> Matmul::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto cdt = a.dtype();
  bool native = cdt == mx::bfloat16;  // a bfloat16 primitive exists only when native
  auto g = cotangents[0];
  if (relu_) {  // relu'(y) is y > 0 (the output is kept in the compute dtype)
    // One pass, no temporaries (MLX's where, or a product with the mask, take 3-4 passes
    // and a mask array, several times slower on bfloat16).
    g = relu_grad(g, outputs[0], s);
  }
  auto gc = g.dtype() == cdt ? g : mx::astype(g, cdt, s);
  std::vector<mx::array> grads;
  int first = -1;  // where the first operand's gradient is in grads
  for (int arg : argnums) {
    if (arg == 0) {
      first = static_cast<int>(grads.size());
    }
    if (arg == 0) {
      mx::array da = trans_a_
          ? matmul(b, gc, std::nullopt, trans_b_, true, false, cdt, batched_, native, s)
          : matmul(gc, b, std::nullopt, false, !trans_b_, false, cdt, batched_, native, s);
      grads.push_back(batched_ ? reduce_to(da, a.shape(), s) : da);
    } else if (arg == 1) {
      mx::array db = a;  // placeholder, assigned below
      if (batched_) {
        db = trans_b_
            ? matmul(gc, a, std::nullopt, true, trans_a_, false, cdt, true, native, s)
            : matmul(a, gc, std::nullopt, !trans_a_, false, false, cdt, true, native, s);
        db = reduce_to(db, b.shape(), s);
      } else {
        // Rows of a and of the cotangent, as 2-D matrices (Flatten keeps shapeless traces).
        auto a2 = a.ndim() == 1 ? mx::expand_dims(a, 0, s)
            : a.ndim() > 2      ? mx::flatten(a, 0, a.ndim() - 2, s)
                                : a;
        auto g2 = gc.ndim() == 1 ? mx::expand_dims(gc, 0, s)
            : gc.ndim() > 2      ? mx::flatten(gc, 0, gc.ndim() - 2, s)
                                 : gc;
        db = trans_b_
            ? matmul(g2, a2, std::nullopt, true, trans_a_, false, cdt, false, native, s)
            : matmul(a2, g2, std::nullopt, !trans_a_, false, false, cdt, false, native, s);
      }
      grads.push_back(db);
    } else {
      auto& bias = primals[2];
      std::vector<int> axes;
      for (int i = 0; i + 1 < g.ndim(); ++i) {
        axes.push_back(i);
      }
      // MLX's CPU sum of bfloat16 accumulates in float32 and rounds once: the same result
      // as summing a float32 upcast, without an upcast of the whole cotangent.
      auto gb = bias.dtype() == g.dtype() ? mx::sum(g, axes, false, s)
                                          : mx::sum(mx::astype(g, mx::float32, s), axes, false, s);
      grads.push_back(gb.dtype() == bias.dtype() ? gb : mx::astype(gb, bias.dtype(), s));
    }
  }
  // The first operand's gradient flows on down the network: making it wait for the others'
  // (the weight's and bias's) has those computed now, while this layer's cotangent and
  // input are live, instead of at the end of the backward pass with every layer's
  // cotangent held until then (MLX evaluates depth first, from the outputs).
  if (first >= 0 && grads.size() > 1) {
    std::vector<mx::array> others;
    for (int i = 0; i < static_cast<int>(grads.size()); ++i) {
      if (i != first) {
        others.push_back(grads[i]);
      }
    }
    grads[first] = after(grads[first], others, s);
  }
  return grads;
}

std::vector<mx::array> Matmul::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto cdt = a.dtype();
  bool native = cdt == mx::bfloat16;
  auto shape = out_shape(a.shape(), b.shape(), trans_a_, trans_b_, batched_);
  // Tangents are summed in float32 and given the output's dtype.
  std::optional<mx::array> t;
  for (size_t i = 0; i < argnums.size(); ++i) {
    auto tan = tangents[i];
    mx::array ti = tan;
    if (argnums[i] == 0) {
      ti = matmul(mx::astype(tan, cdt, s), b, std::nullopt, trans_a_, trans_b_, false,
                  mx::float32, batched_, native, s);
    } else if (argnums[i] == 1) {
      ti = matmul(a, mx::astype(tan, cdt, s), std::nullopt, trans_a_, trans_b_, false,
                  mx::float32, batched_, native, s);
    } else {
      ti = mx::broadcast_to(mx::astype(tan, mx::float32, s), shape, s);
    }
    t = t ? mx::add(*t, ti, s) : ti;
  }
  std::optional<mx::array> bias;
  if (has_bias_) {
    bias = primals[2];
  }
  if (relu_) {
    auto y = matmul(a, b, bias, trans_a_, trans_b_, false, mx::float32, batched_, native, s);
    t = mx::where(mx::greater(y, mx::array(0.0f), s), *t, mx::array(0.0f), s);
  }
  return {mx::astype(*t, out_dtype_, s)};
}

// ---- relu_grad ------------------------------------------------------------------------

mx::array relu_grad(const mx::array& g, const mx::array& y, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  auto ok = [](mx::Dtype d) { return d == mx::float32 || d == mx::bfloat16; };
  if (g.shape() != y.shape() || !ok(g.dtype()) || !ok(y.dtype())) {
    // Anything else (never built by Matmul::vjp): MLX's ops.
    auto mask = mx::greater(y, mx::array(0.0f, y.dtype()), stream);
    return mx::where(mask, g, mx::array(0.0f, g.dtype()), stream);
  }
  return mx::array(g.shape(), g.dtype(), std::make_shared<ReluGrad>(stream), {g, y});
}

namespace {


// Branch-free (a mask of the bits: random signs would mispredict a branch half the time),
// so that the compiler vectorises it.
template <typename G, typename Y>
void relu_grad_loop(const G* g, const Y* y, G* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    out[i] = g[i] & static_cast<G>(G(0) - static_cast<G>(positive(y[i])));
  }
}

} // namespace

void ReluGrad::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // A flat pass: operands not row-contiguous are copied first (references otherwise, so that
  // the cotangent stays donatable).
  auto& encoder = mx::cpu::get_command_encoder(stream());
  std::optional<mx::array> g_copy, y_copy;
  if (!inputs[0].flags().row_contiguous) {
    g_copy = row_contiguous_copy(inputs[0], encoder);
  }
  if (!inputs[1].flags().row_contiguous) {
    y_copy = row_contiguous_copy(inputs[1], encoder);
  }
  const mx::array& g = g_copy ? *g_copy : inputs[0];
  const mx::array& y = y_copy ? *y_copy : inputs[1];
  // The cotangent's buffer is reused when nothing else holds it, as MLX's elementwise ops
  // do (an elementwise pass can run in place): a new buffer per layer would raise the peak
  // of a backward pass that MLX's scheduler queues ahead.
  if (!g_copy && g.is_donatable() && g.itemsize() == out.itemsize() &&
      g.buffer_size() <= out.nbytes() + 16384) {
    out.copy_shared_buffer(g);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  size_t n = out.size();
  const void* pg = g.data<void>();
  const void* py = y.data<void>();
  void* po = out.data<void>();
  bool g16 = g.dtype() == mx::bfloat16, y16 = y.dtype() == mx::bfloat16;
  encoder.dispatch([pg, py, po, n, g16, y16]() {
    if (g16 && y16) {
      relu_grad_loop(static_cast<const uint16_t*>(pg), static_cast<const uint16_t*>(py),
                     static_cast<uint16_t*>(po), n);
    } else if (g16) {
      relu_grad_loop(static_cast<const uint16_t*>(pg), static_cast<const uint32_t*>(py),
                     static_cast<uint16_t*>(po), n);
    } else if (y16) {
      relu_grad_loop(static_cast<const uint32_t*>(pg), static_cast<const uint16_t*>(py),
                     static_cast<uint32_t*>(po), n);
    } else {
      relu_grad_loop(static_cast<const uint32_t*>(pg), static_cast<const uint32_t*>(py),
                     static_cast<uint32_t*>(po), n);
    }
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> ReluGrad::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  // Elementwise: both operands with the mapped axis in front, broadcast where one lacks it.
  auto s = stream();
  auto g = axes[0] >= 0 ? mx::moveaxis(inputs[0], axes[0], 0, s) : inputs[0];
  auto y = axes[1] >= 0 ? mx::moveaxis(inputs[1], axes[1], 0, s) : inputs[1];
  if (axes[0] < 0) {
    g = mx::broadcast_to(mx::expand_dims(g, 0, s), y.shape(), s);
  }
  if (axes[1] < 0) {
    y = mx::broadcast_to(mx::expand_dims(y, 0, s), g.shape(), s);
  }
  return {{relu_grad(g, y, s)}, {0}};
}

void ReluGrad::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("fluxlike_native.relu_grad has no GPU kernel");
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

// ---- after ----------------------------------------------------------------------------

mx::array after(const mx::array& x, const std::vector<mx::array>& deps, mx::StreamOrDevice s) {
  if (deps.empty()) {
    return x;
  }
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), deps.begin(), deps.end());
  return mx::array(
      x.shape(), x.dtype(), std::make_shared<After>(mx::to_stream(s)), std::move(inputs));
}

std::pair<std::vector<mx::array>, std::vector<int>> After::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  std::vector<mx::array> deps(inputs.begin() + 1, inputs.end());
  if (axes[0] >= 0) {
    return {{after(inputs[0], deps, s)}, {axes[0]}};
  }
  int size = 1;
  for (size_t i = 1; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      size = inputs[i].shape(axes[i]);
    }
  }
  auto shape = inputs[0].shape();
  shape.insert(shape.begin(), size);
  auto x = mx::broadcast_to(mx::expand_dims(inputs[0], 0, s), shape, s);
  return {{after(x, deps, s)}, {0}};
}

void After::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
}

void After::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
}

std::vector<mx::array> After::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    grads.push_back(arg == 0 ? cotangents[0] : mx::zeros_like(primals[arg], stream()));
  }
  return grads;
}

std::vector<mx::array> After::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == 0) {
      return {tangents[i]};
    }
  }
  return {mx::zeros_like(primals[0], stream())};
}

} // namespace fluxlike_native
