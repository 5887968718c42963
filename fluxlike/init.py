"""Weight initialisers (Flux's): functions of a shape returning a float32 array.

Shapes follow MLX: ``(out, in)`` for dense weights and ``(out, *kernel, in)`` for
convolutions, so ``fan_in`` is the product of every axis but the first and ``fan_out`` that
of every axis but the last. A layer takes one as ``init=``; options go in with
``functools.partial``:

>>> from functools import partial
>>> from fluxlike import Dense, glorot_uniform, orthogonal
>>> glorot_uniform((3, 4)).shape
(3, 4)
>>> Dense(4, 3, init=partial(orthogonal, gain=2.0)).weight.shape
(3, 4)

Where ``mlx.nn.init`` has the distribution (Glorot, He, sparse) these build on it; they add
Flux's conventions (a shape, not an array; Flux's defaults; Flux's ``sparse_init`` zeroes a
fraction of each column) and checked arguments.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .checks import is_int

Shape = tuple[int, ...]


def _shape(shape: Any, name: str, min_ndim: int = 1) -> Shape:
    """``shape`` (an int or a tuple of positive ints) as a tuple, or a ``ValueError``."""
    dims = (shape,) if is_int(shape) else shape
    if not isinstance(dims, (tuple, list)) or not all(is_int(d) and d >= 1 for d in dims):
        raise ValueError(f"[{name}] shape must be a tuple of positive integers, got {shape!r}")
    if len(dims) < min_ndim:
        raise ValueError(f"[{name}] needs a shape of at least {min_ndim} dimensions, got "
                         f"{tuple(dims)}; a bias or a vector takes zeros32 or ones32")
    return tuple(int(d) for d in dims)


def _positive(value: Any, name: str, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"[{name}] {what} must be a positive number, got {value!r}")
    return float(value)


def _fans(shape: Shape) -> tuple[int, int]:
    if len(shape) < 2:
        return shape[0], shape[0]
    receptive = math.prod(shape[1:-1])
    return shape[-1] * receptive, shape[0] * receptive


def _from_mlx(initialiser: Any, shape: Shape, *args: Any) -> mx.array:
    """An ``mlx.nn.init`` initialiser applied to ``shape``: it reads only its argument's shape,
    so the placeholder is never computed (MLX is lazy)."""
    return initialiser(mx.zeros(shape), *args)


def glorot_uniform(shape: Shape, gain: float = 1.0) -> mx.array:
    """Uniform on ``±gain * sqrt(6 / (fan_in + fan_out))`` (Flux's default for weights;
    ``mlx.nn.init.glorot_uniform``).

    >>> from fluxlike import glorot_uniform
    >>> w = glorot_uniform((30, 20))
    >>> w.shape, w.dtype, bool(abs(w).max() <= (6 / 50) ** 0.5)
    ((30, 20), mlx.core.float32, True)
    """
    shape = _shape(shape, "glorot_uniform")
    if len(shape) >= 2:
        return _from_mlx(nn.init.glorot_uniform(), shape, gain)
    fan_in, fan_out = _fans(shape)
    limit = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return mx.random.uniform(-limit, limit, shape)


def glorot_normal(shape: Shape, gain: float = 1.0) -> mx.array:
    """Normal with standard deviation ``gain * sqrt(2 / (fan_in + fan_out))``
    (``mlx.nn.init.glorot_normal``).

    >>> from fluxlike import glorot_normal
    >>> glorot_normal((3, 3, 3, 2)).shape
    (3, 3, 3, 2)
    """
    shape = _shape(shape, "glorot_normal")
    if len(shape) >= 2:
        return _from_mlx(nn.init.glorot_normal(), shape, gain)
    fan_in, fan_out = _fans(shape)
    return gain * math.sqrt(2.0 / (fan_in + fan_out)) * mx.random.normal(shape)


def kaiming_uniform(shape: Shape, gain: float = math.sqrt(2.0)) -> mx.array:
    """Uniform on ``±gain * sqrt(3 / fan_in)`` (He initialisation, for ReLU layers;
    ``mlx.nn.init.he_uniform`` with Flux's default gain ``√2``).

    >>> from fluxlike import kaiming_uniform
    >>> bool(abs(kaiming_uniform((64, 6))).max() <= 1.0)  # sqrt(2) * sqrt(3 / 6)
    True
    """
    shape = _shape(shape, "kaiming_uniform")
    if len(shape) >= 2:
        return _from_mlx(nn.init.he_uniform(), shape, "fan_in", gain)
    fan_in, _ = _fans(shape)
    limit = gain * math.sqrt(3.0 / fan_in)
    return mx.random.uniform(-limit, limit, shape)


def kaiming_normal(shape: Shape, gain: float = math.sqrt(2.0)) -> mx.array:
    """Normal with standard deviation ``gain / sqrt(fan_in)`` (``mlx.nn.init.he_normal``
    with Flux's default gain ``√2``).

    >>> from fluxlike import kaiming_normal
    >>> kaiming_normal((8, 3, 3, 4)).shape
    (8, 3, 3, 4)
    """
    shape = _shape(shape, "kaiming_normal")
    if len(shape) >= 2:
        return _from_mlx(nn.init.he_normal(), shape, "fan_in", gain)
    fan_in, _ = _fans(shape)
    return gain / math.sqrt(fan_in) * mx.random.normal(shape)


def truncated_normal(shape: Shape, *, mean: float = 0.0, std: float = 1.0, lo: float = -2.0,
                     hi: float = 2.0) -> mx.array:
    """Normal with ``mean`` and ``std``, truncated to ``[lo, hi]`` (absolute bounds, as in
    Flux; MLX's ``mx.random.truncated_normal`` draws it).

    >>> from fluxlike import truncated_normal
    >>> w = truncated_normal((1000,), std=0.1, lo=-0.1, hi=0.1)
    >>> bool(abs(w).max() <= 0.1)
    True
    """
    shape = _shape(shape, "truncated_normal")
    std = _positive(std, "truncated_normal", "std")
    if not lo < hi:
        raise ValueError(f"[truncated_normal] needs lo < hi, got lo={lo!r}, hi={hi!r}")
    z = mx.random.truncated_normal((lo - mean) / std, (hi - mean) / std, shape)
    return mean + std * z


def orthogonal(shape: Shape, gain: float = 1.0) -> mx.array:
    """A (semi-)orthogonal matrix times ``gain`` (Saxe et al., 2014): with the shape seen as
    ``(shape[0], prod(shape[1:]))``, its rows are orthonormal when there are fewer rows than
    columns, else its columns. As Flux, from the QR decomposition of a ``(max, min)`` normal
    matrix, signs fixed by ``R``'s diagonal so that the result is uniform (Haar) over
    orthogonal matrices. (``mlx.nn.init.orthogonal`` decomposes a ``max × max`` matrix and
    takes 2-D shapes only.)

    >>> import mlx.core as mx
    >>> from fluxlike import orthogonal
    >>> w = orthogonal((3, 5))
    >>> bool(mx.allclose(w @ w.T, mx.eye(3), atol=1e-5))
    True
    """
    shape = _shape(shape, "orthogonal", min_ndim=2)
    rows, cols = shape[0], math.prod(shape[1:])
    q, r = mx.linalg.qr(mx.random.normal((max(rows, cols), min(rows, cols))), stream=mx.cpu)
    q = q * mx.sign(mx.diag(r))
    q = q.T if rows < cols else q
    return (gain * q).reshape(shape)


def sparse_init(shape: Shape, *, sparsity: float, std: float = 0.01) -> mx.array:
    """A 2-D ``(out, in)`` matrix of normal entries (standard deviation ``std``) of which
    ``ceil(sparsity * out)`` in each column are zero (Martens, 2010), as Flux's
    ``sparse_init``: each input feeds a fixed fraction of the outputs. (This is
    ``mlx.nn.init.sparse`` of the transposed shape: MLX zeroes a fraction of each row.)

    >>> from fluxlike import sparse_init
    >>> w = sparse_init((4, 3), sparsity=0.5)
    >>> (w == 0).sum(axis=0).tolist()
    [2, 2, 2]
    """
    shape = _shape(shape, "sparse_init")
    if len(shape) != 2:
        raise ValueError(f"[sparse_init] takes 2-D shapes (out, in) only, got {shape}")
    if not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool) \
            or not 0 <= sparsity <= 1:
        raise ValueError(f"[sparse_init] sparsity must be in [0, 1], got {sparsity!r}")
    std = _positive(std, "sparse_init", "std")
    return _from_mlx(nn.init.sparse(sparsity, std=std), shape[::-1]).T


def identity_init(shape: Shape, *, gain: float = 1.0) -> mx.array:
    """Weights that make a layer the identity map (times ``gain``): zeros for a vector (a
    bias), ``gain`` times the identity matrix (rectangular allowed) for ``(out, in)``, and for
    a convolution kernel ``(out, *kernel, in)`` ``gain`` at the kernel's centre
    ``k // 2`` from channel ``i`` to channel ``i``, so that a :class:`~fluxlike.Conv` with
    ``padding="same"`` passes its input through (Flux's ``identity_init``, whose centre is
    mirrored because Flux's ``Conv`` flips its kernel). The map is the identity only where
    ``in == out``.

    >>> import mlx.core as mx
    >>> from fluxlike import Conv, identity_init
    >>> identity_init((2, 3)).tolist()
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    >>> layer = Conv((3, 3), 2, 2, padding="same", init=identity_init)
    >>> x = mx.random.normal((1, 4, 4, 2))
    >>> bool(mx.array_equal(layer(x), x))
    True
    """
    shape = _shape(shape, "identity_init")
    weights = np.zeros(shape, dtype=np.float32)
    if len(shape) >= 2:
        centre = tuple(k // 2 for k in shape[1:-1])
        for i in range(min(shape[0], shape[-1])):
            at = (i, *centre, i)  # (built first: mypy reads w[(a, *b)] as Python 3.11's w[a, *b])
            weights[at] = gain
    return mx.array(weights)


def ones32(shape: Shape) -> mx.array:
    """Float32 ones of ``shape`` (``mx.ones``).

    >>> from fluxlike import ones32
    >>> ones32((2,))
    array([1, 1], dtype=float32)
    """
    return mx.ones(_shape(shape, "ones32"), dtype=mx.float32)


def zeros32(shape: Shape) -> mx.array:
    """Float32 zeros of ``shape`` (``mx.zeros``): an initialiser that starts a layer at zero.

    >>> from fluxlike import zeros32
    >>> zeros32((2,))
    array([0, 0], dtype=float32)
    """
    return mx.zeros(_shape(shape, "zeros32"), dtype=mx.float32)
