"""A Griffe extension for the API reference: fluxlike's docstrings are plain text with reST
inline markup and doctest examples (they run under ``pytest --doctest-modules``). Rendered as
Markdown, ``>>>`` would read as a block quote, so each run of doctest lines (with the output
lines after it) becomes a ``pycon`` code block, and ``:func:`x``` roles become code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")


def markdown(text: str) -> str:
    """``text`` with its doctest runs fenced and its reST roles as code spans."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
            continue
        out.append(_ROLE.sub(r"`\1`", line))
        i += 1
    return "\n".join(out)


class DoctestsAsCode(griffe.Extension):
    """Rewrites every docstring of the loaded package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
