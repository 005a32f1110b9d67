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


class ModelExitError(ModelMeterError):
    """The model's code raised ``SystemExit`` (``sys.exit``) or another ``BaseException`` that is neither an
    ``Exception`` nor ``KeyboardInterrupt`` while it was built or run: the analysis did not finish, which is a
    failure (a cost guard must never end quietly with exit status 0)."""

    def __init__(self, what: str, exc: BaseException) -> None:
        how = f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"raised {type(exc).__name__}"
        super().__init__(f"{what}: the model's code {how} before its analysis finished")
