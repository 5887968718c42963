// fluxlike-native: casts between float32, bfloat16 and float16 (see cast.h).

#include "cast.h"
#include "common.h"

#include <memory>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace fluxlike_native {

mx::array convert(const mx::array& x, mx::Dtype dt, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (x.dtype() == dt || !float_or_half(x.dtype()) || !float_or_half(dt) ||
      stream.device != mx::Device::cpu) {
    return mx::astype(x, dt, stream);
  }
  return mx::array(x.shape(), dt, std::make_shared<Convert>(stream, dt), {x});
}

bool Convert::is_equivalent(const mx::Primitive& other) const {
  return dt_ == static_cast<const Convert&>(other).dt_;
}

namespace {

// An element of a cast costs about as much as this many multiply-adds (an estimate: a load, a
// few integer operations and a store, memory-bound): casts of 2**19 elements and more are
// shared out over OpenMP's threads, in blocks of 2**16. (On the 4 x 2048 x 2048 MLP's
// bfloat16 gradient, Intel Xeon with AMX, the weights' casts and their gradients' were
// ~12% of the step on one thread.)
constexpr double ELEMENT_MACS = 8;
constexpr int64_t BLOCK = 1 << 16;

} // namespace

void Convert::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // A contiguous buffer (row- or column-major, or a broadcast of one: data_size() elements)
  // converts as it is, keeping its layout, as MLX's casts do; any other view is copied first.
  const auto& x =
      inputs[0].flags().contiguous ? inputs[0] : row_contiguous_copy(inputs[0], encoder);
  if (x.flags().row_contiguous && x.data_size() == x.size()) {
    set_aligned_data(out);  // (a product's source, read in place)
  } else {
    out.set_data(mx::allocator::malloc(x.data_size() * out.itemsize()), x.data_size(),
                 x.strides(), x.flags());
  }
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([src = x.data<void>(), from = x.dtype(), dst = out.data<void>(),
                    to = out.dtype(), n = x.data_size()]() {
    auto in = static_cast<const char*>(src);
    auto o = static_cast<char*>(dst);
    size_t in_size = mx::size_of(from), out_size = mx::size_of(to);
    shared_out(static_cast<int64_t>(n), ELEMENT_MACS, BLOCK, [&](int64_t lo, int64_t hi) {
      auto a = in + lo * in_size;
      auto b = o + lo * out_size;
      auto count = static_cast<size_t>(hi - lo);
      if (!convert_streaming(a, from, b, to, count, n)) {
        convert_all(a, from, b, to, count);
      }
    });
  });
}

std::pair<std::vector<mx::array>, std::vector<int>> Convert::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  return {{convert(inputs[0], dt_, stream())}, axes};
}

std::vector<mx::array> Convert::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (size_t i = 0; i < argnums.size(); ++i) {  // (as astype's: the cotangent cast back)
    grads.push_back(convert(cotangents[0], primals[0].dtype(), stream()));
  }
  return grads;
}

std::vector<mx::array> Convert::jvp(
    const std::vector<mx::array>&,
    const std::vector<mx::array>& tangents,
    const std::vector<int>&) {
  return {convert(tangents[0], dt_, stream())};
}

} // namespace fluxlike_native
