"""Optional native kernels for the CPU: oneDNN's matmul, convolution, max pooling and softmax,
the Adam and RMSprop updates and a finiteness check, as primitives inside MLX's graph.

The companion package ``fluxlike-native`` (built from ``native/`` by ``./dev setup`` on Linux
x86-64) holds MLX primitives whose CPU evaluation runs a cached oneDNN primitive on MLX's CPU
stream, with ``vjp``/``jvp``/``vmap`` and ``output_shapes`` (so ``mx.grad``, ``mx.jvp``,
``mx.vmap`` and ``mx.compile``, shapeless too, work). fluxlike works without it.

- :func:`native_info` says whether the kernels are in use, and why (or why not);
  :func:`available` and :func:`bfloat16_native` its two answers (the routing reads
  :data:`switch` itself).
- :func:`disabled` switches fluxlike's routing off the kernels for a block.
- The kernels themselves (:func:`linear`, :func:`matmul`, :func:`conv`,
  :func:`conv_transpose`, :func:`max_pool`, :func:`softmax`, :func:`adam_kernel`,
  :func:`rmsprop_kernel`, :func:`finite_kernel`, :func:`keep_kernel`) are in
  :mod:`fluxlike.native.ops`; which layer call takes them is decided in one place,
  :func:`fluxlike.precision.kernels.choose`.

The companion is found, checked against the running MLX and loaded when this package is
imported (``import fluxlike`` does it): ``FLUXLIKE_NATIVE=0`` (or ``off``) leaves it unused,
``FLUXLIKE_NATIVE_BF16=float32`` runs bfloat16 in float32 kernels even where oneDNN has
bfloat16 ones, ``FLUXLIKE_NATIVE_F16=float32`` float16 products likewise, and
``ONEDNN_MAX_CPU_ISA`` caps oneDNN's instruction set; all four are read then. Numerics:
float32 operands give float32 results (float32 accumulation, as ``mx.matmul``); bfloat16
operands give bfloat16 results accumulated in float32 and rounded once, in oneDNN's bfloat16
kernels on a CPU with AVX512-BF16, else in float32 kernels with the same roundings; float16
products likewise, in oneDNN's float16 kernels on a CPU with AVX512-FP16 (they convert in
hardware and accumulate in float32, at float32's speed). oneDNN's bfloat16 kernels flush
bfloat16 denormals (below 1.2e-38) to zero, where MLX keeps them;
``FLUXLIKE_NATIVE_BF16=float32`` gives MLX's results there too (see ``native/README.md``,
"Numerics at the edges").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ._loader import NativeInfo, switch
from .ops import (
    NativeUnavailable,
    adam_kernel,
    conv,
    conv_transpose,
    finite_kernel,
    keep_kernel,
    linear,
    matmul,
    max_pool,
    rmsprop_kernel,
    softmax,
)

__all__ = ["NativeInfo", "NativeUnavailable", "adam_kernel", "available",
           "background_creation", "bfloat16_native", "cache_info", "conv", "conv_transpose",
           "disabled", "finite_kernel", "keep_kernel", "linear", "matmul", "matmul_mode",
           "max_pool",
           "native_info", "rmsprop_kernel", "softmax", "switch", "wait_for_creations"]

MATMUL_MODES = ("auto", "gemm", "reused", "primitive")


_lock = threading.Lock()
_switched_off = 0  # how many disabled() blocks are open


def native_info() -> NativeInfo:
    """Whether the native kernels are in use, and why.

    >>> from fluxlike.native import native_info
    >>> info = native_info()
    >>> isinstance(info.available, bool) and bool(info.reason)
    True
    """
    return switch.info


def available() -> bool:
    """Whether fluxlike's routing takes the native kernels (:func:`native_info`'s
    ``available``; ``False`` inside :func:`disabled`).

    >>> from fluxlike import native
    >>> native.available() == native.native_info().available
    True
    """
    return switch.ext is not None


def bfloat16_native() -> bool:
    """Whether bfloat16 operands run in oneDNN's bfloat16 kernels here (:func:`native_info`'s
    ``bfloat16 == "native"``, and not inside :func:`disabled`): the kernels are in use and the
    CPU has AVX512_CORE_BF16."""
    return switch.ext is not None and switch.bf16


@contextmanager
def disabled() -> Iterator[None]:
    """fluxlike's routing switched off the native kernels while the block runs, in the whole
    process: :func:`available` says no, and graphs built inside take MLX's kernels (the
    layers', attention's and the optimiser updates'), as under ``FLUXLIKE_NATIVE=0``. For
    comparisons, tests and ``mx.export_function``, which cannot serialise the native
    primitives.

    Unlike ``FLUXLIKE_NATIVE=0``: the functions of :mod:`fluxlike.native.ops` called directly
    still run the kernels, and :func:`native_info` still describes the companion. Graphs and
    ``mx.compile`` traces keep the kernels they were built with, inside or outside the block
    (``fluxlike.update``'s compiled steps are traced again after a switch). Not for use while
    other threads build graphs. Blocks nest.

    >>> from fluxlike import native
    >>> with native.disabled():
    ...     native.available()
    False
    """
    global _switched_off
    with _lock:
        _switched_off += 1
        switch.ext = None
    try:
        yield
    finally:
        with _lock:
            _switched_off -= 1
            if _switched_off == 0:
                switch.ext = switch.loaded


def cache_info() -> dict | None:
    """The companion's primitive caches: sizes, capacity, hits, misses, creations and the time
    spent creating primitives, and the creations ``pending`` on the worker thread (see
    :func:`background_creation`); ``None`` where the companion is not in use.

    >>> from fluxlike import native
    >>> info = native.cache_info()
    >>> info is None or isinstance(info, dict)
    True
    """
    ext = switch.loaded
    if ext is None:
        return None
    return dict(ext.cache_info()) if hasattr(ext, "cache_info") else {
        "matmul": ext.cache_size(), "conv": ext.conv_cache_size(),
        "pool": ext.pool_cache_size(), "softmax": ext.softmax_cache_size()}


def matmul_mode(mode: str | None = None) -> str | None:
    """How the companion's unbatched float32 products (linear layers, their gradients) run,
    process-wide; sets it to ``mode`` if given. Returns the mode in effect (``"auto"``
    resolved), ``None`` where the companion is not in use.

    - ``"gemm"``: on oneDNN's GEMM without a primitive: nothing to create for a new row count;
    - ``"reused"``: a shape's first uses on that GEMM, a cached primitive from its fourth use
      (queued on a worker thread at the third, :func:`background_creation`; from the third
      where that is off);
    - ``"primitive"``: a cached primitive per shape from its first use (before 2026-12-04).
      It also governs the other ops: otherwise a float32 convolution of at most 2**23
      multiply-adds (2**18 dilated or grouped; its backward passes, one group, on oneDNN's
      GEMM), a small float32 max pooling (and its backward pass) and a softmax of at most
      2**16 entries make no primitive on a shape's first uses (MLX's convolution, loops),
      only from the fourth (as ``"reused"``), and a softmax of at most 2**14 entries none
      (its loops are as fast); and on AMX a bfloat16 product of 1 or 8+ row-major rows (a
      linear layer, its input gradient) runs on one primitive per weight shape made for any
      row count (oneDNN's runtime dimension; the same speed, the shape's own rounding but in
      a last row past a block, the same bits on every call), not one per row count, and a
      batched bfloat16 product of at most 2**20 multiply-adds (attention's in generation) on
      one per batch shape and layout for any length;
    - ``"auto"`` (the default): ``"gemm"`` on every CPU. Below AVX-512 oneDNN's float32 matmul
      primitive is that GEMM anyway; on AVX-512 it is a brgemm kernel that rounds its sums
      otherwise, so ``"reused"`` changes a shape's results in their last bits from its fourth
      call on (the same training run twice in one process ends apart), and ``"primitive"``
      creates one per row count. There a linear layer's forward product (``x @ W.T``) of
      2**29 multiply-adds or more runs on its primitive (0.77-0.91x the GEMM's time, its
      creation less than the difference); smaller ones and the backward layouts (where the
      GEMM is the faster) on the GEMM. Which kernel a product runs depends on its shape and
      layout only, so it gives the same bits on every call.

    >>> from fluxlike import native
    >>> native.matmul_mode() in (None, "gemm")
    True
    """
    if mode is not None and mode not in MATMUL_MODES:
        raise ValueError(f"fluxlike.native.matmul_mode: mode must be one of {MATMUL_MODES} or "
                         f"None (to read it), got {mode!r}")
    ext = switch.loaded
    if ext is None:
        return None
    if mode is not None:
        ext.set_matmul_mode(mode)
    return str(ext.matmul_mode())


def background_creation(on: bool | None = None) -> bool | None:
    """Whether a primitive that a call can do without is created on the companion's worker
    thread (``True``, the default) or on the evaluating thread (``False``), process-wide;
    sets it to ``on`` if given. Returns the setting in effect, ``None`` where the companion is
    not in use.

    It concerns the calls :func:`matmul_mode` lists, which can run without a primitive (MLX's
    convolution, plain loops, oneDNN's GEMM). A shape's first two uses create nothing (a
    shape seen twice never pays a creation: 0.1-0.5 ms of a core each, several times a small
    call, and on two cores it slows the calls beside it); its third queues the primitive on
    the worker thread and runs without it too; from the fourth, a call uses the primitive,
    creating it itself if the worker has not stored it yet (it never waits on the worker).
    The worker runs at Linux's idle priority (``SCHED_IDLE``: only on a core nothing else
    wants) and creates each primitive for the evaluating thread's OpenMP thread count, as the
    evaluating thread would. So a shape's first three calls run the other way and the later
    ones its primitive, whatever the timing (the two differ in float32 rounding for a
    convolution or a softmax; a seeded run repeats bit for bit). ``False``: the third use
    creates the primitive on the evaluating thread, waits for it and uses it (at the second
    use before 2026-12-05, on this thread before 2026-12-04).

    >>> from fluxlike import native
    >>> native.background_creation() in (None, True, False)
    True
    """
    if on is not None and not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"fluxlike.native.background_creation: on must be True, False or "
                        f"None (to read it), got {on!r}")
    ext = switch.loaded
    if ext is None:
        return None
    if on is not None:
        ext.set_background_creation(bool(on))
    return bool(ext.background_creation())


def wait_for_creations() -> None:
    """Blocks until the worker thread has created every primitive queued so far (see
    :func:`background_creation`): before timing a steady state, for example. Does nothing
    where the companion is not in use.

    >>> from fluxlike import native
    >>> native.wait_for_creations()
    >>> (native.cache_info() or {"pending": 0})["pending"]
    0
    """
    ext = switch.loaded
    if ext is not None:
        ext.wait_for_creations()
