"""Activation functions, as plain functions of an array.

Most are elementwise and run in their input's dtype (policy "none"). ``softmax``,
``logsoftmax`` and ``logsumexp`` compute in float32 for half-precision input; inside an
:func:`~fluxlike.autocast` scope they return float32, outside they cast back to the input
dtype.

>>> import mlx.core as mx
>>> from fluxlike import relu, softmax
>>> relu(mx.array([-1.0, 2.0]))
array([0, 2], dtype=float32)
>>> softmax(mx.array([0.0, 0.0]))
array([0.5, 0.5], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .precision.state import HALF, current_dtype


def identity(x: mx.array) -> mx.array:
    """Return ``x`` unchanged (the default activation of every layer)."""
    return x


def relu(x: mx.array) -> mx.array:
    """``max(x, 0)``."""
    return nn.relu(x)


def leakyrelu(x: mx.array, a: float = 0.01) -> mx.array:
    """``x`` where positive, ``a * x`` elsewhere."""
    # not nn.leaky_relu: its max(a * x, x) is wrong for a > 1
    return mx.where(x > 0, x, a * x)


def elu(x: mx.array, alpha: float = 1.0) -> mx.array:
    """``x`` where positive, ``alpha * (exp(x) - 1)`` elsewhere."""
    # not nn.elu: exp of a large positive x overflows (above ~11 in float16) in the branch
    # where() discards, and its gradient there is 0 * inf = NaN. minimum(0, x), not
    # minimum(x, 0): MLX gives a tie's gradient to the second operand, and the slope at
    # x == 0 must be alpha (as in PyTorch, Flux and nn.elu).
    return mx.where(x > 0, x, alpha * mx.expm1(mx.minimum(0, x)))


def gelu(x: mx.array) -> mx.array:
    """Gaussian error linear unit, exact form ``x * Φ(x)``."""
    return nn.gelu(x)


def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + exp(-x))``."""
    return mx.sigmoid(x)


def tanh(x: mx.array) -> mx.array:
    """Hyperbolic tangent."""
    return mx.tanh(x)


def swish(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` (also called SiLU)."""
    return nn.silu(x)


def softplus(x: mx.array) -> mx.array:
    """``log(1 + exp(x))``, computed stably."""
    return mx.logaddexp(x, mx.zeros_like(x))


def _in_float32(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """Apply ``fn`` in float32 to half-precision ``x`` (fp32 policy)."""
    if x.dtype not in HALF:
        return fn(x)
    out = fn(x.astype(mx.float32))
    return out if current_dtype() is not None else out.astype(x.dtype)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``exp(x) / sum(exp(x))`` along ``axis``, in at least float32."""
    return _in_float32(lambda v: mx.softmax(v, axis=axis, precise=True), x)


def logsoftmax(x: mx.array, axis: int = -1) -> mx.array:
    """``x - logsumexp(x)`` along ``axis``, in at least float32."""
    return _in_float32(lambda v: v - mx.logsumexp(v, axis=axis, keepdims=True), x)


def logsumexp(x: mx.array, axis: int | None = -1, keepdims: bool = False) -> mx.array:
    """``log(sum(exp(x)))`` along ``axis`` (all axes for ``None``), in at least float32."""
    return _in_float32(lambda v: mx.logsumexp(v, axis=axis, keepdims=keepdims), x)


ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    f.__name__: f
    for f in (identity, relu, leakyrelu, elu, gelu, sigmoid, tanh, swish, softplus, softmax,
              logsoftmax)
}


def resolve(act: Callable | str | None, layer: str) -> Callable[[mx.array], mx.array]:
    """The activation function named or given by ``act`` (``None`` is ``identity``)."""
    if act is None:
        return identity
    if isinstance(act, str):
        if act not in ACTIVATIONS:
            raise ValueError(
                f"[{layer}] unknown activation {act!r}; expected a callable or one of "
                f"{sorted(ACTIVATIONS)}"
            )
        return ACTIVATIONS[act]
    if not callable(act):
        raise TypeError(f"[{layer}] activation must be callable or a name, got {act!r}")
    return act
