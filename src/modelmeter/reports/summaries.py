"""The checks of a read result's ``roofline`` and ``parallel`` summaries (docs/reports.md, "The result's schema").

Every report prints these summaries as they are, so :meth:`~.result.Result.from_dict` refuses one that is not as
modelmeter writes it: each field a report reads present and of its type (a summary edited by hand is a one-line
``ValueError`` naming the field, never a ``KeyError`` from a renderer). A field no report reads is left as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import InvalidValueError

# What a check is: it raises for a value that is not of its kind, naming ``where`` (the field's dotted path).
Check = Callable[[Any, str], None]
MAX_NUMBER = 1e30  # no model's cost comes near this (the guard's limit too): a larger one is a damaged file
# The smallest positive number the summaries hold: the roofline chart divides and takes logs of them, and a
# quotient of the two bounds (1e60) stays a finite float.
MIN_POSITIVE = 1e-30


def shown(value: Any) -> str:
    """``value`` for a message: a number in full (a number cut to 40 characters reads as a smaller one), an integer
    of over 39 digits by its size, anything else cut to 40 characters."""
    if type(value) is int and value.bit_length() > 128:  # (str() refuses ints of over 4300 digits)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return f"{value!r:.40}"


def _refuse(where: str, value: Any, kind: str) -> NoReturn:
    raise InvalidValueError(f"{where} is {shown(value)}, not {kind}")


def number(value: Any, where: str) -> None:
    """0, or a number (not a boolean) from :data:`MIN_POSITIVE` to :data:`MAX_NUMBER`."""
    if type(value) not in (int, float) or not (value == 0 or MIN_POSITIVE <= value <= MAX_NUMBER):
        _refuse(where, value, f"0 or a number from {MIN_POSITIVE:g} to {MAX_NUMBER:g}")


def positive(value: Any, where: str) -> None:
    """A number from :data:`MIN_POSITIVE` to :data:`MAX_NUMBER` (one a report divides by)."""
    if type(value) not in (int, float) or not MIN_POSITIVE <= value <= MAX_NUMBER:
        _refuse(where, value, f"a number from {MIN_POSITIVE:g} to {MAX_NUMBER:g}")


def count(value: Any, where: str) -> None:
    """An integer (not a boolean) from 0 to :data:`MAX_NUMBER`."""
    if type(value) is not int or not 0 <= value <= MAX_NUMBER:
        _refuse(where, value, "a count")


def text(value: Any, where: str) -> None:
    if type(value) is not str:
        _refuse(where, value, "text")


def flag(value: Any, where: str) -> None:
    if type(value) is not bool:
        _refuse(where, value, "true or false")


def nullable(check: Check) -> Check:
    """``check``, or ``null``."""
    def checked(value: Any, where: str) -> None:
        if value is not None:
            check(value, where)
    return checked


def mapping(check: Check) -> Check:
    """An object whose every value passes ``check``."""
    def checked(value: Any, where: str) -> None:
        if type(value) is not dict:
            _refuse(where, value, "an object")
        for key, item in value.items():
            check(item, f"{where}.{key}")
    return checked


def items(check: Check, length: int | None = None) -> Check:
    """A list (of ``length`` items when given) whose every item passes ``check``."""
    def checked(value: Any, where: str) -> None:
        if type(value) is not list or (length is not None and len(value) != length):
            _refuse(where, value, "a list" if length is None else f"a list of {length}")
        for index, item in enumerate(value):
            check(item, f"{where}[{index}]")
    return checked


def obj(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """An object with every ``required`` field and any of the ``optional`` ones, each passing its check (other
    fields unchecked: no report reads them)."""
    def checked(value: Any, where: str) -> None:
        if type(value) is not dict:
            _refuse(where, value, "an object")
        missing = [name for name in required if name not in value]
        if missing:
            raise InvalidValueError(f"{where} lacks {', '.join(missing)}")
        for name, check in {**required, **(optional or {})}.items():
            if name in value:
                check(value[name], f"{where}.{name}")
    return checked


def _time(value: Any, where: str) -> None:
    """The roofline's time per phase: each a number, and the total."""
    obj({"total": number})(value, where)
    mapping(number)(value, where)


def _measured(value: Any, where: str) -> None:
    """A measured time comes with its MFU and HFU (the text reports print them beside it)."""
    if value.get("measured_time") is not None:
        obj({"mfu": number, "hfu": number})(value, where)


_OPERATOR = obj({"operator": text, "dtype": nullable(text), "flops": number, "bytes": number, "time": number,
                 "compute_bound": flag})
_DEVICE = obj({"label": text, "memory": number, "bandwidth": positive, "peak": positive},
              {"vector_peak": nullable(number)})
_ROOFLINE = obj({"device": _DEVICE, "dtype": nullable(text), "time": _time, "compute_bound_share": number},
                {"throughput": nullable(number), "items": nullable(obj({}, {"unit": text})),
                 "predicted_mfu": nullable(number), "measured_time": nullable(number), "mfu": nullable(number),
                 "hfu": nullable(number), "operators": items(_OPERATOR)})
_RANK = obj({"ranks": items(count, length=2), "count": count, "flops": obj({"total": number}),
             "parameters": obj({"held": number}), "communication": obj({"sent": number, "received": number})},
            {"stage": nullable(count), "memory": nullable(obj({"peak": number, "parts": mapping(number)})),
             "time": nullable(obj({"step": number, "assumption": text})),
             "coordinates": nullable(mapping(items(count)))})  # an uneven tensor-parallel split's rows
_PIPELINE = obj({"stages": count, "micro_batches": count},
                {"bubble_fraction": nullable(number), "schedule": nullable(text)})
_PARALLEL = obj({"plan": text, "world_size": count, "mesh": mapping(count), "ranks": items(_RANK)},
                {"micro_batches": nullable(count), "pipeline": nullable(_PIPELINE)})


def check_summaries(data: dict[str, Any]) -> None:
    """A result's ``roofline`` and ``parallel`` summaries (when not empty) as every report reads them."""
    roofline = data.get("roofline")
    if roofline:
        _ROOFLINE(roofline, "the result's roofline")
        _measured(roofline, "the result's roofline")
    parallel = data.get("parallel")
    if parallel:
        _PARALLEL(parallel, "the result's parallel")
