"""What the tests of the native companion (tests/native/) share: the skip mark, random operands,
the float64 reference of a linear layer and its tolerance, and a subprocess runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fluxlike import native

INFO = native.native_info()
needs_native = pytest.mark.skipif(not INFO.available,
                                  reason=f"fluxlike-native not in use: {INFO.reason}")
needs_f16_kernels = pytest.mark.skipif(
    INFO.float16 != "native", reason=f"float16 runs in oneDNN's float32 kernels here (CPU ISA "
    f"{INFO.isa}: no AVX512-FP16, or FLUXLIKE_NATIVE_F16=float32, or no companion)")
ROOT = Path(__file__).resolve().parent.parent
DTYPES = [mx.float32, mx.bfloat16]
BF16_HALF_ULP = 2.0**-8  # half a bfloat16 ulp, relative to the value (8-bit significand)


def np64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rand(shape, dtype=mx.float32, scale=1.0):
    return (scale * mx.random.normal(shape)).astype(dtype)


def reference(x, w, b=None, act=False):
    """float64 ``act(x @ w.T + b)`` and the scale ``|x| @ |w|.T + |b|`` of its rounding."""
    x64, w64 = np64(x), np64(w)
    y = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    if b is not None:
        y = y + np64(b)
        scale = scale + np.abs(np64(b))
    return (np.maximum(y, 0) if act else y), scale


def assert_close(y: mx.array, exact: np.ndarray, scale: np.ndarray, dtype) -> None:
    """``y`` within the module's documented tolerance of ``exact``."""
    assert y.dtype == dtype
    got = np64(y)
    assert got.shape == exact.shape
    bound = 1e-5 * scale + 1e-30
    if dtype == mx.bfloat16:
        bound = bound + BF16_HALF_ULP * np.abs(exact) * (1 + 1e-3)
    excess = np.abs(got - exact) - bound
    assert excess.max(initial=-1) <= 0, f"max error over bound {excess.max()}"


@contextmanager
def float16_in_float32_kernels() -> Iterator[None]:
    """float16 products in oneDNN's float32 kernels (upcast inside the primitive) while the
    block runs, as on a CPU without AVX512-FP16 or under ``FLUXLIKE_NATIVE_F16=float32``: the
    companion's setting and the routing's. (Where the CPU has no float16 kernels, a no-op.)"""
    from fluxlike_native import _ext
    old, routed = _ext.set_native_f16(False), native.switch.f16
    native.switch.f16 = False
    try:
        yield
    finally:
        _ext.set_native_f16(old)
        native.switch.f16 = routed


def executed_kernels(code: str, primitive: str) -> list[str]:
    """The oneDNN implementations (``brg:avx512_core_fp16``, ``ref:any``, ...) of every
    ``primitive`` (``"matmul"``, ``"convolution"``) that ``code`` executes in a fresh
    interpreter, as ``ONEDNN_VERBOSE`` lists them."""
    run = _subprocess(code, ONEDNN_VERBOSE="1")
    assert run.returncode == 0, run.stderr
    return [line.split(",")[4] for line in run.stdout.splitlines()
            if line.startswith(f"onednn_verbose,exec,cpu,{primitive},")]


def _subprocess(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("FLUXLIKE_NATIVE", "FLUXLIKE_NATIVE_BF16", "FLUXLIKE_NATIVE_F16",
                         "ONEDNN_MAX_CPU_ISA",
                         "OMP_WAIT_POLICY")}
    # (an outer PYTHONPATH kept behind the checkout: ./dev asan's build of the companion)
    full.update(env, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)


def laid_out(a: mx.array, layout: str) -> mx.array:
    """``a``'s values as a transposed, sliced or broadcast view (2-D ``a``)."""
    if layout == "transposed":  # stored (in, rows), read through .T: column-major
        stored = mx.array(np.ascontiguousarray(np64(a).T), dtype=mx.float32).astype(a.dtype)
        mx.eval(stored)
        return stored.T
    if layout == "sliced rows":
        big = mx.zeros((2 * a.shape[0], a.shape[1]), a.dtype)
        big[::2] = a
        return big[::2]
    if layout == "sliced columns":
        big = mx.zeros((a.shape[0], a.shape[1] + 3), a.dtype)
        big[:, 1:-2] = a
        return big[:, 1:-2]
    if layout == "broadcast" and a.shape[0] > 0:
        return mx.broadcast_to(a[:1], a.shape)
    return a


LAYOUTS = ["contiguous", "transposed", "sliced rows", "sliced columns", "broadcast"]
