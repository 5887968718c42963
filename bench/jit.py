"""What MLX's CPU kernel compiler leaves on the table: the seed MLP's training step with MLX's
fused kernels as MLX builds them, and the same kernels rebuilt with two more compiler flags.

On the CPU, ``mx.compile`` fuses elementwise ops into C++ that MLX compiles at run time with
``g++ -std=c++17 -O3 ... -fPIC -shared`` and keeps in ``$TMPDIR/mlx/<version>/cpu``. GCC
leaves two kinds of those loops scalar:

- a loop with ``sqrt`` (``std::sqrt``, which may set ``errno``) - Adam's and RMSProp's update;
- a loop over more than ~10 pairs of arrays that may overlap: GCC versions a loop for
  aliasing with at most ``--param vect-max-version-for-alias-checks=10`` run-time tests, and
  Adam's kernel (``w``, ``m``, ``v``, ``g`` in; ``w``, ``m``, ``v`` out) needs 15.

Without the native companion, fluxlike's ``update`` runs the optimiser step as one such kernel
per parameter, so the whole of Adam is scalar code (with it, fluxlike's Adam, AdamW and RMSProp
update float32 and bfloat16 parameters in the companion's vectorised kernels instead:
``fluxlike.native.adam_kernel``, ``rmsprop_kernel``). This script measures MLX's own
kernels, so its processes run with ``FLUXLIKE_NATIVE=0``: it measures what ``-fno-math-errno --param
vect-max-version-for-alias-checks=64`` would give, with nothing else changed: each variant runs
in a fresh process whose ``TMPDIR`` holds either the kernels MLX built or the same sources
rebuilt with those flags (MLX loads a kernel library it finds there instead of building it).
The processes alternate; each prints the medians of interleaved samples.

    .venv/bin/python bench/jit.py [--pairs 3] [--model seed]

Needs ``g++`` (which MLX itself needs to fuse on the CPU). It writes only under a new temporary
directory, removed at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FLAGS = ["-fno-math-errno", "--param", "vect-max-version-for-alias-checks=64"]
VARIANTS = {"f32": {"ac": None, "compiled": False},
            "f32 compiled": {"ac": None, "compiled": True},
            "autocast": {"ac": "bfloat16", "compiled": False}}


def measure(model: str, rounds: int) -> dict[str, float]:
    """In this process: median ms per training step of each variant, interleaved."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mlx.core as mx
    import models as M
    from run import fluxlike_step

    spec = M.SPECS[model]
    ws = M.weights(spec)
    x_np, labels = M.data(spec)
    x, y = mx.array(x_np), mx.array(M.onehot(labels, spec.classes))
    steps = {name: fluxlike_step(spec, ws, x, y, ac=v["ac"] and getattr(mx, v["ac"]),
                                 compiled=v["compiled"])[0]
             for name, v in VARIANTS.items()}
    calls = 40 if model == "seed" else 2
    for step in steps.values():
        for _ in range(max(calls, 5)):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for name in order:
            steps[name]()
            start = time.perf_counter()
            for _ in range(calls):
                steps[name]()
            samples[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def run_child(tmpdir: str, model: str, rounds: int) -> dict[str, float]:
    env = dict(os.environ, TMPDIR=tmpdir, FLUXLIKE_NATIVE="0")  # MLX's kernels: see above
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model,
                          "--rounds", str(rounds)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def mlx_include() -> str:
    import mlx

    for root in mlx.__path__:
        path = os.path.join(root, "include")
        if os.path.exists(os.path.join(path, "mlx", "backend", "cpu", "compiled_preamble.h")):
            return path
    raise SystemExit("bench/jit.py: MLX's headers (mlx/include) are not installed")


def vectorised(source: str, include: str, flags: list[str]) -> bool:
    """Whether GCC vectorises the kernel's loop with these extra flags."""
    info = subprocess.run(["g++", "-std=c++17", "-O3", "-fPIC", "-c", *flags, "-I", include,
                           source, "-o", os.devnull, "-fopt-info-vec-optimized"],
                          capture_output=True, text=True).stderr
    return "loop vectorized" in info


def rebuild(stock: str, rebuilt: str) -> list[tuple[str, bool, bool]]:
    """Copy MLX's kernel sources from ``stock`` to ``rebuilt`` and build them there with
    ``FLAGS`` added; per kernel: (name, vectorised as MLX builds it, vectorised rebuilt)."""
    include = mlx_include()
    found = glob.glob(os.path.join(stock, "mlx", "*", "cpu"))
    if not found:
        raise SystemExit("bench/jit.py: MLX built no CPU kernels (is mx.compile disabled?)")
    (src_dir,) = found
    dst_dir = os.path.join(rebuilt, os.path.relpath(src_dir, stock))
    os.makedirs(dst_dir)
    kernels = []
    for source in sorted(glob.glob(os.path.join(src_dir, "*.cpp"))):
        name = os.path.basename(source)[:-4]
        target = os.path.join(dst_dir, name + ".cpp")
        shutil.copy(source, target)
        # MLX's own command (mlx/backend/cpu/jit_compiler.cpp), plus FLAGS
        subprocess.run(["g++", "-std=c++17", "-O3", "-Wall", "-fPIC", "-shared", *FLAGS, "-I",
                        include, target, "-o", os.path.join(dst_dir, f"lib{name}.so")],
                       check=True, capture_output=True)
        kernels.append((name, vectorised(source, include, []), vectorised(source, include, FLAGS)))
    return kernels


def ops_of(kernel: str) -> str:
    """The primitives a kernel fuses, from its name (``Ef4IPowerCDFf4ISubtract...``: a dtype,
    ``I``/``O`` for inner or output node, the primitive, node names), broadcasts left out."""
    ops = re.findall(r"[a-z]+\d+[IO]((?:[A-Z][a-z0-9]+)+)", kernel.split("_")[0])
    return " ".join(op for op in ops if op != "Broadcast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="stock/rebuilt process pairs")
    parser.add_argument("--rounds", type=int, default=25, help="samples per variant and process")
    parser.add_argument("--model", default="seed", choices=["seed", "large", "cnn"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.rounds)))
        return
    if shutil.which("g++") is None:
        raise SystemExit("bench/jit.py: needs g++ (MLX's CPU kernels are built with it)")
    with tempfile.TemporaryDirectory(prefix="fluxlike-jit-") as top:
        stock, rebuilt = os.path.join(top, "stock"), os.path.join(top, "rebuilt")
        os.makedirs(stock)
        run_child(stock, args.model, 2)  # MLX builds the kernels this model's steps use
        kernels = rebuild(stock, rebuilt)
        results: dict[str, list[dict[str, float]]] = {"stock": [], "rebuilt": []}
        for _ in range(args.pairs):
            for which, tmpdir in (("stock", stock), ("rebuilt", rebuilt)):
                results[which].append(run_child(tmpdir, args.model, args.rounds))
    print(f"# MLX's CPU kernels as built, and rebuilt with {' '.join(FLAGS)}")
    print(f"model: {args.model}; {args.pairs} process pairs, alternating, "
          f"{args.rounds} interleaved samples per variant and process")
    print(f"fused kernels: {len(kernels)}; loops vectorised as MLX builds them: "
          f"{sum(k[1] for k in kernels)}, rebuilt: {sum(k[2] for k in kernels)}")
    for name, before, after in kernels:
        clipped = " ..." if len(name) > 245 else ""  # MLX clips longer names to 246
        print(f"  {'vector' if before else 'scalar'} -> {'vector' if after else 'scalar'}  "
              f"{ops_of(name)}{clipped}")
    print("\nvariant | stock ms (per process) | rebuilt ms (per process) | rebuilt / stock")
    print("--- | --- | --- | ---")
    for name in VARIANTS:
        before = [r[name] for r in results["stock"]]
        after = [r[name] for r in results["rebuilt"]]
        ratio = statistics.median(after) / statistics.median(before)
        print(f"{name} | {', '.join(f'{t:.3f}' for t in before)} | "
              f"{', '.join(f'{t:.3f}' for t in after)} | {ratio:.2f}")


if __name__ == "__main__":
    main()
