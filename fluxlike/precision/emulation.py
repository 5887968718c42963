"""Half precision on the CPU in float32 kernels: the emulation.

MLX's CPU float16/bfloat16 GEMM and convolution are scalar loops, far slower than float32 on an
optimised BLAS. Where no native kernel takes a half-precision kernel call
(:func:`fluxlike.precision.kernels.choose` says ``"emulated"``), it runs here with the numerics
of half precision - operands already rounded to the half dtype, float32 accumulation, the
result rounded once to the half dtype - in float32 kernels: upcast, float32
GEMM/convolution, cast the result down. It is one ``mx.custom_function`` whose backward pass
recomputes the float32 upcasts from the saved half-precision inputs, so only half-precision
activations are kept for the backward pass, and whose cotangents come back in the operands'
dtypes. It supports ``mx.grad``/``mx.vjp`` and ``mx.compile`` (not second-order gradients);
in a shapeless trace the plain casts are differentiated instead. Inference reuses the kept
float32 upcasts of the weights (:func:`castcache.casts_if_seen`).

Memory: what the graph retains is about half of float32's for an activation-heavy MLP. MLX's
CPU scheduler, though, allocates each op's output when it queues the op, up to about a hundred
ops ahead of execution, so a measured peak also counts the float32 temporaries queued
meanwhile; large linear layers therefore run in blocks of rows (:data:`CHUNK_BYTES`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from .. import workarounds
from .._mlxtyping import custom_function
from . import castcache
from .operands import convert
from .state import context

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
        return convert(y32, dtype)
    if kind is None:
        return act(convert(y32, dtype))
    return convert(act(y32), dtype)


# Largest float32 temporary (bytes) one piece of an emulated linear layer may make.
CHUNK_BYTES = 4 * 2**20


def linear(
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


def linear_on_kept(x: mx.array, params: tuple[mx.array, ...], dtype: mx.Dtype,
                   act: Activation | None) -> mx.array | None:
    """``act(x @ weight.T + bias)`` (``params``: the weight and the optional bias) in half
    ``dtype`` outside differentiation: a float32 kernel on the kept float32 values of the
    rounded parameters, the input rounded to ``dtype``, one rounding of the result. ``None``
    the first time the parameters are seen (or for tracers of ``mx.grad``/``mx.compile``):
    then :func:`linear`'s custom gradient runs, which keeps no float32 copies."""
    kept = castcache.rounded_f32_if_seen(params, dtype)
    if kept is None:
        return None
    x32 = convert(convert(x, dtype), mx.float32)
    y32 = x32 @ kept[0].T if len(kept) == 1 else mx.addmm(kept[1], x32, kept[0].T)
    return rounded(y32, dtype, act)


def matmul(a: mx.array, b: mx.array) -> mx.array:
    """``a @ b`` of half operands of one dtype in float32 kernels, rounded once."""
    return _in_float32("matmul")(a, b)


def convolved(options: tuple, act: Callable | None, x: mx.array, weight: mx.array,
              *bias: mx.array) -> mx.array:
    """Kernel ``options`` (plus the bias) on half operands in float32 kernels: with the
    parameters' kept upcasts when an earlier call made them, else through the custom
    gradient."""
    name, *rest = options
    if bias:
        options = (f"{name}+bias", *rest)
    params32 = castcache.casts_if_seen((weight, *bias), mx.float32)
    if params32 is not None:
        return rounded(plain_kernel(*options)(convert(x, mx.float32), *params32), x.dtype, act)
    return _activated(act, *options)(x, weight, *bias)


@functools.cache
def plain_kernel(name: str, *options) -> Callable[..., mx.array]:
    """The plain kernel ``name`` with its static options bound: a function of arrays;
    ``"conv+bias"`` (any kernel name with ``+bias``) adds a third operand, the bias."""
    if name.endswith("+bias"):
        plain = plain_kernel(name.removesuffix("+bias"), *options)
        return lambda x, w, b: plain(x, w) + b
    if name == "linear":
        return lambda x, w: x @ w.T
    if name == "affine":
        return lambda x, w, b: workarounds.affine(x, w, b, context.get().shapeless)
    if name == "matmul":
        return lambda a, b: a @ b
    if name == "conv":
        stride, padding, dilation, groups = options
        return lambda x, w: workarounds.conv_general(x, w, stride, padding, dilation, groups)
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
    kernel = plain_kernel(name, *options)

    def plain(*operands: mx.array) -> mx.array:
        y = kernel(*(convert(a, mx.float32) for a in operands))
        return convert(y if act is None else act(y), operands[0].dtype)

    forward = custom_function(plain)

    @forward.vjp
    def backward(operands: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        # Recompute the upcasts from the saved half operands. Tying them to the cotangent
        # keeps MLX from scheduling them (and holding them) before the backward pass gets here.
        upcast = [convert(a, mx.float32) for a in mx.depends(list(operands), [cotangent])]
        cotangent32 = convert(cotangent, mx.float32)
        if act is not None:  # relu'(y) is y > 0, and y > 0 exactly where its rounding is
            # (a product, not mx.where, which is slower on the CPU: bench/README.md,
            # "Figures quoted by the code")
            cotangent32 = cotangent32 * (output > 0)
        grads = _kernel_vjp(name, kernel, upcast, cotangent32)
        grads = [convert(g, a.dtype) for g, a in zip(grads, operands, strict=True)]
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
    kernel = plain_kernel(name)

    def blocks(n: int) -> range:
        return range(0, n, step)

    @custom_function
    def forward(x: mx.array, *params: mx.array) -> mx.array:
        params32 = [convert(p, mx.float32) for p in params]
        outputs: list[mx.array] = []
        for start in blocks(x.shape[0]):
            rows = x[start : start + step]
            if outputs:
                rows = mx.depends(rows, outputs[-1])
            outputs.append(convert(kernel(convert(rows, mx.float32), *params32), x.dtype))
        return mx.concatenate(outputs, axis=0)

    @forward.vjp
    def backward(operands: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        x, *params = operands
        params32 = [convert(p, mx.float32) for p in mx.depends(list(params), [cotangent])]
        sums: list[mx.array] | None = None  # parameter gradients, accumulated in float32
        dxs: list[mx.array] = []
        previous = cotangent
        for start in blocks(x.shape[0]):
            rows, cot = mx.depends([x[start : start + step], cotangent[start : start + step]],
                                   [previous])
            dx, *dparams = _kernel_vjp(
                name, kernel, [convert(rows, mx.float32), *params32], convert(cot, mx.float32)
            )
            sums = dparams if sums is None else [a + b for a, b in zip(sums, dparams, strict=True)]
            previous = convert(dx, x.dtype)
            dxs.append(previous)
        assert sums is not None  # _emulated_linear: more than one block of rows
        dx = mx.depends(mx.concatenate(dxs, axis=0), sums)
        return (dx, *(convert(g, p.dtype) for g, p in zip(sums, params, strict=True)))

    return forward


def _kernel_vjp(
    name: str, kernel: Callable[..., mx.array], primals: list[mx.array], cotangent: mx.array
) -> list[mx.array]:
    """The gradients of ``kernel`` at ``primals``; for the linear kernels, with the weight
    gradient row-major."""
    if name == "linear":
        return list(workarounds.linear_grads(cotangent, *primals))
    if name == "affine":
        return list(workarounds.affine_grads(cotangent, *primals))
    return mx.vjp(kernel, primals, [cotangent])[1]
