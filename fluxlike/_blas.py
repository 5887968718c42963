"""An optimised BLAS under MLX on Linux.

The Linux ``mlx-cpu`` wheel links a bundled *reference* BLAS (netlib, ~8 GFLOP/s sgemm).
A BLAS opened with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported takes its place:
the dynamic linker binds MLX's ``cblas_sgemm`` to the first definition in the global scope
(~200-250 GFLOP/s with OpenBLAS on two cores). Importing :mod:`fluxlike` does this first of
all, so it must come before ``import mlx.core`` (or the BLAS must be in ``LD_PRELOAD``).

``FLUXLIKE_BLAS`` chooses: a path to a library (used instead of the search), or ``0``/``off``/
``none`` to leave MLX's BLAS alone. Otherwise the search tries Debian's OpenBLAS
(``libopenblas0-pthread``), any ``libopenblas`` the linker knows, a pip ``cmeel-openblas``, then
MKL from pip. Nothing happens on other systems (macOS: MLX uses Accelerate).

What MLX really calls is checked, not assumed: the slot of ``cblas_sgemm`` in ``libmlx.so``'s
global offset table is read and :func:`blas_info` names the library that holds its target.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import struct
import sys
import sysconfig
import warnings
from dataclasses import dataclass

__all__ = ["BlasInfo", "BlasWarning", "blas_info"]

DISABLED = ("0", "off", "none", "false", "no")
SYMBOL = "cblas_sgemm"
# Path fragments of optimised implementations; anything else named libblas is a reference build.
OPTIMISED = ("openblas", "mkl", "blis", "flame", "atlas", "armpl", "accelerate")


class BlasWarning(UserWarning):
    """MLX's float32 matmul on this CPU runs on a slow reference BLAS; the message says why
    and how to fix it."""


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU matmul calls.

    ``path``: the library ``cblas_sgemm`` resolves to in ``libmlx.so`` (``None`` where it
    cannot be known: not Linux, or MLX does not call a shared BLAS); ``optimised``: whether
    that is an optimised implementation; ``loaded``: the library fluxlike opened, if any;
    ``reason``: how it came about, in words.
    """

    path: str | None
    optimised: bool
    loaded: str | None
    reason: str


_loaded: str | None = None
_reason = "not loaded yet"
_warned = False


def blas_info() -> BlasInfo:
    """Which BLAS MLX's CPU matmul calls, read from the running process.

    >>> from fluxlike import blas_info
    >>> info = blas_info()
    >>> isinstance(info.optimised, bool), isinstance(info.reason, str)
    (True, True)
    """
    if not sys.platform.startswith("linux"):
        return BlasInfo(None, True, None, _reason)
    import mlx.core  # noqa: F401  (the table below is filled when libmlx.so is loaded)

    path = resolved_path()
    optimised = path is not None and is_optimised(path)
    return BlasInfo(path, optimised, _loaded, _reason)


def is_optimised(path: str) -> bool:
    """Whether the library at ``path`` is an optimised BLAS rather than a reference build."""
    real = os.path.realpath(path).lower()
    if any(word in real for word in OPTIMISED):
        return True
    return not os.path.basename(real).startswith(("libblas", "libcblas"))


def load() -> None:
    """Open an optimised BLAS globally before ``mlx.core`` is imported; warn once if MLX
    ends up on its reference BLAS. Called by ``import fluxlike``; a no-op off Linux."""
    global _loaded, _reason
    if not sys.platform.startswith("linux"):
        _reason = f"not Linux ({sys.platform}): MLX uses the platform's BLAS"
        return
    choice = os.environ.get("FLUXLIKE_BLAS", "").strip()
    if choice.lower() in DISABLED and choice:
        _reason = f"disabled by FLUXLIKE_BLAS={choice}"
        return
    if "mlx.core" in sys.modules:
        _reason = "mlx.core was imported before fluxlike"
        found = candidates()
        preload = found[0] if found else "/path/to/libopenblas.so.0"
        _check(fix=f"import fluxlike before mlx (make `import fluxlike` the program's first "
                   f"import), or start Python with LD_PRELOAD={preload}"
                   + ("" if found else f"; first {INSTALL_FIX}"))
        return
    preloaded = _global_symbol_owner()
    if preloaded is not None:  # LD_PRELOAD or an earlier RTLD_GLOBAL load
        _reason = f"already in the process: {preloaded}"
        _check(fix="remove the reference BLAS from LD_PRELOAD")
        return
    failure = None
    if choice:
        _loaded, failure = _open(choice)
        if _loaded is not None:
            _reason = f"loaded from FLUXLIKE_BLAS={choice}"
    if _loaded is None:
        for path in candidates():
            _loaded, _ = _open(path)
            if _loaded is not None:
                _reason = f"loaded {path}"
                break
    if _loaded is None:
        _reason = "no optimised BLAS found"
    if failure is not None:
        _reason = f"FLUXLIKE_BLAS={choice} could not be used ({failure}); {_reason}"
        _warn(f"FLUXLIKE_BLAS={choice!r} could not be used: {failure}. "
              f"Set it to the path of an optimised BLAS (e.g. libopenblas.so.0) or to 'off'.")
    _check(fix=INSTALL_FIX)


INSTALL_FIX = (
    "install an optimised BLAS: `apt-get install libopenblas0-pthread` (Debian/Ubuntu), or "
    "set FLUXLIKE_BLAS=/path/to/libopenblas.so.0, or start Python with "
    "LD_PRELOAD=/path/to/libopenblas.so.0"
)


def candidates() -> list[str]:
    """Optimised BLAS libraries that exist on this machine, best first."""
    arch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(
        platform.machine(), f"{platform.machine()}-linux-gnu"
    )
    paths = [
        f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",
        f"/usr/lib/{arch}/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
    ]
    prefixes = {sys.prefix, sysconfig.get_paths().get("purelib", sys.prefix)}
    for prefix in sorted(prefixes):  # pip packages: cmeel-openblas, then mkl
        paths.append(os.path.join(prefix, "cmeel.prefix", "lib", "libopenblas.so.0"))
        paths.append(os.path.join(prefix, "lib", "libmkl_rt.so.2"))
    found = [p for p in paths if os.path.exists(p)]
    if not found:  # ldconfig's cache; a subprocess, so only when the usual places are empty
        name = ctypes.util.find_library("openblas")
        if name:
            found.append(name)
    return found


def _open(path: str) -> tuple[str | None, str | None]:
    """``(path, None)`` once ``path`` is open globally and defines ``cblas_sgemm``, else
    ``(None, why not)``."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        return None, str(error)
    if not hasattr(lib, SYMBOL):
        return None, f"{path} has no {SYMBOL}"
    return path, None


def _check(fix: str) -> None:
    """Warn once if MLX's ``cblas_sgemm`` resolves to a reference BLAS."""
    info = blas_info()
    if info.path is None or info.optimised:
        return
    _warn(
        f"MLX's float32 matmul runs on the reference BLAS {info.path} "
        f"(~30x slower than an optimised one) because {info.reason}. To fix it, {fix}; "
        f"or set FLUXLIKE_BLAS=off to silence this warning."
    )


def _warn(message: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(message, BlasWarning, stacklevel=_outside_level())


def _outside_level() -> int:
    """The ``stacklevel`` of the first caller outside fluxlike and the import machinery
    (the user's ``import fluxlike``), counted from ``_warn``."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:  # warnings skips these itself
            frame = frame.f_back
            continue
        if not name.startswith(package):
            break
        frame, level = frame.f_back, level + 1
    return level


# --- reading the process: where does a symbol resolve? ------------------------------------

class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libc.dlsym.restype = ctypes.c_void_p
    return libc


def _owner(address: int | None) -> str | None:
    """The file of the loaded object holding ``address``."""
    if not address:
        return None
    found = _DlInfo()
    if not _libc().dladdr(ctypes.c_void_p(address), ctypes.byref(found)) or not found.dli_fname:
        return None
    return os.fsdecode(found.dli_fname)


def _global_symbol_owner() -> str | None:
    """The library defining ``cblas_sgemm`` in the process's global scope, if any."""
    return _owner(_libc().dlsym(None, SYMBOL.encode()))  # NULL handle = RTLD_DEFAULT


def resolved_path() -> str | None:
    """The library that ``libmlx.so``'s call to ``cblas_sgemm`` jumps into, read from its
    global offset table (Python loads extensions with immediate binding, so the slot holds
    the final target); ``None`` if MLX calls no shared ``cblas_sgemm``."""
    mlx_path = _mapped("libmlx.so")
    if mlx_path is None:
        return None
    try:
        offset = _got_offset(mlx_path, SYMBOL)
        bias = _load_bias(mlx_path)
    except (OSError, ValueError, struct.error):
        return None
    if offset is None or bias is None:
        return None
    return _owner(ctypes.c_void_p.from_address(bias + offset).value)


def _mapped(name: str) -> str | None:
    """The path of a file named ``name`` mapped into this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if os.path.basename(path) == name:
                return path
    return None


def _load_bias(path: str) -> int | None:
    """The load address of the shared object at ``path`` (``l_addr`` of its link map)."""
    handle = ctypes.CDLL(path)._handle  # already loaded: only takes a reference
    link_map = ctypes.c_void_p()
    libc = ctypes.CDLL(None)
    if libc.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(link_map)) != 0:  # RTLD_DI_LINKMAP
        return None
    return ctypes.c_size_t.from_address(link_map.value).value


def _got_offset(path: str, symbol: str) -> int | None:
    """The address (relative to the load bias) of ``symbol``'s relocation slot in the ELF64
    little-endian shared object at ``path``."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:6] != b"\x7fELF\x02\x01":
            raise ValueError(f"{path} is not a little-endian ELF64 file")
        shoff = struct.unpack_from("<Q", elf, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                    for i in range(shnum)]
        wanted = symbol.encode() + b"\0"
        rela = [s for s in sections if s[1] == 4]  # SHT_RELA; .rela.plt is the small one
        for _, _, _, _, offset, size, link, _, _, _ in sorted(rela, key=lambda s: s[5]):
            symtab, strtab = sections[link], sections[sections[link][6]]
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", elf[offset:offset + size]):
                index = r_info >> 32
                if not index:
                    continue
                name = strtab[4] + struct.unpack_from("<I", elf, symtab[4] + index * 24)[0]
                if elf[name:name + len(wanted)] == wanted:
                    return r_offset
    return None


load()
