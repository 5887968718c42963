"""The native companion found, checked and loaded (fluxlike/native/_loader.py), and fluxlike
without it.

Without the extension these tests skip with the reason ``native_info()`` gives. To run them
as if it were absent: ``FLUXLIKE_NATIVE=0 python -m pytest -q tests/native``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_helpers import (
    INFO,
    _subprocess,
    needs_native,
)

from fluxlike import native


def test_fluxlike_works_without_native():
    """With fluxlike_native unimportable, fluxlike imports and trains, native_info() says why,
    and the native functions raise a clear NativeUnavailable."""
    result = _subprocess("""
        import sys
        sys.modules["fluxlike_native"] = None          # as if it were not installed
        import mlx.core as mx
        import fluxlike
        from fluxlike import Dense, native
        info = native.native_info()
        assert not info.available, info
        assert "not installed" in info.reason and "./dev setup" in info.reason, info.reason
        assert not native.available() and native.cache_info() is None
        y = Dense(3, 2)(mx.ones((4, 3)))
        mx.eval(y)
        assert y.shape == (4, 2)
        from fluxlike import Chain, Conv, MaxPool, gradient, relu
        cnn = Chain(Conv((3, 3), 1, 2, relu, padding=1), MaxPool((2, 2)))
        for ac in (None, mx.bfloat16):
            g, = gradient(lambda m: m(mx.ones((2, 8, 8, 1))).sum(), cnn, autocast=ac)
            assert g["layers"][0]["weight"].dtype == mx.float32
        try:
            native.linear(mx.ones((2, 3)), mx.ones((4, 3)))
        except native.NativeUnavailable as error:
            assert "fluxlike.native.linear" in str(error) and "not installed" in str(error)
        else:
            raise AssertionError("no error")
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_mismatched_build_is_reported(tmp_path):
    """A companion built for another MLX is not imported; native_info() names both versions."""
    fake = tmp_path / "fluxlike_native"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_build.py").write_text('MLX_VERSION = "0.0.1"\n')
    (fake / "_ext.py").write_text('raise AssertionError("a mismatched _ext was imported")\n')
    result = _subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import mlx.core as mx
        from fluxlike import native
        info = native.native_info()
        assert not info.available and info.built_for == "0.0.1", info
        assert "built for MLX 0.0.1" in info.reason and mx.__version__ in info.reason, info
        print("ok")
    """)
    assert result.returncode == 0, result.stderr


def test_a_companion_that_predates_this_fluxlike_is_not_used(tmp_path):
    """A companion for this MLX that lacks an entry this fluxlike calls (built from an older
    native/) is not used; native_info() names what is missing and says to rebuild, and the
    layers run MLX's kernels."""
    fake = tmp_path / "fluxlike_native"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_build.py").write_text(f"MLX_VERSION = {mx.__version__!r}\n")
    (fake / "_ext.py").write_text(f"built_mlx_version = {mx.__version__!r}\n"
                                  f"def runtime_mlx_version():\n    return {mx.__version__!r}\n"
                                  f"def matmul(*args, **kwargs):\n    raise AssertionError\n")
    result = _subprocess(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import mlx.core as mx
        from fluxlike import Dense, native
        info = native.native_info()
        assert not info.available and not native.available(), info
        assert "predates" in info.reason and "softmax" in info.reason, info.reason
        assert "rebuild" in info.reason, info.reason
        mx.eval(Dense(3, 2)(mx.ones((4, 3))))
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


@needs_native
def test_native_info_in_use():
    assert INFO.available and INFO.isa and INFO.onednn
    assert INFO.built_for == mx.__version__ == INFO.mlx
    assert INFO.bfloat16 in ("native", "float32 kernels")
    assert "oneDNN" in INFO.reason and INFO.isa in INFO.reason


@needs_native
@pytest.mark.parametrize("env, policy", [({}, "PASSIVE"),
                                         ({"OMP_WAIT_POLICY": "active"}, "ACTIVE")])
def test_openmp_threads_wait_passively_unless_the_environment_says(env, policy):
    """oneDNN's OpenMP threads sleep at once after a parallel region unless the user chose a
    policy (libgomp's own spins, and costs 10-100x beside other busy processes); fluxlike
    leaves the environment as it found it, so child processes inherit nothing."""
    result = _subprocess("""
        import os
        import fluxlike
        from fluxlike import native
        assert native.available()
        print("inherited:", os.environ.get("OMP_WAIT_POLICY"))
    """, OMP_DISPLAY_ENV="true", **env)
    assert result.returncode == 0, result.stderr
    assert f"OMP_WAIT_POLICY = '{policy}'" in result.stderr + result.stdout
    assert f"inherited: {env.get('OMP_WAIT_POLICY')}" in result.stdout


def test_the_switches_check_their_arguments_without_the_companion_too(monkeypatch):
    # (the same errors whether or not the companion is in use)
    monkeypatch.setattr(native.switch, "loaded", None)
    with pytest.raises(TypeError, match="background_creation: on must be True, False or None"):
        native.background_creation(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="matmul_mode: mode must be one of"):
        native.matmul_mode("bogus")
    assert native.background_creation(np.bool_(True)) is None
    assert native.background_creation() is None and native.matmul_mode() is None
