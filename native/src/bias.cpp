// fluxlike-native: the gradient of a bias (see bias.h).

#include "bias.h"
#include "common.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

namespace {

// The same in MLX's ops: the reference for the derivatives, vmap and the cases the pass
// leaves to MLX (a sum over one column or one row, a GPU stream).
mx::array bias_grad_ops(const mx::array& g, mx::Dtype bias_dt, mx::Dtype round_dt,
                        mx::StreamOrDevice s, int first = 0) {
  std::vector<int> axes;  // (from `first`: a vmapped cotangent's members stay apart)
  for (int i = first; i + 1 < g.ndim(); ++i) {
    axes.push_back(i);
  }
  // (MLX's sum of a half-precision array accumulates in float32 and rounds once: summed in
  // that dtype when it is the one rounded to, without an upcast of the whole cotangent)
  auto summed = g.dtype() == round_dt || (round_dt == mx::float32 && g.dtype() == bias_dt)
                    ? mx::sum(g, axes, false, s)
                    : mx::sum(mx::astype(g, mx::float32, s), axes, false, s);
  if (summed.dtype() != round_dt && round_dt != mx::float32) {
    summed = mx::astype(summed, round_dt, s);
  }
  return summed.dtype() == bias_dt ? summed : mx::astype(summed, bias_dt, s);
}

// A few columns (a small convolution's channels: 16 of 50,000 rows) summed in registers: the
// general loop below stores and reloads each column's sum at every row (it cannot know that
// acc is not x), a dependency through memory that cost 2x.
template <int64_t C>
void add_rows_fixed(const float* __restrict x, int64_t rows, float* __restrict acc) {
  float a[C];
  for (int64_t j = 0; j < C; ++j) a[j] = acc[j];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < C; ++j) a[j] += x[r * C + j];
  }
  for (int64_t j = 0; j < C; ++j) acc[j] = a[j];
}

// rows x cols values of dtype `dt` (row-major) summed down each column into `acc` (float32,
// zeroed), each column's rows added in order.
FLN_VECTOR_CLONES void add_rows(const float* x, int64_t rows, int64_t cols, float* acc) {
  switch (cols) {
    case 8: return add_rows_fixed<8>(x, rows, acc);
    case 16: return add_rows_fixed<16>(x, rows, acc);
    case 32: return add_rows_fixed<32>(x, rows, acc);
    case 64: return add_rows_fixed<64>(x, rows, acc);
    default: break;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (int64_t j = 0; j < cols; ++j) {
      acc[j] += row[j];
    }
  }
}

void column_sums(const void* x, mx::Dtype dt, int64_t rows, int64_t cols, float* acc) {
  if (dt == mx::float32) {
    add_rows(static_cast<const float*>(x), rows, cols, acc);
    return;
  }
  // half precision: a block of rows widened at a time (MLX's conversions), then added
  constexpr int64_t block_values = 4096;
  int64_t block = std::max<int64_t>(1, block_values / cols);
  std::vector<float> wide(static_cast<size_t>(block * cols));
  auto* bytes = static_cast<const uint16_t*>(x);
  for (int64_t r = 0; r < rows; r += block) {
    int64_t n = std::min(block, rows - r);
    widen_all(bytes + r * cols, dt, wide.data(), static_cast<size_t>(n * cols));
    add_rows(wide.data(), n, cols, acc);
  }
}

} // namespace

mx::array bias_grad(const mx::array& g, mx::Dtype bias_dt, mx::StreamOrDevice s,
                    mx::Dtype round_dt) {
  FLN_CHECK(float_or_half(g.dtype()) && float_or_half(bias_dt) && float_or_half(round_dt),
            "fluxlike_native.bias_grad: expected float32, bfloat16 or float16 dtypes, got g ",
            dtype_str(g.dtype()), ", bias ", dtype_str(bias_dt), ", rounding to ",
            dtype_str(round_dt));
  FLN_CHECK(g.ndim() >= 1, "fluxlike_native.bias_grad: expected a cotangent with at least "
            "one axis, got a scalar");
  auto stream = mx::to_stream(s);
  int64_t cols = g.shape(-1);
  int64_t rows = cols ? static_cast<int64_t>(g.size()) / cols : 0;
  if (stream.device != mx::Device::cpu || g.ndim() < 2 || cols < 2 || rows < 2) {
    return bias_grad_ops(g, bias_dt, round_dt, stream);
  }
  return mx::array({g.shape(-1)}, bias_dt,
                   std::make_shared<BiasGrad>(stream, bias_dt, round_dt), {g});
}

std::vector<mx::Shape> BiasGrad::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(-1)}};
}

bool BiasGrad::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const BiasGrad&>(other);
  return bias_dt_ == o.bias_dt_ && round_dt_ == o.round_dt_;
}

void BiasGrad::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  RowMajor dense(inputs[0], encoder);
  const mx::array& g = *dense;
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  int64_t cols = g.shape(-1);
  int64_t rows = static_cast<int64_t>(g.size()) / cols;
  encoder.dispatch([x = g.data<void>(), dt = g.dtype(), rows, cols, round_dt = round_dt_,
                    out_dt = out.dtype(), dst = out.data<void>()]() {
    std::vector<float> acc(static_cast<size_t>(cols), 0.0f);  // (MLX's sum starts from 0)
    column_sums(x, dt, rows, cols, acc.data());
    round_all(acc.data(), round_dt, acc.size());
    narrow_all(acc.data(), out_dt, dst, acc.size());
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> BiasGrad::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  // Each member's sum over its own rows: the mapped axis first, left out of the sum.
  auto s = stream();
  auto g = mx::moveaxis(inputs[0], axes[0], 0, s);
  return {{bias_grad_ops(g, bias_dt_, round_dt_, s, /*first=*/1)}, {0}};
}

std::vector<mx::array> BiasGrad::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto s = stream();
  return vjp_of(
      [this, s](const std::vector<mx::array>& in) {
        return std::vector<mx::array>{bias_grad_ops(in[0], bias_dt_, round_dt_, s)};
      },
      primals, cotangents, argnums);
}

std::vector<mx::array> BiasGrad::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto s = stream();
  return jvp_of(
      [this, s](const std::vector<mx::array>& in) {
        return std::vector<mx::array>{bias_grad_ops(in[0], bias_dt_, round_dt_, s)};
      },
      primals, tangents, argnums, s);
}

FLN_VECTOR_CLONES void add_bias_float32(float* y, const float* bias, size_t rows,
                                         size_t cols) {
  for (size_t r = 0; r < rows; ++r) {
    float* __restrict row = y + r * cols;
    const float* __restrict b = bias;
    for (size_t c = 0; c < cols; ++c) {
      row[c] += b[c];
    }
  }
}

} // namespace fluxlike_native
