"""Optional native kernels for the CPU: oneDNN's matmul, convolution, max pooling and softmax
inside MLX's graph.

The companion package ``fluxlike-native`` (built from ``native/`` by ``./dev setup`` on
Linux x86-64) holds MLX primitives whose CPU evaluation runs a cached oneDNN primitive on
MLX's CPU stream (a bias fused into the kernel, a ReLU applied in the same task, keeping NaN
as MLX does), with ``vjp``/``jvp`` and ``output_shapes`` (so ``mx.grad``, ``mx.jvp`` and
``mx.compile``, shapeless too, work). This module finds it, checks it, and decides how it
is used; fluxlike works without it.

- :func:`native_info` says whether the kernels are in use, and why (or why not).
- :func:`linear` (``act(x @ w.T + bias)``, ``w`` of shape ``(out, in)`` as in ``Dense``),
  :func:`matmul` (batched, transposed operands) and :func:`conv` (``mx.conv_general``'s
  channels-last convolution, 1-3 spatial axes, with its two gradients as oneDNN primitives)
  build the primitives; :func:`max_pool` is oneDNN's max pooling with its gradient;
  :func:`attention` is ``mx.fast.scaled_dot_product_attention`` made
  of them (float32 scores and softmax, so no MLX half-precision kernel runs); :func:`softmax`
  is oneDNN's float32 softmax over the last axis (MLX's CPU softmax runs a scalar ``exp``
  on the Linux wheel, which is built without AVX); :func:`pays`
  says whether they beat today's kernels for a shape and dtype (measured; see
  ``bench/native.py``).

Numerics: float32 operands give float32 results (float32 accumulation, as ``mx.matmul``);
bfloat16 operands give bfloat16 results (or float32 with ``out_dtype=mx.float32``)
accumulated in float32, rounded once. On a CPU with AVX-512-BF16, bfloat16 runs in
oneDNN's native bfloat16 kernels; without it (or with ``ONEDNN_MAX_CPU_ISA`` set below
``AVX512_CORE_BF16``), bfloat16 operands are upcast and run in float32 kernels with the same
numerics - decided once, when the first op is built, never inside ``mx.eval``.

Environment: ``FLUXLIKE_NATIVE=0`` (or ``off``) leaves the kernels unused;
``FLUXLIKE_NATIVE_BF16=float32`` runs bfloat16 in float32 kernels even where native ones
exist. Both, like ``ONEDNN_MAX_CPU_ISA``, are read once, at the first use. oneDNN's OpenMP
threads keep libgomp's default (spin briefly after a parallel region, then sleep), or what
``OMP_WAIT_POLICY`` says (bench/README.md has the measurements).
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx

__all__ = ["NativeInfo", "NativeUnavailable", "adam_kernel", "attention", "available",
           "bfloat16_native", "conv", "conv_transpose", "disabled", "linear", "matmul",
           "max_pool", "native_info", "on_switch", "pays", "plain_linear_kernel", "provides",
           "rmsprop_kernel", "softmax", "split_act"]

_DISABLED = ("0", "off", "no", "false", "none")


class NativeUnavailable(RuntimeError):
    """A native kernel was called where the native companion is not in use; the message
    says why (see :func:`native_info`) and how to fix it."""


@dataclass(frozen=True)
class NativeInfo:
    """What the native companion provides in this process.

    ``available``: whether its kernels are in use; ``reason``: why, or why not, in words;
    ``isa``: oneDNN's effective CPU ISA (``None`` when not loaded); ``bfloat16``: how
    bfloat16 operands run - ``"native"`` (oneDNN's bfloat16 kernels), ``"float32 kernels"``
    (upcast, bfloat16 numerics) or ``None``; ``mlx``: the running MLX version;
    ``built_for``: the MLX version the companion was built against; ``onednn``: oneDNN's
    version; ``path``: where the companion was found.
    """

    available: bool
    reason: str
    isa: str | None = None
    bfloat16: str | None = None
    mlx: str = mx.__version__  # type: ignore[attr-defined]  # not in MLX's stub
    built_for: str | None = None
    onednn: str | None = None
    path: str | None = None


_lock = threading.Lock()
_info: NativeInfo | None = None
_ext: ModuleType | None = None
_bf16_native = False
_switched_off = 0  # how many disabled() blocks are open
_on_switch: list[Callable[[], None]] = []


def native_info() -> NativeInfo:
    """Whether the native kernels are in use, and why; the first call loads them.

    >>> from fluxlike.native import native_info
    >>> info = native_info()
    >>> isinstance(info.available, bool) and bool(info.reason)
    True
    """
    if _info is None:
        _load()
    assert _info is not None
    return _info


def available() -> bool:
    """Whether the native kernels are in use (:func:`native_info`'s ``available``; ``False``
    inside :func:`disabled`)."""
    if _switched_off:
        return False
    return (_info if _info is not None else native_info()).available


def bfloat16_native() -> bool:
    """Whether bfloat16 operands run in oneDNN's bfloat16 kernels here (:func:`native_info`'s
    ``bfloat16 == "native"``): the kernels are in use and the CPU has AVX512_CORE_BF16."""
    if _switched_off:
        return False
    if _info is None:
        _load()
    return _bf16_native


@contextmanager
def disabled() -> Iterator[None]:
    """fluxlike's routing switched off the native kernels while the block runs, in the whole
    process: :func:`available` says no, and graphs built inside take MLX's kernels (the
    layers', attention's and the optimiser updates'), as under ``FLUXLIKE_NATIVE=0``. For
    comparisons, tests and ``mx.export_function`` (bench/run.py's ``-native`` columns).

    Unlike ``FLUXLIKE_NATIVE=0``: the functions of this module called directly
    (:func:`linear`, :func:`conv`, ...) still run the kernels, and :func:`native_info` still
    describes the companion. Graphs and ``mx.compile`` traces keep the kernels they were built
    with, inside or outside the block (``fluxlike.update``'s compiled steps are traced again
    after a switch). Not for use while other threads build graphs. Blocks nest.

    >>> from fluxlike import native
    >>> with native.disabled():
    ...     native.available()
    False
    """
    global _switched_off
    with _lock:
        _switched_off += 1
    try:
        _switched()
        yield
    finally:
        with _lock:
            _switched_off -= 1
        _switched()


def on_switch(callback: Callable[[], None]) -> None:
    """Have :func:`disabled` call ``callback()`` on entering and on leaving a block: for code
    that keeps a decision taken from :func:`available` (``fluxlike.precision.ops`` registers
    its ``forget_native``)."""
    _on_switch.append(callback)


def _switched() -> None:
    """Every callback, even after one raised (the first error is raised after the last)."""
    error: BaseException | None = None
    for callback in _on_switch:
        try:
            callback()
        except BaseException as e:  # raised below, once all have run
            error = error or e
    if error is not None:
        raise error


def _load() -> None:
    """Find, check and import the companion once (thread-safe); sets ``_info``."""
    global _info, _ext, _bf16_native
    with _lock:
        if _info is not None:
            return
        info, ext, bf16 = _find()
        _ext, _bf16_native = ext, bf16
        _info = info


def _find() -> tuple[NativeInfo, ModuleType | None, bool]:
    choice = os.environ.get("FLUXLIKE_NATIVE", "").strip().lower()
    if choice in _DISABLED and choice:
        return NativeInfo(False, f"disabled by FLUXLIKE_NATIVE={choice}"), None, False
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return NativeInfo(False, f"no native kernels for {sys.platform} "
                                 f"{platform.machine()} (Linux x86-64 only)"), None, False
    try:
        from fluxlike_native import _build  # pure Python: safe whatever MLX is installed
    except ImportError as error:
        return NativeInfo(False, f"fluxlike-native is not installed ({error}); on Linux "
                                 f"x86-64, `./dev setup` builds it"), None, False
    built_for = getattr(_build, "MLX_VERSION", None)
    path = os.path.dirname(_build.__file__)
    if built_for != mx.__version__:  # type: ignore[attr-defined]  # not in MLX's stub
        return NativeInfo(
            False, f"fluxlike-native at {path} was built for MLX {built_for}, this is MLX "
                   f"{mx.__version__}: rebuild it (./dev setup, or pip install "  # type: ignore[attr-defined]  # not in MLX's stub
                   f"--no-build-isolation ./native)", built_for=built_for, path=path,
        ), None, False
    try:
        from fluxlike_native import _ext as ext
    except ImportError as error:
        return NativeInfo(False, f"fluxlike-native at {path} could not be loaded ({error}); "
                                 f"reinstall it with ./dev setup", built_for=built_for,
                          path=path), None, False
    if ext.runtime_mlx_version() != mx.__version__ or ext.built_mlx_version != built_for:  # type: ignore[attr-defined]  # not in MLX's stub
        return NativeInfo(False, f"fluxlike-native's module reports MLX "
                                 f"{ext.built_mlx_version} (libmlx: "
                                 f"{ext.runtime_mlx_version()}), expected {mx.__version__}: "  # type: ignore[attr-defined]  # not in MLX's stub
                                 f"rebuild it", built_for=built_for, path=path), None, False
    isa = ext.cpu_isa()
    forced = os.environ.get("FLUXLIKE_NATIVE_BF16", "").strip().lower()
    bf16 = ext.isa_has_bf16() and forced != "float32"
    if bf16:
        how, why = "native", f"oneDNN's bfloat16 kernels ({isa})"
    elif forced == "float32":
        how, why = "float32 kernels", "bfloat16 in float32 kernels (FLUXLIKE_NATIVE_BF16=float32)"
    else:
        how, why = "float32 kernels", (f"bfloat16 in float32 kernels: the CPU ISA {isa} has no "
                                       f"AVX512_CORE_BF16")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    limit = f", ONEDNN_MAX_CPU_ISA={cap}" if cap else ""
    adam = ", with native Adam and RMSprop updates" if hasattr(ext, "rmsprop_step") else ""
    reason = (f"oneDNN {ext.onednn_version()} matmul, convolution, pooling and softmax in use"
              f"{adam}: float32 on {isa}{limit}; {why}")
    return NativeInfo(True, reason, isa, how, mx.__version__, built_for,  # type: ignore[attr-defined]  # not in MLX's stub
                      ext.onednn_version(), path), ext, bf16


def provides(name: str) -> bool:
    """Whether the companion in use has the kernel ``name`` (e.g. ``"softmax"``): a build
    from an older ``native/`` lacks the newer kernels until ``./dev setup`` rebuilds it.

    >>> from fluxlike import native
    >>> native.provides("matmul") == native.available()
    True
    """
    return available() and hasattr(_ext, name)


def _require(name: str) -> ModuleType:
    if _ext is None:
        info = native_info()
        if _ext is None:
            raise NativeUnavailable(
                f"fluxlike.native.{name}: the native kernels are not in use: {info.reason}. "
                f"Check fluxlike.native.available() first, or use MLX's kernels (mx.matmul)"
            )
    return _ext


def _check_arrays(name: str, **arrays: mx.array | None) -> None:
    for key, value in arrays.items():
        if value is not None and not isinstance(value, mx.array):
            raise TypeError(f"fluxlike.native.{name}: expected {key} to be an mx.array, got "
                            f"{type(value).__name__}")


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
    also allowed float32 for bfloat16 operands) float32 or bfloat16, one dtype. ``act``:
    ``None``, ``"relu"`` or fluxlike's/``mlx.nn``'s ``relu`` are fused into the kernel
    (applied in the kernel's task, NaN kept); any other function is applied to the result.
    The result is ``(..., out)`` in the operands' dtype (or ``out_dtype=mx.float32``); its
    gradients with respect to ``w`` are row-major, in ``w``'s dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.linear(mx.ones((2, 3), mx.bfloat16), mx.ones((4, 3), mx.bfloat16))
    ...     assert y.shape == (2, 4) and y.dtype == mx.bfloat16
    """
    ext = _ext if _ext is not None else _require("linear")
    if type(x) is not mx.array or type(w) is not mx.array or (
        bias is not None and type(bias) is not mx.array
    ):
        _check_arrays("linear", x=x, w=w, bias=bias)
    fused, after = (False, None) if act is None else split_act(act)
    try:
        # Positional: nanobind fills defaults and keywords at a cost the size of a small
        # layer's whole graph construction (every float32 linear layer calls this).
        y = (ext.matmul(x, w, bias, False, True, fused, out_dtype, False, _bf16_native)
             if stream is None else
             ext.matmul(x, w, bias, False, True, fused, out_dtype, False, _bf16_native,
                        stream=stream))
    except ValueError as error:
        raise ValueError(f"fluxlike.native.linear(x {x.shape} {x.dtype}, w {w.shape} "
                         f"{w.dtype}): {error}") from None
    return y if after is None else after(y)


def plain_linear_kernel() -> Callable[[mx.array, mx.array, mx.array | None, bool],
                                      mx.array | None] | None:
    """The companion's entry for fluxlike's everyday float32 layer call,
    ``kernel(x, w, bias, relu)``: ``relu?(x @ w.T + bias)`` on oneDNN where ``x``, ``w`` and
    ``bias`` (or ``None``) are float32 of matching shapes and the default device is the CPU,
    ``None`` for anything else; it checks in C++ what :func:`linear` checks in Python. ``None``
    where the kernels are not in use (or a build predates the entry)."""
    return getattr(_ext, "plain_linear", None) if available() else None


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
    where the kernels are not in use (or a build predates the entry).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.adam_kernel()
    >>> if kernel is not None:
    ...     one = mx.array(1.0)
    ...     p, m, v = kernel(mx.ones(2), mx.full(2, 2.0), mx.zeros(2), mx.zeros(2), one, one,
    ...                      None, 0.9, 0.999, 1e-8)
    ...     assert mx.allclose(m, mx.full(2, 0.2)).item() and mx.allclose(v, mx.full(2, 0.004))
    """
    return getattr(_ext, "adam_step", None) if available() else None


def rmsprop_kernel() -> Callable[..., tuple[mx.array, mx.array]] | None:
    """The companion's RMSprop update of one float32 or bfloat16 parameter,
    ``kernel(p, g, v, lr, alpha, eps) -> (p', v')``: one pass computing what
    ``mlx.optimizers.RMSprop`` computes, bit for bit, with ``lr`` a 0-d array of the
    parameter's dtype (as :func:`adam_kernel`: CPU only, differentiable, ``mx.vmap``-able).
    fluxlike's :class:`~fluxlike.RMSProp` uses it on the CPU. ``None`` where the kernels are
    not in use (or a build predates the entry).

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> kernel = native.rmsprop_kernel()
    >>> if kernel is not None:
    ...     p, v = kernel(mx.ones(2), mx.full(2, 2.0), mx.zeros(2), mx.array(0.1), 0.9, 1e-8)
    ...     assert mx.allclose(v, mx.full(2, 0.4)).item()
    ...     assert mx.allclose(p, mx.full(2, 1 - 0.2 / 0.4**0.5), atol=1e-6).item()
    """
    return getattr(_ext, "rmsprop_step", None) if available() else None


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
    try:
        return ext.matmul(a, b, None, trans_a=transpose_a, trans_b=transpose_b,
                          out_dtype=out_dtype, batched=batched, native_bf16=_bf16_native,
                          stream=stream)
    except ValueError as error:
        raise ValueError(f"fluxlike.native.matmul(a {a.shape} {a.dtype}, b {b.shape} "
                         f"{b.dtype}): {error}") from None


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float | None = None,
    mask: str | mx.array | None = None,
) -> mx.array:
    """``softmax(q @ k.T * scale + mask) @ v`` as ``mx.fast.scaled_dot_product_attention``
    computes it, on the native matmul: ``q`` ``(B, H, L_q, D)``, ``k`` ``(B, H_kv, L_k, D)``,
    ``v`` ``(B, H_kv, L_k, D_v)`` with ``H_kv`` dividing ``H`` (grouped queries); one dtype,
    float32 or bfloat16.

    The scores are accumulated and kept in float32 (bfloat16 operands give float32 scores),
    the softmax runs in float32, and its probabilities are rounded to the operands' dtype for
    the product with ``v``, whose result has that dtype: no MLX half-precision kernel runs.
    ``mask``: ``None``, ``"causal"`` (aligned to the last key, as MLX's), a boolean array
    (``True`` = attend) or an additive array, broadcastable to ``(B, H, L_q, L_k)``.
    ``scale`` defaults to ``D ** -0.5``.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     q = mx.ones((1, 2, 4, 8), mx.bfloat16)
    ...     assert native.attention(q, q, q, mask="causal").dtype == mx.bfloat16
    """
    _require("attention")
    _check_arrays("attention", q=q, k=k, v=v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[1] % k.shape[1] or (
            k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]):
        raise ValueError(f"fluxlike.native.attention: expected q (B, H, L_q, D), k (B, H_kv, "
                         f"L_k, D), v (B, H_kv, L_k, D_v) with H_kv dividing H, got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}")
    batch, heads, lq, depth = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scale = depth**-0.5 if scale is None else scale
    if groups > 1:  # grouped queries: the keys broadcast over each group's heads
        q = q.reshape(batch, kv_heads, groups, lq, depth)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = matmul(q, k, transpose_b=True, out_dtype=mx.float32) * scale
    if groups > 1:
        scores = scores.reshape(batch, heads, lq, lk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"fluxlike.native.attention: mask must be None, 'causal' or an "
                             f"array, got {mask!r}")
        rows = mx.arange(lq)[:, None] + (lk - lq)
        scores = mx.where(mx.arange(lk)[None] <= rows, scores, -mx.inf)
    elif mask is not None:
        scores = (mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_
                  else scores + mask.astype(mx.float32))
    probs = mx.softmax(scores, axis=-1).astype(q.dtype)
    if groups > 1:
        probs = probs.reshape(batch, kv_heads, groups, lq, lk)
    out = matmul(probs, v)
    return out.reshape(batch, heads, lq, v.shape[-1]) if groups > 1 else out


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
    if not hasattr(ext, "softmax"):
        raise NativeUnavailable("fluxlike.native.softmax: this build of fluxlike-native has no "
                                "softmax (built from an older native/): rebuild it with "
                                "./dev setup, or use mx.softmax")
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
    if isinstance(value, int):
        return [value] * k
    values = list(value)
    if len(values) != k or not all(isinstance(v, int) for v in values):
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
    high)`` tuples of them as ``mx.conv_general`` takes. float32 or bfloat16 (one dtype;
    bfloat16 accumulates in float32 and is rounded once). Empty operands run
    ``mx.conv_general``.

    >>> import mlx.core as mx
    >>> from fluxlike import native
    >>> if native.available():
    ...     y = native.conv(mx.ones((1, 5, 5, 2)), mx.ones((3, 3, 3, 2)), padding=1)
    ...     assert y.shape == (1, 5, 5, 3) and y[0, 2, 2, 0].item() == 18
    """
    ext = _require("conv")
    _check_arrays("conv", x=x, w=w, bias=bias)
    k = x.ndim - 2
    if k < 1 or k > 3 or w.ndim != x.ndim:
        raise ValueError(f"fluxlike.native.conv: expected x (N, *spatial, C_in) with 1-3 "
                         f"spatial axes and w (C_out, *kernel, C_in // groups) of as many axes, "
                         f"got x {x.shape} and w {w.shape}")
    strides = _per_axis("conv", stride, k, "stride")
    dilations = _per_axis("conv", dilation, k, "dilation")
    lo, hi = _padding("conv", padding, k)
    fused, after = (False, None) if act is None else split_act(act, "conv")
    if x.size == 0 or w.size == 0:
        y = mx.conv_general(x, w, stride=strides, padding=(lo, hi), kernel_dilation=dilations,
                            groups=groups, stream=stream)
        y = y if bias is None else y + bias
        y = mx.maximum(y, 0) if fused else y
    else:
        try:
            y = ext.conv(x, w, bias, strides, lo, hi, dilations, groups, _bf16_native,
                         relu=fused, stream=stream)
        except ValueError as error:
            raise ValueError(f"fluxlike.native.conv(x {x.shape} {x.dtype}, w {w.shape} "
                             f"{w.dtype}): {error}") from None
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
    _check_arrays("conv_transpose", x=x, w=w, bias=bias)
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
    try:
        y = ext.conv_backward_data(x, w_t, [*out, c_out], strides, pads, pads, dilations,
                                   groups, _bf16_native, stream=stream)
    except ValueError as error:
        raise ValueError(f"fluxlike.native.conv_transpose(x {x.shape} {x.dtype}, w {w.shape} "
                         f"{w.dtype}): {error}") from None
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

    ``x``: ``(N, *spatial, C)`` with 1-3 spatial axes, float32 or bfloat16, not empty;
    ``window`` and ``stride`` (default: the window) an int or one per axis; ``padding`` as
    :func:`conv` takes it, each side smaller than the window; padded entries never win. The
    result is ``(N, *out, C)``, ``out = (spatial + low + high - window) // stride + 1``, in
    ``x``'s dtype (exact: a maximum rounds nothing). The gradient goes to the first maximum
    of each window (as PyTorch's), where MLX's ``max`` shares it among equal maxima; the
    forward-mode derivative and the gradient's own gradients pick that same entry.

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
    try:
        return ext.max_pool(x, kernel, strides, lo, hi, _bf16_native, stream=stream)
    except ValueError as error:
        raise ValueError(f"fluxlike.native.max_pool(x {x.shape} {x.dtype}): {error}") from None


# Where the native convolution beats MLX's (float32: MLX's own; bfloat16: fluxlike's float32
# emulation, i.e. ``precision.ops``), measured by bench/native.py on two shared cores (forward
# and gradients): bfloat16 pays at every size; float32 from about 2**17 multiply-adds. (Linear
# layers go native at every size: bench/README.md.)
PAYS_MIN_MACS = {mx.float32: 2**17, mx.bfloat16: 0}


def pays(rows: int, inner: int, cols: int, dtype: mx.Dtype) -> bool:
    """Whether the native kernel is expected to beat today's path for a ``(rows, inner) @
    (inner, cols)`` product of ``dtype`` on the CPU: the kernels are in use, the dtype is
    float32 or bfloat16, and the product is large enough (``PAYS_MIN_MACS``). For a
    convolution pass its implicit GEMM: ``rows = N * prod(out_spatial)``, ``inner =
    prod(kernel) * C_in // groups``, ``cols = C_out``.

    >>> import mlx.core as mx
    >>> pays(512, 2048, 2048, mx.float16)
    False
    """
    least = PAYS_MIN_MACS.get(dtype)
    if least is None or not available():
        return False
    return rows * inner * cols >= least
