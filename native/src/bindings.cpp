// fluxlike-native: the Python module fluxlike_native._ext.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cache.h"
#include "common.h"
#include "conv.h"
#include "cpu.h"
#include "finite.h"
#include "matmul.h"
#include "packed.h"
#include "mlx/version.h"
#include "pool.h"
#include "relu.h"
#include "bias.h"
#include "cast.h"
#include "gelu.h"
#include "logistic.h"
#include "softmax.h"
#include "updates.h"

namespace nb = nanobind;
using namespace nb::literals;

#define FLN_STR2(x) #x
#define FLN_STR(x) FLN_STR2(x)

namespace {

using fluxlike_native::Op;

nb::dict counts_dict(const fluxlike_native::CacheCounts& c) {
  nb::dict d;
  d["size"] = c.size;
  d["hits"] = c.hits;
  d["misses"] = c.misses;
  d["creations"] = c.creations;
  d["evictions"] = c.evictions;
  d["create_ns"] = c.create_ns;
  d["work_bytes"] = c.work_bytes;
  return d;
}

nb::dict cache_info() {
  auto info = fluxlike_native::primitive_cache().info();
  nb::dict d = counts_dict(info.total);
  d["capacity"] = info.capacity;
  d["pending"] = fluxlike_native::creator().pending();
  nb::dict ops;
  for (int i = 0; i < fluxlike_native::OP_COUNT; ++i) {
    ops[fluxlike_native::op_name(static_cast<Op>(i))] = counts_dict(info.ops[i]);
  }
  d["ops"] = ops;
  return d;
}

uint64_t op_size(Op op) {
  return fluxlike_native::primitive_cache().info().ops[static_cast<int>(op)].size;
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "oneDNN kernels as MLX primitives for fluxlike (CPU). Use fluxlike.native.";

  m.attr("built_mlx_version") = FLN_STR(MLX_VERSION_MAJOR) "." FLN_STR(
      MLX_VERSION_MINOR) "." FLN_STR(MLX_VERSION_PATCH);
  m.def("runtime_mlx_version", []() { return std::string(mx::version()); },
        "The version libmlx reports in this process.");
  m.def("cpu_isa", &fluxlike_native::cpu_isa,
        "oneDNN's effective CPU ISA (respects ONEDNN_MAX_CPU_ISA).");
  m.def("isa_has_bf16", &fluxlike_native::isa_has_bf16,
        "Whether oneDNN has bfloat16 dot-product kernels here (avx512_core_bf16 or better).");
  m.def("isa_has_fp16", &fluxlike_native::isa_has_fp16,
        "Whether oneDNN has float16 kernels here (AVX512-FP16: avx512_core_fp16 or better).");
  m.def("native_f16", &fluxlike_native::native_f16,
        "Whether float16 products run in oneDNN's float16 kernels (isa_has_fp16() unless "
        "set_native_f16(False)).");
  m.def("set_native_f16", &fluxlike_native::set_native_f16, "on"_a,
        "Whether float16 products may run in oneDNN's float16 kernels (else in its float32 "
        "kernels, upcast); returns the old setting.");
  m.def("isa_has_avx512", &fluxlike_native::isa_has_avx512,
        "Whether oneDNN has AVX-512 kernels here.");
  m.def("onednn_version", &fluxlike_native::onednn_version, "oneDNN's version.");
  // The one primitive cache of all ops (cache.h); the per-op functions before cache_info
  // stay for the callers written against them.
  m.def("cache_info", &cache_info,
        R"(The primitive cache's counts: a dict of size, capacity, hits, misses, creations,
evictions, create_ns (time spent creating primitives) and work_bytes (the temporary memory
one execution of each cached primitive allocates, summed), and "ops": the same counts but
capacity per op ("matmul", "conv", "softmax", "max_pool").)");
  m.def(
      "set_cache_capacity",
      [](int64_t capacity) {
        FLN_CHECK(capacity >= 0, "fluxlike_native.set_cache_capacity: the capacity must be a "
                  "number of entries >= 0 (0 keeps none), got ", capacity);
        return fluxlike_native::primitive_cache().set_capacity(static_cast<size_t>(capacity));
      },
      "capacity"_a,
      "Set how many primitives the cache keeps (least recently used evicted first); returns "
      "the old capacity.");
  m.def(
      "set_single_thread_macs",
      [](double macs) {
        FLN_CHECK(macs >= 0, "fluxlike_native.set_single_thread_macs: the threshold must be a "
                  "number of multiply-adds >= 0 (0: every kernel on OpenMP's threads), got ",
                  macs);
        double old = fluxlike_native::set_single_thread_macs(macs);
        nb::gil_scoped_release release;  // (clearing waits for the worker's creations)
        fluxlike_native::primitive_cache().clear();  // entries keep their creation's threads
        return old;
      },
      "macs"_a,
      "Set the size (multiply-adds; for pooling, compared entries) below which a kernel runs "
      "on one OpenMP thread; returns the old one. Clears the primitive cache.");
  m.def("single_thread_macs", &fluxlike_native::single_thread_macs,
        "The size (multiply-adds) below which a kernel runs on one OpenMP thread.");
  m.def(
      "clear_cache",
      []() {
        nb::gil_scoped_release release;  // (it waits for the worker's creations)
        fluxlike_native::primitive_cache().clear();
      },
        "Drop the cached oneDNN primitives (matmul, convolution, softmax and pooling) and "
        "zero the cache's counts.");
  m.def("set_background_creation", &fluxlike_native::set_background_creation, "on"_a,
        "Whether a deferrable shape's primitive is queued on a worker thread at its third use "
        "(uses_without_primitive; that call and the earlier ones run without it, the next "
        "uses it) (True, the default) or created on the evaluating thread at that use; returns "
        "the old setting.");
  m.def("background_creation", &fluxlike_native::background_creation,
        "Whether primitives are created on a worker thread (set_background_creation).");
  m.def(
      "set_uses_without_primitive",
      [](int uses) {
        FLN_CHECK(uses >= 2, "fluxlike_native.set_uses_without_primitive: uses must be at "
                  "least 2 (a shape's first use never waits for a creation), got ", uses);
        return fluxlike_native::set_uses_without_primitive(uses);
      },
      "uses"_a,
      "Sets how many uses of a deferrable shape run without its primitive (default 3): its "
      "creation is queued at the last of them, the next use runs it; returns the old count.");
  m.def("uses_without_primitive", &fluxlike_native::uses_without_primitive,
        "How many uses of a deferrable shape run without its primitive "
        "(set_uses_without_primitive).");
  // The worker stopped (after the creation it runs) when Python exits, before anything is
  // torn down: a C atexit handler comes after MLX's and oneDNN's later statics are gone.
  m.def("_stop_creator", []() {
    nb::gil_scoped_release release;
    fluxlike_native::stop_creator();
  });
  nb::module_::import_("atexit").attr("register")(m.attr("_stop_creator"));
  m.def(
      "wait_for_creations",
      []() {
        nb::gil_scoped_release release;
        fluxlike_native::creator().wait();
      },
      "Block until the worker thread has created every primitive queued so far.");
  m.def("cache_size", []() { return op_size(Op::Matmul); }, "Cached oneDNN matmul primitives.");
  m.def("cache_impls", []() { return fluxlike_native::primitive_cache().impls(Op::Matmul); },
        "(oneDNN implementation name, count) of the cached matmul primitives.");
  m.def("conv_cache_size", []() { return op_size(Op::Conv); },
        "Cached oneDNN convolution primitives.");
  m.def("conv_cache_impls", []() { return fluxlike_native::primitive_cache().impls(Op::Conv); },
        "(oneDNN implementation name, count) of the cached convolution primitives.");
  m.def("softmax_cache_size", []() { return op_size(Op::Softmax); },
        "Cached oneDNN softmax primitives.");
  m.def("pool_cache_size", []() { return op_size(Op::MaxPool); },
        "Cached oneDNN pooling primitives.");
  m.def("pool_cache_impls",
        []() { return fluxlike_native::primitive_cache().impls(Op::MaxPool); },
        "(oneDNN implementation name, count) of the cached pooling primitives.");

  m.def(
      "matmul",
      [](const mx::array& a, const mx::array& b, const std::optional<mx::array>& bias,
         bool trans_a, bool trans_b, bool relu, std::optional<mx::Dtype> out_dtype,
         bool batched, bool native_bf16, std::optional<mx::Dtype> compute_dtype,
         bool rounded, mx::StreamOrDevice s) {
        return fluxlike_native::matmul(a, b, bias, trans_a, trans_b, relu, out_dtype, batched,
                                       native_bf16, s, compute_dtype, rounded);
      },
      "a"_a,
      "b"_a,
      "bias"_a = nb::none(),
      "trans_a"_a = false,
      "trans_b"_a = false,
      "relu"_a = false,
      "out_dtype"_a = nb::none(),
      "batched"_a = false,
      "native_bf16"_a = true,
      nb::kw_only(),
      "compute_dtype"_a = nb::none(),
      "rounded"_a = false,
      "stream"_a = nb::none(),
      R"(act(op(a) @ op(b) + bias) on oneDNN, as one MLX primitive (see matmul.h);
compute_dtype fuses casts of float32 operands to it into the product.)");

  m.def(
      "set_matmul_mode",
      [](const std::string& mode) -> std::string {
        using fluxlike_native::MatmulMode;
        static const char* names[] = {"auto", "primitive", "gemm", "reused"};
        int i = 0;
        while (i < 4 && mode != names[i]) {
          ++i;
        }
        FLN_CHECK(i < 4, "fluxlike_native.set_matmul_mode: mode must be 'auto', 'primitive', "
                  "'gemm' or 'reused', got '", mode, "'");
        return names[static_cast<int>(fluxlike_native::set_matmul_mode(MatmulMode(i)))];
      },
      "mode"_a,
      R"(How unbatched float32 products run, process-wide; returns the old mode. 'gemm': on
oneDNN's GEMM without a primitive, any row count; 'reused': a shape's first uses on that GEMM,
a cached primitive from its fourth (queued on the creator's thread at its third, cache.h:
uses_without_primitive);
'primitive': a cached primitive per shape from its first use (bfloat16 products too, which
otherwise may run on a primitive for any row count: any_rows_kernel); 'auto' (the default):
'gemm' (see matmul.h).)");
  m.def(
      "matmul_mode",
      []() -> std::string {
        static const char* names[] = {"auto", "primitive", "gemm", "reused"};
        return names[static_cast<int>(fluxlike_native::effective_mode())];
      },
      "The mode unbatched float32 products run in now ('auto' resolved).");
  m.def("direct_gemm", &fluxlike_native::direct_gemm_in_use,
        "Whether unbatched float32 products run on oneDNN's GEMM without a primitive now (in "
        "mode 'auto' on AVX-512, all but forward products of 2**29 multiply-adds or more).");
  m.def("primitive_is_jit_gemm", &fluxlike_native::primitive_is_jit_gemm,
        "Whether oneDNN's float32 matmul primitive is its jit GEMM on this CPU.");
  m.def("any_rows_kernel", &fluxlike_native::any_rows_kernel,
        "Whether bfloat16 products may run on a primitive made for any row count (oneDNN's "
        "runtime dimension; brgemm, on AMX) here and now (not in matmul mode 'primitive').");
  m.def(
      "set_any_rows_min",
      [](int64_t rows) {
        FLN_CHECK(rows >= 1, "fluxlike_native.set_any_rows_min: rows must be at least 1, got ",
                  rows);
        return fluxlike_native::set_any_rows_min(rows);
      },
      "rows"_a,
      "Sets the fewest rows (besides 1) a bfloat16 product runs on its primitive for any row "
      "count with (default 8); returns the old.");
  m.def("any_rows_min", &fluxlike_native::any_rows_min,
        "The fewest rows (besides 1) a bfloat16 product runs on its primitive for any row "
        "count with.");

  m.def(
      "standalone_matmul",
      [](int64_t m, int64_t k, int64_t n, mx::Dtype dtype, bool transposed_b, bool any_layout,
         int reps) {
        nb::gil_scoped_release release;
        auto t = fluxlike_native::standalone_matmul(m, k, n, dtype, transposed_b, any_layout,
                                                    reps);
        return std::make_pair(t.seconds, t.impl);
      },
      "m"_a, "k"_a, "n"_a, "dtype"_a, nb::kw_only(), "transposed_b"_a = true,
      "any_layout"_a = false, "reps"_a = 20,
      R"((seconds, implementation): the fastest of `reps` calls of oneDNN's matmul for an
(m, k) @ (k, n) product in `dtype`, run outside MLX on filled buffers of its own - b stored
transposed as a linear layer's weights are (`transposed_b`), in the plain layout MLX's arrays
have, or reordered once into the layout oneDNN prefers (`any_layout`). The reference that
in-graph products are measured against (bench/matmul.py).)");

  m.def("pack_weights", &fluxlike_native::pack_weights, "w"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(A linear layer's bfloat16 weights w (out, in) reordered into the layout oneDNN's
kernel prefers (a 1-D uint8 array), or None where the plain layout is the kernel's own or no
bfloat16 kernel exists (see packed.h).)");
  m.def("packed_linear", &fluxlike_native::packed_linear, "x"_a, "w"_a, "bias"_a.none(),
        "packed"_a, "relu"_a, "out_dtype"_a, nb::kw_only(), "stream"_a = nb::none(),
        R"(relu?(x @ w.T + bias) for bfloat16 x and w, read from packed = pack_weights(w): the
native bfloat16 product's bits; derivatives and vmap are the plain product's (see packed.h).)");

  m.def(
      "plain_linear",
      [](const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
         bool relu) -> std::optional<mx::array> {
        // fluxlike's everyday float32 layer call, checked here rather than in Python (each
        // check there costs about as much as this whole call's graph construction).
        if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 2 ||
            x.ndim() < 1 || x.shape(-1) != w.shape(1) ||
            mx::default_device().type != mx::Device::DeviceType::cpu) {
          return std::nullopt;
        }
        if (bias && (bias->dtype() != mx::float32 || bias->ndim() != 1 ||
                     bias->shape(0) != w.shape(0))) {
          return std::nullopt;
        }
        return fluxlike_native::matmul(x, w, bias, false, true, relu, std::nullopt, false,
                                       false, {});
      },
      "x"_a, "w"_a, "bias"_a.none(), "relu"_a,
      R"(relu?(x @ w.T + bias) on oneDNN for float32 operands on the CPU (default device),
w (out, in) and bias (out,) or None; None for anything else (the caller's general path).)");

  m.def("gelu", &fluxlike_native::gelu, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        R"(x * Phi(x) (GELU, exact form) in one vectorised pass, float32, bfloat16 or float16
(see gelu.h): MLX's erf approximation, without its cancellation for negative x.)");
  // The logistic primitive's kinds, each one vectorised pass (float32, bfloat16 or float16;
  // see logistic.h).
  struct LogisticBinding {
    const char* name;
    fluxlike_native::Logistic kind;
    const char* doc;
  };
  static constexpr LogisticBinding logistic_bindings[] = {
      {"sigmoid", fluxlike_native::Logistic::Sigmoid,
       "sigmoid(x) as one vectorised pass (float32, bfloat16 or float16; see logistic.h)."},
      {"tanh", fluxlike_native::Logistic::Tanh,
       "tanh(x) as one vectorised pass (float32, bfloat16 or float16; see logistic.h)."},
      {"exp", fluxlike_native::Logistic::Exp,
       "exp(x) as one vectorised pass (float32, bfloat16 or float16; see logistic.h)."},
  };
  for (const auto& b : logistic_bindings) {
    m.def(
        b.name,
        [kind = b.kind](const mx::array& x, mx::StreamOrDevice s) {
          return fluxlike_native::logistic(x, kind, s);
        },
        "x"_a, nb::kw_only(), "stream"_a = nb::none(), b.doc);
  }
  m.def("gelu_grad", &fluxlike_native::gelu_grad, "g"_a, "x"_a, nb::kw_only(),
        "stream"_a = nb::none(), R"(g * gelu'(x), GELU's backward pass (see gelu.h).)");
  m.def(
      "bias_grad",
      [](const mx::array& g, mx::Dtype bias_dt, std::optional<mx::Dtype> round_dt,
         mx::StreamOrDevice s) {
        return fluxlike_native::bias_grad(g, bias_dt, s, round_dt.value_or(mx::float32));
      },
      "g"_a, "bias_dtype"_a, nb::kw_only(), "round_dtype"_a = nb::none(),
      "stream"_a = nb::none(),
        R"(The gradient of a bias added along g's last axis: g summed over its other axes in
float32, rounded to round_dtype, in bias_dtype; as MLX's sum and casts give it (see bias.h).)");
  m.def("convert", &fluxlike_native::convert, "x"_a, "dtype"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(x as dtype, as mx.astype gives it bit for bit, in one vectorised pass between
float32, bfloat16 and float16 on the CPU (mx.astype itself elsewhere; see cast.h).)");
  m.def("relu_grad", &fluxlike_native::relu_grad, "g"_a, "y"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(g where y > 0, else 0, in one pass (a fused ReLU's backward; see matmul.h).)");

  m.def("softmax", &fluxlike_native::softmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        R"(softmax over the last axis of a float32 array on oneDNN (see softmax.h).)");
  m.def("softmax_backward_is_reference", &fluxlike_native::softmax_backward_is_reference,
        "Whether oneDNN's softmax backward pass is its scalar reference implementation here "
        "(below AVX-512): then softmax_grad runs vectorised loops and makes no primitive.");
  m.def("softmax_grad", &fluxlike_native::softmax_grad, "g"_a, "y"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(y * (g - sum(g * y, -1)): the softmax's backward pass on oneDNN (see softmax.h).)");

  m.def("log_sum_exp", &fluxlike_native::log_sum_exp, "x"_a, "top"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(log(sum(exp(x - top))) over the last axis of a float32 array, top of x's shape with
its last axis 1 (the rows' maxima, the caller's): one vectorised pass (see softmax.h).)");
  m.def("log_sum_exp_grad", &fluxlike_native::log_sum_exp_grad, "g"_a, "x"_a, "top"_a, "out"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        R"(g * exp(x - top - out): log_sum_exp's gradient in x (see softmax.h).)");

  m.def(
      "conv",
      [](const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
         std::vector<int> stride, std::vector<int> pad_lo, std::vector<int> pad_hi,
         std::vector<int> dilation, int groups, bool native_bf16, bool relu,
         mx::StreamOrDevice s) {
        fluxlike_native::ConvParams p{std::move(stride), std::move(pad_lo), std::move(pad_hi),
                                      std::move(dilation), groups};
        return fluxlike_native::conv(x, w, bias, p, native_bf16, relu, s);
      },
      "x"_a, "w"_a, "bias"_a, "stride"_a, "pad_lo"_a, "pad_hi"_a, "dilation"_a, "groups"_a,
      "native_bf16"_a, nb::kw_only(), "relu"_a = false, "stream"_a = nb::none(),
      R"(mx.conv_general's convolution (channels-last) on oneDNN (see conv.h).)");

  m.def(
      "conv_backward_data",
      [](const mx::array& dy, const mx::array& w, std::vector<int> x_tail,
         std::vector<int> stride, std::vector<int> pad_lo, std::vector<int> pad_hi,
         std::vector<int> dilation, int groups, bool native_bf16, mx::StreamOrDevice s) {
        fluxlike_native::ConvParams p{std::move(stride), std::move(pad_lo), std::move(pad_hi),
                                      std::move(dilation), groups};
        return fluxlike_native::conv_backward_data(
            dy, w, mx::Shape(x_tail.begin(), x_tail.end()), p, native_bf16, s);
      },
      "dy"_a, "w"_a, "x_tail"_a, "stride"_a, "pad_lo"_a, "pad_hi"_a, "dilation"_a,
      "groups"_a, "native_bf16"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"(The input gradient of conv (a transposed convolution) on oneDNN (see conv.h).)");

  m.def(
      "adam_step",
      [](const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v,
         const mx::array& c1, const mx::array& c2, const std::optional<mx::array>& decay,
         double b1, double b2, double eps, const std::optional<mx::array>& keep,
         mx::StreamOrDevice s) {
        auto out = fluxlike_native::adam_step(p, g, m, v, c1, c2, decay, b1, b2, eps, keep, s);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      "p"_a, "g"_a, "m"_a, "v"_a, "c1"_a, "c2"_a, "decay"_a.none(), "b1"_a, "b2"_a, "eps"_a,
      nb::kw_only(), "keep"_a = nb::none(), "stream"_a = nb::none(),
      R"((p', m', v'): mlx.optimizers.Adam's bias-corrected update of a float32 or bfloat16
parameter in one pass (AdamW's with decay = 1 - lr * weight_decay), bit for bit (see updates.h);
with keep (a 0-d bool), p, m and v themselves where it is false (a skipped step).)");

  m.def(
      "all_finite",
      [](const std::vector<mx::array>& xs, mx::StreamOrDevice s) {
        return fluxlike_native::all_finite(xs, s);
      },
      "xs"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"(A 0-d bool: whether no element of the float32, bfloat16 or float16 arrays xs is inf or
nan, as one primitive (see finite.h).)");
  m.def("keep_if", &fluxlike_native::keep_if, "flag"_a, "taken"_a, "kept"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        R"(flag ? taken : kept for a 0-d bool flag and two arrays of one shape and dtype, taking
over taken's buffer where nothing else holds it (nothing read or written when flag is true;
see finite.h).)");

  m.def(
      "rmsprop_step",
      [](const mx::array& p, const mx::array& g, const mx::array& v, const mx::array& lr,
         double alpha, double eps, mx::StreamOrDevice s) {
        auto out = fluxlike_native::rmsprop_step(p, g, v, lr, alpha, eps, s);
        return std::make_tuple(out[0], out[1]);
      },
      "p"_a, "g"_a, "v"_a, "lr"_a, "alpha"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"((p', v'): mlx.optimizers.RMSprop's update of a float32 or bfloat16 parameter in one
pass, bit for bit (see updates.h).)");

  m.def(
      "max_pool",
      [](const mx::array& x, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> pad_lo, std::vector<int> pad_hi, bool native_bf16,
         mx::StreamOrDevice s) {
        fluxlike_native::PoolParams p{std::move(kernel), std::move(stride), std::move(pad_lo),
                                      std::move(pad_hi)};
        return fluxlike_native::max_pool(x, p, native_bf16, s);
      },
      "x"_a, "kernel"_a, "stride"_a, "pad_lo"_a, "pad_hi"_a, "native_bf16"_a, nb::kw_only(),
      "stream"_a = nb::none(),
      R"(The maximum over each window (channels-last) on oneDNN, with its gradient (see pool.h).)");
}
