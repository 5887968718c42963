"""Data handling as in Flux: mini-batch iteration and one-hot encoding.

MLX layout: observations lie on the **first** axis (Flux puts them on the last), and the
class axis of a one-hot matrix is the last: ``onehotbatch`` gives shape ``(n, classes)``.

>>> import mlx.core as mx
>>> from fluxlike import DataLoader, onecold, onehotbatch
>>> x, y = mx.zeros((10, 3)), mx.arange(10)
>>> [(bx.shape, by.shape) for bx, by in DataLoader((x, y), batchsize=4)]
[((4, 3), (4,)), ((4, 3), (4,)), ((2, 3), (2,))]
>>> onehotbatch([1, 0], [0, 1, 2])
array([[0, 1, 0],
       [1, 0, 0]], dtype=float32)
>>> onecold(mx.array([[0.1, 0.9], [0.8, 0.2]]), ["cat", "dog"])
['dog', 'cat']
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Hashable, ItemsView, Iterator, KeysView, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, cast

import mlx.core as mx
import numpy as np

from . import distributed as _distributed

_NO_DEFAULT = object()


def _as_array(x: Any, path: str) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, np.ndarray):
        return mx.array(x)  # mx.array converts float64 to float32, as MLX does everywhere
    raise TypeError(
        f"[DataLoader] data{path} must be an mx.array or a numpy array, got {type(x).__name__}"
    )


_KEYWORDS = {  # other libraries' spellings of DataLoader's keywords
    "batch_size": "the keyword is batchsize: DataLoader(data, batchsize=32)",
    "drop_last": "the keyword is partial: partial=False drops a last short batch",
}


def _clear_call_errors(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` with clear errors for other libraries' calls: the arrays given separately
    (Flux 0.12's ``DataLoader(X, Y)``), a positional batch size, PyTorch's keywords. Its
    signature (``inspect``, ``help``) stays ``init``'s."""
    known = [name for name in inspect.signature(init).parameters if name not in ("self", "data")]

    @functools.wraps(init)
    def checked(self: DataLoader, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1:
            if all(isinstance(a, (mx.array, np.ndarray)) for a in args):
                raise TypeError(
                    f"[DataLoader] takes the data as one argument, got {len(args)} arrays; "
                    f"pass the data as one tuple: DataLoader((X, Y), batchsize=32)"
                )
            raise TypeError(
                f"[DataLoader] takes one positional argument (the data), got {len(args)}; "
                f"the options are keywords: DataLoader(data, batchsize=32)"
            )
        for name in kwargs:
            if name not in known and name != "data":
                fix = _KEYWORDS.get(name, f"the keywords are {', '.join(known)}")
                raise TypeError(f"[DataLoader] unknown keyword {name!r}; {fix}")
        init(self, *args, **kwargs)

    return checked


class DataLoader:
    """Iterate over mini-batches of ``data``, observations on the first axis.

    ``DataLoader(data, *, batchsize=1, shuffle=False, partial=True, rng=None)``

    ``data`` is one array (``mx.array`` or numpy, converted once with ``mx.array``), or a
    tuple or dict of arrays with the same number of observations; a batch is then a tuple
    (of the same type, e.g. a named tuple) or a dict of arrays. ``len(loader)`` is the
    number of batches per epoch. ``shuffle=True`` draws a new order on every iteration (an
    epoch) from ``rng``: a ``numpy.random.Generator``, an int seed, or ``None`` to seed one
    from MLX's global random state (so ``mx.random.seed`` makes runs repeatable).
    ``partial=False`` drops a last batch smaller than ``batchsize`` (a ``batchsize`` larger
    than the data is then a ``ValueError``: the epoch would have no batch). ``rng`` is checked
    even when ``shuffle=False``.

    ``distributed`` (data parallelism): ``None`` (one process), ``True`` (the group of
    ``mx.distributed.init()``) or an ``mx.distributed.Group``. Every rank passes the whole
    data set and the same options (checked: a ``ValueError`` on every rank otherwise) and
    iterates over its own shard, as with PyTorch's ``DistributedSampler``: each epoch's order
    (shuffled with rank 0's seed, so the same on every rank, and a new order every epoch) is
    split round-robin, rank ``r`` taking positions ``r, r + size, ...``. With ``partial=True``
    the order is first padded with its own first ``-nobs % size`` entries (every example is
    seen, those few twice; ``drop_last=False``), with ``partial=False`` its last
    ``nobs % size`` entries are dropped (``drop_last=True``) and then, on every rank alike, a
    last short batch. Every rank has the same number of batches (``len(loader)``, per rank),
    of the same sizes. Making a distributed loader communicates (the check and the seed):
    every rank makes the same loaders in the same order.

    >>> import mlx.core as mx
    >>> from fluxlike import DataLoader
    >>> loader = DataLoader(mx.arange(5), batchsize=2)
    >>> len(loader), [b.tolist() for b in loader]
    (3, [[0, 1], [2, 3], [4]])
    >>> [b.tolist() for b in DataLoader(mx.arange(5), batchsize=2, partial=False)]
    [[0, 1], [2, 3]]
    >>> sorted(sum((b.tolist() for b in DataLoader(mx.arange(5), shuffle=True, rng=0)), []))
    [0, 1, 2, 3, 4]
    >>> DataLoader({"x": mx.zeros((6, 2)), "y": mx.zeros(6)}, batchsize=4, shuffle=True)
    DataLoader(dict of 2 arrays, 6 observations, batchsize=4, shuffle=True)
    """

    # Declared here for the type checker: ``__init__`` is wrapped (``_clear_call_errors``).
    shard: _distributed.DataShard | None
    rng: np.random.Generator | None
    _data: Any
    _arrays_list: list[mx.array]
    batchsize: int
    shuffle: bool
    partial: bool
    nobs: int

    @_clear_call_errors
    def __init__(
        self,
        data: Any,
        *,
        batchsize: int = 1,
        shuffle: bool = False,
        partial: bool = True,
        rng: np.random.Generator | int | None = None,
        distributed: Any = None,
    ):
        if (
            isinstance(batchsize, bool)
            or not isinstance(batchsize, numbers.Integral)
            or batchsize < 1
        ):
            raise ValueError(
                f"[DataLoader] batchsize must be a positive integer, got {batchsize!r}"
            )
        for name, flag in (("shuffle", shuffle), ("partial", partial)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(
                    f"[DataLoader] {name} must be True or False, got {flag!r}; "
                    f"write {name}={bool(flag)!r} if that is what you mean"
                    if isinstance(flag, (int, float)) else
                    f"[DataLoader] {name} must be True or False, got {flag!r}"
                )
        arrays = self._arrays(data)
        sizes = {name: a.shape[0] for name, a in arrays}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"data{name} has {n}" for name, n in sizes.items())
            raise ValueError(
                f"[DataLoader] all arrays must have the same number of observations "
                f"(first axis): {listed}"
            )
        nobs = next(iter(sizes.values()))
        if nobs == 0:
            raise ValueError("[DataLoader] data has no observations (its first axis is empty)")
        if not partial and batchsize > nobs:
            # Flux (MLUtils) warns and shrinks the batch to nobs; an epoch of no batches
            # would make train() return nan, so say it here instead.
            raise ValueError(
                f"[DataLoader] batchsize={batchsize} is larger than the {nobs} observations, "
                f"and partial=False drops the only (short) batch: use partial=True or a "
                f"batchsize of at most {nobs}"
            )
        _check_rng(rng)  # also when not shuffling: a wrong argument is a mistake either way
        group = _distributed.resolve_group(distributed, "[DataLoader]")
        self.shard = None  # data parallelism: this rank's share of each epoch
        if group is not None and group.size() > 1:
            seed = _seed(rng) if shuffle else None
            self.shard, seed = _distributed.shard_loader(
                group, nobs, int(batchsize), bool(shuffle), bool(partial), seed)
            if self.shard.size == 0 or (not partial and batchsize > self.shard.size):
                raise ValueError(
                    f"[DataLoader] {nobs} observations over {group.size()} ranks leave "
                    f"{self.shard.size} per rank, fewer than batchsize={batchsize} with "
                    f"partial=False: use a smaller batchsize or partial=True"
                )
            rng = seed
        self.rng = _generator(rng) if shuffle else None
        self._data = data
        self._arrays_list = [a for _, a in arrays]
        self.batchsize = int(batchsize)
        self.shuffle = bool(shuffle)
        self.partial = bool(partial)
        self.nobs = nobs

    @staticmethod
    def _arrays(data: Any) -> list[tuple[str, mx.array]]:
        if isinstance(data, tuple):
            items = [(f"[{i}]", x) for i, x in enumerate(data)]
        elif isinstance(data, dict):
            items = [(f"[{k!r}]", x) for k, x in data.items()]
        elif isinstance(data, (mx.array, np.ndarray)):
            items = [("", data)]
        else:
            raise TypeError(
                f"[DataLoader] data must be an array, or a tuple or dict of arrays, "
                f"got {type(data).__name__}"
            )
        if not items:
            raise ValueError(f"[DataLoader] data is an empty {type(data).__name__}")
        arrays = [(name, _as_array(x, name)) for name, x in items]
        for name, a in arrays:
            if a.ndim == 0:
                raise ValueError(
                    f"[DataLoader] data{name} is a scalar; observations lie on the first axis"
                )
        return arrays

    def __len__(self) -> int:
        full, rest = divmod(self.nobs if self.shard is None else self.shard.size, self.batchsize)
        return full + (1 if rest and self.partial else 0)

    def _pack(self, batch: list[mx.array]) -> Any:
        data = self._data
        if isinstance(data, dict):
            return dict(zip(data.keys(), batch, strict=True))
        if isinstance(data, tuple):
            # a named tuple is rebuilt field by field, a plain tuple from an iterable
            return type(data)(*batch) if hasattr(data, "_fields") else tuple(batch)
        return batch[0]

    def __iter__(self) -> Iterator[Any]:
        rng = cast(np.random.Generator, self.rng)  # set whenever shuffle is
        order = mx.array(rng.permutation(self.nobs)) if self.shuffle else None
        nobs = self.nobs
        if self.shard is not None:  # the same order on every rank: take this rank's share
            order, nobs = self.shard.positions(order), self.shard.size
        for i in range(len(self)):
            start, stop = i * self.batchsize, min((i + 1) * self.batchsize, nobs)
            if order is None:
                yield self._pack([a[start:stop] for a in self._arrays_list])
            else:
                rows = order[start:stop]
                yield self._pack([mx.take(a, rows, axis=0) for a in self._arrays_list])

    def __repr__(self) -> str:
        data = self._data
        if isinstance(data, (tuple, dict)):
            what = f"{type(data).__name__} of {len(data)} arrays"
        else:
            what = f"array of shape {tuple(self._arrays_list[0].shape)}"
        options = f"batchsize={self.batchsize}"
        options += ", shuffle=True" if self.shuffle else ""
        options += ", partial=False" if not self.partial else ""
        if self.shard is not None:
            options += f", distributed=rank {self.shard.rank} of {self.shard.world}"
        return f"DataLoader({what}, {self.nobs} observations, {options})"


def _check_rng(rng: Any) -> None:
    if rng is None or isinstance(rng, np.random.Generator):
        return
    if isinstance(rng, bool) or not isinstance(rng, numbers.Integral):
        raise TypeError(
            f"[DataLoader] rng must be a numpy Generator, an int seed or None, "
            f"got {type(rng).__name__}"
        )
    if rng < 0:  # numpy's seeds are non-negative
        raise ValueError(f"[DataLoader] rng must be a non-negative int seed, got {rng!r}")


def _seed(rng: np.random.Generator | int | None) -> int:
    """An int seed from an ``rng`` argument (checked): the int itself, one drawn from a
    Generator, or for ``None`` one from MLX's global random state. A distributed loader
    shuffles with rank 0's."""
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(0, 2**31 - 1))
    return cast(int, mx.random.randint(0, 2**31 - 1, ()).item()) if rng is None else int(rng)


def _generator(rng: np.random.Generator | int | None) -> np.random.Generator:
    """The shuffling generator (``rng`` checked by ``_check_rng``): ``rng`` itself, one seeded
    with the int ``rng``, or for ``None`` one seeded from MLX's global random state (as Flux
    follows Julia's default RNG)."""
    if rng is None:
        rng = cast(int, mx.random.randint(0, 2**31 - 1, ()).item())
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(int(rng))  # an int seed (numbers.Integral)


def _labels_list(labels: Any, where: str) -> list:
    if isinstance(labels, (mx.array, np.ndarray)):
        if labels.ndim != 1:
            raise ValueError(
                f"[{where}] labels must be one-dimensional, got shape {tuple(labels.shape)}"
            )
        return cast(list, labels.tolist())  # one-dimensional
    if isinstance(labels, bytes) or not hasattr(labels, "__iter__"):
        raise TypeError(f"[{where}] labels must be a sequence, got {type(labels).__name__}")
    if _unordered(labels):
        raise TypeError(f"[{where}] labels must be ordered, got a {type(labels).__name__}; "
                        f"pass a list")
    return list(labels)  # a str is its characters, as in Flux (onehotbatch("abca", "abc"))


def _unordered(x: Any) -> bool:
    """A set-like collection whose order follows the hash seed (a dict's keys do not)."""
    return isinstance(x, (set, frozenset)) or (
        isinstance(x, AbstractSet) and not isinstance(x, (KeysView, ItemsView))
    )


def _class_index(classes: Sequence[Hashable], where: str) -> dict:
    if isinstance(classes, (mx.array, np.ndarray)):
        classes = classes.tolist()
    if classes is None or isinstance(classes, (bytes, numbers.Number)) or not hasattr(
        classes, "__iter__"
    ):
        hint = f"; for {classes} classes 0 to {classes - 1} pass range({classes})" if (
            isinstance(classes, numbers.Integral) and not isinstance(classes, bool)
            and int(classes) > 0) else ""
        raise TypeError(
            f"[{where}] classes must be an ordered sequence of labels such as [0, 1, 2] or "
            f"'abc', got {type(classes).__name__}{hint}"
        )
    if _unordered(classes):
        raise TypeError(
            f"[{where}] classes must be ordered, got a {type(classes).__name__} (whose order "
            f"changes with the hash seed, and so would the columns); pass sorted(classes) "
            f"or a list in the order you want"
        )
    index = {}
    for i, c in enumerate(classes):
        try:
            hash(c)
        except TypeError:
            raise TypeError(
                f"[{where}] every class must be hashable, got {type(c).__name__} {c!r} at "
                f"position {i}; use tuples instead of lists"
            ) from None
        if c in index:
            raise ValueError(f"[{where}] classes must be distinct, {c!r} appears twice")
        index[c] = i
    if not index:
        raise ValueError(f"[{where}] classes is empty")
    return index


def onehotbatch(labels: Any, classes: Sequence[Hashable], default: Any = _NO_DEFAULT) -> mx.array:
    """One-hot encode ``labels`` against ``classes``: a float32 array ``(n, len(classes))``.

    Row ``i`` has a one in the column of ``labels[i]``'s position in ``classes`` (the class axis
    is last, MLX's layout). A label not in ``classes`` is a ``ValueError``, unless ``default``
    (itself one of the classes) is given: such labels are then encoded as ``default``.

    >>> from fluxlike import onehotbatch
    >>> onehotbatch(["b", "z"], ["a", "b", "c"], default="c")
    array([[0, 1, 0],
           [0, 0, 1]], dtype=float32)
    >>> onehotbatch("aba", "ab")  # a string is a sequence of characters, as in Flux
    array([[1, 0],
           [0, 1],
           [1, 0]], dtype=float32)
    >>> onehotbatch([3], [0, 1, 2])
    Traceback (most recent call last):
    ...
    ValueError: [onehotbatch] label 3 is not one of the classes [0, 1, 2]; ...
    """
    index = _class_index(classes, "onehotbatch")
    fallback = None
    if default is not _NO_DEFAULT:
        if default not in index:
            raise ValueError(f"[onehotbatch] default {default!r} is not one of the classes")
        fallback = index[default]
    columns = []
    for label in _labels_list(labels, "onehotbatch"):
        column = index.get(label, fallback)
        if column is None:
            shown = list(index)
            shown = shown if len(shown) <= 20 else shown[:20] + ["..."]
            raise ValueError(
                f"[onehotbatch] label {label!r} is not one of the classes {shown}; "
                f"pass default=<class> to encode unknown labels"
            )
        columns.append(column)
    eye = np.zeros((len(columns), len(index)), dtype=np.float32)
    eye[np.arange(len(columns)), columns] = 1
    return mx.array(eye)


def onehot(label: Hashable, classes: Sequence[Hashable], default: Any = _NO_DEFAULT) -> mx.array:
    """One-hot encode one label: a float32 vector of length ``len(classes)``.

    >>> from fluxlike import onehot
    >>> onehot("b", ["a", "b", "c"])
    array([0, 1, 0], dtype=float32)
    """
    return onehotbatch([label], classes, default)[0]


def onecold(y: Any, classes: Sequence[Hashable] | None = None) -> Any:
    """The inverse of :func:`onehotbatch`: the position of the maximum along the last axis.

    Without ``classes`` the result is an ``mx.array`` of int32 indices (shape ``y.shape[:-1]``,
    a scalar array for a single vector); with ``classes`` the indices are replaced by the
    class labels: one label for a vector, a list (nested for more axes) for a batch.

    >>> import mlx.core as mx
    >>> from fluxlike import onecold
    >>> onecold(mx.array([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1]]))
    array([1, 0], dtype=int32)
    >>> onecold(mx.array([0.1, 0.9, 0.0]), ["a", "b", "c"])
    'b'
    """
    if isinstance(y, np.ndarray):
        y = mx.array(y)
    if not isinstance(y, mx.array):
        raise TypeError(f"[onecold] expected an mx.array, got {type(y).__name__}")
    if y.ndim == 0:
        raise ValueError("[onecold] expected at least one axis (the class axis), got a scalar")
    if y.shape[-1] == 0:
        raise ValueError(
            f"[onecold] the class axis (the last) of y is empty (shape {tuple(y.shape)}): "
            f"there is no class to pick; y must have one entry per class"
        )
    indices = mx.argmax(y, axis=-1).astype(mx.int32)
    if classes is None:
        return indices
    classes = list(classes.tolist() if isinstance(classes, (mx.array, np.ndarray)) else classes)
    if len(classes) != y.shape[-1]:
        raise ValueError(
            f"[onecold] y has {y.shape[-1]} entries on its last axis but there are "
            f"{len(classes)} classes"
        )

    def label(i: Any) -> Any:
        return [label(j) for j in i] if isinstance(i, list) else classes[i]

    return label(indices.tolist())
