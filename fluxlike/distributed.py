"""Data-parallel training on ``mx.distributed``, and precision policies for MLX's sharded layers.

fluxlike adds no transport of its own: the processes are started by ``mlx.launch`` (ring over
TCP, MPI, NCCL or JACCL) and talk through ``mx.distributed``. As in Flux's ``DistributedUtils``,
the distribution lives in the optimiser state and the data loader:

- ``setup(rule, model, distributed=True)`` (or an ``mx.distributed.Group``) checks that every
  rank holds the same parameter tree, broadcasts rank 0's parameters and buffers, and keeps a
  :class:`DataParallel` in the optimiser state;
- :func:`~fluxlike.update` then averages the gradients over the group (bucketed, as
  ``mlx.nn.utils.average_gradients`` does, optionally in a lower ``communication_dtype``)
  inside its compiled step, before the loss scale unscales them and the rule (clipping
  included) sees them, so the overflow decision is made on the reduced gradients and every
  rank takes the same step; BatchNorm running statistics are averaged after each step;
- ``DataLoader(..., distributed=True)`` gives each rank a disjoint shard of every epoch;
- :func:`~fluxlike.train` averages the loss over the group (so a non-finite loss stops every
  rank at the same batch) and shows its progress bar on rank 0 only;
  :func:`~fluxlike.savemodel` writes on rank 0 only, the others wait for it.

Parameters held by MLX's sharded layers (``fully_shard``'s :class:`FullyShardedModule`, the
tensor-parallel ``AllToShardedLinear``/``ShardedToAllLinear`` and their quantized forms) are
*local*: each rank holds its own shard, so they are neither broadcast nor averaged (their
gradients are already reduced by the layers themselves); their names, shapes and dtypes are
still checked. Those layers get precision policies here, so they run under
:func:`~fluxlike.autocast`. MLX 0.32.4's ring backend has no ``sum_scatter``, which
``fully_shard``'s backward uses: ``setup(..., distributed=...)`` (:func:`fit_backend`) gives
such models a backward that reduces with ``all_sum`` there.

Every rank must make the same calls in the same order: ``setup``, ``update``, ``train``,
``savemodel`` and making a distributed ``DataLoader`` communicate. An exception on one rank
only (a loss that raises there, say) leaves the others waiting in their next collective.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable
from functools import reduce
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    FullyShardedModule,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    sum_gradients,
)
from mlx.utils import tree_unflatten

from ._mlxtyping import tree_flatten
from .precision import kernels
from .precision.policy import autocast_policy

Group = mx.distributed.Group
BUCKET_BYTES = 32 * 1024**2  # as mlx.nn.utils.average_gradients
SHARDED_LAYERS = (
    FullyShardedModule, AllToShardedLinear, ShardedToAllLinear,
    QuantizedAllToShardedLinear, QuantizedShardedToAllLinear,
)
STATISTICS = ("running_mean", "running_var")  # BatchNorm's (fluxlike's and mlx.nn's)


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


def resolve_group(distributed: Any, where: str) -> Group | None:
    """The group a ``distributed=`` argument names: ``None``/``False`` none (one process),
    ``True`` the group of ``mx.distributed.init()``, a ``Group`` itself."""
    if distributed is None or distributed is False:
        return None
    if distributed is True:
        return mx.distributed.init()
    if isinstance(distributed, Group):
        return distributed
    raise TypeError(
        f"{where} distributed must be None (one process), True (the group of "
        f"mx.distributed.init()) or an mx.distributed.Group, got {distributed!r}"
    )


def _check_floating_dtype(dtype: Any, where: str) -> mx.Dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(
            f"{where} communication_dtype must be None (each gradient's own dtype) or a "
            f"floating dtype such as mx.bfloat16, got {dtype!r}"
        )
    return dtype


# -- collectives -----------------------------------------------------------------------------

def barrier(group: Group, failed: bool = False) -> int:
    """Wait until every rank of ``group`` gets here (an ``all_sum`` of a scalar, evaluated:
    ``mx.distributed`` has no barrier of its own). Each rank says whether it ``failed``;
    returns how many did, the same number on every rank."""
    count = mx.distributed.all_sum(mx.array(int(bool(failed)), mx.int32), group=group)
    return cast(int, count.item())


def _buckets(sizes: list[int], itemsize: int, limit: int) -> list[list[int]]:
    """Consecutive indices grouped until a group's bytes reach ``limit``."""
    groups: list[list[int]] = [[]]
    nbytes = 0
    for i, size in enumerate(sizes):
        if groups[-1] and nbytes >= limit:
            groups.append([])
            nbytes = 0
        groups[-1].append(i)
        nbytes += size * itemsize
    return groups if groups[0] else []


def _bucketed(
    arrays: list[mx.array], reduce_bucket: Callable[[mx.array], mx.array],
    bucket_bytes: int = BUCKET_BYTES,
) -> list[mx.array]:
    """``arrays`` with ``reduce_bucket`` applied to the concatenation of each bucket of
    same-dtype arrays (few large collectives instead of one per array, as
    ``average_gradients`` does; mixed dtypes go in buckets of their own dtype rather than one
    collective per array)."""
    out: list[mx.array | None] = [None] * len(arrays)
    by_dtype: dict[mx.Dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        sizes = [arrays[i].size for i in indices]
        for bucket in _buckets(sizes, dtype.size, bucket_bytes):
            members = [indices[j] for j in bucket]
            if len(members) == 1:
                a = arrays[members[0]]
                out[members[0]] = reduce_bucket(a.reshape(-1)).reshape(a.shape)
                continue
            flat = reduce_bucket(mx.concatenate([arrays[i].reshape(-1) for i in members]))
            bounds = reduce(lambda acc, i: acc + [acc[-1] + arrays[i].size], members, [0])
            for i, part in zip(members, mx.split(flat, bounds[1:-1]), strict=True):
                out[i] = part.reshape(arrays[i].shape)
    return cast("list[mx.array]", out)  # every slot filled


def broadcast(arrays: list[mx.array], group: Group, root: int = 0) -> list[mx.array]:
    """Rank ``root``'s values of ``arrays`` on every rank (lazily: nothing is evaluated).
    An ``all_sum`` to which the other ranks contribute zeros (``mx.distributed`` has no
    broadcast); booleans travel as uint8."""
    mine = group.rank() == root

    def one(flat: mx.array) -> mx.array:
        kind = flat.dtype
        wire = flat.astype(mx.uint8) if kind == mx.bool_ else flat
        wire = wire if mine else mx.zeros_like(wire)
        got = mx.distributed.all_sum(wire, group=group)
        return got.astype(kind) if kind == mx.bool_ else got

    return _bucketed(arrays, one)


def broadcast_int(value: int, group: Group, root: int = 0) -> int:
    """Rank ``root``'s non-negative int (below 2**31) on every rank (evaluated)."""
    return cast(int, broadcast([mx.array(value, mx.int32)], group, root)[0].item())


def _gather_bytes(data: bytes, group: Group) -> list[bytes]:
    """Every rank's ``data``, in rank order (two all-gathers: the lengths, then the bytes
    padded to the longest, as int32 words)."""
    lengths = cast("list[int]", mx.distributed.all_gather(mx.array([len(data)], mx.int32),
                                                          group=group).tolist())
    longest = max(lengths) + (-max(lengths)) % 4
    words = np.frombuffer(data.ljust(longest, b"\0"), dtype=np.int32)
    gathered = mx.distributed.all_gather(mx.array(words).reshape(1, -1), group=group)
    return [row.tobytes()[:n] for row, n in zip(np.array(gathered), lengths, strict=True)]


def check_same(entries: list[str], group: Group, where: str, what: str, fix: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank of ``group`` passed the same
    ``entries`` (one line each, e.g. a parameter's name, shape and dtype). One all-gather of a
    fingerprint when they agree; when they do not, the entries themselves are gathered so that
    the error names the first difference. Never hangs as long as every rank calls it."""
    text = "\n".join(entries).encode()
    digest = hashlib.sha256(text).digest()[:16]
    mine = mx.array(np.frombuffer(digest, dtype=np.int32).tolist() + [len(entries)], mx.int32)
    prints = cast("list[list[int]]",
                  mx.distributed.all_gather(mine.reshape(1, -1), group=group).tolist())
    if all(p == prints[0] for p in prints):
        return
    lists = [zlib.decompress(b).decode().split("\n") if b else []
             for b in _gather_bytes(zlib.compress(text), group)]
    reference = lists[0]
    problems = []
    for rank, other in enumerate(lists[1:], start=1):
        for i in range(max(len(other), len(reference))):
            a = reference[i] if i < len(reference) else "nothing"
            b = other[i] if i < len(other) else "nothing"
            if a != b:
                problems.append(f"rank {rank} has {b!r} where rank 0 has {a!r} (entry {i}; "
                                f"rank 0 has {len(reference)} entries, rank {rank} {len(other)})")
                break
    raise ValueError(
        f"{where} the ranks of the group hold different {what}: " + "; ".join(problems)
        + f"; {fix}"
    )


# -- the model's arrays ----------------------------------------------------------------------

def local_paths(model: nn.Module) -> tuple[str, ...]:
    """Dotted prefixes of the parts of ``model`` held by MLX's sharded layers (each rank its
    own shard)."""
    return tuple(name for name, m in model.named_modules() if isinstance(m, SHARDED_LAYERS))


def _is_local(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def _owner(path: str, model: nn.Module, prefixes: tuple[str, ...]) -> str:
    """The class name of the sharded layer holding ``path`` (the innermost)."""
    modules = dict(model.named_modules())
    inner = max((p for p in prefixes if _is_local(path, (p,))), key=len)
    return type(modules[inner]).__name__


def model_entries(model: nn.Module, trainable: Iterable[str]) -> list[str]:
    """One line per array of ``model``: its name, dtype, shape, and whether it is trained and
    whether it is a local shard: what :func:`check_same` compares across ranks."""
    trained = set(trainable)
    prefixes = local_paths(model)
    lines = []
    for path, a in tree_flatten(model.parameters()):
        if not isinstance(a, mx.array):
            lines.append(f"{path} {type(a).__name__}")
            continue
        role = "trained" if path in trained else "frozen"
        local = f" local to {_owner(path, model, prefixes)}" if _is_local(path, prefixes) \
            else ""
        lines.append(f"{path} {_name(a.dtype)} {tuple(a.shape)} {role}{local}")
    return lines


def _statistics(model: nn.Module, prefixes: tuple[str, ...]) -> list[tuple[nn.Module, str]]:
    """The BatchNorm running statistics of ``model`` that every rank holds whole."""
    found = []
    for name, m in model.named_modules():
        for key in STATISTICS:
            value = m.get(key) if isinstance(m, dict) else None
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating) and (
                not _is_local(f"{name}.{key}" if name else key, prefixes)
            ):
                found.append((m, key))
    return found


class DataParallel:
    """How one :class:`~fluxlike.OptState` trains over a group of processes: made by
    ``setup(..., distributed=...)``, kept in ``opt_state.distributed``.

    Attributes: ``group`` (the ``mx.distributed.Group``), ``rank``, ``size``,
    ``communication_dtype`` (``None``: each gradient travels in its own dtype) and
    ``bucket_bytes`` (arrays of one dtype are concatenated into all-reductions of about this
    many bytes). A group of size 1 communicates nothing.
    """

    def __init__(self, group: Group, communication_dtype: mx.Dtype | None = None,
                 local: tuple[str, ...] = (), bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.communication_dtype = communication_dtype
        self.local = tuple(local)
        self.bucket_bytes = int(bucket_bytes)

    def __repr__(self) -> str:
        dtype = "" if self.communication_dtype is None else (
            f", communication_dtype={_name(self.communication_dtype)}")
        return f"DataParallel(rank {self.rank} of {self.size}{dtype})"

    @property
    def active(self) -> bool:
        """Whether there is anyone to talk to (more than one process)."""
        return self.size > 1

    def _mean(self, flat: mx.array) -> mx.array:
        n, dtype, wire = self.size, flat.dtype, self.communication_dtype
        if wire is None or wire == dtype:
            return mx.distributed.all_sum(flat, group=self.group) / n
        # divided first: a sum of float16 gradients could overflow where their mean does not
        sent = (flat / n).astype(wire)
        return mx.distributed.all_sum(sent, group=self.group).astype(dtype)

    def average(self, grads: Any) -> Any:
        """``grads`` averaged over the group, leaves in their own dtypes; the gradients of
        local shards are left as they are. Graph operations only (no evaluation), so it runs
        inside ``mx.compile``."""
        if not self.active:
            return grads
        flat = tree_flatten(grads)
        shared = [i for i, (path, g) in enumerate(flat)
                  if isinstance(g, mx.array) and mx.issubdtype(g.dtype, mx.floating)
                  and not _is_local(path, self.local)]
        if not shared:
            return grads
        averaged = _bucketed([flat[i][1] for i in shared], self._mean, self.bucket_bytes)
        for i, value in zip(shared, averaged, strict=True):
            flat[i] = (flat[i][0], value)
        return tree_unflatten(flat)

    def sync_statistics(self, model: nn.Module) -> None:
        """Average ``model``'s BatchNorm running statistics over the group, in place (lazily).
        Called by :func:`~fluxlike.update` after each step, so they stay identical on every
        rank (each rank's forward still normalises with its own batch's statistics)."""
        if not self.active:
            return
        slots = _statistics(model, self.local)
        if not slots:
            return
        values = [m[key] for m, key in slots]
        n = self.size
        averaged = _bucketed(values, lambda f: mx.distributed.all_sum(f, group=self.group) / n,
                             self.bucket_bytes)
        for (m, key), value in zip(slots, averaged, strict=True):
            m[key] = value

    def mean(self, value: mx.array) -> mx.array:
        """``value`` (a loss) averaged over the group, lazily."""
        if not self.active:
            return value
        return mx.distributed.all_sum(value, group=self.group) / self.size


def prepare(model: nn.Module, trainable: Iterable[str], distributed: Any,
            communication_dtype: Any, where: str = "setup:") -> DataParallel | None:
    """What ``setup`` does for ``distributed=``: check every rank holds the same tree (a
    clear ``ValueError`` on every rank otherwise), then give every rank rank 0's arrays
    (parameters and buffers, local shards excepted). Returns the :class:`DataParallel`, or
    ``None`` without a group. Validates its arguments before any communication."""
    dtype = _check_floating_dtype(communication_dtype, where)
    group = resolve_group(distributed, where)
    if group is None:
        if dtype is not None:
            raise ValueError(
                f"{where} communication_dtype={_name(dtype)} needs distributed=True or a "
                f"group; one process communicates nothing"
            )
        return None
    parallel = DataParallel(group, dtype, local_paths(model))
    if not parallel.active:
        return parallel
    check_same(
        model_entries(model, trainable), group, where,
        "models (array names, dtypes, shapes, trained or frozen)",
        "build the same model on every rank (the same code and configuration) before "
        "setup(..., distributed=...)",
    )
    fit_backend(model, group)
    flat = [(path, a) for path, a in tree_flatten(model.parameters())
            if isinstance(a, mx.array) and not _is_local(path, parallel.local)]
    if flat:
        shared = broadcast([a for _, a in flat], group)
        mx.eval(shared)
        model.update(tree_unflatten(list(zip([p for p, _ in flat], shared, strict=True))),
                     strict=False)
    return parallel


def _has_sum_scatter(group: Group) -> bool:
    """Whether the group's backend has ``sum_scatter`` (a collective: every rank asks). MLX
    0.32.4's ring backend has not (``[ring] sum_scatter not supported``), and ``fully_shard``'s
    backward needs it."""
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
        return True
    except RuntimeError:
        return False


def _reduce_by_all_sum(module: FullyShardedModule, group: Group) -> None:
    """Give ``module`` (a ``FullyShardedModule``) a backward that reduces its gradients with
    ``all_sum`` and keeps this rank's slice, in place of ``sum_scatter`` (the same values,
    twice the traffic). The forward (the gather, in ``compute_dtype``) is MLX's own.
    Workaround for MLX 0.32.4's ring backend, which has no ``sum_scatter``."""
    gather, n, rank = module._gather_fn, group.size(), group.rank()

    @mx.custom_function
    def gathered(shards: list[mx.array]) -> list[mx.array]:
        return gather(shards)

    @gathered.vjp
    def gathered_vjp(shards: list[mx.array], cotangents: list[mx.array], _: Any) -> list:
        local = mx.concatenate([c.reshape(n, -1) for c in cotangents], axis=1)
        mine = mx.distributed.all_sum(local, group=group)[rank] / n
        bounds = reduce(lambda acc, s: acc + [acc[-1] + s.size], shards, [0])
        parts = mx.split(mine, bounds[1:-1])
        return [p.reshape(s.shape).astype(s.dtype) for p, s in zip(parts, shards, strict=True)]

    module._gather_fn = gathered


def fit_backend(model: nn.Module, group: Group) -> int:
    """Make ``model``'s ``FullyShardedModule``s train on ``group``'s backend: where it lacks
    ``sum_scatter`` (MLX 0.32.4's ring), their backward reduces with ``all_sum`` instead.
    A collective when the model has any (every rank must call it); returns how many were
    changed. ``setup(..., distributed=...)`` calls it."""
    sharded = [m for _, m in model.named_modules() if isinstance(m, FullyShardedModule)
               and not getattr(m, "_fluxlike_all_sum", False)]
    if not sharded or group.size() == 1 or _has_sum_scatter(group):
        return 0
    for m in sharded:
        _reduce_by_all_sum(m, group)
        object.__setattr__(m, "_fluxlike_all_sum", True)
    return len(sharded)


def on_rank0(group: Group | None, where: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only; the other ranks wait for it (a barrier). An exception on
    rank 0 is raised there and, as a ``RuntimeError`` naming ``where``, on every other rank."""
    if group is None or group.size() == 1:
        return fn()
    result, error = None, None
    if group.rank() == 0:
        try:
            result = fn()
        except Exception as e:  # report it to the others before raising it here
            error = e
    if barrier(group, failed=error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"{where} failed on rank 0 (see its error there)")
    return result


def save_group(distributed: Any, opt_state: Any, model: nn.Module, where: str) -> Group | None:
    """The group that ``savemodel`` writes for: ``distributed`` if given, else the
    optimiser state's; ``distributed=False`` writes from every caller. A model holding
    shards (rank 0's alone are not the model) is a ``ValueError`` on every rank."""
    if distributed is False:
        return None
    if distributed is not None:
        group = resolve_group(distributed, where)
    else:
        parallel = getattr(opt_state, "distributed", None)
        group = parallel.group if isinstance(parallel, DataParallel) else None
    if group is not None and group.size() > 1:
        local = local_paths(model)
        if local:
            raise ValueError(
                f"{where} the model holds shards (at {local[0] or 'the top'!r}: fully_shard "
                f"or a tensor-parallel layer), and rank 0's are not the whole model: save "
                f"each rank's to a path of its own with distributed=False"
            )
    return group


# -- data ------------------------------------------------------------------------------------

class DataShard:
    """One rank's share of each epoch's order, as PyTorch's ``DistributedSampler``: the
    order (of ``nobs`` observations) is padded with its own first entries to a multiple of
    the group size (``pad=True``, every example seen, a few twice) or cut to one (``pad=False``,
    the last ``nobs % size`` of the order dropped); rank ``r`` takes positions
    ``r, r + size, r + 2 size, ...``."""

    def __init__(self, rank: int, size: int, nobs: int, pad: bool):
        self.rank, self.world, self.pad = rank, size, pad
        self.nobs = nobs
        self.size = -(-nobs // size) if pad else nobs // size  # observations per rank

    def positions(self, order: mx.array | None) -> mx.array:
        """This rank's indices into the data for an epoch of ``order`` (``None``: 0..n-1)."""
        order = mx.arange(self.nobs) if order is None else order
        total = self.size * self.world
        if total > self.nobs:
            order = mx.concatenate([order, order[: total - self.nobs]])
        return order[self.rank : total : self.world]


def shard_loader(group: Group, nobs: int, batchsize: int, shuffle: bool, partial: bool,
                 seed: int | None) -> tuple[DataShard, int | None]:
    """The shard of a distributed DataLoader, after checking that every rank built the same
    loader (number of observations, batch size, shuffle, partial): a ``ValueError`` on every
    rank otherwise. Returns the shard and rank 0's ``seed`` for shuffling."""
    entries = [f"observations {nobs}", f"batchsize {batchsize}", f"shuffle {shuffle}",
               f"partial {partial}"]
    check_same(entries, group, "[DataLoader]", "loaders",
               "give every rank the whole data set and the same options: the loader shards it")
    if seed is not None:
        seed = broadcast_int(seed, group)
    return DataShard(group.rank(), group.size(), nobs, pad=partial), seed


# -- precision policies for MLX's sharded layers ---------------------------------------------

def _all_to_sharded(self: AllToShardedLinear, x: mx.array) -> mx.array:
    x = sum_gradients(self.group)(x)  # the cotangent of x is summed over the group
    return kernels.linear(x, self["weight"], self["bias"] if "bias" in self else None)


def _sharded_to_all(self: ShardedToAllLinear, x: mx.array) -> mx.array:
    y = mx.distributed.all_sum(kernels.linear(x, self["weight"]), group=self.group)
    return y + self["bias"].astype(y.dtype) if "bias" in self else y


def _register_policies() -> None:
    """Give MLX's sharded layers precision policies. The tensor-parallel linears are
    ``"down"``: inside a scope they multiply through fluxlike's kernels (on the CPU, half
    precision at float32 GEMM speed, as ``nn.Linear``); their quantized forms are ``"down"``
    with MLX's own forward (their scales and biases cast); ``FullyShardedModule`` is a
    container (``"none"``): the layers of its module cast the gathered parameters themselves."""
    autocast_policy("down", forward=_all_to_sharded)(AllToShardedLinear)
    autocast_policy("down", forward=_sharded_to_all)(ShardedToAllLinear)
    for cls in (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear):
        autocast_policy("down")(cls)
    autocast_policy("none")(FullyShardedModule)


_register_policies()
