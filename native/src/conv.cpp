// fluxlike-native: oneDNN convolution as MLX primitives (forward, backward data, backward
// weights), channels-last activations and MLX's (C_out, *kernel, C_in / groups) weights.
//
// As in matmul.cpp: eval_cpu looks up (or creates) a cached oneDNN primitive for the exact
// shapes, dtypes and parameters, on the evaluating thread, and dispatches its execution to
// MLX's CPU stream. oneDNN picks its own weights layout ("any"); MLX's layout is reordered
// into it (or, for the weights gradient, out of it) inside the same task.

#include "conv.h"

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>

#include "bias.h"
#include "conv_gemm.h"
#include "finite.h"
#include "cache.h"
#include "common.h"
#include "cpu.h"
#include "matmul.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "order.h"
#include "relu.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.conv";
using dims = dnnl::memory::dims;

// MLX's (O, *kernel, I / groups) weights as oneDNN's (O, I, *k) or (G, O/G, I/G, *k).
dnnl::memory::desc weights_md(const mx::Shape& s, int groups, mx::Dtype dt) {
  int k = static_cast<int>(s.size()) - 2;
  int64_t o = s[0], ig = s.back();
  std::vector<int64_t> ksz(s.begin() + 1, s.end() - 1), kst(k);
  int64_t acc = ig;
  for (int i = k - 1; i >= 0; --i) {
    kst[i] = acc;
    acc *= ksz[i];
  }
  dims d, st;
  if (groups > 1) {
    d = {groups, o / groups, ig};
    st = {(o / groups) * acc, acc, 1};
  } else {
    d = {o, ig};
    st = {acc, 1};
  }
  d.insert(d.end(), ksz.begin(), ksz.end());
  st.insert(st.end(), kst.begin(), kst.end());
  return dnnl::memory::desc(d, dnnl_type(dt), st);
}

dnnl::memory::desc any_like(const dnnl::memory::desc& md) {
  return dnnl::memory::desc(md.get_dims(), md.get_data_type(), dnnl::memory::format_tag::any);
}

// The convolution, and where oneDNN's weights layout is not MLX's, the reorder into it (out
// of it, for the weights gradient).
struct ConvPrepared : Prepared {
  std::optional<Prepared> reorder;
  size_t weights_bytes = 0;  // the weights in oneDNN's layout, where reordered
};

dims to_dims(const std::vector<int>& v, int minus = 0) {
  dims d;
  for (int x : v) d.push_back(x - minus);
  return d;
}

// x: (N, *S, C_in) shape; w: weights shape; y: output shape.
std::shared_ptr<const ConvPrepared> lookup(
    ConvKind kind,
    const ConvParams& p,
    const mx::Shape& xs,
    const mx::Shape& ws,
    const mx::Shape& ys,
    mx::Dtype dt,
    std::optional<mx::Dtype> bias_dt,
    bool defer_first = false) {
  // (A fused ReLU runs after the kernel: one primitive serves both.)
  std::vector<int64_t> key{static_cast<int64_t>(kind), static_cast<int64_t>(dt.val()),
                           bias_dt ? static_cast<int64_t>(bias_dt->val()) : -1, p.groups};
  for (auto* s : {&xs, &ws, &ys}) {
    key.push_back(static_cast<int64_t>(s->size()));
    key.insert(key.end(), s->begin(), s->end());
  }
  for (auto* v : {&p.stride, &p.pad_lo, &p.pad_hi, &p.dilation}) {
    key.insert(key.end(), v->begin(), v->end());
  }
  return cached<ConvPrepared>(Op::Conv, std::move(key), FN, "convolution", [&] {
    auto x_md = act_md(xs, dt), y_md = act_md(ys, dt), w_user_md = weights_md(ws, p.groups, dt);
    auto w_any = any_like(w_user_md);
    auto strides = to_dims(p.stride), dil = to_dims(p.dilation, 1);
    auto pl = to_dims(p.pad_lo), pr = to_dims(p.pad_hi);
    auto& eng = engine();
    double macs = static_cast<double>(ws.back());
    for (auto d : ys) macs *= d;
    for (size_t i = 1; i + 1 < ws.size(); ++i) macs *= ws[i];
    OneThread one(one_thread_for(macs, dt == mx::bfloat16));
    auto attr = user_scratchpad();
    // The backward kinds need the forward's description as a hint (the forward kind itself
    // does not: a description is a good part of a creation's time).
    auto fwd_hint = [&] {
      return dnnl::convolution_forward::primitive_desc(
          eng, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_md,
          w_any, y_md, strides, dil, pl, pr);
    };
    auto e = std::make_shared<ConvPrepared>();
    dnnl::memory::desc w_prim_md;
    if (kind == ConvKind::Forward) {
      dnnl::convolution_forward::primitive_desc pd;
      if (bias_dt) {
        dnnl::memory::desc bias_md({ys.back()}, dnnl_type(*bias_dt), dnnl::memory::format_tag::a);
        pd = dnnl::convolution_forward::primitive_desc(
            eng, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_md,
            w_any, bias_md, y_md, strides, dil, pl, pr, attr);
      } else {
        pd = dnnl::convolution_forward::primitive_desc(
            eng, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_md,
            w_any, y_md, strides, dil, pl, pr, attr);
      }
      w_prim_md = pd.weights_desc();
      // (Without a bias, its description is empty and no buffer is passed for it.)
      static_cast<Prepared&>(*e) =
          prepare(pd, {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_BIAS, DNNL_ARG_DST});
    } else if (kind == ConvKind::BackwardData) {
      auto pd = dnnl::convolution_backward_data::primitive_desc(
          eng, dnnl::algorithm::convolution_direct, x_md, w_any, y_md, strides, dil, pl, pr,
          fwd_hint(), attr);
      w_prim_md = pd.weights_desc();
      static_cast<Prepared&>(*e) =
          prepare(pd, {DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_SRC});
    } else {
      auto pd = dnnl::convolution_backward_weights::primitive_desc(
          eng, dnnl::algorithm::convolution_direct, x_md, w_any, y_md, strides, dil, pl, pr,
          fwd_hint(), attr);
      w_prim_md = pd.diff_weights_desc();
      static_cast<Prepared&>(*e) =
          prepare(pd, {DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS});
    }
    if (w_prim_md != w_user_md) {
      bool out = kind == ConvKind::BackwardWeights;  // the gradient out of oneDNN's layout
      e->reorder = prepare(dnnl::reorder::primitive_desc(eng, out ? w_prim_md : w_user_md, eng,
                                                         out ? w_user_md : w_prim_md),
                           {DNNL_ARG_FROM, DNNL_ARG_TO});
      e->weights_bytes = w_prim_md.get_size();
      e->work_bytes += e->weights_bytes;
    }
    return std::shared_ptr<const ConvPrepared>(std::move(e));
  }, defer_first, [&] {
    return std::function<void()>([kind, p, xs, ws, ys, dt, bias_dt] {
      lookup(kind, p, xs, ws, ys, dt, bias_dt);
    });
  });
}

// in0/in1/out as the primitive's inputs and output; see Conv's comment.
void run(const ConvPrepared& e, ConvKind kind, void* in0, void* in1, void* bias, void* out) {
  dnnl::stream strm(engine());
  // The weights (or their gradient) in oneDNN's layout, where it is not MLX's.
  Buffer wtmp(e.weights_bytes, FN, "the reordered weights");
  if (kind == ConvKind::BackwardWeights) {
    void* dw = e.reorder ? wtmp.p : out;
    execute(e, strm, {{DNNL_ARG_SRC, in0}, {DNNL_ARG_DIFF_DST, in1}, {DNNL_ARG_DIFF_WEIGHTS, dw}},
            FN);
    if (e.reorder) {
      execute(*e.reorder, strm, {{DNNL_ARG_FROM, wtmp.p}, {DNNL_ARG_TO, out}}, FN);
    }
    return;
  }
  void* w = in1;
  if (e.reorder) {
    execute(*e.reorder, strm, {{DNNL_ARG_FROM, in1}, {DNNL_ARG_TO, wtmp.p}}, FN);
    w = wtmp.p;
  }
  if (kind == ConvKind::Forward) {
    execute(e, strm, {{DNNL_ARG_SRC, in0}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_BIAS, bias},
                      {DNNL_ARG_DST, out}}, FN);
  } else {
    execute(e, strm, {{DNNL_ARG_DIFF_DST, in0}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DIFF_SRC, out}},
            FN);
  }
}

// A bfloat16 convolution of an odd channel count (one group) in bfloat16 kernels: oneDNN 3.2
// reads bfloat16 channels in pairs, the last with its neighbour (the next pixel's first) times a
// zero weight, so an infinite or NaN neighbour made NaN where MLX gives a finite result. Here
// the operands that carry the channels (x, w) are copied with a zero channel more, the
// primitive is made for c + 1 channels, and a result that carries them (dx, dw) is computed
// with c + 1 and copied out without the last. A 1-channel first layer (images) in float32
// kernels cost twice its bfloat16 time: the widened float32 copies and the rounding of a large
// output.
void copy_channels(const uint16_t* from, size_t from_c, uint16_t* to, size_t to_c, size_t rows) {
  size_t c = std::min(from_c, to_c);
  if (c == 1 && to_c == 2) {  // (an image's one channel: loops the compiler vectorises)
    for (size_t r = 0; r < rows; ++r) to[2 * r] = from[r], to[2 * r + 1] = 0;
    return;
  }
  if (c == 1) {
    for (size_t r = 0; r < rows; ++r) to[r] = from[2 * r];
    return;
  }
  for (size_t r = 0; r < rows; ++r) {
    if (c < 16) {
      for (size_t j = 0; j < c; ++j) to[r * to_c + j] = from[r * from_c + j];
    } else {
      std::memcpy(to + r * to_c, from + r * from_c, c * sizeof(uint16_t));
    }
    if (to_c > c) to[r * to_c + c] = 0;
  }
}

// (The copies in MLX's buffer cache, as Scratch keeps them: a large fresh allocation would be
// mapped and faulted in at every call.)
void run_widened(const ConvPrepared& e, ConvKind kind, void* in0, void* in1, void* bias,
                 void* out, const mx::Shape& xs, const mx::Shape& ws) {
  size_t c = static_cast<size_t>(ws.back()), x_rows = 1, w_rows = 1;
  for (size_t i = 0; i + 1 < xs.size(); ++i) x_rows *= static_cast<size_t>(xs[i]);
  for (size_t i = 0; i + 1 < ws.size(); ++i) w_rows *= static_cast<size_t>(ws[i]);
  size_t x_bytes = x_rows * (c + 1) * sizeof(uint16_t);
  size_t w_bytes = w_rows * (c + 1) * sizeof(uint16_t);
  auto widened = [&](const void* from, size_t rows, Scratch& to) {
    copy_channels(static_cast<const uint16_t*>(from), c, static_cast<uint16_t*>(to.get()), c + 1,
                  rows);
    return to.get();
  };
  auto narrowed = [&](Scratch& from, size_t rows) {
    copy_channels(static_cast<const uint16_t*>(from.get()), c + 1, static_cast<uint16_t*>(out), c,
                  rows);
  };
  if (kind == ConvKind::Forward) {
    Scratch x(x_bytes, FN, "x with a zero channel more");
    Scratch w(w_bytes, FN, "w with a zero channel more");
    run(e, kind, widened(in0, x_rows, x), widened(in1, w_rows, w), bias, out);
  } else if (kind == ConvKind::BackwardData) {
    Scratch w(w_bytes, FN, "w with a zero channel more");
    Scratch dx(x_bytes, FN, "dx with a channel more");
    run(e, kind, in0, widened(in1, w_rows, w), nullptr, dx.get());
    narrowed(dx, x_rows);
  } else {
    Scratch x(x_bytes, FN, "x with a zero channel more");
    Scratch dw(w_bytes, FN, "dw with a channel more");
    run(e, kind, widened(in0, x_rows, x), in1, nullptr, dw.get());
    narrowed(dw, w_rows);
  }
}

// MLX's CPU convolution multiplies its zero padding by the weights where it runs as an explicit
// GEMM (mlx/backend/cpu/conv.cpp, 0.32: kernel dilation 1 and one group, or 1-D): 0 * inf and
// 0 * NaN make NaN in each output whose window reaches into the padding at a weight that is not
// finite. oneDNN skips the padding, as MLX's direct loops do elsewhere. Whether MLX multiplies:
bool padded_(const ConvParams& p) {
  for (size_t a = 0; a < p.stride.size(); ++a) {
    if (p.pad_lo[a] > 0 || p.pad_hi[a] > 0) return true;
  }
  return false;
}

bool mlx_multiplies_padding(const ConvParams& p) {
  bool padded = false, dilated = false;
  for (size_t a = 0; a < p.stride.size(); ++a) {
    padded = padded || p.pad_lo[a] > 0 || p.pad_hi[a] > 0;
    dilated = dilated || p.dilation[a] != 1;
  }
  return padded && !dilated && (p.groups == 1 || p.stride.size() == 1);
}

// Element i of float32, bfloat16 or float16 data as a float, and a float stored there
// (common.h; float16 through the conversion passes, one value at a time: this runs only
// where a weight is not finite, found by a vectorised scan first).
float to_float(const void* p, size_t i, mx::Dtype dt) {
  if (dt == mx::float32) return static_cast<const float*>(p)[i];
  if (dt == mx::bfloat16) return widen(static_cast<const uint16_t*>(p)[i]);
  float f;
  widen_all(static_cast<const uint16_t*>(p) + i, dt, &f, 1);
  return f;
}

void store_float(void* p, size_t i, float f, mx::Dtype dt) {
  if (dt == mx::float32) {
    static_cast<float*>(p)[i] = f;
  } else if (dt == mx::bfloat16) {
    static_cast<uint16_t*>(p)[i] = narrow_keeping_nan(f);
  } else {
    narrow_all(&f, dt, static_cast<uint16_t*>(p) + i, 1);
  }
}

// Where a weight that is not finite meets the padding (a scan of the weights first; nothing
// more where all are finite), the outputs as MLX gives them: NaN where MLX multiplies its
// padding, else the sum over the real entries only (0 * inf left out, as MLX's direct loops
// do; oneDNN's implementations differ in this from one geometry to the next).
struct ConvBuffers {
  const void* x;
  const void* w;
  const void* bias;  // or nullptr
  void* y;
  mx::Dtype dt, bias_dt;  // of x, w and y; of the bias
};

void padding_as_mlx(const ConvBuffers& b, const mx::Shape& xs, const mx::Shape& ws,
                    const mx::Shape& ys, const ConvParams& p) {
  int k = static_cast<int>(ws.size()) - 2;
  int64_t outs = ws[0], per = ws.back(), kn = 1, sn = 1, c_in = xs.back();
  for (int a = 0; a < k; ++a) kn *= ws[a + 1], sn *= ys[a + 1];
  if (all_finite(b.w, static_cast<size_t>(outs * kn * per), b.dt)) {
    return;  // (one vectorised scan: the usual case)
  }
  std::vector<char> bad(static_cast<size_t>(outs * kn), 0);
  bool any = false;
  for (int64_t i = 0; i < outs * kn; ++i) {
    for (int64_t c = 0; c < per; ++c) {
      bad[i] |= static_cast<char>(!std::isfinite(to_float(b.w, i * per + c, b.dt)));
    }
    any = any || bad[i];
  }
  if (!any) return;
  bool multiplies = mlx_multiplies_padding(p);
  float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> at(k), coord(k);
  auto window = [&](int64_t q) {  // the input coordinates of kernel entry q; false: padding
    bool real = true;
    for (int a = k - 1; a >= 0; --a) {
      coord[a] = at[a] * p.stride[a] - p.pad_lo[a] + (q % ws[a + 1]) * p.dilation[a];
      q /= ws[a + 1];
      real = real && coord[a] >= 0 && coord[a] < xs[a + 1];
    }
    return real;
  };
  for (int64_t s = 0; s < sn; ++s) {
    int64_t rest = s;
    for (int a = k - 1; a >= 0; --a) {
      at[a] = rest % ys[a + 1];
      rest /= ys[a + 1];
    }
    for (int64_t o = 0; o < outs; ++o) {
      bool hit = false;
      for (int64_t q = 0; q < kn && !hit; ++q) hit = bad[o * kn + q] && !window(q);
      if (!hit) continue;
      int64_t group = o / (outs / p.groups);
      for (int64_t n = 0; n < ys[0]; ++n) {
        size_t out = static_cast<size_t>((n * sn + s) * outs + o);
        if (multiplies) {
          store_float(b.y, out, nan, b.dt);
          continue;
        }
        float sum = b.bias ? to_float(b.bias, o, b.bias_dt) : 0.0f;
        for (int64_t q = 0; q < kn; ++q) {
          if (!window(q)) continue;
          int64_t off = n;
          for (int a = 0; a < k; ++a) off = off * xs[a + 1] + coord[a];
          for (int64_t c = 0; c < per; ++c) {
            sum += to_float(b.x, off * c_in + group * per + c, b.dt) *
                to_float(b.w, (o * kn + q) * per + c, b.dt);
          }
        }
        store_float(b.y, out, sum, b.dt);
      }
    }
  }
}

mx::Shape conv_out_shape(const mx::Shape& xs, const mx::Shape& ws, const ConvParams& p) {
  int k = static_cast<int>(xs.size()) - 2;
  FLN_CHECK(k >= 1 && k <= 3 && ws.size() == xs.size(), FN, ": expected x (N, *spatial, C_in) "
            "with 1-3 spatial axes and w (C_out, *kernel, C_in / groups) of as many axes, got x ",
            shape_str(xs), " and w ", shape_str(ws));
  for (auto* v : {&p.stride, &p.pad_lo, &p.pad_hi, &p.dilation}) {
    FLN_CHECK(static_cast<int>(v->size()) == k, FN, ": stride, padding and dilation need ", k,
              " values each, got ", vec_str(*v));
  }
  FLN_CHECK(p.groups >= 1 && ws[0] % p.groups == 0 && xs.back() == ws.back() * p.groups, FN,
            ": channels do not match: x ", shape_str(xs), " has ", xs.back(), ", w ",
            shape_str(ws), " takes ", ws.back(), " x groups=", p.groups, " (and C_out ", ws[0],
            " must divide by groups)");
  mx::Shape out{xs[0]};
  for (int i = 0; i < k; ++i) {
    FLN_CHECK(p.stride[i] >= 1 && p.dilation[i] >= 1 && p.pad_lo[i] >= 0 && p.pad_hi[i] >= 0,
              FN, ": stride and dilation must be >= 1 and padding >= 0, got stride ",
              vec_str(p.stride), ", dilation ", vec_str(p.dilation), ", padding ",
              vec_str(p.pad_lo), " / ", vec_str(p.pad_hi));
    int span = xs[i + 1] + p.pad_lo[i] + p.pad_hi[i] - p.dilation[i] * (ws[i + 1] - 1) - 1;
    FLN_CHECK(span >= 0, FN, ": the (dilated) kernel ", shape_str(ws), " is larger than the "
              "padded input ", shape_str(xs), " on spatial axis ", i);
    out.push_back(span / p.stride[i] + 1);
  }
  out.push_back(ws[0]);
  return out;
}

mx::array make(
    ConvKind kind,
    const ConvParams& p,
    const mx::array& in0,
    const mx::array& in1,
    const std::optional<mx::array>& bias,
    mx::Shape shape,
    mx::Shape fixed,
    mx::Stream s,
    bool relu = false,
    bool upcast = false) {
  std::vector<mx::array> inputs{in0, in1};  // (made row-contiguous in eval_cpu where not)
  if (bias) inputs.push_back(*bias);
  auto dt = in0.dtype();
  return mx::array(
      std::move(shape), dt,
      std::make_shared<Conv>(s, kind, p, bias.has_value(), std::move(fixed), relu, upcast),
      std::move(inputs));
}

mx::Shape tail(const mx::Shape& s) {
  return mx::Shape(s.begin() + 1, s.end());
}

// dx of shape (dy.N, *x_tail) from dy and w.
mx::array backward_data(const mx::array& dy, const mx::array& w, const mx::Shape& x_tail,
                        const ConvParams& p, mx::Stream s, bool upcast = false) {
  mx::Shape shape{dy.shape(0)};
  shape.insert(shape.end(), x_tail.begin(), x_tail.end());
  return make(ConvKind::BackwardData, p, dy, w, std::nullopt, shape, x_tail, s, false, upcast);
}

// Whether a kernel tap meets only padding along some spatial axis (no output position puts
// it on an input entry): oneDNN 3.2's bfloat16 weight gradient (Intel Xeon with AMX) wrote
// garbage, even NaN, into such taps' gradients (14 of 760 1-D geometries of 1-5 entries, each
// with such a tap, e.g. x of length 1, kernel 3, padding 1, stride 2; MLX: 0); float32
// kernels compute them.
bool padding_only_tap(const mx::Shape& xs, const mx::Shape& ws, const ConvParams& p) {
  for (size_t a = 0; a < p.stride.size(); ++a) {
    int64_t in = xs[a + 1], k = ws[a + 1], d = p.dilation[a], st = p.stride[a];
    int64_t out = (in + p.pad_lo[a] + p.pad_hi[a] - d * (k - 1) - 1) / st + 1;
    for (int64_t t = 0; t < k; ++t) {
      // input entries o * st - pad_lo + t * d for o in [0, out) never in [0, in)
      int64_t first = t * d - p.pad_lo[a], last = first + (out - 1) * st;
      bool meets = false;
      for (int64_t at = first; at <= last && !meets; at += st) {
        meets = at >= 0 && at < in;
      }
      if (!meets) {
        return true;
      }
    }
  }
  return false;
}

mx::array backward_weights(const mx::array& x, const mx::array& dy, const mx::Shape& wshape,
                           const ConvParams& p, mx::Stream s, bool upcast = false) {
  // (oneDNN 3.2 has no float16 weight gradient but its reference kernel, 100x slower than
  // float32 kernels on the small CNN's layers: float16 always runs in float32 kernels here.)
  upcast = upcast || x.dtype() == mx::float16 ||
      (x.dtype() == mx::bfloat16 && padding_only_tap(x.shape(), wshape, p));
  return make(ConvKind::BackwardWeights, p, x, dy, std::nullopt, wshape, wshape, s, false,
              upcast);
}

mx::array forward(const mx::array& x, const mx::array& w, const std::optional<mx::array>& b,
                  const ConvParams& p, mx::Stream s, bool relu = false, bool upcast = false) {
  return make(ConvKind::Forward, p, x, w, b, conv_out_shape(x.shape(), w.shape(), p), {}, s,
              relu, upcast);
}

} // namespace

mx::array conv(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
               const ConvParams& p, bool native_bf16, bool relu, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU, the stream "
            "is on the GPU; use mx.conv_general there");
  auto dt = x.dtype();
  FLN_CHECK(w.dtype() == dt && float_or_half(dt),
            FN, ": x and w must both be float32, both bfloat16 or both float16, got ",
            x.dtype(), " and ", w.dtype());
  conv_out_shape(x.shape(), w.shape(), p);  // its checks
  if (bias) {
    FLN_CHECK(bias->ndim() == 1 && bias->shape(0) == w.shape(0), FN, ": bias must have shape (",
              w.shape(0), ",), got ", shape_str(bias->shape()));
    FLN_CHECK(bias->dtype() == dt || bias->dtype() == mx::float32, FN, ": bias must be of x's "
              "dtype or float32");
  }
  // oneDNN 3.2's bfloat16 convolution with an odd number of input channels per group reads
  // them in pairs, the last with its neighbour times a zero weight (see run_widened): one
  // group is given a zero channel more inside the primitive; several groups (the neighbour is
  // the next group's first channel) run in float32 kernels.
  bool paired = w.shape().back() % 2 == 1 && p.groups != 1;
  // float16 in oneDNN's float16 kernels where native_f16() (cpu.h), as the products.
  bool upcast = dt == mx::float16 ? !native_f16() : in_float32_kernels(dt, native_bf16 && !paired);
  FLN_CHECK(dt != mx::bfloat16 || upcast || isa_has_bf16(), FN, ": native bfloat16 kernels "
            "were asked for, but oneDNN's CPU ISA is ", cpu_isa(), "; pass native_bf16=False");
  FLN_CHECK(x.size() != 0 && w.size() != 0, FN, ": empty operands (x ", shape_str(x.shape()),
            ", w ", shape_str(w.shape()), "); use mx.conv_general");
  return forward(x, w, bias, p, stream, relu, upcast);
}

mx::array conv_backward_data(const mx::array& dy, const mx::array& w, const mx::Shape& x_tail,
                             const ConvParams& p, bool native_bf16, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  FLN_CHECK(stream.device == mx::Device::cpu, FN, ": oneDNN kernels run on the CPU");
  auto dt = dy.dtype();
  FLN_CHECK(w.dtype() == dt && float_or_half(dt),
            FN, ": dy and w must both be float32, both bfloat16 or both float16, got ",
            dy.dtype(), " and ", w.dtype());
  mx::Shape xs{dy.ndim() > 0 ? dy.shape(0) : 0};
  xs.insert(xs.end(), x_tail.begin(), x_tail.end());
  auto expect = conv_out_shape(xs, w.shape(), p);
  FLN_CHECK(expect == dy.shape(), FN, ": a convolution of an input ", shape_str(xs), " with w ",
            shape_str(w.shape()), " gives ", shape_str(expect), ", not dy's ",
            shape_str(dy.shape()));
  bool upcast = dt == mx::float16 ? !native_f16() : in_float32_kernels(dt, native_bf16);
  FLN_CHECK(dt != mx::bfloat16 || upcast || isa_has_bf16(), FN, ": native bfloat16 kernels "
            "were asked for, but oneDNN's CPU ISA is ", cpu_isa());
  return backward_data(dy, w, x_tail, p, stream, upcast);
}

// A float32 convolution's first uses at a shape run MLX's own convolution: its primitive is
// used from the fourth (queued at the third, cache.h: cached()) (a creation, 0.2-0.5 ms on
// AVX2, costs more than a small convolution itself: an image size seen once or twice would
// pay it whole). MLX's kernel is reached
// through the primitive of the graph node mx::conv_general builds on the same inputs (never
// evaluated as a node: its eval_cpu runs here, on this stream), so that call is what the
// kernels-off path computes, bit for bit, bias and ReLU after it as MLX adds them.
// Up to FIRST_USE_MAX_MACS multiply-adds where MLX runs its explicit GEMM (no dilation, one
// group: to there it cost less than a creation and oneDNN's call over 1-3 spatial axes, 1x1
// to 5x5 kernels, strides 1-2, AMD EPYC Zen 3, bench/results/2026-12-04-first-uses.md;
// above, it can cost several times more, 70 against 14 ms at 2**29, and its im2col temporary
// is the kernel's volume times the input), up to FIRST_USE_MAX_MACS_LOOPS where it runs its
// direct loops (dilated, grouped, depthwise: 10-25 ms against 1 ms at 2**22), float32 only,
// and what MLX's conv_general takes (groups only in one or two spatial axes).
constexpr double FIRST_USE_MAX_MACS = 1 << 23;
constexpr double FIRST_USE_MAX_MACS_LOOPS = 1 << 18;

// A convolution's multiply-adds: its output's size times each output's kernel volume.
double macs_of(const mx::Shape& ws, const mx::Shape& ys) {
  double macs = 1;
  for (auto d : ys) macs *= static_cast<double>(d);
  for (size_t i = 1; i < ws.size(); ++i) macs *= static_cast<double>(ws[i]);
  return macs;
}

bool Conv::first_use_fits(const std::vector<mx::array>& inputs, const mx::array& out) const {
  auto& x = inputs[0];
  auto& w = inputs[1];
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 ||
      (has_bias_ && inputs[2].dtype() != mx::float32) || (p_.groups != 1 && x.ndim() > 4)) {
    return false;
  }
  bool gemm = p_.groups == 1;
  for (int d : p_.dilation) gemm = gemm && d == 1;
  double bound = gemm ? FIRST_USE_MAX_MACS : FIRST_USE_MAX_MACS_LOOPS;
  return macs_of(w.shape(), out.shape()) <= bound;
}

bool Conv::first_use_on_mlx(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  std::vector<int> ones(p_.stride.size(), 1);
  auto ref = mx::conv_general(x, w, p_.stride, p_.pad_lo, p_.pad_hi, p_.dilation, ones,
                              p_.groups, false, stream());
  if (!ref.has_primitive() || std::string(ref.primitive().name()) != "Convolution" ||
      ref.inputs().size() != 2 || ref.inputs()[0].id() != x.id() ||
      ref.inputs()[1].id() != w.id() || ref.shape() != out.shape() ||
      ref.dtype() != out.dtype()) {
    return false;  // (MLX built something else around it: create the primitive instead)
  }
  std::vector<mx::array> outs{out};  // (the same array: a handle on out's data)
  ref.primitive().eval_cpu(ref.inputs(), outs);  // allocates out, dispatches MLX's kernel
  auto& encoder = mx::cpu::get_command_encoder(stream());
  if (has_bias_) {
    encoder.set_input_array(inputs[2]);
  }
  // After MLX's task on this stream: the bias and the ReLU (`ref` is kept with them: the
  // inputs it holds outlive that task whatever MLX's own bookkeeping does).
  encoder.dispatch([ref, y = out.data<float>(), channels = out.shape().back(), n = out.size(),
                    bias = has_bias_ ? inputs[2].data<float>() : nullptr, relu = relu_]() {
    if (bias != nullptr) {
      add_bias_float32(y, bias, n / static_cast<size_t>(channels), static_cast<size_t>(channels));
    }
    if (relu) {
      relu_keeping_nan(y, n, mx::float32);
    }
  });
  return true;
}

// An input of a convolution computed in float32 kernels, as its task reads it.
struct HalfInput {
  const void* data = nullptr;
  size_t size = 0;
  mx::Dtype dtype = mx::float32;
};

HalfInput half_input(const mx::array& x) {
  return {x.data<void>(), x.size(), x.dtype()};
}

// Half precision in float32 kernels: the operands upcast (exactly) into float32 buffers that
// live while the task runs, the float32 kernel `entry` (or, without one, a backward pass's
// GEMM over the patches), and the result rounded once - what astype, a float32 convolution
// and astype compute, in one node.
void in_float32(const ConvPrepared* entry, ConvKind kind, const HalfInput& in0,
                const HalfInput& in1, const HalfInput& bias, void* po, mx::Dtype odt,
                bool relu, size_t n, bool padded, const mx::Shape& xs, const mx::Shape& ws,
                const mx::Shape& ys, const ConvParams& p) {
  Float32Scratch a_copy(in0.size, FN), b_copy(in1.size, FN), bias_copy(bias.size, FN);
  Float32Scratch y_copy(n, FN);
  float *a32 = a_copy.get(), *b32 = b_copy.get(), *bias32 = bias_copy.get();
  float* y = y_copy.get();
  for (auto [from, to] : {std::pair{&in0, a32}, {&in1, b32}, {&bias, bias32}}) {
    if (from->data != nullptr) {
      widen_all(from->data, from->dtype, to, from->size);
    }
  }
  if (entry) {
    run(*entry, kind, a32, b32, bias32, y);
  } else {
    conv_backward_gemm(kind, a32, b32, y, xs, ws, ys, p);
  }
  if (padded) {
    padding_as_mlx({a32, b32, bias32, y, mx::float32, mx::float32}, xs, ws, ys, p);
  }
  if (relu) {
    relu_keeping_nan(y, n, mx::float32);
  }
  narrow_all(y, odt, po, n);
}

void Conv::eval_cpu(const std::vector<mx::array>& operands, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto inputs = row_contiguous_all(operands, encoder);
  auto& in0 = inputs[0];
  auto& in1 = inputs[1];
  std::optional<mx::Dtype> bias_dt;
  if (has_bias_) bias_dt = upcast_ ? mx::float32 : inputs[2].dtype();
  auto dt = upcast_ ? mx::float32 : in0.dtype();  // the kernel's
  std::shared_ptr<const ConvPrepared> entry;
  if (kind_ == ConvKind::Forward && out.size() != 0 && first_use_deferred() &&
      first_use_fits(inputs, out)) {
    entry = lookup(kind_, p_, in0.shape(), in1.shape(), out.shape(), in0.dtype(), bias_dt,
                   /*defer_first=*/true);
    if (!entry && first_use_on_mlx(inputs, out)) {
      return;
    }
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  const mx::Shape* xs;
  const mx::Shape* ws;
  const mx::Shape* ys;
  if (kind_ == ConvKind::Forward) {
    xs = &in0.shape(), ws = &in1.shape(), ys = &out.shape();
  } else if (kind_ == ConvKind::BackwardData) {
    xs = &out.shape(), ws = &in1.shape(), ys = &in0.shape();
  } else {
    xs = &in0.shape(), ws = &out.shape(), ys = &in1.shape();
  }
  bool widen = dt == mx::bfloat16 && p_.groups == 1 && ws->back() % 2 == 1;  // run_widened
  if (!entry) {
    // A backward pass's first uses in float32 kernels (one group, up to FIRST_USE_MAX_MACS)
    // run oneDNN's GEMM over the input's patches (conv_gemm.h) while its primitive is made
    // (queued at its third use, used from the fourth): as cheap as the primitive's call, where
    // a creation costs several of them.
    bool gemm_first = kind_ != ConvKind::Forward && dt == mx::float32 && p_.groups == 1 &&
        first_use_deferred() && macs_of(*ws, *ys) <= FIRST_USE_MAX_MACS;
    if (widen) {
      auto xw = *xs, ww = *ws;
      xw.back() += 1, ww.back() += 1;
      entry = lookup(kind_, p_, xw, ww, *ys, dt, bias_dt);
    } else {
      entry = lookup(kind_, p_, *xs, *ws, *ys, dt, bias_dt, gemm_first);
    }
  }
  void* pbias = has_bias_ ? const_cast<void*>(inputs[2].data<void>()) : nullptr;
  bool upcast = upcast_;
  if (!upcast && dt != mx::float32 && entry && entry->impl.rfind("ref", 0) == 0) {
    // No fast half kernel for this geometry (oneDNN gave its reference implementation, 100x
    // slower): float32 kernels, as a CPU without half kernels runs it.
    upcast = true;
    entry = lookup(kind_, p_, *xs, *ws, *ys, mx::float32,
                   has_bias_ ? std::optional<mx::Dtype>(mx::float32) : std::nullopt);
  }
  if (upcast) {
    encoder.dispatch([entry, kind = kind_, in0 = half_input(in0), in1 = half_input(in1),
                      bias = has_bias_ ? half_input(inputs[2]) : HalfInput{},
                      po = out.data<void>(), odt = out.dtype(), relu = relu_, n = out.size(),
                      padded = kind_ == ConvKind::Forward && padded_(p_), xs = *xs, ws = *ws,
                      ys = *ys, p = p_]() {
      in_float32(entry.get(), kind, in0, in1, bias, po, odt, relu, n, padded, xs, ws, ys, p);
    });
    return;
  }
  encoder.dispatch([entry, kind = kind_, p0 = const_cast<void*>(in0.data<void>()),
                    p1 = const_cast<void*>(in1.data<void>()), pbias, po = out.data<void>(),
                    relu = relu_, odt = out.dtype(), n = out.size(),
                    padded = kind_ == ConvKind::Forward && padded_(p_), xs = *xs, ws = *ws,
                    ys = *ys, p = p_, bias_dt = bias_dt.value_or(mx::float32),
                    x = half_input(in0), w = half_input(in1),
                    b = has_bias_ ? half_input(inputs[2]) : HalfInput{}, widen]() {
    // oneDNN 3.2's AMX convolution reads input entries beside a window's edge times zero
    // weights: an infinite or NaN input made NaN in outputs whose windows do not reach it
    // (where MLX gives a finite result; Intel Xeon with AMX). Its AVX512-BF16 data gradient
    // sums an odd number of a group's output channels in pairs, the last with the next
    // group's or pixel's first times a zero weight: a non-finite cotangent made NaN in its
    // neighbour's gradient (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on that Xeon,
    // tests/native/test_hostile.py). Such an input (a scan of it first) goes through float32
    // kernels, as a CPU without half kernels runs it; float16 too (its AMX kernels, on
    // AMX-FP16 CPUs, were not measured: guarded as bfloat16's).
    bool leaks = (entry && entry->amx && kind == ConvKind::Forward) ||
        (kind == ConvKind::BackwardData && (ws.front() / p.groups) % 2 == 1);
    if (entry && leaks && odt != mx::float32 && !all_finite(x.data, x.size, x.dtype)) {
      auto e32 = lookup(kind, p, xs, ws, ys, mx::float32,
                        b.data ? std::optional<mx::Dtype>(mx::float32) : std::nullopt);
      in_float32(e32.get(), kind, x, w, b, po, odt, relu, n, padded, xs, ws, ys, p);
      return;
    }
    if (widen) {
      run_widened(*entry, kind, p0, p1, pbias, po, xs, ws);
    } else if (entry) {
      run(*entry, kind, p0, p1, pbias, po);
    } else {
      conv_backward_gemm(kind, static_cast<const float*>(p0), static_cast<const float*>(p1),
                         static_cast<float*>(po), xs, ws, ys, p);
    }
    if (padded) {
      padding_as_mlx({p0, p1, pbias, po, odt, bias_dt}, xs, ws, ys, p);
    }
    if (relu) {  // after the kernel, keeping NaN (see relu_keeping_nan)
      relu_keeping_nan(po, n, odt);
    }
  });
}

std::vector<mx::Shape> Conv::output_shapes(const std::vector<mx::array>& inputs) {
  if (kind_ == ConvKind::Forward) {
    return {conv_out_shape(inputs[0].shape(), inputs[1].shape(), p_)};
  }
  if (kind_ == ConvKind::BackwardData) {
    mx::Shape s{inputs[0].shape(0)};
    s.insert(s.end(), fixed_.begin(), fixed_.end());
    return {s};
  }
  return {fixed_};
}

bool Conv::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Conv&>(other);
  return kind_ == o.kind_ && p_ == o.p_ && has_bias_ == o.has_bias_ && relu_ == o.relu_ &&
      upcast_ == o.upcast_ && fixed_ == o.fixed_;
}

std::pair<std::vector<mx::array>, std::vector<int>> Conv::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  auto apply = [this, s](const std::vector<mx::array>& in) {
    std::optional<mx::array> bias;
    if (has_bias_) {
      bias = in[2];
    }
    return std::vector<mx::array>{
        make(kind_, p_, in[0], in[1], bias, output_shapes(in)[0], fixed_, s, relu_,
             upcast_)};
  };
  // The batch: x's first axis (Forward), dy's (BackwardData); a weight gradient reduces it.
  std::vector<bool> batched(inputs.size(), false);
  batched[0] = kind_ != ConvKind::BackwardWeights;
  return vmap_rows(inputs, axes, batched, apply, s);
}

std::vector<mx::array> Conv::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto dt = a.dtype();
  // A fused ReLU: relu'(y) is y > 0 on the kept output, one pass (as Matmul::vjp).
  auto g = relu_ ? relu_grad(cotangents[0], outputs[0], s) : cotangents[0];
  auto c = g.dtype() == dt ? g : mx::astype(g, dt, s);
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (kind_ == ConvKind::Forward) {  // y = conv(x, w) + bias
      if (arg == 0) {
        grads.push_back(backward_data(c, b, tail(a.shape()), p_, s, upcast_));
      } else if (arg == 1) {
        grads.push_back(backward_weights(a, c, b.shape(), p_, s, upcast_));
      } else {
        grads.push_back(bias_grad(g, primals[2].dtype(), s));
      }
    } else if (kind_ == ConvKind::BackwardData) {  // dx = conv^T(dy, w)
      grads.push_back(arg == 0 ? forward(c, b, std::nullopt, p_, s, false, upcast_)
                               : backward_weights(c, a, b.shape(), p_, s, upcast_));
    } else {  // dw = bw(x, dy)
      grads.push_back(arg == 0 ? backward_data(b, c, tail(a.shape()), p_, s, upcast_)
                               : forward(a, c, std::nullopt, p_, s, false, upcast_));
    }
  }
  if (kind_ == ConvKind::Forward) {
    order_input_grad(grads, argnums, c.nbytes() + a.nbytes(), s);
  }
  return grads;
}

std::vector<mx::array> Conv::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  auto& a = primals[0];
  auto& b = primals[1];
  auto dt = a.dtype();
  // Upcast, the tangents' convolutions are float32 ones of the exact upcasts, summed in
  // float32 and rounded once (as the casts this primitive replaces give them).
  auto f32 = [&](const mx::array& x) { return upcast_ ? mx::astype(x, mx::float32, s) : x; };
  std::optional<mx::array> t;
  for (size_t i = 0; i < argnums.size(); ++i) {
    auto tan = f32(tangents[i].dtype() == dt ? tangents[i] : mx::astype(tangents[i], dt, s));
    int arg = argnums[i];
    auto a_ = f32(a), b_ = f32(b);
    mx::array ti = tan;
    if (kind_ == ConvKind::Forward) {
      ti = arg == 0 ? forward(tan, b_, std::nullopt, p_, s)
          : arg == 1 ? forward(a_, tan, std::nullopt, p_, s)
                     : tan;
    } else if (kind_ == ConvKind::BackwardData) {
      ti = backward_data(arg == 0 ? tan : a_, arg == 0 ? b_ : tan, fixed_, p_, s);
    } else {
      ti = backward_weights(arg == 0 ? tan : a_, arg == 0 ? b_ : tan, fixed_, p_, s);
    }
    t = t ? mx::add(*t, ti, s) : ti;
  }
  auto out = mx::astype(*t, dt, s);
  if (relu_) {  // the tangent of max(y, 0): masked by the output, recomputed here
    out = relu_grad(out, forward(a, b, has_bias_ ? std::optional<mx::array>(primals[2])
                                                  : std::nullopt, p_, s, true, upcast_), s);
  }
  return {out};
}

} // namespace fluxlike_native
