"""The autocast scope (fluxlike/precision/scope.py) against its specification: dtype and device
arguments, per-device state, context manager and decorator forms, restoring on exit and on
exception, re-entry, enabled=False, per-thread and per-task state, and a state machine."""

import asyncio
import contextvars
import threading

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx.utils import tree_flatten

from fluxlike import Chain, Conv, Dense, Dropout, autocast, flatten, gradient, relu, trainmode
from fluxlike import compile as fl_compile
from fluxlike.precision.scope import _entries
from fluxlike.precision.state import PLAIN, context

F16, BF16 = mx.float16, mx.bfloat16


def same(a, b) -> bool:
    """Equality of optional dtypes (``mx.Dtype == None`` is a TypeError in MLX)."""
    return a is b if a is None or b is None else a == b


def state() -> tuple:
    return autocast.get_dtype("cpu"), autocast.get_dtype("gpu")


def assert_state(cpu, gpu) -> None:
    got = state()
    assert same(got[0], cpu) and same(got[1], gpu), f"expected ({cpu}, {gpu}), got {got}"
    assert autocast.is_enabled("cpu") == (cpu is not None)
    assert autocast.is_enabled("gpu") == (gpu is not None)
    if cpu is None and gpu is None:
        assert context.get() is PLAIN  # the layers' fast path is an identity test


@pytest.fixture(autouse=True)
def _starts_and_ends_off():
    assert_state(None, None)
    yield
    left = state()
    context.set(PLAIN)  # a failing test must not leak its scopes into the next ones
    _entries.set(())
    assert left == (None, None), f"a test left autocast on: {left}"


class TestArguments:
    @pytest.mark.parametrize("dtype, expected", [(None, BF16), (F16, F16), (BF16, BF16)])
    def test_dtype(self, dtype, expected):
        with autocast(dtype, device="cpu") as scope:
            assert same(autocast.get_dtype("cpu"), expected)
        assert same(scope.dtype, expected)

    @pytest.mark.parametrize("bad", [mx.float32, mx.float64, mx.int8, "float16", np.float16, 16])
    def test_bad_dtype_names_the_allowed_ones(self, bad):
        with pytest.raises(ValueError, match=r"mx\.float16 or mx\.bfloat16"):
            autocast(bad)

    @pytest.mark.parametrize("full", [mx.float32, mx.float64])
    def test_full_precision_dtype_says_how_to_compute_in_float32(self, full):
        with pytest.raises(ValueError, match=r"; to compute in float32, leave the scope or use "
                                             r"autocast\(enabled=False\)$"):
            autocast(full)
        with pytest.raises(ValueError, match=r"got mlx.core.int8$"):
            autocast(mx.int8)

    @pytest.mark.parametrize(
        "device, slot",
        [("cpu", 0), ("gpu", 1), (mx.cpu, 0), (mx.gpu, 1), (mx.Device(mx.cpu), 0),
         (mx.Device(mx.gpu), 1), (None, 0)],  # None: the default device, the CPU here
    )
    def test_device(self, device, slot):
        with autocast(F16, device=device):
            expected = [None, None]
            expected[slot] = F16
            assert_state(*expected)
            assert autocast.is_enabled(device) and same(autocast.get_dtype(device), F16)

    @pytest.mark.parametrize("bad", ["metal", "cuda", "", 0, 1, True, object()])
    def test_bad_device(self, bad):
        with pytest.raises(ValueError, match=r"'cpu', 'gpu', mx\.cpu, mx\.gpu or an mx\.Device"):
            autocast(F16, device=bad)
        with pytest.raises(ValueError, match="device must be"):
            autocast.get_dtype(bad)
        with pytest.raises(ValueError, match="device must be"):
            autocast.is_enabled(bad)

    def test_enabled_must_be_a_bool(self):
        with pytest.raises(TypeError, match="enabled must be a bool"):
            autocast(enabled=1)

    def test_device_none_is_resolved_when_entered(self, monkeypatch):
        scope = autocast(F16)  # made while the CPU is the default device
        monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
        with scope:
            assert_state(None, F16)
            assert same(autocast.get_dtype(), F16)  # queries follow the default device too
        monkeypatch.undo()
        with scope:
            assert_state(F16, None)

    def test_queries_are_static(self):
        scope = autocast(F16, device="gpu")
        with scope:
            assert scope.is_enabled("gpu") and not scope.is_enabled()
            assert same(scope.get_dtype("gpu"), F16) and scope.get_dtype() is None


class TestScope:
    def test_context_manager_returns_itself(self):
        scope = autocast(F16, device="cpu")
        with scope as entered:
            assert entered is scope

    def test_nested_scopes_restore_the_outer_dtype(self):
        layer = Dense(2, 2)
        x = mx.ones((1, 2))
        seen = []
        with autocast(F16, device="cpu"):
            seen.append(layer(x).dtype)
            with autocast(BF16, device="cpu"):
                seen.append(layer(x).dtype)
            seen.append(layer(x).dtype)
        seen.append(layer(x).dtype)
        assert seen == [F16, BF16, F16, mx.float32]

    def test_never_touches_the_other_device(self):
        with autocast(BF16, device="gpu"):
            with autocast(F16, device="cpu"):
                assert_state(F16, BF16)
                with autocast(device="cpu", enabled=False):
                    assert_state(None, BF16)
                assert_state(F16, BF16)
            assert_state(None, BF16)
            with autocast(F16, device="gpu", enabled=False):
                assert_state(None, None)
            assert_state(None, BF16)

    def test_enabled_false_switches_off_inside(self):
        layer = Dense(2, 2)
        with autocast(F16, device="cpu"):
            with autocast(F16, device="cpu", enabled=False) as off:
                assert not autocast.is_enabled("cpu")
                assert layer(mx.ones((1, 2))).dtype == mx.float32
            assert same(autocast.get_dtype("cpu"), F16)
        with off:  # disabling when already off changes nothing
            assert_state(None, None)

    def test_exception_restores_and_propagates(self):
        with autocast(F16, device="gpu"):
            with pytest.raises(KeyError):
                with autocast(BF16, device="gpu"):
                    raise KeyError("inside")
            assert_state(None, F16)

    def test_state_restored_while_the_object_lives_on(self):
        scope = autocast(F16, device="cpu")
        with scope:
            pass
        assert_state(None, None)  # `scope` is still referenced: exit, not collection, ends it
        assert scope.dtype == F16

    def test_reenter_after_exit(self):
        scope = autocast(BF16, device="cpu")
        for _ in range(3):
            with scope:
                assert_state(BF16, None)
            assert_state(None, None)

    def test_enter_while_active_each_exit_undoes_its_own_entry(self):
        scope = autocast(F16, device="cpu")
        with scope:
            with autocast(BF16, device="cpu"):
                with scope:
                    assert_state(F16, None)
                assert_state(BF16, None)  # the inner entry of `scope` restored BF16
            assert_state(F16, None)
        assert_state(None, None)

    def test_out_of_order_exit_of_a_generator_scope(self):
        # contextvars are not per-generator: a scope held open by a suspended generator is
        # exited later, from inside another scope. Each exit undoes only its own device.
        def gen():
            with autocast(BF16, device="gpu"):
                yield
                yield

        g = gen()
        next(g)
        assert_state(None, BF16)
        with autocast(F16, device="cpu"):
            g.close()
            assert_state(F16, None)
        assert_state(None, None)

    def test_out_of_order_exit_on_one_device(self):
        a, b = autocast(F16, device="cpu"), autocast(BF16, device="cpu")
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)  # b is still in force...
        assert_state(BF16, None)
        b.__exit__(None, None, None)  # ...and restores what a was entered from
        assert_state(None, None)

    def test_exit_without_entry_is_an_error(self):
        scope = autocast(F16)
        with pytest.raises(RuntimeError, match="not entered"):
            scope.__exit__(None, None, None)
        with scope:
            pass
        with pytest.raises(RuntimeError, match="not entered"):
            scope.__exit__(None, None, None)


class TestDecorator:
    def test_each_call_runs_in_the_scope_and_leaves_it(self):
        layer = Dense(3, 2)

        @autocast(F16, device="cpu")
        def predict(x):
            assert_state(F16, None)
            return layer(x)

        assert predict(mx.ones((1, 3))).dtype == F16
        assert_state(None, None)
        assert predict.__name__ == "predict"

    def test_left_on_exception(self):
        @autocast(BF16, device="gpu")
        def boom():
            assert_state(None, BF16)
            raise ValueError("boom")

        with autocast(F16, device="gpu"):
            with pytest.raises(ValueError, match="boom"):
                boom()
            assert_state(None, F16)

    def test_recursive_calls_nest(self):
        depths = []

        @autocast(F16, device="cpu")
        def down(n):
            depths.append(autocast.get_dtype("cpu"))
            if n:
                with autocast(device="cpu", enabled=False):
                    down(n - 1)
                    assert_state(None, None)  # the nested call left its own entry
                assert_state(F16, None)

        down(3)
        assert all(same(d, F16) for d in depths) and len(depths) == 4

    def test_decorating_a_coroutine_function(self):
        @autocast(F16, device="cpu")
        async def step():
            await asyncio.sleep(0)
            return autocast.get_dtype("cpu")

        assert same(asyncio.run(step()), F16)

    def test_a_coroutine_awaited_inside_another_scope_runs_in_its_own(self):
        @autocast(F16, device="cpu")
        async def inner():
            await asyncio.sleep(0)
            return autocast.get_dtype("cpu")

        async def outer():
            coroutine = inner()  # created here, run when awaited: in inner's scope all the same
            with autocast(BF16, device="cpu"):
                got = await coroutine
                return got, autocast.get_dtype("cpu")

        got, after = asyncio.run(outer())
        assert same(got, F16) and same(after, BF16)

    def test_generator_functions_are_refused(self):
        def numbers():
            yield autocast.get_dtype("cpu")

        async def async_numbers():
            yield autocast.get_dtype("cpu")

        for fn, kind in ((numbers, "a generator"), (async_numbers, "an async generator")):
            with pytest.raises(TypeError, match=rf"^autocast: cannot decorate {kind} function "
                               rf"\({fn.__name__}\): .*use `with autocast\(...\)` inside"):
                autocast(F16, device="cpu")(fn)
        assert_state(None, None)

    def test_classes_are_refused(self):
        with pytest.raises(TypeError, match=r"^autocast: cannot decorate a class \(Dense\); "
                           r"decorate its methods"):
            autocast(F16)(Dense)
        assert isinstance(Dense(2, 1), Dense)  # the class is untouched

    def test_not_a_callable(self):
        with pytest.raises(TypeError, match="can only decorate a callable"):
            autocast(F16)(3)


class TestIsolation:
    def test_new_thread_starts_off(self):
        seen = []
        with autocast(F16, device="cpu"):
            t = threading.Thread(target=lambda: seen.append(state()))
            t.start()
            t.join()
        assert seen == [(None, None)]

    def test_a_threads_scope_is_invisible_to_others(self):
        barrier = threading.Barrier(2, timeout=10)
        seen: dict[str, list] = {"a": [], "b": []}
        layer = Dense(2, 2)
        x = mx.ones((1, 2))

        def worker(name, dtype):
            try:
                with autocast(dtype, device="cpu"):
                    barrier.wait()  # both scopes are open now
                    seen[name].append((autocast.get_dtype("cpu"), layer(x).dtype))
                    barrier.wait()
                barrier.wait()  # one has left, the other may not have
                seen[name].append((autocast.get_dtype("cpu"), layer(x).dtype))
            finally:
                mx.clear_streams()  # MLX's rule for threads that used it

        threads = [threading.Thread(target=worker, args=("a", F16)),
                   threading.Thread(target=worker, args=("b", BF16))]
        with autocast(BF16, device="gpu"):
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert_state(None, BF16)
        assert seen["a"] == [(F16, F16), (None, mx.float32)]
        assert seen["b"] == [(BF16, BF16), (None, mx.float32)]

    def test_asyncio_tasks_interleave_with_their_own_scopes(self):
        layer = Dense(2, 2)
        x = mx.ones((1, 2))
        log = []

        async def worker(name, dtype):
            assert_state(None, F16)  # a copy of the creating context
            with autocast(dtype, device="cpu"):
                for _ in range(3):
                    log.append((name, autocast.get_dtype("cpu"), layer(x).dtype))
                    await asyncio.sleep(0)  # the other task runs, inside its own scope
                    log.append((name, autocast.get_dtype("cpu"), layer(x).dtype))
            return autocast.get_dtype("cpu")

        async def main():
            with autocast(F16, device="gpu"):
                results = await asyncio.gather(worker("a", F16), worker("b", BF16))
                assert_state(None, F16)  # the tasks' scopes never leak back
            return results

        assert asyncio.run(main()) == [None, None]
        names = [entry[0] for entry in log]
        assert names[:3] == ["a", "b", "a"] and len(log) == 12  # the tasks really interleaved
        for name, dtype, out in log:
            expected = F16 if name == "a" else BF16
            assert dtype == expected and out == expected

    def test_context_copies_are_independent(self):
        ctx = contextvars.copy_context()
        with autocast(F16, device="cpu"):
            assert ctx.run(state) == (None, None)
            inner = contextvars.copy_context()
        assert inner.run(autocast.get_dtype, "cpu") == F16


class TestCompile:
    def test_compile_refuses_what_is_not_a_function_or_a_flag(self):
        with pytest.raises(TypeError, match=r"fluxlike.compile: shapeless must be True or "
                                            r"False, got 'no'"):
            fl_compile(lambda x: x, shapeless="no")
        with pytest.raises(TypeError, match=r"fluxlike.compile: fn must be a function, got int"):
            fl_compile(3)

    def test_one_trace_per_autocast_state(self):
        layer = Dense(3, 2)
        forward = fl_compile(lambda x: layer(x))
        x = mx.ones((2, 3))
        order = [None, F16, None, BF16, F16, None]
        dtypes = []
        for dtype in order:
            if dtype is None:
                dtypes.append(forward(x).dtype)
            else:
                with autocast(dtype, device="cpu"):
                    dtypes.append(forward(x).dtype)
        assert dtypes == [mx.float32, F16, mx.float32, BF16, F16, mx.float32]
        with autocast(F16, device="gpu"):  # not this device's scope: the float32 trace
            assert forward(x).dtype == mx.float32

    def test_fixing_the_mode_traces_again(self):
        model = Chain(Dense(4, 64), Dropout(0.5))
        forward = fl_compile(lambda x: model(x), inputs=model.state)
        x = mx.ones((8, 4))

        def drops() -> bool:
            return (forward(x) == 0).sum().item() > 0

        assert not drops()  # automatic: test mode outside gradient
        for switch, expected in ((lambda: trainmode(model), True),
                                 (lambda: trainmode(model, False), False),
                                 (model.train, True), (model.eval, False),
                                 (lambda: trainmode(model, "auto"), False)):
            switch()
            assert drops() is expected

    def test_shapeless_trace_of_conv_flatten_dense(self):
        mx.random.seed(0)
        model = Chain(Conv((3, 3), 1, 4, relu, padding=1), flatten, Dense(4 * 5 * 5, 3))
        mx.eval(model.parameters())
        forward = fl_compile(lambda x: model(x), inputs=model.state, shapeless=True)
        for rows in (6, 9, 2):
            x = mx.random.normal((rows, 5, 5, 1))
            np.testing.assert_allclose(np.array(forward(x)), np.array(model(x)), rtol=1e-5,
                                       atol=1e-6)

    @pytest.mark.parametrize("dtype", [None, BF16, F16])
    def test_shapeless_trace_replays_at_other_batch_sizes(self, dtype):
        # custom gradients cannot be traced shapeless, and MLX's shapeless addmm crashed on
        # a smaller batch: fluxlike traces plain ops there, with the same values
        mx.random.seed(0)
        model = Chain(Dense(16, 64, relu), Dense(64, 8))
        mx.eval(model.parameters())

        def grad(x):
            return gradient(lambda m: (m(x) ** 2).mean(), model)[0]

        forward = fl_compile(lambda x: model(x), shapeless=True)
        compiled_grad = fl_compile(grad, shapeless=True)
        with autocast(dtype, device="cpu", enabled=dtype is not None):
            for rows in (200, 300, 100, 5):
                x = mx.random.normal((rows, 16))
                assert mx.array_equal(forward(x), model(x)).item()
                fast, slow = compiled_grad(x), grad(x)
                for (key, a), (_, b) in zip(tree_flatten(fast), tree_flatten(slow), strict=True):
                    assert a.dtype == b.dtype == mx.float32
                    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5,
                                               err_msg=key)


# --- state machine ------------------------------------------------------------------------

DEVICES = [None, "cpu", "gpu", mx.cpu, mx.gpu, mx.Device(mx.cpu), mx.Device(mx.gpu)]
GPU_DEVICES = ("gpu", mx.gpu)


def slot_of(device) -> int:
    if isinstance(device, mx.Device):
        return 1 if device.type == mx.gpu else 0
    return 1 if any(device is d for d in GPU_DEVICES) else 0  # None: the default, the CPU


class ScopeMachine(RuleBasedStateMachine):
    """Random scopes entered, exited, nested, re-entered, used as decorators and around
    exceptions, checked after every step against a model: a device's dtype is the setting of
    its latest live entry (its dtype, or None if disabled), or None when it has none."""

    def __init__(self):
        super().__init__()
        self.scopes: list[tuple[autocast, int, object]] = []  # (scope, slot, setting)
        self.live: list[tuple[autocast, int, object]] = []  # live entries, oldest first

    def expected(self) -> tuple:
        out = [None, None]
        for _, slot, setting in self.live:
            out[slot] = setting
        return tuple(out)

    @rule(dtype=st.sampled_from([None, F16, BF16]), device=st.sampled_from(DEVICES),
          enabled=st.booleans())
    def create(self, dtype, device, enabled):
        scope = autocast(dtype, device=device, enabled=enabled)
        setting = (BF16 if dtype is None else dtype) if enabled else None
        self.scopes.append((scope, slot_of(device), setting))

    @precondition(lambda self: self.scopes)
    @rule(data=st.data())
    def enter(self, data):
        entry = data.draw(st.sampled_from(self.scopes))  # may be live already: re-entry
        assert entry[0].__enter__() is entry[0]
        self.live.append(entry)

    @precondition(lambda self: self.live)
    @rule()
    def exit_innermost(self):
        scope = self.live.pop()[0]
        assert scope.__exit__(None, None, None) is None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def exit_out_of_order(self, data):
        k = data.draw(st.integers(0, len(self.live) - 1))
        scope = self.live[k][0]
        scope.__exit__(None, None, None)  # undoes this scope's latest entry
        last = max(i for i, e in enumerate(self.live) if e[0] is scope)
        del self.live[last]

    @precondition(lambda self: self.scopes)
    @rule(data=st.data(), raises=st.booleans())
    def with_block(self, data, raises):
        entry = data.draw(st.sampled_from(self.scopes))
        before = self.expected()
        try:
            with entry[0]:
                self.live.append(entry)
                self.check()
                self.live.pop()
                if raises:
                    raise ArithmeticError
        except ArithmeticError:
            assert raises
        self.check_equals(before)

    @precondition(lambda self: self.scopes)
    @rule(data=st.data(), raises=st.booleans())
    def decorated_call(self, data, raises):
        outer = data.draw(st.sampled_from(self.scopes))
        inner = data.draw(st.sampled_from(self.scopes))
        before = self.expected()

        @outer[0]
        def fn():
            self.live.append(outer)
            try:
                self.check()
                with inner[0]:  # a nested scope inside the decorated call
                    self.live.append(inner)
                    self.check()
                    self.live.pop()
                self.check()
            finally:
                self.live.pop()
            if raises:
                raise LookupError
            return "done"

        if raises:
            with pytest.raises(LookupError):
                fn()
        else:
            assert fn() == "done"
        self.check_equals(before)

    def check_equals(self, expected):
        assert_state(*expected)

    @invariant()
    def check(self):
        assert_state(*self.expected())

    def teardown(self):
        while self.live:
            self.live.pop()[0].__exit__(None, None, None)
        assert_state(None, None)


ScopeMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestScopeStateMachine = ScopeMachine.TestCase


@pytest.mark.parametrize("outer", ["plain", "autocast f16", "shapeless", "differentiating"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_steps_state_is_autocast_inside_differentiating_set_at_once(outer, dtype):
    """``enter_step`` (every eager training step) sets what ``with autocast(dtype):`` inside
    ``enter_differentiating()`` sets, from any state, and ``leave_step`` gives the state
    back."""
    from fluxlike.precision.scope import enter_step, leave_step
    from fluxlike.precision.state import enter, enter_differentiating

    tokens = []
    if outer == "autocast f16":
        scope = autocast(F16)
        scope.__enter__()
    elif outer != "plain":
        tokens.append(enter(**{outer: True}))
    try:
        before, entries = context.get(), _entries.get()
        token = enter_differentiating()
        with autocast(dtype):
            wanted = context.get()
        context.reset(token)
        assert context.get() is before
        for _ in range(2):  # (the second from the remembered state)
            step = enter_step(dtype)
            assert context.get() == wanted and context.get().differentiating
            assert _entries.get() == entries  # (no scope object recorded)
            leave_step(step)
            assert context.get() is before
    finally:
        if outer == "autocast f16":
            scope.__exit__(None, None, None)
        for token in reversed(tokens):
            context.reset(token)
    assert context.get() is PLAIN


def test_a_scope_left_open_by_a_step_restores_what_the_step_found():
    """A scope entered inside a step and exited after it (a generator's, closed later)
    restores the dtype the step found, as it would had the step been an autocast scope."""
    from fluxlike.precision.scope import enter_step, leave_step

    def features():
        with autocast(F16):
            yield
            yield

    step = enter_step(BF16)
    opened = features()
    next(opened)
    leave_step(step)
    assert autocast.get_dtype("cpu") is None
    opened.close()
    assert autocast.get_dtype("cpu") is None and context.get() is PLAIN
    assert _entries.get() == ()
