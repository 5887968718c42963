"""The native kernels as functions on MLX arrays: thin wrappers over the companion's
entries that check their arguments and name the function in errors.

Called directly they run whenever the companion is loaded (inside
:func:`fluxlike.native.disabled` too); fluxlike's layers reach them through
:func:`fluxlike.precision.kernels.choose`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import mlx.core as mx

from .. import workarounds
from ._loader import switch


class NativeUnavailable(RuntimeError):
    """A native kernel was called where the native companion is not in use; the message
    says why (see :func:`fluxlike.native.native_info`) and how to fix it."""


def _require(name: str) -> ModuleType:
    """The loaded companion, or :class:`NativeUnavailable` saying why there is none."""
    ext = switch.loaded
    if ext is None:
        raise NativeUnavailable(
            f"fluxlike.native.{name}: the native kernels are not in use: {switch.info.reason}. "
            f"Check fluxlike.native.available() first, or use MLX's kernels (mx.matmul)"
        )
    return ext


@contextmanager
def _named(name: str, **arrays: mx.array) -> Iterator[None]:
    """A ``ValueError`` of the companion's (an ``std::invalid_argument``) raised inside, with
    the function's name and its operands' shapes and dtypes in front."""
    try:
        yield
    except ValueError as error:
        raise _renamed(name, error, **arrays) from None


def _renamed(name: str, error: ValueError, **arrays: mx.array) -> ValueError:
    """The error :func:`_named` raises (for a hot call, without a context manager)."""
    given = ", ".join(f"{key} {a.shape} {a.dtype}" for key, a in arrays.items())
    return ValueError(f"fluxlike.native.{name}({given}): {error}")


def _check_arrays(name: str, **arrays: mx.array | None) -> None:
    """A ``TypeError`` naming ``name`` unless each of ``arrays`` is an ``mx.array``; those
    whose name ends in ``_`` (``bias_``: optional) may be ``None``."""
    for key, value in arrays.items():
        optional = key.endswith("_")
        if (value is None and optional) or isinstance(value, mx.array):
            continue
        key = key.rstrip("_")
        raise TypeError(f"fluxlike.native.{name}: expected {key} to be an mx.array"
                        f"{' or None' if optional else ''}, got {type(value).__name__}; "
                        f"convert it with mx.array({key})")


def split_act(act: str | Callable | None, name: str = "linear"
              ) -> tuple[bool, Callable | None]:
    """``(fuse a ReLU, activation applied afterwards)`` for ``act`` in :func:`linear`:
    fluxlike's ``identity`` and ``relu`` say what they are (their ``_commutes_with_rounding``
    mark), as ``mlx.nn``'s ``relu`` does by being it. The answers for those are remembered
    (a bounded set)."""
    try:
        known = _KNOWN_ACTS.get(act)
    except TypeError:  # an unhashable callable
        known = None
    if known is not None:
        return known
    split = _split_act_uncached(act, name)
    if split[1] is None:  # identity or a fused ReLU: finitely many such objects
        _KNOWN_ACTS[act] = split
    return split


_KNOWN_ACTS: dict[Any, tuple[bool, Callable | None]] = {}


def _split_act_uncached(act: str | Callable | None, name: str
                        ) -> tuple[bool, Callable | None]:
    if act is None or (isinstance(act, str) and act == "identity"):
        return False, None
    if isinstance(act, str):
        if act == "relu":
            return True, None
        raise ValueError(f"fluxlike.native.{name}: act must be None, 'relu' or a function, "
                         f"got {act!r}")
    mark = getattr(act, "_commutes_with_rounding", None)
    if mark == "identity":
        return False, None
    if mark == "relu" or act is _nn_relu():
        return True, None
    return False, act


def _nn_relu() -> Callable:
    import mlx.nn

    return mlx.nn.relu


def linear(
    x: mx.array,
    w: mx.array,
    bias: mx.array | None = None,
    act: str | Callable[[mx.array], mx.array] | None = None,
    *,
    out_dtype: mx.Dtype | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``act(x @ w.T + bias)`` in one oneDNN primitive, ``w`` of shape ``(out, in)``.

    ``x``: ``(..., in)``, any leading axes; ``w``, ``x`` (and ``bias``, shape ``(out,)``,
    also allowed float32 for half operands) float32, bfloat16 or float16, one dtype (a half
    dtype without oneDNN's kernels for it here - AVX512-BF16, AVX512-FP16 - in its float32
    kernels: the primitive upcasts the operands while it runs and rounds the result once).
    ``act``: ``None``, ``"relu"`` or fluxlike's/``mlx.nn``'s ``relu`` are fused into the
    kernel (applied in the kernel's task, NaN kept); any other function is applied to the
    result. The result is ``(..., out)`` in the operands' dtype (or ``out_dtype=mx.float32``);
    its gradients with respect to ``w`` are row-major, in ``w``'s dtype, except in oneDNN's
    bfloat16 or float16 kernels for an operand or bias that is fluxlike's cast of a float32
    array (autocast's weights): that one gets the float32 product or sum, which the cast
    passes on unrounded.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.linear(mx.ones((2, 3), mx.bfloat16), mx.ones((4, 3), mx.bfloat16))
    ...     assert y.shape == (2, 4) and y.dtype == mx.bfloat16
    """
    ext = switch.loaded or _require("linear")
    if type(x) is not mx.array or type(w) is not mx.array or (
        bias is not None and type(bias) is not mx.array
    ):
        _check_arrays("linear", x=x, w=w, bias_=bias)
    fused, after = (False, None) if act is None else split_act(act)
    with _named("linear", x=x, w=w):
        y = ext.matmul(x, w, bias, False, True, fused, out_dtype, False, switch.bf16,
                       stream=stream)
    return y if after is None else after(y)


def adam_kernel() -> Callable[..., tuple[mx.array, mx.array, mx.array]] | None:
    """The companion's Adam update of one float32 or bfloat16 parameter,
    ``kernel(p, g, m, v, c1, c2, decay, b1, b2, eps) -> (p', m', v')``: one vectorised pass
    (threaded for a large parameter) computing what ``mlx.optimizers.Adam``'s bias-corrected
    update computes, bit for bit, with ``c1 = lr / (1 - b1**step)`` and
    ``c2 = rsqrt(1 - b2**step)`` as 0-d arrays of the parameter's dtype and
    ``decay = 1 - lr * weight_decay`` (AdamW) or ``None``; ``g``, ``m`` and ``v`` of the
    parameter's shape and dtype; CPU only; differentiable (MLX's derivatives of the same
    formula) and ``mx.vmap``-able. fluxlike's :class:`~fluxlike.Adam` and
    :class:`~fluxlike.AdamW` use it for float32 and bfloat16 parameters on the CPU. ``None``
    where the kernels are not in use (or inside :func:`fluxlike.native.disabled`).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.adam_kernel()
    >>> if kernel is not None:
    ...     one = mx.array(1.0)
    ...     p, m, v = kernel(mx.ones(2), mx.full(2, 2.0), mx.zeros(2), mx.zeros(2), one, one,
    ...                      None, 0.9, 0.999, 1e-8)
    ...     assert mx.allclose(m, mx.full(2, 0.2)).item() and mx.allclose(v, mx.full(2, 0.004))
    """
    return None if switch.ext is None else switch.ext.adam_step


def finite_kernel() -> Callable[[list[mx.array]], mx.array] | None:
    """The companion's check of a training step's gradients, ``kernel(arrays) -> bool``:
    whether no element of the float32, bfloat16 or float16 ``arrays`` (a non-empty list) is
    inf or nan, as a 0-d bool array computed by one primitive in one pass (MLX's ops take
    ``isfinite``, ``all`` and an ``and`` per array: on a small model, scheduling those nodes
    is a sizeable part of a step). CPU only; its derivatives are zero; ``mx.vmap``-able.
    :func:`fluxlike.all_finite` and the training step's check use it on the CPU. ``None``
    where the kernels are not in use (or inside :func:`fluxlike.native.disabled`).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.finite_kernel()
    >>> if kernel is not None:
    ...     assert kernel([mx.ones(3), mx.zeros(2, dtype=mx.bfloat16)]).item()
    ...     assert not kernel([mx.ones(3), mx.array([1.0, float("nan")])]).item()
    """
    return None if switch.ext is None else switch.ext.all_finite


def keep_kernel() -> Callable[[mx.array, mx.array, mx.array], mx.array] | None:
    """The companion's selection of a training step's result, ``kernel(flag, taken, kept)``:
    ``mx.where(flag, taken, kept)`` for a 0-d bool ``flag`` and two arrays of one shape and
    dtype, where the result takes over ``taken``'s buffer when nothing else holds it (an
    optimiser's fresh output) and is overwritten with ``kept`` only when ``flag`` is false: a
    step that is kept reads and writes nothing (``mx.where`` reads both and writes a third
    array: on a 4 x 2048 x 2048 MLP's Adam step, Intel Xeon, 32 of 53 ms). CPU only;
    differentiable as ``mx.where``; ``mx.vmap``-able. :func:`fluxlike.update` keeps its
    parameters and optimiser state with it on the CPU. ``None`` where the kernels are not in
    use (or inside :func:`fluxlike.native.disabled`).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.keep_kernel()
    >>> if kernel is not None:
    ...     assert kernel(mx.array(False), mx.ones(2) * 2, mx.zeros(2)).tolist() == [0, 0]
    """
    return None if switch.ext is None else switch.ext.keep_if


def rmsprop_kernel() -> Callable[..., tuple[mx.array, mx.array]] | None:
    """The companion's RMSprop update of one float32 or bfloat16 parameter,
    ``kernel(p, g, v, lr, alpha, eps) -> (p', v')``: one pass computing what
    ``mlx.optimizers.RMSprop`` computes, bit for bit, with ``lr`` a 0-d array of the
    parameter's dtype (as :func:`adam_kernel`: CPU only, differentiable, ``mx.vmap``-able).
    fluxlike's :class:`~fluxlike.RMSProp` uses it on the CPU. ``None`` where the kernels are
    not in use (or inside :func:`fluxlike.native.disabled`).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.rmsprop_kernel()
    >>> if kernel is not None:
    ...     p, v = kernel(mx.ones(2), mx.full(2, 2.0), mx.zeros(2), mx.array(0.1), 0.9, 1e-8)
    ...     assert mx.allclose(v, mx.full(2, 0.4)).item()
    ...     assert mx.allclose(p, mx.full(2, 1 - 0.2 / 0.4**0.5), atol=1e-6).item()
    """
    return None if switch.ext is None else switch.ext.rmsprop_step


def matmul(
    a: mx.array,
    b: mx.array,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    out_dtype: mx.Dtype | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``op(a) @ op(b)`` in one oneDNN primitive, ``op`` transposing the last two axes where
    asked (without a copy: the kernel reads the operand transposed).

    ``b`` 2-D: ``a`` has any leading axes (a transposed ``a`` must be 2-D). ``b`` with batch
    axes: ``a`` and ``b`` are broadcast against each other over them, as ``mx.matmul`` does
    (e.g. attention's ``q @ k.T`` is ``matmul(q, k, transpose_b=True)`` on ``(B, H, L, D)``).
    Dtypes and numerics as :func:`linear`; ``out_dtype=mx.float32`` keeps a bfloat16
    product's float32 accumulation (e.g. for a float32 softmax).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     assert native.matmul(mx.ones((2, 5, 3)), mx.ones((3, 4))).shape == (2, 5, 4)
    """
    ext = _require("matmul")
    _check_arrays("matmul", a=a, b=b)
    batched = b.ndim > 2
    if batched:
        if a.ndim < 2:
            raise ValueError(f"fluxlike.native.matmul: a must have 2 or more axes when b has "
                             f"batch axes, got a {a.shape} and b {b.shape}")
        if a.ndim < b.ndim:
            a = a.reshape((1,) * (b.ndim - a.ndim) + a.shape)
        elif b.ndim < a.ndim:
            b = b.reshape((1,) * (a.ndim - b.ndim) + b.shape)
    with _named("matmul", a=a, b=b):
        return ext.matmul(a, b, None, trans_a=transpose_a, trans_b=transpose_b,
                          out_dtype=out_dtype, batched=batched, native_bf16=switch.bf16,
                          stream=stream)


def softmax(x: mx.array, *, stream: mx.Stream | mx.Device | None = None) -> mx.array:
    """``mx.softmax(x, axis=-1, precise=True)`` for a float32 ``x`` (any leading axes) as one
    oneDNN primitive (its accurate algorithm: the row's maximum subtracted first), with its
    backward pass as another (``y * (g - sum(g * y))``); both are differentiable again, and
    have output shapes (``mx.compile(shapeless=True)``).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     assert native.softmax(mx.zeros((2, 4))).tolist() == [[0.25] * 4] * 2
    """
    ext = _require("softmax")
    _check_arrays("softmax", x=x)
    if x.dtype != mx.float32 or x.ndim < 1:
        raise ValueError(f"fluxlike.native.softmax: expected a float32 array of one or more "
                         f"axes, got {x.dtype} of shape {x.shape}; use mx.softmax")
    return ext.softmax(x, stream=stream)


def _padding(name: str, padding: int | Sequence[Any], k: int) -> tuple[list[int], list[int]]:
    """``(low, high)`` padding per spatial axis from an int, one per axis, or a pair of those
    (low, high)."""
    if (isinstance(padding, (tuple, list)) and len(padding) == 2
            and all(isinstance(p, (tuple, list)) for p in padding)):
        return (_per_axis(name, padding[0], k, "padding"),
                _per_axis(name, padding[1], k, "padding"))
    both = _per_axis(name, padding, k, "padding")
    return both, both


def _per_axis(name: str, value: int | Sequence[Any], k: int,
              what: str) -> list[int]:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if whole(value):
        return [value] * k  # type: ignore[list-item]  # (whole: an int)
    values: list[Any] = list(value) if isinstance(value, (tuple, list)) else [value]
    if len(values) != k or not all(whole(v) for v in values):
        raise ValueError(f"fluxlike.native.{name}: {what} must be an int or {k} ints (one per "
                         f"spatial axis), got {value!r}")
    return values


def conv(
    x: mx.array,
    w: mx.array,
    bias: mx.array | None = None,
    *,
    stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]] = 0,
    dilation: int | tuple[int, ...] = 1,
    groups: int = 1,
    act: str | Callable[[mx.array], mx.array] | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``act(mx.conv_general(x, w, stride, padding, kernel_dilation=dilation, groups=groups)
    + bias)`` as oneDNN primitives (forward, and for its gradients backward-data and
    backward-weights primitives, themselves differentiable). ``act`` as :func:`linear`
    takes it: a ReLU is fused into the kernel (its gradient masks the cotangent by the kept
    output in one pass), any other function is applied to the result.

    ``x``: ``(N, *spatial, C_in)`` with 1-3 spatial axes; ``w``: ``(C_out, *kernel, C_in //
    groups)``; ``bias``: ``(C_out,)``. ``padding``: an int, one int per axis, or ``(low,
    high)`` tuples of them as ``mx.conv_general`` takes. float32, bfloat16 or float16 (one
    dtype; half precision accumulates in float32 and is rounded once). Empty operands run
    ``mx.conv_general``.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.conv(mx.ones((1, 5, 5, 2)), mx.ones((3, 3, 3, 2)), padding=1)
    ...     assert y.shape == (1, 5, 5, 3) and y[0, 2, 2, 0].item() == 18
    """
    _require("conv")
    _check_arrays("conv", x=x, w=w, bias_=bias)
    k = x.ndim - 2
    if k < 1 or k > 3 or w.ndim != x.ndim:
        raise ValueError(f"fluxlike.native.conv: expected x (N, *spatial, C_in) with 1-3 "
                         f"spatial axes and w (C_out, *kernel, C_in // groups) of as many axes, "
                         f"got x {x.shape} and w {w.shape}")
    strides = _per_axis("conv", stride, k, "stride")
    dilations = _per_axis("conv", dilation, k, "dilation")
    lo, hi = _padding("conv", padding, k)
    return conv_spelled_out(x, w, bias, strides, lo, hi, dilations, groups, act, stream)


def conv_spelled_out(
    x: mx.array,
    w: mx.array,
    bias: mx.array | None,
    stride: Sequence[int],
    lo: Sequence[int],
    hi: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    act: str | Callable[[mx.array], mx.array] | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """:func:`conv` of arrays already checked, with stride, dilation and the padding below
    (``lo``) and above (``hi``) one int per spatial axis: the call of fluxlike's layers,
    which checked them (the checks cost a small convolution's call 15%)."""
    ext = _require("conv")
    fused, after = (False, None) if act is None else split_act(act, "conv")
    if x.size == 0 or w.size == 0:
        y = workarounds.conv_general(x, w, stride, (lo, hi), dilation, groups, stream)
        y = y if bias is None else y + bias
        y = mx.maximum(y, 0) if fused else y
    else:
        try:
            y = ext.conv(x, w, bias, stride, lo, hi, dilation, groups, switch.bf16, relu=fused,
                         stream=stream)
        except ValueError as error:
            raise _renamed("conv", error, x=x, w=w) from None
    return y if after is None else after(y)


def conv_transpose(
    x: mx.array,
    w: mx.array,
    bias: mx.array | None = None,
    *,
    stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    output_padding: int | tuple[int, ...] = 0,
    groups: int = 1,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``mx.conv_transpose{1,2,3}d(x, w, stride, padding, dilation, output_padding, groups)
    + bias`` as the input gradient of a convolution (oneDNN's backward-data primitive, and
    for its own gradients the forward and backward-weights ones).

    ``x``: ``(N, *spatial, C_in)``; ``w``: ``(C_out, *kernel, C_in // groups)`` (MLX's
    layout); the result is ``(N, *out, C_out)`` with ``out = (in - 1) * stride - 2 * padding
    + dilation * (kernel - 1) + 1 + output_padding``; ``output_padding < stride``.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.conv_transpose(mx.ones((1, 4, 2)), mx.ones((3, 3, 2)), stride=2)
    ...     assert y.shape == (1, 9, 3)
    """
    ext = _require("conv_transpose")
    _check_arrays("conv_transpose", x=x, w=w, bias_=bias)
    k = x.ndim - 2
    if k < 1 or k > 3 or w.ndim != x.ndim:
        raise ValueError(f"fluxlike.native.conv_transpose: expected x (N, *spatial, C_in) with "
                         f"1-3 spatial axes and w (C_out, *kernel, C_in // groups), got x "
                         f"{x.shape} and w {w.shape}")
    strides = _per_axis("conv_transpose", stride, k, "stride")
    pads = _per_axis("conv_transpose", padding, k, "padding")
    dilations = _per_axis("conv_transpose", dilation, k, "dilation")
    extra = _per_axis("conv_transpose", output_padding, k, "output_padding")
    if any(e < 0 or e >= s for e, s in zip(extra, strides, strict=True)):
        raise ValueError(f"fluxlike.native.conv_transpose: output_padding must be >= 0 and "
                         f"smaller than stride, got {extra} with stride {strides}")
    c_out, kernel, c_in_g = w.shape[0], w.shape[1:-1], w.shape[-1]
    if groups < 1 or c_out % groups or x.shape[-1] != c_in_g * groups:
        raise ValueError(f"fluxlike.native.conv_transpose: channels do not match: x {x.shape} "
                         f"has {x.shape[-1]}, w {w.shape} takes {c_in_g} x groups={groups} "
                         f"(and C_out {c_out} must divide by groups)")
    out = [(n - 1) * s - 2 * p + d * (q - 1) + 1 + e for n, s, p, d, q, e in
           zip(x.shape[1:-1], strides, pads, dilations, kernel, extra, strict=True)]
    if min(out) < 1 or x.size == 0 or w.size == 0:
        raise ValueError(f"fluxlike.native.conv_transpose: no output for x {x.shape}, w "
                         f"{w.shape} (output spatial size {out}); use mx.conv_transpose")
    # The convolution whose input gradient this is maps (N, *out, C_out) to x's shape with
    # weights (C_in, *kernel, C_out // groups): w's channel roles swapped within each group.
    c_out_g = c_out // groups
    w_t = w.reshape(groups, c_out_g, *kernel, c_in_g)
    w_t = w_t.transpose(0, k + 2, *range(2, k + 2), 1).reshape(groups * c_in_g, *kernel,
                                                                 c_out_g)
    with _named("conv_transpose", x=x, w=w):
        y = ext.conv_backward_data(x, w_t, [*out, c_out], strides, pads, pads, dilations,
                                   groups, switch.bf16, stream=stream)
    return y if bias is None else y + bias.astype(y.dtype)


def max_pool(
    x: mx.array,
    window: int | tuple[int, ...],
    *,
    stride: int | tuple[int, ...] | None = None,
    padding: int | tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]] = 0,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """The maximum over each window of ``x`` (channels last), as oneDNN's max pooling, with
    its gradient (oneDNN's backward pass on the workspace the forward pass wrote).

    ``x``: ``(N, *spatial, C)`` with 1-3 spatial axes, float32, bfloat16 or float16, not empty;
    ``window`` and ``stride`` (default: the window) an int or one per axis; ``padding`` as
    :func:`conv` takes it, each side smaller than the window; padded entries never win. The
    result is ``(N, *out, C)``, ``out = (spatial + low + high - window) // stride + 1``, in
    ``x``'s dtype (exact: a maximum rounds nothing). The gradient goes to the first maximum
    of each window (as PyTorch's), where MLX's ``max`` shares it among equal maxima; where
    the maximum is NaN, -inf or the lowest finite value, or the cotangent is not finite, it
    is shared as MLX shares it (padding counted as -inf). The forward-mode derivative picks
    the first maximum (the first NaN), as MLX's does; the gradient's own gradients pick the
    entry the forward pass recorded.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.max_pool(mx.arange(16.0).reshape(1, 4, 4, 1), 2)
    ...     assert y[0, :, :, 0].tolist() == [[5.0, 7.0], [13.0, 15.0]]
    """
    ext = _require("max_pool")
    _check_arrays("max_pool", x=x)
    k = x.ndim - 2
    if k < 1 or k > 3:
        raise ValueError(f"fluxlike.native.max_pool: expected x (N, *spatial, C) with 1-3 "
                         f"spatial axes, got {x.shape}")
    kernel = _per_axis("max_pool", window, k, "window")
    strides = kernel if stride is None else _per_axis("max_pool", stride, k, "stride")
    lo, hi = _padding("max_pool", padding, k)
    with _named("max_pool", x=x):
        return ext.max_pool(x, kernel, strides, lo, hi, switch.bf16, stream=stream)


