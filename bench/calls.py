"""How much Python one autocast call runs: the calls into fluxlike's and MLX's Python frames.

Counts, for one warm call of ``Chain(Dense(4, 8, relu), LayerNorm(8), Dense(8, 2))`` on a
``(2, 4)`` input, the Python functions entered in ``fluxlike`` and ``mlx`` files (C functions
such as ``mx.addmm`` are not counted: they are the work) and the switches between files along
the way, with the ``with autocast(mx.bfloat16)`` included, and the same for the plain call
outside any scope; then prints the call path of the autocast call.

    .venv/bin/python bench/calls.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

import fluxlike as fl

ROOTS = (str(Path(fl.__file__).parent), str(Path(mx.__file__).parent.parent / "mlx"))


def _ours(filename: str) -> bool:
    return filename.startswith(ROOTS)


def trace(fn: Callable[[], object]) -> list[tuple[str, str, int]]:
    """``(file, function, depth)`` of each Python call into fluxlike or mlx while ``fn`` runs
    (calls made from inside those calls to other libraries are not followed)."""
    calls: list[tuple[str, str, int]] = []
    depth = [0]

    def profile(frame, event, arg):  # noqa: ANN001
        if event == "call":
            depth[0] += 1
            code = frame.f_code
            if _ours(code.co_filename):
                calls.append((code.co_filename, code.co_name, depth[0]))
        elif event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [c for c in calls if c[1] != "profile"]


def switches(calls: list[tuple[str, str, int]]) -> int:
    """How many times consecutive calls are in different files."""
    return sum(a[0] != b[0] for a, b in zip(calls, calls[1:], strict=False))


def short(filename: str) -> str:
    for root in ROOTS:
        if filename.startswith(root):
            return Path(root).name + filename[len(root):]
    return filename


def measure() -> dict[str, list[tuple[str, str, int]]]:
    model = fl.Chain(fl.Dense(4, 8, fl.relu), fl.LayerNorm(8), fl.Dense(8, 2))
    x = mx.random.normal((2, 4))
    mx.eval(model.parameters(), x)

    def scoped() -> None:
        with fl.autocast(mx.bfloat16):
            model(x)

    def plain() -> None:
        model(x)

    for _ in range(3):  # warm: the casts are kept, the barrier crossed
        scoped()
        plain()
    return {"autocast": trace(scoped), "plain": trace(plain)}


def main() -> None:
    found = measure()
    print("call | Python calls (fluxlike + mlx) | switches between files")
    print("--- | --- | ---")
    for name, calls in found.items():
        print(f"{name} | {len(calls)} | {switches(calls)}")
    print("\ncall path of the autocast call:\n")
    for filename, function, depth in found["autocast"]:
        print(f"{'  ' * (depth - 1)}{short(filename)}: {function}")


if __name__ == "__main__":
    main()
