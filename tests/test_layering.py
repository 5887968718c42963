"""The package's one-way layering: layers -> precision -> MLX; losses and activations import no
layer module; precision imports neither layers nor activations; no module is hidden by a
function of the same name."""

import ast
from pathlib import Path

import pytest

import fluxlike

ROOT = Path(fluxlike.__file__).parent


def _imports(path: Path) -> set[str]:
    """The fluxlike modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("fluxlike", *path.relative_to(ROOT).with_suffix("").parts[:-1]))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fluxlike"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("fluxlike"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).glob("*.py")) if folder else []


def _reaches(path: Path, prefix: str) -> list[str]:
    return sorted(m for m in _imports(path) if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize("path", _modules("precision"), ids=lambda p: p.name)
def test_precision_imports_neither_layers_nor_activations(path):
    assert _reaches(path, "fluxlike.layers") == []
    assert _reaches(path, "fluxlike.activations") == []
    assert _reaches(path, "fluxlike.losses") == []


LOSSES = [f"losses/{p.name}" for p in sorted((ROOT / "losses").glob("*.py"))]


@pytest.mark.parametrize("name", [*LOSSES, "activations.py", "checks.py", "workarounds.py"])
def test_functional_modules_import_no_layer_module(name):
    assert _reaches(ROOT / name, "fluxlike.layers") == []


def test_no_module_is_hidden_by_a_function_of_its_name():
    modules = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    hidden = [name for name in modules
              if not name.startswith("_") and callable(getattr(fluxlike, name, None))
              and not hasattr(getattr(fluxlike, name), "__path__")
              and getattr(getattr(fluxlike, name), "__module__", None) is not None
              and not isinstance(getattr(fluxlike, name), type(fluxlike))]
    assert hidden == []
