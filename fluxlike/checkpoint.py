"""Model state and checkpoints, as Flux's ``state``/``loadmodel!``, in safetensors files.

:func:`state` is a model's nested dict of arrays (everything in ``model.parameters()``,
frozen BatchNorm running statistics included); :func:`loadmodel` loads such a dict back.
:func:`savemodel` writes a model, and optionally an optimiser state from
:func:`~fluxlike.setup`, to one safetensors file; :func:`loadcheckpoint` restores both.

Loading is all or nothing: every name, shape and dtype kind is checked before anything is
changed, and the first mismatch is a ``ValueError`` naming it. As in Flux's ``loadmodel!``,
model arrays are converted to the dtype the model already has, so a bfloat16 checkpoint loads
into a float32 model; only the *kind* must agree (a floating array cannot fill an integer
slot). The optimiser state is checked by the optimiser state's own ``load_state`` (exact
names, shapes and dtypes), before the model is changed.

File layout: model arrays are stored under ``"model."`` + their flattened name (e.g.
``"model.layers.0.weight"``), optimiser state under ``"opt."``; non-array leaves (Python
numbers, strings, ``None``) go, as JSON, into the file's metadata, and so do the class
names of the optimiser (``"optimizer"``), which :func:`loadcheckpoint` compares with those
of the state it loads into, and the rule with every hyperparameter it had at the save
(``"rule"``, as :func:`fluxlike.optimisers.hyperparameters.recorded` writes it), which
:func:`loadcheckpoint` restores. Each of those entries came in a later version than the
layout: a file without one loads as before it. The file is a plain safetensors file:
``mx.load(path)`` reads its arrays.

Faults: a save writes a temporary file beside the target (named after the host, process and
thread, so that concurrent saves to one path never share one: the last to finish wins, each
file whole), flushes it to disk, renames it over the target and flushes the directory, so a
crash or power loss leaves the old checkpoint or the new one; a killed save's temporary is
removed by the next save to that path. A load reads the whole file first (the model then owns
its arrays: rewriting or truncating the file afterwards cannot reach it), and a file that is
truncated, empty or malformed in any way is a ``ValueError`` naming the file and the fault.
float64 entries (which other writers store and MLX's own reader refuses) load, converted to
the model's dtypes.

File names: MLX's ``Module.save_weights`` picks the format by the extension (``.npz`` or
``.safetensors``) and refuses others. A checkpoint needs safetensors (its metadata), so
:func:`savemodel` requires a ``.safetensors`` name. :func:`loadcheckpoint` goes by the
content instead: it reads safetensors files of any name (as earlier versions wrote them) and
MLX's ``.npz`` weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map_with_path, tree_unflatten

from . import distributed as _distributed
from ._mlxtyping import tree_flatten
from ._stack import outside_stacklevel
from .optimisers.hyperparameters import (
    ScheduleNotStored,
    follow,
    recorded,
    replaced_schedules,
    restored,
    saved_rule,
)
from .optimisers.rules import Rule

FORMAT = "fluxlike"
_MODEL, _OPT = "model.", "opt."
_PLAIN = (bool, int, float, str, type(None))
_ZIP_MAGIC = b"PK\x03\x04"  # an .npz file is a zip archive


def state(model: nn.Module) -> dict:
    """The model's arrays as a nested dict (lists for list children), like Flux's ``state``.

    Includes non-trainable arrays such as BatchNorm's running statistics. The arrays are the
    model's own (MLX arrays are values: later training replaces rather than mutates them).

    >>> from fluxlike import BatchNorm, Chain, Dense, state
    >>> sorted(state(BatchNorm(3)))
    ['bias', 'running_mean', 'running_var', 'weight']
    >>> state(Chain(Dense(3, 2), Dense(2, 1)))["layers"][1]["weight"].shape
    (1, 2)
    """
    _check_module(model, "state")
    return model.parameters()


def loadmodel(model: nn.Module, source: Any) -> nn.Module:
    """Load ``source`` (a :func:`state` dict, a flat dict of dotted names such as
    ``{"layers.0.weight": ...}``, or another model) into ``model`` in place; returns ``model``.

    Every array of the model must be present with the same shape, and no other name may be;
    arrays are converted to the model's dtypes. On any mismatch a ``ValueError`` names the
    first one and the model is left unchanged.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, loadmodel, state
    >>> a, b = Dense(3, 2), Dense(3, 2)
    >>> bool(mx.array_equal(loadmodel(b, state(a)).weight, a.weight))
    True
    >>> loadmodel(b, state(Dense(4, 2)))
    Traceback (most recent call last):
    ...
    ValueError: [loadmodel] shape mismatch at 'weight': model has (2, 3), checkpoint has (2, 4)
    """
    _check_module(model, "loadmodel")
    if isinstance(source, nn.Module):
        source = source.parameters()
    if not isinstance(source, (dict, list, tuple)):
        raise TypeError(
            f"[loadmodel] expected a state dict (from fluxlike.state) or a model, "
            f"got {type(source).__name__}"
        )
    new = _matched(model.parameters(), dict(tree_flatten(source)), "loadmodel", "", "model")
    model.update(new)
    return model


def savemodel(
    path: str | os.PathLike, model: nn.Module, opt_state: Any = None, *, distributed: Any = None
) -> None:
    """Write ``model`` (and ``opt_state`` from :func:`~fluxlike.setup`, if given) to one
    safetensors file at exactly ``path``, whose name must end in ``.safetensors`` (as for
    MLX's ``save_weights``, the extension names the format). The write is atomic and
    durable: a crash leaves either the old file or the new one (see the module's notes on
    faults); saves from several threads or processes to one path each leave a whole file.

    Data parallelism: with an ``opt_state`` from ``setup(..., distributed=...)`` (or
    ``distributed=True``/a group here) only rank 0 writes, and every rank returns once it has
    (a barrier; if rank 0 fails, the others raise ``RuntimeError``). All ranks hold the same
    model and state, so that file is the group's checkpoint; :func:`loadcheckpoint` reads it
    on every rank, or into one process. ``distributed=False`` writes from every caller.

    >>> import mlx.core as mx, tempfile, os
    >>> from fluxlike import Dense, loadcheckpoint, savemodel
    >>> path = os.path.join(tempfile.mkdtemp(), "dense.safetensors")
    >>> a, b = Dense(3, 2), Dense(3, 2)
    >>> savemodel(path, a)
    >>> sorted(mx.load(path))
    ['model.bias', 'model.weight']
    >>> bool(mx.array_equal(loadcheckpoint(path, b).weight, a.weight))
    True
    >>> savemodel(path.replace(".safetensors", ".npz"), a)
    Traceback (most recent call last):
    ...
    ValueError: [savemodel] a checkpoint is a safetensors file: name it 'dense.safetensors' ...
    """
    _check_module(model, "savemodel")
    group = _distributed.save_group(distributed, opt_state, model, "[savemodel]")
    if group is not None and group.size() > 1:  # rank 0 writes, the others wait for it
        _distributed.on_rank0(group, "[savemodel]",
                              lambda: savemodel(path, model, opt_state, distributed=False))
        return
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(
            f"[savemodel] a checkpoint is a safetensors file: name it "
            f"'{path.stem}.safetensors' (got {str(path)!r}; the extension names the format, "
            f"as for MLX's save_weights)"
        )
    arrays: dict[str, mx.array] = {}
    plain: dict[str, Any] = {}
    trees = [(_MODEL, model.parameters())]
    if opt_state is not None:
        trees.append((_OPT, _opt_tree(opt_state, "savemodel")))
    for prefix, tree in trees:
        for name, leaf in tree_flatten(tree):
            if isinstance(leaf, mx.array):
                arrays[prefix + name] = leaf
            elif isinstance(leaf, _PLAIN):
                plain[prefix + name] = leaf
            else:
                raise TypeError(
                    f"[savemodel] cannot store {type(leaf).__name__} at '{prefix}{name}': "
                    f"only arrays, numbers, strings and None"
                )
    metadata = {"format": FORMAT, "plain": json.dumps(plain)}
    kind = None if opt_state is None else _optimizer_kind(opt_state)
    if kind is not None:
        metadata["optimizer"] = json.dumps(kind)
    rule = None if opt_state is None else _recorded_rule(opt_state)
    if rule is not None:
        metadata["rule"] = json.dumps(rule)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"[savemodel] no directory {str(path.parent)!r} to write into")
    if path.is_dir():
        raise IsADirectoryError(
            f"[savemodel] {str(path)!r} is a directory: give the path of a file inside it, "
            f"such as {str(path / 'model.safetensors')!r}"
        )
    _write(path, arrays, metadata)


# Temporary files are named after the target, the host, the process, the thread and a random
# token, so that concurrent saves to one path (threads, processes, machines sharing a file
# system) never share one; mx.save_safetensors insists on the suffix.
_TMP_SUFFIX = ".tmp.safetensors"
_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"
_ABANDONED = 24 * 3600  # another machine's temporary this much older than now: its save died


def _write(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Write atomically and durably: a temporary file beside ``path``, flushed to disk, renamed
    over ``path``, and the directory flushed. A crash at any point leaves the old file or the
    new one (and perhaps a temporary file, removed by the next save to ``path``)."""
    _remove_stale_temporaries(path)
    token = f"{_HOST}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
    tmp = path.with_name(f".{path.name}.{token}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on some platforms: nothing to flush there
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files that earlier saves to ``path`` left when they were killed:
    this machine's of processes no longer running (a live process may be writing its own),
    another machine's only once a day old. Temporaries named as earlier versions named them
    (``.<name>.<pid>.tmp.safetensors``) count as this machine's."""
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_TMP_SUFFIX)):
            continue
        parts = name[len(prefix) : -len(_TMP_SUFFIX)].rsplit(".", 3)
        if len(parts) == 1 and parts[0].isdigit():
            host, pid = _HOST, int(parts[0])
        elif len(parts) == 4 and parts[1].isdigit():
            host, pid = parts[0], int(parts[1])
        else:
            continue
        try:
            if host == _HOST:
                if _running(pid):
                    continue
            elif time.time() - os.stat(path.parent / name).st_mtime < _ABANDONED:
                continue
            os.unlink(path.parent / name)
        except OSError:  # another save removed it first
            pass


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or no way to tell: keep it
        return True
    return True


def loadcheckpoint(path: str | os.PathLike, model: nn.Module, opt_state: Any = None) -> nn.Module:
    """Restore ``model`` (and ``opt_state``, if given) from a :func:`savemodel` file; returns
    ``model``.

    The model is checked as in :func:`loadmodel`, the optimiser state by its own
    ``load_state``, and only when both fit is either changed. Without ``opt_state`` a stored
    optimiser state is ignored (loading weights for inference); with it, the file must hold
    one, saved from the same kind of optimiser (the class names recorded by
    :func:`savemodel` must agree, or one be a subclass of the other, such as ``Adam`` and
    ``AdamW``; files without them are not checked). A file written by ``model.save_weights``
    (MLX's own layout, no prefixes; ``.safetensors`` or ``.npz``) loads as model weights.
    The format is read from the file's content, whatever its name.

    The rule's hyperparameters come back too, as PyTorch's ``load_state_dict`` and
    Optimisers.jl's state tree bring them: where ``opt_state``'s rule is the saved one
    (the same rules, chained and wrapped alike, whatever their values), every
    hyperparameter becomes the saved value (betas, eps, ``ClipNorm``'s max_norm,
    ``WeightDecay``'s decay, ``AccumGrad``'s n...), as :func:`~fluxlike.adjust` would set
    it, so the run goes on exactly as it would have. A learning-rate schedule is a function,
    which a file cannot hold: give ``setup`` the same schedule (it goes on from the saved
    step count); a state whose rule has a number there gets the state alone (the learning
    rate with it: the schedule's last value), with a ``UserWarning``. A rule of
    another structure whose state fits all the same (Adam's state into ``AdamW``, a
    gradient transform added in front, an ``mlx.optimizers`` optimiser) gets the state
    alone, keeping the hyperparameters it was set up with, with a ``UserWarning`` saying
    so. A file saved before checkpoints recorded the rule (no ``"rule"`` metadata entry)
    restores the state alone, as then: the learning rate (an array of the state) comes
    back, the other hyperparameters stay those given to ``setup``.

    >>> import tempfile, os
    >>> from fluxlike import Adam, Dense, adjust, loadcheckpoint, savemodel, setup
    >>> path = os.path.join(tempfile.mkdtemp(), "run.safetensors")
    >>> model = Dense(3, 2)
    >>> saved = setup(Adam(), model)
    >>> adjust(saved, 0.05, betas=(0.5, 0.6), eps=1e-3)
    >>> savemodel(path, model, saved)
    >>> resumed, opt_state = Dense(3, 2), setup(Adam(), Dense(3, 2))
    >>> loadcheckpoint(path, resumed, opt_state)
    Dense(3 => 2)  # 8 parameters
    >>> opt_state.state["optimizer"]["step"]
    array(0, dtype=uint64)
    >>> opt_state.rule
    Adam(lr=0.05, betas=(0.5, 0.6), eps=0.001)
    """
    _check_module(model, "loadcheckpoint")
    if opt_state is not None:
        _opt_tree(opt_state, "loadcheckpoint")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"[loadcheckpoint] {str(path)!r} is a directory: give the path "
                                f"of a checkpoint file inside it")
    if not path.is_file():
        raise FileNotFoundError(f"[loadcheckpoint] no checkpoint file at {str(path)!r}")
    arrays, metadata = _read(path)
    if metadata.get("format") != FORMAT:  # plain MLX weights
        model_entries, opt_entries, prefix = dict(arrays), {}, ""
    else:
        entries: dict[str, Any] = {**arrays, **_plain(metadata, path)}
        model_entries = _strip(entries, _MODEL)
        opt_entries = _strip(entries, _OPT)
        prefix = _MODEL
        stray = sorted(k for k in entries if not k.startswith((_MODEL, _OPT)))
        if stray:
            raise ValueError(f"[loadcheckpoint] unexpected entry '{stray[0]}' in {str(path)!r}")
    try:
        new_model = _matched(model.parameters(), model_entries, "loadcheckpoint", prefix, "model")
    except ValueError as e:
        raise ValueError(f"{e} (in {str(path)!r})") from None
    if opt_state is not None:
        if not opt_entries:
            raise ValueError(
                f"[loadcheckpoint] {str(path)!r} holds no optimiser state; "
                f"call loadcheckpoint(path, model) to load the model alone"
            )
        _check_optimizer_kind(metadata.get("optimizer"), opt_state, path)
        rule, other = _restored_rule(metadata.get("rule"), opt_state, path,
                                     opt_entries.get("optimizer.learning_rate"))
        # OptState.load_state validates everything and changes nothing on a mismatch; it
        # also makes the loss scale a float16 run saved if this state has none yet.
        # float64 entries (another writer's; MLX writes none) take the state's own dtype
        current = dict(tree_flatten(opt_state.state))
        for name, value in opt_entries.items():
            now = current.get(name)
            if isinstance(value, mx.array) and value.dtype == mx.float64 and isinstance(
                now, mx.array
            ) and mx.issubdtype(now.dtype, mx.floating):
                opt_entries[name] = value.astype(now.dtype)
        try:
            opt_state.load_state(tree_unflatten(list(opt_entries.items())))
        except ValueError as e:
            raise ValueError(f"[loadcheckpoint] optimiser state in {str(path)!r}: {e}") from e
        if rule is not None:  # (checked above: setting it cannot fail)
            follow(opt_state, rule)
        if other is not None:
            warnings.warn(other, UserWarning, stacklevel=outside_stacklevel())
    model.update(new_model)
    return model


# safetensors' dtype names; MLX's own reader refuses F64 (see fluxlike.workarounds), one
# reason why fluxlike reads the files itself
_DTYPES = {
    "BOOL": (np.bool_, mx.bool_), "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
    "U16": (np.uint16, mx.uint16), "I16": (np.int16, mx.int16),
    "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32),
    "U64": (np.uint64, mx.uint64), "I64": (np.int64, mx.int64),
    "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "F32": (np.float32, mx.float32), "F64": (np.float64, mx.float64),
    "C64": (np.complex64, mx.complex64),
}
_MAX_HEADER = 100 << 20  # as the safetensors format itself caps it


def _read(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata of a safetensors file (or of MLX's ``.npz`` weights), read
    whole into memory: the arrays own their data (a later rewrite of the file cannot reach
    them). Anything malformed is a ``ValueError`` naming the file and what is wrong."""
    def bad(what: str) -> ValueError:
        return ValueError(f"[loadcheckpoint] {str(path)!r} is not a readable checkpoint: {what}")

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise bad(f"it cannot be read ({e.strerror or e})") from None
    if data[: len(_ZIP_MAGIC)] == _ZIP_MAGIC:  # MLX's save_weights("....npz"): no metadata
        try:
            arrays = mx.load(str(path), format="npz")
            mx.eval(arrays)
        except (RuntimeError, ValueError, OSError) as e:
            raise bad(f"a damaged .npz archive ({e})") from None
        return cast("dict[str, mx.array]", arrays), {}  # format="npz": a dict
    if len(data) < 8:
        raise bad(f"the file has {len(data)} bytes, too few for a safetensors header "
                  f"(an interrupted download or copy?)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER, len(data) - 8):
        raise bad(f"its header claims {size} bytes, the file has {len(data) - 8} after the "
                  f"length (a truncated file?)")
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"its header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("its '__metadata__' is not an object of strings")
    body = memoryview(data)[8 + size :]
    arrays = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], info["shape"]
            start, end = info["data_offsets"]
            ok = (dtype in _DTYPES and isinstance(shape, list)
                  and all(type(n) is int and n >= 0 for n in shape)
                  and type(start) is int and type(end) is int and 0 <= start <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise bad(f"the header entry of {name!r} is malformed: {str(info)[:200]}")
        np_dtype, mx_dtype = _DTYPES[dtype]
        count = math.prod(shape)
        if end - start != count * np.dtype(np_dtype).itemsize:
            raise bad(f"{name!r} ({dtype}, shape {tuple(shape)}) should have "
                      f"{count * np.dtype(np_dtype).itemsize} bytes, the header gives "
                      f"{end - start}")
        if end > len(body):
            raise bad(f"{name!r} ends at byte {end} of the data, which has {len(body)} "
                      f"(a truncated file?)")
        values = np.frombuffer(body[start:end], dtype=np_dtype).reshape(shape)
        if mx_dtype == mx.bfloat16:
            arrays[name] = mx.array(values).view(mx.bfloat16)
        else:
            arrays[name] = mx.array(values, dtype=mx_dtype)
    mx.eval(arrays)
    return arrays, metadata


def _plain(metadata: dict[str, str], path: Path) -> dict[str, Any]:
    """The non-array entries recorded in a fluxlike file's metadata."""
    try:
        plain = json.loads(metadata.get("plain", "{}"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"[loadcheckpoint] {str(path)!r} has an unreadable 'plain' metadata "
                         f"entry ({type(e).__name__}: not valid JSON)") from None
    if not isinstance(plain, dict):
        raise ValueError(f"[loadcheckpoint] {str(path)!r} has a 'plain' metadata entry that is "
                         f"a JSON {type(plain).__name__}, not an object")
    for name, value in plain.items():
        if not isinstance(value, _PLAIN):
            raise ValueError(f"[loadcheckpoint] {str(path)!r} has a non-plain value at "
                             f"{name!r} in its metadata: a {type(value).__name__}")
    return plain


def _check_module(model: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"[{where}] expected a model (an mlx.nn.Module), got {type(model).__name__}"
        )


def _opt_tree(opt_state: Any, where: str) -> Any:
    if not hasattr(opt_state, "state") or not hasattr(opt_state, "load_state"):
        raise TypeError(
            f"[{where}] opt_state must be the optimiser state from fluxlike.setup, "
            f"got {type(opt_state).__name__}"
        )
    return opt_state.state


def _optimizer_kind(opt_state: Any) -> dict[str, Any] | None:
    """What the checkpoint records of ``opt_state``'s optimiser: the rule's name (for
    messages) and the mlx optimiser's class names from its own up to ``Optimizer``
    (compared). Gradient transforms in front (fluxlike's OptimiserChain) hold no state and are
    left out, so a chain and its last rule share a state. ``None`` for a duck-typed state."""
    optimizer = getattr(opt_state, "optimizer", None)
    inner = getattr(optimizer, "inner", None)  # fluxlike's OptimiserChain
    if isinstance(inner, optim.Optimizer):
        optimizer = inner
    if not isinstance(optimizer, optim.Optimizer):
        return None
    rule = getattr(opt_state, "rule", optimizer)
    rule = getattr(rule, "parts", (rule,))[-1]
    classes = [c.__name__ for c in type(optimizer).__mro__  # fluxlike's private ones left out
               if issubclass(c, optim.Optimizer) and c is not optim.Optimizer
               and not c.__name__.startswith("_")]
    return {"rule": type(rule).__name__, "classes": classes}


def _check_optimizer_kind(recorded: str | None, opt_state: Any, path: Path) -> None:
    """A ``ValueError`` if the file's optimiser is of another kind than ``opt_state``'s
    (Momentum's and RMSProp's states have the same names and shapes: only this tells them
    apart). One may subclass the other (Adam and AdamW keep the same moments)."""
    current = _optimizer_kind(opt_state)
    if recorded is None or current is None:  # an older file, or a duck-typed state
        return
    try:
        saved = json.loads(recorded)
        names, rule = list(saved["classes"]), str(saved["rule"])
    except (ValueError, TypeError, KeyError, RecursionError):
        raise ValueError(
            f"[loadcheckpoint] {str(path)!r} has an unreadable 'optimizer' metadata entry: "
            f"{recorded[:200]!r}"
        ) from None
    if not names or names[0] in current["classes"] or current["classes"][0] in names:
        return
    saved = {"rule": rule, "classes": names}

    def shown(kind: dict) -> str:
        public = [c for c in kind["classes"] if not c.startswith("_")] or kind["classes"]
        return f"{kind['rule']} (mlx {public[0]})"

    raise ValueError(
        f"[loadcheckpoint] the optimiser state in {str(path)!r} was saved from "
        f"{shown(saved)}, this opt_state is for {shown(current)}; setup() the same rule to "
        f"resume"
    )


def _recorded_rule(opt_state: Any) -> dict[str, Any] | None:
    """What the checkpoint records of ``opt_state``'s rule: its live hyperparameters (see
    :func:`~fluxlike.optimisers.hyperparameters.recorded`); ``None`` for an mlx optimizer
    given to ``setup`` as it is, a rule of the user's own or a duck-typed state."""
    rule = getattr(opt_state, "rule", None)
    return recorded(rule) if isinstance(rule, Rule) else None


def _restored_rule(entry: str | None, opt_state: Any, path: Path,
                   learning_rate: Any) -> tuple[Any, str | None]:
    """``(rule, warning)``: the rule ``opt_state`` follows once the file's state is loaded
    (its own, with the hyperparameters the file records, the learning rate the state's
    ``learning_rate``; ``None``: nothing to set), and what to warn of once it is (the file's
    rule is not ``opt_state``'s, so its hyperparameters stay as they are). Raises
    ``ValueError`` for a record that cannot be read or restored; changes nothing."""
    if entry is None:  # a file from before checkpoints recorded the rule
        return None, None
    try:
        record = json.loads(entry)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict):
        raise ValueError(f"[loadcheckpoint] {str(path)!r} has an unreadable 'rule' metadata "
                         f"entry: {entry[:200]!r}")
    if not hasattr(opt_state, "optimizer"):  # a duck-typed state: no rule to restore
        return None, None
    current = getattr(opt_state, "rule", None)
    new = None
    if isinstance(current, Rule):
        try:
            new = restored(current, record, learning_rate)
        except ScheduleNotStored as e:  # (fine-tuning from a run's end, evaluating it...)
            return None, (
                f"[loadcheckpoint] the optimiser in {str(path)!r} was saved with a schedule "
                f"for {e.field} ({e.schedule}), a function, which a checkpoint cannot hold, "
                f"and this opt_state's rule has {e.field}={e.value!r} there ({current!r}): "
                f"the state is loaded (the learning rate with it: the schedule's last "
                f"value), the other hyperparameters stay those it was set up with. To "
                f"resume the run, setup() the rule with the same schedule"
            )
        except (ValueError, TypeError, RecursionError) as e:
            raise ValueError(f"[loadcheckpoint] {str(path)!r} has an unreadable 'rule' "
                             f"metadata entry: {e}") from None
    if new is not None:
        replaced = replaced_schedules(current, new)
        said = ", ".join(f"{field}={number!r} where this opt_state's rule has a schedule "
                         f"({getattr(schedule, '__qualname__', type(schedule).__name__)})"
                         for field, schedule, number in replaced)
        return new, None if not replaced else (
            f"[loadcheckpoint] the optimiser in {str(path)!r} was saved with {said}: the "
            f"saved number replaces it, as the saved run used it. To go on with the "
            f"schedule, adjust(opt_state, {replaced[0][0]}=schedule) after loading")
    try:
        saved = saved_rule(record)  # (checked: for a state of an mlx optimizer too)
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"[loadcheckpoint] {str(path)!r} has an unreadable 'rule' "
                         f"metadata entry: {e}") from None
    shown = f"another rule, {current!r}" if isinstance(current, Rule) else (
        f"an mlx optimizer, {type(current).__name__}")
    was = _shown(record) if saved is None else repr(saved)
    return None, (
        f"[loadcheckpoint] the optimiser state in {str(path)!r} was saved from "
        f"{was[:500]}; this opt_state follows {shown}, whose state fits: the state "
        f"(the learning rate with it) is loaded, the other hyperparameters stay those it was "
        f"set up with. To resume with the saved ones, setup() the saved rule"
    )


def _shown(record: Any) -> str:
    """A rule's record (``recorded``) written as the rule's repr."""
    def value(v: Any) -> str:
        if isinstance(v, dict) and "type" in v:
            return _shown(v)
        if isinstance(v, dict) and "schedule" in v:
            return f"<schedule {v['schedule']}>"
        return repr(tuple(v)) if isinstance(v, list) else repr(v)

    try:
        if "parts" in record:
            return f"{record['type']}({', '.join(map(_shown, record['parts']))})"
        fields = ", ".join(f"{k}={value(v)}" for k, v in record["fields"].items())
        return f"{record['type']}({fields})"
    except (TypeError, KeyError, AttributeError, RecursionError):
        return repr(record)[:200]


def _strip(entries: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in entries.items() if k.startswith(prefix)}


def _kind(dtype: mx.Dtype) -> str:
    for kind in ("floating", "complexfloating", "integer", "bool_"):
        if mx.issubdtype(dtype, getattr(mx, kind)):
            return kind
    return str(dtype)


def _matched(target: Any, entries: dict[str, Any], where: str, prefix: str, owner: str) -> Any:
    """``target``'s tree of arrays with every leaf replaced by ``entries[name]``, converted
    to the target leaf's dtype; a ``ValueError`` at the first mismatch. Changes nothing."""
    leaves = dict(tree_flatten(target))
    for name in leaves:
        if name not in entries:
            raise ValueError(
                f"[{where}] missing '{prefix}{name}': the {owner} has it, the checkpoint does not"
            )
    extra = [name for name in entries if name not in leaves]
    if extra:
        raise ValueError(
            f"[{where}] unexpected '{prefix}{extra[0]}': the checkpoint has it, "
            f"the {owner} does not"
        )

    def convert(name: str, old: mx.array) -> mx.array:
        new, at = entries[name], f"'{prefix}{name}'"
        if isinstance(new, np.ndarray):
            new = mx.array(new)
        if not isinstance(new, mx.array):
            raise ValueError(
                f"[{where}] type mismatch at {at}: {owner} has an array, "
                f"checkpoint has {type(new).__name__}"
            )
        if new.shape != old.shape:
            raise ValueError(
                f"[{where}] shape mismatch at {at}: {owner} has {tuple(old.shape)}, "
                f"checkpoint has {tuple(new.shape)}"
            )
        if _kind(new.dtype) != _kind(old.dtype):
            raise ValueError(
                f"[{where}] dtype mismatch at {at}: {owner} has {old.dtype}, "
                f"checkpoint has {new.dtype} (only casts within a kind are allowed)"
            )
        return new if new.dtype == old.dtype else new.astype(old.dtype)

    # Convert everything first (raising on a mismatch) and only then build the tree.
    converted = {name: convert(name, old) for name, old in leaves.items()}
    return tree_map_with_path(lambda name, _: converted[name], target)
