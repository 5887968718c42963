// fluxlike-native: what every op's header uses - MLX's primitive classes, and macros for the
// declarations each primitive repeats, in the style of MLX's DEFINE_GRADS() / DEFINE_VMAP()
// (mlx/primitives.h; those assume namespace mlx::core).
#pragma once

#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

// jvp and vjp.
#define FLN_DEFINE_GRADS()                               \
  std::vector<mx::array> jvp(                            \
      const std::vector<mx::array>& primals,             \
      const std::vector<mx::array>& tangents,            \
      const std::vector<int>& argnums) override;         \
  std::vector<mx::array> vjp(                            \
      const std::vector<mx::array>& primals,             \
      const std::vector<mx::array>& cotangents,          \
      const std::vector<int>& argnums,                   \
      const std::vector<mx::array>& outputs) override;

#define FLN_DEFINE_VMAP()                                        \
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(      \
      const std::vector<mx::array>& inputs,                      \
      const std::vector<int>& axes) override;

#define FLN_DEFINE_OUTPUT_SHAPES() \
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

// One output of the first input's shape.
#define FLN_DEFINE_INPUT_OUTPUT_SHAPE()                                            \
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { \
    return {inputs[0].shape()};                                                    \
  }

// name() == "FluxlikeNative<PRIMITIVE>".
#define FLN_DEFINE_NAME(PRIMITIVE)    \
  const char* name() const override { \
    return "FluxlikeNative" #PRIMITIVE; \
  }

#define FLN_DEFINE_IS_EQUIVALENT() \
  bool is_equivalent(const mx::Primitive& other) const override;

// No parameters: any two are equivalent.
#define FLN_DEFINE_DEFAULT_IS_EQUIVALENT()                   \
  bool is_equivalent(const mx::Primitive&) const override { \
    return true;                                             \
  }

// eval_cpu of a one-output primitive, and an eval_gpu that throws `gpu_error`.
#define FLN_DEFINE_EVAL_CPU_ONLY(gpu_error)                                         \
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;     \
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {               \
    throw std::runtime_error(gpu_error);                                            \
  }

// The same for a primitive of several outputs.
#define FLN_DEFINE_EVAL_CPU_ONLY_MULTI(gpu_error)                                   \
  void eval_cpu(const std::vector<mx::array>& inputs,                               \
                std::vector<mx::array>& outputs) override;                          \
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {  \
    throw std::runtime_error(gpu_error);                                            \
  }
