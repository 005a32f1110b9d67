"""Parameter counts by module: every dotted prefix of every parameter name, shared parameters once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from torch import nn

from .._torch_compat import parameters_of
from ..engine.naming import ModuleNames


def parameter_count(model: nn.Module) -> defaultdict[str, int]:
    """Number of parameter elements under every name prefix; ``""`` is the whole model.

    A parameter shared by several modules counts once, under its first name (as fvcore does).
    Works on the meta device: only shapes are read.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return count_by_prefix(ModuleNames(model).modules.items())


def count_by_prefix(modules: Iterable[tuple[str, nn.Module]]) -> defaultdict[str, int]:
    """:func:`parameter_count` over ``(canonical name, module)`` pairs in ``named_modules()`` order (what
    :class:`ModuleNames` holds): each parameter added to ``""``, every prefix of its module and its own name,
    once, in ``named_parameters()`` order."""
    counts: defaultdict[str, int] = defaultdict(int)
    seen: set[int] = set()
    chains: dict[str, tuple[str, ...]] = {"": ("",)}
    for prefix, module in modules:
        own_parameters = parameters_of(module)
        if not own_parameters:
            continue
        own, total = [], 0
        for name, param in own_parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                size = param.numel()
                own.append((name, size))
                total += size
        if own:  # the prefixes first (in one go), then the parameters' own names: named_parameters()'s key order
            for key in _chain(prefix, chains):
                counts[key] += total
            for name, size in own:
                counts[f"{prefix}.{name}" if prefix else name] += size
    return counts


def _chain(name: str, chains: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """``"a.b"`` -> ``("", "a", "a.b")``, remembered in ``chains``."""
    chain = chains.get(name)
    if chain is None:
        chain = chains[name] = (*_chain(name.rpartition(".")[0], chains), name)
    return chain
