"""The optimised BLAS under MLX on Linux (fluxlike/_blas.py).

What a process ends up with depends on what it imported first, so every case but the test
run's own is a fresh interpreter.
"""

import ctypes
import ctypes.util
import json
import mmap
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

import fluxlike
from fluxlike import _blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS is swapped on Linux only"
)

FOUND = _blas.candidates()
needs_blas = pytest.mark.skipif(
    not FOUND,
    reason="no optimised BLAS on this machine: `apt-get install libopenblas0-pthread` "
    "(what ./dev does as root) provides one",
)

REPORT = """
import ctypes, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {imports}
    import fluxlike
    info = fluxlike.blas_info()
    import fluxlike._blas
    fluxlike._blas.load()  # running the loader again must not warn again
libc = ctypes.CDLL(None)
libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
print(json.dumps({{
    "path": info.path, "optimised": info.optimised, "loaded": info.loaded,
    "reason": info.reason,
    "warnings": [str(w.message) for w in caught if w.category is fluxlike.BlasWarning],
    # what a library loaded later would bind cblas_sgemm to (RTLD_DEFAULT)
    "global": fluxlike._blas._owner(libc.dlsym(None, b"cblas_sgemm")),
}}))
"""


def run(imports: str = "", **env: str) -> dict:
    """``import fluxlike`` in a fresh interpreter (after ``imports``), with ``env`` added;
    what it reports and the BlasWarnings it raised."""
    script = textwrap.dedent(REPORT).format(imports=imports)
    environ = {k: v for k, v in os.environ.items() if k not in ("FLUXLIKE_BLAS", "LD_PRELOAD")}
    done = subprocess.run(
        [sys.executable, "-c", script], env={**environ, **env}, capture_output=True,
        text=True, timeout=120, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_blas
def test_this_test_run_uses_the_optimised_blas():
    """conftest imports fluxlike before anything imports mlx.core."""
    info = fluxlike.blas_info()
    assert info.optimised, info
    if info.loaded is not None:  # None: it came from LD_PRELOAD
        assert os.path.realpath(info.path) == os.path.realpath(info.loaded), info


@needs_blas
def test_search_finds_the_installed_blas():
    report = run()
    assert report["optimised"] and report["loaded"] == FOUND[0]
    assert report["warnings"] == []


@needs_blas
def test_an_explicit_path_is_used():
    path = FOUND[-1]
    report = run(FLUXLIKE_BLAS=path)
    assert report["loaded"] == path and report["optimised"]
    assert "FLUXLIKE_BLAS" in report["reason"] and report["warnings"] == []


@pytest.mark.parametrize("value", ["off", "0", "none", "OFF"])
def test_disabled_leaves_mlx_alone_silently(value):
    report = run(FLUXLIKE_BLAS=value)
    assert report["loaded"] is None and not report["optimised"]
    assert "disabled" in report["reason"] and report["warnings"] == []


@needs_blas
def test_a_bare_library_name_is_found_as_the_loader_finds_it():
    # what ldconfig's cache (ctypes.util.find_library) and the warning's example give
    report = run(FLUXLIKE_BLAS=os.path.basename(FOUND[-1]))
    assert report["optimised"] and report["warnings"] == []
    assert os.path.isabs(report["loaded"]) and "FLUXLIKE_BLAS" in report["reason"]


@pytest.mark.parametrize("value", ["on", "1", "TRUE", "auto"])
def test_switched_on_is_the_search(value):
    report = run(FLUXLIKE_BLAS=value)
    assert report["warnings"] == [] if FOUND else len(report["warnings"]) == 1
    assert report["optimised"] == bool(FOUND) and "FLUXLIKE_BLAS" not in report["reason"]


def test_a_bogus_path_warns_once_and_falls_back_to_the_search():
    report = run(FLUXLIKE_BLAS="/no/such/libblas.so")
    assert len(report["warnings"]) == 1
    assert "/no/such/libblas.so" in report["warnings"][0]
    assert report["optimised"] == bool(FOUND)


@needs_blas
def test_mlx_imported_first_gets_the_optimised_blas_too():
    report = run(imports="import mlx.core")
    assert report["optimised"] and report["loaded"] == FOUND[0]
    assert report["warnings"] == []


@needs_blas
@pytest.mark.parametrize("imports", ["", "import mlx.core"])
def test_the_blas_stays_private_to_mlx(imports):
    """Nothing loaded later (a torch) binds its own BLAS calls to the library fluxlike
    opened: it is not in the process's global scope."""
    report = run(imports=imports)
    assert report["optimised"]
    assert report["global"] is None or (
        os.path.realpath(report["global"]) != os.path.realpath(report["loaded"]))


@needs_blas
def test_mlx_lapack_calls_go_to_the_optimised_library_and_compute_right():
    info = fluxlike.blas_info()
    bias, slots = _blas._mlx_slots()
    lapack = [name for name in ("sgetrf_", "spotrf_", "ssyevd_") if name in slots]
    assert lapack, "libmlx.so calls none of the LAPACK routines this test knows"
    for name in lapack:
        target = ctypes.c_void_p.from_address(bias + slots[name][0]).value
        assert os.path.realpath(_blas._owner(target)) == os.path.realpath(info.path), name
    a = mx.random.normal((48, 48), key=mx.random.key(0))
    spd = a @ a.T + 48 * mx.eye(48)
    assert mx.allclose(mx.linalg.inv(spd, stream=mx.cpu) @ spd, mx.eye(48), atol=1e-4)
    low = mx.linalg.cholesky(spd, stream=mx.cpu)
    assert mx.allclose(low @ low.T, spd, rtol=1e-4, atol=1e-3)


def test_slots_of_libmlx_hold_its_blas_symbols():
    bias, slots = _blas._mlx_slots()
    assert _blas.SYMBOL in slots and bias > 0
    assert all(offset > 0 for offsets in slots.values() for offset in offsets)


def test_slots_refuse_what_is_not_an_elf64_shared_object(tmp_path):
    text = tmp_path / "not_elf.so"
    text.write_bytes(b"#!/bin/sh\n" + bytes(60))
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        _blas._slots(str(text))
    other = tmp_path / "sparc.so"  # an ELF64 little-endian header for another machine
    other.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(11) + (43).to_bytes(2, "little") + bytes(44))
    with pytest.raises(ValueError, match="not x86-64 or AArch64"):
        _blas._slots(str(other))


def test_store_writes_through_a_read_only_page():
    """A library linked with -z now has its offset table read-only: the write lifts that."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert page not in (None, ctypes.c_void_p(-1).value)
    try:
        assert _blas._writable_pages([page + 8]) == set()
        _blas._store(page + 8, 0x1234, set())
        assert ctypes.c_void_p.from_address(page + 8).value == 0x1234
        assert _blas._writable_pages([page + 8]) == set()  # read-only again
    finally:
        libc.munmap(ctypes.c_void_p(page), mmap.PAGESIZE)


@needs_blas
def test_a_blas_in_ld_preload_is_left_in_place():
    report = run(imports="import mlx.core", LD_PRELOAD=FOUND[0])
    assert report["optimised"] and report["warnings"] == []
    assert report["loaded"] is None and "already in the process" in report["reason"]


@pytest.mark.parametrize("path, optimised", [
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0", True),
    ("/opt/venv/lib/libmkl_rt.so.2", True),
    ("/x/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0", False),
    ("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", False),
])
def test_reference_and_optimised_names(path, optimised):
    assert _blas.is_optimised(path) == optimised


@needs_blas
def test_a_refused_write_is_a_reason_not_a_crash(monkeypatch):
    """``import fluxlike`` must survive slots it cannot write: the library is then reported as
    unusable, with why (and load() warns with the LD_PRELOAD fix)."""
    def refuse(lib, path):
        raise OSError("mprotect refused")

    monkeypatch.setattr(_blas, "_point_mlx_at", refuse)
    assert _blas._open(FOUND[0]) == (None, "mprotect refused")


def test_a_library_without_its_own_sgemm_is_refused(tmp_path):
    """A library that only reaches cblas_sgemm through one it loads (here: libc, which has
    none) is not pointed at: MLX keeps what it has."""
    before = _blas.resolved_path()
    libm = ctypes.util.find_library("m")
    assert _blas._point_mlx_at(ctypes.CDLL(libm), libm) == (
        f"{libm} does not define cblas_sgemm itself (only through a library it loads)")
    assert _blas.resolved_path() == before
