"""How a baseline entry names its model, checked in full before anything is imported or called.

A baseline file is data — it may come with a pull request — so what ``modelmeter --check-baseline FILE`` runs
again for an entry is confined to what the command line would accept from FILE's own project:

* options: only those the command writes into an entry (:data:`ENTRY_OPTIONS`), in the form
  it writes them, with values the command's own option types accept;
* a built-in (zoo) model; ``torchvision:`` / ``timm:`` / ``transformers:`` models, which the loaders restrict
  to the libraries' registered builders and config classes — without options that load weights, checkpoints
  or code (:data:`LOADING_OPTIONS`);
* a device by name, with the roofline's options; a devices file (``--devices-file``, or a file given to
  ``--device``) only inside the *project directory*, as below;
* ``path/file.py:factory`` and ``package.module:factory`` only when the file, or the module's top-level
  package as the import would find it, lies in the *project directory*: the directory of the baseline file
  and everything below it (after symbolic links are resolved). Paths are relative to the working directory,
  as on the command line; the factory must be a function or class that the named file or module defines.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import os
import re
from pathlib import Path
from typing import Any, NoReturn

from ..cli.models import ModelSpecError, on_path, parse_overrides

# The options a baseline entry holds: what ``modelmeter.cli.job.job_argv`` writes into one, each with whether one
# value follows it. The one list of them: a saved spec may hold these alone (below), a check of every model refuses
# them on its command line (each entry brings its own: cli/guard.py), a comparison sorts them (guard/baseline.py);
# tests/test_cli_one_source.py checks each against it.
ENTRY_OPTIONS: dict[str, bool] = {
    "--input": True, "--batch": True, "--resolution": True, "--seq-len": True, "--dtype": True, "--convention": True,
    "--execution": True, "--backward": False, "--dense-attention": False, "--attention-kernel": True,
    "--memory": False, "--optimizer": True, "--state-dtype": True, "--foreach": False, "--parallel": True,
    "--device": True, "--devices-file": True, "--efficiency": True, "--launch-overhead": True, "--tf32": False,
    "--measured-time": True}
MAX_TOKENS = 256
MAX_TOKEN_CHARS = 1000

# Builder options of the libraries that load weights, checkpoints or code (from disk or the hub), with the
# values a baseline may give them (none: it may not name the option at all).
LOADING_OPTIONS: dict[str, dict[str, tuple[Any, ...]]] = {
    "torchvision": {"weights": (None,), "weights_backbone": (None,)},
    "timm": {"pretrained": (False,), "pretrained_cfg": (), "pretrained_cfg_overlay": (), "checkpoint_path": (),
             "cache_dir": ()},
    "transformers": {"auto_map": (), "trust_remote_code": (False,), "attn_implementation": ("eager", "sdpa")},
}
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def check_spec(tokens: list[str], name: str, baseline: str | os.PathLike[str],
               parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command-line arguments of the entry ``name`` of the baseline file ``baseline``, parsed by ``parser``
    (the command's) once every token is known to be allowed; :class:`ModelSpecError` naming the entry and the
    token otherwise. Imports nothing the entry names."""
    what = f"the baseline entry {name!r}"
    if not tokens:
        raise ModelSpecError(f"{what} was not saved by the command (no spec): check it where it was saved "
                             "(e.g. with the pytest plugin)")
    if len(tokens) > MAX_TOKENS or any(len(token) > MAX_TOKEN_CHARS for token in tokens):
        raise ModelSpecError(f"{what}: its spec is too long to be one the command wrote")
    positional = _positional(tokens, what)
    if not positional:
        raise ModelSpecError(f"{what}: its spec names no model")
    model, *overrides = positional
    try:
        parse_overrides(overrides)
        check_model(model, overrides, project_of(baseline))
        _check_devices_files(tokens, project_of(baseline))
    except ModelSpecError as exc:
        raise ModelSpecError(f"{what}: {exc}") from None
    return _parse(parser, tokens, what)


def project_of(baseline: str | os.PathLike[str]) -> Path:
    """The project directory of a baseline file: its own directory, symbolic links resolved."""
    return Path(os.path.abspath(baseline)).resolve().parent


def _positional(tokens: list[str], what: str) -> list[str]:
    """The tokens that are not options (the model and its key=value arguments); refuses any option that a
    saved entry cannot hold."""
    positional = []
    tokens_left = iter(tokens)
    for token in tokens_left:
        takes_value = ENTRY_OPTIONS.get(token, False)  # False also for a flag of ENTRY_OPTIONS: checked below
        if takes_value:
            value = next(tokens_left, None)
            if value is None or value.startswith("-"):  # no value of these options starts with "-"
                raise ModelSpecError(f"{what}: {token} needs a value")
        elif token.startswith("-"):
            if token not in ENTRY_OPTIONS:
                allowed = ", ".join(sorted(ENTRY_OPTIONS))
                raise ModelSpecError(f"{what}: its spec holds the option {token!r}, which a baseline may not "
                                     f"hold (only {allowed})")
        else:
            positional.append(token)
    return positional


def _parse(parser: argparse.ArgumentParser, tokens: list[str], what: str) -> argparse.Namespace:
    """``tokens`` parsed by ``parser``, its usage errors raised as one line instead of exiting."""
    def refuse(message: str) -> NoReturn:
        raise ModelSpecError(f"{what}: {message}")

    parser.exit_on_error = False
    parser.error = refuse  # type: ignore[method-assign]
    try:
        return parser.parse_intermixed_args(tokens)
    except argparse.ArgumentError as exc:
        raise ModelSpecError(f"{what}: {exc}") from None


def check_model(spec: str, overrides: list[str], project: Path) -> None:
    """Refuse a model spec that the command line would not accept from ``project``'s baseline (module
    docstring); imports nothing the spec names."""
    source, sep, rest = spec.partition(":")
    if not sep:
        from ..zoo import ZOO

        if spec not in ZOO:
            raise ModelSpecError(f"{spec!r} is not a built-in model (`modelmeter list`)")
    elif source in LOADING_OPTIONS:
        name, _, inline = rest.partition(",")
        if not _LIBRARY_NAME.fullmatch(name.strip()):
            raise ModelSpecError(f"{spec!r} does not name a {source} model")
        _check_library_options(source, parse_overrides([inline, *overrides] if inline else overrides))
    else:
        target, _, factory = spec.rpartition(":")
        if not factory.isidentifier():
            raise ModelSpecError(f"{spec!r}: the factory must be a Python name, got {factory!r}")
        if target.endswith(".py") or "/" in target or os.sep in target:
            _check_file(target, project)
        else:
            _check_module(target, project)


def _check_library_options(source: str, options: dict[str, Any]) -> None:
    for key, value in options.items():
        allowed = LOADING_OPTIONS[source].get(key)
        if key.startswith("_") or (allowed is not None and value not in allowed):
            raise ModelSpecError(f"{source} option {key}={value!r} is not allowed in a baseline: it may load "
                                 "weights, checkpoints or code")


def _check_devices_files(tokens: list[str], project: Path) -> None:
    """A ``--devices-file`` of the entry (or a device file given to ``--device``) is a JSON or TOML file inside
    the project, as a model file is."""
    for option, value in itertools.pairwise(tokens):
        if option == "--devices-file" or (option == "--device" and value.lower().endswith((".json", ".toml"))):
            _check_file(value, project, (".json", ".toml"), "a devices file (.json or .toml)")


def _check_file(target: str, project: Path, suffixes: tuple[str, ...] = (".py",),
                kind: str = "a Python file (.py)") -> None:
    if target.startswith("~") or os.path.isabs(target):
        raise ModelSpecError(f"{target} is an absolute path: a baseline names files relative to the working "
                             f"directory, inside its project directory {project}")
    if not target.endswith(suffixes):
        raise ModelSpecError(f"{target} is not {kind}")
    path = Path(os.getcwd(), target).resolve()
    if not path.is_relative_to(project):
        raise ModelSpecError(f"{target} is outside the baseline's project directory {project}")
    if not path.is_file():
        raise ModelSpecError(f"no such file: {target}")


def _check_module(target: str, project: Path) -> None:
    """``target``'s top-level package, as the import would find it (the working directory first on the path),
    lies inside ``project``: found without importing it."""
    if not all(part.isidentifier() for part in target.split(".")):
        raise ModelSpecError(f"{target!r} is not a module name (package.module)")
    top = target.split(".")[0]
    with on_path(os.getcwd()):  # the working directory first, as the loader puts it
        try:
            found = importlib.util.find_spec(top)  # a top-level name: nothing is imported to find it
        except (ImportError, ValueError):
            found = None
    if found is None:
        raise ModelSpecError(f"no module named {target!r} in the working directory")
    locations = list(found.submodule_search_locations or []) or [found.origin or "built-in"]
    outside = [where for where in locations if not _inside(where, project)]
    if outside:
        raise ModelSpecError(f"the module {target!r} is not in the baseline's project directory {project} "
                             f"({top} is {outside[0]})")


def check_factory(module: Any, factory: Any, spec: str, project: str) -> None:
    """After the project's module is imported, before its factory is called: the module's file lies in
    ``project`` and the factory is a function or class the module itself defines (not, say, a ``run``
    it imported from ``subprocess``)."""
    where = getattr(module, "__file__", None) or "built-in"
    if not _inside(where, Path(project)):
        raise ModelSpecError(f"{spec}: the module imported from {where} is outside the baseline's project "
                             f"directory {project}")
    defined_here = getattr(factory, "__module__", None) == module.__name__
    if not (defined_here and (inspect.isfunction(factory) or inspect.isclass(factory))):
        raise ModelSpecError(f"{spec}: a baseline may only call a function or class defined in "
                             f"{spec.rpartition(':')[0]} itself")


def _inside(where: str, project: Path) -> bool:
    return os.path.isabs(where) and Path(where).resolve().is_relative_to(project)
