"""Attention: ``MultiHeadAttention`` on ``mx.fast.scaled_dot_product_attention``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from ..checks import check_active, check_flag, check_real, check_size, checked_init
from ..init import glorot_uniform
from ..modes import is_active
from ..precision.attention import Mask, attend
from ..precision.policy import autocast_policy
from .base import Layer, signature_of
from .basic import Dense


@autocast_policy("down")
class MultiHeadAttention(Layer):
    """Multi-head scaled dot-product attention, as in "Attention Is All You Need".

    ``MultiHeadAttention(dims, nheads, *, bias=False, dropout=0.0, kdims=None, vdims=None,
    init=glorot_uniform, active=None)``: the children ``q_proj``, ``k_proj``, ``v_proj`` and
    ``out_proj`` are :class:`~fluxlike.Dense` layers ``dims => dims``, ``kdims => dims``,
    ``vdims => dims`` and ``dims => dims`` (``kdims`` defaults to ``dims``, ``vdims`` to
    ``kdims``); ``dims`` must be a multiple of ``nheads``.

    ``mha(q, k=None, v=None, *, mask=None, return_weights=False)``: ``q`` is
    ``(batch, Lq, dims)``, ``k`` is ``(batch, Lk, kdims)`` (default ``q``: self-attention) and
    ``v`` is ``(batch, Lk, vdims)`` (default ``k``). The result is ``(batch, Lq, dims)``, or
    ``(output, weights)`` with the attention weights ``(batch, nheads, Lq, Lk)`` when
    ``return_weights=True``. ``mask`` is one of

    - ``None``: attend everywhere;
    - ``"causal"``: query ``i`` attends keys ``j <= i + Lk - Lq`` (MLX's lower-right alignment,
      the usual causal mask when ``Lq == Lk``);
    - a boolean array, ``True`` where attention is allowed;
    - a floating array added to the scores (``-inf`` or a large negative number blocks; a
      row blocked everywhere gives a finite result rather than NaN, and with ``-inf`` the
      average of the values, as a boolean mask does),

    and an array mask must broadcast to ``(batch, nheads, Lq, Lk)``. Attention dropout with
    probability ``dropout`` is applied to the weights only in training mode (see
    :func:`fluxlike.modes.is_active`; ``active=None`` decides automatically, ``True`` or
    ``False`` fixes the mode, as for :class:`~fluxlike.Dropout`), computing the softmax
    explicitly in float32; otherwise the core is MLX's fused ``scaled_dot_product_attention``.

    >>> import mlx.core as mx
    >>> from fluxlike import MultiHeadAttention
    >>> mha = MultiHeadAttention(64, 8)
    >>> mha
    MultiHeadAttention(64, nheads=8)  # 16_384 parameters
    >>> x = mx.ones((2, 10, 64))
    >>> mha(x, mask="causal").shape
    (2, 10, 64)
    >>> out, weights = mha(x, mx.ones((2, 6, 64)), return_weights=True)
    >>> weights.shape
    (2, 8, 10, 6)
    >>> MultiHeadAttention(64, 8, dropout=0.1, active=False)
    MultiHeadAttention(64, nheads=8, dropout=0.1, active=False)  # 16_384 parameters
    """

    def __init__(
        self,
        dims: int,
        nheads: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        kdims: int | None = None,
        vdims: int | None = None,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
        active: bool | None = None,
    ):
        super().__init__()
        name = "MultiHeadAttention"
        dims = check_size(dims, name, "dims")
        nheads = check_size(nheads, name, "nheads")
        kdims = dims if kdims is None else check_size(kdims, name, "kdims")
        vdims = kdims if vdims is None else check_size(vdims, name, "vdims")
        if dims % nheads:
            raise ValueError(f"[{name}] dims={dims} must be divisible by nheads={nheads}; "
                             f"choose nheads among the divisors of {dims}")
        dropout = check_real(dropout, name, "dropout", lambda v: 0 <= v < 1,
                             "a probability in [0, 1)")
        bias = check_flag(bias, name, "bias")
        active = check_active(active, name)
        init = checked_init(init, name)  # an init error names this layer, not its Dense
        self.nheads = nheads
        self.dropout = dropout
        self.active = active
        self.q_proj = Dense(dims, dims, bias=bias, init=init)
        self.k_proj = Dense(kdims, dims, bias=bias, init=init)
        self.v_proj = Dense(vdims, dims, bias=bias, init=init)
        self.out_proj = Dense(dims, dims, bias=bias, init=init)

    def __call__(
        self,
        q: mx.array,
        k: mx.array | None = None,
        v: mx.array | None = None,
        *,
        mask: Mask = None,
        return_weights: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        k = q if k is None else k
        v = k if v is None else v
        # By item: the children as attributes go through nn.Module.__getattr__, which is slow.
        projections = self["q_proj"], self["k_proj"], self["v_proj"]
        self._check_inputs((q, k, v), projections)
        mask = self._check_mask(mask, (q.shape[0], self.nheads, q.shape[1], k.shape[1]))
        q, k, v = (self._heads(p(x)) for p, x in zip(projections, (q, k, v), strict=True))
        out, weights = self._attend(q, k, v, mask, return_weights)
        batch, heads, length, size = out.shape
        out = self["out_proj"](out.transpose(0, 2, 1, 3).reshape(batch, length, heads * size))
        return (out, cast(mx.array, weights)) if return_weights else out  # weights: asked for

    def _heads(self, x: mx.array) -> mx.array:
        """``(batch, L, dims)`` split into ``(batch, nheads, L, dims // nheads)``."""
        batch, length, dims = x.shape  # (no -1: it cannot be inferred for an empty batch)
        return x.reshape(batch, length, self.nheads, dims // self.nheads).transpose(0, 2, 1, 3)

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: Mask, return_weights: bool
    ) -> tuple[mx.array, mx.array | None]:
        """The attention of the heads, and its weights (``None`` where sdpa computed it)."""
        dropout = self.dropout if self.dropout > 0 and is_active(self) else 0.0
        return attend(q, k, v, 1 / math.sqrt(q.shape[-1]), mask, dropout, return_weights)

    @staticmethod
    def _check_inputs(qkv: tuple[Any, Any, Any], projections: tuple[Dense, Dense, Dense]) -> None:
        name = "MultiHeadAttention"
        for what, x, proj in zip(("query", "key", "value"), qkv, projections, strict=True):
            features = proj["weight"].shape[1]
            if not isinstance(x, mx.array):
                raise TypeError(f"[{name}] expected an mx.array {what}, got {type(x).__name__}")
            if not mx.issubdtype(x.dtype, mx.floating):
                raise TypeError(f"[{name}] expected a floating-point {what}, got {x.dtype}; "
                                f"convert it first, e.g. x.astype(mx.float32)")
            if x.ndim != 3 or x.shape[-1] != features:
                raise ValueError(f"[{name}] expected {what} of shape (batch, length, "
                                 f"{features}), got shape {tuple(x.shape)}")
            if x.shape[1] == 0:
                raise ValueError(f"[{name}] expected a {what} of length at least 1, got shape "
                                 f"{tuple(x.shape)}")
        q, k, v = qkv
        if not q.shape[0] == k.shape[0] == v.shape[0]:
            raise ValueError(f"[{name}] query, key and value must have one batch size, got "
                             f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"[{name}] key and value must have one length, got shapes "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")

    @staticmethod
    def _check_mask(mask: Any, target: tuple[int, int, int, int]) -> Mask:
        name = "MultiHeadAttention"
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            return mask
        if isinstance(mask, str):
            raise ValueError(f"[{name}] the only mask name is 'causal', got {mask!r}")
        if not isinstance(mask, mx.array):
            raise TypeError(f"[{name}] mask must be None, 'causal' or an mx.array, got {mask!r}")
        if mask.dtype != mx.bool_ and not mx.issubdtype(mask.dtype, mx.floating):
            raise TypeError(f"[{name}] mask must be boolean (True = attend) or floating "
                            f"(added to the scores), got {mask.dtype}")
        shape = tuple(mask.shape)
        trailing = zip(shape[::-1], target[::-1], strict=False)  # numpy broadcasting
        if len(shape) > 4 or any(m not in (1, t) for m, t in trailing):
            raise ValueError(f"[{name}] mask of shape {shape} does not broadcast to "
                             f"(batch, nheads, Lq, Lk) = {target}")
        return mask

    def signature(self) -> str:
        dims, kdims = self.k_proj.weight.shape
        vdims = self.v_proj.weight.shape[1]
        options: dict[str, Any] = {"nheads": self.nheads}
        if self.q_proj.bias is not None:
            options["bias"] = True
        if self.dropout:
            options["dropout"] = self.dropout
        if kdims != dims:
            options["kdims"] = kdims
        if vdims != kdims:
            options["vdims"] = vdims
        if self.active is not None:
            options["active"] = self.active
        return signature_of([str(dims)], "MultiHeadAttention", **options)
