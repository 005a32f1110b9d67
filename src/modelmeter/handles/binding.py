"""Formulas that read an operator's arguments by name, bound to the fvcore-style ``handle(inputs, outputs)``.

A handle gets the arguments of a call in the operator's schema order (``inputs``), as fvcore's handles do. A
formula written with :func:`by_name` names the arguments it reads instead, as the aten schema names them::

    @by_name
    def linear_cost(input, bias, *, result): ...

Bound to an operator (:meth:`Formula.bind`, or :func:`bind_all` for a table keyed by operator), it becomes such a
handle: each parameter is read at the position its name has in the schema of the overload that was called (told
apart by the number of arguments, which the recorder always places in full), so one formula serves every operator
and overload that names its arguments alike, wherever they sit. Defaults are settled here, in one place: an
argument the call did not place takes the schema's default, else the formula's own default (which also stands for
an argument the operator does not have); with neither, the call fails with an error naming the operator and the
argument. Two keyword-only parameters are not arguments: ``result`` (the first output, None when there is none)
and ``outputs`` (all of them, flattened).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from ..errors import InvalidTypeError

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")

RESULT, OUTPUTS = "result", "outputs"
_MISSING: Any = object()


@dataclass(frozen=True)
class _Argument:
    name: str
    default: Any = _MISSING  # the schema's default, as the recorder places it; _MISSING when it has none
    tensor: bool | None = None  # whether the schema's type is a tensor (``Tensor``, ``Tensor?``); None: unknown


@dataclass(frozen=True)
class _Overload:
    name: str
    arguments: tuple[_Argument, ...]
    written: tuple[int, ...]  # positions of the arguments an ``.out`` form writes into (empty for other forms)

    @property
    def writes_out(self) -> bool:
        """An ``.out`` form (it writes into an argument): chosen only when no other form fits."""
        return bool(self.written)

    def fits(self, inputs: list[Any]) -> bool:
        """True when every placed argument is a tensor exactly where the schema has one (None fits anywhere)."""
        return all(value is None or argument.tensor is None or argument.tensor == hasattr(value, "shape")
                   for value, argument in zip(inputs, self.arguments, strict=True))

    def index(self, names: tuple[str, ...]) -> int | None:
        """Position of the first of ``names`` among the arguments, or None."""
        for name in names:
            for i, argument in enumerate(self.arguments):
                if argument.name == name:
                    return i
        return None


@dataclass(frozen=True)
class _Parameter:
    name: str
    aliases: tuple[str, ...]  # the name, then the other argument names it stands for
    default: Any


class Formula(Generic[_T]):
    """A cost formula with named parameters; :meth:`bind` makes it the handle of one operator."""

    def __init__(self, fn: Callable[..., _T], aliases: Mapping[str, tuple[str, ...]],
                 arguments: tuple[str, ...] | None) -> None:
        self.fn = fn
        self.arguments = arguments
        self.parameters, self.wants = _parameters(fn, aliases)
        self._bound: dict[str, BoundFormula[_T]] = {}
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    def bind(self, op: str) -> BoundFormula[_T]:
        """This formula as the handle of ``op`` (``"aten::addmm"``; a ``backward:`` key reads its forward call).

        Raises ``TypeError`` naming the operator and the parameter when a parameter without a default is not an
        argument of any overload of ``op``.
        """
        bound = self._bound.get(op)
        if bound is None:
            bound = self._bound[op] = BoundFormula(self, op, _overloads(op, self.arguments))
        return bound


class BoundFormula(Generic[_T]):
    """A :class:`Formula` bound to one operator: a handle ``(inputs, outputs) -> _T``."""

    def __init__(self, formula: Formula[_T], op: str, overloads: tuple[_Overload, ...] | None) -> None:
        self.formula, self.op, self.overloads = formula, op, overloads
        self.__doc__ = formula.__doc__
        self.__name__ = formula.__name__
        # per number of arguments: (position or -1, value when -1) of each parameter; None where overloads of that
        # many arguments differ in their tensors' places (``addmm.out`` and ``addmm.dtype``): per placed tensors
        self._layouts: dict[int, tuple[tuple[int, Any], ...] | None] = {}
        self._typed_layouts: dict[tuple[bool, ...], tuple[tuple[int, Any], ...]] = {}
        self._at: dict[str, Callable[[list[Any], list[Any]], _T]] = {}  # at_overload, per overload name
        if overloads is not None:
            self._check(overloads)

    def __call__(self, inputs: list[Any], outputs: list[Any]) -> _T:
        layout = self._layouts.get(len(inputs), _MISSING)
        if layout is None:
            layout = self._typed_layout(inputs)
        elif layout is _MISSING:
            layout = self._layout(inputs)
        return self.apply(layout, inputs, outputs)

    def apply(self, layout: tuple[tuple[int, Any], ...], inputs: list[Any], outputs: list[Any]) -> _T:
        """The formula of the parameters ``layout`` places (see :meth:`place`) in a call of ``inputs``."""
        values = [inputs[i] if i >= 0 else value for i, value in layout]
        wanted = {name: outputs if name == OUTPUTS else (outputs[0] if outputs else None)
                  for name in self.formula.wants}
        return self.formula.fn(*values, **wanted)

    def at_overload(self, name: str) -> Callable[[list[Any], list[Any]], _T]:
        """This handle for calls that overload ``name`` placed (an event's ``overload``): the arguments read where
        that overload has them, with no guess from their number and types (``max.unary_out(self, *, out)``
        and ``max.other(self, other)`` place as many tensors). Itself when the operator has no such overload."""
        found = self._at.get(name)
        if found is None:
            chosen = next((o for o in self.overloads or () if o.name == name), None)
            found = self._at[name] = self if chosen is None else _AtOverload(self, chosen)
        return found

    def _check(self, overloads: tuple[_Overload, ...]) -> None:
        for parameter in self.formula.parameters:
            if parameter.default is _MISSING and all(o.index(parameter.aliases) is None for o in overloads):
                known = sorted({a.name for o in overloads for a in o.arguments})
                raise InvalidTypeError(f"{self.formula.__name__} reads argument {_spelled(parameter)}, which {self.op} "
                                       f"does not have (its arguments: {', '.join(known) or 'none'})")

    def _layout(self, inputs: list[Any]) -> tuple[tuple[int, Any], ...]:
        """Where each parameter is in a call that placed ``inputs`` (remembered by their number, or by where they
        hold tensors when overloads of that many arguments differ there)."""
        given = len(inputs)
        if self.formula.parameters and _ambiguous(self._known_overloads(), given):
            self._layouts[given] = None
            return self._typed_layout(inputs)
        layout = self._placed(inputs)
        self._layouts[given] = layout
        return layout

    def _typed_layout(self, inputs: list[Any]) -> tuple[tuple[int, Any], ...]:
        tensors = tuple(hasattr(value, "shape") for value in inputs)
        layout = self._typed_layouts.get(tensors)
        if layout is None:
            layout = self._typed_layouts[tensors] = self._placed(inputs)
        return layout

    def _placed(self, inputs: list[Any]) -> tuple[tuple[int, Any], ...]:
        if not self.formula.parameters:  # (a formula of the outputs only suits any operator, schema or not)
            return ()
        chosen = _overload_for(self._known_overloads(), inputs)
        return tuple(self.place(parameter, chosen, len(inputs)) for parameter in self.formula.parameters)

    def place(self, parameter: _Parameter, chosen: _Overload, given: int) -> tuple[int, Any]:
        """(position, None) of a parameter the call placed, else (-1, its default)."""
        index = chosen.index(parameter.aliases)
        if index is not None and index < given:
            return index, None
        default = parameter.default
        if index is not None and chosen.arguments[index].default is not _MISSING:
            default = chosen.arguments[index].default
        if default is _MISSING:
            raise InvalidTypeError(f"{self.op}: {self.formula.__name__} needs argument {_spelled(parameter)}, which "
                                   f"the call did not give ({given} argument{'s' if given != 1 else ''}) and which "
                                   "has no default")
        return -1, default

    def _known_overloads(self) -> tuple[_Overload, ...]:
        if self.overloads is None:  # registered since it was bound? (torch.distributed's fsdp:: operators are,
            self.overloads = _overloads(self.op, self.formula.arguments)  # when FSDP is first imported)
            if self.overloads is not None:
                self._check(self.overloads)
        if self.overloads is None:
            raise InvalidTypeError(f"{self.op}: {self.formula.__name__} reads arguments by name, but this PyTorch has "
                                   f"no schema for {self.op}")
        return self.overloads


class _AtOverload(Generic[_T]):
    """A :class:`BoundFormula` for the calls one overload placed (:meth:`BoundFormula.at_overload`)."""

    def __init__(self, bound: BoundFormula[_T], chosen: _Overload) -> None:
        self.bound, self.chosen, self.formula = bound, chosen, bound.formula
        self.__name__ = bound.__name__
        self._layouts: dict[int, tuple[tuple[int, Any], ...]] = {}  # per number of arguments placed

    def __call__(self, inputs: list[Any], outputs: list[Any]) -> _T:
        given = len(inputs)
        layout = self._layouts.get(given)
        if layout is None:
            layout = self._layouts[given] = tuple(self.bound.place(parameter, self.chosen, given)
                                                  for parameter in self.formula.parameters)
        return self.bound.apply(layout, inputs, outputs)


def at_overload(handle: Any, overload: str) -> Any:
    """``handle`` for a call that ``overload`` placed (an event's ``overload``; "" when unknown): a handle that
    reads arguments by name (its ``at_overload``) reads them where that overload has them; any other as it is."""
    at = getattr(handle, "at_overload", None) if overload else None
    return handle if at is None else at(overload)


@overload
def by_name(fn: Callable[..., _T], /) -> Formula[_T]: ...


@overload
def by_name(*, arguments: tuple[str, ...] | None = None,
            **aliases: str | tuple[str, ...]) -> Callable[[Callable[..., _T]], Formula[_T]]: ...


def by_name(fn: Callable[..., _T] | None = None, /, *, arguments: tuple[str, ...] | None = None,
            **aliases: str | tuple[str, ...]) -> Formula[_T] | Callable[[Callable[..., _T]], Formula[_T]]:
    """Mark ``fn`` as a formula over arguments named as in the operator's schema (see the module's docstring).

    ``aliases`` give a parameter the other names an operator may use for it (``mat1=("batch1", "mat")``: the
    multiplied matrix of ``addmm``, ``baddbmm`` and ``addmv``). ``arguments`` spells out the argument names for an
    operator that has no schema in torch (``flex_attention``); otherwise the schema is read from ``torch.ops``.
    """
    spelled = {name: (names,) if isinstance(names, str) else tuple(names) for name, names in aliases.items()}

    def make(function: Callable[..., _T]) -> Formula[_T]:
        return Formula(function, spelled, arguments)

    return make if fn is None else make(fn)


def bind_all(table: Mapping[str, Any]) -> dict[str, Any]:
    """``table`` with every :class:`Formula` bound to its operator (the key); other entries unchanged."""
    return {op: entry.bind(op) if isinstance(entry, Formula) else entry for op, entry in table.items()}


def _parameters(fn: Callable[..., Any], aliases: Mapping[str, tuple[str, ...]]) -> tuple[
        tuple[_Parameter, ...], tuple[str, ...]]:
    """The argument parameters of ``fn`` and the output parameters (``result``, ``outputs``) it wants."""
    parameters, wants = [], []
    for p in inspect.signature(fn).parameters.values():
        default = _MISSING if p.default is inspect.Parameter.empty else p.default
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in (RESULT, OUTPUTS):
            wants.append(p.name)
        elif p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name not in (RESULT, OUTPUTS):
            parameters.append(_Parameter(p.name, (p.name, *aliases.get(p.name, ())), default))
        else:
            raise InvalidTypeError(f"{fn.__name__}: parameter {p.name!r} must name an argument (a plain parameter) or "
                                   f"be the keyword-only {RESULT!r} or {OUTPUTS!r}")
    unknown = set(aliases) - {p.name for p in parameters}
    if unknown:
        raise InvalidTypeError(f"{fn.__name__}: aliases for parameters it does not have: {', '.join(sorted(unknown))}")
    return tuple(parameters), tuple(wants)


def _spelled(parameter: _Parameter) -> str:
    return " or ".join(repr(name) for name in parameter.aliases)


_SCHEMAS: dict[str, tuple[_Overload, ...]] = {}


def _overloads(op: str, arguments: tuple[str, ...] | None) -> tuple[_Overload, ...] | None:
    """The overloads of ``op`` (its forward call's for a ``backward:`` key), or the spelled-out ``arguments``;
    None when torch has no such operator (one of another version or device: checked when it is called)."""
    if arguments is not None:
        return (_Overload("default", tuple(_Argument(name) for name in arguments), ()),)
    name = op.removeprefix("backward:")
    found = _SCHEMAS.get(name)
    if found is None:  # (not kept when missing: the operator may be registered later)
        found = _read_schemas(name)
        if found is not None:
            _SCHEMAS[name] = found
    return found


def _read_schemas(op: str) -> tuple[_Overload, ...] | None:
    import torch  # here, not above: the handle tables are imported by the reports, which need no torch

    from .._torch_compat import schema_of

    namespace, _, name = op.partition("::")
    if namespace == "fsdp":  # registered by importing FSDP2, which a trace loaded from the cache may not have done
        with contextlib.suppress(ImportError):  # (a build without torch.distributed has none)
            import torch.distributed.fsdp
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        schemas = [(overload_, schema_of(getattr(packet, overload_))) for overload_ in packet.overloads()]
    except (AttributeError, RuntimeError):
        return None
    return tuple(_overload(overload_, schema) for overload_, schema in schemas) or None


def _overload(name: str, schema: torch.FunctionSchema) -> _Overload:
    import torch

    tensor = torch.OptionalType(torch.TensorType.get())
    arguments = tuple(_Argument(a.name, _plain(a.default_value) if a.has_default_value() else _MISSING,
                                a.type.isSubtypeOf(tensor)) for a in schema.arguments)
    written = tuple(i for i, a in enumerate(schema.arguments)
                    if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    return _Overload(name, arguments, written)


def _plain(value: Any) -> Any:
    """A schema default as the recorder places it: lists as lists, dtypes and layouts as their names."""
    import torch

    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.device)):
        return str(value)
    return value


def out_arguments(op: str, inputs: list[Any], overload: str = "") -> tuple[int, ...]:
    """Positions of the arguments that a call of ``op`` placing ``inputs`` writes its results into (the ``out=``
    tensors of an ``.out`` form); empty for any other form, or an operator torch has no schema for. ``overload``,
    when known, names the overload that placed them; else it is told by their number and types."""
    overloads = _overloads(op, None)
    if not overloads:
        return ()
    named = next((o for o in overloads if o.name == overload), None) if overload else None
    return (named or _overload_for(overloads, inputs)).written


def out_arguments_vary(op: str, given: int) -> bool:
    """True when calls of ``op`` placing ``given`` arguments may be of an ``.out`` form or not, told apart by
    where they hold tensors (``addmm.out`` and ``addmm.dtype`` both have six arguments)."""
    overloads = _overloads(op, None)
    return overloads is not None and _ambiguous(overloads, given)


def _count_fits(overloads: tuple[_Overload, ...], given: int) -> list[_Overload]:
    """The overloads with ``given`` arguments, an ``.out`` form last."""
    return sorted((o for o in overloads if len(o.arguments) == given), key=lambda o: o.writes_out)


def _ambiguous(overloads: tuple[_Overload, ...], given: int) -> bool:
    """True when overloads with ``given`` arguments name or type them differently: the call's tensors tell."""
    fits = _count_fits(overloads, given)
    return any((o.arguments, o.written) != (fits[0].arguments, fits[0].written) for o in fits[1:])


def _overload_for(overloads: tuple[_Overload, ...], inputs: list[Any]) -> _Overload:
    """The overload a call that placed ``inputs`` was placed by: the one with that many arguments (of several,
    the first whose tensors are where the call's are; an ``.out`` form only when nothing else fits); for a call
    that placed another number (a user-level call that passed only its positional arguments), the ``default``
    overload, else the first."""
    fits = _count_fits(overloads, len(inputs))
    if fits:
        return next((o for o in fits if o.fits(inputs)), fits[0])
    return next((o for o in overloads if o.name == "default"), overloads[0])
