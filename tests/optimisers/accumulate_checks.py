"""The two-process checks of tests/optimisers/test_accumulate.py, run in every process of one
``mlx.launch`` group: ``AccumGrad`` under data parallelism.

    mlx.launch -n 2 --backend ring --python python tests/optimisers/accumulate_checks.py OUTDIR

Each rank gives its own gradients; the accumulation must see their average (so both ranks
keep the same sums and take the same steps) and a gradient that overflows on one rank only
must be skipped on both, the sums untouched. Rank 0 also runs the one-process reference on
the averaged gradients. Each rank writes ``OUTDIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's fluxlike
import fluxlike as fl  # noqa: E402


def grads_of(rank: int, step: int) -> dict:
    rng = np.random.default_rng(100 * step + rank)
    return {"weight": mx.array(rng.normal(size=(2, 3)).astype(np.float32)),
            "bias": mx.array(rng.normal(size=(2,)).astype(np.float32))}


def flat(tree) -> dict:
    return {k: np.array(v).tolist() for k, v in tree_flatten(tree)}


def run(group, scaled: bool) -> dict:
    rank, size = group.rank(), group.size()
    mx.random.seed(rank)  # different initial parameters: setup gives every rank rank 0's
    model = fl.Dense(3, 2)
    scale = fl.DynamicLossScale(init_scale=4.0) if scaled else None
    opt = fl.setup(fl.AccumGrad(2, fl.Adam(0.01)), model, distributed=group, loss_scale=scale)
    start = fl.Dense(3, 2)
    start.update(model.parameters())
    overflow = 1 if scaled else None  # this update overflows on rank 1 only
    steps = [0, 1, 2, 3, 4] if scaled else [0, 1, 2, 3]
    for i in steps:
        g = grads_of(rank, i)
        if scaled:
            g = {k: v * scale.loss_scale for k, v in g.items()}
            if i == overflow and rank == 1:
                g["bias"] = g["bias"] * float("inf")
        fl.update(opt, model, g)
        mx.eval(model.parameters(), opt.state)
    out = {"params": flat(model.parameters()), "opt": flat(opt.state)}
    if rank == 0:  # one process on the averaged gradients, the overflowing update left out
        ref = fl.setup(fl.AccumGrad(2, fl.Adam(0.01)), start)
        for i in steps:
            if i == overflow:
                continue
            parts = [grads_of(r, i) for r in range(size)]
            fl.update(ref, start, {k: sum(p[k] for p in parts) / size for k in parts[0]})
        out["reference"] = flat(start.parameters())
        out["reference_steps"] = ref.state["optimizer"]["step"].item()
    return out


def main(outdir: Path) -> None:
    group = mx.distributed.init()
    rank = group.rank()
    results: dict = {"rank": rank, "size": group.size()}
    for name, scaled in (("plain", False), ("loss_scale", True)):
        try:
            results[name] = run(group, scaled)
        except Exception:  # reported to pytest; the other rank may then wait: bounded there
            results[name] = {"exception": traceback.format_exc()}
        (outdir / f"rank{rank}.json").write_text(json.dumps(results))
    fl.barrier(group)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
