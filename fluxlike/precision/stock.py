"""Policies for MLX's stock layers, so an unmodified ``mlx.nn`` model runs under autocast.

Inside a scope, ``nn.Linear``, the convolutions and ``nn.MultiHeadAttention`` run the
forwards below instead of their own: the same computations through :mod:`.ops`, so that half
precision on the CPU takes the float32 kernels instead of MLX's scalar half-precision GEMM.
``nn.Bilinear`` and the recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) still run
MLX's native kernels there.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx
import mlx.nn as nn

from ..layers.attention import attend
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
    """``value`` for each of ``n`` dimensions, as Python ints. MLX's layers keep a numpy
    integer (``stride=np.int64(2)``) as it was given, and their own forward accepts it."""
    if isinstance(value, numbers.Integral):
        return (int(value),) * n
    return tuple(int(v) for v in value)


def _bias(layer: nn.Module) -> mx.array | None:
    """The layer's bias, added in the kernel's float32 before the one rounding on the CPU."""
    return layer["bias"] if "bias" in layer else None


def _linear(self: nn.Linear, x: mx.array) -> mx.array:
    return ops.linear(x, self["weight"], _bias(self))


def _conv(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    return ops.conv(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), getattr(self, "groups", 1), _bias(self),
    )


def _conv_transpose(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    return ops.conv_transpose(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), _per_dim(self.output_padding, n), getattr(self, "groups", 1),
        _bias(self),
    )


def _multi_head_attention(
    self: nn.MultiHeadAttention, queries: mx.array, keys: mx.array, values: mx.array,
    mask: mx.array | str | None = None,
) -> mx.array:
    heads = self.num_heads
    queries, keys, values = (
        mx.unflatten(proj(x), -1, (heads, -1)).transpose(0, 2, 1, 3)
        for proj, x in ((self.query_proj, queries), (self.key_proj, keys),
                        (self.value_proj, values))
    )
    output, _ = attend(queries, keys, values, math.sqrt(1 / queries.shape[-1]), mask)
    return self.out_proj(output.transpose(0, 2, 1, 3).flatten(-2, -1))


scoped_forward(nn.Linear.__call__, _linear)
scoped_forward(nn.MultiHeadAttention.__call__, _multi_head_attention)
for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    scoped_forward(_cls.__call__, _conv)
for _cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    scoped_forward(_cls.__call__, _conv_transpose)
