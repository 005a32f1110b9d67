"""What a guard accepts as a number or a file: a guard that reads NaN, infinity or a negative cost compares
nothing (every comparison with NaN is false), so every amount it reads is checked here first."""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
from typing import Any

from ..errors import InvalidTypeError, InvalidValueError, ModelMeterError
from ..reports import jsontext
from ..reports.files import file_problem
from ..reports.render import format_metric
from ..reports.result import BYTE_METRICS, TIME_METRICS
from ..reports.summaries import MAX_NUMBER

MAX_AMOUNT = MAX_NUMBER  # no model's cost comes near it: a larger number in a file or a flag is a mistake
MAX_FILE_BYTES = 64 * 2**20  # a baseline of hundreds of large models is a few MiB


class GuardFileError(ModelMeterError, ValueError):
    """A baseline or saved analysis that cannot be used: unreadable, not JSON, or holding a wrong value."""


def check_amount(value: object, what: str) -> float:
    """``value`` as a cost or limit: an int or float (not a bool), finite, at least 0 and at most
    :data:`MAX_AMOUNT`. ``TypeError`` / ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{what} must be a number, got {type(value).__name__} {shorten(value)}")
    if isinstance(value, int) and value > MAX_AMOUNT:  # compared as an int: a huge one does not fit a float
        raise InvalidValueError(f"{what} is out of range: {shorten(value)} is over {MAX_AMOUNT:g}")
    if not math.isfinite(value):
        raise InvalidValueError(f"{what} must be a finite number, got {value}")
    if value < 0:
        raise InvalidValueError(f"{what} cannot be negative, got {value}")
    if value > MAX_AMOUNT:
        raise InvalidValueError(f"{what} is out of range: {value:g} is over {MAX_AMOUNT:g}")
    return value


def check_tolerance(value: object, what: str = "tolerance") -> float:
    """A tolerance (a fraction: 0.01 is 1%): a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{what} must be a number (a fraction: 0.01 is 1%), got {type(value).__name__} "
                               f"{shorten(value)}")
    if not math.isfinite(value) or value < 0:
        raise InvalidValueError(f"{what} must be a finite number >= 0 (a fraction: 0.01 is 1%), got {value}")
    return float(value)


def parse_tolerance(text: str) -> float:
    """``"0.7%"`` or ``"0.007"`` as the float nearest the decimal written (0.7 / 100 in floats is just below it,
    and a growth of exactly 0.7% would fail); a ``ValueError`` for what is not a finite number >= 0."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(e[+-]?[0-9]{1,5})?\s*(%?)", text.strip().lower())
    if match is None:
        raise InvalidValueError(f"not a tolerance: {text!r} (a finite number >= 0, e.g. 1% or 0.01)")
    number, exponent, sign = match.groups()
    value = Fraction(number + (exponent or "")) / (100 if sign else 1)
    if value > MAX_AMOUNT:  # (float() of a larger Fraction may overflow)
        raise InvalidValueError(f"{text!r} is out of range for a tolerance (at most {MAX_AMOUNT:g})")
    return check_tolerance(float(value))


def check_name(name: str, what: str) -> None:
    """Names read from a file are printed: no control characters (an escape sequence could rewrite what the
    terminal shows), at most 1000 characters."""
    if not is_printable_name(name):
        raise GuardFileError(f"{what} is not a printable name of at most 1000 characters: {shorten(name)}")


def is_printable_name(name: str) -> bool:
    """``name`` has no control characters and at most 1000 characters (what a baseline's names may be)."""
    return name.isprintable() and len(name) <= 1000


_HOLDER = "a baseline or saved analysis"  # what jsontext says a file holds, or is not


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON in ``path``, at most :data:`MAX_FILE_BYTES`; NaN and Infinity (which Python's json reads) are
    refused. :class:`GuardFileError` naming the file for anything else, FileNotFoundError passes through."""
    where = repr(os.fspath(path))
    check_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES + 1)  # (a file that grew since it was checked)
        if len(text) > MAX_FILE_BYTES:
            raise GuardFileError(f"{where} is over {MAX_FILE_BYTES // 2**20} MiB: too large for a baseline or "
                                 "saved analysis")
        return jsontext.loads(text, _HOLDER)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise GuardFileError(f"cannot read {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise GuardFileError(f"{where} is not a text file (not UTF-8)") from None
    except RecursionError:
        raise GuardFileError(f"{where} is nested too deeply to be a baseline or saved analysis") from None
    except ValueError as exc:  # jsontext's InvalidValueError: malformed JSON, NaN / Infinity, a key given twice
        detail = str(exc).removeprefix(f"{_HOLDER} is not valid JSON: ")  # (said once)
        raise GuardFileError(f"{where} is not valid JSON: {detail[:200]}") from None


def check_file(path: str | os.PathLike[str]) -> None:
    """``path`` is a regular file of at most :data:`MAX_FILE_BYTES`, found without opening it: a pipe would
    block the guard forever and ``/dev/zero`` fill its memory. :class:`GuardFileError` otherwise;
    FileNotFoundError passes through."""
    problem = file_problem(path, MAX_FILE_BYTES, _HOLDER)
    if problem is not None:
        raise GuardFileError(problem)


def shorten(value: object, limit: int = 40) -> str:
    """``repr(value)``, at most ``limit`` characters, for an error message."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr() refuses ints of over 4300 digits
        return f"(an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def with_exact(metric: str, value: float) -> str:
    """``value`` of ``metric`` as the reports round it, and with every digit when that differs, for a guard's
    failure: ``4.112G (4,111,512,576)``, ``2.12KiB (2,176 bytes)``, ``1.23ms (0.0012345678901 s)``, ``96``."""
    short = format_metric(metric, value)
    if metric in TIME_METRICS:
        full = f"{float(value)!r} s"
    elif isinstance(value, int) or value.is_integer():
        full = f"{int(value):,}" + " bytes" * (metric in BYTE_METRICS)
    else:
        full = repr(value) + " bytes" * (metric in BYTE_METRICS)
    return short if short == full else f"{short} ({full})"


def percent(fraction: float) -> str:
    """A signed relative change, ``+2.8%``; two significant digits below 0.1% (``+0.0012%``), where ``+0.0%``
    would tell a failing change from none."""
    share = 100 * fraction
    return f"{share:+.1f}%" if abs(share) >= 0.1 or share == 0 else f"{share:+.2g}%"
