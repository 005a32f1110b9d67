"""Strict JSON for every report modelmeter writes: a non-finite number is written as ``null``.

``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which strict readers (JavaScript's ``JSON.parse``,
``jq``, ``json.loads`` with ``parse_constant`` refusing them) reject, and with ``allow_nan=False`` it raises.
A result holds one only where a handle the user registered returned it (modelmeter's own formulas and ratios are
finite); it is written as ``null``, JSON's "no value", and :meth:`Result.from_dict` reads that ``null`` back
as NaN (docs/reports.md, "JSON").
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from ..errors import InvalidValueError


def finite(value: Any) -> Any:
    """``value`` (JSON-like data: dicts, lists, tuples, numbers, strings) with every non-finite float as None."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is dict:
        return {key: finite(item) for key, item in value.items()}
    if kind is list or kind is tuple:
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)`` as strict JSON: non-finite floats written as ``null``."""
    return json.dumps(finite(value), allow_nan=False, **options)


def loads(text: str | bytes, holder: str) -> Any:
    """``json.loads(text)`` as strict JSON: JSON's ``NaN`` and ``Infinity``, which Python's parser reads and no file
    modelmeter writes holds, are an InvalidValueError saying that ``holder`` (``"a saved trace"``) holds none; so is
    a key given twice in one object; malformed JSON is one saying that it is not valid JSON."""
    def refuse(name: str) -> NoReturn:
        raise InvalidValueError(f"{name} is not a value {holder} holds")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        """An object whose keys are all different: Python's parser keeps the last of a key given twice (a merge
        or a hand edit), so a cost or an entry read from the file could be another than the one reviewed."""
        data = dict(pairs)
        if len(data) < len(pairs):
            twice = next(key for i, (key, _) in enumerate(pairs) if key in (k for k, _ in pairs[:i]))
            raise InvalidValueError(f"the key {twice!r} is given twice in one object; {holder} holds each once")
        return data
    try:
        return json.loads(text, parse_constant=refuse, object_pairs_hook=unique)
    except InvalidValueError:
        raise
    except ValueError as exc:  # malformed JSON (json.JSONDecodeError), an integer of too many digits
        raise InvalidValueError(f"{holder} is not valid JSON: {str(exc)[:200]}") from exc
