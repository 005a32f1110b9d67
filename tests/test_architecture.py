"""The architecture of shared/design.md, checked on the source in src/: the package has no import cycle, imports
point down the layers only, and no module reads another module's private names.

Every import statement counts: at module level, inside functions, and under ``if TYPE_CHECKING:``. A function-level
import still runs (it is how a cycle usually hides), and a type that a lower layer's signature borrows from a higher
layer is a dependency of the design even when only the type checker imports it.

A finding is keyed without line numbers, so the temporary allow-list below survives unrelated edits; its messages
give the lines.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "modelmeter"

# The layers of shared/design.md, bottom first: (layer, its modules, the layers it sits on). A module belongs to the
# layer naming the longest prefix of its dotted name (the package root only by its own name). It may import its own
# layer and every layer it sits on, directly or through others; nothing sits on the package root.
LAYERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("base", ("modelmeter.errors", "modelmeter._version", "modelmeter._torch_compat"), ()),
    ("io", ("modelmeter.io",), ("base",)),
    ("checkpoint", ("modelmeter.checkpoint",), ("io",)),
    ("engine", ("modelmeter.engine",), ("base",)),
    ("runner", ("modelmeter.engine.tracer",), ("engine",)),  # runs the model: nothing below it may
    ("handles", ("modelmeter.handles",), ("engine",)),
    ("devices", ("modelmeter.devices",), ("base",)),  # the accelerators' datasheets: plain data, torch-free
    ("metrics", ("modelmeter.metrics",), ("handles", "devices")),
    ("parallel", ("modelmeter.parallel",), ("metrics",)),  # per-rank cost of parallel plans, derived from a trace
    ("format", ("modelmeter.engine.serialize",), ("engine",)),  # the Trace as JSON: kept by the cache, saved by reports
    ("cache", ("modelmeter.cache",), ("format", "io")),
    ("reports", ("modelmeter.reports",), ("metrics", "format", "io")),
    ("session", ("modelmeter.session", "modelmeter.views", "modelmeter.analysis", "modelmeter.memory",
                 "modelmeter.fvcore_api", "modelmeter.trace_files"), ("runner", "cache", "reports")),
    ("zoo", ("modelmeter.zoo",), ("base",)),
    # the command's model loaders, and the words of its errors they share with it
    ("loaders", ("modelmeter.cli.models", "modelmeter.cli.errors"), ("engine", "zoo")),
    ("guard", ("modelmeter.guard",), ("session", "loaders")),
    ("cli", ("modelmeter.cli", "modelmeter.__main__"), ("guard",)),
    ("launcher", ("modelmeter_cli",), ("cli",)),  # the console script: imports the command lazily
    ("plugin", ("modelmeter_pytest",), ("guard",)),
    ("root", (ROOT,), ("session", "parallel")),  # the public names, re-exported
)


# --- reading the source --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    name: str
    path: str  # as the messages show it
    tree: ast.Module
    is_package: bool


@dataclass(frozen=True)
class Import:
    """One module of ours imported by another: ``names`` are what ``from target import ...`` takes from it."""

    importer: str
    target: str
    names: tuple[str, ...]
    line: int


def load_sources(src: Path) -> dict[str, Source]:
    """The package under ``src`` and the modules of their own beside it, by dotted name."""
    sources = {}
    for path in sorted([*src.glob("*.py"), *(src / ROOT).rglob("*.py")]):
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        shown = str(path.relative_to(src.parent))
        sources[name] = Source(name, shown, ast.parse(path.read_text(), shown), is_package)
    return sources


def imports(sources: Mapping[str, Source]) -> list[Import]:
    """Every import of one of our modules by another, wherever the statement stands."""
    found = []
    for source in sources.values():
        package = source.name if source.is_package else source.name.rpartition(".")[0]
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Import):
                found += [Import(source.name, alias.name, (), node.lineno)
                          for alias in node.names if alias.name in sources]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                for alias in node.names:
                    if f"{base}.{alias.name}" in sources:  # a submodule taken as a name
                        found.append(Import(source.name, f"{base}.{alias.name}", (), node.lineno))
                    elif base in sources:
                        found.append(Import(source.name, base, (alias.name,), node.lineno))
    return [i for i in found if i.target != i.importer]


def _absolute(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - level + 1]
    return ".".join([*parts, module] if module else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _where(sources: Mapping[str, Source], module: str, line: int) -> str:
    return f"{sources[module].path}:{line}"


def _add(findings: dict[str, str], key: str, sources: Mapping[str, Source], module: str, line: int) -> None:
    """One more place of the finding ``key``."""
    findings[key] = findings.get(key, "") + f"  {_where(sources, module, line)}\n"


# --- the three checks ------------------------------------------------------------------------------------------------

def cycle_findings(sources: Mapping[str, Source]) -> dict[str, str]:
    """Each strongly connected component of the import graph with more than one module."""
    edges: dict[str, dict[str, int]] = {name: {} for name in sources}
    for imp in imports(sources):
        edges[imp.importer][imp.target] = min(imp.line, edges[imp.importer].get(imp.target, imp.line))
    findings = {}
    for component in _strongly_connected(edges):
        if len(component) > 1:
            inside = [f"  {_where(sources, a, line)} imports {b}"
                      for a in component for b, line in sorted(edges[a].items()) if b in component]
            findings[f"cycle: {' <-> '.join(component)}"] = "\n".join(inside)
    return findings


def _strongly_connected(edges: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm; each component sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def layer_of(module: str) -> str | None:
    best = ""
    layer = None
    for name, prefixes, _ in LAYERS:
        for prefix in prefixes:
            inside = module == prefix or (prefix != ROOT and module.startswith(prefix + "."))
            if inside and len(prefix) > len(best):
                best, layer = prefix, name
    return layer


def _below() -> dict[str, set[str]]:
    """Each layer with the layers it may import (itself and all it sits on, transitively)."""
    sits_on = {name: set(under) for name, _, under in LAYERS}
    below = {}
    for name in sits_on:
        reach, todo = {name}, [name]
        while todo:
            for under in sits_on[todo.pop()] - reach:
                reach.add(under)
                todo.append(under)
        below[name] = reach
    return below


def layer_findings(sources: Mapping[str, Source]) -> dict[str, str]:
    """Modules in no layer, and imports of a layer the importer does not sit on."""
    below = _below()
    findings = {f"layer: {name} is in no layer of LAYERS": source.path
                for name, source in sources.items() if layer_of(name) is None}
    for imp in imports(sources):
        upper, lower = layer_of(imp.importer), layer_of(imp.target)
        if upper is not None and lower is not None and lower not in below[upper]:
            key = f"layer: {imp.importer} ({upper}) imports {imp.target} ({lower})"
            _add(findings, key, sources, imp.importer, imp.line)
    return findings


def private_findings(sources: Mapping[str, Source]) -> dict[str, str]:
    """Reads of another module's private names (names with one leading underscore).

    Found: ``from m import _name``; an import of a private module from outside its package; ``m._name`` on an
    imported module of ours; and ``obj._attr`` where ``_attr`` is the private attribute of one of our classes and
    ``obj`` is not ``self``, ``cls`` or ``super()`` — also through ``getattr``/``setattr``/``hasattr``/``delattr``
    with the name spelled out. A plain local name (``other``, a parameter) may reach the private attributes of its own
    module's classes, so a class's own helpers and copies pass; an attribute path (``self.part._attr``) may not:
    that object belongs to another. Private names that no class of ours defines (torch's ``module._parameters``,
    ``torch._C``, a namedtuple's ``_replace``) are not ours to judge here: torch's live in its compatibility module.
    """
    owners: dict[str, set[str]] = {}  # private attribute name -> modules whose classes define it
    for name, source in sources.items():
        for attr in _class_private_names(source.tree):
            owners.setdefault(attr, set()).add(name)
    ours = {name.partition(".")[0] for name in sources}
    findings: dict[str, str] = {}
    for imp in imports(sources):
        for name in filter(_is_private, imp.names):
            _add(findings, f"private: {imp.importer} imports {name} from {imp.target}", sources, imp.importer, imp.line)
        package = _package_of_private(imp.target)
        if package is not None and not (imp.importer == package or imp.importer.startswith(package + ".")):
            key = f"private: {imp.importer} imports the private module {imp.target}"
            _add(findings, key, sources, imp.importer, imp.line)
    for name, source in sources.items():
        modules = _module_aliases(source, sources)
        for receiver, attr, line in _private_accesses(source.tree):
            dotted = _dotted(receiver)
            if dotted in ("self", "cls", "super()"):
                continue
            head, _, rest = (dotted or "").partition(".")
            if head in modules:  # the receiver starts with an imported module
                module = ".".join(filter(None, [modules[head], rest]))
                if module in sources:
                    if module != name:
                        _add(findings, f"private: {name} reads {module}.{attr}", sources, name, line)
                    continue
                if modules[head].partition(".")[0] not in ours:  # torch._C, os._exit
                    continue
            if attr not in owners or (isinstance(receiver, ast.Name) and name in owners[attr]):
                continue
            _add(findings, f"private: {name} reads {ast.unparse(receiver)}.{attr}", sources, name, line)
    return findings


def _class_private_names(tree: ast.Module) -> set[str]:
    """Private attributes of the module's classes: methods, class-level names, ``self.x``/``cls.x`` and slots."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
                if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in item.targets):
                    names.update(c.value for c in ast.walk(item.value)
                                 if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return set(filter(_is_private, names))


def _private_accesses(tree: ast.Module) -> Iterator[tuple[ast.expr, str, int]]:
    """(receiver, private name, line) of every ``x._name`` and ``getattr(x, "_name", ...)``-like call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            yield node.value, node.attr, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value)):
            yield node.args[0], node.args[1].value, node.lineno


def _module_aliases(source: Source, sources: Mapping[str, Source]) -> dict[str, str]:
    """Local name -> the module it is bound to by an import, ours or not (``import torch`` binds ``torch``)."""
    package = source.name if source.is_package else source.name.rpartition(".")[0]
    aliases = {}
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            for alias in node.names:
                module = f"{base}.{alias.name}"
                if module in sources or base not in sources:  # a module of ours, or a name from a foreign module
                    aliases[alias.asname or alias.name] = module
    return aliases


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
        return "super()"
    return None


def _package_of_private(module: str) -> str | None:
    """The package a private module (``pkg._mod``, ``pkg._sub.mod``) belongs to; None for a public one."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], 1):
        if _is_private(part):
            return ".".join(parts[:i])
    return None


# --- the tests ------------------------------------------------------------------------------------------------------

def _assert_clean(findings: Mapping[str, str]) -> None:
    assert not findings, "\n".join(f"{key}\n{findings[key]}" for key in sorted(findings))


@pytest.fixture(scope="module")
def sources() -> dict[str, Source]:
    return load_sources(SRC)


def test_no_import_cycle(sources: dict[str, Source]) -> None:
    _assert_clean(cycle_findings(sources))


def test_imports_point_down_the_layers(sources: dict[str, Source]) -> None:
    _assert_clean(layer_findings(sources))


def test_no_module_reads_another_modules_private_names(sources: dict[str, Source]) -> None:
    _assert_clean(private_findings(sources))


def test_the_checks_see_what_they_must(tmp_path: Path) -> None:
    """The checks on a small made-up package with one of each defect, hidden the ways they hide in practice."""
    files = {
        "modelmeter_cli.py": "def main():\n    from modelmeter.cli import run\n",
        "modelmeter/__init__.py": "from .engine.trace import Trace\n",
        "modelmeter/errors.py": "",
        "modelmeter/cli.py": "import modelmeter\nrun = 1\n",
        "modelmeter/engine/__init__.py": "",
        "modelmeter/engine/trace.py": """
            import torch
            class Trace:
                __slots__ = ("_events",)
                def _path_for(self): return torch._C
                def copy(self):
                    other = Trace()
                    other._events = self._events
                    return other
            def rebuild():
                from ..reports.result import Result  # function level, relative, upward
                return Result
            """,
        "modelmeter/engine/_torch.py": "x = 1\n",
        "modelmeter/engine/tracer.py": "from ._torch import x\n",
        "modelmeter/reports/__init__.py": "",
        "modelmeter/reports/result.py": """
            from typing import TYPE_CHECKING
            from torch import nn
            from modelmeter.engine import trace as tr
            if TYPE_CHECKING:
                import modelmeter.engine.tracer  # only for the type checker, and upward
            class Result:
                def __init__(self, trace):
                    self.trace = trace
                    self.n = len(trace._events) + len(self.trace._path_for())
                    self.m = getattr(tr.Trace(), "_events")
                    self._own = tr._helper
                    self.p = tr.Trace._path_for
                    self.q = nn.Module._apply  # torch's
            """,
        "modelmeter/io/__init__.py": "from modelmeter.engine._torch import x\nfrom ..engine.trace import _helper\n",
        "modelmeter/newthing.py": "",
    }
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    made_up = load_sources(tmp_path)

    assert set(cycle_findings(made_up)) == {
        "cycle: modelmeter.engine.trace <-> modelmeter.reports.result",
    }
    assert set(layer_findings(made_up)) == {
        "layer: modelmeter.newthing is in no layer of LAYERS",
        "layer: modelmeter.cli (cli) imports modelmeter (root)",
        "layer: modelmeter.engine.trace (engine) imports modelmeter.reports.result (reports)",
        "layer: modelmeter.reports.result (reports) imports modelmeter.engine.tracer (runner)",
        "layer: modelmeter.io (io) imports modelmeter.engine._torch (engine)",
        "layer: modelmeter.io (io) imports modelmeter.engine.trace (engine)",
    }
    assert set(private_findings(made_up)) == {
        "private: modelmeter.io imports the private module modelmeter.engine._torch",
        "private: modelmeter.io imports _helper from modelmeter.engine.trace",
        "private: modelmeter.reports.result reads trace._events",
        "private: modelmeter.reports.result reads self.trace._path_for",
        "private: modelmeter.reports.result reads tr.Trace()._events",
        "private: modelmeter.reports.result reads modelmeter.engine.trace._helper",
        "private: modelmeter.reports.result reads tr.Trace._path_for",
    }
