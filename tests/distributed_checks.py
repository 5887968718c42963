"""The checks of tests/test_distributed.py, run in every process of one ``mlx.launch`` group.

    mlx.launch -n 2 --backend ring --python python tests/distributed_checks.py OUTDIR

Each rank runs every check in order (they communicate, so all ranks run the same ones) and
writes ``OUTDIR/rank<r>.json``: per check, plain numbers, lists and hashes that the pytest side
compares across ranks and against one process. Rank 0 also trains the one-process references
itself (``distributed=None``), from the same initial parameters, on the joined batches.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    fully_shard,
)
from mlx.utils import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fluxlike
import fluxlike as fl  # noqa: E402
from fluxlike.distributed import DataShard, _has_sum_scatter  # noqa: E402
from fluxlike.losses import logitcrossentropy  # noqa: E402
from fluxlike.optimisers.compiled import COMPILED  # noqa: E402

B, STEPS, FEATURES, CLASSES = 4, 3, 6, 3  # batch per rank, steps, model sizes


def digest(tree) -> str:
    """A hash of every array's bytes in ``tree`` (identical trees, identical hashes)."""
    h = hashlib.sha256()
    for name, a in tree_flatten(tree):
        if isinstance(a, mx.array):
            h.update(name.encode())
            h.update(np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())
    return h.hexdigest()


def max_diff(a, b) -> float:
    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert fa.keys() == fb.keys(), (sorted(fa), sorted(fb))
    return max(float(mx.max(mx.abs(fa[k].astype(mx.float32) - fb[k].astype(mx.float32))))
               for k in fa)


def mlp(seed: int, out: int = CLASSES) -> fl.Chain:
    mx.random.seed(seed)
    return fl.Chain(fl.Dense(FEATURES, 16, fl.relu), fl.Dense(16, out))


def data(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    return mx.array(x), fl.onehotbatch(y.tolist(), list(range(CLASSES)))


def loss(m, x, y):
    return logitcrossentropy(m(x), y)


def copy_of(model, seed: int, out: int = CLASSES):
    twin = mlp(seed + 1000, out)
    fl.loadmodel(twin, fl.state(model))
    return twin


def check_equivalence(group, precision: str) -> dict:
    """N steps with batch B per rank == one process with the joined batch 2B."""
    dtype = {"float32": None, "bfloat16": mx.bfloat16, "float16": mx.float16}[precision]
    rank, size = group.rank(), group.size()
    model = mlp(10 + rank)  # different on each rank: setup must broadcast rank 0's
    reference = copy_of(model, 10) if rank == 0 else None
    x, y = data(size * B * STEPS)

    def rule():  # float16: clipping (active at this norm) after the loss scale's unscaling
        return fl.OptimiserChain(fl.ClipNorm(0.05), fl.Adam(1e-2)) if precision == "float16" \
            else fl.Adam(1e-2)

    opt = fl.setup(rule(), model, distributed=group)
    after_setup = digest(model.parameters())
    loader = fl.DataLoader((x, y), batchsize=B, shuffle=True, rng=7, distributed=group)
    mean = fl.train(loss, model, loader, opt, autocast=dtype, progress=False)
    out = {"after_setup": after_setup,
           "params": digest(model.parameters()), "opt": digest(opt.state),
           "batches": len(loader), "mean_loss": mean, "eager": COMPILED[opt].eager,
           "loss_scale": opt.loss_scale.loss_scale.item(),
           "dtypes": sorted({str(a.dtype) for _, a in tree_flatten(model.parameters())})}
    if rank == 0:
        order = np.random.default_rng(7).permutation(x.shape[0])
        joined = fl.DataLoader((x[mx.array(order)], y[mx.array(order)]), batchsize=size * B)
        ref_opt = fl.setup(rule(), reference)
        ref_mean = fl.train(loss, reference, joined, ref_opt, autocast=dtype, progress=False)
        out["diff_vs_one_process"] = max_diff(model.parameters(), reference.parameters())
        out["mean_loss_one_process"] = ref_mean
        out["ref_loss_scale"] = ref_opt.loss_scale.loss_scale.item()
    return out


def check_communication_dtype(group) -> dict:
    """bfloat16 communication: the ranks still agree exactly, and stay near float32's."""
    rank, size = group.rank(), group.size()
    x, y = data(size * B * STEPS)
    results = {}
    for name, wire, compiled in (("float32", None, False), ("bfloat16", mx.bfloat16, False),
                                 ("compiled", None, True)):
        model = mlp(20 + rank)
        opt = fl.setup(fl.Descent(0.1), model, distributed=group, communication_dtype=wire)
        loader = fl.DataLoader((x, y), batchsize=B, distributed=group)
        fl.train(loss, model, loader, opt, progress=False, compile=compiled)
        results[name] = model
    return {"params": digest(results["bfloat16"].parameters()),
            "diff_vs_float32": max_diff(results["bfloat16"].parameters(),
                                        results["float32"].parameters()),
            "compiled": digest(results["compiled"].parameters()),
            "compiled_vs_float32": max_diff(results["compiled"].parameters(),
                                            results["float32"].parameters()),
            "repr": repr(fl.setup(fl.Descent(0.1), mlp(1), distributed=group,
                                  communication_dtype=mx.bfloat16))}


def check_nonfinite(group) -> dict:
    """A non-finite gradient on one rank only: both skip the step and back off together."""
    rank = group.rank()
    model = mlp(30 + rank)
    x, y = data(8, seed=rank)
    opt = fl.setup(fl.Descent(0.1), model, distributed=group, loss_scale=fl.DynamicLossScale())
    steps = []
    for i in range(3):
        before = digest(model.parameters())
        grads = fl.gradient(loss, model, x, y, autocast=mx.float16,
                            loss_scale=opt.loss_scale)[0]
        if i == 1 and rank == 1:  # one leaf of one rank overflows
            grads["layers"][0]["weight"] = grads["layers"][0]["weight"] * float("inf")
        fl.update(opt, model, grads)
        mx.eval(model.parameters(), opt.state)
        steps.append({"changed": digest(model.parameters()) != before,
                      "params": digest(model.parameters()), "opt": digest(opt.state),
                      "scale": opt.loss_scale.loss_scale.item(),
                      "counter": opt.loss_scale.counter.item()})
    return {"steps": steps}


def check_train_nonfinite_loss(group) -> dict:
    """A loss that is non-finite on one rank stops train on every rank at the same batch."""
    rank, size = group.rank(), group.size()
    model = mlp(40 + rank)
    x, y = data(size * B * 3)
    # poison one example of rank 1's second batch (in every rank's copy of the data)
    poisoned = DataShard(1, size, x.shape[0], pad=True).positions(None).tolist()[B + 1]
    xn = np.array(x)
    xn[poisoned] = np.nan
    loader = fl.DataLoader((mx.array(xn), y), batchsize=B, distributed=group)
    opt = fl.setup(fl.Descent(0.1), model, distributed=group)
    try:
        fl.train(loss, model, loader, opt, progress=False)
        return {"raised": None}
    except FloatingPointError as e:
        return {"raised": str(e), "params": digest(model.parameters())}


def check_data(group) -> dict:
    """The shards of two epochs, partial=True (padded) and partial=False (dropped)."""
    rank = group.rank()
    out = {}
    for partial in (True, False):
        loader = fl.DataLoader(mx.arange(11), batchsize=2, shuffle=True, rng=3, partial=partial,
                               distributed=group)
        out[f"partial={partial}"] = {
            "len": len(loader), "epochs": [[b.tolist() for b in loader] for _ in range(2)]}
    mx.random.seed(rank)  # rng=None: seeded from MLX's random state, which differs here
    loader = fl.DataLoader(mx.arange(10), batchsize=5, shuffle=True, distributed=group)
    out["rng=None"] = [b.tolist() for b in loader]
    out["unshuffled"] = [b.tolist() for b in fl.DataLoader(mx.arange(7), batchsize=3,
                                                           distributed=group)]
    out["repr"] = repr(loader)
    try:
        fl.DataLoader(mx.arange(10 + rank), batchsize=2, distributed=group)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def check_batchnorm(group) -> dict:
    """Running statistics stay identical on all ranks (averaged after each step)."""
    rank, size = group.rank(), group.size()
    mx.random.seed(50 + rank)
    model = fl.Chain(fl.Dense(FEATURES, 8), fl.BatchNorm(8, fl.relu), fl.Dense(8, CLASSES))
    x, y = data(size * B * 2)
    opt = fl.setup(fl.Adam(1e-2), model, distributed=group)
    start = model.layers[1].running_mean
    fl.train(loss, model, fl.DataLoader((x, y), batchsize=B, distributed=group), opt,
             progress=False)
    bn = model.layers[1]
    return {"stats": digest({"m": bn.running_mean, "v": bn.running_var}),
            "moved": float(mx.max(mx.abs(bn.running_mean - start))),
            "params": digest(model.parameters())}


def check_checkpoint(group, outdir: Path) -> dict:
    """Saved by the group (rank 0 writes), loaded into one process: it continues identically."""
    rank, size = group.rank(), group.size()
    path = outdir / "group.safetensors"
    x, y = data(size * B * 4)
    first, second = (x[: size * B * 2], y[: size * B * 2]), (x[size * B * 2:], y[size * B * 2:])
    model = mlp(60 + rank)
    opt = fl.setup(fl.Adam(1e-2), model, distributed=group)
    fl.train(loss, model, fl.DataLoader(first, batchsize=B, distributed=group), opt,
             autocast=mx.float16, progress=False)
    fl.savemodel(path, model, opt)
    written = sorted(p.name for p in outdir.iterdir() if "safetensors" in p.name)
    saved = digest(model.parameters())
    fl.train(loss, model, fl.DataLoader(second, batchsize=B, distributed=group), opt,
             autocast=mx.float16, progress=False)
    out = {"written": written, "final": digest(model.parameters())}
    loaded = fl.loadcheckpoint(path, mlp(99), fl.setup(fl.Adam(1e-2), mlp(99)))
    out["loaded_on_every_rank"] = digest(loaded.parameters()) == saved
    try:
        fl.savemodel(outdir / "bad.npz", model, opt)
        out["bad_save"] = None
    except (ValueError, RuntimeError) as e:
        out["bad_save"] = f"{type(e).__name__}: {e}"
    if rank == 0:  # one process: load the group's checkpoint and continue on joined batches
        one, one_opt = mlp(98), fl.setup(fl.Adam(1e-2), mlp(98))
        fl.loadcheckpoint(path, one, one_opt)
        fl.train(loss, one, fl.DataLoader(_joined(second, size), batchsize=size * B), one_opt,
                 autocast=mx.float16, progress=False)
        out["diff_vs_one_process"] = max_diff(model.parameters(), one.parameters())
        out["scales"] = [opt.loss_scale.loss_scale.item(), one_opt.loss_scale.loss_scale.item()]
    return out


def _joined(arrays, size):
    """The arrays reordered so that batch i of size*B holds exactly what the ranks' batches i
    of B held (the shards are round-robin)."""
    n = arrays[0].shape[0]
    order = np.concatenate([np.arange(r, n, size)[i * B:(i + 1) * B]
                            for i in range(n // (size * B)) for r in range(size)])
    return tuple(a[mx.array(order)] for a in arrays)


def check_sharded(group) -> dict:
    """fully_shard and the tensor-parallel linears under autocast == their unsharded selves."""
    rank, size = group.rank(), group.size()
    out = {"has_sum_scatter": _has_sum_scatter(group)}  # a canary for the ring workaround
    x, y = data(8, seed=3)
    y = mx.concatenate([y, mx.zeros((8, 1))], axis=1)  # 4 classes: shards evenly

    def run(model):
        value, grads = fl.withgradient(loss, model, x, y, autocast=mx.bfloat16)
        with fl.autocast(mx.bfloat16):
            out_dtype = str(model(x).dtype)
        mx.eval(value, grads)
        return value.item(), grads[0], out_dtype

    def shard_of(full, axis):
        return mx.split(full, size, axis=axis)[rank]

    base = mlp(70, out=4)  # the same on every rank; sizes divisible by the group's
    ref_loss, ref_grads, ref_dtype = run(base)
    for compute in (None, mx.bfloat16):
        model = fully_shard(copy_of(base, 70, out=4), group=group, compute_dtype=compute)
        opt = fl.setup(fl.Descent(0.1), model, distributed=group)  # ring: all_sum backward
        try:
            fl.savemodel("never-written.safetensors", model, opt)
            refused = None
        except ValueError as e:
            refused = str(e)
        value, grads, dtype = run(model)
        expected = tree_map(lambda g: shard_of(g, 0), ref_grads)
        out[f"fully_shard compute_dtype={compute}"] = {
            "loss": [value, ref_loss], "grad_diff": max_diff(grads["module"], expected),
            "dtype": [dtype, ref_dtype],
            "params": sorted({str(a.dtype) for _, a in tree_flatten(model.parameters())}),
            "grads": sorted({str(a.dtype) for _, a in tree_flatten(grads)}),
            "shapes": [list(a.shape) for _, a in tree_flatten(model.parameters())],
            "save_refused": refused}
    mx.random.seed(71)
    plain = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 4))
    ref_loss, ref_grads, ref_dtype = run(plain)
    tp = nn.Sequential(AllToShardedLinear.from_linear(plain.layers[0], group=group), nn.ReLU(),
                       ShardedToAllLinear.from_linear(plain.layers[2], group=group))
    value, grads, dtype = run(tp)
    g0, g2 = ref_grads["layers"][0], ref_grads["layers"][2]
    expected = {"layers": [{"weight": shard_of(g0["weight"], 0), "bias": shard_of(g0["bias"], 0)},
                           {}, {"weight": shard_of(g2["weight"], 1), "bias": g2["bias"]}]}
    out["tensor parallel"] = {
        "loss": [value, ref_loss], "grad_diff": max_diff(grads, expected),
        "dtype": [dtype, ref_dtype],
        "params": sorted({str(a.dtype) for _, a in tree_flatten(tp.parameters())}),
        "grads": sorted({str(a.dtype) for _, a in tree_flatten(grads)})}
    # quantized forms: forward under autocast against the unsharded quantized model
    mx.random.seed(72)
    qplain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    nn.quantize(qplain, group_size=32, bits=8)
    qtp = nn.Sequential(
        QuantizedAllToShardedLinear.from_quantized_linear(qplain.layers[0], group=group),
        nn.ReLU(),
        QuantizedShardedToAllLinear.from_quantized_linear(qplain.layers[2], group=group))
    xq = mx.random.normal((4, 64), key=mx.random.key(5))
    with fl.autocast(mx.bfloat16):
        a, b = qplain(xq), qtp(xq)
    out["quantized"] = {"diff": float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)))),
                        "scale": float(mx.max(mx.abs(a.astype(mx.float32)))),
                        "dtype": str(b.dtype)}
    return out


def check_mismatch(group) -> dict:
    """Different models on the ranks: a clear error on every rank, within seconds."""
    rank = group.rank()
    out = {}
    for name, model in (("shape", mlp(80, out=CLASSES + rank)),
                        ("dtype", fl.f16(mlp(80)) if rank == 1 else mlp(80)),
                        ("layers", fl.Chain(*mlp(80).layers[: 2 - rank]))):
        start = time.monotonic()
        try:
            fl.setup(fl.Adam(), model, distributed=group)
            out[name] = {"error": None}
        except ValueError as e:
            out[name] = {"error": str(e)}
        out[name]["seconds"] = time.monotonic() - start
    return out


def main(outdir: Path) -> None:
    group = mx.distributed.init()
    rank = group.rank()
    results: dict = {"rank": rank, "size": group.size()}
    checks = [
        ("float32", lambda: check_equivalence(group, "float32")),
        ("bfloat16", lambda: check_equivalence(group, "bfloat16")),
        ("float16", lambda: check_equivalence(group, "float16")),
        ("communication_dtype", lambda: check_communication_dtype(group)),
        ("nonfinite", lambda: check_nonfinite(group)),
        ("train_nonfinite_loss", lambda: check_train_nonfinite_loss(group)),
        ("data", lambda: check_data(group)),
        ("batchnorm", lambda: check_batchnorm(group)),
        ("checkpoint", lambda: check_checkpoint(group, outdir)),
        ("sharded", lambda: check_sharded(group)),
        ("mismatch", lambda: check_mismatch(group)),
    ]
    only = set(sys.argv[2:])
    for name, fn in checks:
        if only and name not in only:
            continue
        try:
            results[name] = fn()
        except Exception:  # reported to pytest; the other rank may then wait: bounded there
            results[name] = {"exception": traceback.format_exc()}
        (outdir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    fl.barrier(group)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
