"""Module names: every path to every submodule, and the canonical name of each module object.

A module reachable by several paths (a shared submodule) gets the first path in depth-first
order as its canonical name, as fvcore does; every other path is an alias of it.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .._torch_compat import children_of


def named_modules_with_dup(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules()`` but yields a shared module once per path that reaches it."""
    yield prefix, model
    for name, child in children_of(model).items():
        if child is None:
            continue
        yield from named_modules_with_dup(child, f"{prefix}.{name}" if prefix else name)


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

    def resolve(self, name: str) -> str:
        """The canonical name for ``name``; a clear error for anything else."""
        if not isinstance(name, str):
            raise TypeError(f"module_name must be a string, got {type(name).__name__}")
        try:
            return self.aliases[name]
        except KeyError:
            raise KeyError(
                f"Requested module name {name!r} is not among the descendants of the analyzed model."
            ) from None
