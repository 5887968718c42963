"""Weight initialisers: functions of a shape returning a float32 array.

Shapes follow MLX: ``(out, in)`` for dense weights and ``(out, *kernel, in)`` for
convolutions, so ``fan_in`` is the product of every axis but the first.

>>> from fluxlike.init import glorot_uniform
>>> glorot_uniform((3, 4)).shape
(3, 4)
"""

from __future__ import annotations

import math

import mlx.core as mx


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        return shape[0], shape[0]
    receptive = math.prod(shape[1:-1])
    return shape[-1] * receptive, shape[0] * receptive


def glorot_uniform(shape: tuple[int, ...], gain: float = 1.0) -> mx.array:
    """Uniform on ``±gain * sqrt(6 / (fan_in + fan_out))`` (Flux's default for weights)."""
    fan_in, fan_out = _fans(shape)
    limit = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return mx.random.uniform(-limit, limit, shape)


def glorot_normal(shape: tuple[int, ...], gain: float = 1.0) -> mx.array:
    """Normal with standard deviation ``gain * sqrt(2 / (fan_in + fan_out))``."""
    fan_in, fan_out = _fans(shape)
    return gain * math.sqrt(2.0 / (fan_in + fan_out)) * mx.random.normal(shape)


def kaiming_uniform(shape: tuple[int, ...], gain: float = math.sqrt(2.0)) -> mx.array:
    """Uniform on ``±gain * sqrt(3 / fan_in)`` (He initialisation, for ReLU layers)."""
    fan_in, _ = _fans(shape)
    limit = gain * math.sqrt(3.0 / fan_in)
    return mx.random.uniform(-limit, limit, shape)


def kaiming_normal(shape: tuple[int, ...], gain: float = math.sqrt(2.0)) -> mx.array:
    """Normal with standard deviation ``gain / sqrt(fan_in)``."""
    fan_in, _ = _fans(shape)
    return gain / math.sqrt(fan_in) * mx.random.normal(shape)
