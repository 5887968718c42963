"""The core of attention: scaled dot-product attention of heads, with its masks, and the
one place its dtypes are decided (float32 softmax; CPU half precision off MLX's half GEMM)."""

from __future__ import annotations

import mlx.core as mx

from .. import workarounds
from . import kernels, operands
from .state import HALF

Mask = mx.array | str | None


def attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None,
    dropout: float = 0.0, return_weights: bool = False,
) -> tuple[mx.array, mx.array | None]:
    """Scaled dot-product attention of heads ``(batch, heads, L, d)``, and its weights
    (``None`` where MLX's fused ``scaled_dot_product_attention`` computed it without them).

    ``mask``: ``None``, ``"causal"``, a boolean array (``True`` = attend) or an additive one.
    The fused kernel runs unless weights or dropout are asked for, the operands are float64
    (its softmax is only float32-accurate there), they are half precision on the CPU, where
    it would run MLX's scalar half GEMM, or the native companion's softmax takes the CPU's
    float32 scores (MLX's fused kernel is its own softmax over them there, whose ``exp`` is
    scalar: 12-15 ms against 3 for attention's ``(4, 8, 128, 128)`` scores on AMD EPYC Zen 3):
    then the scores and the weighted sum go through :func:`~fluxlike.precision.kernels.matmul`
    (oneDNN's bfloat16 or float16 kernels where the native companion has them for the dtype,
    else the emulation's float32 kernels;
    the same roundings either way: half operands, float32 accumulation, half results) and the
    softmax runs in float32, as in the fused kernel
    (:func:`~fluxlike.precision.kernels.softmax`: oneDNN's where the companion is in use).

    >>> import mlx.core as mx
    >>> q = mx.ones((1, 2, 3, 4), mx.bfloat16)
    >>> out, weights = attend(q, q, q, 0.5, "causal", return_weights=True)
    >>> out.shape, out.dtype, weights.shape
    ((1, 2, 3, 4), mlx.core.bfloat16, (1, 2, 3, 3))
    """
    fused = workarounds.fast_kernels_exact(q.dtype) and not (dropout or return_weights)
    half_cpu = operands.half_on_cpu(q, k, v)
    native_softmax = q.dtype == mx.float32 and kernels.choose(
        "softmax", mx.float32, q) == kernels.NATIVE
    if fused and not (half_cpu or native_softmax):
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            mask = _finite(mask.astype(q.dtype))  # sdpa wants the scores' dtype
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask), None
    scores = kernels.matmul(kernels.scale(q, scale), k, transpose_b=True)
    # The softmax runs in float32 at least, as sdpa's does.
    scores = operands.convert(scores, mx.float32) if scores.dtype in HALF else scores
    if isinstance(mask, str):
        lq, lk = scores.shape[-2:]
        mask = mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        # finfo.min rather than -inf: a fully masked row averages, as in sdpa.
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    elif mask is not None:
        scores = _finite(scores + mask.astype(scores.dtype))
    # float32 scores on oneDNN where it is in use; exact in float64 (MLX's) too
    weights = kernels.softmax(scores)
    if dropout:
        keep = mx.random.bernoulli(1 - dropout, weights.shape)
        weights = mx.where(keep, weights / (1 - dropout), mx.zeros_like(weights))
    weights = operands.convert(weights, v.dtype)
    return kernels.matmul(weights, v), weights


def _finite(x: mx.array) -> mx.array:
    """``x`` with ``-inf`` raised to its dtype's lowest finite value: a row that an additive
    mask blocks everywhere then gives a finite result instead of NaN (which would reach every
    gradient of the batch); with ``-inf`` it averages, as a boolean mask does. A float32 mask
    of ``-1e9`` is ``-inf`` once autocast has cast it to float16."""
    return mx.maximum(x, mx.array(mx.finfo(x.dtype).min, x.dtype))
