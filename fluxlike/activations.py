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

from . import workarounds
from .precision import kernels
from .precision.emulation import commutes_with_rounding
from .precision.state import HALF, current_dtype


@commutes_with_rounding("identity")
def identity(x: mx.array) -> mx.array:
    """Return ``x`` unchanged (the default activation of every layer).

    >>> import mlx.core as mx
    >>> from fluxlike import identity
    >>> identity(mx.array([-1.0, 2.0]))
    array([-1, 2], dtype=float32)
    """
    return x


@commutes_with_rounding("relu")
def relu(x: mx.array) -> mx.array:
    """``max(x, 0)``, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import relu
    >>> relu(mx.array([-1.0, 0.0, 2.0]))
    array([0, 0, 2], dtype=float32)
    >>> relu(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16
    """
    return nn.relu(x)


def leakyrelu(x: mx.array, a: float = 0.01) -> mx.array:
    """``x`` where positive, ``a * x`` elsewhere, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import leakyrelu
    >>> leakyrelu(mx.array([-1.0, 2.0])), leakyrelu(mx.array([-1.0, 2.0]), 0.5)
    (array([-0.01, 2], dtype=float32), array([-0.5, 2], dtype=float32))
    >>> leakyrelu(mx.ones(2, dtype=mx.bfloat16)).dtype
    mlx.core.bfloat16
    """
    return workarounds.leaky_relu(x, a)  # not nn.leaky_relu: wrong for a > 1


def elu(x: mx.array, alpha: float = 1.0) -> mx.array:
    """``x`` where positive, ``alpha * (exp(x) - 1)`` elsewhere, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import elu
    >>> elu(mx.array([-1.0, 0.0, 2.0]))
    array([-0.6321, 0, 2], dtype=float32)
    >>> elu(mx.ones(2, dtype=mx.float16), alpha=2.0).dtype
    mlx.core.float16
    """
    return workarounds.elu(x, alpha)  # not nn.elu: NaN gradients for large x


def gelu(x: mx.array) -> mx.array:
    """Gaussian error linear unit, exact form ``x * Φ(x)``, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import gelu
    >>> gelu(mx.array([-1.0, 0.0, 2.0]))
    array([-0.1587, 0, 1.9545], dtype=float32)
    >>> gelu(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16

    On the CPU with the native kernels in use this is one vectorised pass forward and one
    backward (MLX's ``erf`` and ``exp`` are scalar there), equal to ``mlx.nn.gelu`` to 5e-7
    absolute in float32 (:func:`fluxlike.precision.kernels.gelu`).
    """
    return kernels.gelu(x)


def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + exp(-x))``, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import sigmoid
    >>> sigmoid(mx.array([-1.0, 0.0, 2.0]))
    array([0.2689, 0.5, 0.8808], dtype=float32)
    >>> sigmoid(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16
    """
    return kernels.sigmoid(x)


def tanh(x: mx.array) -> mx.array:
    """Hyperbolic tangent, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import tanh
    >>> tanh(mx.array([-1.0, 0.0, 2.0]))
    array([-0.7616, 0, 0.964], dtype=float32)
    >>> tanh(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16
    """
    return kernels.tanh(x)


def swish(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` (also called SiLU), in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import swish
    >>> swish(mx.array([-1.0, 0.0, 2.0]))
    array([-0.2689, 0, 1.7616], dtype=float32)
    >>> swish(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16
    """
    if type(x) is not mx.array:
        return nn.silu(x)  # (a Python scalar, a NumPy array)
    return x * kernels.sigmoid(x)


def softplus(x: mx.array) -> mx.array:
    """``log(1 + exp(x))``, computed stably, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import softplus
    >>> softplus(mx.array([-1.0, 0.0, 2.0]))
    array([0.3133, 0.6931, 2.1269], dtype=float32)
    >>> softplus(mx.ones(2, dtype=mx.float16)).dtype
    mlx.core.float16
    """
    return mx.logaddexp(x, mx.zeros_like(x))


def relu6(x: mx.array) -> mx.array:
    """``min(max(x, 0), 6)``, in the input's dtype (MLX's ``nn.relu6``).

    >>> import mlx.core as mx
    >>> from fluxlike import relu6
    >>> relu6(mx.array([-1.0, 3.0, 8.0]))
    array([0, 3, 6], dtype=float32)
    """
    return nn.relu6(x)


def hardtanh(x: mx.array) -> mx.array:
    """``x`` clamped to ``[-1, 1]``, in the input's dtype (MLX's ``nn.hard_tanh``).

    >>> import mlx.core as mx
    >>> from fluxlike import hardtanh
    >>> hardtanh(mx.array([-3.0, 0.5, 2.0]))
    array([-1, 0.5, 1], dtype=float32)
    """
    return nn.hard_tanh(x)


def hardsigmoid(x: mx.array) -> mx.array:
    """``(x + 3) / 6`` clamped to ``[0, 1]`` (NNlib's ``hardσ``, PyTorch's ``hardsigmoid``),
    in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import hardsigmoid
    >>> hardsigmoid(mx.array([-4.0, 0.0, 1.5, 4.0]))
    array([0, 0.5, 0.75, 1], dtype=float32)
    """
    return mx.clip((x + 3) / 6, 0, 1)


def hardswish(x: mx.array) -> mx.array:
    """``x * hardsigmoid(x)``, in the input's dtype (MLX's ``nn.hardswish``).

    >>> import mlx.core as mx
    >>> from fluxlike import hardswish
    >>> hardswish(mx.array([-4.0, 0.0, 1.5, 4.0]))
    array([-0, 0, 1.125, 4], dtype=float32)
    """
    return nn.hardswish(x)


# Klambauer et al. (2017), to the digits NNlib and PyTorch use (MLX's nn.selu rounds them to 5).
_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717


def selu(x: mx.array) -> mx.array:
    """Scaled ELU, ``λ * elu(x, α)`` with ``λ ≈ 1.0507`` and ``α ≈ 1.6733`` (the
    self-normalising constants, full precision), in the input's dtype. Pair it with
    :class:`~fluxlike.AlphaDropout` and ``lecun_normal``-style initialisation.

    >>> import mlx.core as mx
    >>> from fluxlike import selu
    >>> selu(mx.array([-1.0, 0.0, 2.0]))
    array([-1.1113, 0, 2.1014], dtype=float32)
    """
    return _SELU_LAMBDA * workarounds.elu(x, _SELU_ALPHA)  # not nn.selu: see elu


def celu(x: mx.array, alpha: float = 1.0) -> mx.array:
    """Continuously differentiable ELU: ``x`` where positive, ``alpha * (exp(x / alpha) - 1)``
    elsewhere, in the input's dtype (slope 1 at 0, finite gradients for large ``x``).

    >>> import mlx.core as mx
    >>> from fluxlike import celu
    >>> celu(mx.array([-1.0, 0.0, 2.0])), celu(mx.array([-1.0]), 2.0)
    (array([-0.632121, 0, 2], dtype=float32), array([-0.786939], dtype=float32))
    """
    # exp sees only minimum(0, x) (in that order: the tie's gradient goes to x), as in elu
    return mx.where(x > 0, x, alpha * mx.expm1(mx.minimum(0, x) / alpha))


def mish(x: mx.array) -> mx.array:
    """``x * tanh(softplus(x))``, in the input's dtype (MLX's ``nn.mish``).

    >>> import mlx.core as mx
    >>> from fluxlike import mish
    >>> mish(mx.array([-1.0, 0.0, 2.0]))
    array([-0.303401, 0, 1.94395], dtype=float32)
    """
    return nn.mish(x)


def softsign(x: mx.array) -> mx.array:
    """``x / (1 + |x|)``, in the input's dtype (MLX's ``nn.softsign``).

    >>> import mlx.core as mx
    >>> from fluxlike import softsign
    >>> softsign(mx.array([-1.0, 0.0, 3.0]))
    array([-0.5, 0, 0.75], dtype=float32)
    """
    return nn.softsign(x)


def tanhshrink(x: mx.array) -> mx.array:
    """``x - tanh(x)``, in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import tanhshrink
    >>> tanhshrink(mx.array([-1.0, 0.0, 2.0]))
    array([-0.238406, 0, 1.03597], dtype=float32)
    """
    return x - mx.tanh(x)


def logcosh(x: mx.array) -> mx.array:
    """``log(cosh(x))``, computed stably as ``x + softplus(-2x) - log(2)`` (as NNlib), in
    the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import logcosh
    >>> logcosh(mx.array([-1.0, 0.0, 100.0]))
    array([0.433781, 0, 99.3069], dtype=float32)
    """
    return x + mx.logaddexp(-2 * x, mx.zeros_like(x)) - _LOG2


_LOG2 = 0.6931471805599453


def lisht(x: mx.array) -> mx.array:
    """``x * tanh(x)`` (linearly scaled hyperbolic tangent), in the input's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import lisht
    >>> lisht(mx.array([-1.0, 0.0, 2.0]))
    array([0.761594, 0, 1.92806], dtype=float32)
    """
    return x * mx.tanh(x)


def gelu_erf(x: mx.array) -> mx.array:
    """GELU in its exact form ``x * Φ(x)`` (``0.5 x (1 + erf(x / √2))``), in the input's
    dtype: the same function as :func:`gelu`, under NNlib's name.

    >>> import mlx.core as mx
    >>> from fluxlike import gelu_erf
    >>> gelu_erf(mx.array([-1.0, 0.0, 2.0]))
    array([-0.158655, 0, 1.9545], dtype=float32)
    """
    return kernels.gelu(x)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation ``0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`` (NNlib's
    ``gelu``, PyTorch's ``approximate="tanh"``, MLX's ``nn.gelu_approx``), in the input's
    dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import gelu_tanh
    >>> gelu_tanh(mx.array([-1.0, 0.0, 2.0]))
    array([-0.158808, 0, 1.95459], dtype=float32)
    """
    return nn.gelu_approx(x)


def _in_float32(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """Apply ``fn`` in float32 to half-precision ``x`` (fp32 policy)."""
    if x.dtype not in HALF:
        return fn(x)
    out = fn(x.astype(mx.float32))
    return out if current_dtype() is not None else out.astype(x.dtype)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``exp(x) / sum(exp(x))`` along ``axis``.

    Half-precision input is computed in float32 and returned in its own dtype outside an
    :func:`~fluxlike.autocast` scope, in float32 inside one; float32 and float64 input is
    computed and returned in its dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import autocast, softmax
    >>> softmax(mx.log(mx.array([1.0, 3.0])))
    array([0.25, 0.75], dtype=float32)
    >>> half = mx.zeros((2, 3), dtype=mx.float16)
    >>> softmax(half).dtype
    mlx.core.float16
    >>> with autocast(mx.float16):
    ...     softmax(half).dtype
    mlx.core.float32
    """
    return _in_float32(lambda v: _softmax(v, axis), x)


def _softmax(v: mx.array, axis: int) -> mx.array:
    """``mx.softmax(v, axis, precise=True)``; float32 over the last axis on the native
    companion's where it is in use (MLX's CPU ``exp`` is scalar)."""
    if v.dtype == mx.float32 and axis in (-1, v.ndim - 1):
        return kernels.softmax(v)
    return mx.softmax(v, axis=axis, precise=True)


def logsoftmax(x: mx.array, axis: int = -1) -> mx.array:
    """``x - logsumexp(x)`` along ``axis``, max-shifted (exact for large ``|x|``).
    Precision as in :func:`softmax` (half input: computed in float32, returned in its dtype outside
    a scope and in float32 inside one).

    >>> import mlx.core as mx
    >>> from fluxlike import logsoftmax
    >>> logsoftmax(mx.array([0.0, 0.0]))
    array([-0.6931, -0.6931], dtype=float32)
    >>> logsoftmax(mx.array([-1e5, -1e5]))
    array([-0.6931, -0.6931], dtype=float32)
    >>> logsoftmax(mx.zeros(2, dtype=mx.bfloat16)).dtype
    mlx.core.bfloat16
    """
    return _in_float32(lambda v: kernels.stable_logsoftmax(v, axis), x)


def logsumexp(x: mx.array, axis: int | None = -1, keepdims: bool = False) -> mx.array:
    """``log(sum(exp(x)))`` along ``axis`` (all axes for ``None``), max-shifted; precision
    as in :func:`softmax` (half input: computed in float32, returned in its dtype outside a
    scope and in float32 inside one).

    >>> import mlx.core as mx
    >>> from fluxlike import logsumexp
    >>> logsumexp(mx.zeros((2, 4)), axis=None)
    array(2.0794, dtype=float32)
    >>> logsumexp(mx.zeros((2, 4), dtype=mx.float16)).dtype, logsumexp(mx.zeros((2, 4))).shape
    (mlx.core.float16, (2,))
    """
    return _in_float32(lambda v: kernels.stable_logsumexp(v, axis, keepdims), x)


ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    f.__name__: f
    for f in (identity, relu, leakyrelu, elu, gelu, sigmoid, tanh, swish, softplus, softmax,
              logsoftmax, relu6, hardtanh, hardsigmoid, hardswish, selu, celu, mish, softsign,
              tanhshrink, logcosh, lisht, gelu_erf, gelu_tanh)
}


def resolve(act: Callable | str | None, layer: str) -> Callable[[mx.array], mx.array]:
    """The activation function named or given by ``act`` (``None`` is ``identity``);
    ``layer`` names the layer in errors.

    ``act`` may be a name, a function of an array (fluxlike's, ``mlx.nn``'s, ``mx.tanh``, a
    lambda, a ``functools.partial``) or a module instance (``nn.ReLU()``). A class
    (``nn.ReLU``), or a callable that does not return an array for an array (``len``,
    ``lambda x: None``), is refused here, at construction, rather than failing at the first
    call. (A user's function is tried once on a small float32 array to tell; a function that
    raises on it is accepted, and its error will come at the call.)

    >>> import mlx.nn as nn
    >>> from fluxlike.activations import identity, relu, resolve
    >>> resolve("relu", "Dense") is relu, resolve(None, "Dense") is identity
    (True, True)
    >>> resolve("rleu", "Dense")
    Traceback (most recent call last):
    ValueError: [Dense] unknown activation 'rleu'; expected a callable or one of [...]
    >>> resolve(nn.ReLU, "Dense")
    Traceback (most recent call last):
    TypeError: [Dense] act=nn.ReLU is a class, not an activation: pass an instance, nn.ReLU(), ...
    """
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
    if isinstance(act, type):
        name = act.__name__
        if issubclass(act, nn.Module):
            shown = f"nn.{name}" if getattr(nn, name, None) is act else name
            function = name.lower() if name.lower() in ACTIVATIONS else None
            raise TypeError(
                f"[{layer}] act={shown} is a class, not an activation: pass an instance, "
                f"{shown}(){f', or the function {function}' if function else ''}"
            )
        raise TypeError(
            f"[{layer}] act={name} is a class, not an activation: pass a function of an "
            f"array such as relu (or its name, 'relu'), or a module instance such as nn.ReLU()"
        )
    if act in ACTIVATIONS.values() or isinstance(act, nn.Module) or _is_mlx(act) or act is abs:
        return act
    if getattr(act, "__module__", None) == "builtins":  # len, print, ...: not tried (print!)
        raise TypeError(
            f"[{layer}] act={getattr(act, '__name__', act)} is a Python builtin, not an "
            f"activation: pass a function of an array such as relu, or a module instance "
            f"such as nn.ReLU()"
        )
    _probe(act, layer)
    return act


def _is_mlx(act: Callable) -> bool:
    """One of MLX's own functions (``mx.tanh``, ``nn.gelu``): an activation if callable on an
    array, not worth trying."""
    return (getattr(act, "__module__", None) or "").startswith("mlx") or type(
        act).__module__.startswith("nanobind")


def _probe(act: Callable, layer: str) -> None:
    """Refuse ``act`` if it returns something other than an array for a small float32 array.
    Only the graph is built (nothing is evaluated); if the call drew random numbers, the
    random state is put back, so that constructing a layer draws nothing."""
    key = mx.random.state[0]  # type: ignore[index]  # MLX's stub lacks mx.random.state
    try:
        out = act(mx.zeros((1, 2)))
    except Exception:  # e.g. needs another shape: the call will tell
        return
    finally:
        if mx.random.state[0] is not key:  # type: ignore[index]  # (as above)
            hi, lo = key.tolist()
            mx.random.seed((hi << 32) | lo)
    if not isinstance(out, mx.array):
        shown = getattr(act, "__name__", None) or type(act).__name__
        raise TypeError(
            f"[{layer}] act={shown} is not an activation: for an array it returns "
            f"{type(out).__name__}, not an array; pass a function of an array such as relu, "
            f"or a module instance such as nn.ReLU()"
        )
