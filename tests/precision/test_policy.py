"""Per-layer precision policies and the dispatch barrier (fluxlike/precision/policy.py,
fluxlike/precision/stock.py): output dtypes of fluxlike's and mlx.nn's layers under autocast,
what is never cast, master weights, user layers and subclasses, the device rule, and (in a
fresh interpreter) the barrier itself."""

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import np64
from mlx.utils import tree_flatten

import fluxlike as fl
from fluxlike import autocast, autocast_policy, policy_of
from fluxlike.precision import kernels
from fluxlike.precision.operands import match_input
from fluxlike.precision.policy import is_routing
from fluxlike.precision.swap import swapped

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
HALVES = [F16, BF16]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _dispatching():
    """These tests run after the barrier (the subprocess test covers before it)."""
    with autocast(device="cpu", enabled=False):
        pass
    assert is_routing()


def leaves(out):
    """The arrays of a layer's output (an array, or a tuple/list of them)."""
    if isinstance(out, mx.array):
        return [out]
    return [a for item in out for a in leaves(item)]


def run(layer, inputs, dtype=None):
    """Output dtypes of ``layer(*inputs)``, inside ``autocast(dtype, device="cpu")`` if given."""
    if dtype is None:
        return [a.dtype for a in leaves(layer(*inputs))]
    with autocast(dtype, device="cpu"):
        return [a.dtype for a in leaves(layer(*inputs))]


def img(*shape):
    return mx.random.normal(shape)


# (name, layer factory, inputs, policy). Inputs are float32 unless stated.
FLUXLIKE = [
    ("Dense", lambda: fl.Dense(4, 3, "relu"), lambda: [img(2, 4)], "down"),
    ("Bilinear", lambda: fl.Bilinear(4, 5, 3), lambda: [img(2, 4), img(2, 5)], "down"),
    ("Conv", lambda: fl.Conv((3, 3), 2, 4, "relu", stride=2), lambda: [img(2, 8, 8, 2)],
     "down"),
    ("Conv1d", lambda: fl.Conv((3,), 2, 4, padding="same"), lambda: [img(2, 8, 2)], "down"),
    ("ConvTranspose", lambda: fl.ConvTranspose((3, 3), 4, 2), lambda: [img(1, 5, 5, 4)],
     "down"),
    ("RNN", lambda: fl.RNN(3, 5), lambda: [img(2, 4, 3)], "down"),
    ("LSTM", lambda: fl.LSTM(3, 5, return_state=True), lambda: [img(2, 4, 3)], "down"),
    ("GRU", lambda: fl.GRU(3, 5), lambda: [img(2, 4, 3)], "down"),
    ("LSTMCell", lambda: fl.LSTMCell(3, 5), lambda: [img(2, 3)], "down"),
    ("MultiHeadAttention", lambda: fl.MultiHeadAttention(8, 2),
     lambda: [img(2, 5, 8)], "down"),
    ("BatchNorm", lambda: fl.BatchNorm(4), lambda: [img(6, 4)], "fp32"),
    ("LayerNorm", lambda: fl.LayerNorm(4), lambda: [img(3, 4)], "fp32"),
    ("RMSNorm", lambda: fl.RMSNorm(4), lambda: [img(3, 4)], "fp32"),
    ("GroupNorm", lambda: fl.GroupNorm(4, 2), lambda: [img(2, 3, 4)], "fp32"),
    ("InstanceNorm", lambda: fl.InstanceNorm(4, affine=True), lambda: [img(2, 5, 4)], "fp32"),
    ("Dropout", lambda: fl.Dropout(0.5), lambda: [img(3, 4)], "none"),
    ("Scale", lambda: fl.Scale(4), lambda: [img(3, 4)], "none"),
    ("CrossCor", lambda: fl.CrossCor((3, 3), 2, 4, "relu", padding=1),
     lambda: [img(2, 6, 6, 2)], "down"),
    ("DepthwiseConv", lambda: fl.DepthwiseConv((3,), 2, 4), lambda: [img(2, 8, 2)], "down"),
    ("AlphaDropout", lambda: fl.AlphaDropout(0.5), lambda: [img(3, 4)], "none"),
    ("Upsample", lambda: fl.Upsample("bilinear", scale=2), lambda: [img(2, 3, 3, 2)], "none"),
    ("PixelShuffle", lambda: fl.PixelShuffle(2), lambda: [img(2, 3, 3, 8)], "none"),
]

STOCK = [
    ("Linear", lambda: nn.Linear(4, 3), lambda: [img(2, 4)], "down"),
    ("Bilinear", lambda: nn.Bilinear(4, 5, 3), lambda: [img(2, 4), img(2, 5)], "down"),
    ("Conv1d", lambda: nn.Conv1d(2, 4, 3), lambda: [img(2, 8, 2)], "down"),
    ("Conv2d", lambda: nn.Conv2d(2, 4, 3, stride=2), lambda: [img(2, 8, 8, 2)], "down"),
    ("Conv3d", lambda: nn.Conv3d(2, 4, 3), lambda: [img(1, 4, 4, 4, 2)], "down"),
    ("ConvTranspose1d", lambda: nn.ConvTranspose1d(4, 2, 3), lambda: [img(2, 5, 4)], "down"),
    ("ConvTranspose2d", lambda: nn.ConvTranspose2d(4, 2, 3), lambda: [img(1, 5, 5, 4)],
     "down"),
    ("MultiHeadAttention", lambda: nn.MultiHeadAttention(8, 2),
     lambda: [img(2, 5, 8), img(2, 6, 8), img(2, 6, 8)], "down"),
    ("RNN", lambda: nn.RNN(3, 5), lambda: [img(2, 4, 3)], "down"),
    ("GRU", lambda: nn.GRU(3, 5), lambda: [img(2, 4, 3)], "down"),
    ("LSTM", lambda: nn.LSTM(3, 5), lambda: [img(2, 4, 3)], "down"),
    ("LayerNorm", lambda: nn.LayerNorm(4), lambda: [img(3, 4)], "fp32"),
    ("RMSNorm", lambda: nn.RMSNorm(4), lambda: [img(3, 4)], "fp32"),
    ("GroupNorm", lambda: nn.GroupNorm(2, 4), lambda: [img(2, 3, 4)], "fp32"),
    ("InstanceNorm", lambda: nn.InstanceNorm(4, affine=True), lambda: [img(2, 5, 4)], "fp32"),
    ("BatchNorm", lambda: nn.BatchNorm(4), lambda: [img(6, 4)], "fp32"),
    ("Dropout", lambda: nn.Dropout(0.5), lambda: [img(3, 4)], "none"),
]


def expected_dtype(policy, scope_dtype, input_dtype):
    if scope_dtype is None:
        return input_dtype
    return {"down": scope_dtype, "fp32": F32, "none": input_dtype}[policy]


@pytest.mark.parametrize("name, make, inputs, policy", FLUXLIKE + STOCK,
                         ids=[f"fluxlike.{c[0]}" for c in FLUXLIKE] +
                             [f"nn.{c[0]}" for c in STOCK])
class TestOutputDtypes:
    def test_policy_is_registered(self, name, make, inputs, policy):
        assert policy_of(make()) == policy

    @pytest.mark.parametrize("dtype", HALVES)
    def test_inside_a_scope(self, name, make, inputs, policy, dtype):
        layer = make()
        xs = inputs()
        got = run(layer, xs, dtype)
        assert got == [expected_dtype(policy, dtype, F32)] * len(got)
        assert run(layer, xs) == [F32] * len(got)  # and float32 again outside

    @pytest.mark.parametrize("dtype", HALVES)
    def test_half_input_inside_a_scope(self, name, make, inputs, policy, dtype):
        """fp32 layers take half input up to float32; down layers compute in the scope's
        dtype whatever half dtype comes in."""
        layer = make()
        other = F16 if dtype == BF16 else BF16
        got = run(layer, [x.astype(other) for x in inputs()], dtype)
        if policy == "none":  # stock Dropout is active (mlx training mode): input dtype
            assert got == [other] * len(got)
        else:
            assert got == [expected_dtype(policy, dtype, other)] * len(got)


class TestOtherLayers:
    @pytest.mark.parametrize("emb", [lambda: fl.Embedding(10, 4), lambda: nn.Embedding(10, 4),
                                     lambda: fl.EmbeddingBag(10, 4)])
    @pytest.mark.parametrize("dtype", HALVES)
    def test_embedding_is_float32(self, emb, dtype):
        layer = emb()
        idx = mx.array([[1, 2], [3, 9]])
        assert policy_of(layer) == "none"
        assert run(layer, [idx], dtype) == [F32]

    @pytest.mark.parametrize("dtype", HALVES)
    def test_pooling_keeps_the_input_dtype(self, dtype):
        x = img(1, 4, 4, 2)
        with autocast(dtype, device="cpu"):
            assert fl.MaxPool((2, 2))(x).dtype == F32
            assert fl.MaxPool((2, 2))(x.astype(dtype)).dtype == dtype

    @pytest.mark.parametrize("dtype", HALVES)
    def test_chain_ends_in_the_scope_dtype(self, dtype):
        model = fl.Chain(fl.Dense(4, 8, "relu"), fl.BatchNorm(8), fl.Dense(8, 2))
        x = img(5, 4)
        with autocast(dtype, device="cpu"):
            assert model[0](x).dtype == dtype
            assert model[:2](x).dtype == F32
            assert model(x).dtype == dtype

    def test_unmodified_mlx_nn_model(self):
        class Block(nn.Module):  # a user's model, written against mlx.nn only
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3, padding=1)
                self.norm = nn.GroupNorm(4, 8)
                self.attn = nn.MultiHeadAttention(8, 2)
                self.ln = nn.LayerNorm(8)
                self.head = nn.Linear(8, 10)

            def __call__(self, x):
                h = nn.relu(self.conv(x))
                h = self.norm(h).reshape(x.shape[0], -1, 8)
                h = self.ln(h + self.attn(h, h, h))
                return self.head(h.mean(axis=1))

        model = Block()
        x = img(2, 4, 4, 3)
        reference = model(x)
        for dtype in HALVES:
            with autocast(dtype, device="cpu"):
                out = model(x)
            assert out.dtype == dtype
            np.testing.assert_allclose(np64(out), np64(reference), atol=0.1, rtol=0.05)
        seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
        with autocast(F16, device="cpu"):
            assert seq(img(3, 4)).dtype == F16
            assert seq.layers[2](seq.layers[0](img(3, 4))).dtype == F32


class Probe(nn.Module):
    """Records the dtypes its call sees (of its own parameters and its arguments)."""

    seen: list = []

    def __init__(self):
        super().__init__()
        self.w32 = mx.ones((2,))
        self.w64 = mx.ones((2,), dtype=mx.float64)
        self.index = mx.array([1, 2])
        self.nested = [mx.ones((2,)), {"b": mx.ones((2,), dtype=F16)}]

    def __call__(self, *args, **kwargs):
        Probe.seen.append({
            "params": (self.w32.dtype, self.w64.dtype, self.index.dtype,
                       self.nested[0].dtype, self.nested[1]["b"].dtype),
            "args": [a.dtype if isinstance(a, mx.array) else a for a in args],
            "kwargs": {k: v.dtype if isinstance(v, mx.array) else
                       [t.dtype for t in v] for k, v in kwargs.items()},
        })
        return args[0]


@autocast_policy("down")
class DownProbe(Probe):
    pass


@autocast_policy("fp32")
class Fp32Probe(Probe):
    pass


ARGS = [mx.ones((2,)), mx.ones((2,), dtype=mx.float64), mx.array([1, 2]),
        mx.array([True, False]), mx.ones((2,), dtype=F16), 3.5, "text"]


class TestNeverCast:
    @pytest.mark.parametrize("dtype", HALVES)
    def test_down_casts_only_float32_and_half(self, dtype):
        Probe.seen.clear()
        with autocast(dtype, device="cpu"):
            DownProbe()(*ARGS, mask=mx.array([True]), pair=(mx.ones(1), mx.zeros(1, mx.int8)))
        seen = Probe.seen[0]
        assert seen["params"] == (dtype, mx.float64, mx.int32, dtype, dtype)
        assert seen["args"] == [dtype, mx.float64, mx.int32, mx.bool_, dtype, 3.5, "text"]
        assert seen["kwargs"] == {"mask": mx.bool_, "pair": [dtype, mx.int8]}

    @pytest.mark.parametrize("dtype", HALVES)
    def test_fp32_casts_only_half_up(self, dtype):
        Probe.seen.clear()
        with autocast(dtype, device="cpu"):
            Fp32Probe()(*ARGS, h=[mx.ones(1, BF16), mx.ones(1, mx.float64)])
        seen = Probe.seen[0]
        assert seen["params"] == (F32, mx.float64, mx.int32, F32, F16)  # its own, unchanged
        assert seen["args"] == [F32, mx.float64, mx.int32, mx.bool_, F32, 3.5, "text"]
        assert seen["kwargs"] == {"h": [F32, mx.float64]}

    def test_outside_a_scope_nothing_is_cast(self):
        Probe.seen.clear()
        with autocast(F16, device="gpu"):  # another device's scope
            DownProbe()(*ARGS)
        assert Probe.seen[0]["args"][:5] == [F32, mx.float64, mx.int32, mx.bool_, F16]

    def test_swapped_casts_are_put_back(self):
        layer = DownProbe()
        before = dict(layer)
        nested = [layer.nested[0], layer.nested[1]["b"]]
        with swapped(layer, BF16):
            assert layer.w32.dtype == BF16 and layer.nested[1]["b"].dtype == BF16
            assert layer.w64.dtype == mx.float64 and layer.index.dtype == mx.int32
        assert all(layer[k] is v for k, v in before.items())
        assert [layer.nested[0], layer.nested[1]["b"]] == nested
        assert layer.w32.dtype == F32 and layer.nested[0].dtype == F32


class TestMasterWeights:
    @pytest.mark.parametrize("dtype", HALVES)
    @pytest.mark.parametrize("stock", [False, True])
    def test_unchanged_float32_after_forward_and_backward(self, dtype, stock):
        if stock:
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 3))
        else:
            model = fl.Chain(fl.Dense(4, 8, "relu"), fl.BatchNorm(8), fl.Dense(8, 3))
        x, y = img(16, 4), img(16, 3)
        flat = dict(tree_flatten_params(model))
        copies = {k: np.array(v) for k, v in flat.items()}

        def loss(m):
            return mx.mean((m(x).astype(F32) - y) ** 2)

        reference = nn.value_and_grad(model, loss)(model)[1]
        with autocast(dtype, device="cpu"):
            value, grads = nn.value_and_grad(model, loss)(model)
        mx.eval(value, grads)
        assert value.dtype == F32
        for key, g in tree_flatten_params(grads):
            assert g.dtype == F32, key
            ref = dict(tree_flatten_params(reference))[key]
            scale = float(mx.abs(ref).max()) + 1e-6
            assert float(mx.abs(g - ref).max()) / scale < 0.1, key  # half-precision rounding
        after = dict(tree_flatten_params(model))
        assert after.keys() == flat.keys()
        for key, v in after.items():
            assert v.dtype == F32, key  # (nn.value_and_grad leaves equal copies in the model)
            np.testing.assert_array_equal(np.array(v), copies[key])

    def test_running_statistics_stay_float32(self):
        bn = fl.trainmode(fl.BatchNorm(4))
        with autocast(F16, device="cpu"):
            bn(img(8, 4).astype(F16))
        assert bn.running_mean.dtype == F32 and bn.running_var.dtype == F32
        assert float(mx.abs(bn.running_mean).sum()) > 0  # they did update


def tree_flatten_params(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree.parameters() if isinstance(tree, nn.Module) else tree)


class TestUserLayers:
    def test_one_line_opts_a_layer_in(self):
        @autocast_policy("down")
        class Projection(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = mx.ones((3, 2))

            def __call__(self, x):
                return x @ self.w

        layer = Projection()
        with autocast(F16, device="cpu"):
            assert layer(mx.ones((1, 3))).dtype == F16
        assert layer(mx.ones((1, 3))).dtype == F32 and layer.w.dtype == F32

    def test_registering_an_existing_class(self):
        class Norm(nn.Module):
            def __call__(self, x):
                return x / mx.sqrt(mx.mean(x * x))

        x = mx.ones((2, 2), dtype=BF16)
        with autocast(BF16, device="cpu"):
            assert Norm()(x).dtype == BF16
        assert autocast_policy("fp32")(Norm) is Norm  # after the barrier: wrapped at once
        with autocast(BF16, device="cpu"):
            assert Norm()(x).dtype == F32
        assert Norm()(x).dtype == BF16

    def test_bad_registrations(self):
        with pytest.raises(ValueError, match="policy must be one of"):
            autocast_policy("half")
        with pytest.raises(TypeError, match="mlx.nn.Module subclass"):
            autocast_policy("down")(int)


class TestSubclasses:
    def test_inherits_the_policy(self):
        class Wide(fl.Dense):
            pass

        assert policy_of(Wide) == "down"
        with autocast(F16, device="cpu"):
            assert Wide(2, 3)(mx.ones((1, 2))).dtype == F16

    def test_own_call_defined_after_the_barrier(self):
        class Doubled(fl.Dense):  # no super() call: it must be wrapped itself
            def __call__(self, x):
                x = match_input(x, self.weight, "Doubled")
                return 2 * kernels.linear(x, self.weight, self.bias)

        class Twice(Doubled):  # and so must its own subclasses
            def __call__(self, x):
                return kernels.linear(match_input(x, self.weight, "Twice"), self.weight)

        with autocast(BF16, device="cpu"):
            assert Doubled(2, 3)(mx.ones((1, 2))).dtype == BF16
            assert Twice(2, 3)(mx.ones((1, 2))).dtype == BF16
        assert Doubled(2, 3)(mx.ones((1, 2))).dtype == F32

    def test_super_call(self):
        class Shifted(fl.Dense):
            def __call__(self, x):
                return super().__call__(x) + 1

        layer = Shifted(2, 3)
        with autocast(F16, device="cpu"):
            out = layer(mx.ones((1, 2)))
        assert out.dtype == F16
        np.testing.assert_allclose(np64(out), np64(layer(mx.ones((1, 2)))), atol=1e-2)

    @pytest.mark.parametrize("policy, expected", [("none", F32), ("fp32", F32), ("down", F16)])
    def test_own_policy_overrides_the_parent(self, policy, expected):
        @autocast_policy(policy)
        class Special(fl.Dense):
            pass

        assert policy_of(Special) == policy and policy_of(fl.Dense) == "down"
        with autocast(F16, device="cpu"):
            assert Special(2, 3)(mx.ones((1, 2))).dtype == expected
            assert fl.Dense(2, 3)(mx.ones((1, 2))).dtype == F16


class TestDeviceRule:
    def test_another_devices_scope_does_not_affect_a_cpu_call(self):
        dense, bn, linear = fl.Dense(2, 3), fl.BatchNorm(2), nn.Linear(2, 3)
        x = mx.ones((4, 2))
        with autocast(F16, device="gpu"):
            assert dense(x).dtype == F32 and linear(x).dtype == F32
            assert bn(x.astype(F16)).dtype == F16  # not cast up: the CPU has no scope
            with autocast(BF16, device="cpu"):
                assert dense(x).dtype == BF16 and linear(x).dtype == BF16
                assert bn(x.astype(F16)).dtype == F32

    def test_the_policy_of_the_default_device_is_used(self, monkeypatch):
        dense = fl.Dense(2, 3)
        x = mx.ones((1, 2))
        with autocast(BF16, device="cpu"), autocast(F16, device="gpu"):
            assert dense(x).dtype == BF16
            # Pretend the GPU is the default device (the computation still runs on the CPU).
            monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
            assert dense(x).dtype == F16
            monkeypatch.undo()
            assert dense(x).dtype == BF16


BARRIER_SCRIPT = textwrap.dedent('''
    import sys, threading
    import mlx.core as mx
    import mlx.nn as nn
    import fluxlike as fl
    from fluxlike import autocast, autocast_policy
    from fluxlike.precision import policy

    def is_wrapper(f):
        return hasattr(f, "__fluxlike_plain__")

    # Classes defined before the barrier: a subclass with its own __call__, and a "none"
    # subclass registered before its parent (the registry's order must not matter).
    class OwnCall(fl.Dense):
        def __call__(self, x):
            return fl.Dense.__call__(self, x) * 1
    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.ones((2, 2))
        def __call__(self, x):
            return x @ self.w
    class Kid(Base):
        pass
    autocast_policy("none")(Kid)
    autocast_policy("down")(Base)

    # Each class's own record: its kind, and whether its forward casts at fluxlike's kernels
    # (fluxlike's own layers: no wrapper at all).
    registry = {cls: ("none" if d["kind"] == "down" and d["forward"] is None
                      and policy._ours(cls.__call__) else d["kind"])
                for cls, d in policy._declared.items() if "kind" in d}
    plain = {cls: cls.__call__ for cls in list(registry) + [OwnCall]}
    assert not policy.is_routing()
    assert fl.Dense.__call__ is fl.Dense.__dict__["__call__"]
    assert not is_wrapper(fl.Dense.__call__) and not hasattr(fl.Dense.__call__, "__wrapped__")

    # Using the library without autocast never crosses the barrier.
    x = mx.ones((4, 3))
    model = fl.Chain(fl.Dense(3, 4, "relu"), fl.BatchNorm(4), fl.LayerNorm(4), fl.Dense(4, 2))
    assert model(x).dtype == mx.float32
    nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))(x)
    fl.softmax(x)
    scope = autocast(mx.float16)  # made, not entered
    assert not autocast.is_enabled() and autocast.get_dtype("gpu") is None
    fl.compile(lambda v: model(v))(x)
    assert not policy.is_routing()
    for cls, f in plain.items():
        assert cls.__call__ is f and not is_wrapper(cls.__call__), cls

    # Count the wrappers each class ever gets while many threads cross at once.
    made = {}
    install = policy._install
    def counting(cls, *args):
        install(cls, *args)
        own = cls.__dict__.get("__call__")
        if is_wrapper(own):
            made.setdefault(cls, set()).add(id(own))
    policy._install = counting
    sys.setswitchinterval(1e-6)
    n = 16
    start = threading.Barrier(n)
    results = [None] * n
    dense, kid = fl.Dense(3, 2), Kid()  # made here: mx.random in many threads is MLX's problem
    def first_use(i):
        start.wait()
        try:
            with autocast(mx.float16, device="cpu"):
                results[i] = (dense(x).dtype, model(x).dtype, kid(mx.ones((1, 2))).dtype)
        finally:
            mx.clear_streams()  # MLX's rule for threads: else the process may abort at exit
    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join()
    policy._install = install

    assert policy.is_routing()
    assert results == [(mx.float16, mx.float16, mx.float32)] * n, results
    for cls, pol in registry.items():
        own = cls.__dict__.get("__call__")
        if pol == "none":
            assert not is_wrapper(cls.__call__), cls
            continue
        assert is_wrapper(own), cls
        assert own.__fluxlike_plain__ is plain[cls], cls  # wraps the plain method...
        assert not is_wrapper(own.__fluxlike_plain__), cls  # ...once
        assert len(made.get(cls, ())) == 1, (cls, made.get(cls))
    assert is_wrapper(OwnCall.__dict__["__call__"])
    wrappers = {cls: cls.__call__ for cls in registry}
    with autocast(mx.bfloat16, device="cpu"):
        assert OwnCall(3, 2)(x).dtype == mx.bfloat16
    assert all(cls.__call__ is w for cls, w in wrappers.items())  # later scopes change nothing
    print("barrier ok")
''')


def test_dispatch_barrier_in_a_fresh_interpreter():
    done = subprocess.run([sys.executable, "-c", BARRIER_SCRIPT], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "barrier ok"


# fluxlike's own down layers get no wrapper: they cast at the kernels. Every one is here, with
# an input, so that a new down layer that forgets to call the kernels fails this test.
DOWN_EXAMPLES = {
    "Dense": (lambda fl: fl.Dense(4, 3), (2, 4)),
    "Bilinear": (lambda fl: fl.Bilinear(4, 4, 3), (2, 4)),
    "Conv": (lambda fl: fl.Conv((3, 3), 2, 3), (1, 5, 5, 2)),
    "CrossCor": (lambda fl: fl.CrossCor((3, 3), 2, 3), (1, 5, 5, 2)),
    "ConvTranspose": (lambda fl: fl.ConvTranspose((3, 3), 2, 3), (1, 5, 5, 2)),
    "RNNCell": (lambda fl: fl.RNNCell(4, 3), (2, 4)),
    "LSTMCell": (lambda fl: fl.LSTMCell(4, 3), (2, 4)),
    "GRUCell": (lambda fl: fl.GRUCell(4, 3), (2, 4)),
    "RNN": (lambda fl: fl.RNN(4, 3), (2, 5, 4)),
    "LSTM": (lambda fl: fl.LSTM(4, 3), (2, 5, 4)),
    "GRU": (lambda fl: fl.GRU(4, 3), (2, 5, 4)),
    "MultiHeadAttention": (lambda fl: fl.MultiHeadAttention(8, 2), (2, 5, 8)),
}


def _down_layers() -> list[str]:
    import inspect

    import fluxlike as fl

    return sorted(name for name in fl.__all__ if inspect.isclass(getattr(fl, name))
                  and issubclass(getattr(fl, name), nn.Module)
                  and policy_of(getattr(fl, name)) == "down")


def test_every_down_layer_has_an_example_here():
    assert sorted(DOWN_EXAMPLES) == _down_layers()


@pytest.mark.parametrize("name", sorted(DOWN_EXAMPLES))
def test_every_down_layer_calls_the_kernels(name, monkeypatch):
    """Under autocast, each of fluxlike's down layers runs unwrapped, computes through
    fluxlike's kernels (which cast at the op) in the scope's dtype, and leaves its float32
    parameters as they were."""
    import fluxlike as fl

    make, shape = DOWN_EXAMPLES[name]
    layer = make(fl)
    assert not hasattr(type(layer).__call__, "__fluxlike_plain__")
    calls = []
    for kernel in ("linear", "matmul", "conv", "conv_transpose"):
        original = getattr(kernels, kernel)
        monkeypatch.setattr(kernels, kernel, lambda *a, _k=original, _n=kernel, **kw: (
            calls.append(_n), _k(*a, **kw))[1])
    x = mx.random.normal(shape)
    with autocast(BF16):
        y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    assert calls and y.dtype == BF16, (calls, y.dtype)
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(layer.parameters()))


def test_a_fluxlike_layer_of_another_kind_declared_down_in_a_subclass_is_cast_around():
    """Only fluxlike's own "down" forwards cast at the kernels: an Embedding's or a
    LayerNorm's forward declared "down" in a user's subclass computes in the scope's dtype
    through the swapped casts, as a user's own layer does."""

    @autocast_policy("down")
    class Lookup(fl.Embedding):
        pass

    @autocast_policy("down")
    class Norm(fl.LayerNorm):
        pass

    with autocast(BF16):
        assert Lookup(10, 4)(mx.array([1, 2])).dtype == BF16
        assert Norm(4)(mx.ones((2, 4))).dtype == BF16
    assert not hasattr(fl.Dense.__call__, "__fluxlike_plain__")  # still unwrapped
