"""The native Adam update (fluxlike.native.adam_kernel): bit for bit what
``mlx.optimizers.Adam`` / ``AdamW`` compute, in float32 and bfloat16, eagerly and inside
``mx.compile``, for random shapes, layouts, hyperparameters and gradients (NaN and infinities
too), from several threads, differentiable as MLX's update is; and fluxlike's Adam/AdamW take
it for float32 and bfloat16 parameters on the CPU, with the same trained model as MLX's
update gives.

Without the companion every test here skips except the last, which checks that fluxlike's
Adam then runs MLX's update."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import in_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import fluxlike
from fluxlike import native

KERNEL = native.adam_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native Adam update is not in use: "
                                  f"{native.native_info().reason}")


def bits(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16))
    return np.array(x).view(np.uint32)


def same(a: mx.array, b: mx.array) -> bool:
    """Bit for bit (NaN payloads and the sign of zero included)."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def kernel_step(opt: optim.Adam, g: mx.array, p: mx.array, m: mx.array, v: mx.array):
    """One update through the kernel with the scalars MLX's Adam derives for ``opt``'s step
    (``opt.step`` already counts this step)."""
    lr = opt.learning_rate.astype(p.dtype)
    b1, b2 = opt.betas
    c1 = (lr / (1 - b1**opt.step)).astype(p.dtype)
    c2 = mx.rsqrt(1 - b2**opt.step).astype(p.dtype)
    decay = 1 - lr * opt.weight_decay if isinstance(opt, optim.AdamW) else None
    assert KERNEL is not None
    return KERNEL(p, g, m, v, c1, c2, decay, b1, b2, opt.eps)


def mlx_optimizer(weight_decay: float | None, lr, betas, eps) -> optim.Adam:
    if weight_decay is None:
        return optim.Adam(lr, betas=list(betas), eps=eps, bias_correction=True)
    return optim.AdamW(lr, betas=list(betas), eps=eps, weight_decay=weight_decay,
                       bias_correction=True)


def run_both(shape, steps, weight_decay, lr, betas, eps, scale, transpose, seed=0,
             dtype=mx.float32):
    """``steps`` updates of one parameter of ``dtype`` by MLX's optimiser and by the kernel;
    asserts they agree bit for bit after each."""
    key = mx.random.key(seed)
    p = mx.random.normal(shape, key=key).astype(dtype)
    opt = mlx_optimizer(weight_decay, lr, betas, eps)
    opt.init({"w": p})
    pk, mk, vk = p, mx.zeros(shape, dtype), mx.zeros(shape, dtype)
    for t in range(steps):
        g = (scale * mx.random.normal(shape[::-1] if transpose else shape,
                                      key=mx.random.key(seed + 1 + t))).astype(dtype)
        if transpose:
            g = g.T  # a strided gradient
        p = opt.apply_gradients({"w": g}, {"w": p})["w"]
        pk, mk, vk = kernel_step(opt, g, pk, mk, vk)
        mx.eval(p, pk, mk, vk, opt.state)
        state = opt.state["w"]
        assert same(pk, p), f"parameter differs after step {t + 1}"
        assert same(mk, state["m"]) and same(vk, state["v"]), f"moments differ at {t + 1}"


def first_step_both(p: mx.array, g: mx.array, weight_decay: float | None) -> mx.array:
    """A first Adam(W) step (lr 1e-2) of ``p`` with gradient ``g`` by MLX's optimiser and by
    the kernel; asserts they agree bit for bit and returns the kernel's parameter."""
    opt = mlx_optimizer(weight_decay, 1e-2, (0.9, 0.999), 1e-8)
    opt.init({"w": p})
    new = opt.apply_gradients({"w": g}, {"w": p})["w"]
    pk, mk, vk = kernel_step(opt, g, p, mx.zeros_like(p), mx.zeros_like(p))
    mx.eval(new, pk, mk, vk)
    assert same(pk, new) and same(mk, opt.state["w"]["m"]) and same(vk, opt.state["w"]["v"])
    return pk


@needs_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.one_of(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
                    st.tuples(st.integers(250, 400), st.integers(263, 300))),  # threaded
    steps=st.integers(1, 4),
    weight_decay=st.one_of(st.none(), st.floats(0.0, 0.5)),
    lr=st.floats(1e-5, 1.0),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3, 0.0]),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6]),
    transpose=st.booleans(),
    seed=st.integers(0, 1000),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
)
def test_kernel_is_mlx_adam_bit_for_bit(shape, steps, weight_decay, lr, b1, b2, eps, scale,
                                        transpose, seed, dtype):
    run_both(shape, steps, weight_decay, lr, (b1, b2), eps, scale, transpose and len(shape) == 2,
             seed, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("weight_decay", [None, 0.01])
def test_large_parameter_is_shared_out_and_still_exact(weight_decay, dtype):
    """Above 2**16 elements the pass is split over OpenMP's threads: the same bits."""
    run_both((300, 301), 3, weight_decay, 1e-3, (0.9, 0.999), 1e-8, 1.0, False, dtype=dtype)
    run_both((301, 300), 2, weight_decay, 1e-3, (0.9, 0.999), 1e-8, 1.0, True, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("weight_decay", [None, 0.01])
def test_a_parameter_past_the_caches_streams_its_results_and_is_still_exact(weight_decay):
    """From 2**17 float32 elements the results are written by non-temporal stores (a vector
    loop between scalar ends): the same bits, special values included, wherever they fall."""
    run_both((1025, 1031), 2, weight_decay, 1e-3, (0.9, 0.999), 1e-8, 1.0, False)
    run_both((512, 256), 2, weight_decay, 1e-3, (0.9, 0.999), 1e-8, 1.0, True)  # 2**17
    n = (1 << 20) + 13
    g = mx.random.normal((n,), key=mx.random.key(3))
    at = mx.array([0, 1, 2, 7, 8, 4095, 65536, n // 2, n - 9, n - 1])
    g[at] = mx.array([float("nan"), float("inf"), -float("inf"), 1e38, -0.0, 3e-45, 0.0,
                      float("nan"), -1e38, float("inf")])
    first_step_both(mx.random.normal((n,), key=mx.random.key(4)), g, weight_decay)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_non_finite_gradients_propagate_as_in_mlx(dtype):
    g = mx.array([0.0, 1.0, float("nan"), float("inf"), -float("inf"), 1e38, -0.0, 3e-45],
                 dtype)
    p = mx.array([1.0, -1.0, 2.0, 0.0, -0.0, 5.0, 0.0, 1.0], dtype)
    for weight_decay in (None, 0.1):
        pk = first_step_both(p, g, weight_decay)
        assert mx.isnan(pk[2:5]).all().item()  # NaN and ±inf gradients: NaN parameters


@needs_kernel
def test_inside_compile_and_a_schedule():
    """A compiled step (as fluxlike.update's) with a scheduled learning rate: the same bits as
    MLX's eager update, step after step."""
    schedule = optim.cosine_decay(1e-2, 10)
    ref = optim.AdamW(schedule, weight_decay=0.05, bias_correction=True)
    p0 = mx.random.normal((33, 17), key=mx.random.key(3))
    ref.init({"w": p0})
    mine = optim.AdamW(schedule, weight_decay=0.05, bias_correction=True)
    mine.init({"w": p0})
    state = [mine.state]

    def update(g, p):
        mine.state["learning_rate"] = schedule(mine.step)  # as apply_gradients: then the step
        mine.state["step"] = mine.step + 1
        s = mine.state["w"]
        new, s["m"], s["v"] = kernel_step(mine, g, p, s["m"], s["v"])
        return new

    step = mx.compile(update, inputs=state, outputs=state)
    p_ref = p_mine = p0
    for t in range(5):
        g = mx.random.normal((33, 17), key=mx.random.key(10 + t))
        p_ref = ref.apply_gradients({"w": g}, {"w": p_ref})["w"]
        p_mine = step(g, p_mine)
        mx.eval(p_ref, p_mine, ref.state, mine.state)
        assert same(p_mine, p_ref), f"step {t + 1}"
        assert same(mine.state["w"]["v"], ref.state["w"]["v"])


@needs_kernel
def test_from_several_threads():
    def work(i: int) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            run_both((70, 1000), 2, 0.01 if i % 2 else None, 1e-3, (0.9, 0.999), 1e-8, 1.0,
                     False, seed=i)

    in_threads(work, 4)


@needs_kernel
def test_differentiable_as_mlx_update():
    """The update differentiated through (as in meta-learning): the gradients with respect to
    the gradient, the parameter and the learning rate are MLX's (the kernel's derivatives are
    those of the same formula in MLX's ops), and forward-mode agrees too."""
    p = mx.random.normal((4, 5), key=mx.random.key(0))
    g = mx.random.normal((4, 5), key=mx.random.key(1))
    m = 0.1 * mx.random.normal((4, 5), key=mx.random.key(2))
    v = mx.abs(mx.random.normal((4, 5), key=mx.random.key(3)))
    c2 = mx.array(1.3)

    def through_kernel(g, p, c1):
        new, m2, v2 = KERNEL(p, g, m, v, c1, c2, mx.array(0.99), 0.9, 0.999, 1e-8)
        return (new * new).sum() + m2.sum() + (v2 * v2).sum()

    def through_mlx(g, p, c1):
        p = p * mx.array(0.99)
        m2 = 0.9 * m + (1 - 0.9) * g
        v2 = 0.999 * v + (1 - 0.999) * mx.square(g)
        new = p - (c1 * m2) / (mx.sqrt(v2) * c2 + 1e-8)
        return (new * new).sum() + m2.sum() + (v2 * v2).sum()

    c1 = mx.array(0.01)
    mine = mx.grad(through_kernel, argnums=(0, 1, 2))(g, p, c1)
    ref = mx.grad(through_mlx, argnums=(0, 1, 2))(g, p, c1)
    for a, b in zip(mine, ref, strict=True):
        assert mx.allclose(a, b, rtol=1e-6, atol=1e-7).item()
    tangent = mx.random.normal((4, 5), key=mx.random.key(4))
    jk = mx.jvp(lambda g: KERNEL(p, g, m, v, c1, c2, None, 0.9, 0.999, 1e-8)[0], [g], [tangent])
    jm = mx.jvp(lambda g: p - (c1 * (0.9 * m + (1 - 0.9) * g))
                / (mx.sqrt(0.999 * v + (1 - 0.999) * mx.square(g)) * c2 + 1e-8),
                [g], [tangent])
    assert mx.allclose(jk[1][0], jm[1][0], rtol=1e-6, atol=1e-7).item()


@needs_kernel
@pytest.mark.parametrize("bad, message", [
    (dict(g=mx.zeros((3, 2))), r"the gradient has shape \(3, 2\), the parameter \(2, 3\)"),
    (dict(m=mx.zeros((2, 3), mx.bfloat16)),
     "expected m of the parameter's dtype float32, got bfloat16"),
    (dict(p=mx.zeros((2, 3), mx.float16)),
     "expected a float32 or bfloat16 parameter, got float16; use mlx.optimizers.Adam"),
    (dict(c1=mx.zeros((1,))), r"expected c1 to be a 0-d float32 array .*, got float32 of "
                              r"shape \(1,\); use mlx.optimizers.Adam"),
    (dict(c2=mx.array(1.0, mx.bfloat16)), "expected c2 to be a 0-d float32 array"),
])
def test_bad_operands_are_refused_when_the_graph_is_built(bad, message):
    args = dict(p=mx.zeros((2, 3)), g=mx.zeros((2, 3)), m=mx.zeros((2, 3)), v=mx.zeros((2, 3)),
                c1=mx.array(1.0), c2=mx.array(1.0))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        KERNEL(args["p"], args["g"], args["m"], args["v"], args["c1"], args["c2"], None, 0.9,
               0.999, 1e-8)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_vmap_over_the_update_is_mlx_update(dtype):
    """mx.vmap over an ensemble's update (fluxlike's Adam takes the kernel inside): MLX's bits;
    and over the kernel with one learning rate per member (the formula in MLX's ops)."""
    from fluxlike.optimisers.rules import _AdamW

    p = mx.random.normal((5, 3, 4), key=mx.random.key(0)).astype(dtype)
    g = mx.random.normal((3, 4, 5), key=mx.random.key(1)).astype(dtype)  # mapped on axis 2

    def stepped(opt):
        opt.init({"w": p[0]})
        opt.state["step"] = opt.step + 1
        return mx.vmap(lambda p, g: opt.apply_single(g, p, {"m": mx.zeros_like(p),
                                                            "v": mx.zeros_like(p)}),
                       in_axes=(0, 2))(p, g)

    mine = stepped(_AdamW(1e-2, weight_decay=0.1, bias_correction=True))
    ref = stepped(optim.AdamW(1e-2, weight_decay=0.1, bias_correction=True))
    assert same(mine, ref)

    c1 = mx.array([0.1, 0.01, 0.001, 0.2, 0.3]).astype(dtype)
    one = mx.array(1.0, dtype)
    zeros = mx.zeros((5, 3, 4), dtype)
    kern = mx.vmap(lambda c1, p: KERNEL(p, g[..., 0], zeros[0], zeros[0], c1, one, None, 0.9,
                                        0.999, 1e-8), in_axes=(0, 0))(c1, p)
    for i in range(5):
        want = KERNEL(p[i], g[..., 0], zeros[0], zeros[0], c1[i], one, None, 0.9, 0.999, 1e-8)
        for a, b in zip(kern, want, strict=True):
            assert mx.allclose(a[i], b, rtol=1e-6, atol=0).item()


@needs_kernel
def test_edge_parameters_through_fluxlike_adam(monkeypatch):
    """0-d and empty parameters, a broadcast gradient, mixed dtypes (MLX's update), a
    learning rate that is not one number (MLX's update): all as stock mlx.optimizers.Adam."""
    from fluxlike.optimisers.rules import _Adam

    cases = [
        (mx.array(1.5), mx.array(0.25)),  # 0-d
        (mx.zeros((0, 3)), mx.zeros((0, 3))),  # empty
        (mx.ones((4, 3)), mx.broadcast_to(mx.array([0.1, -0.2, 0.3]), (4, 3))),  # broadcast g
        (mx.ones((4, 3), mx.bfloat16), mx.full((4, 3), 0.1)),  # bf16 p, f32 g: MLX's
    ]
    for p, g in cases:
        mine, ref = _Adam(1e-2, bias_correction=True), optim.Adam(1e-2, bias_correction=True)
        a, b = p, p
        for _ in range(3):
            a = mine.apply_gradients({"w": g}, {"w": a})["w"]
            b = ref.apply_gradients({"w": g}, {"w": b})["w"]
        mx.eval(a, b, mine.state, ref.state)
        assert same(a, b) and same(mine.state["w"]["v"], ref.state["w"]["v"]), (p.shape, p.dtype)
    calls = counting_kernel(monkeypatch)
    mine = _Adam(mx.full((1,), 1e-2), bias_correction=True)  # a learning rate of shape (1,)
    ref = optim.Adam(mx.full((1,), 1e-2), bias_correction=True)
    p, g = mx.ones((2, 3)), mx.full((2, 3), 0.5)
    a = mine.apply_gradients({"w": g}, {"w": p})["w"]
    b = ref.apply_gradients({"w": g}, {"w": p})["w"]
    assert calls[0] == 0 and same(a, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("decay", [None, 0.99])
def test_keep_gives_the_state_back_when_false_and_the_step_when_true(dtype, decay):
    """keep: a skipped step's parameter and moments are its inputs bit for bit (NaN included),
    a kept one the plain kernel's; derivatives and vmap with a flag per member as mx.where of
    the two."""
    p, g, m, v = (mx.random.normal((7, 5), key=mx.random.key(i)).astype(dtype)
                  for i in range(4))
    p[0, 0], v = float("nan"), mx.abs(v)
    c1, c2 = mx.array(0.1, dtype), mx.array(1.5, dtype)
    d = None if decay is None else mx.array(decay, dtype)
    plain = KERNEL(p, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8)
    taken = KERNEL(p, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8, keep=mx.array(True))
    skipped = KERNEL(p, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8, keep=mx.array(False))
    for a, b in zip(taken, plain, strict=True):
        assert same(a, b)
    for a, b in zip(skipped, (p, m, v), strict=True):
        assert same(a, b)
    flags = mx.array([True, False, True])
    ps = mx.stack([p, p * 2, p * 3])
    batched = mx.vmap(lambda f, p: KERNEL(p, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8, keep=f))(
        flags, ps)
    for i, f in enumerate(flags.tolist()):
        one = KERNEL(ps[i], g, m, v, c1, c2, d, 0.9, 0.999, 1e-8)
        want = one if f else (ps[i], m, v)
        for a, b in zip(batched, want, strict=True):
            assert mx.allclose(a[i], b, rtol=1e-6, atol=0, equal_nan=True).item()
    q = mx.abs(p) + 1  # (finite, for the derivatives)
    for f in (True, False):
        grad = mx.grad(lambda q: KERNEL(q, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8,
                                        keep=mx.array(f))[0].astype(mx.float32).sum())(q)  # noqa: B023
        want = mx.grad(lambda q: KERNEL(q, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8)[0]
                       .astype(mx.float32).sum())(q) if f else mx.ones_like(q)
        assert mx.allclose(grad, want).item()
    with pytest.raises(ValueError, match="keep must be a 0-d bool array"):
        KERNEL(p, g, m, v, c1, c2, d, 0.9, 0.999, 1e-8, keep=mx.array(1.0))


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_loss_scaled_steps_keep_the_kernel_and_skip_non_finite_ones(dtype, monkeypatch):
    """With a dynamic loss scale, update wraps the kernel's results in mx.where: a step whose
    gradients are not finite changes nothing, the others match MLX's update bit for bit."""
    def run(kernel_on: bool):
        if not kernel_on:
            monkeypatch.setattr(native, "adam_kernel", lambda: None)
        mx.random.seed(0)
        model = fluxlike.Chain(fluxlike.Dense(4, 3))
        model.set_dtype(dtype)
        state = fluxlike.setup(fluxlike.Adam(1e-2), model,
                               loss_scale=fluxlike.DynamicLossScale(2.0**4))
        seen = []
        for t in range(4):
            g = {"layers": [{"weight": mx.full((3, 4), 0.5 * (t + 1), dtype),
                             "bias": mx.full((3,), float("inf") if t == 1 else 0.1, dtype)}]}
            fluxlike.update(state, model, g)
            mx.eval(model.parameters(), state.optimizer.state)
            seen.append(dict(tree_flatten(model.parameters())))
        monkeypatch.undo()
        return seen

    calls = counting_kernel(monkeypatch)
    mine = run(True)
    assert calls[0] >= 2
    ref = run(False)
    for t, (a, b) in enumerate(zip(mine, ref, strict=True)):
        for name in a:
            assert same(a[name], b[name]), (t, name)
    assert all(same(mine[1][k], mine[0][k]) for k in mine[0])  # the inf step changed nothing


def train(rule, steps: int = 4, dtype=mx.float32):
    """A small MLP trained ``steps`` steps with ``fluxlike.update``; its parameters."""
    mx.random.seed(0)
    model = fluxlike.Chain(fluxlike.Dense(6, 16, fluxlike.relu), fluxlike.Dense(16, 3))
    if dtype != mx.float32:
        model.set_dtype(dtype)
    state = fluxlike.setup(rule, model)
    x = mx.random.normal((8, 6), key=mx.random.key(1)).astype(dtype)
    y = mx.eye(3)[mx.arange(8) % 3]
    for _ in range(steps):
        grads = fluxlike.gradient(
            lambda m: fluxlike.losses.logitcrossentropy(m(x).astype(mx.float32), y), model)[0]
        fluxlike.update(state, model, grads)
        mx.eval(model.parameters(), state.optimizer.state)
    return dict(tree_flatten(model.parameters()))


def counting_kernel(monkeypatch) -> list[int]:
    calls = [0]
    kernel = native.adam_kernel()

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(native, "adam_kernel",
                        lambda: counted if kernel is not None and native.available() else None)
    return calls


@needs_kernel
@pytest.mark.parametrize("rule", [
    fluxlike.Adam(1e-2), fluxlike.AdamW(1e-2, weight_decay=0.1),
    fluxlike.OptimiserChain(fluxlike.ClipNorm(0.5), fluxlike.Adam(optim.cosine_decay(1e-2, 5))),
], ids=["Adam", "AdamW", "chain-schedule"])
def test_fluxlike_adam_takes_the_kernel_and_trains_as_mlx_update(rule, monkeypatch):
    """The same model trained with the kernel and with MLX's update (the layers' kernels the
    same in both: only the update differs), bit for bit."""
    calls = counting_kernel(monkeypatch)
    mine = train(rule)
    assert calls[0] >= 4  # the four parameters, traced once (update compiles the step)
    monkeypatch.setattr(native, "adam_kernel", lambda: None)
    ref = train(rule)
    assert mine.keys() == ref.keys()
    for name in mine:
        assert same(mine[name], ref[name]), name


@needs_kernel
@pytest.mark.parametrize("rule", [fluxlike.Adam(1e-2), fluxlike.AdamW(1e-2, weight_decay=0.1)],
                         ids=["Adam", "AdamW"])
def test_bfloat16_parameters_take_the_kernel_in_bfloat16(rule, monkeypatch):
    """A bfloat16 model (bf16mix) is updated by the kernel in bfloat16, with the bits of MLX's
    bfloat16 update (the same model trained with the kernel switched off)."""
    calls = counting_kernel(monkeypatch)
    mine = train(rule, steps=3, dtype=mx.bfloat16)
    assert calls[0] >= 4
    monkeypatch.setattr(native, "adam_kernel", lambda: None)
    ref = train(rule, steps=3, dtype=mx.bfloat16)
    for name in mine:
        assert mine[name].dtype == mx.bfloat16 and same(mine[name], ref[name]), name


@needs_kernel
def test_float16_parameters_keep_mlx_update(monkeypatch):
    calls = counting_kernel(monkeypatch)
    params = train(fluxlike.Adam(1e-2), steps=2, dtype=mx.float16)
    assert calls[0] == 0
    assert all(p.dtype == mx.float16 and mx.isfinite(p).all().item() for p in params.values())


def test_without_the_kernel_adam_is_mlx_update():
    """Where the companion is absent (or switched off) fluxlike's Adam is MLX's: the same
    training, bit for bit, as a stock mlx.optimizers.Adam with bias correction."""

    def stock():
        mx.random.seed(0)
        model = fluxlike.Chain(fluxlike.Dense(6, 16, fluxlike.relu), fluxlike.Dense(16, 3))
        opt = optim.Adam(1e-2, bias_correction=True)
        x = mx.random.normal((8, 6), key=mx.random.key(1))
        y = mx.eye(3)[mx.arange(8) % 3]
        for _ in range(4):
            grads = fluxlike.gradient(
                lambda m: fluxlike.losses.logitcrossentropy(m(x), y), model)[0]
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
        return dict(tree_flatten(model.parameters()))

    with native.disabled():
        mine, ref = train(fluxlike.Adam(1e-2)), stock()
    for name in mine:
        assert same(mine[name], ref[name]), name


# ---- RMSprop ---------------------------------------------------------------------------

RMSPROP = native.rmsprop_kernel()


def rmsprop_both(shape, steps, lr, alpha, eps, scale, transpose, seed, dtype):
    """``steps`` RMSprop updates by MLX's optimiser and by the kernel, bit for bit."""
    p = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    opt = optim.RMSprop(lr, alpha=alpha, eps=eps)
    opt.init({"w": p})
    pk, vk = p, mx.zeros(shape, dtype)
    for t in range(steps):
        g = (scale * mx.random.normal(shape[::-1] if transpose else shape,
                                      key=mx.random.key(seed + 1 + t))).astype(dtype)
        if transpose:
            g = g.T
        p = opt.apply_gradients({"w": g}, {"w": p})["w"]
        assert RMSPROP is not None
        pk, vk = RMSPROP(pk, g, vk, opt.learning_rate.astype(dtype), alpha, eps)
        mx.eval(p, pk, vk, opt.state)
        assert same(pk, p) and same(vk, opt.state["w"]["v"]), f"step {t + 1}"


@needs_kernel
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.one_of(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
                    st.tuples(st.integers(250, 400), st.integers(263, 300))),
    steps=st.integers(1, 3),
    lr=st.floats(1e-5, 1.0),
    alpha=st.floats(0.0, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3, 1e-30]),  # MLX's RMSprop refuses eps = 0
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6]),
    transpose=st.booleans(),
    seed=st.integers(0, 1000),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
)
def test_rmsprop_kernel_is_mlx_rmsprop_bit_for_bit(shape, steps, lr, alpha, eps, scale,
                                                    transpose, seed, dtype):
    rmsprop_both(shape, steps, lr, alpha, eps, scale, transpose and len(shape) == 2, seed, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_rmsprop_non_finite_and_vmap(dtype):
    g = mx.array([0.0, 1.0, float("nan"), float("inf"), -float("inf"), -0.0], dtype)
    p = mx.array([1.0, -1.0, 2.0, 0.0, -0.0, 0.0], dtype)
    opt = optim.RMSprop(1e-2)
    opt.init({"w": p})
    new = opt.apply_gradients({"w": g}, {"w": p})["w"]
    pk, vk = RMSPROP(p, g, mx.zeros_like(p), mx.array(1e-2, dtype), 0.99, 1e-8)
    assert same(pk, new) and same(vk, opt.state["w"]["v"])

    ps = mx.random.normal((4, 3, 5), key=mx.random.key(2)).astype(dtype)
    gs = mx.random.normal((4, 3, 5), key=mx.random.key(3)).astype(dtype)
    lr = mx.array(1e-2, dtype)
    batched = mx.vmap(lambda p, g: RMSPROP(p, g, mx.zeros_like(p), lr, 0.99, 1e-8))(ps, gs)
    for i in range(4):
        one = RMSPROP(ps[i], gs[i], mx.zeros_like(ps[i]), lr, 0.99, 1e-8)
        assert same(batched[0][i], one[0]) and same(batched[1][i], one[1])
    with pytest.raises(ValueError, match="rmsprop_step: expected lr to be a 0-d"):
        RMSPROP(p, g, mx.zeros_like(p), mx.ones((1,), dtype), 0.99, 1e-8)


@needs_kernel
def test_fluxlike_rmsprop_takes_the_kernel_and_trains_as_mlx_update(monkeypatch):
    calls = [0]
    kernel = native.rmsprop_kernel()

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(native, "rmsprop_kernel", lambda: counted)
    mine = train(fluxlike.RMSProp(1e-2))
    assert calls[0] >= 4
    monkeypatch.setattr(native, "rmsprop_kernel", lambda: None)
    ref = train(fluxlike.RMSProp(1e-2))
    for name in mine:
        assert same(mine[name], ref[name]), name


@needs_kernel
def test_update_traced_inside_disabled_takes_the_kernel_again_outside(monkeypatch):
    """fluxlike.update keys its compiled steps by the switch: a step first traced inside
    native.disabled() (MLX's update) is traced again outside it, with the kernel."""
    calls = counting_kernel(monkeypatch)
    mx.random.seed(0)
    model = fluxlike.Chain(fluxlike.Dense(4, 3))
    state = fluxlike.setup(fluxlike.Adam(1e-2), model)
    g = {"layers": [{"weight": mx.full((3, 4), 0.5), "bias": mx.full((3,), 0.1)}]}
    with native.disabled():
        fluxlike.update(state, model, g)
    assert calls[0] == 0
    fluxlike.update(state, model, g)
    mx.eval(model.parameters())
    assert calls[0] == 2
