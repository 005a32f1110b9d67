"""Models whose path depends on values, state or randomness, and unusual wrappers: the analysis counts the path a real
call takes, and leaves the model, its inputs and the caller's random number generators as they were.

Oracle: torch's own ``FlopCounterMode`` on a real call (products only: modelmeter's ``"macs"`` doubled), on copies
of the model and the inputs.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import ModelRunError, analyze
from modelmeter.engine import recorder


def real_products(model: nn.Module, inputs: tuple[Any, ...]) -> int:
    """The floating-point operations of the products of a real call, on copies (the call may change them)."""
    model, inputs = copy.deepcopy(model), copy.deepcopy(inputs)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return int(counter.get_total_flops())


def counted_products(model: nn.Module, inputs: tuple[Any, ...], execution: str = "auto") -> int:
    analysis = analyze(model, inputs, convention="macs", execution=execution, quiet=True)
    return 2 * int(analysis.flops.total())


class _Gated(nn.Module):
    """A small layer, and a large one when ``mask`` (an input) still has a non-zero element after the model wrote
    values it computed (zeros: ``h > 1e9`` is never true) into it by way of ``write``."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        self.small, self.large = nn.Linear(8, 8), nn.Linear(8, 64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.small(x)
        zeros = (h[:2, 0] > 1e9).long()
        read = mask
        if self.write == "slice copy_":
            mask[:2].copy_(zeros)
        elif self.write == "view setitem":
            read = mask.clone()
            read.view(-1)[:2] = zeros
        else:  # the base written, a view of it read
            read = mask[:2]
            mask.mul_(zeros)
        if read.sum() > 0:
            return self.large(h)
        return h


@pytest.mark.parametrize("write", ["slice copy_", "view setitem", "base written, view read"])
def test_values_written_through_a_view_are_not_followed_as_they_were(write: str) -> None:
    # The mask's values are known to a fake run (an input); once unknown values are written into one view of its
    # storage, every view of it is unknown: the branch read from it is the real one (it took the large layer)
    model, inputs = _Gated(write), (torch.randn(4, 8), torch.ones(2, dtype=torch.long))
    expected = real_products(model, inputs)
    assert expected == 2 * 4 * 8 * 8  # the small layer alone
    assert counted_products(model, copy.deepcopy(inputs)) == expected
    assert counted_products(model, copy.deepcopy(inputs), "real") == expected


class _Cache:
    """A cache object the caller passes (as transformers' ``DynamicCache``): the model appends to it."""

    def __init__(self) -> None:
        self.keys = [torch.randn(3, 8)]
        self.length = torch.tensor(3)
        self.inner = _Counter()


class _Counter:
    def __init__(self) -> None:
        self.calls = 0


class _Appends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        h = self.proj(x)
        cache.keys.append(h)
        cache.keys = list(cache.keys)  # replaced, too
        cache.length += h.shape[0]  # in place
        cache.inner.calls += 1
        cache.last = h  # an attribute it did not have
        return h @ torch.cat(cache.keys).T


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_an_object_passed_to_the_model_is_left_as_it_was(execution: str) -> None:
    cache = _Cache()
    keys, first = cache.keys, cache.keys[0].clone()
    model, x = _Appends(), torch.randn(2, 8)
    expected = real_products(model, (x, cache))
    assert counted_products(model, (x, cache), execution) == expected == 2 * (2 * 8 * 8 + 2 * 8 * 5)
    assert cache.keys is keys and len(keys) == 1 and torch.equal(keys[0], first) and type(keys[0]) is torch.Tensor
    assert int(cache.length) == 3 and cache.inner.calls == 0 and not hasattr(cache, "last")


def test_a_key_value_cache_passed_to_a_transformers_model_is_left_as_it_was() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 64, (1, 7))
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
    before = [(layer.keys, layer.keys.clone()) for layer in cache.layers]
    analyze(model, {"input_ids": ids[:, 6:], "past_key_values": cache, "use_cache": True}, quiet=True)
    assert cache.get_seq_length() == 6  # not 7, nor FakeTensors
    for layer, (tensor, values) in zip(cache.layers, before, strict=True):
        assert layer.keys is tensor and torch.equal(tensor, values)


class _LayerDrop(nn.Module):
    """Skips each layer with probability 1/2 in training mode, drawing from torch's generator or Python's ``random``;
    ``needs_values``: then reads a value computed from the weights (a fake run cannot: the fallback runs real
    kernels)."""

    def __init__(self, draw: str, needs_values: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))
        self.draw, self.needs_values = draw, needs_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            p = torch.rand(()).item() if self.draw == "torch" else random.random()
            if self.training and p < 0.5:
                continue
            x = layer(x)
        if self.needs_values and x.sum() > 1e9:
            x = x * 2
        return x


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("needs_values", [False, True])
@pytest.mark.parametrize("draw", ["torch", "random"])
def test_a_layer_drop_counts_the_layers_a_call_now_would_run(draw: str, needs_values: bool) -> None:
    # The call's path follows the numbers drawn from the caller's generators as they are: every attempt (a fake run,
    # the fallback to real kernels) draws those, a value is drawn once (not again to follow it), no trace is shared
    # with or stored for a call with other states; and the generators are left as they were (Python's and numpy's)
    model, x = _LayerDrop(draw, needs_values).train(), torch.randn(4, 8)
    counts = set()
    for seed in range(4):
        _seeded(seed)
        expected = real_products(model, (x,))
        _seeded(seed)
        analysis = analyze(model, x, convention="macs", quiet=True)
        assert 2 * analysis.flops.total() == expected
        assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == _next_draws(seed)
        counts.add(expected)
    assert len(counts) > 1  # the seeds take different paths


def _next_draws(seed: int) -> tuple[float, float, float]:
    _seeded(seed)
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_a_layer_drop_is_not_cached_on_disk(tmp_path: Path) -> None:
    model, x = _LayerDrop("random", needs_values=False).train(), torch.randn(4, 8)
    for seed in range(3):
        _seeded(seed)
        expected = real_products(model, (x,))
        _seeded(seed)
        analysis = analyze(model, x, convention="macs", quiet=True, cache_dir=tmp_path)
        assert 2 * analysis.flops.total() == expected and not analysis.from_cache


class _UntilSmall(nn.Module):
    """Applies a contraction until the activations' norm is small: a loop whose length is a value."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while x.norm() > 1e-3:
            x = 0.1 * self.step(x)
        return x


def test_a_loop_on_assumed_values_of_a_meta_model_ends_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the meta device every value read is assumed (True here): the loop never ended (and the trace grew)
    monkeypatch.setattr(recorder, "GUESSES", 50)
    with torch.device("meta"):
        model = _UntilSmall()
    with pytest.raises(ModelRunError, match="loops until a value it computes changes.*assumed to be True"):
        analyze(model, torch.randn(2, 8), quiet=True)
    # a few assumed values are counted as before, each one said; the first layer reads its input's value, known
    model = nn.Sequential(*[_UntilSmall() for _ in range(3)]).to("meta")
    for layer in model:
        layer.forward = lambda x, layer=layer: layer.step(x) if x.norm() > 1e-3 else x  # type: ignore[method-assign]
    analysis = analyze(model, torch.randn(2, 8), convention="macs", quiet=True)
    assert analysis.flops.total() == 3 * 2 * 8 * 8 and len(analysis.assumptions()) == 2


class _Selects(nn.Module):
    """Rows of ``x`` selected by the caller's ``mask`` or ids — a shape made of values — then a layer on them."""

    def __init__(self, select: str) -> None:
        super().__init__()
        self.select = select
        self.embed, self.layer = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.select == "nonzero":
            rows = x[mask.nonzero()[:, 0]]
        elif self.select == "where":
            rows = x[torch.where(mask)[0]]
        elif self.select == "boolean mask":
            rows = x[mask]
        elif self.select == "masked_select":
            rows = torch.masked_select(ids, mask).float()[:, None].expand(-1, 8)
        else:  # unique
            rows = self.embed(torch.unique(ids))
        return self.layer(rows)


@pytest.mark.parametrize("on", ["cpu", "meta"])
@pytest.mark.parametrize("select", ["nonzero", "where", "boolean mask", "masked_select", "unique"])
def test_a_shape_made_of_the_callers_values_is_followed_without_real_kernels(select: str, on: str) -> None:
    # The mask and ids are the caller's, their values known to a fake run: a meta model assumed every element
    # non-zero (or failed), a CPU model fell back to real kernels
    mask, ids = torch.tensor([True, False, False, True, True, False]), torch.tensor([3, 3, 5, 3, 9, 5])
    inputs = (torch.randn(6, 8), mask, ids)
    expected = real_products(_Selects(select), inputs)
    with torch.device(on):
        model = _Selects(select)
    analysis = analyze(model, inputs, convention="macs", quiet=True)
    assert 2 * analysis.flops.total() == expected == 2 * 3 * 8 * 8
    assert analysis.trace.execution == "fake" and not analysis.assumptions()


class _Branches(nn.Module):
    """``torch.cond`` between two layers and none, on the caller's flag or on the sign of an activation."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on
        self.wide, self.narrow = nn.Linear(8, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        pred = flag if self.on == "flag" else (x.sum() > 0)
        return torch.cond(pred, lambda x: self.narrow(self.wide(x)), lambda x: x.clone(), (x,))


@pytest.mark.parametrize("on", ["flag", "activation"])
def test_an_exported_conditional_counts_the_branch_its_predicate_picks(on: str) -> None:
    # torch.export's cond ran with the recorders set aside: its branch was unseen, a silent zero. (torch's
    # FlopCounterMode counts the larger branch whichever runs: hand arithmetic is the oracle.)
    x = torch.randn(4, 8)
    exported = torch.export.export(_Branches(on), (x, torch.tensor(True))).module()
    for execution in ("auto", "real"):
        for taken in (True, False):
            x = x.abs() if taken else -x.abs()
            analysis = analyze(exported, (x, torch.tensor(taken)), convention="macs", execution=execution, quiet=True)
            assert analysis.flops.total() == (2 * 4 * 8 * 64 if taken else 0)
