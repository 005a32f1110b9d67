"""Errors that name what went wrong: the argument, or the module and operator where a model failed."""

from __future__ import annotations


class ModelMeterError(Exception):
    """Base class of every error modelmeter raises on purpose."""


class ModelRunError(ModelMeterError, RuntimeError):
    """The model raised while it was traced; the message names the module and operator."""

    def __init__(self, message: str, module: str | None, operator: str | None) -> None:
        super().__init__(message)
        self.module = module
        self.operator = operator
