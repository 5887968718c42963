"""Where the transformer LM's training step spends its time, float32 against autocast(bfloat16).

The LM of ``bench/models.py`` (stock ``mlx.nn``: 4 pre-norm encoder layers, width 512, 8
heads, context 128, batch 4) is timed whole (forward + backward + Adam, as ``bench/run.py``'s
``fl f32`` / ``fl autocast``), split into phases (forward + backward alone, the Adam update
alone), and piece by piece: each kind of op the step runs, forward and backward at the
step's shapes, in float32 and as autocast runs it, multiplied by how often one step runs it.
All variants are interleaved (a new order each round) and their medians kept; the pieces
are small graphs, so each also carries ``mx.eval``'s fixed cost (tens of microseconds): the
per-step sums are estimates, the whole-step rows the figures.

    .venv/bin/python bench/lm.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import models as M

import fluxlike
from fluxlike import autocast, native, setup, update, withgradient
from fluxlike.precision import stock
from fluxlike.precision.attention import attend

BF16 = mx.bfloat16
B, L, D, H = M.LM.batch, M.LM.context, M.LM.dims, M.LM.heads


@contextlib.contextmanager
def without(piece: str, lm: nn.Module) -> Iterator[None]:
    """While building the step's graph, ``piece`` of ``lm`` is replaced by (nearly) nothing:
    ``"attention core"`` returns the values, ``"layernorm"`` its input, ``"relu"`` its
    input; the step's time without it, subtracted from the whole step's, is its share in
    the real graph."""
    if piece == "relu":
        saved = [layer.activation for layer in lm.layers]
        for layer in lm.layers:
            layer.activation = lambda y: y
        try:
            yield
        finally:
            for layer, act in zip(lm.layers, saved, strict=True):
                layer.activation = act
        return
    if piece == "attention core":
        targets = [(mx.fast, "scaled_dot_product_attention", lambda q, k, v, **kw: v),
                   (stock, "attend", lambda q, k, v, *a, **kw: (v, None))]
    else:
        targets = [(mx.fast, "layer_norm", lambda x, *a, **kw: x)]
    saved_fns = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, fn in targets:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved_fns:
            setattr(owner, name, fn)


SWAPPED = ("attention core", "layernorm", "relu")


def step_variants() -> dict[str, Callable[[], object]]:
    """The whole step and its phases, in float32 and under autocast(bfloat16), and the whole
    step with each of ``SWAPPED`` taken out."""
    tokens_np, targets_np = M.lm_data()
    tokens, targets = mx.array(tokens_np), mx.array(targets_np)
    out: dict[str, Callable[[], object]] = {}
    for label, ac in (("f32", None), ("ac", BF16)):
        mx.random.seed(0)
        lm = M.LanguageModel()
        opt_state = setup(fluxlike.Adam(1e-3), lm)
        captured = [lm.state, opt_state.optimizer.state]
        mx.eval(captured)

        def step(lm=lm, opt_state=opt_state, captured=captured, ac=ac) -> None:
            loss, grads = withgradient(lambda m: M.lm_loss(m, tokens, targets), lm, autocast=ac)
            update(opt_state, lm, grads[0])
            mx.eval(loss, captured)

        def fwd_bwd(lm=lm, ac=ac) -> None:
            loss, grads = withgradient(lambda m: M.lm_loss(m, tokens, targets), lm, autocast=ac)
            mx.eval(loss, grads)

        def forward(lm=lm, ac=ac) -> None:
            if ac is None:
                mx.eval(M.lm_loss(lm, tokens, targets))
            else:
                with autocast(ac):
                    mx.eval(M.lm_loss(lm, tokens, targets))

        out[f"step {label}"] = step
        for piece in SWAPPED:
            def swapped(step=step, piece=piece, lm=lm) -> None:
                with without(piece, lm):
                    step()

            out[f"step {label} without {piece}"] = swapped
        out[f"fwd+bwd {label}"] = fwd_bwd
        out[f"forward {label}"] = forward
        if ac is None:
            _, grads = withgradient(lambda m: M.lm_loss(m, tokens, targets), lm)
            grads = grads[0]
            mx.eval(grads)

            def adam(lm=lm, opt_state=opt_state, grads=grads, captured=captured) -> None:
                update(opt_state, lm, grads)
                mx.eval(captured)

            out["adam update"] = adam
    return out


def fwd_bwd_of(fn: Callable[..., mx.array], *inputs: mx.array,
               ac: mx.Dtype | None = None) -> Callable[[], None]:
    """Forward and backward of ``fn`` on ``inputs`` (gradients of every input), against a
    fixed random cotangent, inside ``autocast(ac)`` when given."""
    out = fn(*inputs)
    cotangent = mx.random.normal(out.shape).astype(out.dtype)
    grad = mx.grad(lambda *xs: (fn(*xs) * cotangent).astype(mx.float32).sum(),
                   argnums=tuple(range(len(inputs))))
    mx.eval(cotangent, *inputs)

    def run() -> None:
        if ac is None:
            mx.eval(grad(*inputs))
        else:
            with autocast(ac):
                mx.eval(grad(*inputs))

    return run


def piece_variants() -> dict[str, tuple[int, Callable[[], None]]]:
    """``{name: (calls per step, run)}`` for the step's pieces."""
    mx.random.seed(1)
    x = mx.random.normal((B, L, D))
    xh = x.astype(BF16)
    q, k, v = (mx.random.normal((B, H, L, D // H)) for _ in range(3))
    qh, kh, vh = (a.astype(BF16) for a in (q, k, v))
    mask = nn.MultiHeadAttention.create_additive_causal_mask(L)
    scale = 1 / math.sqrt(D // H)
    pieces: dict[str, tuple[int, Callable[[], None]]] = {}
    ln = nn.LayerNorm(D)
    pieces["layernorm f32"] = (9, fwd_bwd_of(ln, x))
    for din, dout, n in ((D, D, 16), (D, 4 * D, 4), (4 * D, D, 4), (D, M.LM.vocab, 1)):
        lin = nn.Linear(din, dout)
        xi = mx.random.normal((B, L, din))
        mx.eval(lin.parameters())
        pieces[f"linear {din}->{dout} f32"] = (n, fwd_bwd_of(lambda a, lin=lin: lin(a), xi))
        pieces[f"linear {din}->{dout} ac"] = (n, fwd_bwd_of(lambda a, lin=lin: lin(a), xi,
                                                            ac=BF16))
    pieces["attention core f32 (sdpa)"] = (4, fwd_bwd_of(
        lambda a, b, c: attend(a, b, c, scale, mask)[0], q, k, v))
    pieces["attention core ac"] = (4, fwd_bwd_of(
        lambda a, b, c: attend(a, b, c, scale, mask)[0], qh, kh, vh, ac=BF16))
    heads = mx.random.normal((B, L, D))
    pieces["split/merge heads f32"] = (4, fwd_bwd_of(
        lambda a: mx.unflatten(a, -1, (H, -1)).transpose(0, 2, 1, 3) * 1.0, heads))
    pieces["split/merge heads bf16"] = (4, fwd_bwd_of(
        lambda a: mx.unflatten(a, -1, (H, -1)).transpose(0, 2, 1, 3) * 1.0,
        heads.astype(BF16)))
    h4 = mx.random.normal((B, L, 4 * D))
    pieces["relu f32"] = (4, fwd_bwd_of(nn.relu, h4))
    pieces["relu bf16"] = (4, fwd_bwd_of(nn.relu, h4.astype(BF16)))
    pieces["residual add f32+f32"] = (8, fwd_bwd_of(lambda a, b: a + b, x, x))
    pieces["residual add f32+bf16"] = (8, fwd_bwd_of(lambda a, b: a + b, x, xh))
    pieces["cast f32->bf16 (B,L,D)"] = (5, fwd_bwd_of(lambda a: a.astype(BF16), x))
    logits = mx.random.normal((B, L, M.LM.vocab))
    targets = mx.random.randint(0, M.LM.vocab, (B, L))
    pieces["loss f32 logits"] = (1, fwd_bwd_of(
        lambda a: nn.losses.cross_entropy(a, targets, reduction="mean"), logits))
    return pieces


def timed(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved(fns: dict[str, Callable[[], object]], rounds: int,
                calls: dict[str, int]) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(names)
        for name in names:
            samples[name].append(timed(fns[name], calls[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-pieces", action="store_true", help="only the whole step")
    args = parser.parse_args()
    print(f"fluxlike.native: {native.native_info().reason}")
    steps = step_variants()
    fns: dict[str, Callable[[], object]] = dict(steps)
    per_step: dict[str, int] = {}
    if not args.no_pieces:
        for name, (n, fn) in piece_variants().items():
            fns[name], per_step[name] = fn, n
    calls = {}
    for name, fn in fns.items():
        first = timed(fn, 1)
        calls[name] = max(1, round(0.05 / first))
    t = interleaved(fns, args.rounds, calls)
    base = t["step f32"]
    print(f"\n{'phase':<34} {'ms':>8} {'/ step f32':>10}")
    for name in steps:
        print(f"{name:<34} {1e3 * t[name]:8.2f} {t[name] / base:10.2f}")
    if per_step:
        print(f"\n{'piece (fwd+bwd)':<34} {'ms/call':>8} {'calls':>5} {'ms/step':>8} "
              f"{'/ step f32':>10}")
        for name, n in per_step.items():
            print(f"{name:<34} {1e3 * t[name]:8.3f} {n:5d} {1e3 * n * t[name]:8.2f} "
                  f"{n * t[name] / base:10.2f}")


if __name__ == "__main__":
    main()
