"""Basic layers: containers, dense maps, embeddings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import mlx.core as mx

from .. import workarounds
from ..activations import identity, resolve
from ..checks import check_features, check_flag, check_size, index_range, initialise, is_int
from ..init import glorot_uniform
from ..precision import kernels
from ..precision.operands import match_input, operands
from ..precision.policy import autocast_policy
from .base import Layer, signature_of


class _Container(Layer):
    """What :class:`Chain` and :class:`Parallel` share: layers given by position (a list) or by
    name (a dict), ``len``, indexing by position or name, and slicing."""

    # Entries of the module itself: a layer of that name would hide them from mlx.nn.Module.
    _reserved: tuple[str, ...] = ("layers",)

    def _set_layers(self, layers: tuple[Callable, ...], named: dict[str, Callable]) -> None:
        owner = type(self).__name__
        if layers and named:
            raise ValueError(f"[{owner}] give layers either by position or by name, not both")
        taken = sorted(k for k in named if k in self._reserved or k.startswith("_"))
        if taken:
            raise ValueError(f"[{owner}] {taken} cannot name a layer (reserved, or private to "
                             f"mlx.nn.Module: names starting with '_')")
        for key, layer in [*enumerate(layers), *named.items()]:
            if not callable(layer):
                raise TypeError(f"[{owner}] layer {key!r} must be callable, got {layer!r}")
        self.layers = dict(named) if named else list(layers)

    def _layers(self) -> Iterable[Callable]:
        """The layers in order (read by item: ``self.layers`` goes through a slow __getattr__)."""
        layers = dict.__getitem__(self, "layers")
        return layers.values() if isinstance(layers, dict) else layers

    def _items(self) -> list[tuple[str | None, Callable]]:
        if isinstance(self.layers, dict):
            return list(self.layers.items())
        return [(None, layer) for layer in self.layers]

    def _sliced(self, *layers: Callable, **named: Callable) -> _Container:
        """A container of the same kind holding ``layers`` (for ``c[1:]``)."""
        raise NotImplementedError

    def __getattr__(self, key: str) -> Any:
        """``c.enc`` for a layer named ``enc``. Python calls this only when normal lookup
        fails (never for the calls' own reads, which go by item)."""
        value = dict.get(self, key)  # nn.Module.__getattr__'s own lookup, kept first
        if value is not None:
            return value
        layers = dict.get(self, "layers")
        if isinstance(layers, dict) and key in layers:
            return layers[key]
        return super().__getattr__(key)

    def __setattr__(self, key: str, value: Any) -> None:
        """``c.enc = layer`` replaces the layer named ``enc`` (rather than adding an entry
        the container would never call)."""
        layers = dict.get(self, "layers")
        if isinstance(layers, dict) and key in layers:
            if not callable(value):
                raise TypeError(f"[{type(self).__name__}] layer {key!r} must be callable, "
                                f"got {value!r}")
            layers[key] = value
            return
        super().__setattr__(key, value)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int | slice | str) -> Any:
        if isinstance(index, str):  # mlx.nn.Module reads its own entries with string keys
            layers = dict.get(self, "layers")
            if isinstance(layers, dict) and index in layers:
                return layers[index]
            if index in self.keys():
                return dict.__getitem__(self, index)
            names = f"the names are {list(layers)}" if isinstance(layers, dict) \
                else "its layers are given by position: index them by number"
            raise KeyError(f"[{type(self).__name__}] no layer named {index!r}; {names}")
        items = self._items()
        if isinstance(index, slice):
            chosen = items[index]
            if isinstance(self.layers, dict):
                return self._sliced(**cast("dict[str, Callable]", dict(chosen)))  # named
            return self._sliced(*(layer for _, layer in chosen))
        try:
            return items[index][1]
        except IndexError:
            count = f"{len(items)} layer" + ("" if len(items) == 1 else "s")
            raise IndexError(f"[{type(self).__name__}] index {index} out of range for "
                             f"{count}") from None


class Chain(_Container):
    """Call layers in sequence: ``Chain(f, g, h)(x) == h(g(f(x)))``.

    Layers may be given by position or by name (``Chain(enc=Dense(2, 3), dec=Dense(3, 2))``)
    but not both. A chain can be indexed (``c[0]``, ``c["enc"]``, or ``c.enc`` where no
    method has that name) and sliced (``c[1:]``, another ``Chain`` sharing the same
    layers). Elements may be plain functions.

    >>> import mlx.core as mx
    >>> from fluxlike import Chain, Dense, relu
    >>> model = Chain(Dense(5, 3, relu), Dense(3, 2))
    >>> model(mx.ones((4, 5))).shape
    (4, 2)
    >>> model
    Chain(
      Dense(5 => 3, relu),  # 18 parameters
      Dense(3 => 2),  # 8 parameters
    )  # Total: 4 arrays, 26 parameters, 104 bytes.
    >>> named = Chain(enc=Dense(5, 3), dec=Dense(3, 2))
    >>> named.enc
    Dense(5 => 3)  # 18 parameters
    """

    def __init__(self, *layers: Callable, **named: Callable):
        super().__init__()
        self._set_layers(layers, named)

    def __call__(self, x: Any) -> Any:
        for layer in self._layers():
            x = layer(x)
        return x

    def __iter__(self):
        return iter(self._layers())

    def _sliced(self, *layers: Callable, **named: Callable) -> Chain:
        return Chain(*layers, **named)

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return self._items()


@autocast_policy("down")
class Dense(Layer):
    """A fully connected layer: ``act(x @ weight.T + bias)``.

    ``Dense(in_dims, out_dims, act=identity, *, bias=True, init=glorot_uniform)``: ``weight``
    has shape ``(out_dims, in_dims)`` and is made by ``init(shape)``; ``bias=False`` leaves
    ``bias`` as ``None``. The input's last axis must have ``in_dims`` entries; any leading
    axes are batch axes. Under :func:`~fluxlike.autocast` it computes in the scope's dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense
    >>> layer = Dense(5, 2)
    >>> layer
    Dense(5 => 2)  # 12 parameters
    >>> layer(mx.ones((3, 5))).shape
    (3, 2)
    >>> Dense(5, 2, "relu", bias=False)
    Dense(5 => 2, relu, bias=False)  # 10 parameters
    """

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        act: Callable | str = identity,
        *,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
    ):
        super().__init__()
        in_dims = check_size(in_dims, "Dense", "in_dims")
        out_dims = check_size(out_dims, "Dense", "out_dims")
        bias = check_flag(bias, "Dense", "bias")
        self.act = resolve(act, "Dense")
        self.weight = initialise(init, (out_dims, in_dims), "Dense")
        self.bias = mx.zeros((out_dims,), self.weight.dtype) if bias else None

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]  # item access: `self.weight` goes through a slow __getattr__
        try:
            return kernels.linear(x, weight, self.get("bias"), self.act, "Dense")
        except (ValueError, IndexError):  # a shape MLX refused, or 0-d: name the layer and sizes
            in_dims = weight.shape[1]
            image = isinstance(x, mx.array) and x.ndim > 2 and math.prod(x.shape[1:]) == in_dims
            hint = "; flatten it first: flatten(x) or x.reshape(x.shape[0], -1)" if image else ""
            check_features(x, in_dims, "Dense", hint=hint)
            raise

    def signature(self) -> str:
        out_dims, in_dims = self.weight.shape
        options = {} if self.bias is not None else {"bias": False}
        return signature_of([f"{in_dims} => {out_dims}"], "Dense", self.act, **options)


def _standard_normal(shape: tuple[int, ...]) -> mx.array:
    """Standard normal float32 entries (Flux's ``randn32``), Embedding's default init."""
    return mx.random.normal(shape)


def flatten(x: mx.array) -> mx.array:
    """Reshape ``(N, ...)`` to ``(N, prod(...))``, keeping the batch axis first.

    A plain function, so it can sit in a :class:`Chain` between convolutions and
    :class:`Dense` layers. A 1-d input ``(N,)`` becomes ``(N, 1)``.

    >>> import mlx.core as mx
    >>> from fluxlike import flatten
    >>> flatten(mx.zeros((2, 3, 4, 5))).shape
    (2, 60)
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"[flatten] expected an mx.array input, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("[flatten] expected an input with a batch axis, got a 0-d array")
    if x.ndim == 1:
        return x[:, None]
    # mx.flatten, not a reshape to x.shape[0]: a shapeless trace then replays at any batch size
    return mx.flatten(x, start_axis=1)


@autocast_policy("down")
class Bilinear(Layer):
    """A bilinear map of two inputs: ``y[..., k] = act(x1 @ weight[k] @ x2 + bias[k])``.

    ``Bilinear(in1, in2, out, act=identity, *, bias=True, init=glorot_uniform)``: ``weight``
    has shape ``(out, in1, in2)`` (made by ``init``), ``bias`` shape ``(out,)`` or ``None``.
    Call it as ``layer(x1, x2)`` or ``layer((x1, x2))`` (a tuple, as a :class:`Chain` passes
    it), with ``x1`` of shape ``(..., in1)`` and ``x2`` of shape ``(..., in2)`` sharing their
    batch axes; ``layer(x)`` means ``layer(x, x)``. Under :func:`~fluxlike.autocast` it
    computes in the scope's dtype, like :class:`Dense`. The repr always shows both input
    sizes, in the order of the constructor.

    >>> import mlx.core as mx
    >>> from fluxlike import Bilinear
    >>> layer = Bilinear(5, 4, 3)
    >>> layer
    Bilinear((5, 4) => 3)  # 63 parameters
    >>> layer(mx.ones((2, 5)), mx.ones((2, 4))).shape
    (2, 3)
    >>> Bilinear(2, 2, 3, "tanh", bias=False)
    Bilinear((2, 2) => 3, tanh, bias=False)  # 12 parameters
    """

    def __init__(
        self,
        in1: int,
        in2: int,
        out: int,
        act: Callable | str = identity,
        *,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = glorot_uniform,
    ):
        super().__init__()
        in1, in2, out = (check_size(value, "Bilinear", name)
                         for name, value in (("in1", in1), ("in2", in2), ("out", out)))
        bias = check_flag(bias, "Bilinear", "bias")
        self.act = resolve(act, "Bilinear")
        self.weight = initialise(init, (out, in1, in2), "Bilinear")
        self.bias = mx.zeros((out,), self.weight.dtype) if bias else None

    def __call__(self, x1: mx.array | tuple[mx.array, mx.array], x2: mx.array | None = None):
        weight, bias = self["weight"], self.get("bias")  # item access: see Dense.__call__
        x1, x2 = _pair(x1, x2, weight.shape[1:])
        out, in1, in2 = weight.shape
        batch = x1.shape[:-1]
        n = math.prod(batch)
        x1, weight, bias = operands(x1, weight, bias, layer="Bilinear")
        x1 = x1.reshape(n, in1, 1)
        x2 = match_input(x2, weight, "Bilinear").reshape(n, in2)
        # (x2 contracted with W) then with x1: two GEMMs, no (n, out, in1, in2) temporary
        wx2 = kernels.linear(x2, weight.reshape(out * in1, in2)).reshape(n, out, in1)
        y = kernels.matmul(wx2, x1).reshape(*batch, out)
        return self.act(y if bias is None else y + bias)

    def signature(self) -> str:
        out, in1, in2 = self.weight.shape
        options = {} if self.bias is not None else {"bias": False}
        return signature_of([f"({in1}, {in2}) => {out}"], "Bilinear", self.act, **options)


def _pair(x1: Any, x2: Any, sizes: tuple[int, int]) -> tuple[mx.array, mx.array]:
    """Bilinear's two inputs from ``(x1, x2)``, ``((x1, x2), None)`` or ``(x, None)``, checked
    against the feature ``sizes`` and for shared batch axes."""
    if isinstance(x1, tuple) and x2 is None:
        if len(x1) != 2:
            raise ValueError(f"[Bilinear] expected a pair of inputs, got {len(x1)}")
        x1, x2 = x1
    x2 = x1 if x2 is None else x2
    check_features(x1, sizes[0], "Bilinear")
    check_features(x2, sizes[1], "Bilinear")
    if x1.shape[:-1] != x2.shape[:-1]:
        raise ValueError(
            f"[Bilinear] the two inputs must share their batch axes, got shapes "
            f"{tuple(x1.shape)} and {tuple(x2.shape)}"
        )
    return x1, x2


class Scale(Layer):
    """Elementwise affine map: ``act(weight * x + bias)``, with ``weight`` and ``bias`` of
    shape ``size``.

    ``Scale(size, act=identity, *, bias=True, init=mx.ones)``: ``size`` is an int or a
    tuple of ints; ``weight = init(size)`` (ones by default), ``bias`` is zeros or ``None``.
    The input's trailing axes must broadcast against ``size`` without changing the input's
    shape (``Scale(C)`` scales the channels of an ``(N, H, W, C)`` image).

    Precision: policy "none". The layer computes in its input's floating dtype (its
    parameters are cast to it for the call; the master copies stay as they are), so under
    :func:`~fluxlike.autocast` it keeps a half-precision activation in half precision.
    Integer input is computed in the parameters' dtype.

    >>> import mlx.core as mx
    >>> from fluxlike import Scale
    >>> Scale(3)
    Scale(3)  # 6 parameters
    >>> Scale(3)(mx.ones((2, 3), dtype=mx.float16)).dtype
    mlx.core.float16
    >>> Scale((2, 3), "relu", bias=False)
    Scale((2, 3), relu, bias=False)  # 6 parameters
    """

    def __init__(
        self,
        size: int | tuple[int, ...],
        act: Callable | str = identity,
        *,
        bias: bool = True,
        init: Callable[[tuple[int, ...]], mx.array] = mx.ones,
    ):
        super().__init__()
        shape = (size,) if is_int(size) else size
        if not isinstance(shape, tuple) or not shape:
            raise ValueError(
                f"[Scale] size must be a positive integer or a tuple of them, got {size!r}"
            )
        shape = tuple(check_size(value, "Scale", "size") for value in shape)
        bias = check_flag(bias, "Scale", "bias")
        self.act = resolve(act, "Scale")
        self.weight = initialise(init, shape, "Scale")
        self.bias = mx.zeros(shape, self.weight.dtype) if bias else None

    def __call__(self, x: mx.array) -> mx.array:
        if not isinstance(x, mx.array):
            raise TypeError(f"[Scale] expected an mx.array input, got {type(x).__name__}")
        weight, bias = self["weight"], self.get("bias")  # item access: see Dense.__call__
        size = tuple(weight.shape)
        trailing = tuple(x.shape[-len(size) :]) if x.ndim >= len(size) else None
        if trailing is None or any(s not in (1, t) for s, t in zip(size, trailing, strict=True)):
            raise ValueError(
                f"[Scale] expected input whose trailing axes match {size}, "
                f"got shape {tuple(x.shape)}"
            )
        dtype = x.dtype if mx.issubdtype(x.dtype, mx.floating) else weight.dtype
        y = weight.astype(dtype) * x.astype(dtype)
        return self.act(y if bias is None else y + bias.astype(dtype))

    def signature(self) -> str:
        size = self.weight.shape
        shown = str(size[0]) if len(size) == 1 else str(tuple(size))
        options = {} if self.bias is not None else {"bias": False}
        return signature_of([shown], "Scale", self.act, **options)


class SkipConnection(Layer):
    """``connection(layers(x), x)``: a residual block when ``connection`` is ``mx.add``.

    ``connection`` is any callable of two arguments (``mx.add``, ``lambda a, b: ...``, a
    layer such as :class:`Bilinear` whose parameters then belong to the block). The repr
    expands both like a container.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, SkipConnection
    >>> block = SkipConnection(Dense(3, 3), mx.add)
    >>> block(mx.ones((2, 3))).shape
    (2, 3)
    >>> block
    SkipConnection(
      Dense(3 => 3),  # 12 parameters
      add,
    )  # Total: 2 arrays, 12 parameters, 48 bytes.
    """

    def __init__(self, layers: Callable, connection: Callable):
        super().__init__()
        for name, value in (("layers", layers), ("connection", connection)):
            if not callable(value):
                raise TypeError(f"[SkipConnection] {name} must be callable, got {value!r}")
        self.layers = layers
        self.connection = connection

    def __call__(self, x: Any) -> Any:
        return self.connection(self.layers(x), x)

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return [(None, self.layers), (None, self.connection)]


class Parallel(_Container):
    """Apply several layers side by side and combine: ``connection(f(x), g(x), ...)``.

    ``Parallel(connection, *layers)`` or ``Parallel(connection, name=layer, ...)``:

    - one input ``x``: every layer gets ``x``;
    - as many inputs as layers (``p(x1, x2)`` or the tuple ``p((x1, x2))``): one each;
    - several inputs and a single layer: that layer is applied to each input.

    The outputs are combined by ``connection(*outputs)``; ``connection=None`` returns the
    tuple of outputs. Layers can be indexed like a :class:`Chain` (``p[0]``, ``p["a"]``,
    ``p.a``).

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Parallel
    >>> p = Parallel(mx.add, a=Dense(2, 3), b=Dense(4, 3))
    >>> p(mx.ones((5, 2)), mx.ones((5, 4))).shape
    (5, 3)
    >>> p
    Parallel(
      add,
      a = Dense(2 => 3),  # 9 parameters
      b = Dense(4 => 3),  # 15 parameters
    )  # Total: 4 arrays, 24 parameters, 96 bytes.
    >>> [y.shape for y in Parallel(None, Dense(2, 3), Dense(2, 1))(mx.ones((5, 2)))]
    [(5, 3), (5, 1)]
    """

    _reserved = ("layers", "connection")

    def __init__(self, connection: Callable | None, *layers: Callable, **named: Callable):
        super().__init__()
        if connection is not None and not callable(connection):
            raise TypeError(f"[Parallel] connection must be callable or None, got {connection!r}")
        if not layers and not named:
            raise ValueError("[Parallel] needs at least one layer")
        self.connection = connection
        self._set_layers(layers, named)

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 1 and isinstance(xs[0], tuple):  # a tuple is always spread, as in Flux
            xs = xs[0]
        layers = list(self._layers())
        if not xs:
            raise ValueError("[Parallel] expected at least one input, got none")
        if len(xs) == 1:
            outputs = tuple(layer(xs[0]) for layer in layers)
        elif len(layers) == 1:
            outputs = tuple(layers[0](x) for x in xs)
        elif len(xs) == len(layers):
            outputs = tuple(layer(x) for layer, x in zip(layers, xs, strict=True))
        else:
            raise ValueError(
                f"[Parallel] with {len(layers)} layers takes one input or {len(layers)} "
                f"inputs, got {len(xs)}"
            )
        return outputs if self.connection is None else self.connection(*outputs)

    def _sliced(self, *layers: Callable, **named: Callable) -> Parallel:
        return Parallel(self.connection, *layers, **named)

    def shown_children(self) -> list[tuple[str | None, Any]]:
        return [(None, self.connection)] + self._items()


def lookup(weight: mx.array, x: Any, layer: str) -> mx.array:
    """The rows ``weight[x]`` of a table for integer indices ``x``, checked to lie in
    ``[0, len(weight))`` (eagerly; traced, out-of-range rows are NaN): :class:`Embedding`'s
    lookup, which ``layer`` names in errors."""
    if not isinstance(x, mx.array) or not mx.issubdtype(x.dtype, mx.integer):
        got = x.dtype if isinstance(x, mx.array) else type(x).__name__
        raise TypeError(
            f"[{layer}] expected an mx.array of integer indices, got {got}; "
            f"convert class labels with x.astype(mx.int32)"
        )
    vocab = weight.shape[0]
    bounds = index_range(x)
    if bounds is None:  # traced (or empty): nothing to read back, mask instead
        return workarounds.take_rows(weight, x)
    if bounds[0] < 0 or bounds[1] >= vocab:
        raise ValueError(
            f"[{layer}] indices must lie in [0, {vocab}), "
            f"got values from {bounds[0]} to {bounds[1]}"
        )
    return weight[x]


class Embedding(Layer):
    """A lookup table: integer indices ``(...)`` give rows of ``weight``, ``(..., dims)``.

    ``Embedding(vocab, dims, *, init=standard normal)``: ``weight`` has shape
    ``(vocab, dims)`` (MLX's layout; Flux stores its transpose). Indices are 0-based and
    must lie in ``[0, vocab)``; any integer dtype and any shape, a 0-d index gives one row.

    Index checking: MLX's gather does not check bounds (an index past the end reads
    arbitrary memory or crashes), so each eager call checks the indices' range and raises
    a ``ValueError`` naming the offending values. That check reads two numbers back to the
    host, one synchronisation per call. Inside ``mx.compile``/``fluxlike.compile`` or
    ``mx.vmap`` nothing can be read back, so there the rows of out-of-range indices are NaN
    instead (memory-safe, and the loss turns NaN).

    Precision: policy "none"; the output has the weight's dtype (float32 under autocast,
    as in PyTorch).

    >>> import mlx.core as mx
    >>> from fluxlike import Embedding
    >>> emb = Embedding(10, 4)
    >>> emb
    Embedding(10 => 4)  # 40 parameters
    >>> emb(mx.array([[1, 2, 3], [4, 5, 9]])).shape
    (2, 3, 4)
    """

    def __init__(
        self,
        vocab: int,
        dims: int,
        *,
        init: Callable[[tuple[int, ...]], mx.array] = _standard_normal,
    ):
        super().__init__()
        vocab = check_size(vocab, "Embedding", "vocab")
        dims = check_size(dims, "Embedding", "dims")
        self.weight = initialise(init, (vocab, dims), "Embedding")

    def __call__(self, x: mx.array) -> mx.array:
        return lookup(self["weight"], x, "Embedding")

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ weight.T``: the table as the output layer of a model with tied embeddings
        (GPT-2, mlx-lm's Llama), ``(..., dims)`` to ``(..., vocab)`` logits. Unlike the lookup
        it is a matrix product, and computes in the compute dtype under autocast.

        >>> import mlx.core as mx
        >>> from fluxlike import Embedding
        >>> Embedding(10, 4).as_linear(mx.ones((2, 4))).shape
        (2, 10)
        """
        return kernels.linear(x, self["weight"], None, None, "Embedding.as_linear")

    def signature(self) -> str:
        vocab, dims = self.weight.shape
        return f"Embedding({vocab} => {dims})"
