"""``LazyPath``: a path computed on first use."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import InvalidTypeError, InvalidValueError

__all__ = ["LazyPath"]


class LazyPath(os.PathLike[str]):
    """An ``os.PathLike`` whose path is ``func()``, computed on first use and then fixed.

    ``os.fspath``, ``open``, ``os.path.*``, ``str()``, ``len``, ``[]``, ``+`` and ``in`` compute the path.
    Other ``str`` attributes (``lp.upper()``, ``lp.endswith(...)``) are delegated to the path only once it has
    been computed, as in iopath; before that they raise ``AttributeError``, so that probing an object
    (``hasattr``, serialisers) never triggers the computation. ``==`` compares identity, as in iopath. A function
    that raises leaves the path uncomputed (its error is raised again on the next use); a computed path pickles as
    its value.
    """

    def __init__(self, func: Callable[[], str | os.PathLike[str]]) -> None:
        self._func = func
        self._value: str | None = None
        self._lock = threading.RLock()  # re-entrant, so that a function that needs its own path is told, not hung
        self._computing = False

    def _get_value(self) -> str:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._compute()
                value = self._value
        return value

    def _compute(self) -> str:
        """``func()`` as a ``str``; called with the lock held. A failure leaves the path uncomputed, so the next
        use calls ``func`` again."""
        if self._computing:
            raise InvalidValueError(f"LazyPath function {self._func!r} needs the path it is computing")
        self._computing = True
        try:
            raw = self._func()
            computed = os.fspath(raw) if isinstance(raw, (str, os.PathLike)) else raw
        finally:
            self._computing = False
        if not isinstance(computed, str):
            raise InvalidTypeError(f"LazyPath function must return a str path, got {type(computed).__name__}")
        return computed

    @property
    def materialized(self) -> bool:
        """Whether the path has been computed."""
        return self._value is not None

    def __fspath__(self) -> str:
        return self._get_value()

    def __str__(self) -> str:
        return self._get_value()

    def __repr__(self) -> str:
        if self._value is None:
            return f"LazyPath(<not computed: {self._func!r}>)"
        return f"LazyPath({self._value!r})"

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally. Private/dunder names are never delegated (this also keeps
        # pickle/copy, which probe for ``__setstate__`` etc. before ``__init__`` ran, working).
        if name.startswith("_"):
            raise AttributeError(name)
        value = self.__dict__.get("_value")
        if value is None:
            raise AttributeError(
                f"Uninitialized LazyPath has no attribute {name!r}; materialise it first with os.fspath(path)."
            )
        return getattr(value, name)

    def __getitem__(self, key: int | slice) -> str:
        return self._get_value()[key]

    def __len__(self) -> int:
        return len(self._get_value())

    def __iter__(self) -> Iterator[str]:
        return iter(self._get_value())

    def __contains__(self, item: str) -> bool:
        return item in self._get_value()

    def __add__(self, other: str) -> str:
        return self._get_value() + other

    def __radd__(self, other: str) -> str:
        return other + self._get_value()

    def __getstate__(self) -> dict[str, Any]:
        # A computed path travels as its value, so that it pickles whatever its function was (a lambda, a closure).
        func = self._func if self._value is None else functools.partial(str, self._value)
        return {"_func": func, "_value": self._value}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._func = state["_func"]
        self._value = state["_value"]
        self._lock = threading.RLock()
        self._computing = False
