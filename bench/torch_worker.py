"""The PyTorch side of ``bench/run.py``: a process of its own that builds the PyTorch models
and times them on request, so that each framework is measured as a user runs it.

    .venv/bin/python bench/torch_worker.py [--threads N]   # started by run.py, not by hand

Why not in run.py's process: MLX there changes what PyTorch pays. fluxlike's training step
raises MLX's CPU buffer-cache limit, after which a PyTorch large-MLP step in the same process
took 20-35 k page faults per step (636 ms against ~360 ms alone); and until fluxlike kept its
OpenBLAS private to MLX, it opened it with ``RTLD_GLOBAL`` and a torch imported afterwards bound
its BLAS calls to it (its BLAS threads then fought its OpenMP threads). This process imports
torch, numpy and ``specs.py``, never MLX or fluxlike.

Protocol: one JSON object per line each way (requests on stdin, replies on stdout). At start
the worker sends ``{"pid", "torch", "threads", "loaded"}`` (``loaded``: which of mlx and
fluxlike it has imported, i.e. none) or ``{"error"}`` when torch cannot be imported. Then:

- ``{"op": "build", "section": "inference" | "training", "model": name}`` -> ``{"variants"}``
  (drops the models built before);
- ``{"op": "warm", "variant", "extra", "slow_s"}`` -> ``{"seconds"}`` of the last warm-up call
  (``warm_up``);
- ``{"op": "sample", "variant", "calls"}`` -> ``{"seconds"}`` per call, measured here, so that
  the pipe's latency is not counted (``sample``: one untimed call, then ``calls`` timed);
- ``{"op": "output", "variant"}`` -> ``{"shape", "data"}``: the inference output as base64
  float32 bytes (for run.py's agreement check);
- ``{"op": "clear"}`` -> ``{}``: drops the models.

A failed request is answered ``{"error": traceback}``. End of input (run.py closed the pipe,
exited or crashed) ends the worker. The parent's side (``TorchWorker``, ``Remote``) and the
timing primitives that both processes use (``warm_up``, ``sample``) are here too; importing
this module does not import torch.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
from specs import LM, SPECS, LMSpec, Spec, data, lm_data, weights

# ------------------------------------------------------------------ timing (both processes)


def warm_up(fn: Callable[[], object], extra: int, slow_s: float) -> float:
    """Seconds taken by the last of ``1 + extra`` warm-up calls of ``fn`` (the first call
    traces, compiles, allocates); just the first when it took longer than ``slow_s``."""
    start = time.perf_counter()
    fn()
    last = time.perf_counter() - start
    if last < slow_s:
        for _ in range(extra):
            start = time.perf_counter()
            fn()
            last = time.perf_counter() - start
    return last


def sample(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call over ``calls`` calls of ``fn``, after one untimed call: a sample
    measures the variant in its steady state (a training loop repeats one step), not its first
    call after another variant reshuffled the allocators' caches."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


# ------------------------------------------------------------------ the parent's side


class Unavailable(RuntimeError):
    """The worker could not start (torch missing or broken)."""


class TorchWorker:
    """The PyTorch process, seen from run.py: started at construction, ended by ``close``
    (or by run.py's exit, which closes the pipe)."""

    def __init__(self, threads: int = 0, python: str | None = None):
        self.python = python or sys.executable  # a Python with torch (a venv of its own is fine)
        self.proc = subprocess.Popen(
            [self.python, str(Path(__file__).resolve()), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.pid = self.proc.pid
        self._cpu = 0.0
        hello = self._read()
        if "error" in hello:
            self.close()
            raise Unavailable(hello["error"])
        self.version: str = hello["torch"]
        self.threads: int = hello["threads"]
        self.loaded: list[str] = hello["loaded"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"the PyTorch worker (pid {self.pid}) exited with status {rc}")
        return json.loads(line)

    def ask(self, op: str, **fields: object) -> dict:
        """Send one request and return its reply (raise on an error reply)."""
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"PyTorch worker, {op}: {reply['error']}")
        return reply

    def build(self, section: str, model: str) -> dict[str, Remote]:
        """Build the PyTorch variants of one model for one section (dropping earlier ones)."""
        reply = self.ask("build", section=section, model=model)
        return {name: Remote(self, name) for name in reply["variants"]}

    def clear(self) -> None:
        self.ask("clear")

    def cpu_seconds(self) -> float:
        """CPU time the worker has used so far (user + system, from ``/proc``; the last value
        read once it has exited), so that run.py does not count it as other processes' load."""
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            self._cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        return self._cpu

    def close(self) -> int:
        """End the worker (end of input) and return its exit status."""
        self.cpu_seconds()
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Remote:
    """One PyTorch variant living in the worker; run.py's Timer calls ``warm_up`` and
    ``sample`` where it would time a local function."""

    def __init__(self, worker: TorchWorker, name: str):
        self.worker, self.name = worker, name

    def warm_up(self, extra: int, slow_s: float) -> float:
        return self.worker.ask("warm", variant=self.name, extra=extra, slow_s=slow_s)["seconds"]

    def sample(self, calls: int) -> float:
        return self.worker.ask("sample", variant=self.name, calls=calls)["seconds"]

    def output(self) -> np.ndarray:
        """The variant's inference output on the model's batch, float32."""
        reply = self.worker.ask("output", variant=self.name)
        flat = np.frombuffer(base64.b64decode(reply["data"]), dtype=np.float32)
        return flat.reshape(reply["shape"])


# ------------------------------------------------------------------ PyTorch models (worker)


def torch_model(spec: Spec, ws: list):  # -> torch.nn.Sequential
    """The model as a ``torch.nn.Sequential`` (NCHW for the CNN), from the MLX-layout weights
    of ``specs.weights``."""
    import torch

    layers: list = []
    it = iter(ws)
    spatial = spec.input_shape[:-1]
    for layer in spec.layers:
        if layer[0] == "flatten":
            layers.append(torch.nn.Flatten())
            continue
        w, b = next(it)
        if layer[0] == "dense":
            made = torch.nn.Linear(layer[1], layer[2])
            if len(spec.input_shape) == 3 and layers and isinstance(layers[-1], torch.nn.Flatten):
                # MLX flattens (H, W, C), PyTorch (C, H, W): permute the weight's columns.
                c = w.shape[1] // math.prod(spatial)
                w = w.reshape(w.shape[0], *spatial, c).transpose(0, 3, 1, 2).reshape(w.shape)
            made.weight.data = torch.from_numpy(np.ascontiguousarray(w))
        else:
            made = torch.nn.Conv2d(layer[1], layer[2], 3, padding=1)
            made.weight.data = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2)))
            spatial = tuple(s // 2 for s in spatial)
        made.bias.data = torch.from_numpy(b.copy())
        layers.append(made)
        if layer[0] == "conv" or layer[3]:
            layers.append(torch.nn.ReLU())
        if layer[0] == "conv":
            layers.append(torch.nn.MaxPool2d(2))
    return torch.nn.Sequential(*layers)


def torch_input(x: np.ndarray):  # -> torch.Tensor
    """``x`` as a torch tensor in PyTorch's layout (NHWC -> NCHW for images)."""
    import torch

    if x.ndim == 4:
        x = x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x))


def inference_variants(spec: Spec) -> dict[str, Callable[[], object]]:
    """One forward pass under ``torch.no_grad()``, float32 and under CPU bf16 autocast."""
    import torch

    tm, tx = torch_model(spec, weights(spec)).eval(), torch_input(data(spec)[0])

    def torch_f32():
        with torch.no_grad():
            return tm(tx)

    def torch_bf16():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return tm(tx)

    return {"torch f32": torch_f32, "torch bf16": torch_bf16}


def training_variants(spec: Spec) -> dict[str, Callable[[], object]]:
    """One training step (forward, cross entropy on integer labels, backward, Adam(1e-3)),
    float32 and under CPU bf16 autocast; each variant has its own model and optimiser."""
    import torch
    import torch.nn.functional as F

    ws = weights(spec)
    x_np, labels_np = data(spec)

    def step_for(dtype) -> Callable[[], None]:
        tm = torch_model(spec, ws).train()
        tx, tl = torch_input(x_np), torch.from_numpy(labels_np.astype(np.int64))
        opt = torch.optim.Adam(tm.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(tm(tx), tl)
            loss.backward()
            opt.step()

        return step

    return {"torch f32": step_for(None), "torch bf16": step_for(torch.bfloat16)}


def lm_training_variants(spec: LMSpec = LM) -> dict[str, Callable[[], object]]:
    """The transformer LM's training step (``bench/models.py``'s ``LanguageModel`` in
    ``torch.nn``: pre-norm ``TransformerEncoderLayer``s, batch first, ReLU, no dropout, an
    additive causal mask), float32 and under CPU bf16 autocast, Adam(1e-3)."""
    import torch
    import torch.nn.functional as F

    tokens_np, targets_np = lm_data(spec)

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(spec.vocab, spec.dims)
            self.positions = torch.nn.Embedding(spec.context, spec.dims)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(spec.dims, spec.heads, 4 * spec.dims,
                                                 dropout=0.0, batch_first=True,
                                                 norm_first=True)
                for _ in range(spec.layers))
            self.norm = torch.nn.LayerNorm(spec.dims)
            self.head = torch.nn.Linear(spec.dims, spec.vocab)

        def forward(self, tokens):
            length = tokens.shape[1]
            x = self.embedding(tokens) + self.positions(torch.arange(length))
            mask = torch.nn.Transformer.generate_square_subsequent_mask(length)
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.norm(x))

    def step_for(dtype) -> Callable[[], None]:
        torch.manual_seed(0)
        tm = LanguageModel().train()
        tokens = torch.from_numpy(tokens_np.astype(np.int64))
        targets = torch.from_numpy(targets_np.astype(np.int64))
        opt = torch.optim.Adam(tm.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                logits = tm(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()

        return step

    return {"torch f32": step_for(None), "torch bf16": step_for(torch.bfloat16)}


# ------------------------------------------------------------------ the worker's loop


def handle(request: dict, variants: dict[str, Callable[[], object]]) -> dict:
    op = request["op"]
    if op in ("build", "clear"):
        variants.clear()
        gc.collect()
        if op == "clear":
            return {}
        if request["model"] == LM.name:
            if request["section"] != "training":
                raise ValueError(f"the {LM.name} model is timed in training only")
            variants.update(lm_training_variants())
            return {"variants": list(variants)}
        build = {"inference": inference_variants, "training": training_variants}
        variants.update(build[request["section"]](SPECS[request["model"]]))
        return {"variants": list(variants)}
    fn = variants[request["variant"]]
    if op == "warm":
        return {"seconds": warm_up(fn, request["extra"], request["slow_s"])}
    if op == "sample":
        return {"seconds": sample(fn, request["calls"])}
    if op == "output":
        out = np.ascontiguousarray(fn().float().numpy(), dtype=np.float32)
        return {"shape": list(out.shape), "data": base64.b64encode(out.tobytes()).decode()}
    raise ValueError(f"unknown request {op!r}")


def serve(threads: int) -> int:
    # The replies get fd 1 to themselves; anything else printing there (a library's C code
    # included) goes to stderr instead of into the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        import torch
    except ImportError as e:
        send({"error": f"cannot import torch ({e})"})
        return 1
    if threads:
        torch.set_num_threads(threads)
    send({"pid": os.getpid(), "torch": torch.__version__, "threads": torch.get_num_threads(),
          "loaded": [m for m in ("mlx", "fluxlike") if m in sys.modules]})
    variants: dict[str, Callable[[], object]] = {}
    for line in sys.stdin:  # ends at end of input: run.py is done, or gone
        try:
            reply = handle(json.loads(line), variants)
        except Exception:
            reply = {"error": traceback.format_exc()}
        send(reply)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads(N) (default: PyTorch's own choice)")
    args = parser.parse_args()
    try:
        sys.exit(serve(args.threads))
    except (BrokenPipeError, KeyboardInterrupt):
        # run.py went away mid-reply, or Ctrl-C reached the whole process group: nothing to
        # report to anyone (and no flushing of a broken pipe at shutdown either).
        os._exit(0)


if __name__ == "__main__":
    main()
