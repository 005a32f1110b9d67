"""What a model is called with: normalise the user's ``inputs`` into positional and keyword arguments."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch_compat import pytree
from ..errors import InvalidTypeError
from .metadata import NESTED_STRIDED
from .naming import named_modules_with_dup


class Args:
    """Positional and keyword arguments for ``model(*args, **kwargs)``.

    ``FlopCountAnalysis(model, Args(ids, attention_mask=mask))`` calls the model as
    ``model(ids, attention_mask=mask)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Args({', '.join(parts)})"


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``inputs`` as ``(args, kwargs)``.

    A tensor is the one positional argument, a tuple holds the positional arguments (as in fvcore),
    a dict holds keyword arguments, an :class:`Args` holds both; anything else is the single
    positional argument (a list of dicts, say).
    """
    if isinstance(inputs, Args):
        return tuple(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs, {}
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        return (), dict(inputs)
    if inputs is None:
        raise InvalidTypeError("inputs is None: pass a tensor, a tuple of arguments, a dict of keyword "
                               "arguments or modelmeter.Args(*args, **kwargs)")
    return (inputs,), {}


def check_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Reject what cannot be traced, naming the argument, before the model runs."""
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):  # its modules are C++ objects: nothing to attribute counts to
        raise InvalidTypeError(f"model is a TorchScript module ({type(model).__name__}, from torch.jit.script or "
                               "torch.jit.trace), which cannot be analysed: pass the nn.Module it was made from")
    named_modules_with_dup(model)  # (refuses a cycle of submodules, before any other walk goes round it)
    for path, leaf in _leaves(args, kwargs, fields=False):  # (a dataclass's numpy field may be the model's to read)
        module = type(leaf).__module__
        if module == "numpy" or module.startswith("numpy."):
            raise InvalidTypeError(f"{path} is a numpy array; convert it with torch.from_numpy() first")
        if isinstance(leaf, torch.Tensor) and leaf.is_nested and leaf.layout == torch.strided:
            raise InvalidTypeError(f"{path}: {NESTED_STRIDED}")
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        # fvcore passes a dict of inputs as the one positional argument; here it is keyword arguments
        hint = "" if args or not kwargs else "; to pass a dict as the one argument, give it in a tuple: (inputs,)"
        raise InvalidTypeError(f"inputs do not match {type(model).__name__}.forward{signature}: {exc}{hint}") from None


def input_where(args: tuple[Any, ...], kwargs: dict[str, Any], test: Callable[[torch.Tensor], bool]) -> str | None:
    """The path of the first input tensor that passes ``test`` (``"inputs[0]"``), or None (a quantized or a sparse
    one: only real kernels take it)."""
    return next((path for path, leaf in _leaves(args, kwargs) if isinstance(leaf, torch.Tensor) and test(leaf)), None)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any], fields: bool = True) -> list[tuple[str, Any]]:
    """Each leaf of the inputs with its path, and with ``fields`` the fields of dataclasses walked in their place
    (each dataclass once: one that refers to itself is no endless walk)."""
    out: list[tuple[str, Any]] = []
    seen: set[int] | None = set() if fields else None
    _leaves_under("inputs", (args, kwargs), out, seen, skip=1)
    return out


def _leaves_under(prefix: str, tree: Any, out: list[tuple[str, Any]], seen: set[int] | None, skip: int = 0) -> None:
    flat, _ = pytree.tree_flatten_with_path(tree)
    for keys, leaf in flat:
        path = prefix + "".join(str(k) for k in keys[skip:])
        if seen is not None and _is_dataclass_instance(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            for field in dataclasses.fields(leaf):
                _leaves_under(f"{path}.{field.name}", getattr(leaf, field.name), out, seen)
        else:
            out.append((path, leaf))


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested structure of arguments, the fields of dataclasses included (a
    dataclass holding a tensor is copied, with the field replaced: the caller's is left as it is)."""
    return _mapped(fn, tree, {})


def _mapped(fn: Callable[[torch.Tensor], Any], tree: Any, made: dict[int, Any]) -> Any:
    """:func:`map_tensors`, each dataclass converted once: ``made`` maps one met before to its conversion (a
    dataclass referring to itself gives a copy referring to the copy)."""
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if id(value) in made:
            return made[id(value)]
        if _is_dataclass_instance(value):
            return _with_fields(value, lambda field: _mapped(fn, field, made), made)
        return value

    return pytree.tree_map(leaf, tree)


#: the types of the common leaves of arguments and of operators' arguments that are no dataclass: told apart by a
#: set lookup, with no call (another leaf sends the walk to the slower one that looks into dataclasses)
_PLAIN = frozenset({type(None), int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format})


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure, in order: in pytree's containers and in the fields of dataclasses (a
    batch or an output given as a dataclass, which pytree leaves whole). It runs for each operator recorded: the
    fields are looked for only where a leaf is none of the plain ones."""
    leaves = pytree.tree_leaves(tree)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif type(leaf) not in _PLAIN:  # perhaps a dataclass: the walk of fields
            return _tensors_under(leaves, set())
    return found


def _tensors_under(leaves: list[Any], seen: set[int]) -> list[torch.Tensor]:
    """The tensors of ``leaves`` and of their dataclasses' fields, each dataclass once."""
    found: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_dataclass_instance(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            fields = [getattr(leaf, field.name) for field in dataclasses.fields(leaf)]
            found += _tensors_under(pytree.tree_leaves(fields), seen)
    return found


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _with_fields(value: Any, convert: Callable[[Any], Any], made: dict[int, Any]) -> Any:
    """``value`` itself when ``convert`` returns every field as it is, else a shallow copy of it with the fields
    ``convert`` changed (set as a frozen dataclass allows: no ``__init__`` or ``__post_init__`` runs again), noted in
    ``made`` before its fields are converted. Only the fields holding a tensor are converted: the others stay the
    caller's objects (a cache list the forward appends to), where a conversion would rebuild their containers."""
    copied = made[id(value)] = copy.copy(value)
    changed = False
    for field in dataclasses.fields(value):
        before = getattr(value, field.name)
        if not tensors_in(before):
            continue
        after = convert(before)
        if after is not before:
            object.__setattr__(copied, field.name, after)
            changed = True
    if not changed:
        made[id(value)] = value
        return value
    return copied
