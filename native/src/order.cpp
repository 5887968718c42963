// fluxlike-native: an ordering dependency for backward passes (see order.h).

#include "order.h"

#include <algorithm>

namespace fluxlike_native {

mx::array order_after(const mx::array& x, const std::vector<mx::array>& deps,
                      mx::StreamOrDevice s) {
  if (deps.empty()) {
    return x;
  }
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), deps.begin(), deps.end());
  return mx::array(
      x.shape(), x.dtype(), std::make_shared<OrderAfter>(mx::to_stream(s)), std::move(inputs));
}

void order_input_grad(std::vector<mx::array>& grads, const std::vector<int>& argnums,
                      size_t freed, mx::StreamOrDevice s) {
  auto zero = std::find(argnums.begin(), argnums.end(), 0);
  if (zero == argnums.end() || grads.size() < 2) {
    return;
  }
  auto first = static_cast<size_t>(zero - argnums.begin());
  std::vector<mx::array> others;
  size_t held = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (i != first) {
      others.push_back(grads[i]);
      held += grads[i].nbytes();
    }
  }
  if (held > freed) {
    return;
  }
  grads[first] = order_after(grads[first], others, s);
}

std::pair<std::vector<mx::array>, std::vector<int>> OrderAfter::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto s = stream();
  std::vector<mx::array> deps(inputs.begin() + 1, inputs.end());
  if (axes[0] >= 0) {
    return {{order_after(inputs[0], deps, s)}, {axes[0]}};
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
  return {{order_after(x, deps, s)}, {0}};
}

void OrderAfter::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
}

void OrderAfter::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.copy_shared_buffer(inputs[0]);
}

std::vector<mx::array> OrderAfter::vjp(
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

std::vector<mx::array> OrderAfter::jvp(
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
