"""Policies for MLX's stock layers, so an unmodified ``mlx.nn`` model runs under autocast.

Inside a scope, ``nn.Linear`` and the convolutions run the forward below instead of their
own: the same computation through :mod:`.ops`, so that half precision on the CPU takes the
float32 kernels instead of MLX's scalar half-precision GEMM. ``nn.Bilinear``, the recurrent
layers and ``nn.MultiHeadAttention``'s attention core still use MLX's native kernels (their
``nn.Linear`` children are routed).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import ops
from .policy import autocast_policy, scoped_forward

for _cls in (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.MultiHeadAttention, nn.RNN, nn.GRU, nn.LSTM,
):
    autocast_policy("down")(_cls)

for _cls in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm, nn.BatchNorm):
    autocast_policy("fp32")(_cls)

for _cls in (nn.Embedding, nn.Dropout):
    autocast_policy("none")(_cls)


def _per_dim(value: int | tuple[int, ...], n: int) -> tuple[int, ...]:
    return (value,) * n if isinstance(value, int) else tuple(value)


def _with_bias(layer: nn.Module, y: mx.array) -> mx.array:
    return y + layer["bias"] if "bias" in layer else y


def _linear(self: nn.Linear, x: mx.array) -> mx.array:
    return ops.linear(x, self["weight"], self["bias"] if "bias" in self else None)


def _conv(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    y = ops.conv(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), getattr(self, "groups", 1),
    )
    return _with_bias(self, y)


def _conv_transpose(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    y = ops.conv_transpose(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), _per_dim(self.output_padding, n), getattr(self, "groups", 1),
    )
    return _with_bias(self, y)


scoped_forward(nn.Linear.__call__, _linear)
for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    scoped_forward(_cls.__call__, _conv)
for _cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    scoped_forward(_cls.__call__, _conv_transpose)
