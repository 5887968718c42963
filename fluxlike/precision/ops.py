"""The compute kernels of the down-policy layers, and the one place their dtypes are decided.

Layers call these instead of ``@``/``mx.conv_general`` directly, so that the rules below
hold everywhere and the CPU can route half precision to fast float32 kernels.

Dtype rules (:func:`match_input`): a floating input takes its layer's weight dtype (so a
``f16mix`` model accepts float32 data), except that float64 data given to a float32 layer is
converted with a one-time warning; integer and boolean inputs are a ``TypeError``.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

_warned_float64: set[str] = set()


def match_input(x: mx.array, weight: mx.array, layer: str) -> mx.array:
    """``x`` converted to ``weight``'s dtype, following the module's dtype rules."""
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if x.dtype == weight.dtype:
        return x
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(
            f"[{layer}] expected a floating-point input, got {x.dtype}; "
            f"convert it first, e.g. x.astype(mx.float32)"
        )
    if x.dtype == mx.float64 and layer not in _warned_float64:
        _warned_float64.add(layer)
        warnings.warn(
            f"[{layer}] float64 input converted to the layer's {weight.dtype}; "
            f"use f64(model) to compute in float64",
            stacklevel=3,
        )
    return x.astype(weight.dtype)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T + bias`` with ``weight`` of shape ``(out, in)``."""
    if bias is None:
        return x @ weight.T
    return mx.addmm(bias, x, weight.T)


def matmul(a: mx.array, b: mx.array) -> mx.array:
    """``a @ b`` for operands of one dtype."""
    return a @ b


def conv(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]],
    dilation: tuple[int, ...],
    groups: int,
) -> mx.array:
    """N-d convolution, channels last: ``x`` is ``(N, *spatial, C_in)``, ``weight`` is
    ``(C_out, *kernel, C_in // groups)``."""
    return mx.conv_general(
        x, weight, stride=stride, padding=padding, kernel_dilation=dilation, groups=groups
    )


def conv_transpose(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    output_padding: tuple[int, ...],
    groups: int,
) -> mx.array:
    """N-d transposed convolution, channels last; ``weight`` is ``(C_out, *kernel, C_in // groups)``."""
    fn = {1: mx.conv_transpose1d, 2: mx.conv_transpose2d, 3: mx.conv_transpose3d}[x.ndim - 2]
    unpack = (lambda t: t[0]) if x.ndim == 3 else (lambda t: t)
    return fn(
        x,
        weight,
        stride=unpack(stride),
        padding=unpack(padding),
        dilation=unpack(dilation),
        output_padding=unpack(output_padding),
        groups=groups,
    )
