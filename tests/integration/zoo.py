"""Real upstream architectures, built from their own classes with random weights (no
download): mlx-lm's language models from a config dict, as ``mlx_lm.utils.load_model`` builds
them from a checkpoint's ``config.json``, and two transformers of stock ``mlx.nn`` layers (a
BERT encoder as mlx-examples' ``bert`` writes it, and ``nn.Transformer``).

``build(name, dims, layers)`` makes any of them at any size: the tests use dims 64 and 2
layers, ``bench/upstream.py`` dims 512 and 4 layers. Each model maps token ids ``(batch,
length)`` to logits ``(batch, length, vocab)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn


def _llama_like(model_type: str, dims: int, layers: int, vocab: int, **extra: object) -> dict:
    heads = max(2, dims // 16)
    return dict(model_type=model_type, hidden_size=dims, num_hidden_layers=layers,
                intermediate_size=2 * dims + dims // 2, num_attention_heads=heads,
                num_key_value_heads=heads // 2, rms_norm_eps=1e-5, vocab_size=vocab,
                tie_word_embeddings=False, **extra)


def lm_config(name: str, dims: int = 64, layers: int = 2, vocab: int = 128) -> dict:
    """The ``config.json`` of a small mlx-lm model of architecture ``name``."""
    heads = max(2, dims // 16)
    if name in ("llama", "mistral"):
        return _llama_like(name, dims, layers, vocab)
    if name == "qwen2":  # q/k/v projections with biases, tied embeddings
        config = _llama_like(name, dims, layers, vocab)
        return {**config, "tie_word_embeddings": True}
    if name == "gemma":  # (1 + w) RMSNorm, GELU MLP, scaled embeddings, one KV head
        return dict(model_type=name, hidden_size=dims, num_hidden_layers=layers,
                    intermediate_size=2 * dims, num_attention_heads=heads,
                    num_key_value_heads=1, head_dim=dims // heads, rms_norm_eps=1e-6,
                    vocab_size=vocab)
    if name == "gpt2":
        return dict(model_type=name, n_ctx=256, n_embd=dims, n_head=heads, n_layer=layers,
                    n_positions=256, layer_norm_epsilon=1e-5, vocab_size=vocab)
    if name in ("mamba", "falcon_mamba"):
        return dict(model_type=name, vocab_size=vocab, hidden_size=dims,
                    intermediate_size=2 * dims, state_size=8, num_hidden_layers=layers,
                    conv_kernel=4, use_bias=False, use_conv_bias=True,
                    time_step_rank=math.ceil(dims / 16), tie_word_embeddings=True)
    if name == "mixtral":  # a sparse mixture of experts (SwitchGLU: mx.gather_mm)
        return {**_llama_like(name, dims, layers, vocab), "num_local_experts": 4,
                "num_experts_per_tok": 2}
    raise ValueError(f"lm_config: unknown architecture {name!r}; one of {LM_NAMES}")


LM_NAMES = ("llama", "mistral", "qwen2", "gemma", "gpt2", "mamba", "falcon_mamba", "mixtral")
STOCK_NAMES = ("bert", "transformer")


def mlx_lm_model(name: str, dims: int = 64, layers: int = 2, vocab: int = 128) -> nn.Module:
    """An mlx-lm ``Model`` of architecture ``name``, random weights, evaluated."""
    from mlx_lm.utils import _get_classes  # load_model's own way from config to classes

    config = lm_config(name, dims, layers, vocab)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


class BertLayer(nn.Module):
    """mlx-examples' ``bert/model.py`` encoder layer: post-norm, ``nn.MultiHeadAttention``
    with biases, GELU MLP."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.attention = nn.MultiHeadAttention(dims, heads, bias=True)
        self.ln1 = nn.LayerNorm(dims, eps=1e-12)
        self.ln2 = nn.LayerNorm(dims, eps=1e-12)
        self.linear1 = nn.Linear(dims, 4 * dims)
        self.linear2 = nn.Linear(4 * dims, dims)
        self.gelu = nn.GELU()

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        x = self.ln1(x + self.attention(x, x, x, mask))
        return self.ln2(x + self.linear2(self.gelu(self.linear1(x))))


class Bert(nn.Module):
    """mlx-examples' BERT, as it builds its attention mask: ``log`` of a float32 0/1 padding
    mask (``-inf`` where padded), broadcast over heads and queries; a token-level head on
    top so that it trains as the other models do."""

    def __init__(self, dims: int = 64, layers: int = 2, vocab: int = 128, max_len: int = 256):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dims)
        self.position_embeddings = nn.Embedding(max_len, dims)
        self.norm = nn.LayerNorm(dims, eps=1e-12)
        self.layers = [BertLayer(dims, max(2, dims // 16)) for _ in range(layers)]
        self.head = nn.Linear(dims, vocab)

    def __call__(self, ids: mx.array, attention_mask: mx.array | None = None) -> mx.array:
        if attention_mask is None:
            attention_mask = mx.ones(ids.shape)
            attention_mask[:, -2:] = 0  # the last two positions are padding
        x = self.word_embeddings(ids) + self.position_embeddings(mx.arange(ids.shape[1]))
        x = self.norm(x)
        mask = mx.expand_dims(mx.log(attention_mask), (1, 2))  # float32, as mlx-examples
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


class StockTransformer(nn.Module):
    """``nn.Transformer`` (encoder-decoder, pre-norm) as a causal LM: the token sequence is
    both source and target, the decoder's mask from ``create_additive_causal_mask``."""

    def __init__(self, dims: int = 64, layers: int = 2, vocab: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dims)
        self.transformer = nn.Transformer(dims, max(2, dims // 16), layers, layers,
                                          2 * dims, norm_first=True)
        self.head = nn.Linear(dims, vocab)

    def __call__(self, ids: mx.array) -> mx.array:
        x = self.embedding(ids)
        mask = nn.MultiHeadAttention.create_additive_causal_mask(ids.shape[1])  # float32
        return self.head(self.transformer(x, x, None, mask, None))


def stock_model(name: str, dims: int = 64, layers: int = 2, vocab: int = 128) -> nn.Module:
    """A transformer of stock ``mlx.nn`` layers, random weights, evaluated."""
    makers: dict[str, Callable[..., nn.Module]] = {"bert": Bert, "transformer": StockTransformer}
    model = makers[name](dims, layers, vocab)
    mx.eval(model.parameters())
    return model


def build(name: str, dims: int = 64, layers: int = 2, vocab: int = 128) -> nn.Module:
    """Any model of :data:`LM_NAMES` (mlx-lm) or :data:`STOCK_NAMES` (stock mlx.nn)."""
    if name in STOCK_NAMES:
        return stock_model(name, dims, layers, vocab)
    return mlx_lm_model(name, dims, layers, vocab)


def lm_loss(model: nn.Module, tokens: mx.array) -> mx.array:
    """Next-token cross entropy of ``model`` on ``tokens`` ``(batch, length + 1)``, in
    float32 whatever the logits' dtype (as mlx-lm's own ``default_loss``)."""
    logits = model(tokens[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")
