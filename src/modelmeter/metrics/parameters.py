"""Parameter counts by module, from the trace's module table: every dotted prefix of every parameter name, shared
parameters once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ..engine.trace import ModuleInfo


def count_by_prefix(modules: Iterable[ModuleInfo]) -> defaultdict[str, int]:
    """Number of parameter elements under every name prefix (``""`` is the whole model), over the module table
    (``Trace.modules``, in ``named_modules()`` order, each parameter under its first owner only): each parameter
    added to ``""``, every prefix of its module and its own name, in ``named_parameters()`` order."""
    return _count(modules, with_parameters=True)


def count_by_module(modules: Iterable[ModuleInfo]) -> defaultdict[str, int]:
    """:func:`count_by_prefix` of the module names only (a result's rows): the parameters' own names left out."""
    return _count(modules, with_parameters=False)


def _count(modules: Iterable[ModuleInfo], with_parameters: bool) -> defaultdict[str, int]:
    counts: defaultdict[str, int] = defaultdict(int)
    chains: dict[str, tuple[str, ...]] = {"": ("",)}
    for module in modules:
        if not module.parameters:
            continue
        own = [(param.name, param.numel()) for param in module.parameters]
        total = sum(size for _, size in own)
        for key in _chain(module.name, chains):  # the prefixes first (in one go), then the parameters' own names
            counts[key] += total
        if with_parameters:
            for name, size in own:
                counts[f"{module.name}.{name}" if module.name else name] += size
    return counts


def parameter_shapes(modules: Iterable[ModuleInfo]) -> dict[str, tuple[int, ...]]:
    """Full parameter name -> shape, in ``named_parameters()`` order (shared parameters under their first name)."""
    return {f"{module.name}.{param.name}" if module.name else param.name: param.shape
            for module in modules for param in module.parameters}


def _chain(name: str, chains: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """``"a.b"`` -> ``("", "a", "a.b")``, remembered in ``chains``."""
    chain = chains.get(name)
    if chain is None:
        chain = chains[name] = (*_chain(name.rpartition(".")[0], chains), name)
    return chain
