"""The one broadcast of plain shapes (engine/shapes.py) that the meta kernels and the handles share, against
torch's own ``broadcast_shapes``: the same shape where torch gives one, an error where torch raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelmeter.engine.shapes import broadcast_shape
from modelmeter.errors import InvalidValueError

# sizes 0, 1 and two others: a 1 stretches, a 0 is a size of its own, 2 against 3 fails
SHAPES = st.lists(st.lists(st.sampled_from([0, 1, 2, 3]), max_size=4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(SHAPES)
def test_broadcast_shape_is_torchs(shapes: list[list[int]]) -> None:
    try:
        expected = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        with pytest.raises(InvalidValueError, match="do not broadcast"):
            broadcast_shape(*shapes)
    else:
        assert broadcast_shape(*shapes) == expected


@pytest.mark.parametrize(("shapes", "expected"), [
    ((), ()), (((),), ()), (((0,), (1,)), (0,)), (((1, 0), (3, 1)), (3, 0)), (((2, 1, 4), (3, 1), (4,)), (2, 3, 4)),
    ((torch.Size([5, 1]), [1, 6]), (5, 6)),
])
def test_broadcast_shape_examples(shapes: tuple[list[int], ...], expected: tuple[int, ...]) -> None:
    assert broadcast_shape(*shapes) == expected == tuple(torch.broadcast_shapes(*shapes))


@pytest.mark.parametrize("shapes", [((2,), (3,)), ((0,), (2,)), ((4, 2), (2, 1), (3, 1))])
def test_shapes_that_do_not_broadcast_are_refused_as_torch_refuses_them(shapes: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes(*shapes)
    with pytest.raises(InvalidValueError, match="do not broadcast"):
        broadcast_shape(*shapes)
