"""fluxlike as pip installs it: metadata, extras, ``__version__``, ``__all__``, ``py.typed``.

The slow half installs the checkout into a fresh venv, as a user would
(``pip install "<checkout>[cpu]"`` on Linux, plain on macOS), and runs the installed package
and mypy against it; it is skipped only when pip cannot reach its index.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import mlx.core as mx
import pytest

import fluxlike

ROOT = Path(__file__).parent.parent
LINUX = platform.system() == "Linux"
# What pip prints when it cannot reach an index, as opposed to a broken pyproject.toml.
OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Network is unreachable|No matching distribution found|ProxyError|timed out",
)


# --- the package as imported here ---------------------------------------------------------


def test_all_lists_the_public_names_exactly_once():
    names = fluxlike.__all__
    assert len(names) == len(set(names)), "a name is listed twice in fluxlike.__all__"
    missing = [n for n in names if not hasattr(fluxlike, n)]
    assert not missing, f"fluxlike.__all__ names what fluxlike lacks: {missing}"
    public = {
        n
        for n, v in vars(fluxlike).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    # compile is public as fluxlike.compile, but `import *` must not shadow the builtin
    unlisted = sorted(public - set(names) - {"compile"})
    assert not unlisted, f"public names missing from fluxlike.__all__: {unlisted}"
    assert "compile" not in names and callable(fluxlike.compile)
    assert not [n for n in names if isinstance(getattr(fluxlike, n), types.ModuleType)]


def test_star_import_exports_exactly_all():
    namespace: dict = {}
    exec("from fluxlike import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(fluxlike.__all__)
    assert "compile" not in namespace and "losses" not in namespace


def test_version_is_the_metadata_version():
    from importlib.metadata import version

    assert fluxlike.__version__ == version("fluxlike")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", fluxlike.__version__)


def test_license_and_typed_marker_are_in_the_checkout():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (ROOT / "fluxlike" / "py.typed").exists()


def test_this_mlx_is_inside_the_tested_range():
    """A canary: a newer MLX installed here must be tested, then the bound in pyproject moved."""
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"mlx>=([\d.]+),<([\d.]+)"', text).groups()
    version = tuple(int(p) for p in mx.__version__.split(".")[:2])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split("."))), (
        f"mlx {mx.__version__} is outside the tested range >={low},<{high} in pyproject.toml"
    )


# --- the package as pip installs it -------------------------------------------------------


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A copy of the checkout's package files: building must leave no build/ in the checkout."""
    copy = tmp_path_factory.mktemp("source") / "fluxlike-src"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(
        ROOT / "fluxlike", copy / "fluxlike", ignore=shutil.ignore_patterns("__pycache__")
    )
    return copy


def _fresh_install(where: Path, target: str) -> tuple[str, Path, Path]:
    """``(python, site_packages, where)`` of a new venv in ``where`` with ``target`` installed."""
    venv = where / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], timeout=60)
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    try:
        pip = _run([python, "-m", "pip", "install", "-q", target], timeout=85, cwd=where)
    except subprocess.TimeoutExpired:
        pytest.skip("pip install of the checkout took over 85 s: is its index reachable?")
    if pip.returncode != 0 and OFFLINE.search(pip.stderr + pip.stdout):
        pytest.skip(f"pip cannot reach its index:\n{pip.stderr[-2000:]}")
    assert pip.returncode == 0, pip.stderr
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return python, Path(site.stdout.strip()), where


@pytest.fixture(scope="module")
def installed(source, tmp_path_factory):
    """The checkout pip-installed as the README says: ``.[cpu]`` on Linux, ``.`` on macOS."""
    target = f"{source}[cpu]" if LINUX else str(source)
    return _fresh_install(tmp_path_factory.mktemp("install"), target)


@pytest.mark.skipif(not LINUX, reason="on macOS the plain install is MLX's Metal build")
def test_plain_linux_install_forces_no_backend_and_says_which_to_choose(source, tmp_path):
    """A CUDA user installs fluxlike[cuda12]; so plain fluxlike on Linux brings no mlx-cpu, and
    importing it without a backend says what to install."""
    python, _, where = _fresh_install(tmp_path, str(source))
    listed = _run([python, "-m", "pip", "list", "--format=json"], timeout=60)
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert "mlx" in names and not {"mlx-cpu", "mlx-cuda-12", "mlx-cuda-13"} & names
    out = _run([python, "-c", "import fluxlike"], cwd=where, timeout=60)
    assert out.returncode != 0
    assert "pip install 'fluxlike[cpu]'" in out.stderr and "libmlx.so" in out.stderr, out.stderr


def test_installed_package_runs_and_matches_its_metadata(installed):
    python, site, where = installed
    probe = textwrap.dedent(
        """
        import json, importlib.metadata as md
        import mlx.core as mx
        import fluxlike
        namespace = {}
        exec("from fluxlike import *", namespace)
        with fluxlike.autocast(mx.bfloat16):
            y = fluxlike.Dense(2, 3)(mx.ones((1, 2)))
        print(json.dumps({
            "file": fluxlike.__file__,
            "version": fluxlike.__version__,
            "metadata_version": md.version("fluxlike"),
            "star": sorted(set(namespace) - {"__builtins__"}),
            "all": sorted(fluxlike.__all__),
            "dtype": str(y.dtype),
            "mlx_cpu": [d.metadata["Name"] for d in md.distributions()
                        if d.metadata["Name"].lower().replace("_", "-") == "mlx-cpu"],
        }))
        """
    )
    # run outside the checkout, so that only the installed copy can be imported
    out = _run([python, "-c", probe], cwd=where, timeout=60)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert Path(found["file"]).is_relative_to(site)
    assert found["version"] == found["metadata_version"] == fluxlike.__version__
    assert found["star"] == found["all"] == sorted(fluxlike.__all__)
    assert found["dtype"] == "mlx.core.bfloat16"
    if LINUX:
        assert found["mlx_cpu"], "fluxlike[cpu] did not bring in mlx-cpu"


def test_installed_metadata_has_the_extras_license_and_classifiers(installed):
    python, _, where = installed
    probe = (
        "import json, importlib.metadata as md; m = md.metadata('fluxlike'); "
        "print(json.dumps({k: m.get_all(k) for k in ('Requires-Dist', 'Provides-Extra', "
        "'Classifier', 'License-Expression', 'Requires-Python', 'Summary', "
        "'Description-Content-Type')}))"
    )
    out = _run([python, "-c", probe], cwd=where, timeout=60)
    assert out.returncode == 0, out.stderr
    meta = json.loads(out.stdout)
    requires = [r.replace(" ", "") for r in meta["Requires-Dist"]]
    # the base install takes plain mlx (Metal on macOS; no forced mlx[cpu] beside a CUDA build)
    assert "mlx<0.33,>=0.32" in requires
    assert not [r for r in requires if r.startswith("mlx[") and "extra==" not in r]
    for extra in ("cpu", "cuda12", "cuda13"):
        assert f'mlx[{extra}]<0.33,>=0.32;extra=="{extra}"' in requires
    assert set(meta["Provides-Extra"]) >= {"cpu", "cuda12", "cuda13", "test", "bench", "examples"}
    assert 'torch;extra=="bench"' in requires
    assert {'matplotlib>=3.7;extra=="examples"', 'scikit-learn>=1.3;extra=="examples"'} <= set(
        requires
    )
    assert meta["License-Expression"] == ["MIT"]
    assert meta["Requires-Python"] == [">=3.10"]
    assert meta["Description-Content-Type"] == ["text/markdown"]
    assert "Typing :: Typed" in meta["Classifier"]
    assert "Programming Language :: Python :: 3.10" in meta["Classifier"]


USER_SCRIPT = """
import mlx.core as mx

import fluxlike as fl
from fluxlike.losses import logitcrossentropy

model = fl.Chain(fl.Dense(4, 8, fl.relu), fl.Dense(8, 2))
x, y = mx.zeros((3, 4)), mx.array([0, 1, 1])
with fl.autocast(mx.bfloat16):
    logits = model(x)
opt_state = fl.setup(fl.Adam(1e-3), model)
grads = fl.gradient(lambda m: logitcrossentropy(m(x), y), model, autocast=mx.bfloat16)
fl.update(opt_state, model, grads[0])
half = fl.f16mix(model)
version: str = fl.__version__
reveal_type(fl.setup)
layer = fl.Dense("four", 8)  # the one error: fluxlike's annotations say in_features is an int
"""


def test_mypy_finds_the_installed_package_typed(installed, tmp_path):
    """PEP 561: py.typed ships, so mypy reads fluxlike's annotations in a user's script."""
    pytest.importorskip("mypy", reason="needs mypy (the [test] extra): pip install -e '.[test]'")
    python, site, _ = installed
    assert (site / "fluxlike" / "py.typed").exists()
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "MYPY_CACHE_DIR": str(tmp_path / "cache")}
    out = _run(
        [sys.executable, "-m", "mypy", "--python-executable", python, "--no-incremental",
         "--no-error-summary", str(script)],
        cwd=tmp_path, env=env, timeout=120,
    )
    report = out.stdout + out.stderr
    assert "py.typed" not in report and "import-untyped" not in report, report
    assert 'Revealed type is "def (rule: ' in report
    assert "fluxlike.optimisers.state.OptState" in report
    errors = [line for line in report.splitlines() if ": error:" in line]
    assert len(errors) == 1 and 'Argument 1 to "Dense" has incompatible type "str"' in errors[0]
