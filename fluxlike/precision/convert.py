"""Storage converters: a model with its floating parameters stored in another dtype.

``f32``, ``f64``, ``f16`` and ``bf16`` cast every floating parameter (full casts, like
PyTorch's ``model.half()``). ``f16mix`` and ``bf16mix`` cast all but the layers that declare
:func:`keep_float32` (BatchNorm, InstanceNorm and GroupNorm, fluxlike's and ``mlx.nn``'s),
whose statistics and affine parameters stay float32, as in Flux; LayerNorm and RMSNorm are
cast (under autocast they compute in float32 whatever their parameters' dtype).

A half-precision conversion crosses the dispatch barrier (:func:`.policy.activate`), as the
first ``autocast`` does: converted ``mlx.nn`` layers then run fluxlike's kernels where their
own forwards would fall into MLX's slow CPU half kernels or refuse a float32 attention mask
(:mod:`.stock`).

Each converter returns a new model and leaves its argument unchanged: the module tree is
copied node by node (sharing no module, list, dict or frozen-set with the argument), integer
and boolean leaves are untouched, and a leaf already of the target dtype is reused, not
copied. Frozen parameters stay frozen. Modules or arrays that appear twice in the argument
(tied weights) appear twice, as one object, in the result. Arrays and plain trees of arrays
(e.g. ``model.parameters()``) are converted too.

Following ``mlx.nn.Module.parameters()``, arrays under keys starting with ``_`` are not
parameters and are not cast.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .policy import activate, policy_record
from .state import HALF

T = TypeVar("T")


def keeps_float32(layer: Any) -> bool:
    """Whether a layer (or layer class) keeps float32 under mixed conversion: its record's
    ``keep_float32`` (see :func:`~fluxlike.keep_float32`).

    >>> import mlx.nn as nn
    >>> from fluxlike import BatchNorm, Dense
    >>> from fluxlike.precision.convert import keeps_float32
    >>> keeps_float32(BatchNorm), keeps_float32(nn.GroupNorm(4, 8)), keeps_float32(Dense)
    (True, True, False)
    """
    return policy_record(layer).keep_float32


def _convert(tree: T, dtype: mx.Dtype, mixed: bool) -> T:
    if dtype in HALF:
        # A half model routes mlx.nn's layers to fluxlike's kernels outside a scope too
        # (stock.py: ``unscoped``): that needs the dispatch barrier crossed, as autocast does.
        activate()
    memo: dict[int | tuple[int, mx.Dtype], Any] = {}  # modules by id, arrays by (id, dtype)

    def leaf(x: Any, target: mx.Dtype, cast: bool) -> Any:
        if isinstance(x, nn.Module):
            return module(x, target)
        if not (cast and isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating)):
            return x
        if x.dtype == target:
            return x
        key = (id(x), target)
        if key not in memo:
            memo[key] = x.astype(target)
        return memo[key]

    def module(m: nn.Module, target: mx.Dtype) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        if mixed and keeps_float32(m):
            target = mx.float32
        new = memo[id(m)] = copy.copy(m)
        # Bookkeeping such as the frozen-parameter set must not be shared with the argument.
        for key, value in m.__dict__.items():
            if isinstance(value, (set, list, dict)):
                new.__dict__[key] = copy.copy(value)
        for key, value in m.items():
            # "_" keys hold no parameters (mlx's valid_parameter_filter): only their modules
            # are converted.
            cast = functools.partial(leaf, target=target, cast=not key.startswith("_"))
            dict.__setitem__(new, key, tree_map(cast, value, is_leaf=nn.Module.is_module))
        return new

    return tree_map(lambda x: leaf(x, dtype, True), tree, is_leaf=nn.Module.is_module)


def f32(model: T) -> T:
    """``model`` with every floating parameter in float32.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, f16, f32
    >>> f32(f16(Dense(2, 3))).weight.dtype
    mlx.core.float32
    """
    return _convert(model, mx.float32, mixed=False)


def f64(model: T) -> T:
    """``model`` with every floating parameter in float64 (float64 runs on the CPU only).

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, f64
    >>> with mx.stream(mx.cpu):
    ...     f64(Dense(2, 3))(mx.ones((1, 2), dtype=mx.float64)).dtype
    mlx.core.float64
    """
    return _convert(model, mx.float64, mixed=False)


def f16(model: T) -> T:
    """``model`` with every floating parameter in float16, norms included (a full cast).

    >>> import mlx.core as mx
    >>> from fluxlike import BatchNorm, Chain, Dense, f16
    >>> half = f16(Chain(Dense(2, 3), BatchNorm(3)))
    >>> half[0].weight.dtype, half[1].weight.dtype, half[1].running_mean.dtype
    (mlx.core.float16, mlx.core.float16, mlx.core.float16)
    """
    return _convert(model, mx.float16, mixed=False)


def bf16(model: T) -> T:
    """``model`` with every floating parameter in bfloat16, norms included (a full cast).

    >>> import mlx.core as mx
    >>> from fluxlike import BatchNorm, Chain, Dense, bf16
    >>> half = bf16(Chain(Dense(2, 3), BatchNorm(3)))
    >>> half[0].weight.dtype, half[1].running_var.dtype
    (mlx.core.bfloat16, mlx.core.bfloat16)
    """
    return _convert(model, mx.bfloat16, mixed=False)


def f16mix(model: T) -> T:
    """``model`` in float16, except layers that :func:`keep_float32` (BatchNorm,
    InstanceNorm, GroupNorm): their statistics and affine parameters stay float32.

    The result takes float32 data (fluxlike's layers convert their input to their weights'
    dtype) and computes in float16. ``mlx.nn``'s own layers do not convert: with float32
    data they promote their weights to float32, and after a norm kept float32 so does the
    rest; give such a model half-precision data (it then runs fluxlike's kernels on the CPU,
    :mod:`.stock`), keep it under ``autocast`` (which casts each layer's input), or use
    fluxlike's layers.

    >>> import mlx.core as mx
    >>> from fluxlike import BatchNorm, Chain, Dense, f16mix, relu
    >>> model = Chain(Dense(4, 8, relu), BatchNorm(8), Dense(8, 2))
    >>> half = f16mix(model)
    >>> half[0].weight.dtype, half[1].weight.dtype, half[1].running_mean.dtype
    (mlx.core.float16, mlx.core.float32, mlx.core.float32)
    >>> half(mx.ones((5, 4))).dtype
    mlx.core.float16
    >>> model[0].weight.dtype  # the argument is unchanged
    mlx.core.float32
    """
    return _convert(model, mx.float16, mixed=True)


def bf16mix(model: T) -> T:
    """``model`` in bfloat16, except layers that :func:`keep_float32` (BatchNorm,
    InstanceNorm, GroupNorm), which stay float32.

    >>> import mlx.core as mx
    >>> import mlx.nn as nn
    >>> from fluxlike import bf16mix
    >>> half = bf16mix(nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8)))
    >>> half.layers[0].weight.dtype, half.layers[1].weight.dtype
    (mlx.core.bfloat16, mlx.core.float32)
    """
    return _convert(model, mx.bfloat16, mixed=True)
