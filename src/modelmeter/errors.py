"""Errors that name what went wrong: the argument, or the module and operator where a model failed."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace


class ModelMeterError(Exception):
    """Base class of every error modelmeter raises on purpose: ``except modelmeter.ModelMeterError`` catches them
    all. Each one is also the built-in error a caller would expect (a ``ValueError`` for a bad value, a
    ``KeyError`` for a name that is not there), so code that catches those keeps working."""


class InvalidValueError(ModelMeterError, ValueError):
    """A value modelmeter cannot take: an argument or option out of its range, a file or text whose content is
    damaged or of another kind. The message names the argument, option or file, and what it can be."""


class InvalidTypeError(ModelMeterError, TypeError):
    """An argument of a kind modelmeter cannot take (a numpy array where a tensor goes, a TorchScript module, a
    string where a flag goes); the message names the argument."""


class InvalidNameError(ModelMeterError, KeyError):
    """A name modelmeter cannot use: a module that is not in the model or the result, a model that is not in the
    zoo, a checkpoint entry that is not registered or is taken. The message names it and, where they are few, what
    there is."""

    def __str__(self) -> str:  # KeyError's own quotes the message as a key's repr
        return str(self.args[0]) if self.args else ""


class UnsupportedError(ModelMeterError, NotImplementedError):
    """Something modelmeter cannot do (yet): a valid request, not a mistake in it; the message says what and, where
    there is one, what to do instead."""


class ModelRunError(ModelMeterError, RuntimeError):
    """The model raised while it was traced; the message names the module and operator. ``wording``: the message
    as its parts (:class:`Wording`), where the engine made it of module classes and advice."""

    def __init__(self, message: str, module: str | None, operator: str | None,
                 wording: Wording | None = None) -> None:
        super().__init__(message)
        self.module = module
        self.operator = operator
        self.wording = wording


@dataclass(frozen=True)
class Wording:
    """A :class:`ModelRunError`'s message as its parts, so that a caller naming the model's modules or advising
    otherwise (the parallel runner, whose copy of the model has classes of its own) words it anew without editing
    its text. ``template``: ``str.format`` text, other text in it made :func:`literal`, with a field ``{class_N}``
    for the class of the module ``modules[N]`` names (``""``: the model) and ``{advice}`` for what it advises;
    ``classes``: the classes the message names those modules by; ``advice``: its advice."""

    template: str
    modules: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    advice: str = ""

    def text(self, classes: Mapping[str, str] | None = None, advice: str | None = None) -> str:
        """The message, naming each module by its class in ``classes`` (module name -> class name; its own class
        for one not there) and advising ``advice`` (None: the message's own)."""
        given = classes or {}
        fields = {f"class_{index}": given.get(module, own)
                  for index, (module, own) in enumerate(zip(self.modules, self.classes, strict=True))}
        return self.template.format(**fields, advice=self.advice if advice is None else advice)

    def reworded(self, classes: Mapping[str, str], advice: str | None = None) -> Wording:
        """This wording with the modules named by their class in ``classes`` and ``advice`` advised (as
        :meth:`text`)."""
        named = tuple(classes.get(module, own) for module, own in zip(self.modules, self.classes, strict=True))
        return replace(self, classes=named, advice=self.advice if advice is None else advice)


def literal(text: str) -> str:
    """``text`` as it reads in a :class:`Wording`'s template: its braces doubled, so none is a field."""
    return text.replace("{", "{{").replace("}", "}}")


class InputMismatchError(ModelRunError):
    """The model's inputs do not fit it: an operator got a tensor its module's parameters cannot take (channels,
    features, rank, token ids). The message names the module and operator and what they expected; the error is
    raised from torch's own. The command exits 2 on it, as on any other input it cannot use."""


class ParallelPlanError(ModelMeterError, ValueError):
    """A parallel plan that cannot be run: a malformed ``--parallel`` text (the message names the bad part), a
    plan a model cannot take (no tensor-parallel plan known for it), or a process group already set up."""


class ModelExitError(ModelMeterError):
    """The model's code raised ``SystemExit`` (``sys.exit``) or another ``BaseException`` that is neither an
    ``Exception`` nor ``KeyboardInterrupt`` while it was built or run: the analysis did not finish, which is a
    failure (a cost guard must never end quietly with exit status 0)."""

    def __init__(self, what: str, exc: BaseException) -> None:
        how = f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"raised {type(exc).__name__}"
        super().__init__(f"{what}: the model's code {how} before its analysis finished")


def cuda_failure(exc: BaseException) -> str | None:
    """What to tell the user when ``exc`` comes from a model that puts tensors on CUDA where CUDA cannot run (no
    driver, no GPU, a CPU-only torch); None for any other error."""
    import torch

    if torch.cuda.is_available():
        return None
    error = _cuda_error(exc)
    if error is None:
        return None
    return (f"it puts tensors on CUDA, which this machine cannot run ({type(error).__name__}); modelmeter needs no "
            "GPU: a fake run (execution 'auto' or 'fake') counts them on cuda, forward and backward, or create "
            "tensors on the device of the inputs or parameters (x.device) and build the model on cpu")


def puts_tensors_on_cuda(exc: BaseException) -> bool:
    """Whether ``exc`` comes from tensors the model put on CUDA: CUDA could not start, or a fake run met a tensor on
    CUDA next to the model's own (a FakeTensor run with everything on CUDA mends both)."""
    return _cuda_error(exc) is not None


def _cuda_error(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that CUDA caused, told by origin, not by the wording of torch's message: torch's
    CUDA initialisation on the failing stack, or a fake run that met a tensor on CUDA next to the model's own."""
    from ._torch_compat import FakeTensorDeviceMismatchError, cuda_lazy_init_code

    lazy_init = cuda_lazy_init_code()
    for error in _chain(exc):
        mixed = isinstance(error, FakeTensorDeviceMismatchError) and "cuda" in (
            error.device.type, error.common_device.type)
        if mixed or any(code is lazy_init for code in _codes(error)):
            return error
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _codes(exc: BaseException) -> Iterator[object]:
    """The code objects of the frames ``exc`` passed through."""
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def check_flag(name: str, value: object) -> None:
    """Refuse an argument ``name`` that is not a flag: a truthy ``"no"`` would turn it on. ``True``/``False``, an
    integer (``0``/``1``, as fvcore's callers pass) and numpy's bool are flags."""
    if isinstance(value, numbers.Integral) or getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return
    raise InvalidTypeError(f"{name} must be True or False, got {value!r:.60}")


def check_depth(name: str, value: object) -> None:
    """Refuse an argument ``name`` that is not a whole number of levels from 0 (the model's row alone) up."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTypeError(f"{name} must be an integer number of levels (0: the model's row only), got "
                               f"{value!r:.60}")
    if value < 0:
        raise InvalidValueError(f"{name} must be 0 or more (0: the model's row only), got {value}")
