"""Unmodified upstream models under every precision mode: mlx-lm's architectures (Llama,
Mistral, Qwen2, Gemma, GPT-2, Mamba, Falcon-Mamba, Mixtral's mixture of experts) and
transformers of stock ``mlx.nn`` layers (mlx-examples' BERT, ``nn.Transformer``), tiny configs
built from their own classes with random weights (``zoo.py``).

Each is checked under ``autocast(bf16/f16)``, the converters ``bf16mix``/``f16mix``/``bf16``,
``fluxlike.compile`` and ``gradient(autocast=)``, in training through ``train`` (the loss falls
as float32's does, master weights stay float32), and, for mlx-lm's models, in mlx-lm's own
``generate_step``, quantized (``nn.quantize``) and LoRA fine-tuning (``linear_to_lora_layers``).

Tolerances, relative to float32 (``rel``: the norm of the difference over float32's norm),
measured with these configs at ~3-4x margin: logits bfloat16 2.5e-2, float16 4e-3; the
gradient tree bfloat16 6e-2, float16 1.5e-2.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
import zoo
from mlx.utils import tree_flatten, tree_map

import fluxlike
from fluxlike import Adam, autocast, bf16, bf16mix, f16mix, gradient, native, setup, train

NEEDS_MLX_LM = "the upstream-model tests build mlx-lm's models: pip install -e '.[test]'"
NAMES = zoo.LM_NAMES + zoo.STOCK_NAMES
DTYPES = [mx.bfloat16, mx.float16]
LOGITS_TOL = {mx.bfloat16: 2.5e-2, mx.float16: 4e-3}
GRAD_TOL = {mx.bfloat16: 6e-2, mx.float16: 1.5e-2}
F16_SCALE = 2.0**12  # float16 gradients of these losses underflow unscaled (see the Mamba test)


def rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def tree_rel(a: dict, b: dict) -> float:
    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert fa.keys() == fb.keys()
    return rel(mx.concatenate([fa[k].reshape(-1) for k in fb]),
               mx.concatenate([fb[k].reshape(-1) for k in fb]))


def make(name: str, **size: int) -> nn.Module:
    if name in zoo.LM_NAMES:
        pytest.importorskip("mlx_lm", reason=NEEDS_MLX_LM)
    mx.random.seed(1)
    return zoo.build(name, **size)


@pytest.fixture
def tokens() -> mx.array:
    return mx.random.randint(0, 128, (2, 13))


def float32_leaves(model: nn.Module) -> None:
    for key, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            assert value.dtype == mx.float32, key


# ------------------------------------------------------------------ forward


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", NAMES)
def test_autocast_forward_is_close_to_float32(name, dtype, tokens):
    model = make(name)
    x = tokens[:, :-1]
    want = model(x)
    with autocast(dtype):
        got = model(x)
    assert got.shape == want.shape
    assert rel(got, want) < LOGITS_TOL[dtype], name
    float32_leaves(model)  # the master weights are untouched


CONVERTERS = [(bf16mix, mx.bfloat16), (f16mix, mx.float16), (bf16, mx.bfloat16)]


@pytest.mark.parametrize("convert,dtype", CONVERTERS, ids=["bf16mix", "f16mix", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_converted_model_runs_and_is_close_to_float32(name, convert, dtype, tokens):
    """The converted model's plain forward, no scope: it must run wherever the autocast one
    does (BERT's float32 additive mask reached a half ``scaled_dot_product_attention``)."""
    model = make(name)
    x = tokens[:, :-1]
    want = model(x)
    half = convert(model)
    if name == "mixtral" and mx.default_device() == mx.cpu:
        # MLX 0.32's CPU gather_mm (mlx-lm's SwitchGLU experts) has float32 kernels only:
        # a half model of experts cannot run on the CPU (under autocast they compute in
        # float32: SwitchLinear has no precision policy). A canary for MLX's fix.
        with pytest.raises(RuntimeError, match="GatherMM"):
            mx.eval(half(x))
        return
    got = half(x)
    assert got.dtype == dtype
    assert rel(got, want) < 1.5 * LOGITS_TOL[dtype], name
    float32_leaves(model)  # the argument is unchanged


def test_bert_mask_of_a_converted_model_is_cast_as_autocast_casts_it(tokens):
    """A float32 additive mask given to a converted ``nn.MultiHeadAttention`` is cast to the
    scores' dtype (as autocast does; MLX refused it); a boolean one is kept."""
    model = make("bert")
    layer = model.layers[0].attention
    x = mx.random.normal((2, 6, 64))
    keep = mx.array([[True] * 4 + [False] * 2] * 2)[:, None, None, :]
    additive = mx.where(keep, 0.0, -mx.inf).astype(mx.float32)
    want = layer(x, x, x, additive)
    for convert in (bf16mix, f16mix, bf16):
        half = convert(layer)
        dtype = half.query_proj.weight.dtype
        with autocast(dtype):
            scoped = layer(x.astype(dtype), x.astype(dtype), x.astype(dtype), additive)
        got = half(x.astype(dtype), x.astype(dtype), x.astype(dtype), additive)
        assert got.dtype == dtype and rel(got, want) < 1.5 * LOGITS_TOL[dtype]
        assert rel(got, scoped) < LOGITS_TOL[dtype]
        boolean = half(x.astype(dtype), x.astype(dtype), x.astype(dtype), keep)
        assert mx.allclose(boolean.astype(mx.float32), got.astype(mx.float32), atol=1e-2)


# Compiled traces make MLX build its fused CPU kernels (g++, ~1 s each, the first time on a
# machine): two models, one of mlx-lm's and one of stock layers, keep that cost small.
COMPILED = ("llama", "bert")


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_forward_follows_the_scope(name, tokens):
    model = make(name)
    x = tokens[:, :-1]
    forward = fluxlike.compile(lambda t: model(t))
    with autocast(mx.bfloat16):
        eager = model(x)
        compiled = forward(x)
    assert rel(compiled, eager) < 1e-2
    assert forward(x).dtype == model(x).dtype  # outside the scope: float32's own trace
    assert rel(forward(x), model(x)) < 1e-5


# ------------------------------------------------------------------ gradients and training


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", NAMES)
def test_gradients_are_float32_and_close_to_float32(name, dtype, tokens):
    model = make(name)
    before = dict(tree_flatten(model.parameters()))
    want, _ = gradient(zoo.lm_loss, model, tokens)
    scale = F16_SCALE if dtype == mx.float16 else 1.0
    got, _ = gradient(zoo.lm_loss, model, tokens, autocast=dtype, loss_scale=scale)
    got = tree_map(lambda g: g / scale, got)
    assert tree_map(lambda g: g.dtype, got) == tree_map(lambda g: mx.float32, want)
    assert tree_rel(got, want) < GRAD_TOL[dtype], name
    after = dict(tree_flatten(model.parameters()))
    assert all(after[k] is v for k, v in before.items())  # master weights untouched


def _curve(name: str, tokens: mx.array, dtype, steps: int = 6, compile: bool = False):
    model = make(name)
    opt_state = setup(Adam(3e-3), model)
    losses = [train(zoo.lm_loss, model, [(tokens,)], opt_state, autocast=dtype,
                    progress=False, compile=compile) for _ in range(steps)]
    return model, losses


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", NAMES)
def test_training_loss_falls_like_float32(name, dtype, tokens):
    """Six Adam steps on one batch from the same start: the half curve follows float32's
    (float16 with ``train``'s dynamic loss scale; bfloat16 through a compiled step for the
    models of ``COMPILED``)."""
    _, reference = _curve(name, tokens, None)
    model, losses = _curve(name, tokens, dtype, compile=dtype == mx.bfloat16 and name in COMPILED)
    assert reference[-1] < reference[0] - 0.05
    assert losses[-1] < losses[0] - 0.05, losses
    drop, reference_drop = losses[0] - losses[-1], reference[0] - reference[-1]
    assert abs(drop - reference_drop) < 0.25 * reference_drop, (losses, reference)
    float32_leaves(model)


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba"])
def test_mamba_gradients_from_plain_mlx_agree_with_fluxlikes(name, tokens):
    """Plain ``nn.value_and_grad`` under ``autocast`` against ``gradient(autocast=)``.

    bfloat16 agrees exactly where it runs in oneDNN's bfloat16 kernels (both paths take the
    same kernel); elsewhere, and in float16, it differs, by design: Mamba applies ``x_proj`` and
    ``dt_proj`` once per time step, and fluxlike cannot see MLX's ``mx.grad`` trace, so from
    the second application on the plain transform takes autocast's inference path (kept
    weight casts, plain float32 ops), whose weight gradients add up in float32 before one
    rounding to float16, where ``gradient`` rounds each step's to float16, as half weights get
    half gradients. Unscaled, those per-step float16 gradients underflow (``dt_proj.weight``
    1.4e-2 from float32, against 4e-3): scaled as ``train`` scales them, the two agree within
    float16's rounding. Use ``gradient``/``train`` (automatic train mode, loss scale) for
    training."""
    model = make(name)
    loss = zoo.lm_loss
    with autocast(mx.bfloat16):
        _, plain = nn.value_and_grad(model, lambda m: loss(m, tokens))(model)
    ours, _ = gradient(loss, model, tokens, autocast=mx.bfloat16)
    if native.bfloat16_native():
        assert tree_rel(plain, ours) == 0.0
    else:  # within bfloat16's rounding (2**-8)
        assert tree_rel(plain, ours) < 1e-2
    with autocast(mx.float16):
        _, plain = nn.value_and_grad(model, lambda m: loss(m, tokens) * F16_SCALE)(model)
    ours, _ = gradient(loss, model, tokens, autocast=mx.float16, loss_scale=F16_SCALE)
    assert tree_rel(plain, ours) < 2e-3
    for (key, a), (_, b) in zip(tree_flatten(plain), tree_flatten(ours), strict=True):
        assert rel(a, b) < 5e-3, key


# ------------------------------------------------------------------ mlx-lm's own machinery


@pytest.mark.parametrize("name", zoo.LM_NAMES)
def test_mlx_lm_generate_step_under_autocast(name, tokens):
    """mlx-lm's own generation loop (``generate_step``: prefill, KV or SSM cache, sampling)
    inside a scope; its first step's log-probabilities follow float32's."""
    from mlx_lm.generate import generate_step

    model = make(name)
    prompt = tokens[0, :8]
    first32 = next(generate_step(prompt, model, max_tokens=1))[1]
    with autocast(mx.bfloat16):
        steps = list(generate_step(prompt, model, max_tokens=6))
    assert len(steps) == 6
    assert all(isinstance(token, int) and 0 <= token < 128 for token, _ in steps)
    logprobs = steps[0][1]
    assert mx.all(mx.isfinite(logprobs)).item()
    assert rel(logprobs, first32) < LOGITS_TOL[mx.bfloat16]


@pytest.mark.parametrize("name", zoo.LM_NAMES)
def test_quantized_model_under_autocast(name, tokens):
    """``nn.quantize`` (4 bits, groups of 32; mlx-lm's experts too) under autocast: close to
    the quantized model's own float32 forward."""
    model = make(name)
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules()) or name == "mixtral"
    x = tokens[:, :-1]
    want = model(x)
    for dtype in DTYPES:
        with autocast(dtype):
            got = model(x)
        assert rel(got, want) < LOGITS_TOL[dtype], (name, dtype)


@pytest.mark.parametrize("name", zoo.LM_NAMES)
def test_lora_fine_tuning_under_autocast(name, tokens):
    """LoRA as mlx-lm does it (``model.freeze()``, ``linear_to_lora_layers``) trained by
    ``train(..., autocast=mx.bfloat16)``: the loss falls, only the adapters move, and they
    stay float32."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = make(name)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert trainable and all("lora" in k for k in trainable)
    frozen = {k: v for k, v in tree_flatten(model.parameters()) if k not in trainable}
    opt_state = setup(Adam(1e-2), model)
    losses = [train(zoo.lm_loss, model, [(tokens,)], opt_state, autocast=mx.bfloat16,
                    progress=False) for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05, losses
    after = dict(tree_flatten(model.parameters()))
    assert all(mx.array_equal(after[k], v) for k, v in frozen.items())  # the base model
    assert any(not mx.array_equal(after[k], v) for k, v in trainable.items())
    float32_leaves(model)
