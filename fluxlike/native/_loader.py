"""Finding, checking and loading the native companion, once, when :mod:`fluxlike.native` is
imported; and :data:`switch`, what the routing reads at each call."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx

_DISABLED = ("0", "off", "no", "false", "none")
_MLX = mx.__version__  # type: ignore[attr-defined]  # not in MLX's stub
# The entries this fluxlike calls: a companion built from an older native/ lacks some.
REQUIRED = ("matmul", "plain_linear", "conv", "conv_backward_data", "max_pool", "softmax",
            "adam_step", "rmsprop_step", "all_finite", "gelu", "convert", "bias_grad",
            "wait_for_creations", "sigmoid", "tanh", "exp", "log_sum_exp", "set_native_f16")


# The wait policy of oneDNN's OpenMP threads where the environment sets none. libgomp's own
# spins each thread for about 300,000 iterations after a parallel region: the fastest on an
# idle machine (a seed-MLP step 1.7 ms against 2.4 passive), and 10-100x slower as soon as
# anything else runs (the same step 69-214 ms beside one busy process, passive 3-8 ms), because
# the spinning threads take the cores that MLX's threads, OpenBLAS's and the other processes
# need (bench/results/2026-12-03-openmp-wait-policy.md; AMD EPYC, 2 cores, 2026-12-03).
WAIT_POLICY = "PASSIVE"
_OMP_SET_BY_USER = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@contextmanager
def _wait_policy() -> Iterator[None]:
    """:data:`WAIT_POLICY` in the environment while the companion (and with it libgomp, which
    reads it once, as it loads) is imported, unless the user set a policy; the environment as
    it was afterwards, so that child processes inherit nothing from fluxlike."""
    if any(key in os.environ for key in _OMP_SET_BY_USER):
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


@dataclass(frozen=True)
class NativeInfo:
    """What the native companion provides in this process.

    ``available``: whether its kernels are in use; ``reason``: why, or why not, in words;
    ``isa``: oneDNN's effective CPU ISA (``None`` when not loaded); ``bfloat16``: how
    bfloat16 operands run - ``"native"`` (oneDNN's bfloat16 kernels), ``"float32 kernels"``
    (upcast, bfloat16 numerics) or ``None``; ``float16``: the same for float16 operands -
    ``"native"`` (oneDNN's float16 kernels, on AVX512-FP16), ``"float32 kernels"`` or
    ``None``;
    ``mlx``: the running MLX version;
    ``built_for``: the MLX version the companion was built against; ``onednn``: oneDNN's
    version; ``path``: where the companion was found.
    """

    available: bool
    reason: str
    isa: str | None = None
    bfloat16: str | None = None
    mlx: str = _MLX
    built_for: str | None = None
    onednn: str | None = None
    path: str | None = None
    float16: str | None = None


class Switch:
    """What the routing reads at each call: ``ext``, the companion's module while fluxlike
    routes calls to its kernels (``None`` when it is not in use, and inside
    :func:`fluxlike.native.disabled`); ``bf16``, whether bfloat16 runs in oneDNN's bfloat16
    kernels; ``f16``, whether float16 runs in its float16 kernels. ``loaded`` is the companion
    in use whatever ``disabled`` says, ``info`` what
    :func:`fluxlike.native.native_info` reports."""

    __slots__ = ("ext", "bf16", "f16", "loaded", "info")

    def __init__(self, info: NativeInfo, ext: ModuleType | None, bf16: bool):
        self.info = info
        self.ext: ModuleType | None = ext
        self.loaded: ModuleType | None = ext
        self.bf16 = bf16 and ext is not None
        self.f16 = ext is not None and bool(ext.native_f16())


def find() -> tuple[NativeInfo, ModuleType | None, bool]:
    """``(info, the companion's module or None, bfloat16 in oneDNN's bfloat16 kernels)``."""
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
    rebuild = "rebuild it (./dev setup, or pip install --no-build-isolation ./native)"
    if built_for != _MLX:
        return NativeInfo(False, f"fluxlike-native at {path} was built for MLX {built_for}, "
                                 f"this is MLX {_MLX}: {rebuild}", built_for=built_for,
                          path=path), None, False
    try:
        with _wait_policy():
            from fluxlike_native import _ext as ext
    except ImportError as error:
        return NativeInfo(False, f"fluxlike-native at {path} could not be loaded ({error}); "
                                 f"reinstall it with ./dev setup", built_for=built_for,
                          path=path), None, False
    if ext.runtime_mlx_version() != _MLX or ext.built_mlx_version != built_for:
        return NativeInfo(False, f"fluxlike-native's module reports MLX "
                                 f"{ext.built_mlx_version} (libmlx: "
                                 f"{ext.runtime_mlx_version()}), expected {_MLX}: {rebuild}",
                          built_for=built_for, path=path), None, False
    missing = [name for name in REQUIRED if not hasattr(ext, name)]
    if missing:
        return NativeInfo(False, f"fluxlike-native at {path} predates this fluxlike (no "
                                 f"{', '.join(missing)}): {rebuild}", built_for=built_for,
                          path=path), None, False
    isa = ext.cpu_isa()
    forced = os.environ.get("FLUXLIKE_NATIVE_BF16", "").strip().lower()
    bf16 = ext.isa_has_bf16() and forced != "float32"
    if bf16:
        how, why = "native", (f"oneDNN's bfloat16 kernels ({isa}), which flush bfloat16 "
                              f"denormals to zero (FLUXLIKE_NATIVE_BF16=float32 keeps them)")
    elif forced == "float32":
        how, why = "float32 kernels", "bfloat16 in float32 kernels (FLUXLIKE_NATIVE_BF16=float32)"
    else:
        how, why = "float32 kernels", (f"bfloat16 in float32 kernels: the CPU ISA {isa} has no "
                                       f"AVX512_CORE_BF16")
    # float16 in oneDNN's float16 kernels where the CPU converts it in hardware (AVX512-FP16:
    # they accumulate in float32 at float32's speed); elsewhere in its float32 kernels,
    # upcast. Both round the sums once to float16.
    forced16 = os.environ.get("FLUXLIKE_NATIVE_F16", "").strip().lower()
    ext.set_native_f16(forced16 != "float32")
    if ext.native_f16():
        how16, why16 = "native", "float16 in oneDNN's float16 kernels (AVX512-FP16)"
    elif forced16 == "float32":
        how16, why16 = "float32 kernels", "float16 in float32 kernels (FLUXLIKE_NATIVE_F16=float32)"
    else:
        how16, why16 = "float32 kernels", (f"float16 in float32 kernels: the CPU ISA {isa} "
                                           f"has no AVX512_FP16")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    limit = f", ONEDNN_MAX_CPU_ISA={cap}" if cap else ""
    reason = (f"oneDNN {ext.onednn_version()} matmul, convolution, pooling and softmax in use, "
              f"with native Adam and RMSprop updates: float32 on {isa}{limit}; {why}; {why16}")
    return NativeInfo(True, reason, isa, how, _MLX, built_for, ext.onednn_version(),
                      path, how16), ext, bf16


switch = Switch(*find())
