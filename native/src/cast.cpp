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

void Convert::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // A contiguous buffer (row- or column-major, or a broadcast of one: data_size() elements)
  // converts as it is, keeping its layout, as MLX's casts do; any other view is copied first.
  const auto& x =
      inputs[0].flags().contiguous ? inputs[0] : row_contiguous_copy(inputs[0], encoder);
  out.set_data(output_malloc(x.data_size() * out.itemsize(), out.dtype()), x.data_size(),
               x.strides(), x.flags());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([src = x.data<void>(), from = x.dtype(), dst = out.data<void>(),
                    to = out.dtype(), n = x.data_size()]() {
    convert_all(src, from, dst, to, n);
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
