"""Workarounds for MLX bugs and limitations, each naming the MLX version it was seen on and
kept with a canary in ``tests/test_workarounds.py``: a test that passes while MLX still
misbehaves and fails, saying which workaround to remove, once MLX is fixed.

This module imports only MLX and the standard library: it sits below every other
module of the package (layers -> precision -> workarounds -> MLX), so any of them may call it.

The functions below replace an MLX call at the place it misbehaves. Some limitations are
handled where they arise, because the handling is woven into the code there; they are listed
here with their canaries all the same:

- **Custom functions in shapeless traces** (MLX 0.32.4): ``mx.compile(..., shapeless=True)``
  of an ``mx.custom_function`` raises ``[Primitive::output_shapes] CustomTransforms cannot
  infer output shapes``. ``fluxlike.compile(..., shapeless=True)`` therefore traces with
  ``Context.shapeless`` set (``fluxlike/precision/state.py``), and ``precision/kernels.py``
  and ``precision/emulation.py`` then differentiate the plain ops instead of their custom
  gradients (row-major weight gradients, the CPU half-precision kernels).
- **Tracers left in captured state** (MLX 0.32.4): when a function compiled with
  ``mx.compile(fn, inputs=state, outputs=state)`` raises while it is traced, the arrays it
  had written into ``state`` stay there as tracers without a primitive (``[eval] Attempting
  to eval an array without a primitive``). ``fluxlike/optimisers/compiled.py`` puts the state
  from before the step back (``rollback``) when the first call of a compiled step raises.
- **``Optimizer.init`` on a shorter parameter list** (MLX 0.32.4): ``init`` walks the
  optimiser's state list by the state's length and indexes the parameters' list with it, an
  ``IndexError`` once the gradients hold fewer entries of a list than the state (a model
  partly frozen since); it also replaces the state's lists by new ones, which a compiled
  step that captured them would not see. ``optimisers.compiled.init_missing`` makes only the
  missing entries, in place.
- **safetensors F64** (MLX 0.32.4): ``mx.load`` of a ``.safetensors`` file with a float64
  entry raises ``[safetensor] unsupported dtype F64``. ``fluxlike/checkpoint.py`` reads
  safetensors files itself (``_read``; it also does so to read the file whole and to name
  every fault), so other writers' float64 entries load.
- **No ``sum_scatter`` in the ring backend** (MLX 0.32.4): ``mx.distributed.sum_scatter``
  on a ring group of two or more raises ``[ring] sum_scatter not supported``, and
  ``fully_shard``'s backward needs it. ``fluxlike/distributed.py`` (``fit_backend``) gives
  such modules a backward that reduces with ``all_sum`` instead. Its canary needs a
  two-process ring launch, so it lives with the other two-process checks
  (``tests/test_distributed.py``, ``test_ring_still_lacks_sum_scatter``).
- **A reference BLAS under the Linux wheel** (``mlx[cpu]`` 0.32.4): MLX's CPU matmul calls a
  bundled netlib BLAS; ``fluxlike/_blas.py`` points it at an optimised one (figures in
  ``bench/README.md``, *Figures quoted by the code*).
"""

from __future__ import annotations

import atexit
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ._mlxtyping import custom_function

MLX_VERSION = "0.32.4"  # the MLX version every workaround here was seen on

_HALF = (mx.float16, mx.bfloat16)
Pairs = Sequence[tuple[int, int]]


# --- Process exit ------------------------------------------------------------------------

_TASKS = "/proc/self/task"  # Linux: one entry per thread of the process


def _threads() -> frozenset[str] | None:
    try:
        return frozenset(os.listdir(_TASKS))
    except OSError:
        return None


def wait_for_exiting_threads(quiet: float = 0.02, limit: float = 1.0) -> float:
    """Wait until no thread of the process has ended for ``quiet`` seconds, at most ``limit``
    seconds; returns the seconds waited. Run by ``atexit``.

    **Abort at exit after worker threads ran compiled functions** (MLX 0.32.4, Linux;
    ml-explore/mlx#3126). MLX keeps one compile cache per thread, and a thread's cache is
    destroyed by a C++ thread-local destructor after the thread's Python part has finished.
    That destructor takes the GIL (the cache holds Python objects). ``Thread.join()`` returns
    before it runs, so if the main thread then finalises the interpreter, the exiting
    thread's attempt to take the GIL ends it with ``pthread_exit``, whose unwinding through
    the destructor calls ``std::terminate``: ``terminate called without an active
    exception``, SIGABRT, exit status 134, in about half the runs of a script whose threads
    called layers (every ``mlx.nn`` activation such as ``gelu`` is an ``mx.compile``-d
    function).

    Instead: before the interpreter finalises, wait (with the GIL released: sleeping) until
    the process's set of threads has stopped changing, so such destructors finish first.
    Without ``/proc`` (macOS, Windows) it pauses for ``quiet`` seconds. Set
    ``FLUXLIKE_EXIT_WAIT=0`` to skip it."""
    if os.environ.get("FLUXLIKE_EXIT_WAIT", "1") == "0":
        return 0.0
    start = time.monotonic()
    last = _threads()
    if last is None:
        time.sleep(quiet)
        return time.monotonic() - start
    if len(last) <= 1:  # the main thread alone: no other thread to wait for
        return 0.0
    changed = start
    while True:
        time.sleep(0.001)
        now, current = time.monotonic(), _threads()
        if current != last:
            last, changed = current, now
        if now - changed >= quiet or now - start >= limit or current is None:
            return now - start


atexit.register(wait_for_exiting_threads)


# --- Linear algebra ----------------------------------------------------------------------

def affine(x: mx.array, weight: mx.array, bias: mx.array, shapeless: bool) -> mx.array:
    """``x @ weight.T + bias``: one ``mx.addmm``, or for a ``shapeless`` trace a matmul and
    an add.

    MLX 0.32.4: an ``mx.compile(..., shapeless=True)`` trace of ``addmm`` replayed at a
    smaller batch than it was traced at corrupts the heap (glibc then aborts the process:
    ``free(): invalid pointer``, ``corrupted size vs. prev_size``), even for a bare
    ``nn.Linear``; the values it returns are right. ``AddMM``'s shape inference for shapeless
    traces came with ml-explore/mlx#3262; no report of this crash was found upstream.
    ``x @ weight.T + bias`` replays correctly at any batch."""
    if shapeless:
        return x @ weight.T + bias
    return mx.addmm(bias, x, weight.T)


def linear_grads(dy: mx.array, x: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """The gradients of ``x @ weight.T`` for the cotangent ``dy``: ``(dy @ weight, dy.T @ x)``,
    the weight's formed row-major (see :func:`row_major_linear`)."""
    features = x.shape[-1]
    dy2 = dy.reshape(-1, dy.shape[-1]) if dy.ndim != 2 else dy
    x2 = x.reshape(-1, features) if x.ndim != 2 else x
    return dy @ weight, dy2.T @ x2


def affine_grads(dy: mx.array, x: mx.array, weight: mx.array,
                 bias: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The gradients of ``x @ weight.T + bias`` for the cotangent ``dy`` (as
    :func:`linear_grads`, and the bias's)."""
    dx, dweight = linear_grads(dy, x, weight)
    return dx, dweight, dy.reshape(-1, dy.shape[-1]).sum(axis=0).reshape(bias.shape)


@custom_function
def _row_major_linear(x: mx.array, weight: mx.array) -> mx.array:
    return x @ weight.T


@custom_function
def _row_major_affine(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    return mx.addmm(bias, x, weight.T)


_row_major_linear.vjp(lambda primals, cotangent, _: linear_grads(cotangent, *primals))
_row_major_affine.vjp(lambda primals, cotangent, _: affine_grads(cotangent, *primals))


def row_major_linear(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """``x @ weight.T (+ bias)`` whose weight gradient is row-major.

    MLX 0.32.4 differentiates ``x @ weight.T`` into a column-major (transposed) weight
    gradient, and every optimiser op then walks it against the parameter's layout: Adam's step
    on a 2048 x 2048 MLP took 2.5-3.5x longer on such gradients (2026-11-30). While fluxlike
    differentiates, the linear kernels therefore use a backward pass that forms ``dy.T @ x``
    directly. Not in shapeless traces: MLX cannot infer a custom function's output shapes
    there."""
    return _row_major_linear(x, weight) if bias is None else _row_major_affine(x, weight, bias)


# --- float64 on the CPU ------------------------------------------------------------------

def sigmoid(x: mx.array) -> mx.array:
    """``mx.sigmoid``, or for float64 the same function through ``tanh``.

    MLX 0.32.4, CPU: ``exp`` in float64 is only float32-accurate (relative errors ~1e-7), and
    so is ``sigmoid``; ``tanh`` is exact. ``0.5 + 0.5 * tanh(x / 2)`` is the sigmoid."""
    return 0.5 + 0.5 * mx.tanh(0.5 * x) if x.dtype == mx.float64 else mx.sigmoid(x)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax(x, axis, precise=True)``, or for float64 with ``exp`` as ``power(e, .)``.

    MLX 0.32.4, CPU: ``exp`` (and so ``softmax``) in float64 is only float32-accurate; its
    ``power`` is exact. The max is subtracted first (its gradient stopped), as in
    ``mx.softmax``."""
    if x.dtype != mx.float64:
        return mx.softmax(x, axis=axis, precise=True)
    e = mx.power(math.e, x - mx.stop_gradient(mx.max(x, axis=axis, keepdims=True)))
    return e / mx.sum(e, axis=axis, keepdims=True)


# MLX 0.32.4, CPU: given float64, MLX's fused ``mx.fast`` kernels (``scaled_dot_product_attention``,
# ``layer_norm``, ``rms_norm``) return float64 computed at float32 precision (errors ~1e-8).
# Callers compute these dtypes with plain ops instead (a set, not a function: the norms read it
# on every call).
FAST_KERNELS_INEXACT = frozenset({mx.float64})


def fast_kernels_exact(dtype: mx.Dtype) -> bool:
    """Whether MLX's fused ``mx.fast`` kernels compute in ``dtype`` to its own precision
    (not in :data:`FAST_KERNELS_INEXACT`)."""
    return dtype not in FAST_KERNELS_INEXACT


# --- Half precision ----------------------------------------------------------------------

def mean(x: mx.array, axis: int | tuple[int, ...], keepdims: bool = False) -> mx.array:
    """``mx.mean``, accumulating half precision in float32 and returning the input dtype.

    MLX 0.32.4: ``mx.mean`` of float16/bfloat16 rounds its sum to the input dtype before
    dividing: a float16 sum overflows above 65504 (the mean of 200 values of 1000 is
    ``inf``), a bfloat16 one loses digits."""
    if x.dtype in _HALF:
        return mx.mean(x.astype(mx.float32), axis=axis, keepdims=keepdims).astype(x.dtype)
    return mx.mean(x, axis=axis, keepdims=keepdims)


# --- Convolutions ------------------------------------------------------------------------

def conv_transpose_padding(padding: Pairs, kernel: Sequence[int],
                           dilation: Sequence[int]) -> tuple[int, ...]:
    """The symmetric padding per dimension to ask ``mx.conv_transpose*`` for, given the
    ``(lo, hi)`` padding wanted: the smaller side, at most ``dilation * (k - 1)``. The caller
    crops the rest (``lo - padding`` from the start, the output size from there).

    MLX 0.32.4: ``conv_transpose`` takes one padding per dimension (both sides), and with a
    padding above ``dilation * (k - 1)`` and a stride above 1 its output is wrong (a 1-D
    stride-2 kernel of 3 with padding 3 gives 3 outputs where 5 are right)."""
    dims = zip(padding, kernel, dilation, strict=True)
    return tuple(min(lo, hi, d * (k - 1)) for (lo, hi), k, d in dims)


def conv_transpose_output_padding(output_padding: Sequence[int], padding: Pairs,
                                  asked: Sequence[int]) -> tuple[tuple[int, ...], list[int]]:
    """``(output padding to ask MLX for, zeros to append per dimension)``, given the output
    padding wanted, the ``(lo, hi)`` padding wanted and the symmetric padding ``asked`` of
    MLX (from :func:`conv_transpose_padding`). The caller pads the output with the zeros
    (before the bias and activation).

    MLX 0.32.4: ``conv_transpose`` with an ``output_padding`` above its padding gives an
    input gradient shorter than the input (wrong, with no error): a 1-D stride-2 kernel of 3
    with ``output_padding=1`` and no padding gives a gradient of 4 positions for 5 inputs.
    Positions past MLX's output are zeros (no input reaches them), so they are added
    instead."""
    out_pad = tuple(min(op, p) for op, p in zip(output_padding, asked, strict=True))
    extra = [max(0, op - o - (hi - p)) for op, o, (_, hi), p
             in zip(output_padding, out_pad, padding, asked, strict=True)]
    return out_pad, extra


def conv_general(x: mx.array, w: mx.array, stride: Sequence[int], padding: Any,
                 dilation: Sequence[int], groups: int,
                 stream: mx.Stream | mx.Device | None = None) -> mx.array:
    """``mx.conv_general(x, w, ...)``, with zeros (a sum over nothing) where ``x`` has no
    channels and the output is not empty.

    MLX 0.32.4: its CPU convolution of an input with 0 channels divides by zero when it is
    evaluated (the process dies of SIGFPE)."""
    y = mx.conv_general(x, w, stride=stride, padding=padding, kernel_dilation=dilation,
                        groups=groups, stream=stream)
    if x.shape[-1] == 0 and y.size > 0:
        return mx.zeros(y.shape, y.dtype, stream=stream)
    return y


def splits_groups(x: mx.array, groups: int) -> bool:
    """Whether a convolution of ``x`` with ``groups`` runs one call per group
    (:func:`grouped`).

    MLX 0.32.4: its convolutions accept ``groups > 1`` only in 1-D and 2-D (``[conv] Can
    only handle groups != 1 in 1D or 2D convolutions``)."""
    return groups > 1 and x.ndim >= 5


def grouped(kernel: Callable, x: mx.array, weight: mx.array, *options: Any) -> mx.array:
    """``kernel(x, weight, *options)``, whose last option is ``groups``; one call per group,
    concatenated along the channels, when :func:`splits_groups`."""
    groups = options[-1]
    if not splits_groups(x, groups):
        return kernel(x, weight, *options)
    parts = zip(mx.split(x, groups, axis=-1), mx.split(weight, groups, axis=0), strict=True)
    return mx.concatenate([kernel(a, w, *options[:-1], 1) for a, w in parts], axis=-1)


# --- Activations -------------------------------------------------------------------------

def leaky_relu(x: mx.array, a: float) -> mx.array:
    """``x`` where positive, ``a * x`` elsewhere.

    MLX 0.32.4: ``nn.leaky_relu`` is ``max(a * x, x)``, wrong for ``a > 1``
    (``nn.leaky_relu(-1, 2)`` is -1, not -2)."""
    return mx.where(x > 0, x, a * x)


def elu(x: mx.array, alpha: float) -> mx.array:
    """``x`` where positive, ``alpha * (exp(x) - 1)`` elsewhere, with finite gradients.

    MLX 0.32.4: ``nn.elu``'s ``exp(x)`` of a large positive ``x`` overflows (above ~11 in
    float16) in the branch ``where`` discards, and its gradient there is ``0 * inf = NaN``.
    Here ``exp`` only sees ``minimum(0, x)``, in that order because ``mx.minimum`` gives a
    tie's gradient to its second operand, and the slope at ``x == 0`` must be ``alpha`` (as
    in PyTorch, Flux and ``nn.elu``)."""
    return mx.where(x > 0, x, alpha * mx.expm1(mx.minimum(0, x)))


# --- Modules and gathers -----------------------------------------------------------------

class _Pinned(set[str]):
    """A set that always keeps ``pinned`` (see :func:`always_frozen`)."""

    def __init__(self, pinned: Sequence[str]):
        super().__init__(pinned)
        self.pinned = frozenset(pinned)

    def clear(self) -> None:
        super().clear()
        self.update(self.pinned)

    def difference_update(self, *others: Any) -> None:
        super().difference_update(*others)
        self.update(self.pinned)

    def discard(self, name: object) -> None:
        if name not in self.pinned:
            super().discard(name)

    def remove(self, name: str) -> None:
        if name not in self.pinned:
            super().remove(name)


def always_frozen(names: Sequence[str]) -> set:
    """A module's set of frozen names (assign it to ``module._no_grad``) that never loses
    ``names``, whatever unfreezes the module.

    MLX 0.32.4: ``nn.Module.unfreeze`` empties the frozen-name set of every submodule
    directly (``clear``, or ``difference_update`` for some keys), without calling the
    submodule's own ``unfreeze``: so ``model.freeze(); model.unfreeze()`` on a model holding a
    BatchNorm would make its running statistics trainable, and every gradient step would
    then put them back."""
    return _Pinned(names)


def take_rows(weight: mx.array, indices: mx.array) -> mx.array:
    """``weight[indices]``, with NaN rows for the indices outside ``[0, len(weight))``.

    MLX 0.32.4: gathers do not check bounds; an index past the end reads whatever lies
    there (or crashes). Where the indices can be read back, callers raise on them instead
    (``fluxlike.checks.index_range``); inside ``mx.compile``/``mx.vmap`` they cannot, and this
    masked gather is memory-safe (and turns the loss NaN)."""
    valid = (indices >= 0) & (indices < weight.shape[0])
    rows = weight[mx.where(valid, indices, 0)]
    return mx.where(valid[..., None], rows, mx.array(float("nan"), rows.dtype))
