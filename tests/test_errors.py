"""One exception tree: every error modelmeter raises on purpose is a ``ModelMeterError`` and the built-in error a
caller would expect, so ``except modelmeter.ModelMeterError`` catches all of them and ``except ValueError`` keeps
working. Checked two ways: statically (no ``raise`` of a bare built-in error in the package but where the reason is
written below) and by calling the public surface wrongly."""

from __future__ import annotations

import ast
import builtins
import importlib
import pickle
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter import errors

PACKAGE = Path(modelmeter.__file__).parent

_MODELS_OWN = "the model's own check, as the original model makes it"
_PROTOCOL = "Python's attribute protocol"
_ERRNO = "the file system's own error, with its errno"

# (file, enclosing function or "*", built-in error) -> why that raise is not a ModelMeterError
ALLOWED = {
    ("engine/kernel_checks.py", "*", "RuntimeError"): "torch's own error, imitated where a meta kernel lacks the check",
    ("engine/kernel_checks.py", "reduction_check", "IndexError"): "torch's own error (max/min along an empty "
                                                                  "dimension), imitated",
    ("engine/kernel_checks.py", "_indices_in_table", "IndexError"): "torch's own error, imitated where a meta kernel "
                                                                     "lacks the check",
    ("engine/meta_kernels.py", "*", "RuntimeError"): "torch's own error, imitated by a meta kernel",
    **{(f"zoo/{model}.py", "forward", "AssertionError"): _MODELS_OWN for model in ("bert", "gpt", "llama", "vit")},
    **{(path, "__getattr__", "AttributeError"): _PROTOCOL
       for path in ("__init__.py", "zoo/__init__.py", "engine/trace.py", "io/lazy_path.py")},
    ("io/handlers.py", "*", "IsADirectoryError"): _ERRNO,
    ("io/handlers.py", "*", "FileExistsError"): _ERRNO,
    ("io/atomic.py", "exchange", "OSError"): _ERRNO,
    ("io/cache_dir.py", "directory_lock", "TimeoutError"): "a lock that stayed taken, as file_lock's filelock.Timeout "
                                                           "(a TimeoutError) says",
    ("cache/shared.py", "_unreadable", "KeyError"): "control flow inside the key, caught where it is raised",
    ("cache/fingerprint.py", "value", "NotImplementedError"): "an abstract method",
    ("parallel/schedule.py", "*", "RuntimeError"): "a bug in modelmeter (the simulation stalled), not a mistake "
                                                  "of the caller's",
    ("reports/format.py", "*", "AssertionError"): "a bug in modelmeter (an unreachable branch)",
}

_CONTROL_FLOW = {"SystemExit", "KeyboardInterrupt", "GeneratorExit", "StopIteration", "StopAsyncIteration"}
_BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                   if isinstance(value, type) and issubclass(value, BaseException)} - _CONTROL_FLOW


def _raises(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(enclosing function, raised built-in error, line) of every ``raise Builtin(...)`` / ``raise Builtin``."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(target, ast.Name) and target.id in _BUILTIN_ERRORS:
                    found.append((function, target.id, child.lineno))
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_bare_builtin_error_is_raised_on_purpose() -> None:
    bare = []
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for function, error, line in _raises(ast.parse(path.read_text(), str(path))):
            key = next((k for k in ((relative, function, error), (relative, "*", error)) if k in ALLOWED), None)
            if key is None:
                bare.append(f"{relative}:{line} raises a bare {error} in {function}()")
            else:
                used.add(key)
    assert not bare, "raise a modelmeter.errors class instead (InvalidValueError, ...):\n" + "\n".join(bare)
    assert used == set(ALLOWED), f"allowances no raise needs any more: {sorted(set(ALLOWED) - used)}"


def _package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in the package under a public name, by its qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], "modelmeter."):
        if info.name.startswith("modelmeter.__main__") or info.name.endswith("conftest"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and not name.startswith("_")
                    and value.__module__ == module.__name__):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_class_of_the_package_is_a_modelmeter_error() -> None:
    classes = _package_exceptions()
    assert len(classes) >= 20  # the walk found the package's errors
    outside = sorted(name for name, kind in classes.items() if not issubclass(kind, errors.ModelMeterError))
    assert not outside


def test_the_general_errors_are_exported_at_the_root_and_keep_their_builtin_base() -> None:
    expected = {"InvalidValueError": ValueError, "InvalidTypeError": TypeError, "InvalidNameError": KeyError,
                "UnsupportedError": NotImplementedError, "ModelRunError": RuntimeError, "ModelExitError": Exception}
    for name, builtin in expected.items():
        kind = getattr(modelmeter, name)
        assert name in modelmeter.__all__
        assert issubclass(kind, modelmeter.ModelMeterError) and issubclass(kind, builtin)


@pytest.mark.parametrize("kind", [errors.InvalidValueError, errors.InvalidTypeError, errors.InvalidNameError,
                                  errors.UnsupportedError])
def test_errors_survive_pickling(kind: type[Exception]) -> None:
    # a process pool (`modelmeter --jobs`) sends errors back pickled
    again = pickle.loads(pickle.dumps(kind("what went wrong")))
    assert type(again) is kind and str(again) == "what went wrong"


def test_invalid_name_reads_as_its_message() -> None:
    # KeyError's own str() quotes its argument as a key's repr
    assert str(errors.InvalidNameError("no module named 'x'")) == "no module named 'x'"


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU())


def _calls() -> list[tuple[str, object, type[BaseException]]]:
    from modelmeter.checkpoint import Checkpointer
    from modelmeter.io import HTTPURLHandler
    from modelmeter.zoo import get_model

    model, x = _tiny(), torch.randn(2, 4)
    checkpointer = Checkpointer(model)
    checkpointer.add_checkpointable("extra", nn.Linear(1, 1))
    flops = modelmeter.FlopCountAnalysis(model, x)
    result = modelmeter.analyze(model, x, quiet=True).result()
    return [
        ("a convention that does not exist", lambda: modelmeter.analyze(model, x, convention="nope"), ValueError),
        ("an execution that does not exist", lambda: modelmeter.analyze(model, x, execution="nope").result(),
         ValueError),
        ("a model that is not a module", lambda: modelmeter.analyze(object(), x), TypeError),  # type: ignore[arg-type]
        ("inputs that are None", lambda: modelmeter.analyze(model, None), TypeError),
        ("a module name not in the model", lambda: flops.total("nope"),
         KeyError),
        ("a module name not in the result", lambda: result.row("nope"), KeyError),
        ("a zoo model that does not exist", lambda: get_model("nope"), KeyError),
        ("a checkpoint entry taken twice", lambda: checkpointer.add_checkpointable("extra", nn.Linear(1, 1)),
         KeyError),
        ("listing a web server", lambda: HTTPURLHandler().ls("https://example.com/x"), NotImplementedError),
        ("a device that does not exist", lambda: modelmeter.get_device("nope"), ValueError),
    ]


def test_the_public_surface_raises_modelmeter_errors() -> None:
    for what, call, builtin in _calls():
        with pytest.raises(modelmeter.ModelMeterError) as caught:
            call()  # type: ignore[operator]
        assert isinstance(caught.value, builtin), what
