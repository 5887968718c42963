"""The compute kernels of the down-policy layers, and the one place their dtypes are decided.

Layers call these instead of ``@``/``mx.conv_general`` directly, so that the rules below hold
everywhere and the CPU can route half precision to fast float32 kernels.

Dtype rules (:func:`operands`): outside an autocast scope a floating input takes its layer's
weight dtype (so an ``f16mix`` model accepts float32 data), except that float64 data given to
a float32 layer is converted with a one-time warning; integer and boolean inputs are a
``TypeError``. Inside a scope with compute dtype ``T`` (on the default device's type) the
input and the float32/float16/bfloat16 parameters are cast to ``T`` here, at the kernel: this
is how fluxlike's own down-policy layers compute in ``T`` while running their own forward on
themselves. A float64 layer is never cast. Weight casts are kept across calls outside
differentiation (:mod:`.castcache`).

Half precision on the CPU: MLX's CPU float16/bfloat16 GEMM and convolution gradients are
scalar loops, far slower than float32 on an optimised BLAS. When the default device is the
CPU and the operands are float16 or bfloat16 (all of one dtype), each kernel here keeps the
numerics of half precision - operands already rounded to the half dtype, float32
accumulation, the result rounded to the half dtype - but runs the arithmetic in float32
kernels: upcast, float32 GEMM/convolution, cast the result down. It is one
``mx.custom_function`` whose backward pass recomputes the float32 upcasts from the saved
half-precision inputs, so only half-precision activations are kept for the backward pass,
and whose cotangents come back in the operands' dtypes. It supports ``mx.grad``/``mx.vjp``
and ``mx.compile`` (not second-order gradients). On a GPU, MLX's native half kernels run.
Inference reuses the kept float32 upcasts of the weights instead (:func:`castcache.reused`).

Native kernels on the CPU (:mod:`fluxlike.native`, where ``./dev`` built them): float32
linear layers, and float32 convolutions whose implicit GEMM pays, run oneDNN's kernels forward
and backward (their weight gradients come back row-major); bfloat16 linear layers and
convolutions run oneDNN's bfloat16 kernels where the CPU has them, in inference and training,
with the same numerics (bfloat16 operands, float32 accumulation, one rounding, bfloat16
activations kept for the backward pass); a ReLU is fused into them. bfloat16 matmuls
(:func:`matmul`: attention's scores and weighted sums) run oneDNN's bfloat16 kernels too, and
:func:`softmax` (attention's float32 scores under CPU half precision) runs oneDNN's.
``MaxPool`` runs oneDNN's pooling (:func:`max_pool`). float16 (and bfloat16 training without
those kernels) stays on the emulation above.

Memory: what the graph retains is about half of float32's for an activation-heavy MLP.
MLX's CPU scheduler, though, allocates each op's output when it queues the op, up to about a
hundred ops ahead of execution, so a measured peak also counts the float32 temporaries queued
meanwhile; ``mx.set_memory_limit`` makes the scheduler wait and caps that. Measured figures
are in ``bench/README.md``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast, overload

import mlx.core as mx

from .. import native, workarounds
from .._mlxtyping import custom_function
from . import castcache
from .state import CASTABLE, HALF, PLAIN, Context, context, device_index

_warned_float64: set[str] = set()
_HALF = frozenset(HALF)
_F32 = mx.float32
_BF16 = mx.bfloat16
_state = context.get  # bound once: read on every call of every layer

Padding = tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]]
Activation = Callable[[mx.array], mx.array]


def commutes_with_rounding(kind: str) -> Callable[[Activation], Activation]:
    """Mark an activation that commutes with rounding to a half dtype,
    ``act(round(y)) == round(act(y))``: ``"identity"`` or ``"relu"`` (whose gradient is the
    mask ``y > 0``). CPU half precision then applies it in float32 before the one rounding.

    >>> from fluxlike import relu
    >>> relu._commutes_with_rounding
    'relu'
    """
    if kind not in ("identity", "relu"):
        raise ValueError(f"commutes_with_rounding: kind must be 'identity' or 'relu', "
                         f"got {kind!r}")

    def mark(act: Activation) -> Activation:
        act._commutes_with_rounding = kind  # type: ignore[attr-defined]  # a mark on the function
        return act

    return mark


def _commuting(act: Activation | None) -> str | None:
    """``"identity"`` for no activation, the mark of a commuting one, else ``None``."""
    return "identity" if act is None else getattr(act, "_commutes_with_rounding", None)


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
            f"[{layer}] float64 input converted to the layer's {weight.dtype}; "
            f"use f64(model) to compute in float64",
            stacklevel=3,
        )
    return x.astype(target)


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
    cast = castcache.cast
    return (x, cast(weight, dtype),
            *(p if p is None or p.dtype not in CASTABLE else cast(p, dtype) for p in params))


def emulates(first: mx.array, *operands: mx.array | None) -> bool:
    """Whether a kernel on these operands runs as half precision in float32 kernels: the
    default device is the CPU and the operands are all float16 or all bfloat16.

    >>> import mlx.core as mx
    >>> emulates(mx.ones(2, dtype=mx.bfloat16), mx.ones(2, dtype=mx.bfloat16))
    True
    >>> emulates(mx.ones(2), mx.ones(2))
    False
    """
    if first.itemsize != 2:  # cheap: float32 layers pass here on every call
        return False
    dtype = first.dtype
    if dtype not in _HALF:
        return False
    for a in operands:  # a plain loop: this runs on every call of a half-precision layer
        if a is not None and a.dtype != dtype:
            return False
    return mx.default_device().type is mx.cpu  # an enum member: identity is enough


def linear(
    x: mx.array, weight: mx.array, bias: mx.array | None = None,
    act: Activation | None = None, layer: str = "linear",
) -> mx.array:
    """``act(x @ weight.T + bias)`` with ``weight`` of shape ``(out, in)``, in the compute
    dtype of :func:`operands`; ``act`` (an activation, default none) is given here so that
    CPU half precision can apply a ReLU before rounding, which gives the same result faster;
    ``layer`` names the caller in errors.

    >>> import mlx.core as mx
    >>> y = linear(mx.ones((2, 3), mx.bfloat16), mx.ones((4, 3), mx.bfloat16))
    >>> y.shape, y.dtype
    ((2, 4), mlx.core.bfloat16)
    """
    # The everyday float32 call first, with as little Python as can be: one oneDNN kernel
    # (which checks the operands in C++ and declines what is not its), or one addmm.
    state = _state()
    if state is PLAIN:
        kernel = _plain_kernel()
        if kernel is not None:
            fused, after = (False, None) if act is None else native.split_act(act)
            try:
                y = kernel(x, weight, bias, fused)
            except TypeError:  # not an mx.array: the general path below says what it is
                y = None
            if y is not None:
                return y if after is None else after(y)
        if weight.itemsize == 4 and type(x) is mx.array and x.dtype == _F32:
            y = x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)
            return y if act is None else act(y)
    if not (state.differentiating or state.shapeless) and type(x) is mx.array:
        kept = _kept_cpu_half(state, x, weight, bias, act)  # repeated inference, CPU half
        if kept is not None:
            return kept
    x, weight, bias = operands(x, weight, bias, layer=layer)
    if _native_takes(x, weight, bias):
        try:
            return native.linear(x, weight, bias, act)
        except ValueError:  # a bias of another shape, or a shape error: as below
            pass
    # The row-major custom gradients cannot be traced shapeless (MLX cannot infer their
    # output shapes): there the plain ops are differentiated.
    row_major = state.differentiating and not state.shapeless
    if bias is None:
        if emulates(x, weight):
            return _emulated_linear(act, x, weight)
        y = _row_major_linear(x, weight) if row_major else x @ weight.T
    elif emulates(x, weight, bias):
        return _emulated_linear(act, x, weight, bias)
    else:
        y = _row_major_affine(x, weight, bias) if row_major else _affine(x, weight, bias)
    return y if act is None else act(y)


def _native_cpu() -> bool:
    """Whether fluxlike's native kernels run here: the companion is in use (decided once in a
    process: :func:`fluxlike.native.native_info`) and the default device is the CPU."""
    return _native_in_use() and mx.default_device().type is mx.cpu


@functools.cache
def _native_in_use() -> bool:
    return native.available()


@functools.cache
def _plain_kernel() -> Callable[[mx.array, mx.array, mx.array | None, bool],
                                mx.array | None] | None:
    """:func:`fluxlike.native.plain_linear_kernel`, asked once per process."""
    return native.plain_linear_kernel() if _native_in_use() else None


def _native_takes(x: mx.array, weight: mx.array, bias: mx.array | None) -> bool:
    """Whether the native kernel computes this linear, forward and backward (CPU, operands of
    one dtype): float32, and bfloat16 where oneDNN has bfloat16 kernels (:func:`fluxlike.native.
    bfloat16_native`). Its backward pass keeps only the bfloat16 input and output, and
    computes each layer's parameter gradients while that layer's cotangent is live, so a
    bfloat16 training step keeps less than the float32-kernel emulation (bench/README.md).
    float16, and bfloat16 without those kernels, stay on the emulation."""
    dtype = x.dtype
    if dtype == _F32:
        return (weight.dtype == _F32 and (bias is None or bias.dtype == _F32)
                and _native_cpu())
    return (dtype == _BF16 and weight.dtype == _BF16 and (bias is None or bias.dtype == _BF16)
            and _native_cpu() and native.bfloat16_native())


def _kept_cpu_half(state: Context, x: mx.array, weight: mx.array, bias: mx.array | None,
                   act: Activation | None) -> mx.array | None:
    """``linear`` in half precision on the CPU outside differentiation (inside a scope, or a
    half model's own dtype): the float32 kernel on the kept float32 values of the rounded
    weights, the input rounded to the half dtype, one rounding of the result. ``None``
    where that does not apply, and the first time a weight is seen (or a tracer of
    ``mx.grad``/``mx.compile``): then the custom gradient's path runs, which keeps no float32
    copies for a backward pass."""
    if mx.default_device().type is not mx.cpu:  # an enum member: identity is enough
        return None
    dtype = state[0]
    wdtype = weight.dtype
    if dtype is None:
        if wdtype not in _HALF:
            return None
        dtype = wdtype
    elif wdtype != _F32 and wdtype != dtype:
        return None
    given = x.dtype
    if given != _F32 and given != dtype:
        return None
    if dtype == _BF16 and _native_cpu():  # oneDNN's bfloat16 kernel on the kept half casts
        wh = castcache.kept(weight, dtype)
        bh = None if bias is None else castcache.kept(bias, dtype)
        if wh is None or (bias is not None and bh is None):
            return None
        return native.linear(x.astype(dtype) if given == _F32 else x, wh, bh, act)
    w32 = castcache.rounded_upcast(weight, dtype)
    b32 = None if bias is None else castcache.rounded_upcast(bias, dtype)
    if w32 is None or (bias is not None and b32 is None):
        # First sight, or a tracer of mx.grad/mx.compile: the custom gradient's path, which
        # keeps no float32 copies for a backward pass.
        return None
    x32 = (x.astype(dtype) if given == _F32 else x).astype(_F32)
    y32 = x32 @ w32.T if b32 is None else mx.addmm(b32, x32, w32.T)
    return rounded(y32, dtype, act)


def _affine(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """``x @ weight.T + bias`` (:func:`fluxlike.workarounds.affine`: not ``addmm`` in a
    shapeless trace)."""
    return workarounds.affine(x, weight, bias, context.get().shapeless)


# MLX differentiates ``x @ weight.T`` into a column-major (transposed) weight gradient, and
# every optimiser op then walks it against the parameter's layout, several times slower than
# on row-major gradients (bench/README.md). While fluxlike differentiates, the
# linear kernels therefore use a backward pass that forms ``dy.T @ x`` (row-major) directly.
def _linear_grads(dy: mx.array, x: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    features = x.shape[-1]
    dy2 = dy.reshape(-1, dy.shape[-1]) if dy.ndim != 2 else dy
    x2 = x.reshape(-1, features) if x.ndim != 2 else x
    return dy @ weight, dy2.T @ x2


def _affine_grads(
    dy: mx.array, x: mx.array, weight: mx.array, bias: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    dx, dweight = _linear_grads(dy, x, weight)
    return dx, dweight, dy.reshape(-1, dy.shape[-1]).sum(axis=0).reshape(bias.shape)


def _kernel_vjp(
    name: str, kernel: Callable[..., mx.array], primals: list[mx.array], cotangent: mx.array
) -> list[mx.array]:
    """The gradients of ``kernel`` at ``primals``; for the linear kernels, with the weight
    gradient row-major."""
    if name == "linear":
        return list(_linear_grads(cotangent, *primals))
    if name == "affine":
        return list(_affine_grads(cotangent, *primals))
    return mx.vjp(kernel, primals, [cotangent])[1]


@custom_function
def _row_major_linear(x: mx.array, weight: mx.array) -> mx.array:
    return x @ weight.T


@custom_function
def _row_major_affine(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    return mx.addmm(bias, x, weight.T)


_row_major_linear.vjp(lambda primals, cotangent, _: _linear_grads(cotangent, *primals))
_row_major_affine.vjp(lambda primals, cotangent, _: _affine_grads(cotangent, *primals))


# Largest float32 temporary (bytes) one piece of an emulated linear layer may make.
CHUNK_BYTES = 4 * 2**20


def _emulated_linear(
    act: Callable | None, x: mx.array, weight: mx.array, *bias: mx.array
) -> mx.array:
    """``linear`` on half operands in float32 kernels, over row blocks of ``x`` when its
    float32 temporaries would be large.

    MLX's CPU scheduler allocates each op's output when it queues the op, up to about a
    hundred ops ahead, so large float32 temporaries add up to a peak well above what the
    step retains; in blocks of at most ``CHUNK_BYTES`` they stay small.
    """
    name = "affine" if bias else "linear"
    features = x.shape[-1]
    rows = x.size // features if features else 0
    step = max(64, CHUNK_BYTES // (4 * max(weight.shape)))
    if x.ndim < 1 or rows <= step or context.get().shapeless:
        return _activated(act, name)(x, weight, *bias)
    flat = x.reshape(rows, features)
    y = _in_float32_rows(name, step)(flat, weight, *bias).reshape(*x.shape[:-1], -1)
    return y if act is None else act(y)


def rounded(
    y32: mx.array, dtype: mx.Dtype, act: Callable[[mx.array], mx.array] | None = None
) -> mx.array:
    """``act(y32.astype(dtype))``: a float32 result rounded to the half ``dtype``, then
    activated. When ``act`` commutes with rounding (none, ReLU), the activation runs in
    float32 first: MLX's bfloat16 elementwise kernels are slower than float32's on the CPU.

    >>> import mlx.core as mx
    >>> from fluxlike import relu
    >>> rounded(mx.array([1.00390625, -2.0]), mx.bfloat16, relu).tolist()
    [1.0, 0.0]
    """
    kind = _commuting(act)
    if kind == "identity" or act is None:  # _commuting: no act is "identity"
        return y32.astype(dtype)
    if kind is None:
        return act(y32.astype(dtype))
    return act(y32).astype(dtype)


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
    dtype = scope_dtype(scales)
    if dtype is not None:
        x = x.astype(dtype) if x.dtype != dtype else x
        scales = castcache.cast(scales, dtype)
        biases, bias = (None if p is None else castcache.cast(p, dtype) for p in (biases, bias))
    options: dict[str, Any] = {"transpose": True, "group_size": group_size, "bits": bits,
                               "mode": mode}
    if emulates(x, scales, biases, bias):
        half = x.dtype
        scales32 = castcache.cast(scales, mx.float32)
        biases32, bias32 = (None if p is None else castcache.cast(p, mx.float32)
                            for p in (biases, bias))
        y = mx.quantized_matmul(x.astype(mx.float32), weight, scales32, biases32, **options)
        y = y if bias32 is None else y + bias32
        return y.astype(half)
    y = mx.quantized_matmul(x, weight, scales, biases, **options)
    return y if bias is None else y + bias


def matmul(a: mx.array, b: mx.array, *, transpose_b: bool = False) -> mx.array:
    """``a @ b`` for operands of one dtype (``a @ b.swapaxes(-1, -2)`` with
    ``transpose_b``). Half operands on the CPU keep half-precision numerics (float32
    accumulation, the result rounded once to their dtype): bfloat16 in oneDNN's bfloat16
    kernels where the native companion has them (:func:`_native_matmul`), otherwise in
    float32 kernels.

    >>> import mlx.core as mx
    >>> matmul(mx.ones((2, 3), mx.float16), mx.ones((3, 5), mx.float16)).dtype
    mlx.core.float16
    >>> matmul(mx.ones((2, 3), mx.bfloat16), mx.ones((5, 3), mx.bfloat16), transpose_b=True).shape
    (2, 5)
    """
    if emulates(a, b):
        if _native_matmul(a, b):
            return native.matmul(a, b, transpose_b=transpose_b)
        return _in_float32("matmul")(a, b.swapaxes(-1, -2) if transpose_b else b)
    return a @ (b.swapaxes(-1, -2) if transpose_b else b)


def _native_matmul(a: mx.array, b: mx.array) -> bool:
    """Whether :func:`matmul` takes the native kernel, forward and backward: bfloat16
    operands (all one dtype: :func:`emulates` said so) of two or more axes, not empty, on the
    CPU where oneDNN has bfloat16 kernels (attention's scores and weighted sums: MLX's CPU
    float32 matmul on such small batched products costs more than oneDNN's bfloat16 one)."""
    return (a.dtype == _BF16 and a.ndim >= 2 and b.ndim >= 2 and a.size > 0 and b.size > 0
            and _native_cpu() and native.bfloat16_native())


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (:func:`fluxlike.workarounds.softmax`), for the float32
    scores of half-precision attention: on the CPU where the native companion is in use,
    oneDNN's vectorised float32 softmax, forward and backward (MLX's CPU softmax runs a
    scalar ``exp``; the numerics are float32's either way).

    >>> import mlx.core as mx
    >>> softmax(mx.zeros((1, 4))).tolist()
    [[0.25, 0.25, 0.25, 0.25]]
    """
    if x.dtype == _F32 and x.ndim >= 1 and x.size > 0 and _native_softmax_cpu():
        return native.softmax(x)
    return workarounds.softmax(x)


@functools.cache
def _native_softmax() -> bool:
    return _native_in_use() and native.provides("softmax")


def forget_native() -> None:
    """Have the routing ask :mod:`fluxlike.native` again whether its kernels are in use (it
    asks once per process): :func:`fluxlike.native.disabled` calls it, and so may code that
    changes what :mod:`fluxlike.native` finds (a test replacing its module)."""
    for decided in _DECISIONS:
        decided.cache_clear()


@functools.cache
def adam_kernel() -> Callable[..., tuple[mx.array, mx.array, mx.array]] | None:
    """:func:`fluxlike.native.adam_kernel` where the kernels are in use, asked once per
    process (fluxlike's Adam and AdamW update float32 and bfloat16 parameters on the CPU with
    it)."""
    return native.adam_kernel() if _native_in_use() else None


@functools.cache
def rmsprop_kernel() -> Callable[..., tuple[mx.array, mx.array]] | None:
    """:func:`fluxlike.native.rmsprop_kernel` where the kernels are in use, asked once per
    process (fluxlike's RMSProp updates float32 and bfloat16 parameters on the CPU with it)."""
    return native.rmsprop_kernel() if _native_in_use() else None


_DECISIONS = (_native_in_use, _plain_kernel, _native_softmax, adam_kernel,
              rmsprop_kernel)  # as defined, even if patched
native.on_switch(forget_native)


def _native_softmax_cpu() -> bool:
    return _native_softmax() and mx.default_device().type is mx.cpu


def conv(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: Padding,
    dilation: tuple[int, ...],
    groups: int,
    bias: mx.array | None = None,
    act: Callable[[mx.array], mx.array] | None = None,
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
    options = ("conv", _frozen(stride), _frozen(padding), _frozen(dilation), groups)
    return _convolved(options, x, weight, bias, act)


def conv_transpose(
    x: mx.array,
    weight: mx.array,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    output_padding: tuple[int, ...],
    groups: int,
    bias: mx.array | None = None,
    act: Callable[[mx.array], mx.array] | None = None,
) -> mx.array:
    """``act(transposed convolution + bias)``, N-d, channels last; ``weight`` is
    ``(C_out, *kernel, C_in // groups)``; the bias and activation as in :func:`conv`.

    >>> import mlx.core as mx
    >>> x, w = mx.ones((1, 4, 2), mx.float16), mx.ones((3, 3, 2), mx.float16)
    >>> y = conv_transpose(x, w, (2,), (0,), (1,), (0,), 1)
    >>> y.shape, y.dtype
    ((1, 9, 3), mlx.core.float16)
    """
    options = ("conv_transpose", _frozen(stride), _frozen(padding), _frozen(dilation),
               _frozen(output_padding), groups)
    return _convolved(options, x, weight, bias, act)


def _convolved(options: tuple, x: mx.array, weight: mx.array, bias: mx.array | None,
               act: Callable[[mx.array], mx.array] | None) -> mx.array:
    """What :func:`conv` and :func:`conv_transpose` share: the kernel ``options``, then the
    bias and activation (in float32 before the rounding on CPU half precision)."""
    x, weight, bias = operands(x, weight, bias, layer=options[0])
    if options[0] == "conv" and _native_convolves(x, weight, bias, *options[1:]):
        stride, padding, dilation, groups = options[1:]
        return native.conv(x, weight, bias, stride=stride, padding=padding,
                           dilation=dilation, groups=groups, act=act)
    if emulates(x, weight, bias):
        return _emulated(options, act, x, weight, *(() if bias is None else (bias,)))
    y = _kernel(*options)(x, weight)
    if bias is not None:
        y = y + bias
    return y if act is None else act(y)


def _native_convolves(x: mx.array, weight: mx.array, bias: mx.array | None,
                      stride: tuple[int, ...], padding: Padding, dilation: tuple[int, ...],
                      groups: int) -> bool:
    """Whether the native kernel computes this convolution: on the CPU, operands of one
    dtype, float32, or bfloat16 (in training only where oneDNN has bfloat16 kernels, as for
    :func:`linear`; elsewhere training stays on the emulation); in training always (forward
    and backward, the kernel is faster than MLX's at every size measured, and MLX's
    convolution gradient has no ``mx.vmap``: per-example gradients), in inference where
    :func:`fluxlike.native.pays` says its implicit GEMM beats MLX's (for bfloat16: always).
    The backward pass computes only the gradients asked for: not the input's of a first
    layer."""
    dtype = x.dtype
    if dtype != weight.dtype or (bias is not None and bias.dtype != dtype):
        return False
    differentiating = _state().differentiating
    if not (dtype == _F32 or (dtype == _BF16 and (native.bfloat16_native()
                                                   or not differentiating))):
        return False
    if not _native_cpu() or x.ndim < 3 or x.ndim > 5:
        return False
    if differentiating:
        return True
    lo, hi = padding if isinstance(padding[0], tuple) else (padding, padding)
    rows = x.shape[0]
    for n, k, s, d, a, b in zip(x.shape[1:-1], weight.shape[1:-1], stride, dilation, lo, hi,
                                strict=True):
        rows *= max(0, (n + a + b - d * (k - 1) - 1) // s + 1)
    inner = weight.size // weight.shape[0]
    return native.pays(rows, inner, weight.shape[0], dtype)


def max_pool(x: mx.array, window: tuple[int, ...], stride: tuple[int, ...],
             padding: tuple[tuple[int, int], ...]) -> mx.array | None:
    """``MaxPool``'s native kernel (:func:`fluxlike.native.max_pool`, oneDNN's pooling) where
    it runs: the CPU with the native kernels in use, a float32 or bfloat16 input that is not
    empty; ``None`` elsewhere (the layer then runs MLX's ops). ``padding`` is ``(low, high)``
    per spatial axis."""
    dtype = x.dtype
    if (dtype != _F32 and dtype != _BF16) or x.size == 0 or not _native_cpu():
        return None
    lo, hi = zip(*padding, strict=True)
    return native.max_pool(x, window, stride=stride, padding=(lo, hi))


def _emulated(options: tuple, act: Callable | None, x: mx.array, weight: mx.array,
              *bias: mx.array) -> mx.array:
    """Kernel ``options`` (plus the bias) on half operands in float32 kernels: with the
    parameters' kept upcasts when an earlier call made them, else through the custom
    gradient."""
    name, *rest = options
    if bias:
        options = (f"{name}+bias", *rest)
    params32 = castcache.reused((weight, *bias), mx.float32)
    if params32 is not None:
        return rounded(_kernel(*options)(x.astype(mx.float32), *params32), x.dtype, act)
    return _activated(act, *options)(x, weight, *bias)


def _frozen(value):
    """``value`` with lists turned into tuples, so that it can key a cache."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@functools.cache
def _kernel(name: str, *options) -> Callable[..., mx.array]:
    """The plain kernel ``name`` with its static options bound: a function of arrays;
    ``"conv+bias"`` (any kernel name with ``+bias``) adds a third operand, the bias."""
    if name.endswith("+bias"):
        plain = _kernel(name.removesuffix("+bias"), *options)
        return lambda x, w, b: plain(x, w) + b
    if name == "linear":
        return lambda x, w: x @ w.T
    if name == "affine":
        return _affine
    if name == "matmul":
        return lambda a, b: a @ b
    if name == "conv":
        stride, padding, dilation, groups = options
        return lambda x, w: mx.conv_general(
            x, w, stride=stride, padding=padding, kernel_dilation=dilation, groups=groups
        )
    stride, padding, dilation, output_padding, groups = options
    fn = {1: mx.conv_transpose1d, 2: mx.conv_transpose2d, 3: mx.conv_transpose3d}[len(stride)]
    one = (lambda t: t[0]) if len(stride) == 1 else (lambda t: t)
    return lambda x, w: fn(
        x, w, stride=one(stride), padding=one(padding), dilation=one(dilation),
        output_padding=one(output_padding), groups=groups,
    )


@functools.cache
def _in_float32(
    name: str, *options, act: Callable[[mx.array], mx.array] | None = None
) -> Callable[..., mx.array]:
    """Kernel ``name`` on half-precision operands, computed by its float32 kernel. With
    ``act=relu`` the ReLU is applied too, in float32 before the rounding (it commutes with
    rounding), and its gradient masks the float32 cotangent by the output's sign: fewer
    passes than a ReLU on the half result, none of them in MLX's slow half kernels."""
    if act is not None and _commuting(act) != "relu":
        raise ValueError(f"_in_float32: only relu is applied before rounding, got {act!r}")
    kernel = _kernel(name, *options)

    def plain(*operands: mx.array) -> mx.array:
        y = kernel(*(a.astype(mx.float32) for a in operands))
        return (y if act is None else act(y)).astype(operands[0].dtype)

    forward = custom_function(plain)

    @forward.vjp
    def backward(operands: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        # Recompute the upcasts from the saved half operands. Tying them to the cotangent
        # keeps MLX from scheduling them (and holding them) before the backward pass gets here.
        upcast = [a.astype(mx.float32) for a in mx.depends(list(operands), [cotangent])]
        cotangent32 = cotangent.astype(mx.float32)
        if act is not None:  # relu'(y) is y > 0, and y > 0 exactly where its rounding is
            # (a product, not mx.where, which is slower on the CPU: bench/README.md)
            cotangent32 = cotangent32 * (output > 0)
        grads = _kernel_vjp(name, kernel, upcast, cotangent32)
        grads = [g.astype(a.dtype) for g, a in zip(grads, operands, strict=True)]
        # The first operand's gradient flows on down the network; making it wait for the
        # others' (weights') has those computed now, while their float32 inputs are live,
        # instead of at the end with every layer's cotangent held until then.
        grads[0] = mx.depends(grads[0], grads[1:])
        return tuple(grads)

    # In a shapeless trace, differentiated through the casts: the same values and roughly the
    # same gradients, without the saved half operands.
    return lambda *operands: (plain if context.get().shapeless else forward)(*operands)


def _activated(act: Callable[[mx.array], mx.array] | None, *options) -> Callable[..., mx.array]:
    """``act`` applied to :func:`_in_float32`'s result; a ReLU is folded into it."""
    kind = _commuting(act)
    if kind == "relu":
        return _in_float32(*options, act=act)
    plain = _in_float32(*options)
    if kind == "identity" or act is None:  # _commuting: no act is "identity"
        return plain
    return lambda *operands: act(plain(*operands))


@functools.cache
def _in_float32_rows(name: str, step: int) -> Callable[..., mx.array]:
    """Like :func:`_in_float32` for a row-wise kernel (``linear``/``affine``) of a 2-D first
    operand, computed ``step`` rows at a time; the blocks are chained with ``mx.depends`` so
    that they run (and free their float32 temporaries) one after another."""
    kernel = _kernel(name)

    def blocks(n: int) -> range:
        return range(0, n, step)

    @custom_function
    def forward(x: mx.array, *params: mx.array) -> mx.array:
        params32 = [p.astype(mx.float32) for p in params]
        outputs: list[mx.array] = []
        for start in blocks(x.shape[0]):
            rows = x[start : start + step]
            if outputs:
                rows = mx.depends(rows, outputs[-1])
            outputs.append(kernel(rows.astype(mx.float32), *params32).astype(x.dtype))
        return mx.concatenate(outputs, axis=0)

    @forward.vjp
    def backward(operands: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        x, *params = operands
        params32 = [p.astype(mx.float32) for p in mx.depends(list(params), [cotangent])]
        sums: list[mx.array] | None = None  # parameter gradients, accumulated in float32
        dxs: list[mx.array] = []
        previous = cotangent
        for start in blocks(x.shape[0]):
            rows, cot = mx.depends([x[start : start + step], cotangent[start : start + step]],
                                   [previous])
            dx, *dparams = _kernel_vjp(
                name, kernel, [rows.astype(mx.float32), *params32], cot.astype(mx.float32)
            )
            sums = dparams if sums is None else [a + b for a, b in zip(sums, dparams, strict=True)]
            previous = dx.astype(x.dtype)
            dxs.append(previous)
        assert sums is not None  # _emulated_linear: more than one block of rows
        dx = mx.depends(mx.concatenate(dxs, axis=0), sums)
        return (dx, *(g.astype(p.dtype) for g, p in zip(sums, params, strict=True)))

    return forward
