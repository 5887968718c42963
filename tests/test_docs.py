"""The documentation site (docs/, built by MkDocs from mkdocs.yml) as a user meets it: every
page is in the navigation, every ```python block runs (as the README's do, in a fresh namespace
after the README's preamble), printed output shown as a comment is what the block prints, and
every ``./dev`` command a page names exists. CONTRIBUTING.md's blocks run too.

A block that cannot run here (it needs a GPU, or several processes) is marked on the line
before its fence with ``<!-- test: skip (the reason) -->``, which the rendered page hides."""

import re
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# pages outside the site whose python blocks run too
OTHERS = [ROOT / "CONTRIBUTING.md"]

PREAMBLE = """
import mlx.core as mx
images = mx.random.uniform(shape=(128, 8, 8, 1))   # the tour: 8x8 grey images, NHWC
labels = mx.random.randint(0, 10, (128,))
"""
SKIP = re.compile(r"<!-- test: skip \((.+)\) -->\s*$")


def blocks(page: Path, language: str) -> list[tuple[int, str, str | None]]:
    """``(line number, code, reason to skip or None)`` of each fenced block in ``language``."""
    text = page.read_text()
    found = []
    for match in re.finditer(rf"^ *```{language}\n(.*?)^ *```", text, re.M | re.S):
        line = text[: match.start()].count("\n") + 1
        before = text.splitlines()[line - 2] if line > 1 else ""
        skip = SKIP.search(before)
        indent = len(match.group(0)) - len(match.group(0).lstrip(" "))
        code = "\n".join(raw[indent:] for raw in match.group(1).splitlines())
        found.append((line, code, skip.group(1) if skip else None))
    return found


PYTHON = [(str(page.relative_to(ROOT)), line, code, skip) for page in PAGES + OTHERS
          for line, code, skip in blocks(page, "python")]


def test_every_page_is_in_the_navigation():
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {page.name for page in PAGES}


def test_the_readme_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"


@pytest.mark.parametrize("page, line, code, skip", PYTHON,
                         ids=[f"{page}:{line}" for page, line, _, _ in PYTHON])
def test_python_block_runs(page, line, code, skip, capsys):
    if skip:
        pytest.skip(skip)
    mx.random.seed(0)
    namespace: dict = {"__name__": f"docs_{Path(page).stem}_{line}".replace("-", "_")}
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
    shown = re.findall(r"print\(.*\)\s+# (.+)$", code, re.M)
    out = capsys.readouterr().out.splitlines()
    for comment, printed in zip(shown, out[-len(shown):] if shown else [], strict=True):
        expected = comment.split(":")[0].strip()
        where = f"{page}:{line}"
        assert printed.strip() == expected, f"{where} shows {expected!r}, got {printed!r}"


def test_dev_commands_exist():
    out = subprocess.run(["bash", str(ROOT / "dev"), "--help"], capture_output=True, text=True)
    known = set(re.findall(r"^  (\w+) ", out.stdout, re.M))
    for page in PAGES:
        for name in re.findall(r"`\./dev (\w+)", page.read_text()):
            assert name in known, f"docs/{page.name} names ./dev {name}, which ./dev lacks"
