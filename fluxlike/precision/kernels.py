"""The compute kernels of the down-policy layers, and the one place their backend is chosen.

Layers call these instead of ``@``/``mx.conv_general`` directly. Each kernel takes its
operands in the dtype :mod:`.operands` decides, asks :func:`choose` which backend computes
them, and calls it:

- ``"native"``: fluxlike's oneDNN primitives (:mod:`fluxlike.native`) on the CPU, where the
  companion is in use: float32; bfloat16 (in oneDNN's bfloat16 kernels where the CPU has
  them; elsewhere in its float32 kernels with bfloat16's roundings, the primitive upcasting
  its operands while it runs); float16 linear layers, convolutions and attention's products
  (in oneDNN's float16 kernels where the CPU has AVX512-FP16; else linear layers and
  convolutions upcast so, attention's products emulated);
- ``"emulated"``: the rest of half precision on the CPU (attention's products without
  oneDNN's kernels for their dtype, transposed convolutions) in MLX's float32 kernels with half
  precision's numerics (:mod:`.emulation`), since MLX's own half-precision CPU kernels are
  scalar loops;
- ``"mlx"``: MLX's own kernel (on a GPU, for float64, for mixed dtypes, and for float32 where
  the native companion is not in use).

Numerics are the same whichever runs: half operands, float32 accumulation, one rounding of
the result; a ReLU is applied before that rounding (it commutes with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import workarounds
from ..native import _loader
from ..native import ops as native_ops
from ..native.ops import _KNOWN_ACTS, split_act
from . import castcache, emulation
from .operands import convert, match_input, one_dtype, operands
from .state import HALF, PLAIN, Context, context

NATIVE, EMULATED, MLX = "native", "emulated", "mlx"
# Float32 convolutions outside differentiation take the native kernel from this many
# multiply-adds of their implicit GEMM (N * prod(out) x prod(kernel) * C_in / groups x C_out);
# below it MLX's own kernel was as fast (bench/native.py, "Convolutions"). In training, and in
# bfloat16, the native kernel is faster at every size measured.
NATIVE_CONV_MIN_MACS = 2**17

_F32, _BF16, _F16 = mx.float32, mx.bfloat16, mx.float16
_HALF = frozenset(HALF)
# The ops whose native kernels take float16 on every CPU: products in oneDNN's float16 kernels
# where it has them (AVX512-FP16), else in float32 kernels, upcast inside the primitive; max
# pooling through casts (MLX's own float16 pooling is ten times slower).
_UPCAST_F16 = frozenset(("linear", "conv", "max_pool", "gelu", "sigmoid", "tanh", "exp",
                         "scale"))
# And those that take it only in oneDNN's float16 kernels (attention's batched products).
_NATIVE_F16 = frozenset(("matmul",))
_EMULABLE = frozenset(("linear", "conv", "conv_transpose", "matmul", "quantized_linear"))
_switch = _loader.switch  # .ext read per call: the companion's module, or None
_state = context.get  # bound once: read on every call of every layer

Padding = tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]]
Activation = Callable[[mx.array], mx.array]


def choose(op: str, dtype: mx.Dtype | None, x: mx.array | None = None,
           w: mx.array | None = None, geometry: tuple | None = None) -> str:
    """The backend that computes kernel ``op`` on operands of one ``dtype`` (``None``: mixed
    dtypes) on the default device now: ``"native"``, ``"emulated"`` or ``"mlx"`` (see the
    module's docs). ``x`` and ``w`` are the operands where the choice depends on their shapes
    (``matmul``, ``conv``, ``softmax``, ``max_pool``); ``geometry`` is a convolution's
    ``(stride, padding, dilation)``.

    >>> import mlx.core as mx
    >>> a, b = mx.ones((2, 3, 4), mx.float16), mx.ones((2, 4, 5), mx.float16)
    >>> choose("matmul", mx.float16, a, b) in ("native", "emulated", "mlx")  # per CPU, device
    True
    >>> choose("linear", None), choose("linear", mx.float64)
    ('mlx', 'mlx')
    """
    if dtype is None or mx.default_device().type is not mx.cpu:
        return MLX
    half = dtype in _HALF
    if not half and dtype != _F32:
        return MLX
    if _switch.ext is not None and (
            dtype != _F16 or op in _UPCAST_F16 or (_switch.f16 and op in _NATIVE_F16)) and (
            _TAKES[op](dtype, x, w, geometry)):
        return NATIVE
    return EMULATED if half and op in _EMULABLE else MLX


def switched_off() -> bool:
    """Whether the native companion is loaded but switched off (inside
    ``fluxlike.native.disabled()``): then what fluxlike puts in MLX's place is MLX's own
    (:mod:`.stock`), for ``mx.export_function``."""
    return _switch.loaded is not None and _switch.ext is None


def _takes_linear(dtype: mx.Dtype, x: Any = None, w: Any = None, geometry: Any = None) -> bool:
    """float32 and half precision: bfloat16 and float16 in oneDNN's kernels for them where the
    CPU has them (AVX512-BF16, AVX512-FP16); else in its float32 kernels, the primitive
    upcasting its half operands while it runs (so a backward pass keeps them in half
    precision, as the emulation does, with one graph node per product instead of the
    emulation's casts and custom gradient)."""
    return True


def _takes_matmul(dtype: mx.Dtype, a: mx.array, b: mx.array, geometry: Any) -> bool:
    """Half-precision products of two or more axes in oneDNN's kernels for their dtype
    (attention's scores and weighted sums: MLX's CPU float32 matmul costs more on such small
    batched products than oneDNN's bfloat16 one, and its float16 one casts to float32 and
    back around it)."""
    native = _switch.bf16 if dtype == _BF16 else _switch.f16 and dtype == _F16
    return native and a.ndim >= 2 and b.ndim >= 2 and a.size > 0 and b.size > 0


def _takes_conv(dtype: mx.Dtype, x: mx.array, w: mx.array, geometry: tuple) -> bool:
    """1-3 spatial axes; in training always (faster than MLX's at every size measured, and
    MLX's convolution gradient has no ``mx.vmap``), else from :data:`NATIVE_CONV_MIN_MACS`
    (half precision: always; in float32 kernels the primitive upcasts its operands while it
    runs, so a backward pass keeps them in half precision, as the emulation does)."""
    if x.ndim < 3 or x.ndim > 5:
        return False
    if dtype != _F32 or _state().differentiating:
        return True
    stride, padding, dilation = geometry
    lo, hi = padding if isinstance(padding[0], tuple) else (padding, padding)
    rows = x.shape[0]
    for n, k, s, d, a, b in zip(x.shape[1:-1], w.shape[1:-1], stride, dilation, lo, hi,
                                strict=True):
        rows *= max(0, (n + a + b - d * (k - 1) - 1) // s + 1)
    return rows * (w.size // w.shape[0]) * w.shape[0] >= NATIVE_CONV_MIN_MACS


def _takes_softmax(dtype: mx.Dtype, x: mx.array, w: Any, geometry: Any) -> bool:
    """float32 scores (attention's on the CPU, in float32 and under half precision): MLX's
    CPU softmax runs a scalar ``exp`` on the Linux wheel."""
    return dtype == _F32 and x.ndim >= 1 and x.size > 0


def _takes_max_pool(dtype: mx.Dtype, x: mx.array, w: Any, geometry: Any) -> bool:
    return x.size > 0


def _takes_gelu(dtype: mx.Dtype, x: mx.array, w: Any, geometry: Any) -> bool:
    """Every floating dtype but float64, every size: MLX's CPU ``erf`` and ``exp`` are scalar
    on the Linux wheel (its GELU 20x the native pass at a million entries)."""
    return True


def _takes_elementwise(dtype: mx.Dtype, x: mx.array, w: Any, geometry: Any) -> bool:
    """Every floating dtype but float64, every size: MLX's CPU ``exp`` and ``tanh`` are scalar
    on the Linux wheel (sigmoid, tanh and exp 13-16x the native passes)."""
    return True


def _never(*args: Any) -> bool:
    return False


def _takes_scale(dtype: mx.Dtype, *_: Any) -> bool:
    """float16 only (MLX's CPU float16 multiply converts each value in software; its float32
    and bfloat16 ones are vectorised)."""
    return dtype == _F16


_TAKES: dict[str, Callable[..., bool]] = {
    "linear": _takes_linear, "matmul": _takes_matmul, "conv": _takes_conv,
    "softmax": _takes_softmax, "max_pool": _takes_max_pool, "gelu": _takes_gelu,
    "sigmoid": _takes_elementwise, "tanh": _takes_elementwise, "exp": _takes_elementwise,
    "conv_transpose": _never, "quantized_linear": _never, "scale": _takes_scale,
}


def _split(act: Activation) -> tuple[bool, Activation | None]:
    """``(fuse a ReLU into the native kernel, activation applied after it)``."""
    try:
        known = _KNOWN_ACTS.get(act)
    except TypeError:  # an unhashable callable (an nn.Module): split_act says
        known = None
    return known if known is not None else split_act(act)


def linear(
    x: mx.array, weight: mx.array, bias: mx.array | None = None,
    act: Activation | None = None, layer: str = "linear",
) -> mx.array:
    """``act(x @ weight.T + bias)`` with ``weight`` of shape ``(out, in)``, in the compute
    dtype of :func:`~fluxlike.precision.operands.operands`; ``act`` (an activation, default
    none) is given here so that a ReLU can run before the rounding of half precision, or
    inside the native kernel; ``layer`` names the caller in errors.

    >>> import mlx.core as mx
    >>> y = linear(mx.ones((2, 3), mx.bfloat16), mx.ones((4, 3), mx.bfloat16))
    >>> y.shape, y.dtype
    ((2, 4), mlx.core.bfloat16)
    """
    state = _state()
    if state.cpu is None and state.gpu is None:
        # The everyday float32 call (no autocast; training too), with as little Python as can
        # be: the companion's entry (which decides in C++ what choose() decides for float32
        # operands, and declines what is not its), or outside training one addmm.
        ext = _switch.ext
        if ext is not None:
            fused, after = (False, None) if act is None else _split(act)
            try:
                y = ext.plain_linear(x, weight, bias, fused)
            except TypeError:  # not an mx.array: the general path below says what it is
                y = None
            if y is not None:
                return y if after is None else after(y)
        if state is PLAIN and weight.itemsize == 4 and type(x) is mx.array and x.dtype == _F32:
            y = x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)
            return y if act is None else act(y)
    if not (state.differentiating or state.shapeless) and type(x) is mx.array:
        y = _on_kept_casts(state, x, weight, bias, act)  # repeated inference, CPU half
        if y is not None:
            return y
    elif state.differentiating and state.cpu is not None and _switch.ext is not None:
        y = _with_fused_casts(state.cpu, x, weight, bias, act, layer)  # training, CPU half
        if y is not None:
            return y
    x, weight, bias = operands(x, weight, bias, layer=layer)
    dtype = one_dtype(x, weight, bias)
    backend = choose("linear", dtype)
    if backend == NATIVE:
        fused, after = (False, None) if act is None else _split(act)
        try:
            y = _switch.ext.matmul(x, weight, bias, False, True, fused, None, False,  # type: ignore[union-attr]  # NATIVE: in use
                                   _switch.bf16)
            return y if after is None else after(y)
        except ValueError:  # a bias of another shape, or a shape error: MLX's says it
            backend = EMULATED if dtype in _HALF else MLX
    if backend == EMULATED:
        return emulation.linear(act, x, weight, *(() if bias is None else (bias,)))
    # The row-major custom gradients cannot be traced shapeless (MLX cannot infer their
    # output shapes): there the plain ops are differentiated.
    if state.differentiating and not state.shapeless:
        y = workarounds.row_major_linear(x, weight, bias)
    elif bias is None:
        y = x @ weight.T
    else:
        y = workarounds.affine(x, weight, bias, state.shapeless)
    return y if act is None else act(y)


def _on_kept_casts(state: Context, x: mx.array, weight: mx.array, bias: mx.array | None,
                   act: Activation | None) -> mx.array | None:
    """``linear`` in half precision on the CPU outside differentiation (inside a scope, or a
    half model's own dtype) on the weights' casts kept from earlier calls: the native kernel
    on the kept half casts, or a float32 kernel on the kept float32 values of the rounded
    weights. ``None`` where that does not apply, and the first time a weight is seen (or a
    tracer of ``mx.grad``/``mx.compile``): then the custom gradient's path runs, which keeps
    no float32 copies for a backward pass."""
    if mx.default_device().type is not mx.cpu:  # an enum member: identity is enough
        return None
    dtype, wdtype = state.cpu, weight.dtype
    if dtype is None:
        if wdtype not in _HALF:
            return None
        dtype = wdtype
    elif wdtype != _F32 and wdtype != dtype:
        return None
    given = x.dtype
    if given != _F32 and given != dtype:
        return None
    params = (weight,) if bias is None else (weight, bias)
    # choose("linear", dtype) on the CPU outside differentiation, inline (every layer call):
    # half precision is native wherever the companion is in use.
    if _switch.ext is not None:
        fused, after = (False, None) if act is None else _split(act)
        kept = castcache.casts_if_seen(params, dtype)
        if kept is None:
            return None
        xh = convert(x, dtype) if given == _F32 else x
        # (Float32 weights only, whose kept casts mean they were seen before: a half
        # model's own weights may be a transformation's tracers, and would be held twice.)
        packed = (castcache.packed_weights(weight, kept[0])
                  if dtype == _BF16 and wdtype == _F32 and _switch.bf16 and weight.ndim == 2
                  else None)
        if packed is not None:  # the weights in oneDNN's own layout, reordered once
            y = _switch.ext.packed_linear(xh, kept[0], kept[1] if bias is not None else None,  # type: ignore[union-attr]  # NATIVE: in use
                                          packed, fused, dtype)
        else:
            y = _switch.ext.matmul(xh, kept[0], kept[1] if bias is not None else None,  # type: ignore[union-attr]  # NATIVE: in use
                                   False, True, fused, None, False, _switch.bf16)
        return y if after is None else after(y)
    return emulation.linear_on_kept(x, params, dtype, act)


def _with_fused_casts(dtype: mx.Dtype, x: mx.array, weight: mx.array, bias: mx.array | None,
                      act: Activation | None, layer: str) -> mx.array | None:
    """``linear`` while fluxlike differentiates in a half-precision scope on the CPU, where
    the native product runs in float32 kernels anyway (float16 and bfloat16 without oneDNN's
    kernels for them): float32 weights and bias are given to it as they are, and it reads
    them rounded to ``dtype`` (``compute_dtype``): the casts' values and gradients bit for
    bit, without a cast node for each, forward and backward. (A weight used several
    times in one step, as a recurrent layer's are, gets each use's gradient as the casts give
    it, summed in float32, where the casts' own gradients were summed in half precision.)
    ``None`` where that does not apply (then the casts are made)."""
    if dtype not in _HALF or (_switch.bf16 if dtype == _BF16 else _switch.f16) or (
            mx.default_device().type is not mx.cpu):
        return None
    for p in (weight, bias):
        if p is not None and p.dtype != _F32 and p.dtype != dtype:
            return None  # float64 parameters are not cast; another half dtype is
    # The input is cast as before, so that the backward pass keeps it in half precision (a
    # float32 input, a LayerNorm's output feeding a projection, would be kept in float32).
    x = match_input(x, weight, layer, dtype)
    fused, after = (False, None) if act is None else _split(act)
    try:
        y = _switch.ext.matmul(x, weight, bias, False, True, fused, None, False, False,  # type: ignore[union-attr]  # checked by the caller
                               compute_dtype=dtype)
    except ValueError:  # a bias of another shape, or a shape error: the general path says it
        return None
    return y if after is None else after(y)


def matmul(a: mx.array, b: mx.array, *, transpose_b: bool = False) -> mx.array:
    """``a @ b`` for operands of one dtype (``a @ b.swapaxes(-1, -2)`` with
    ``transpose_b``). Half operands on the CPU keep half-precision numerics (float32
    accumulation, the result rounded once to their dtype).

    >>> import mlx.core as mx
    >>> matmul(mx.ones((2, 3), mx.float16), mx.ones((3, 5), mx.float16)).dtype
    mlx.core.float16
    >>> matmul(mx.ones((2, 3), mx.bfloat16), mx.ones((5, 3), mx.bfloat16), transpose_b=True).shape
    (2, 5)
    """
    backend = choose("matmul", one_dtype(a, b), a, b)
    if backend == NATIVE:
        return native_ops.matmul(a, b, transpose_b=transpose_b)
    b = b.swapaxes(-1, -2) if transpose_b else b
    return emulation.matmul(a, b) if backend == EMULATED else a @ b


def gelu(x: mx.array) -> mx.array:
    """GELU in its exact form, ``x * Φ(x)``, in ``x``'s dtype: the native pass where
    :func:`choose` takes it (the CPU with the companion in use; float32, bfloat16 or
    float16), else ``mlx.nn.gelu``. The native pass evaluates MLX's approximation of ``erf``
    (Abramowitz and Stegun 7.1.26) in float32 and rounds once, written so that negative
    inputs keep their relative accuracy (``1 + erf`` cancels there in MLX's): the two agree to
    5e-7 absolute in float32 (``tests/native/test_gelu.py``).

    >>> import mlx.core as mx
    >>> [round(v, 5) for v in gelu(mx.array([-1.0, 0.0, 2.0])).tolist()]
    [-0.15866, 0.0, 1.9545]
    """
    if type(x) is mx.array and choose("gelu", x.dtype, x) == NATIVE:
        return _switch.ext.gelu(x)  # type: ignore[union-attr]  # NATIVE: in use
    return nn.gelu(x)


def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + exp(-x))`` in ``x``'s dtype: the native pass where :func:`choose` takes it
    (the CPU with the companion in use; float32, bfloat16 or float16, computed in float32 and
    rounded once), else :func:`fluxlike.workarounds.sigmoid`. MLX's CPU ``exp`` is scalar on
    the Linux wheel: the native pass is 16x faster, and within 3 ulp of the exact value in
    float32 where MLX's sigmoid is within 63 (``tests/native/test_logistic.py``).

    >>> import mlx.core as mx
    >>> [round(v, 5) for v in sigmoid(mx.array([-1.0, 0.0, 2.0])).tolist()]
    [0.26894, 0.5, 0.8808]
    """
    if type(x) is not mx.array:
        return mx.sigmoid(x)  # (a Python scalar, a NumPy array)
    if choose("sigmoid", x.dtype, x) == NATIVE:
        return _switch.ext.sigmoid(x)  # type: ignore[union-attr]  # NATIVE: in use
    return workarounds.sigmoid(x)


def tanh(x: mx.array) -> mx.array:
    """``tanh(x)`` in ``x``'s dtype: the native pass where :func:`choose` takes it (as
    :func:`sigmoid`; 14x faster than MLX's scalar one, within 2 ulp in float32), else
    ``mx.tanh``.

    >>> import mlx.core as mx
    >>> [round(v, 5) for v in tanh(mx.array([-1.0, 0.0, 2.0])).tolist()]
    [-0.76159, 0.0, 0.96403]
    """
    if type(x) is mx.array and choose("tanh", x.dtype, x) == NATIVE:
        return _switch.ext.tanh(x)  # type: ignore[union-attr]  # NATIVE: in use
    return mx.tanh(x)


def exp(x: mx.array) -> mx.array:
    """``exp(x)`` in ``x``'s dtype: the native pass where :func:`choose` takes it (as
    :func:`sigmoid`: 13x faster than MLX's scalar one on the CPU, within 1 ulp in float32
    where the result is normal; for the losses' and ``logsumexp``'s exponentials), else
    ``mx.exp``.

    >>> import mlx.core as mx
    >>> [round(v, 5) for v in exp(mx.array([-1.0, 0.0, 2.0])).tolist()]
    [0.36788, 1.0, 7.38906]
    """
    if type(x) is mx.array and choose("exp", x.dtype, x) == NATIVE:
        return _switch.ext.exp(x)  # type: ignore[union-attr]  # NATIVE: in use
    return mx.exp(x)


def max_shifted(v: mx.array, axis: int | tuple[int, ...] | None) -> tuple[mx.array, mx.array]:
    """``(v - max, max)`` along ``axis`` (kept), with the maximum's gradient stopped: the
    difference is exact, so ``log(sum(exp(v - max)))`` loses nothing for large ``|v|``
    (``mx.logsumexp`` of ``[-1e5, -1e5]`` is ``-1e5 + 0.6931`` rounded to float32, and
    ``v - logsumexp(v)`` then keeps only that rounding: -0.6953). A row of ``-inf`` shifts
    by 0, not by ``-inf``.

    >>> import mlx.core as mx
    >>> from fluxlike.precision.kernels import max_shifted
    >>> shifted, top = max_shifted(mx.array([[3.0, 1.0]]), -1)
    >>> shifted.tolist(), top.tolist()
    ([[0.0, -2.0]], [[3.0]])
    """
    top = _row_maximum(v, axis)
    return v - top, top


def _row_maximum(v: mx.array, axis: int | tuple[int, ...] | None) -> mx.array:
    """:func:`max_shifted`'s maximum: kept axes, gradient stopped, an infinite one 0."""
    top = mx.stop_gradient(mx.max(v, axis=axis, keepdims=True))
    return mx.where(mx.isinf(top), mx.zeros_like(top), top)


def logsumexp_shifted(v: mx.array, axis: int | tuple[int, ...] | None) -> tuple[mx.array,
                                                                                mx.array]:
    """``(log(sum(exp(v - top))), top)`` along ``axis`` (kept), ``top`` the maximum as
    :func:`max_shifted` takes it. Over the last axis of a float32 ``v`` with the native
    companion in use, one vectorised pass that stores no exponential (and one for its
    gradient, ``exp(v - top - lse)``): MLX's CPU ``logsumexp`` and its gradient run a scalar
    ``exp``, and the ops here four passes (a (512, 32000) cross entropy with its gradient:
    568 ms in MLX's, 67 ms native, AMD EPYC Zen 3). The losses' and
    :func:`fluxlike.logsumexp`'s.

    >>> import mlx.core as mx
    >>> lse, top = logsumexp_shifted(mx.array([[3.0, 3.0]]), -1)
    >>> round(lse.item(), 4), top.item()
    (0.6931, 3.0)
    """
    if (type(v) is mx.array and v.dtype == _F32 and v.ndim >= 1 and isinstance(axis, int)
            and axis in (-1, v.ndim - 1) and choose("exp", _F32, v) == NATIVE):
        top = _row_maximum(v, -1)
        return _switch.ext.log_sum_exp(v, top), top  # type: ignore[union-attr]  # NATIVE
    shifted, top = max_shifted(v, axis)
    return mx.log(mx.sum(exp(shifted), axis=axis, keepdims=True)), top


def stable_logsoftmax(v: mx.array, axis: int = -1) -> mx.array:
    """``v - logsumexp(v)`` along ``axis``, max-shifted so that it is exact to the last
    float32 bit for any magnitude (the losses use it too); in ``v``'s dtype.

    >>> import mlx.core as mx
    >>> from fluxlike.precision.kernels import stable_logsoftmax
    >>> stable_logsoftmax(mx.array([-1e5, -1e5])).tolist()
    [-0.6931471824645996, -0.6931471824645996]
    """
    lse, top = logsumexp_shifted(v, axis)
    return (v - top) - lse


def stable_logsumexp(v: mx.array, axis: int | None = -1, keepdims: bool = False) -> mx.array:
    """``log(sum(exp(v)))`` along ``axis`` (``None``: all), max-shifted; in ``v``'s dtype.

    >>> import mlx.core as mx
    >>> from fluxlike.precision.kernels import stable_logsumexp
    >>> stable_logsumexp(mx.array([1e5, 1e5])).item()
    100000.6953125
    """
    lse, top = logsumexp_shifted(v, axis)
    out = lse + top
    return out if keepdims else (out.reshape(()) if axis is None else out.squeeze(axis))


def scale(x: mx.array, factor: float) -> mx.array:
    """``x * factor`` in ``x``'s dtype, bit for bit (the factor rounded to that dtype, the
    product rounded once), and its gradient likewise. A float16 ``x`` on the CPU is scaled in
    float32 between the native companion's casts, where the product of two float16 values is
    exact: MLX's CPU float16 multiply converts every value in software (attention's query
    scaling took 3.6% of a charlm-sized transformer's float16 training step; through float32,
    three vectorised passes).

    >>> import mlx.core as mx
    >>> x = mx.array([1.0, 3.0, -0.1], mx.float16)
    >>> mx.array_equal(scale(x, 0.3), x * 0.3).item()
    True
    """
    if choose("scale", x.dtype, x) == NATIVE:
        factor32 = mx.array(factor, x.dtype).astype(_F32)  # rounded as MLX rounds a scalar
        return convert(convert(x, _F32) * factor32, x.dtype)
    return x * factor


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (:func:`fluxlike.workarounds.softmax`), for attention's
    float32 scores: oneDNN's vectorised float32 softmax, forward and backward, where the
    native companion is in use (MLX's CPU softmax runs a scalar ``exp``; the numerics are
    float32's either way).

    >>> import mlx.core as mx
    >>> softmax(mx.zeros((1, 4))).tolist()
    [[0.25, 0.25, 0.25, 0.25]]
    """
    if choose("softmax", x.dtype, x) == NATIVE:
        return _switch.ext.softmax(x)  # type: ignore[union-attr]  # NATIVE: in use
    return workarounds.softmax(x)


def hashable(value: Any) -> Any:
    """``value`` with lists turned into tuples, so that it can key a cache."""
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


def conv(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: Padding,
    dilation: tuple[int, ...],
    groups: int,
    bias: mx.array | None = None,
    act: Activation | None = None,
) -> mx.array:
    """``act(convolution + bias)``, N-d, channels last: ``x`` is ``(N, *spatial, C_in)``,
    ``weight`` is ``(C_out, *kernel, C_in // groups)``, ``bias`` (optional) ``(C_out,)``;
    ``padding`` is per dimension, or a ``(low, high)`` pair of per-dimension tuples. On CPU
    half precision the bias is added (and a ReLU applied) in float32 before the one
    rounding, as :func:`linear` does.

    >>> import mlx.core as mx
    >>> x, w = mx.ones((1, 5, 5, 2), mx.bfloat16), mx.ones((3, 3, 3, 2), mx.bfloat16)
    >>> y = conv(x, w, (1, 1), (1, 1), (1, 1), 1)
    >>> y.shape, y.dtype
    ((1, 5, 5, 3), mlx.core.bfloat16)
    """
    return _convolved(("conv", stride, padding, dilation, groups), x, weight, bias, act)


def conv_transpose(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    output_padding: tuple[int, ...],
    groups: int,
    bias: mx.array | None = None,
    act: Activation | None = None,
) -> mx.array:
    """``act(transposed convolution + bias)``, N-d, channels last; ``weight`` is
    ``(C_out, *kernel, C_in // groups)``; the bias and activation as in :func:`conv`.

    >>> import mlx.core as mx
    >>> x, w = mx.ones((1, 4, 2), mx.float16), mx.ones((3, 3, 2), mx.float16)
    >>> y = conv_transpose(x, w, (2,), (0,), (1,), (0,), 1)
    >>> y.shape, y.dtype
    ((1, 9, 3), mlx.core.float16)
    """
    options = ("conv_transpose", stride, padding, dilation, output_padding, groups)
    return _convolved(options, x, weight, bias, act)


def _convolved(options: tuple, x: mx.array, weight: mx.array, bias: mx.array | None,
               act: Activation | None) -> mx.array:
    """What :func:`conv` and :func:`conv_transpose` share: the kernel ``options``, then the
    bias and activation (in float32 before the rounding on CPU half precision)."""
    x, weight, bias = operands(x, weight, bias, layer=options[0])
    if x.size == 0:
        # An empty input (batch, or a spatial axis with padding around it): MLX's convolution
        # gradients fail on one (a reshape error; SIGFPE, which kills the process, for the
        # transposed one). The convolution's output is MLX's, all zeros whatever the weights
        # (their gradient zero), the bias added as usual.
        y = mx.stop_gradient(emulation.plain_kernel(*hashable(options))(x, weight))
        y = y if bias is None else y + bias
        return y if act is None else act(y)
    backend = choose(options[0], one_dtype(x, weight, bias), x, weight, options[1:4])
    if backend == NATIVE:
        stride, padding, dilation, groups = options[1:]
        lo, hi = padding if isinstance(padding[0], (tuple, list)) else (padding, padding)
        return native_ops.conv_spelled_out(x, weight, bias, stride, lo, hi, dilation, groups,
                                           act)
    options = hashable(options)  # (keys the kernels' caches)
    if backend == EMULATED:
        return emulation.convolved(options, act, x, weight, *(() if bias is None else (bias,)))
    y = emulation.plain_kernel(*options)(x, weight)
    if bias is not None:
        y = y + bias
    return y if act is None else act(y)


def max_pool(x: mx.array, window: tuple[int, ...], stride: tuple[int, ...],
             padding: tuple[tuple[int, int], ...]) -> mx.array | None:
    """``MaxPool``'s native kernel (oneDNN's pooling) where :func:`choose` takes it: the CPU
    with the native kernels in use, a floating input (float64 aside) that is not empty; ``None``
    elsewhere (the layer then runs MLX's ops). ``padding`` is ``(low, high)`` per spatial
    axis."""
    if choose("max_pool", x.dtype, x) != NATIVE:
        return None
    lo, hi = zip(*padding, strict=True)
    return native_ops.max_pool(x, window, stride=stride, padding=(lo, hi))


def quantized_linear(
    x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None,
    bias: mx.array | None = None, *, group_size: int, bits: int, mode: str = "affine",
    layer: str = "quantized_linear",
) -> mx.array:
    """``x @ dequantize(weight).T + bias`` for a quantized ``weight`` (``mx.quantize``'s
    ``weight``, ``scales``, ``biases``), as ``nn.QuantizedLinear`` computes it. Inside an
    autocast scope the activations, scales, quantization biases and ``bias`` are in the
    compute dtype (the packed weight is integer and never cast); on the CPU the product of
    those half operands runs in float32 and is rounded once, as :func:`linear` does.

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> w, s, b = mx.quantize(mx.ones((64, 64)), group_size=64, bits=4)
    >>> with autocast(mx.bfloat16):
    ...     quantized_linear(mx.ones((2, 64)), w, s, b, group_size=64, bits=4).dtype
    mlx.core.bfloat16
    """
    if not isinstance(x, mx.array) or not mx.issubdtype(x.dtype, mx.floating):
        got = x.dtype if isinstance(x, mx.array) else type(x).__name__
        raise TypeError(f"[{layer}] expected a floating-point mx.array input, got {got}")
    x, scales, biases, bias = _quantized_operands(x, scales, biases, bias)
    options: dict[str, Any] = {"transpose": True, "group_size": group_size, "bits": bits,
                               "mode": mode}
    if choose("quantized_linear", one_dtype(x, scales, biases, bias)) == EMULATED:
        cached = castcache.cached_cast
        scales32, biases32, bias32 = (None if p is None else cached(p, _F32)
                                      for p in (scales, biases, bias))
        y = mx.quantized_matmul(x.astype(_F32), weight, scales32, biases32,  # type: ignore[arg-type]  # scales are given
                                **options)
        y = y if bias32 is None else y + bias32
        return y.astype(x.dtype)
    y = mx.quantized_matmul(x, weight, scales, biases, **options)
    return y if bias is None else y + bias


def _quantized_operands(x: mx.array, scales: mx.array, *params: mx.array | None
                        ) -> tuple[Any, ...]:
    """The activations, scales and floating parameters of a quantized product in the scope's
    compute dtype (as :func:`~fluxlike.precision.operands.operands`, the packed weight
    aside)."""
    from .operands import scope_dtype

    dtype = scope_dtype(scales)
    if dtype is None:
        return (x, scales, *params)
    cached = castcache.cached_cast
    return (x.astype(dtype) if x.dtype != dtype else x, cached(scales, dtype),
            *(None if p is None else cached(p, dtype) for p in params))
