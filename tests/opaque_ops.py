"""Custom operators no convention knows: the tests' reliably unsupported operators.

Every aten operator of common models is counted or classified free on purpose, so tests that need an
unsupported operator register their own with ``torch.library`` (with a fake kernel, so fake runs work).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _opaque(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    @torch.library.custom_op(f"modelmeter_test::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 1.5

    @op.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return op


blur = _opaque("blur")
warp = _opaque("warp")
mix = _opaque("mix")


def scale_op(namespace: str) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """``NAMESPACE::scale(x, factor)``: a custom operator with a scalar argument, for formulas that read it."""
    @torch.library.custom_op(f"{namespace}::scale", mutates_args=())
    def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @scale.register_fake
    def _(x: torch.Tensor, factor: float) -> torch.Tensor:
        return torch.empty_like(x)

    return scale
