"""The README as a user meets it: its sections exist, every ```python block runs, and every
shell command names something that exists (``--help`` works, extras are defined).

Each Python block runs in a fresh namespace, after PREAMBLE: the data a block does not make
itself (the tour's digit-sized images). A block that needs more belongs in the preamble."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()

PREAMBLE = """
import mlx.core as mx
images = mx.random.uniform(shape=(128, 8, 8, 1))   # the tour: 8x8 grey images, NHWC
labels = mx.random.randint(0, 10, (128,))
"""

SECTIONS = [
    "Install",
    "Ten lines",
    "A tour",
    "A language model in three precisions",
    "Performance",
    "Contributing",
]


def blocks(language: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of each fenced block in ``language``."""
    found = []
    for match in re.finditer(rf"^```{language}\n(.*?)^```", README, re.M | re.S):
        found.append((README[: match.start()].count("\n") + 1, match.group(1)))
    return found


def test_the_two_dev_commands_open_the_readme():
    first = blocks("sh")[0]
    assert first[0] <= 5, "the ./dev block must stay at the top of the README"
    commands = [line.split("#")[0].strip() for line in first[1].splitlines()]
    assert commands == ["./dev demo", "./dev test"]


def test_sections_exist_in_order():
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert [h for h in headings if h in SECTIONS] == SECTIONS


def test_the_plot_it_shows_is_in_the_repository():
    for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README):
        assert (ROOT / path).is_file(), f"README shows {path}, which is not in the repository"
        assert (ROOT / path).stat().st_size < 200_000, f"{path} is large for a README image"


@pytest.mark.parametrize("line, code", blocks("python"), ids=lambda v: str(v)[:12])
def test_python_block_runs(line, code, capsys):
    mx.random.seed(0)
    namespace: dict = {"__name__": f"readme_line_{line}"}
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    # a block that shows printed output as a comment prints that output
    shown = re.findall(r"print\(.*\)\s+# (.+)$", code, re.M)
    out = capsys.readouterr().out.splitlines()
    for comment, printed in zip(shown, out[-len(shown):] if shown else [], strict=True):
        expected = comment.split(":")[0].strip()
        assert printed.strip() == expected, f"README.md:{line} shows {expected!r}, got {printed!r}"


def _shell_commands() -> list[tuple[int, list[str]]]:
    commands = []
    for line, code in blocks("sh"):
        for offset, text in enumerate(code.splitlines()):
            text = text.split(" #")[0].strip()
            for part in filter(None, (p.strip() for p in text.split("&&"))):
                commands.append((line + 1 + offset, shlex.split(part)))
    return commands


# the extras defined in pyproject.toml (no tomllib before Python 3.11)
_optional = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
EXTRAS = set(re.findall(r"^([\w-]+) = \[", _optional.split("\n[")[0], re.M))


# the native kernels' build requirements, as ./dev installs them
NATIVE_BUILD_DEPS = set(re.search(r'^NATIVE_BUILD_DEPS="([^"]+)"', (ROOT / "dev").read_text(),
                                  re.M).group(1).split())


def _dev_commands() -> set[str]:
    out = subprocess.run(["bash", str(ROOT / "dev"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"^  (\w+) ", out.stdout, re.M))


@pytest.mark.parametrize("line, argv", _shell_commands(), ids=lambda v: " ".join(v)[:40]
                         if isinstance(v, list) else str(v))
def test_shell_command_exists(line, argv):
    where = f"README.md:{line}: {shlex.join(argv)}"
    if argv[0] == "./dev":
        assert argv[1] in _dev_commands(), where
        if argv[1] == "demo":  # what follows goes to examples/digits.py
            _check_script_arguments("examples/digits.py", argv[2:], where)
    elif argv[:2] == ["pip", "install"]:
        targets = [a for a in argv[2:] if not a.startswith("-")]
        if all(t.startswith(".") for t in targets):
            for target in targets:
                base, _, extras = target.partition("[")
                assert base in (".", "./native"), f"{where}: installs {base!r}, not this checkout"
                assert (ROOT / base / "pyproject.toml").is_file(), where
                named = set(extras.rstrip("]").split(",")) - {""}
                assert named <= EXTRAS, f"{where}: no extra {named - EXTRAS} in pyproject.toml"
        else:  # the native kernels' build requirements: exactly those ./dev installs
            assert set(targets) == NATIVE_BUILD_DEPS, f"{where}: ./dev installs {NATIVE_BUILD_DEPS}"
    elif Path(argv[0]).name.startswith("python"):
        script = argv[1]
        assert (ROOT / script).is_file(), where
        out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0 and "usage:" in out.stdout, f"{where}: {out.stderr}"
        _check_script_arguments(script, argv[2:], where)
    elif Path(argv[0]).name == "mlx.launch":  # MLX's launcher, beside this interpreter
        assert (Path(sys.executable).parent / "mlx.launch").is_file(), where
        script = argv[-1]
        assert (ROOT / script).is_file(), where
        out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0 and "usage:" in out.stdout, f"{where}: {out.stderr}"
    else:
        pytest.fail(f"{where}: a command this test does not know how to check; teach it")


def _check_script_arguments(script: str, argv: list[str], where: str) -> None:
    """The arguments parse (a script's ``parse_args``), without running the script."""
    spec = importlib.util.spec_from_file_location("readme_" + Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        module.parse_args(argv)
    except SystemExit as stop:
        pytest.fail(f"{where}: the arguments do not parse ({stop})")
    finally:
        del sys.modules[spec.name]


def test_flux_conv_weights_need_their_spatial_axes_flipped():
    """README, Coming from Flux: Flux's Conv is a true convolution (the kernel flipped), and
    fluxlike's a cross-correlation; ``w[:, ::-1, ::-1, :]`` carries a Flux kernel over."""
    signal = pytest.importorskip("scipy.signal", reason="the reference convolution is scipy's")
    from fluxlike import Conv

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 6, 7, 1)).astype(np.float32)
    w_flux = rng.normal(size=(1, 3, 2, 1)).astype(np.float32)  # (out, kh, kw, in), asymmetric
    flux = signal.convolve2d(x[0, :, :, 0], w_flux[0, :, :, 0], mode="valid")  # flips w
    layer = Conv((3, 2), 1, 1, bias=False)
    layer.weight = mx.array(w_flux)[:, ::-1, ::-1, :]
    assert np.allclose(np.array(layer(mx.array(x)))[0, :, :, 0], flux, atol=1e-5)
    layer.weight = mx.array(w_flux)  # without the flip: a different result
    assert not np.allclose(np.array(layer(mx.array(x)))[0, :, :, 0], flux, atol=1e-3)
