"""One product inside MLX's graph against the same oneDNN primitive run standalone, side by
side in one run (issue 21, item 1).

For each size ``(M, K, N)`` (an ``(M, K) @ (N, K).T`` linear-layer product) and dtype:

- ``standalone``: ``fluxlike_native._ext.standalone_matmul``, oneDNN's matmul described as
  the in-graph one is (plain layouts, the weights stored transposed), on filled buffers of its
  own (cache-line aligned), outside MLX; ``standalone, weights reordered``: the same with the
  weights reordered once into the layout oneDNN prefers (``format_tag::any``);
- ``in graph``: ``fluxlike_native._ext.matmul`` on MLX arrays (float32 on its primitive, not
  on the GEMM without one that ``native.matmul_mode`` ``"auto"`` runs), ``--chain``
  independent products per ``mx.eval`` (the time per product: one ``eval`` costs a thread
  wake-up, ~70 us on these VMs, that a model's step pays once), the source made by a native
  op as in a model (a cast here; a layer's product there), whose output starts on a cache
  line (an MLX-made buffer lies 8 bytes past a 16-byte boundary, and an AMX kernel reads an
  aligned copy of such a source: ~0.2 ms more at 512 x 2048 x 2048); ``in graph,
  packed weights``: ``packed_linear`` on ``pack_weights(w)`` (bfloat16 where the CPU has a
  packed layout: what autocast inference runs on weights it has seen), against the plain
  standalone time; ``in graph, one per eval``: one product per ``eval``.

Ratios are the standalone time over the in-graph one (1.0: nothing lost around the call). The
fastest of ``--rounds`` rounds, the variants of a row in turn.

``--rows KxN`` (issue 27) times instead a bfloat16 ``(M, K) @ (N, K).T`` product in the graph
at each row count of ``--row-counts``: on its primitive for any row count (``auto``, where
``_ext.any_rows_kernel()``: brgemm, AMX) against a primitive per shape (matmul mode
``"primitive"``), in steady state (one product per ``eval``, the fastest of ``--rounds``) and
on a row count's first call (the layer's primitive for any row count already made; the
per-shape one creates its primitive then; so does ``auto`` below ``any_rows_min()`` rows;
oneDNN's own primitive cache, on unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``, may hold a
shape the per-shape pass made, which ``auto``'s pass then creates faster).

    .venv/bin/python bench/matmul.py
    .venv/bin/python bench/matmul.py --sizes 512x2048x2048,128x256x256 --rounds 7
    .venv/bin/python bench/matmul.py --quick        # tiny sizes: a smoke run
    .venv/bin/python bench/matmul.py --rows 256x512,2048x2048
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import processor  # noqa: E402  (the CPU's name and ISA flags)

import fluxlike  # noqa: E402, F401  (first: puts OpenBLAS under MLX)
from fluxlike.native import _loader  # noqa: E402


def fastest(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """The fastest of ``rounds`` rounds of ``calls`` calls of ``fn``, seconds per call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def row(ext, m: int, k: int, n: int, dtype: mx.Dtype, chain: int, rounds: int) -> dict:
    # (the sources made as a model's are, by a native op - autocast's cast here, a layer's
    # product in a model - whose outputs start on a cache line: read in place)
    xs = [ext.convert(mx.random.uniform(-1, 1, (m, k), key=mx.random.key(i)), dtype)
          for i in range(chain)]
    w = mx.random.uniform(-1, 1, (n, k), key=mx.random.key(chain)).astype(dtype)
    mx.eval(xs, w)

    def product(x: mx.array) -> mx.array:
        return ext.matmul(x, w, None, False, True, False, None, False, dtype == mx.bfloat16)

    packed = ext.pack_weights(w) if dtype == mx.bfloat16 else None

    calls = min(200, max(2, int(2e9 / (2 * m * n * k * chain))))
    reps = min(1000, max(5, int(1e9 / (2 * m * n * k))))
    # (float32: on the primitive, not the GEMM 'auto' runs, so that both sides are one kernel)
    mode = ext.set_matmul_mode("primitive" if dtype == mx.float32 else "auto")
    try:
        graph = fastest(lambda: mx.eval([product(x) for x in xs]), calls, rounds) / chain
        in_packed = None if packed is None else fastest(lambda: mx.eval(
            [ext.packed_linear(x, w, None, packed, False, dtype) for x in xs]), calls,
            rounds) / chain
        single = fastest(lambda: mx.eval(product(xs[0])), calls * chain, rounds)
    finally:
        ext.set_matmul_mode(mode)
    plain, impl = ext.standalone_matmul(m, k, n, dtype, reps=reps * rounds)
    reordered, _ = ext.standalone_matmul(m, k, n, dtype, any_layout=True, reps=reps * rounds)
    return {"graph": graph, "packed": in_packed, "single": single, "plain": plain,
            "reordered": reordered, "impl": impl}


def rows_table(ext, k: int, n: int, counts: list[int], rounds: int) -> None:
    """Prints the ``--rows`` table's rows for one ``K x N`` layer (see the module's text)."""
    x = mx.random.uniform(-1, 1, (max(counts) + 1, k), key=mx.random.key(0)).astype(mx.bfloat16)
    w = mx.random.uniform(-1, 1, (n, k), key=mx.random.key(1)).astype(mx.bfloat16)
    mx.eval(x, w)

    def call(m: int) -> float:
        start = time.perf_counter()
        mx.eval(ext.matmul(x[:m], w, None, False, True, False, None, False, True))
        return time.perf_counter() - start

    before = ext.set_matmul_mode("primitive")
    try:
        firsts = {}
        ext.clear_cache()
        firsts["primitive"] = [call(m) for m in counts]
        ext.set_matmul_mode("auto")
        ext.clear_cache()
        # (the layer's primitives for any row count made beforehand, for both thread counts)
        call(1)
        call(max(counts) + 1)
        firsts["auto"] = [call(m) for m in counts]
        for i, m in enumerate(counts):
            calls = min(200, max(3, int(2e8 / (2 * m * n * k))))
            steady = {}
            for mode in ("auto", "primitive"):
                ext.set_matmul_mode(mode)
                steady[mode] = fastest(lambda m=m: call(m), calls, rounds)
            print(f"| {m} x {k} x {n} | {steady['primitive'] * 1e6:.1f} "
                  f"| {steady['auto'] * 1e6:.1f} | {steady['auto'] / steady['primitive']:.2f} "
                  f"| {firsts['primitive'][i] * 1e6:.0f} | {firsts['auto'][i] * 1e6:.0f} |")
    finally:
        ext.set_matmul_mode(before)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512x2048x2048,128x256x256",
                        help="MxKxN, comma-separated (default 512x2048x2048,128x256x256)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--chain", type=int, default=16, help="products per eval (default 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds")
    parser.add_argument("--rows", help="KxN layers, comma-separated: row counts instead")
    parser.add_argument("--row-counts", default="1,2,4,7,8,9,16,33,64,65,100,128,257,512,2048",
                        help="with --rows (default 1,2,4,7,8,9,16,33,64,65,100,128,257,512,2048)")
    args = parser.parse_args(argv)
    ext = _loader.switch.ext
    if ext is None:
        sys.exit("bench/matmul.py needs the native companion (./dev setup)")
    if args.rows:
        mx.set_cache_limit(max(mx.set_cache_limit(0), 1 << 32))
        counts = [int(v) for v in args.row_counts.split(",")]
        print(f"{processor()}; MLX {mx.__version__}; oneDNN {ext.onednn_version()} "
              f"({ext.cpu_isa()}); bfloat16; any_rows_kernel: {ext.any_rows_kernel()}, "
              f"from {ext.any_rows_min()} rows (and 1); steady: fastest of {args.rounds}\n")
        print("| M x K x N | per shape us | auto us | auto / per shape | first call, per shape "
              "us | first call, auto us |")
        print("|---|---|---|---|---|---|")
        if not ext.isa_has_bf16():
            print("(no native bfloat16 kernels on this CPU: nothing to time)")
            return
        for layer in args.rows.split(","):
            k, n = (int(v) for v in layer.split("x"))
            rows_table(ext, k, n, counts, args.rounds)
        return
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.chain, args.rounds = [(8, 16, 16)], 2, 2
    mx.set_cache_limit(max(mx.set_cache_limit(0), 1 << 32))  # (as train's update raises it)
    print(f"{processor()}; MLX {mx.__version__}; oneDNN {ext.onednn_version()} "
          f"({ext.cpu_isa()}); {args.chain} products per eval, fastest of {args.rounds}\n")
    print("| M x K x N | dtype | kernel | standalone us | weights reordered us | in graph us "
          "| standalone / in graph | in graph, packed weights us | standalone / that "
          "| in graph, one per eval us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, k, n in sizes:
        for name in args.dtypes.split(","):
            dtype = getattr(mx, name)
            if dtype == mx.bfloat16 and not ext.isa_has_bf16():
                continue  # (in float32 kernels there: not the bfloat16 primitive)
            r = row(ext, m, k, n, dtype, args.chain, args.rounds)
            packed = ("- | -" if r["packed"] is None else
                      f"{r['packed'] * 1e6:.0f} | {r['plain'] / r['packed']:.2f}")
            print(f"| {m} x {k} x {n} | {name} | {r['impl']} | {r['plain'] * 1e6:.0f} "
                  f"| {r['reordered'] * 1e6:.0f} | {r['graph'] * 1e6:.0f} "
                  f"| {r['plain'] / r['graph']:.2f} | {packed} | {r['single'] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
