"""Model utilities from Flux: ``outputsize`` (a model's output shape without computing it)
and ``modules`` (every layer of a model, in order).

They work on any ``mlx.nn.Module`` (fluxlike's layers, mlx.nn's, a user's) and import no
layer module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ._mlxtyping import tree_flatten
from .checks import is_int


def _input_shape(shape: Any, padbatch: bool) -> tuple[int, ...]:
    dims = (shape,) if is_int(shape) else shape
    if not isinstance(dims, (tuple, list)) or not all(is_int(d) and d >= 0 for d in dims):
        raise ValueError(f"[outputsize] each input shape must be a tuple of non-negative "
                         f"integers, got {shape!r}")
    return (1, *map(int, dims)) if padbatch else tuple(map(int, dims))


def outputsize(model: Callable, *shapes: tuple[int, ...], padbatch: bool = False,
               dtype: mx.Dtype = mx.float32) -> Any:
    """The shape of ``model``'s output for inputs of ``shapes``, without computing it, as
    Flux's ``outputsize``.

    ``model`` is called on zeros of each shape (one argument per shape) and the shape of
    its output is read: MLX builds the graph lazily and knows every shape before computing
    anything, so nothing is computed (except values a layer reads back itself, such as
    :class:`~fluxlike.Embedding`'s index check). Shapes are batch first, as everywhere in
    fluxlike; ``padbatch=True`` adds a batch axis of 1 in front of each. ``dtype`` is the
    inputs' dtype (an integer dtype for index inputs). A tuple, list or dict of outputs gives
    the same structure of shapes. The model is left as it was, even when a layer in train
    mode would update its running statistics. A shape the model cannot take raises its usual
    error: ``outputsize`` is also a cheap check that the layers fit together.

    >>> from fluxlike import Chain, Conv, Dense, MaxPool, flatten, outputsize
    >>> features = Chain(Conv((3, 3), 3, 16, padding=1), MaxPool((2, 2)), flatten)
    >>> outputsize(features, (32, 32, 3), padbatch=True)
    (1, 4096)
    >>> outputsize(Chain(features, Dense(4096, 10)), (8, 32, 32, 3))
    (8, 10)
    """
    if not callable(model):
        raise TypeError(f"[outputsize] model must be callable, got {model!r}")
    if not shapes:
        raise ValueError("[outputsize] give the shape of each input, e.g. "
                         "outputsize(model, (batch, features))")
    padbatch = bool(padbatch)
    inputs = [mx.zeros(_input_shape(s, padbatch), dtype=dtype) for s in shapes]
    module = model if isinstance(model, nn.Module) else nn.Module()
    state = module.parameters()
    try:
        out = model(*inputs)
    finally:
        module.update(state)  # a train-mode norm wrote statistics of zeros: put them back
    return tree_map(lambda y: tuple(y.shape) if isinstance(y, mx.array) else y, out)


def modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model``, itself first, each before its children and children in
    order (depth first), each module once even where it is shared, as Flux's ``modules``
    (which lists the layers' tuples too; here only modules). For what a loop over the layers
    needs: a penalty on every Dense weight, a count of the norms.

    >>> import mlx.core as mx
    >>> from fluxlike import BatchNorm, Chain, Dense, modules
    >>> model = Chain(Chain(Dense(4, 3), BatchNorm(3)), Dense(3, 2))
    >>> [type(m).__name__ for m in modules(model)]
    ['Chain', 'Chain', 'Dense', 'BatchNorm', 'Dense']
    >>> sum(mx.sum(m.weight ** 2) for m in modules(model) if isinstance(m, Dense)).shape
    ()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"[modules] expected an mlx.nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    found: list[nn.Module] = []
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        children = tree_flatten(module.children(), is_leaf=nn.Module.is_module)
        stack.extend(c for _, c in reversed(children) if isinstance(c, nn.Module))
    return found
