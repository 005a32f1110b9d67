"""Module names: every path to every submodule, and the canonical name of each module object.

A module reachable by several paths (a shared submodule) gets the first path in depth-first
order as its canonical name, as fvcore does; every other path is an alias of it. :meth:`ModuleNames.infos`
describes each module as plain data for the trace (:class:`~modelmeter.engine.trace.ModuleInfo`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._torch_compat import children_of, class_name, local_tensor, parameters_of
from ..errors import InvalidValueError
from .metadata import dtype_name
from .trace import ModuleInfo, ParameterInfo

# Containers and placeholders that are never called: a module table marks them, so that they are not
# reported as modules the run did not call.
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.Identity)


def named_modules_with_dup(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules()`` but yields a shared module once per path that reaches it. A module that is its own
    submodule (``a.b = b; b.a = a``) is refused: every walk of the tree — torch's ``train()`` and ``state_dict()``,
    the analysis's — would go round it until Python's recursion limit."""
    found: list[tuple[str, nn.Module]] = []
    _paths(model, prefix, found, {})
    return iter(found)


def _paths(module: nn.Module, prefix: str, found: list[tuple[str, nn.Module]], above: dict[int, str]) -> None:
    """Append every path to ``module`` and its submodules, depth first: one call per path (nested generators would
    pass each path up through every level above it). ``above``: id -> path of the modules above ``prefix``."""
    found.append((prefix, module))
    above[id(module)] = prefix
    for name, child in children_of(module).items():
        if child is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if id(child) in above:
            raise InvalidValueError(
                f"module {path!r} is {above[id(child)] or 'the model'!r} again, which contains it: a cycle of "
                f"submodules ({type(child).__name__}), whose walks (torch's train() and state_dict(), the "
                "analysis's) never end; keep one of the two references out of the module tree")
        _paths(child, path, found, above)
    del above[id(module)]


class ModuleNames:
    """Canonical names of a model's modules, and every alias that leads to them."""

    def __init__(self, model: nn.Module) -> None:
        self.by_id: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        self.canonical: list[str] = []
        self.modules: dict[str, nn.Module] = {}  # canonical name -> module, in ``named_modules()`` order
        for name, module in named_modules_with_dup(model):
            canonical = self.by_id.setdefault(id(module), name)
            if canonical == name:
                self.canonical.append(name)
                self.modules[name] = module
            self.aliases[name] = canonical
            if "/" in name:
                self.aliases.setdefault(name.rsplit("/", 1)[1], canonical)

    def infos(self) -> list[ModuleInfo]:
        """Every module as plain data, in ``named_modules()`` order; each parameter under its first owner."""
        seen: set[int] = set()
        known: dict[tuple[Any, ...], ParameterInfo] = {}
        by_id = self.by_id
        out = []
        for name, module in self.modules.items():
            params: tuple[ParameterInfo, ...] = ()
            own = parameters_of(module)
            if own:
                params = tuple(_parameter_infos(own, seen, known))
            children = children_of(module)
            slots = tuple([(key, None if child is None else by_id[id(child)]) for key, child in children.items()]) \
                if children else ()
            out.append(ModuleInfo(name, type(module).__name__, class_name(module), _extra_repr(module), slots, params,
                                  _has_forward(module)))
        return out


def _parameter_infos(own: dict[str, nn.Parameter | None], seen: set[int],
                     known: dict[tuple[Any, ...], ParameterInfo]) -> list[ParameterInfo]:
    """A module's own parameters not seen before (``seen``: their ids, updated). A plain parameter is described by
    its name, shape and dtype alone: one (immutable) description per distinct triple, kept in ``known`` (a model
    repeats a few layer shapes many times)."""
    infos = []
    for key, param in own.items():
        if param is None or id(param) in seen:
            continue
        seen.add(id(param))
        if type(param) in _PLAIN_PARAMETERS:
            fact = (key, param.shape, param.dtype)
            info = known.get(fact)
            if info is None:
                info = known[fact] = _parameter_info(key, param)
            infos.append(info)
        else:
            infos.append(_parameter_info(key, param))
    return infos


def _parameter_info(key: str, param: torch.Tensor) -> ParameterInfo:
    """One parameter; a DTensor's as this rank's shard, with its global shape."""
    local = local_tensor(param)
    whole = None if local is param else tuple(param.shape)
    return ParameterInfo(key, tuple(local.shape), dtype_name(param.dtype), local.numel() * local.element_size(), whole)


_PLAIN_PARAMETERS = (nn.Parameter, torch.Tensor)  # exactly these classes: no DTensor, no lazy parameter


def _has_forward(module: nn.Module) -> bool:
    # (read statically: a TorchScript module's class computes ``forward`` on access, and fails on the class)
    return not isinstance(module, _NO_FORWARD) and inspect.getattr_static(type(module), "forward") is not \
        nn.Module.forward


def _extra_repr(module: nn.Module) -> str:
    """``module.extra_repr()``; a module whose ``extra_repr`` fails says so instead of failing the analysis."""
    try:
        return module.extra_repr()
    except Exception as exc:  # a user's extra_repr is arbitrary code; only fvcore's printout shows it
        return f"<extra_repr() failed: {type(exc).__name__}: {exc}>"
