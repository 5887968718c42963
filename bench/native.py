"""The native kernels (fluxlike.native, oneDNN) against MLX's float32 on OpenBLAS, fluxlike's
current bfloat16 path and PyTorch, side by side in one run.

    .venv/bin/python bench/native.py [--reps N] [--torch PYTHON] [--no-torch] [--quick]

Sections: one linear layer (512 x 2048 @ 2048 x 2048, bias, ReLU); the 4 x (2048 -> 2048)
ReLU MLP at batch 512, inference and training step (loss and gradients of all weights,
eager and compiled); 3x3 convolutions (padding 1, channels-last; the small CNN's two layers
and a wider one), forward and forward+backward (gradients of input, weights, bias); the small
CNN's two 2x2 max pools (``mlx f32`` / ``fl bf16 emu``: fluxlike's MaxPool on MLX's ops, what
it ran before the native kernel), forward and forward+backward; causal
attention at the transformer LM's shape (batch 4, 8 heads, context 128, head 64; ``fl bf16
today`` is MLX's bfloat16 ``scaled_dot_product_attention``, what autocast leaves today); and
the crossover (where the native kernel starts to pay) over smaller
linear layers. Each time is the fastest of ``--reps`` calls after two warm-up calls, the
variants of a row called in turn (round robin), so that the machine's load falls on all
alike (the machines are shared: the minimum is the steadiest estimate); ratios are to MLX
float32 on the same row. PyTorch runs afterwards, in its own process. Peak memory is
``mx.get_peak_memory()`` over one call.

Variants: ``mlx f32`` hand-written MLX (``mx.addmm``) in float32, on the OpenBLAS fluxlike
puts under MLX; ``fl bf16 today`` fluxlike's current CPU bfloat16 path (``precision.kernels.
linear``: oneDNN's bfloat16 kernel where the CPU has one, else bfloat16 numerics in float32
OpenBLAS kernels); ``fl bf16 emu`` that emulation, the native kernels switched off;
``native f32``/``native bf16`` ``fluxlike.native.linear`` (bf16: float32 master weights cast
to bfloat16 on each call, as autocast does); ``torch f32``/``torch bf16`` PyTorch
(``torch.autocast('cpu', torch.bfloat16)``) in a process of its own (``--torch``: a Python
with torch 2.13; default this Python if it has torch, else /tmp/torchvenv/bin/python if
present).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

import fluxlike  # noqa: F401  (first: puts OpenBLAS under MLX)
from fluxlike import native
from fluxlike.precision import kernels
from fluxlike.precision.attention import attend

BATCH, WIDTH, DEPTH = 512, 2048, 4
CONVS = [(64, 28, 1, 16), (64, 14, 16, 32), (32, 32, 64, 64),  # batch, size, C_in, C_out; 3x3
         (1, 28, 1, 8), (1, 28, 1, 16), (1, 8, 3, 4)]  # one example: per-example gradients
CROSSOVER = [(8, 64, 64), (32, 128, 128), (64, 256, 256), (128, 256, 512), (128, 512, 512),
             (256, 1024, 1024), (512, 2048, 2048)]


def measure(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
    """(fastest seconds per call, peak bytes of one call) of each of ``fns``, timed round
    robin (one call of each in turn, ``reps`` rounds) so that the machine's load at any
    moment falls on all of them alike."""
    peaks = {}
    for name, fn in fns.items():
        fn()
        fn()
        mx.reset_peak_memory()
        fn()
        peaks[name] = mx.get_peak_memory()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], peaks[name]) for name in fns}


# ------------------------------------------------------------------------------- MLX side

def mlx_linear(x, w, b, act):
    y = mx.addmm(b, x, w.T)
    return mx.maximum(y, 0) if act else y


def today_linear(x, w, b, act):
    return kernels.linear(x, w, b, _relu if act else None)


def emulated_linear(x, w, b, act):
    """``kernels.linear`` with the native kernels switched off: the float32-kernel emulation."""
    with native.disabled():
        return kernels.linear(x, w, b, _relu if act else None)


def _relu(y):
    return mx.maximum(y, 0)


def native_linear(x, w, b, act):
    return native.linear(x, w, b, "relu" if act else None)


def mlx_conv(x, w, b):
    return mx.conv_general(x, w, padding=1) + b


def today_conv(x, w, b):
    return kernels.conv(x, w, (1, 1), (1, 1), (1, 1), 1, b)


def native_conv(x, w, b):
    return native.conv(x, w, b, padding=1)


def mlx_pool(x):  # fluxlike's MaxPool without the native kernel: MLX's ops
    from fluxlike.layers.pooling import sliding_windows

    return mx.max(sliding_windows(x, (2, 2), (2, 2)), axis=(-3, -2))


def native_pool(x):
    return native.max_pool(x, 2)


POOLS = [(64, 28, 16), (64, 14, 32)]  # the small CNN's: batch, size, channels; 2x2 windows
POOL_KERNELS = {"mlx f32": (mlx_pool, None), "fl bf16 emu": (mlx_pool, mx.bfloat16),
                "native f32": (native_pool, None), "native bf16": (native_pool, mx.bfloat16)}

CONV_KERNELS = {"mlx f32": (mlx_conv, None), "fl bf16 today": (today_conv, mx.bfloat16),
                "native f32": (native_conv, None), "native bf16": (native_conv, mx.bfloat16)}

KERNELS = {"mlx f32": (mlx_linear, None), "fl bf16 today": (today_linear, mx.bfloat16),
           "fl bf16 emu": (emulated_linear, mx.bfloat16),
           "native f32": (native_linear, None), "native bf16": (native_linear, mx.bfloat16)}


def mlp(kernel, dtype, params, x):
    """The ReLU MLP; ``dtype``: cast the float32 parameters and input on each call."""
    h = x if dtype is None else x.astype(dtype)
    for i, (w, b) in enumerate(params):
        if dtype is not None:
            w, b = w.astype(dtype), b.astype(dtype)
        h = kernel(h, w, b, i < len(params) - 1)
    return h


def loss_fn(kernel, dtype):
    def loss(params, x, y):
        out = mlp(kernel, dtype, params, x).astype(mx.float32)
        return mx.mean((out - y) ** 2)
    return loss


def mlx_rows(reps: int, quick: bool) -> dict[str, dict[str, tuple[float, float]]]:
    mx.random.seed(0)
    scale = WIDTH ** -0.5
    params = [(scale * mx.random.normal((WIDTH, WIDTH)), mx.zeros((WIDTH,)))
              for _ in range(DEPTH)]
    x = mx.random.normal((BATCH, WIDTH))
    y = mx.random.normal((BATCH, WIDTH))
    mx.eval(params, x, y)
    rows: dict[str, dict[str, tuple[float, float]]] = {}
    pending: dict[str, dict] = {}
    variants = {k: v for k, v in KERNELS.items()
                if native.available() or not k.startswith("native")}

    def record(row, name, fn):  # measured below, row by row, all variants round robin
        pending.setdefault(row, {})[name] = fn

    w, b = params[0]
    for name, (kernel, dtype) in variants.items():
        xw = (x, w, b) if dtype is None else (x.astype(dtype), w.astype(dtype),
                                              b.astype(dtype))
        mx.eval(xw)
        record("linear 512x2048x2048 fwd", name, lambda k=kernel, a=xw: mx.eval(k(*a, True)))
        record("MLP inference", name,
               lambda k=kernel, d=dtype: mx.eval(mlp(k, d, params, x)))
        grad = mx.value_and_grad(loss_fn(kernel, dtype))
        record("MLP train step", name, lambda g=grad: mx.eval(g(params, x, y)))
        if not quick:
            step = mx.compile(grad)
            record("MLP train step compiled", name, lambda g=step: mx.eval(g(params, x, y)))
    for n, size, cin, cout in CONVS:
        xs = mx.random.normal((n, size, size, cin))
        ws = 0.1 * mx.random.normal((cout, 3, 3, cin))
        bs = mx.zeros((cout,))
        label = f"conv {n}x{size}x{size} {cin}->{cout}"
        for name, (kernel, dtype) in CONV_KERNELS.items():
            if name.startswith("native") and not native.available():
                continue
            a = (xs, ws, bs) if dtype is None else tuple(t.astype(dtype) for t in (xs, ws, bs))
            mx.eval(a)
            record(f"{label} fwd", name, lambda k=kernel, a=a: mx.eval(k(*a)))
            grad = mx.grad(lambda x, w, b, k=kernel: k(x, w, b).astype(mx.float32).sum(),
                           argnums=(0, 1, 2))
            record(f"{label} fwd+bwd", name, lambda g=grad, a=a: mx.eval(g(*a)))
    for n, size, c in POOLS:
        xs = mx.random.normal((n, size, size, c))
        label = f"maxpool {n}x{size}x{size}x{c} 2x2"
        for name, (kernel, dtype) in POOL_KERNELS.items():
            if name.startswith("native") and not native.available():
                continue
            a = xs if dtype is None else xs.astype(dtype)
            mx.eval(a)
            record(f"{label} fwd", name, lambda k=kernel, a=a: mx.eval(k(a)))
            grad = mx.grad(lambda x, k=kernel: k(x).astype(mx.float32).sum())
            record(f"{label} fwd+bwd", name, lambda g=grad, a=a: mx.eval(g(a)))
    q, k, v = (mx.random.normal((4, 8, 128, 64)) for _ in range(3))
    sdpa = mx.fast.scaled_dot_product_attention
    attention = {"mlx f32": (sdpa, None), "fl bf16 today": (sdpa, mx.bfloat16),
                 "native bf16": (_attend, mx.bfloat16)}
    for name, (fn, dtype) in attention.items():
        if name.startswith("native") and not native.available():
            continue
        a = (q, k, v) if dtype is None else tuple(t.astype(dtype) for t in (q, k, v))
        mx.eval(a)
        label = "attention 4x8x128x64 causal"
        record(f"{label} fwd", name, lambda f=fn, a=a: mx.eval(f(*a, scale=0.125,
                                                                  mask="causal")))
        grad = mx.grad(lambda q, k, v, f=fn: f(q, k, v, scale=0.125, mask="causal").astype(
            mx.float32).sum(), argnums=(0, 1, 2))
        record(f"{label} fwd+bwd", name, lambda g=grad, a=a: mx.eval(g(*a)))
    if not quick:
        for rows_, inner, out in CROSSOVER:
            xs, ws, bs = (mx.random.normal((rows_, inner)), mx.random.normal((out, inner)),
                          mx.zeros((out,)))
            label = f"crossover {rows_}x{inner}x{out}"
            for name, (kernel, dtype) in variants.items():
                a = (xs, ws, bs) if dtype is None else tuple(t.astype(dtype)
                                                             for t in (xs, ws, bs))
                mx.eval(a)
                record(label, name, lambda k=kernel, a=a: mx.eval(k(*a, True)))
    for row, fns in pending.items():
        calls = reps if not row.startswith("crossover") else max(reps, 30)
        rows[row] = measure(fns, calls)
    return rows


# ----------------------------------------------------------------------------- torch side

TORCH_SCRIPT = r"""
import json, sys, time
import torch
reps, quick, B, W, D, convs, pools = json.loads(sys.argv[1])
torch.manual_seed(0)
def timeit(fn):
    fn(); fn()
    t = []
    for _ in range(reps):
        s = time.perf_counter(); fn(); t.append(time.perf_counter() - s)
    return min(t)
layers = [torch.nn.Linear(W, W) for _ in range(D)]
model = torch.nn.Sequential(*sum(([l, torch.nn.ReLU()] for l in layers), [])[:-1])
x, y = torch.randn(B, W), torch.randn(B, W)
out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": {}}
def rec(row, name, fn):
    out["rows"].setdefault(row, {})[name] = timeit(fn)
lin = layers[0]
for name, ac in (("torch f32", False), ("torch bf16", True)):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac), torch.no_grad():
        rec("linear 512x2048x2048 fwd", name, lambda: torch.relu(lin(x)))
        rec("MLP inference", name, lambda: model(x))
    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
    rec("MLP train step", name, step)
    for n, size, cin, cout in convs:
        label = f"conv {n}x{size}x{size} {cin}->{cout}"
        cx = torch.randn(n, cin, size, size).contiguous(memory_format=torch.channels_last)
        cv = torch.nn.Conv2d(cin, cout, 3, padding=1).to(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac), torch.no_grad():
            rec(f"{label} fwd", name, lambda: cv(cx))
        cxg = cx.clone().requires_grad_(True)
        def cstep():
            cv.zero_grad(set_to_none=True)
            cxg.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                y = cv(cxg)
            y.float().sum().backward()
        rec(f"{label} fwd+bwd", name, cstep)
    for n, size, c in pools:
        label = f"maxpool {n}x{size}x{size}x{c} 2x2"
        px = torch.randn(n, c, size, size).contiguous(memory_format=torch.channels_last)
        if ac:
            px = px.bfloat16()  # pooling has no autocast: it runs in its input's dtype
        with torch.no_grad():
            rec(f"{label} fwd", name, lambda: torch.nn.functional.max_pool2d(px, 2))
        pxg = px.clone().requires_grad_(True)
        def pstep():
            pxg.grad = None
            torch.nn.functional.max_pool2d(pxg, 2).float().sum().backward()
        rec(f"{label} fwd+bwd", name, pstep)
print(json.dumps(out))
"""


def torch_python(choice: str | None) -> str | None:
    if choice:
        return choice
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    candidate = "/tmp/torchvenv/bin/python"
    return candidate if os.path.exists(candidate) else None


def torch_rows(python: str, reps: int, quick: bool) -> tuple[dict, str]:
    args = json.dumps([reps, quick, BATCH, WIDTH, DEPTH, CONVS, POOLS])
    done = subprocess.run([python, "-c", TORCH_SCRIPT, args], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        return {}, f"torch: failed ({done.stderr.strip().splitlines()[-1:]})"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {r: {k: (v, float("nan")) for k, v in d.items()} for r, d in result["rows"].items()}
    return rows, f"torch {result['torch']} ({python}, {result['threads']} threads, own process)"


# ---------------------------------------------------------------------------------- table

def _attend(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: str) -> mx.array:
    """fluxlike's attention core (on the CPU in bfloat16: the native matmuls and softmax)."""
    return attend(q, k, v, scale, mask)[0]


def flops(row: str) -> float | None:
    if row.startswith("maxpool"):
        return None
    if row.startswith("attention"):
        return 2.0 * 2 * 4 * 8 * 128 * 128 * 64 * (3 if "bwd" in row else 1)
    if row.startswith("conv"):
        parts = row.split()
        n, size, _ = (int(v) for v in parts[1].split("x"))
        cin, cout = (int(v) for v in parts[2].split("->"))
        return 2.0 * n * size * size * cin * cout * 9 * (3 if "bwd" in row else 1)
    if row.startswith(("linear", "crossover")):
        m, k, n = (int(v) for v in row.split()[1].split("x"))
        return 2.0 * m * k * n
    per_layer = 2.0 * BATCH * WIDTH * WIDTH * DEPTH
    return per_layer * (3 if "train" in row else 1)


def table(rows: dict) -> None:
    names = ["mlx f32", "fl bf16 today", "fl bf16 emu", "native f32", "native bf16", "torch f32",
             "torch bf16"]
    names = [n for n in names if any(n in r for r in rows.values())]
    head = f"{'row':30s}" + "".join(f"{n:>15s}" for n in names)
    print("\ntime, ms (ratio to mlx f32)")
    print(head)
    for row, cols in rows.items():
        base = cols.get("mlx f32", (float("nan"),))[0]
        cells = []
        for n in names:
            if n in cols:
                t = cols[n][0]
                cells.append(f"{t * 1e3:8.3g} ({t / base:4.2f})")
            else:
                cells.append(" " * 15)
        print(f"{row:30s}" + "".join(f"{c:>15s}" for c in cells))
    print("\nGFLOP/s (multiply-adds x 2; a training step counts 3 products per layer)")
    print(head)
    for row, cols in rows.items():
        f = flops(row)
        if f is None:
            continue
        print(f"{row:30s}" + "".join(
            f"{f / cols[n][0] / 1e9:15.0f}" if n in cols else " " * 15 for n in names))
    print("\npeak memory, MiB (mx.get_peak_memory over one call; MLX variants only)")
    print(head)
    for row, cols in rows.items():
        if row.startswith("crossover"):
            continue
        print(f"{row:30s}" + "".join(
            f"{cols[n][1] / 2**20:15.0f}" if n in cols and cols[n][1] == cols[n][1]
            else " " * 15 for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch", help="a Python with torch (run in its own process)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--quick", action="store_true", help="skip compiled and crossover rows")
    args = parser.parse_args()
    mx.set_cache_limit(1 << 30)  # MLX's 32 MB default makes large steps page-fault
    info = native.native_info()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"mlx {mx.__version__}; BLAS under MLX: {fluxlike.blas_info().path}; "
          f"mx.set_cache_limit(1 GiB)")
    print(f"native: {info.reason}")
    rows = mlx_rows(args.reps, args.quick)
    python = None if args.no_torch else torch_python(args.torch)
    if python is None:
        print("torch: not used (--no-torch, or none found: pip install torch==2.13.0 into a "
              "venv and pass --torch PYTHON)")
    else:
        extra, line = torch_rows(python, args.reps, args.quick)
        print(line)
        for row, cols in extra.items():
            rows.setdefault(row, {}).update(cols)
    table(rows)


if __name__ == "__main__":
    main()
