"""An optimised BLAS under MLX on Linux.

The Linux ``mlx-cpu`` wheel links a bundled *reference* BLAS and LAPACK (netlib, far slower
than an optimised one: figures in ``bench/README.md``, *Figures quoted by the
code*). At ``import fluxlike`` an optimised
BLAS is opened privately (``RTLD_LOCAL``) and ``libmlx.so``'s calls into BLAS and LAPACK are
pointed at it: every slot of ``libmlx.so``'s global offset table for a BLAS or LAPACK routine
(``cblas_sgemm``, ``sgetrf_``, ...) that the library defines itself gets that library's
function. Nothing else in the process sees the library, so a torch (or anything) loaded
later keeps its own BLAS, and it works whether ``mlx.core`` was imported before fluxlike or
after.

``FLUXLIKE_BLAS`` chooses: a path to a library (used instead of the search), or ``0``/``off``/
``none`` to leave MLX's BLAS alone. Otherwise the search tries Debian's OpenBLAS
(``libopenblas0-pthread``), any ``libopenblas`` the linker knows, a pip ``cmeel-openblas``, then
MKL from pip. A BLAS already under MLX (``LD_PRELOAD``) is left in place. Nothing happens on
other systems (macOS: MLX uses Accelerate).

What MLX really calls is checked, not assumed: :func:`blas_info` names the library that holds
the target of ``libmlx.so``'s ``cblas_sgemm`` slot.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
import re
import struct
import sys
import sysconfig
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from ._stack import outside_stacklevel

__all__ = ["BlasInfo", "BlasWarning", "blas_info"]

DISABLED = ("0", "off", "none", "false", "no")
DEFAULT = ("1", "on", "true", "yes", "auto")  # the search, as when FLUXLIKE_BLAS is unset
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
    """Point MLX's BLAS and LAPACK calls at an optimised BLAS; warn once if MLX ends up on its
    reference BLAS. Called by ``import fluxlike``; a no-op off Linux and once done."""
    global _loaded, _reason
    if not sys.platform.startswith("linux"):
        _reason = f"not Linux ({sys.platform}): MLX uses the platform's BLAS"
        return
    if _loaded is not None:
        return
    choice = os.environ.get("FLUXLIKE_BLAS", "").strip()
    if choice.lower() in DEFAULT:
        choice = ""
    if choice.lower() in DISABLED and choice:
        _reason = f"disabled by FLUXLIKE_BLAS={choice}"
        return
    import mlx.core  # noqa: F401  (libmlx.so must be loaded to be pointed anywhere)

    present = resolved_path()
    if present is not None and is_optimised(present):  # LD_PRELOAD
        _reason = f"already in the process: {present}"
        return
    failure = None
    if choice:
        _loaded, failure = _open(choice)
        if _loaded is not None:
            _reason = f"loaded from FLUXLIKE_BLAS={choice}"
    if _loaded is None:
        _reason = "no optimised BLAS found"
        for path in candidates():
            _loaded, why = _open(path)
            if _loaded is not None:
                _reason = f"loaded {path}"
                break
            _reason = f"{path} could not be used ({why})"
    if failure is not None:
        _reason = f"FLUXLIKE_BLAS={choice} could not be used ({failure}); {_reason}"
        _warn(f"FLUXLIKE_BLAS={choice!r} could not be used: {failure}. "
              f"Set it to an optimised BLAS (a path, or a name such as libopenblas.so.0) or "
              f"to 'off'.")
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
    """``(path, None)`` once ``libmlx.so``'s BLAS and LAPACK slots point into the library at
    ``path`` (opened privately), else ``(None, why not)``."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as error:
        return None, str(error)
    if not hasattr(lib, SYMBOL):
        return None, f"{path} has no {SYMBOL}"
    path = _file_of(lib) or path  # a bare soname (from ldconfig's cache) as the loader found it
    try:
        why = _point_mlx_at(lib, path)
    except OSError as error:  # /proc/self/maps unreadable, mprotect refused
        why = str(error)
    return (path, None) if why is None else (None, why)


class _LinkMap(ctypes.Structure):
    """The start of the loader's ``struct link_map``: the object's load bias and file."""

    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


_RTLD_DI_LINKMAP = 2


def _file_of(lib: ctypes.CDLL) -> str | None:
    """The file the dynamic loader opened for ``lib`` (``dlinfo``), or ``None``."""
    dlinfo = getattr(ctypes.CDLL(None), "dlinfo", None)
    if dlinfo is None:
        return None
    found = ctypes.POINTER(_LinkMap)()
    if dlinfo(ctypes.c_void_p(lib._handle), _RTLD_DI_LINKMAP, ctypes.byref(found)) != 0 or (
        not found
    ):
        return None
    name = found.contents.l_name
    return os.path.abspath(os.fsdecode(name)) if name else None


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
    warnings.warn(message, BlasWarning, stacklevel=outside_stacklevel())


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


def resolved_path() -> str | None:
    """The library that ``libmlx.so``'s call to ``cblas_sgemm`` jumps into, read from its
    global offset table (Python loads extensions with immediate binding, so the slot holds
    the final target); ``None`` if MLX calls no shared ``cblas_sgemm``."""
    where = _mlx_slots()
    if where is None or SYMBOL not in where[1]:
        return None
    bias, slots = where
    return _owner(ctypes.c_void_p.from_address(bias + slots[SYMBOL][0]).value)


def _point_mlx_at(lib: ctypes.CDLL, path: str) -> str | None:
    """Store in each of ``libmlx.so``'s slots for a BLAS or LAPACK routine that ``lib``
    (opened from ``path``) defines itself, not through a library it loads, that definition.
    ``None`` when done, else why not, found before anything is written (a write that the
    system refuses raises ``OSError``)."""
    where = _mlx_slots()
    if where is None:
        return "the slots of libmlx.so could not be read"
    bias, slots = where
    if SYMBOL not in slots:
        return f"libmlx.so does not call a shared {SYMBOL}"
    libc, handle, real = _libc(), ctypes.c_void_p(lib._handle), os.path.realpath(path)
    stores, names = [], set()
    for name, offsets in slots.items():
        if not _BLAS_NAME.fullmatch(name):  # never a libc/libm/C++ function of the same name
            continue
        address = libc.dlsym(handle, name.encode())
        if address and os.path.realpath(_owner(address) or "") == real:
            stores += [(bias + offset, address) for offset in offsets]
            names.add(name)
    if SYMBOL not in names:
        return f"{path} does not define {SYMBOL} itself (only through a library it loads)"
    writable = _writable_pages(slot for slot, _ in stores)
    for slot, address in stores:
        _store(slot, address, writable)
    return None


def _store(slot: int, value: int, writable: set[int]) -> None:
    """Write the pointer ``value`` at ``slot``; a page not in ``writable`` (a library linked
    with ``-z relro -z now`` has its table read-only) is made writable for the write only."""
    page = slot - slot % mmap.PAGESIZE
    if page in writable:
        ctypes.c_void_p.from_address(slot).value = value
        return
    libc = _libc()

    def protect(flags: int) -> None:
        if libc.mprotect(ctypes.c_void_p(page), ctypes.c_size_t(mmap.PAGESIZE), flags):
            raise OSError(f"mprotect of the page at {page:#x} failed")

    protect(mmap.PROT_READ | mmap.PROT_WRITE)
    ctypes.c_void_p.from_address(slot).value = value
    protect(mmap.PROT_READ)


def _writable_pages(addresses: Iterable[int]) -> set[int]:
    """The pages among those of ``addresses`` that are mapped writable."""
    pages = {a - a % mmap.PAGESIZE for a in addresses}
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            low, high = (int(v, 16) for v in span.split("-"))
            if "w" in perms:
                found |= {p for p in pages if low <= p < high}
    return found


def _mlx_slots() -> tuple[int, dict[str, list[int]]] | None:
    """``(load bias, slots)`` of the loaded ``libmlx.so`` (see :func:`_slots`), or ``None``
    where they cannot be read."""
    mlx_path = _mapped("libmlx.so")
    if mlx_path is None:
        return None
    try:
        bias = _load_bias(mlx_path)
        return None if bias is None else (bias, _slots(mlx_path))
    except (OSError, ValueError, struct.error):
        return None


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
    if link_map.value is None:  # a null link map: nothing to read
        return None
    return ctypes.c_size_t.from_address(link_map.value).value


# The names BLAS and LAPACK export: CBLAS's, and Fortran's (lower case, trailing underscore)
_BLAS_NAME = re.compile(r"cblas_\w+|[a-z][a-z0-9]*_")
# Relocation types that fill a pointer slot with a symbol's address: GLOB_DAT, JUMP_SLOT
_SLOT_TYPES = {62: (6, 7), 183: (1025, 1026)}  # by e_machine: x86-64, AArch64


@functools.cache
def _slots(path: str) -> dict[str, list[int]]:
    """The addresses (relative to the load bias) of the pointer slots the dynamic linker
    fills with each symbol's address, in the ELF64 little-endian shared object at ``path``:
    its global offset table, by symbol name."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:6] != b"\x7fELF\x02\x01":
            raise ValueError(f"{path} is not a little-endian ELF64 file")
        machine = struct.unpack_from("<H", elf, 0x12)[0]
        if machine not in _SLOT_TYPES:
            raise ValueError(f"{path}: machine {machine} is not x86-64 or AArch64")
        kinds = _SLOT_TYPES[machine]
        shoff = struct.unpack_from("<Q", elf, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                    for i in range(shnum)]
        slots: dict[str, list[int]] = {}
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind != 4:  # SHT_RELA
                continue
            symtab, strtab = sections[link], sections[sections[link][6]]
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", elf[offset:offset + size]):
                index = r_info >> 32
                if not index or (r_info & 0xFFFFFFFF) not in kinds:
                    continue
                name = strtab[4] + struct.unpack_from("<I", elf, symtab[4] + index * 24)[0]
                slots.setdefault(elf[name:elf.find(b"\0", name)].decode(), []).append(r_offset)
    return slots


load()
