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
names of the optimiser, which :func:`loadcheckpoint` compares with those of the state it
loads into. The file is a plain safetensors file: ``mx.load(path)`` reads its arrays.

File names: MLX's ``Module.save_weights`` picks the format by the extension (``.npz`` or
``.safetensors``) and refuses others. A checkpoint needs safetensors (its metadata), so
:func:`savemodel` requires a ``.safetensors`` name. :func:`loadcheckpoint` goes by the
content instead: it reads safetensors files of any name (as earlier versions wrote them) and
MLX's ``.npz`` weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from . import distributed as _distributed

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
    MLX's ``save_weights``, the extension names the format). The write is atomic: a crash
    leaves either the old file or the new one.

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
    if not path.parent.is_dir():
        raise FileNotFoundError(f"[savemodel] no directory {str(path.parent)!r} to write into")
    # mx.save_safetensors insists on the suffix; write beside the target and rename over it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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

    >>> import tempfile, os
    >>> from fluxlike import Adam, Dense, loadcheckpoint, savemodel, setup
    >>> path = os.path.join(tempfile.mkdtemp(), "run.safetensors")
    >>> model = Dense(3, 2)
    >>> savemodel(path, model, setup(Adam(), model))
    >>> resumed, opt_state = Dense(3, 2), setup(Adam(), Dense(3, 2))
    >>> loadcheckpoint(path, resumed, opt_state)
    Dense(3 => 2)  # 8 parameters
    >>> opt_state.state["optimizer"]["step"]
    array(0, dtype=uint64)
    """
    _check_module(model, "loadcheckpoint")
    if opt_state is not None:
        _opt_tree(opt_state, "loadcheckpoint")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[loadcheckpoint] no checkpoint file at {str(path)!r}")
    with open(path, "rb") as f:
        npz = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    if npz:  # MLX's save_weights("....npz"): weights only, no metadata
        arrays, metadata = mx.load(str(path), format="npz"), {}
    else:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    if metadata.get("format") != FORMAT:  # plain MLX weights
        model_entries, opt_entries, prefix = dict(arrays), {}, ""
    else:
        entries: dict[str, Any] = {**arrays, **json.loads(metadata.get("plain", "{}"))}
        model_entries = _strip(entries, _MODEL)
        opt_entries = _strip(entries, _OPT)
        prefix = _MODEL
        stray = sorted(k for k in entries if not k.startswith((_MODEL, _OPT)))
        if stray:
            raise ValueError(f"[loadcheckpoint] unexpected entry '{stray[0]}' in {str(path)!r}")
    new_model = _matched(model.parameters(), model_entries, "loadcheckpoint", prefix, "model")
    if opt_state is not None:
        if not opt_entries:
            raise ValueError(
                f"[loadcheckpoint] {str(path)!r} holds no optimiser state; "
                f"call loadcheckpoint(path, model) to load the model alone"
            )
        _check_optimizer_kind(metadata.get("optimizer"), opt_state, path)
        # OptState.load_state validates everything and changes nothing on a mismatch; it
        # also makes the loss scale a float16 run saved if this state has none yet.
        try:
            opt_state.load_state(tree_unflatten(list(opt_entries.items())))
        except ValueError as e:
            raise ValueError(f"[loadcheckpoint] optimiser state in {str(path)!r}: {e}") from e
    model.update(new_model)
    return model


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
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            f"[loadcheckpoint] {str(path)!r} has an unreadable 'optimizer' metadata entry: "
            f"{recorded!r}"
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
