"""Policies for MLX's stock layers, so an unmodified ``mlx.nn`` model runs under autocast.

Inside a scope, ``nn.Linear``, the convolutions, ``nn.MultiHeadAttention`` and the quantized
linear layer run the forwards below instead of their own: the same computations through
:mod:`.kernels`, which cast at the op, so that half precision on the CPU takes the
float32 kernels instead of MLX's scalar half-precision GEMM. A tied embedding head
(``nn.Embedding.as_linear``, ``nn.QuantizedEmbedding.as_linear``) computes in the compute
dtype too; the lookups stay in the weights' dtype, as in PyTorch. ``nn.Bilinear`` and the
recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) run their own forwards with their
parameters' casts swapped in, on MLX's native kernels.

After a half-precision converter (``bf16mix``, ``f16``...), these forwards serve some calls
outside a scope too, with the dtypes the layer's own forward would compute in (no input is
converted that MLX would not convert): ``nn.Linear``, the convolutions,
``nn.QuantizedLinear`` and the tied heads (``as_linear``) given an input of their own half
dtype on the CPU, where their own forwards would run MLX's scalar half kernels (50x slower
than fluxlike's), and ``nn.MultiHeadAttention`` with half projections on any device, whose own
forward hands a float32 additive mask to ``mx.fast.scaled_dot_product_attention`` with half
scores, which MLX refuses ("Mask type must promote to output type"): the mask is cast to the
scores' dtype, as under autocast (a boolean mask is kept). This routing starts with the first
``autocast`` or half-precision converter of the process; a model made half otherwise
(``set_dtype``, half weights loaded) gets it after ``fluxlike.precision.policy.activate()``.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from . import kernels, operands
from .attention import attend
from .policy import autocast_policy
from .state import HALF, context, on_first_use


def _per_dim(value: int | tuple[int, ...], n: int) -> tuple[int, ...]:
    """``value`` for each of ``n`` dimensions, as Python ints. MLX's layers keep a numpy
    integer (``stride=np.int64(2)``) as it was given, and their own forward accepts it."""
    if isinstance(value, (int, numbers.Integral)):
        return (int(value),) * n
    return tuple(int(v) for v in value)


def _bias(layer: nn.Module) -> mx.array | None:
    """The layer's bias, added in the kernel's float32 before the one rounding on the CPU."""
    return layer["bias"] if "bias" in layer else None


def _linear(self: nn.Linear, x: mx.array) -> mx.array:
    return kernels.linear(x, self["weight"], _bias(self), None, type(self).__name__)


def _conv(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    return kernels.conv(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), getattr(self, "groups", 1), _bias(self),
    )


def _conv_transpose(self: nn.Module, x: mx.array) -> mx.array:
    n = self["weight"].ndim - 2
    return kernels.conv_transpose(
        x, self["weight"], _per_dim(self.stride, n), _per_dim(self.padding, n),
        _per_dim(self.dilation, n), _per_dim(self.output_padding, n), getattr(self, "groups", 1),
        _bias(self),
    )


def _multi_head_attention(
    self: nn.MultiHeadAttention, queries: mx.array, keys: mx.array, values: mx.array,
    mask: mx.array | str | None = None,
) -> mx.array:
    heads = self.num_heads
    queries, keys, values = (
        mx.unflatten(proj(x), -1, (heads, -1)).transpose(0, 2, 1, 3)
        for proj, x in ((self.query_proj, queries), (self.key_proj, keys),
                        (self.value_proj, values))
    )
    output, _ = attend(queries, keys, values, math.sqrt(1 / queries.shape[-1]), mask)
    return self.out_proj(output.transpose(0, 2, 1, 3).flatten(-2, -1))


def _quantized(self: nn.Module, x: mx.array, bias: mx.array | None) -> mx.array:
    return kernels.quantized_linear(
        x, self["weight"], self["scales"], self.get("biases"), bias,
        group_size=self.group_size, bits=self.bits, mode=getattr(self, "mode", "affine"),
        layer=type(self).__name__,
    )


def _quantized_linear(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    return _quantized(self, x, _bias(self))


def _tied_head(self: nn.Embedding, x: mx.array) -> mx.array:
    return kernels.linear(x, self["weight"], None, None, f"{type(self).__name__}.as_linear")


def _quantized_tied_head(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    return _quantized(self, x, None)


def _dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a (possibly quantized) layer computes in: its weight's, or its scales'."""
    return (layer["scales"] if "scales" in layer else layer["weight"]).dtype


def half_on_cpu(layer: nn.Module, x: object, *args: object, **kwargs: object) -> bool:
    """Outside a scope: whether ``layer``'s own forward would run MLX's half-precision CPU
    kernels on ``x``, an input of the layer's own half dtype on the CPU (a model after
    ``bf16mix``, ``f16``...). Its forward through :mod:`.kernels` then runs instead, in the
    same dtype, on fluxlike's kernels (oneDNN's bfloat16 where built, else float32 kernels
    with half precision's numerics).

    >>> import mlx.core as mx
    >>> import mlx.nn as nn
    >>> layer = nn.Linear(2, 3)
    >>> half_on_cpu(layer, mx.ones((1, 2))), half_on_cpu(layer, mx.ones((1, 2), mx.bfloat16))
    (False, False)
    >>> layer.set_dtype(mx.bfloat16)
    >>> with mx.stream(mx.cpu):
    ...     half_on_cpu(layer, mx.ones((1, 2), mx.bfloat16))
    True
    """
    if type(x) is not mx.array or x.itemsize != 2:  # cheap: every float32 call leaves here
        return False
    dtype = x.dtype
    return (dtype in HALF and _dtype(layer) == dtype
            and mx.default_device().type is mx.cpu)  # an enum member: identity is enough


def half_attention(layer: nn.MultiHeadAttention, *args: object, **kwargs: object) -> bool:
    """Outside a scope: whether an ``nn.MultiHeadAttention`` was converted to half precision
    (its query projection is half): its forward through :func:`.attention.attend` then runs,
    which casts a floating mask to the scores' dtype as autocast does.

    >>> import mlx.core as mx
    >>> import mlx.nn as nn
    >>> layer = nn.MultiHeadAttention(8, 2)
    >>> half_attention(layer)
    False
    >>> layer.set_dtype(mx.float16)
    >>> half_attention(layer)
    True
    """
    return _dtype(layer.query_proj) in HALF


_cls: type[nn.Module]
for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    autocast_policy("down", forward=_conv, unscoped=half_on_cpu)(_cls)
for _cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    autocast_policy("down", forward=_conv_transpose, unscoped=half_on_cpu)(_cls)
autocast_policy("down", forward=_linear, unscoped=half_on_cpu)(nn.Linear)
autocast_policy("down", forward=_quantized_linear, unscoped=half_on_cpu)(nn.QuantizedLinear)
autocast_policy("down", forward=_multi_head_attention, unscoped=half_attention)(
    nn.MultiHeadAttention)
for _cls in (nn.Bilinear, nn.RNN, nn.GRU, nn.LSTM):
    autocast_policy("down")(_cls)
for _cls in (nn.LayerNorm, nn.RMSNorm):
    autocast_policy("fp32")(_cls)
for _cls in (nn.BatchNorm, nn.InstanceNorm, nn.GroupNorm):
    autocast_policy("fp32", keep_float32=True)(_cls)
autocast_policy("none", methods={"as_linear": _tied_head}, unscoped=half_on_cpu)(nn.Embedding)
autocast_policy("none", methods={"as_linear": _quantized_tied_head}, unscoped=half_on_cpu)(
    nn.QuantizedEmbedding)
autocast_policy("none")(nn.Dropout)


# ---------------------------------------------------------------- mx.fast's attention

_mlx_sdpa = mx.fast.scaled_dot_product_attention


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: mx.array | str | None = None, sinks: mx.array | None = None,
                                 force_fused: bool = False, stream: Any = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` once fluxlike is in use (:func:`install`
    replaces MLX's function, which upstream models call themselves: mlx-lm's attention
    layers). On the CPU, MLX's kernel is its own softmax over scores it computes in the
    operands' dtype: half-precision scores take its scalar half GEMM, and its ``exp`` is
    scalar in every dtype. So these run
    :func:`.attention.attend` instead (fluxlike's GEMM and native softmax, float32 scores,
    the same roundings as the fused kernel): half-precision operands on the CPU (autocast's
    outputs, a converted model's; where fluxlike's half products are emulated, from
    :data:`MIN_EMULATED_QUERIES` queries), and float32 ones inside fluxlike's autocast,
    ``gradient`` or ``train`` where the native softmax is in use; masks None, ``"causal"`` or
    boolean. mlx-lm's Llama at width 512 (AMD EPYC Zen 3): a bfloat16 training step 1.54 s
    through MLX's kernel against 0.93 s. Grouped-query attention (fewer key/value heads)
    repeats each key/value head for its query heads. Every other call (the GPU, float64, an
    additive mask, ``sinks``, a ``stream`` or ``force_fused``, a shapeless trace, inside
    ``fluxlike.native.disabled()``) is MLX's own. (A function with it that MLX itself
    compiles shapeless, ``mx.compile(..., shapeless=True)``, cannot trace fluxlike's emulated
    half products: use ``fluxlike.compile``, which leaves the call to MLX there.)

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> q = mx.ones((1, 4, 3, 8))
    >>> with autocast(mx.bfloat16, device="cpu"):
    ...     out = mx.fast.scaled_dot_product_attention(
    ...         q.astype(mx.bfloat16), q[:, :2].astype(mx.bfloat16),
    ...         q[:, :2].astype(mx.bfloat16), scale=0.35, mask="causal")
    >>> out.shape, out.dtype
    ((1, 4, 3, 8), mlx.core.bfloat16)
    """
    if sinks is None and not force_fused and stream is None and _routed(q, k, v, mask):
        heads, kv_heads = q.shape[1], k.shape[1]
        if kv_heads != heads:  # grouped-query: each key/value head serves heads // kv_heads
            k, v = (mx.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
        return attend(q, k, v, scale, mask)[0]
    return _mlx_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=force_fused,
                     stream=stream)


# Below this many queries, half-precision attention stays MLX's where fluxlike's half products
# are emulated (no bfloat16 instructions): each call converts the whole key/value cache to
# float32, which costs more than MLX's scalar product for a few queries against a long cache
# (generation: one query against 8192 keys, 8 heads of 128, 83 ms routed against 31; 16 queries
# against 2048 keys, 9.7 against 49.6; AMD EPYC Zen 3).
MIN_EMULATED_QUERIES = 16


def _routed(q: object, k: object, v: object, mask: object) -> bool:
    """Whether :func:`scaled_dot_product_attention` takes this call (see there)."""
    if kernels.switched_off():  # (native.disabled(): MLX's own, which export can serialise)
        return False
    if not (type(q) is mx.array and type(k) is mx.array and type(v) is mx.array
            and q.ndim == k.ndim == v.ndim == 4 and k.shape[1] == v.shape[1]
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
        return False
    # Masks as MLX takes them and means them alike: None, "causal", a boolean array (an
    # additive one is MLX's: its rows of -inf give NaN there, and its dtype rules differ).
    if not (mask is None or (isinstance(mask, str) and mask == "causal") or (
            type(mask) is mx.array and mask.dtype == mx.bool_ and mask.ndim <= 4)):
        return False
    state = context.get()
    if state.shapeless:  # (attend's masks are shape-dependent Python)
        return False
    if operands.half_on_cpu(q, k, v):
        return q.shape[2] >= MIN_EMULATED_QUERIES or kernels.choose(
            "matmul", q.dtype, q, k) == kernels.NATIVE
    return (q.dtype == mx.float32 and (state.differentiating or state.cpu is not None)
            and k.dtype == v.dtype == mx.float32
            and kernels.choose("softmax", mx.float32, q) == kernels.NATIVE)


# ---------------------------------------------------------------- mlx.nn's activations

_mlx_activations = {name: getattr(nn, name) for name in ("silu", "gelu", "gelu_approx")}
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _native(op: str, x: object) -> bool:
    """Half precision on the CPU with the native pass in use: float32 stays MLX's (a float32
    model exports with mx.export_function, which cannot serialise fluxlike's primitives)."""
    return (type(x) is mx.array and x.dtype in HALF
            and kernels.choose(op, x.dtype, x) == kernels.NATIVE)


def silu(x: mx.array) -> mx.array:
    """``mlx.nn.silu`` once fluxlike is in use (:func:`install`): for half precision on the
    CPU (autocast's outputs, a converted model's), ``x * sigmoid(x)`` with the native sigmoid
    (MLX's ``exp`` is scalar there: 13x); else MLX's. Upstream models call it themselves
    (mlx-lm's SwiGLU).

    >>> import mlx.core as mx
    >>> [round(v, 3) for v in silu(mx.array([-1.0, 0.0, 2.0], mx.bfloat16)).tolist()]
    [-0.27, 0.0, 1.758]
    """
    if _native("sigmoid", x):
        return x * kernels.sigmoid(x)
    return _mlx_activations["silu"](x)


def gelu(x: mx.array) -> mx.array:
    """``mlx.nn.gelu`` once fluxlike is in use: for half precision on the CPU, the native GELU
    (the same exact form, ``x * Φ(x)``: :func:`.kernels.gelu`); else MLX's.

    >>> import mlx.core as mx
    >>> [round(v, 3) for v in gelu(mx.array([-1.0, 0.0, 2.0], mx.bfloat16)).tolist()]
    [-0.158, 0.0, 1.953]
    """
    if _native("gelu", x):
        return kernels.gelu(x)
    return _mlx_activations["gelu"](x)


def gelu_approx(x: mx.array) -> mx.array:
    """``mlx.nn.gelu_approx`` once fluxlike is in use: its formula, ``0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3)))``, for half precision on the CPU with the native tanh (and ``x^3``
    as products: MLX's ``power`` and ``tanh`` are scalar there); else MLX's.

    >>> import mlx.core as mx
    >>> [round(v, 3) for v in gelu_approx(mx.array([-1.0, 0.0, 2.0], mx.bfloat16)).tolist()]
    [-0.158, 0.0, 1.953]
    """
    if _native("tanh", x):
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
        return 0.5 * x * (1 + kernels.tanh(inner))
    return _mlx_activations["gelu_approx"](x)


# ---------------------------------------------------------------- mlx.nn's cross entropy

_mlx_cross_entropy = nn.losses.cross_entropy
_REDUCTIONS = ("none", "mean", "sum")


def cross_entropy(logits: mx.array, targets: mx.array, weights: mx.array | None = None,
                  axis: int = -1, label_smoothing: float = 0.0,
                  reduction: Literal["none", "mean", "sum"] = "none") -> mx.array:
    """``mlx.nn.losses.cross_entropy`` once fluxlike is in use (mlx-lm's training loss calls it
    itself). On the CPU, MLX's is its ``logsumexp``, whose ``exp`` is scalar (and whose gradient
    is a softmax with the same scalar ``exp``): a (512, 32000) float32 loss and its gradient
    took 568 ms there and 67 ms on the native pass (AMD EPYC Zen 3). So this computes
    MLX's formula with :func:`.kernels.logsumexp_shifted` (one native pass): for
    half-precision logits on the CPU (in float32, the loss returned in the logits' dtype, as
    MLX's), and for float32 ones inside fluxlike's ``autocast``, ``gradient`` or ``train``,
    over the last axis, targets class indices or probabilities. Everything else (another axis,
    the GPU, float64, no logits, arguments MLX refuses, which raise its errors) is MLX's own.
    One difference: a row with a ``+inf`` logit has an infinite loss here (NaN in MLX's; both
    give NaN gradients).

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> logits = mx.array([[2.0, -1.0], [-1.0, 2.0]])
    >>> with autocast(mx.bfloat16, device="cpu"):
    ...     loss = cross_entropy(logits, mx.array([0, 1]), reduction="mean")
    >>> round(loss.item(), 5)
    0.04859
    """
    if not _loss_routed(logits, targets, weights, axis, label_smoothing, reduction):
        return _mlx_cross_entropy(logits, targets, weights=weights, axis=axis,
                                  label_smoothing=label_smoothing, reduction=reduction)
    # MLX's formula, on the logits less their maximum (top): that difference picked at the
    # target (bit for bit the shifted logit), or weighted by the probabilities
    v = logits.astype(mx.float32)
    lse, top = kernels.logsumexp_shifted(v, -1)
    if targets.ndim == logits.ndim:
        score = mx.sum((v - top) * targets, axis=-1, keepdims=True)
    else:
        score = mx.take_along_axis(v, mx.expand_dims(targets, -1), -1) - top
    if label_smoothing > 0:  # (1 - s) of the score, s of the logits' mean
        loss = lse - (1 - label_smoothing) * score - label_smoothing * (
            v.mean(axis=-1, keepdims=True) - top)
    else:
        loss = lse - score
    loss = loss.squeeze(-1).astype(logits.dtype)
    if weights is not None:
        loss = loss * weights
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _loss_routed(logits: object, targets: object, weights: object, axis: object,
                 label_smoothing: object, reduction: object) -> bool:
    """Whether :func:`cross_entropy` takes this call (see there)."""
    if not (type(logits) is mx.array and type(targets) is mx.array and logits.size > 0
            and isinstance(axis, int) and axis in (-1, logits.ndim - 1)
            and reduction in _REDUCTIONS and isinstance(label_smoothing, (int, float))
            and 0 <= label_smoothing < 1):
        return False
    if targets.ndim == logits.ndim - 1:
        if targets.shape != logits.shape[:-1] or not mx.issubdtype(targets.dtype, mx.integer):
            return False
    elif targets.shape != logits.shape or targets.dtype != logits.dtype:
        return False
    if weights is not None and not (type(weights) is mx.array
                                    and weights.shape == logits.shape[:-1]):
        return False
    if kernels.choose("exp", mx.float32, logits) != kernels.NATIVE:
        return False
    if logits.dtype in HALF:
        return True
    state = context.get()
    return logits.dtype == mx.float32 and (state.differentiating or state.cpu is not None)


# ---------------------------------------------------------------- installing them

_PATCH_VARIABLE = "FLUXLIKE_PATCH_MLX"


def install() -> None:
    """Replace MLX's functions that upstream models call themselves by the ones above (each
    says when it differs from MLX's), at fluxlike's first use in the process (its first
    ``autocast``, converter, ``gradient`` or training step: importing fluxlike changes
    nothing), each only where MLX's own is still in place (nn.GELU's forward calls the
    activations by name; nn.SiLU's holds MLX's ``silu``, so its forward is replaced).
    ``FLUXLIKE_PATCH_MLX=0`` (read then) leaves MLX's own in place."""
    if os.environ.get(_PATCH_VARIABLE, "1").strip().lower() in ("0", "off", "false", "no"):
        return
    import mlx.nn.layers.activations as activations
    import mlx.nn.losses as losses

    replacements: list[tuple[Any, str, Any, Any]] = [
        (mx.fast, "scaled_dot_product_attention", _mlx_sdpa, scaled_dot_product_attention),
        (losses, "cross_entropy", _mlx_cross_entropy, cross_entropy),
        (nn.SiLU, "__call__", _mlx_silu_module, _silu_module),
    ]
    for name, fn in (("silu", silu), ("gelu", gelu), ("gelu_approx", gelu_approx)):
        replacements += [(where, name, _mlx_activations[name], fn) for where in (nn, activations)]
    for module, name, original, fn in replacements:
        if getattr(module, name) is original:  # (a function of the user's own there stays)
            setattr(module, name, fn)


_mlx_silu_module = nn.SiLU.__call__


def _silu_module(self: nn.SiLU, x: mx.array) -> mx.array:
    """``nn.SiLU``'s forward once fluxlike is in use: :func:`silu`."""
    return silu(x)


on_first_use(install)
