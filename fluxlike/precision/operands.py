"""The dtypes a kernel computes in: the one place the rules are written.

Outside an autocast scope a floating input takes its layer's weight dtype (so an ``f16mix``
model accepts float32 data), except that float64 data given to a float32 layer is converted
with a one-time warning; integer and boolean inputs are a ``TypeError``. Inside a scope with
compute dtype ``T`` (on the default device's type) the input and the float32/float16/bfloat16
parameters are cast to ``T`` at the kernel: this is how fluxlike's own down-policy layers
compute in ``T`` while running their own forward on themselves. A float64 layer is never
cast. Weight casts are kept across calls (:mod:`.castcache`).
"""

from __future__ import annotations

import warnings
from typing import cast, overload

import mlx.core as mx

from .._stack import outside_stacklevel
from . import castcache
from .castcache import convert
from .state import CASTABLE, HALF, PLAIN, context, device_index

_warned_float64: set[str] = set()
HALF_SET = frozenset(HALF)


def match_input(x: mx.array, weight: mx.array, layer: str,
                dtype: mx.Dtype | None = None) -> mx.array:
    """``x`` converted to ``dtype`` (default: ``weight``'s dtype), following the module's
    dtype rules.

    >>> import mlx.core as mx
    >>> match_input(mx.ones((2, 3)), mx.ones((4, 3), dtype=mx.bfloat16), "Dense").dtype
    mlx.core.bfloat16
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    target = weight.dtype if dtype is None else dtype
    if x.dtype == target:
        return x
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(
            f"[{layer}] expected a floating-point input, got {x.dtype}; "
            f"convert it first, e.g. x.astype(mx.float32)"
        )
    if x.dtype == mx.float64 and weight.dtype != mx.float64 and layer not in _warned_float64:
        _warned_float64.add(layer)
        warnings.warn(
            f"[{layer}] float64 input converted to {target}, the dtype the layer computes "
            f"in; use f64(model) to compute in float64",
            stacklevel=outside_stacklevel(),
        )
    return convert(x, target)


def scope_dtype(*params: mx.array | None) -> mx.Dtype | None:
    """The compute dtype of a kernel on ``params`` right now: the autocast scope's on the
    default device, unless a parameter is float64 (never cast); ``None`` outside a scope.

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> with autocast(mx.bfloat16):
    ...     scope_dtype(mx.ones(2)), scope_dtype(mx.ones(2, mx.float64))
    (mlx.core.bfloat16, None)
    """
    state = context.get()
    if state is PLAIN:
        return None
    dtype = cast("mx.Dtype | None", state[device_index()])  # a dtype slot: 0 cpu, 1 gpu
    if dtype is not None and any(p is not None and p.dtype not in CASTABLE for p in params):
        return None
    return dtype


@overload
def operands(x: mx.array, weight: mx.array, *, layer: str) -> tuple[mx.array, mx.array]: ...
@overload
def operands(x: mx.array, weight: mx.array, param: mx.array | None, /, *,
             layer: str) -> tuple[mx.array, mx.array, mx.array | None]: ...
@overload
def operands(x: mx.array, weight: mx.array, *params: mx.array | None,
             layer: str) -> tuple[mx.array | None, ...]: ...
def operands(x: mx.array, weight: mx.array, *params: mx.array | None,
             layer: str) -> tuple[mx.array | None, ...]:
    """``(x, weight, *params)`` in the dtype a kernel computes in: inside an autocast scope
    the scope's compute dtype (weights through the kept casts), else the weight's dtype for
    ``x`` and the parameters as they are.

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> with autocast(mx.float16):
    ...     x, w, b = operands(mx.ones((1, 2)), mx.ones((3, 2)), None, layer="Dense")
    >>> x.dtype, w.dtype, b
    (mlx.core.float16, mlx.core.float16, None)
    """
    dtype = scope_dtype(weight)
    x = match_input(x, weight, layer, dtype)
    if dtype is None:
        return (x, weight, *params)
    cached = castcache.cached_cast
    return (x, cached(weight, dtype),
            *(p if p is None or p.dtype not in CASTABLE else cached(p, dtype) for p in params))


def one_dtype(first: mx.array, *others: mx.array | None) -> mx.Dtype | None:
    """The dtype of ``first`` if every other operand (``None`` aside) has it, else ``None``.

    >>> import mlx.core as mx
    >>> one_dtype(mx.ones(2), None, mx.ones(1)), one_dtype(mx.ones(2), mx.ones(2, mx.float16))
    (mlx.core.float32, None)
    """
    dtype = first.dtype
    for a in others:  # a plain loop: this runs on every kernel call
        if a is not None and a.dtype != dtype:
            return None
    return dtype


def half_on_cpu(first: mx.array, *others: mx.array | None) -> bool:
    """Whether these operands are half precision, all of one dtype, on the CPU (the default
    device): where MLX's own half kernels are slow, and fluxlike's kernels run natively or
    emulated instead.

    >>> import mlx.core as mx
    >>> half_on_cpu(mx.ones(2, dtype=mx.bfloat16), mx.ones(2, dtype=mx.bfloat16))
    True
    >>> half_on_cpu(mx.ones(2), mx.ones(2))
    False
    """
    if first.itemsize != 2:  # cheap: float32 operands pass here on every call
        return False
    dtype = one_dtype(first, *others)
    return dtype in HALF_SET and mx.default_device().type is mx.cpu
