"""Shared test utilities: float64 finite-difference gradient checks, numpy conversion, work
on several threads at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

CPU = mx.cpu  # float64 exists only on the CPU device


def to_float64(model: nn.Module) -> nn.Module:
    """Cast every floating parameter of ``model`` to float64, in place; returns ``model``."""
    model.update(
        tree_map(
            lambda p: p.astype(mx.float64) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    return model


def np64(x: mx.array) -> np.ndarray:
    """An mx.array as a float64 numpy array."""
    return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, dtype=np.float64)


def _numeric_grad(f: Callable[[mx.array], mx.array], x: mx.array, picks, eps: float):
    flat = np.array(x, dtype=np.float64).reshape(-1)
    out = np.zeros(len(picks))
    for n, i in enumerate(picks):
        up, down = flat.copy(), flat.copy()
        up[i] += eps
        down[i] -= eps
        fu = f(mx.array(up.reshape(x.shape), dtype=x.dtype))
        fd = f(mx.array(down.reshape(x.shape), dtype=x.dtype))
        out[n] = (fu.item() - fd.item()) / (2 * eps)
    return out


def check_gradients(
    loss: Callable[..., mx.array],
    *args: mx.array,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    samples: int = 12,
    seed: int = 0,
) -> None:
    """Compare ``mx.grad(loss)`` with central finite differences for each float64 argument.

    ``loss(*args)`` must return a scalar. Checks up to ``samples`` random entries per argument.
    """
    with mx.stream(CPU):
        rng = np.random.default_rng(seed)
        grads = mx.grad(loss, argnums=list(range(len(args))))(*args)
        grads = (grads,) if len(args) == 1 else grads  # one argnum gives a bare array
        for k, (x, g) in enumerate(zip(args, grads, strict=False)):
            assert x.dtype == mx.float64, f"argument {k} must be float64, got {x.dtype}"
            picks = rng.choice(x.size, size=min(samples, x.size), replace=False)

            def f(v, k=k):
                return loss(*args[:k], v, *args[k + 1 :])

            numeric = _numeric_grad(f, x, picks, eps=1e-6)
            analytic = np.array(g, dtype=np.float64).reshape(-1)[picks]
            np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol,
                                       err_msg=f"gradient of argument {k}")


def check_layer_gradients(
    layer: nn.Module, *inputs: mx.array, rtol: float = 1e-4, atol: float = 1e-6, seed: int = 0
) -> None:
    """Finite-difference check of a layer's gradients w.r.t. its trainable parameters and its
    floating inputs, in float64 on the CPU. The loss is ``sum(out * r)`` for a fixed random
    ``r`` (for tuple outputs, every floating array in the tuple)."""
    with mx.stream(CPU):
        to_float64(layer)
        inputs = tuple(
            x.astype(mx.float64) if mx.issubdtype(x.dtype, mx.floating) else x for x in inputs
        )
        flat = tree_flatten(layer.trainable_parameters())
        names = [k for k, _ in flat]
        n_params = len(flat)
        floating_inputs = [i for i, x in enumerate(inputs) if x.dtype == mx.float64]
        probe = [None]

        def loss(*arrays):
            layer.update(tree_unflatten(list(zip(names, arrays[:n_params], strict=False))))
            xs = list(inputs)
            for i, a in zip(floating_inputs, arrays[n_params:], strict=False):
                xs[i] = a
            out = layer(*xs)
            leaves = [v for _, v in tree_flatten(out) if isinstance(v, mx.array)]
            if probe[0] is None:
                r = np.random.default_rng(seed)
                probe[0] = [mx.array(r.normal(size=o.shape), dtype=o.dtype) for o in leaves]
            return sum(mx.sum(o * r) for o, r in zip(leaves, probe[0], strict=False))

        params = [v for _, v in flat]
        originals = list(params)
        try:
            check_gradients(loss, *params, *[inputs[i] for i in floating_inputs],
                            rtol=rtol, atol=atol, seed=seed)
        finally:
            layer.update(tree_unflatten(list(zip(names, originals, strict=False))))


def normal(*shape: int, seed: int = 0, loc: float = 0.0, scale: float = 1.0) -> mx.array:
    """A float32 array of normal noise from numpy (independent of MLX's generator)."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(loc, scale, size=shape).astype(np.float32))


def snapshot(layer: nn.Module) -> dict[str, np.ndarray]:
    """Copies of every array of a layer (trainable or not), by dotted name."""
    return {k: np64(v) for k, v in tree_flatten(layer.parameters())}


def assert_unchanged(layer: nn.Module, before: dict[str, np.ndarray]) -> None:
    """Assert that ``layer`` holds exactly the arrays ``snapshot`` recorded in ``before``."""
    after = snapshot(layer)
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def half_copy(layer, dtype):
    """A shallow copy of ``layer`` whose own floating parameters (arrays, and arrays in its
    lists and dicts; not its child modules) are cast to ``dtype``: the reference a down
    layer's forward computes in under autocast."""
    import mlx.nn as nn
    from mlx.utils import tree_map

    def cast(x):
        if isinstance(x, mx.array) and x.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return x.astype(dtype)
        return x

    copy = type(layer).__new__(type(layer))
    copy.__dict__.update(layer.__dict__)
    for key, value in layer.items():
        dict.__setitem__(copy, key, tree_map(cast, value, is_leaf=nn.Module.is_module))
    return copy



def mse_of(model, x, y):
    """The mean squared error of ``model(x)`` against ``y``: the loss the training tests use."""
    return ((model(x) - y) ** 2).mean()


def dense_of(w, b):
    """A ``fluxlike.Dense`` with the weight ``w`` (nested lists, ``(out, in)``) and bias ``b``."""
    from fluxlike import Dense

    layer = Dense(len(w[0]), len(w))
    layer.weight, layer.bias = mx.array(w), mx.array(b)
    return layer


def leaves(tree):
    """A parameter tree's arrays by dotted path."""
    return dict(tree_flatten(tree))


def in_threads(work: Callable[[int], object], n: int, rounds: int = 1) -> None:
    """``work(k)`` for ``k`` in ``range(n)``, each on a thread of its own, at once, ``rounds``
    times, the threads starting each round together (at a barrier: they race, e.g. to create
    shared primitives); the failures are asserted on this thread."""
    start = threading.Barrier(n)
    failures: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for _ in range(rounds):
                start.wait()
                work(k)
        except BaseException as error:  # noqa: BLE001  (reported on the main thread)
            failures.append(error)
            start.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def rule_problem(steps: int = 3, seed: int = 0):
    """A ``Dense(3, 2)`` with known weights, its parameters in float64 numpy, and ``steps``
    gradients (dicts of float32 numpy arrays): the problem the optimiser-rule tests step."""
    from fluxlike import Dense

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(2, 3)).astype(np.float32)
    b = rng.normal(size=(2,)).astype(np.float32)
    grads = [{"weight": rng.normal(size=(2, 3)).astype(np.float32),
              "bias": rng.normal(size=(2,)).astype(np.float32)} for _ in range(steps)]
    model = Dense(3, 2)
    model.weight, model.bias = mx.array(w), mx.array(b)
    return model, {"weight": w.astype(np.float64), "bias": b.astype(np.float64)}, grads


def run_rule(rule, model, grads):
    """``setup(rule, model)`` and one ``update`` per gradient; returns the state."""
    from fluxlike import setup, update

    opt_state = setup(rule, model)
    for g in grads:
        update(opt_state, model, {k: mx.array(v) for k, v in g.items()})
    return opt_state


def reference_steps(step, params, grads):
    """``step(w, g, state, t) -> w`` applied per parameter for each gradient (``t`` from 1),
    in float64: the expected parameters, written from a rule's formulas."""
    out = {}
    for name, w in params.items():
        state: dict = {}
        for t, g in enumerate(grads, start=1):
            w = step(w, g[name].astype(np.float64), state, t)
        out[name] = w
    return out


def assert_parameters(model, expected, rtol=1e-5, atol=1e-6):
    """``model``'s parameters equal ``expected`` (name -> numpy array)."""
    for name, w in expected.items():
        np.testing.assert_allclose(np64(getattr(model, name)), w, rtol=rtol, atol=atol,
                                   err_msg=name)


def interrupted_child(code: str, root: object) -> tuple[str, str]:
    """Run ``code`` in a child Python (``root`` on its path), wait for it to print
    ``ready``, then send it SIGINT every 3 ms until it exits (60 s at most); its
    ``(stdout, stderr)``. For the tests that a Ctrl-C takes all of a step or none of it."""
    child = subprocess.Popen([sys.executable, "-c", code],
                             env={**os.environ, "PYTHONPATH": str(root)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
        deadline = time.monotonic() + 60
        while child.poll() is None and time.monotonic() < deadline:
            child.send_signal(signal.SIGINT)
            time.sleep(0.003)
        return child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait(timeout=10)

