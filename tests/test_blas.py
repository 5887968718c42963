"""The optimised BLAS under MLX on Linux (fluxlike/_blas.py).

What a process ends up with depends on what it imported first, so every case but the test
run's own is a fresh interpreter.
"""

import json
import os
import subprocess
import sys
import textwrap

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
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {imports}
    import fluxlike
    info = fluxlike.blas_info()
    import fluxlike._blas
    fluxlike._blas.load()  # running the loader again must not warn again
print(json.dumps({{
    "path": info.path, "optimised": info.optimised, "loaded": info.loaded,
    "reason": info.reason,
    "warnings": [str(w.message) for w in caught if w.category is fluxlike.BlasWarning],
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


def test_a_bogus_path_warns_once_and_falls_back_to_the_search():
    report = run(FLUXLIKE_BLAS="/no/such/libblas.so")
    assert len(report["warnings"]) == 1
    assert "/no/such/libblas.so" in report["warnings"][0]
    assert report["optimised"] == bool(FOUND)


def test_mlx_imported_first_warns_once_with_the_fix():
    report = run(imports="import mlx.core")
    assert not report["optimised"] and report["loaded"] is None
    assert len(report["warnings"]) == 1
    message = report["warnings"][0]
    assert "import fluxlike before mlx" in message and "LD_PRELOAD" in message


@needs_blas
def test_ld_preload_makes_the_import_order_irrelevant():
    report = run(imports="import mlx.core", LD_PRELOAD=FOUND[0])
    assert report["optimised"] and report["warnings"] == []


@pytest.mark.parametrize("path, optimised", [
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0", True),
    ("/opt/venv/lib/libmkl_rt.so.2", True),
    ("/x/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0", False),
    ("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", False),
])
def test_reference_and_optimised_names(path, optimised):
    assert _blas.is_optimised(path) == optimised
