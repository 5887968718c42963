// fluxlike-native: packed weights and the product that reads them (see packed.h).

#include "packed.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cache.h"
#include "common.h"
#include "cpu.h"
#include "matmul.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "relu.h"

namespace fluxlike_native {

// The packed layout of (in, out) bfloat16 weights and the reorder into it from a linear
// layer's (out, in) row-major weights (see layout() below).
struct PackedLayout {
  dnnl::memory::desc plain, packed;
  dnnl::reorder reorder;
};

namespace {

const char* FN = "fluxlike_native.pack_weights";
const char* LINEAR_FN = "fluxlike_native.packed_linear";
constexpr uintptr_t LINE = 64;

// The layout for (in, out) weights; none where the kernel's preferred layout is the plain one
// or its kernel is not brgemm. Made once per shape, kept for the process.
std::shared_ptr<const PackedLayout> layout(int64_t in, int64_t out) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const PackedLayout>> layouts;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(in, out);
  auto found = layouts.find(key);
  if (found != layouts.end()) {
    return found->second;
  }
  std::shared_ptr<const PackedLayout> made;
  using tag = dnnl::memory::format_tag;
  auto bf16 = dnnl::memory::data_type::bf16;
  auto& eng = engine();
  // (The row count does not change the layout; 128 rows, as a batch's.)
  dnnl::memory::desc a({128, in}, bf16, tag::ab), y({128, out}, bf16, tag::ab);
  dnnl::memory::desc any({in, out}, bf16, tag::any), plain({in, out}, bf16, tag::ba);
  try {
    dnnl::matmul::primitive_desc pd(engine(), a, any, y, user_scratchpad());
    auto packed = pd.weights_desc();
    std::string impl = pd.impl_info_str();
    if (packed != plain && packed != dnnl::memory::desc({in, out}, bf16, tag::ab) &&
        impl.rfind("brg", 0) == 0) {
      made = std::make_shared<const PackedLayout>(
          PackedLayout{plain, packed,
                 dnnl::reorder(dnnl::reorder::primitive_desc(eng, plain, eng, packed))});
    }
  } catch (const dnnl::error&) {
    // no bfloat16 matmul here: nothing packed
  }
  layouts.emplace(key, made);
  return made;
}

// The packed bytes start at the first cache line's boundary after the array's first byte,
// which holds their offset (1 to 64): read back from any copy of the array (one MLX made
// elsewhere, `packed + 0`), whose buffer sits at another address.
void* packed_at(void* p) {
  auto at = reinterpret_cast<uintptr_t>(p);
  auto offset = static_cast<uint8_t>((at + LINE) / LINE * LINE - at);  // 1..64
  *static_cast<uint8_t*>(p) = offset;
  return static_cast<char*>(p) + offset;
}

const void* packed_in(const void* p) {
  return static_cast<const char*>(p) + *static_cast<const uint8_t*>(p);
}

// The product's primitive for `rows` rows reading the packed weights (DNNL_RUNTIME_DIM_VAL:
// for any row count, made for `one_thread`'s thread count).
std::shared_ptr<const Prepared> lookup(int64_t rows, int64_t in, int64_t out,
                                       const std::shared_ptr<const PackedLayout>& l,
                                       mx::Dtype out_dt, std::optional<mx::Dtype> bias_dt,
                                       std::optional<bool> one_thread = std::nullopt) {
  CacheKey key{-7, rows, in, out, static_cast<int64_t>(out_dt.val()),
               bias_dt ? static_cast<int64_t>(bias_dt->val()) : -1, one_thread.value_or(-1)};
  return cached<Prepared>(Op::Matmul, std::move(key), LINEAR_FN, "packed matmul", [&] {
    dnnl::memory::desc a({rows, in}, dnnl::memory::data_type::bf16, dnnl::memory::dims{in, 1});
    dnnl::memory::desc y({rows, out}, dnnl_type(out_dt, LINEAR_FN), dnnl::memory::dims{out, 1});
    return prepared_matmul(a, l->packed, bias_dt, y, LINEAR_FN, one_thread);
  });
}

} // namespace

std::optional<mx::array> pack_weights(const mx::array& w, mx::StreamOrDevice s) {
  FLN_CHECK(w.ndim() == 2 && w.dtype() == mx::bfloat16, FN, ": expected a linear layer's 2-D "
            "bfloat16 weights (out, in), got shape ", shape_str(w.shape()), " and dtype ",
            dtype_str(w.dtype()));
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU, the stream "
            "is on the GPU");
  if (w.size() == 0 || !isa_has_bf16()) {
    return std::nullopt;
  }
  auto l = layout(w.shape(1), w.shape(0));
  if (!l) {
    return std::nullopt;
  }
  size_t size = l->packed.get_size() + LINE;
  if (size > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return std::nullopt;  // (an MLX shape is int32: such weights keep the plain product)
  }
  auto bytes = static_cast<int>(size);
  return mx::array({bytes}, mx::uint8, std::make_shared<PackWeights>(stream, bytes, l), {w});
}

void PackWeights::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor w(inputs[0], encoder);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([l = layout_, src = const_cast<void*>(w->data<void>()),
                    dst = out.data<void>()]() {
    dnnl::stream strm(engine());
    auto& eng = engine();
    dnnl::memory from(l->plain, eng, src);
    dnnl::memory to(l->packed, eng, packed_at(dst));
    l->reorder.execute(strm, from, to);
    strm.wait();
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> PackWeights::vmap(
    const std::vector<mx::array>&, const std::vector<int>&) {
  throw std::invalid_argument(std::string(FN) + ": packed weights cannot be vmapped; vmap the "
                              "plain product (fluxlike_native.matmul)");
}

std::vector<mx::array> PackWeights::vjp(const std::vector<mx::array>& primals,
                                        const std::vector<mx::array>&,
                                        const std::vector<int>& argnums,
                                        const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (size_t i = 0; i < argnums.size(); ++i) {  // (a constant of w, see packed.h)
    grads.push_back(mx::zeros_like(primals[0], stream()));
  }
  return grads;
}

std::vector<mx::array> PackWeights::jvp(const std::vector<mx::array>&,
                                        const std::vector<mx::array>&, const std::vector<int>&) {
  return {mx::zeros({bytes_}, mx::uint8, stream())};
}

mx::array packed_linear(const mx::array& x, const mx::array& w,
                        const std::optional<mx::array>& bias, const mx::array& packed,
                        bool relu, mx::Dtype out_dtype, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(x.dtype() == mx::bfloat16 && w.dtype() == mx::bfloat16 && w.ndim() == 2 &&
            x.ndim() >= 1 && x.shape(-1) == w.shape(1), LINEAR_FN, ": expected bfloat16 x "
            "(..., in) and w (out, in), got x ", shape_str(x.shape()), " ", dtype_str(x.dtype()),
            " and w ", shape_str(w.shape()), " ", dtype_str(w.dtype()));
  auto l = layout(w.shape(1), w.shape(0));
  FLN_CHECK(l && packed.dtype() == mx::uint8 && packed.ndim() == 1 &&
            packed.size() == l->packed.get_size() + LINE, LINEAR_FN, ": packed must be "
            "fluxlike_native.pack_weights(w), got shape ", shape_str(packed.shape()), " ",
            dtype_str(packed.dtype()));
  FLN_CHECK(out_dtype == mx::bfloat16 || out_dtype == mx::float32, LINEAR_FN, ": out_dtype "
            "must be bfloat16 or float32, got ", dtype_str(out_dtype));
  if (bias) {
    FLN_CHECK(bias->ndim() == 1 && bias->shape(0) == w.shape(0) &&
              (bias->dtype() == mx::bfloat16 || bias->dtype() == mx::float32), LINEAR_FN,
              ": bias must be bfloat16 or float32 of shape (", w.shape(0), ",), got ",
              shape_str(bias->shape()), " ", dtype_str(bias->dtype()));
  }
  FLN_CHECK(stream.device == mx::Device::cpu, LINEAR_FN, ": oneDNN kernels run on the CPU, the "
            "stream is on the GPU");
  if (x.size() == 0) {  // (no rows: the plain product's own way)
    return matmul(x, w, bias, false, true, relu, out_dtype, false, true, stream);
  }
  mx::Shape shape(x.shape().begin(), x.shape().end() - 1);
  shape.push_back(w.shape(0));
  std::vector<mx::array> inputs{x, w};
  if (bias) {
    inputs.push_back(*bias);
  }
  inputs.push_back(packed);
  return mx::array(shape, out_dtype,
                   std::make_shared<PackedLinear>(stream, bias.has_value(), relu, out_dtype, l),
                   std::move(inputs));
}

void PackedLinear::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  set_aligned_data(out);  // (the next product's source, read in place)
  if (out.size() == 0) {
    return;
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor x(inputs[0], encoder);
  const auto& w = inputs[1];
  const auto& packed = inputs.back();
  std::optional<RowMajor> bias;
  std::optional<mx::Dtype> bias_dt;
  if (has_bias_) {
    bias.emplace(inputs[2], encoder);
    bias_dt = inputs[2].dtype();
  }
  int64_t in = w.shape(1), n_out = w.shape(0);
  int64_t rows = in == 0 ? 0 : static_cast<int64_t>(x->size()) / in;
  auto chosen = any_rows(rows, [&] {
    return lookup(rows, in, n_out, layout_, out.dtype(), bias_dt);
  }, [&] {
    bool one = one_thread_for(static_cast<double>(rows) * in * n_out, true);
    return lookup(DNNL_RUNTIME_DIM_VAL, in, n_out, layout_, out.dtype(), bias_dt, one);
  });
  for (const auto& i : inputs) {
    encoder.set_input_array(i);
  }
  encoder.set_output_array(out);
  encoder.dispatch([entry = chosen.entry, actual = chosen.actual(),
                    pa = const_cast<void*>(x->data<void>()), a_bytes = x->nbytes(),
                    pw = packed.data<void>(),
                    pbias = bias ? const_cast<void*>((*bias)->data<void>()) : nullptr,
                    pdst = out.data<void>(), relu = relu_, odt = out.dtype(),
                    n = out.size()]() {
    run_product(*entry, pa, a_bytes, const_cast<void*>(packed_in(pw)), pbias, pdst, LINEAR_FN,
                actual);
    if (relu) {
      relu_keeping_nan(pdst, n, odt);
    }
  });
}

mx::array PackedLinear::plain(const std::vector<mx::array>& inputs) {
  std::optional<mx::array> bias;
  if (has_bias_) {
    bias = inputs[2];
  }
  return matmul(inputs[0], inputs[1], bias, false, true, relu_, out_dtype_, false, true,
                stream());
}

std::vector<mx::Shape> PackedLinear::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape(inputs[0].shape().begin(), inputs[0].shape().end() - 1);
  shape.push_back(inputs[1].shape(0));
  return {shape};
}

bool PackedLinear::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const PackedLinear&>(other);
  return has_bias_ == o.has_bias_ && relu_ == o.relu_ && out_dtype_ == o.out_dtype_;
}

std::pair<std::vector<mx::array>, std::vector<int>> PackedLinear::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  FLN_CHECK(axes.back() < 0, LINEAR_FN, ": packed weights cannot be vmapped; vmap the plain "
            "product (fluxlike_native.matmul)");
  std::vector<mx::array> operands(inputs.begin(), inputs.end() - 1);
  std::vector<int> op_axes(axes.begin(), axes.end() - 1);
  // The plain product's primitive, made for one member's operands (placeholders of their
  // shapes, never evaluated), maps them as it maps its own.
  std::vector<mx::array> member;
  for (size_t i = 0; i < operands.size(); ++i) {
    auto shape = operands[i].shape();
    if (op_axes[i] >= 0) shape.erase(shape.begin() + op_axes[i]);
    member.push_back(mx::zeros(shape, operands[i].dtype(), stream()));
  }
  auto prim = plain(member).primitive_ptr();
  return prim->vmap(operands, op_axes);
}

std::vector<mx::array> PackedLinear::vjp(const std::vector<mx::array>& primals,
                                         const std::vector<mx::array>& cotangents,
                                         const std::vector<int>& argnums,
                                         const std::vector<mx::array>& outputs) {
  std::vector<mx::array> operands(primals.begin(), primals.end() - 1);
  std::vector<int> plain_args;
  for (int a : argnums) {
    if (a < static_cast<int>(operands.size())) plain_args.push_back(a);
  }
  std::vector<mx::array> plain_grads;
  if (!plain_args.empty()) {
    auto prim = plain(operands).primitive_ptr();
    plain_grads = prim->vjp(operands, cotangents, plain_args, outputs);
  }
  std::vector<mx::array> grads;
  size_t next = 0;
  for (int a : argnums) {
    grads.push_back(a < static_cast<int>(operands.size())
                        ? plain_grads[next++]
                        : mx::zeros_like(primals.back(), stream()));
  }
  return grads;
}

std::vector<mx::array> PackedLinear::jvp(const std::vector<mx::array>& primals,
                                         const std::vector<mx::array>& tangents,
                                         const std::vector<int>& argnums) {
  std::vector<mx::array> operands(primals.begin(), primals.end() - 1);
  std::vector<int> plain_args;
  std::vector<mx::array> plain_tangents;
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] < static_cast<int>(operands.size())) {
      plain_args.push_back(argnums[i]);
      plain_tangents.push_back(tangents[i]);
    }
  }
  if (plain_args.empty()) {
    return {mx::zeros(output_shapes(primals)[0], out_dtype_, stream())};
  }
  auto prim = plain(operands).primitive_ptr();
  return prim->jvp(operands, plain_tangents, plain_args);
}

} // namespace fluxlike_native
