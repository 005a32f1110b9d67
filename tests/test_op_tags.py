"""The trace records what torch's operator registry says about its operators, and counting reads it there."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from modelmeter import FlopCountAnalysis
from modelmeter.engine.op_tags import registry_tags
from modelmeter.handles.classify import Classifier


class AddMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1).mul_(2).transpose(0, 1)


def test_every_operator_of_the_run_has_its_registry_tags() -> None:
    trace = FlopCountAnalysis(AddMul(), torch.randn(3, 4)).trace
    ops = {event.op for event in trace.events}
    assert ops <= trace.op_tags.keys()
    assert trace.op_tags["aten::add"] == ("pointwise",)
    assert trace.op_tags["aten::transpose"] == ("view",)
    assert trace.op_tags["aten::mul"] == ("pointwise",)  # the out-of-place form of mul_, which mul_ falls back on
    assert all(trace.op_tags[op] == registry_tags(op) for op in ops)


def test_counting_reads_the_recorded_tags_not_torch() -> None:
    analysis = FlopCountAnalysis(AddMul(), torch.randn(3, 4), convention="flops")
    assert analysis.total() == 2 * 12  # one flop per element for add and mul_; the transpose is a view
    # The same trace with add recorded as untagged: torch's registry would still say pointwise, the count must not.
    trace = analysis.trace
    tags = dict(trace.op_tags, **{"aten::add": ()})
    altered = dataclasses.replace(trace, op_tags=tags)
    recount = FlopCountAnalysis(AddMul(), torch.randn(3, 4), convention="flops", trace=altered)
    assert recount.total() == 12
    assert recount.unsupported_ops() == {"aten::add": 1}


def test_the_classifier_falls_back_on_the_registry_for_unrecorded_operators() -> None:
    classify = Classifier({})
    assert classify.is_elementwise("aten::gelu") and classify.is_free("aten::view")
    assert classify.is_view("aten::transpose_")  # the in-place form of a view
    assert not classify.is_elementwise("aten::where") and classify.is_free("aten::where")
