"""The leftovers of earlier rounds, each a wrong or silent result once documented as a limit: an ``out=`` call
counted by another overload's formula, NaN in JSON, recurrent layers' saved tensors, norm statistics' dtypes
under autocast."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memory_oracle import inference, measure_peak, resident_bytes, training_step, warm_up
from modelmeter import MemoryAnalysis, ModelRunError, Result, analyze
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.tracer import record_trace
from modelmeter.guard.baseline import BaselineFile, entry_from_result
from modelmeter.guard.values import GuardFileError
from modelmeter.handles.conventions import register_handle, unregister_handle
from modelmeter.metrics.traffic import count_bytes
from modelmeter.reports.html import render_html
from modelmeter.reports.render import render
from modelmeter.reports.saved import SavedTrace, read_saved_trace, write_saved_trace


class Call(nn.Module):
    """A model that runs ``fn`` on its input."""

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


# --- 1. an out= call is counted by the overload that ran -------------------------------------------------------
_X = torch.randn(4, 5)
_PAIRS = {  # a call with out=, the same call without it, and what it costs (flops convention): n = 20 elements
    "max": (lambda x: torch.max(x, out=torch.empty(())), torch.max, 20),
    "min": (lambda x: torch.min(x, out=torch.empty(())), torch.min, 20),
    "max other": (lambda x: torch.max(x, x.flip(0), out=torch.empty(4, 5)), lambda x: torch.max(x, x.flip(0)), 20),
    "max dim": (lambda x: torch.max(x, 1, out=(torch.empty(4), torch.empty(4, dtype=torch.long))),
                lambda x: torch.max(x, 1), 20),
}


@pytest.mark.parametrize("name", sorted(_PAIRS))
@pytest.mark.parametrize("execution", ["fake", "real"])
def test_an_out_call_counts_what_the_same_call_without_out_counts(name: str, execution: str) -> None:
    with_out, plain, expected = _PAIRS[name]
    counted = analyze(Call(with_out), (_X,), convention="flops", execution=execution).flops.total()
    assert counted == analyze(Call(plain), (_X,), convention="flops", execution=execution).flops.total()
    assert counted == expected


def test_the_out_tensor_of_a_reduction_is_written_not_read() -> None:
    """``torch.max(x, out=o)`` reads x (80 bytes) and writes o (4); it was taken as ``max(x, other=o)``, o read."""
    trace = analyze(Call(lambda x: torch.max(x, out=torch.empty(()))), (_X,)).trace
    assert sum(count_bytes(trace).counts[""].values()) == 80 + 4


def test_a_saved_trace_keeps_the_overload_of_each_event(tmp_path: Path) -> None:
    analysis = analyze(Call(lambda x: torch.max(x, out=torch.empty(()))), (_X,), convention="flops")
    path = tmp_path / "max.mmtrace"
    write_saved_trace(SavedTrace(analysis.trace, analysis.result(), {"convention": "flops"}, {}), path)
    back = read_saved_trace(path)
    assert [e.overload for e in back.trace.events] == [e.overload for e in analysis.trace.events]
    assert "unary_out" in {e.overload for e in back.trace.events}
    assert back.result.total("flops") == 20


# --- 2. JSON written is strict: a non-finite cost is null, and reads back -----------------------------------------
def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} in JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def nan_result() -> Iterator[Any]:
    """An analysis whose ReLU a registered handle counts as NaN (the one way a result holds a non-finite cost)."""
    register_handle("aten::relu", lambda inputs, outputs: math.nan, convention="fvcore")
    try:
        yield analyze(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),), device="h100")
    finally:
        unregister_handle("aten::relu", convention="fvcore")


def test_a_result_with_a_nan_cost_writes_strict_json_that_reads_back(nan_result: Any) -> None:
    result = nan_result.result()
    data = _strict(result.to_json())
    assert data["modules"][0]["metrics"]["flops"] is None
    assert data["modules"][0]["by_operator"]["flops"]["relu"] is None
    back = Result.from_json(result.to_json())
    assert math.isnan(back.total("flops")) and back.row("0").metrics["flops"] == 32
    assert back.to_json() == result.to_json()


def test_html_and_saved_traces_of_a_nan_cost_are_written(nan_result: Any, tmp_path: Path) -> None:
    """Both raised json's bare "Out of range float values are not JSON compliant"."""
    page = render_html(nan_result.result())
    script = page.split('type="application/json"', 1)[1].split(">", 1)[1].split("</script>", 1)[0]
    _strict(script)
    path = tmp_path / "nan.mmtrace"
    write_saved_trace(SavedTrace(nan_result.trace, nan_result.result(), {"convention": "fvcore"}, {}), path)
    assert math.isnan(read_saved_trace(path).result.total("flops"))


def test_a_baseline_of_a_nan_cost_is_refused_with_a_clear_error(nan_result: Any, tmp_path: Path) -> None:
    baseline = BaselineFile({"m": entry_from_result(nan_result.result())})
    with pytest.raises(GuardFileError, match="not a finite number"):
        baseline.save(tmp_path / "baseline.json")
    assert not (tmp_path / "baseline.json").exists()


# --- 4. norm statistics under CPU autocast are float32, as the CPU's kernels make them -----------------------------
def _norms() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 8), nn.LayerNorm(8), nn.Linear(8, 8))


def _kernels(execution: str, dtype: torch.dtype) -> tuple[list[Any], int]:
    """Each kernel's outputs (shape, dtype) and the predicted peak of a training step under CPU autocast."""
    with torch.autocast("cpu", dtype=dtype):
        analysis = analyze(_norms(), (torch.randn(2, 3, 8, 8),), execution=execution, backward=True, memory=True)
    outputs = [(e.op, [(o.shape, o.dtype) for o in e.outputs if hasattr(o, "dtype")])
               for e in analysis.trace.events if e.level == "dispatch"]
    return outputs, analysis.memory.peak()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("execution", ["fake", "auto"])
def test_norm_outputs_under_cpu_autocast_have_the_cpu_kernels_dtypes(execution: str, dtype: torch.dtype) -> None:
    """The oracle: the same step on real CPU tensors (batch, group and layer norm statistics float32, the group norm
    backward's input gradient in the input's dtype)."""
    real = _kernels("real", dtype)
    assert _kernels(execution, dtype) == real
    assert ("aten::native_layer_norm", [((2, 8), torch_name(dtype)), ((2, 1), torch_name(torch.float32)),
                                        ((2, 1), torch_name(torch.float32))]) in real[0]


def torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- 3. GRU and RNN training steps: what the CPU's kernels save and free -----------------------------------------
class _Recurrent(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def _step(model: nn.Module, x: torch.Tensor, execution: str) -> Any:
    analysis = MemoryAnalysis(model, (x,), training=True, optimizer="sgd", execution=execution)
    events = [(e.phase, e.op, [(o.shape, o.dtype) for o in e.outputs if hasattr(o, "shape")])
              for e in analysis.trace.events if e.level == "dispatch"]
    return events, analysis.trace.storages, analysis.saved_for_backward(), analysis.peak()


_RECURRENT = [("GRU", {}), ("GRU", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
              ("GRU", {"num_layers": 2, "dropout": 0.3, "bias": False}), ("RNN", {"nonlinearity": "tanh"}),
              ("RNN", {"nonlinearity": "relu", "bidirectional": True, "batch_first": True}),
              ("RNN", {"num_layers": 2, "bidirectional": True})]


@pytest.mark.parametrize("kind,options", _RECURRENT)
def test_a_recurrent_training_step_records_what_the_cpu_kernels_do(kind: str, options: dict[str, Any]) -> None:
    """The oracle: the real CPU run, kernel by kernel and storage by storage (born, freed, saved); its peak is the
    allocator's (below). The stand-ins ran the decomposition's other branch (each step's input product apart)."""
    torch.manual_seed(0)
    model = _Recurrent(getattr(nn, kind)(8, 16, **options))
    x = torch.randn(4, 3, 8)
    assert _step(model, x, "fake") == _step(model, x, "real")


def test_a_gru_training_step_is_the_allocators_peak() -> None:
    torch.manual_seed(0)
    model = _Recurrent(nn.GRU(8, 16, num_layers=2, bidirectional=True))
    x = torch.randn(10, 4, 8)
    predicted = MemoryAnalysis(model, (x,), training=True, optimizer="sgd").peak()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, (x,), optimizer)
    measured = resident_bytes(model, (x,), optimizer) + measure_peak(training_step(model, (x,), optimizer)).peak_delta
    assert predicted == measured  # 131,976 predicted for 126,208 before (4.6% over)


def _inference(model: nn.Module, x: torch.Tensor, execution: str) -> Any:
    with torch.no_grad():
        trace = record_trace(RunSpec(model, (x,), execution=execution))
    events = [(e.op, [(o.shape, o.dtype) for o in e.outputs if hasattr(o, "shape")], e.inputs)
              for e in trace.events if e.level == "dispatch"]
    return events, [(s.nbytes, s.born, s.died) for s in trace.storages]


@pytest.mark.parametrize("kind,options", [*_RECURRENT, ("GRU", {"batch_first": True, "bias": False})])
def test_recurrent_inference_writes_what_the_cpu_kernels_do(kind: str, options: dict[str, Any]) -> None:
    """The fast path (events written without running) against the real CPU run, event by event (arguments too) and
    storage by storage: it wrote the other branch (each step's input product apart), 13-40% under the allocator."""
    torch.manual_seed(0)
    model = _Recurrent(getattr(nn, kind)(8, 16, **options)).eval()
    x = torch.randn(4, 3, 8)
    assert _inference(model, x, "fake") == _inference(model, x, "real")


def test_a_gru_in_inference_is_the_allocators_peak() -> None:
    torch.manual_seed(0)
    model = _Recurrent(nn.GRU(8, 16)).eval()
    x = torch.randn(10, 4, 8)
    predicted = MemoryAnalysis(model, (x,)).peak()
    assert predicted == resident_bytes(model, (x,)) + measure_peak(inference(model, (x,))).peak_delta  # 11,648 before


def _frames() -> int:
    frame, count = sys._getframe(), 0
    while frame is not None:
        frame, count = frame.f_back, count + 1
    return count


def _nested(depth: int) -> nn.Module:
    model: nn.Module = nn.Linear(4, 4)
    for _ in range(depth):
        model = nn.Sequential(model)
    return model


@pytest.mark.parametrize("backward", [False, True])
def test_a_model_nested_as_deep_as_torch_runs_it_is_analysed(backward: bool) -> None:
    # Nearly as deep as a plain forward goes from here (three frames and a C call per module call): a run under the
    # recorder's hooks takes a frame more per call, and failed with a RecursionError from 200 modules deep.
    depth = (sys.getrecursionlimit() - _frames()) // 4 - 10
    model, x = _nested(depth), torch.randn(2, 4)
    model(x)  # the oracle: PyTorch runs it
    limit = sys.getrecursionlimit()
    result = analyze(model, x, backward=backward, cache=False, quiet=True).result()
    # fvcore's convention, one per multiply-add: the forward's x @ W.T, and the backward's gradient of W
    assert result.total("flops") == (2 if backward else 1) * 2 * 4 * 4
    assert sys.getrecursionlimit() == limit


def test_a_model_too_deep_for_torch_fails_clearly_and_the_limit_is_put_back() -> None:
    model, x = _nested(2 * sys.getrecursionlimit() // 3), torch.randn(2, 4)
    with pytest.raises(RecursionError):
        model(x)
    limit = sys.getrecursionlimit()
    with pytest.raises(ModelRunError, match="RecursionError"):
        analyze(model, x, cache=False, quiet=True).result()
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_a_table_of_a_nan_cost_prints_it(nan_result: Any, fmt: str) -> None:
    """The table's unit is chosen from the column's largest value: a NaN failed it with ``cannot convert float NaN
    to integer`` (which the command printed as a ``--columns`` error); the finite values keep their unit."""
    text = render(nan_result.result(), fmt, width=200)
    assert "nan" in text.splitlines()[2]  # the model's row: the ReLU's NaN counted in
    linear = next(line for line in text.splitlines() if line.lstrip("| ").startswith("0 "))
    assert "32" in linear  # fvcore's 2 x 4 x 4 multiply-adds of the Linear, in its plain unit


@pytest.mark.parametrize("execution", ["auto", "fake", "meta"])
def test_positions_past_a_learned_position_table_fail_as_the_real_run_does(execution: str, tmp_path: Path) -> None:
    """A fake run's embedding cannot see its indices, so a sequence longer than a learned position table (GPT-2 with
    16 positions given 17 tokens) was counted where the real run fails. The positions the model made itself
    (``arange``) have known values: checked against the table, as the CPU kernel does; the caller's token ids are not
    read (a disk cache keeps such a run: its trace follows from what the key holds)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=1, n_head=2, vocab_size=100,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2Model(config).eval()
    too_long, fits = torch.randint(0, 100, (1, 17)), torch.randint(0, 100, (1, 16))
    with pytest.raises(IndexError, match="index out of range in self"):
        model(too_long)  # the oracle: the real run
    if execution == "meta":
        with torch.device("meta"):
            model = transformers.GPT2Model(config)
    options: dict[str, Any] = {} if execution == "meta" else {"execution": execution}
    with pytest.raises(ModelRunError, match=r"'wpe' \(Embedding\) at operator aten::embedding: IndexError"):
        analyze(model, too_long, cache=False, quiet=True, **options).result()
    first = analyze(model, fits, cache_dir=tmp_path, quiet=True, **options)
    assert first.result().total("flops") > 0 and not first.from_cache
    assert analyze(model, fits.clone(), cache_dir=tmp_path, quiet=True, **options).from_cache


# --- inputs the model's own code refuses: a usage error, as a layer's refusal is --------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["resnet18", "--input", "3x32x32"], ["module 'bn1' (BatchNorm2d)", "expected 4D input (got 3D input)",
                                          "the input given (--input 3x32x32) does not fit the model",
                                          "default input (1x3x224x224 float32)"]),
    (["gpt2_tiny", "--seq-len", "2048"], ["sequence length exceeds block_size", "(--seq-len 2048)",
                                          "default input (1x64 int64)"]),
    (["gpt2_tiny", "--input", "1x2048:int64"], ["(--input 1x2048:int64)"]),
])
def test_inputs_the_models_code_refuses_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               words: list[str]) -> None:
    from modelmeter.cli import main

    assert main([*argv, "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(word in err for word in words), err


def test_a_model_that_fails_on_its_default_input_too_still_exits_1(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    """The default run is the oracle: a model that fails whatever its input is at fault (exit 1)."""
    from modelmeter.cli import main

    (tmp_path / "broken.py").write_text(
        "import torch\n"
        "class Broken(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError('always')\n"
        "def build():\n"
        "    return Broken(), torch.zeros(2, 3)\n")
    assert main([f"{tmp_path / 'broken.py'}:build", "--input", "4x3", "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("modelmeter: the model failed in ") and "ValueError: always" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


# --- torchvision's nms on the meta device: every box kept, an upper bound said so ------------------------------
class KeepsBoxes(nn.Module):
    """A detection head's pattern: non-maximum suppression, then a layer over the boxes kept."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 16)

    def forward(self, boxes: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from torchvision.ops import nms

        return self.head(boxes[nms(boxes, scores, 0.5)])


def _boxes(overlapping: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ten boxes: apart (nms keeps them all) or all on one spot (it keeps one)."""
    corners = torch.zeros(10, 2) if overlapping else torch.arange(10.0).repeat(2, 1).t() * 10
    return torch.cat([corners, corners + 5], dim=1), torch.linspace(1, 0, 10)


def test_nms_on_meta_keeps_every_box_an_upper_bound_of_the_real_runs() -> None:
    """Oracle: real runs. Boxes apart are all kept, and the meta run counts as much; boxes on one spot are one
    kept, and the meta run counts more (the bound), saying what it assumed."""
    with torch.device("meta"):
        on_meta = KeepsBoxes()
    meta = analyze(on_meta, tuple(t.to("meta") for t in _boxes(False)), cache=False)
    apart = analyze(KeepsBoxes(), _boxes(False), execution="real", cache=False)
    together = analyze(KeepsBoxes(), _boxes(True), execution="real", cache=False)
    assert meta.flops.total() == apart.flops.total() == 10 * 4 * 16 > together.flops.total() == 4 * 16
    assert any("nms of 10 meta boxes assumed to keep every one (an upper bound" in a for a in meta.assumptions())


def test_a_detection_model_runs_on_meta_with_nms_kept_whole(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.cli import main

    assert main(["torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", "--depth", "0", "--no-cache"]) == 0
    assert "torchvision's nms of 450 meta boxes assumed to keep every one (an upper bound" in \
        " ".join(capsys.readouterr().out.split())


def test_a_model_that_needs_values_is_told_to_run_real(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Shapes that depend on values where no placeholder is assumed (``unique``, as a detection model's classes):
    a usage error naming --real, which runs it."""
    from modelmeter.cli import main

    (tmp_path / "classes.py").write_text(
        "import torch\n"
        "class Classes(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.unique(x)\n"
        "def build():\n"
        "    return Classes(), torch.zeros(2, 3)\n")
    spec = f"{tmp_path / 'classes.py'}:build"
    assert main([spec, "--input", "8", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at operator aten::_unique2" in err and "run it with --real" in err, err
    assert main([spec, "--input", "8", "--real", "--no-cache"]) == 0


# --- the caller's token ids past the vocabulary: refused as the real run refuses them, cached or not --------------
def _gpt2(on_meta: bool) -> nn.Module:
    """A transformers GPT-2 of 100 tokens (it views the ids before its embedding); on meta, or on the CPU."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=1, n_head=2, vocab_size=100,
                                     bos_token_id=0, eos_token_id=0)
    if on_meta:
        with torch.device("meta"):
            return transformers.GPT2Model(config)
    return transformers.GPT2Model(config).eval()


@pytest.mark.parametrize("execution", ["auto", "fake", "meta"])
@pytest.mark.parametrize("cache", ["shared", "disk"])
def test_token_ids_past_the_vocabulary_fail_on_a_first_and_a_cached_run(execution: str, cache: str,
                                                                         tmp_path: Path) -> None:
    """Oracle: the real run's IndexError. Ids of the same shape and dtype reach the caches' keys alike; a run of ids
    that fit must not let ids past the table through afterwards (nor the other way round): the keys hold the ids'
    least and greatest values."""
    from modelmeter.cache.shared import SHARED

    fits = torch.randint(0, 100, (1, 8))
    past = fits.clone()
    past[0, 3] = 100
    negative = fits.clone()
    negative[0, 5] = -1
    for ids in (past, negative):
        with pytest.raises(IndexError, match="index out of range in self"):
            _gpt2(False)(ids)
    model = _gpt2(execution == "meta")
    options: dict[str, Any] = {} if execution == "meta" else {"execution": execution}

    def run(ids: torch.Tensor) -> Any:
        if cache == "disk":
            SHARED.clear()  # the disk cache alone
        return analyze(model, ids, cache_dir=tmp_path, quiet=True, **options)

    # (auto then runs real kernels, whose error is torch's own words alone)
    detail = "" if execution == "auto" else r" \(indices from -?\d+ to \d+, into a table of 100 rows\)"
    for ids in (past, negative):
        with pytest.raises(ModelRunError, match=r"'wte' \(Embedding\) at operator aten::embedding: IndexError: "
                                                r"index out of range in self" + detail):
            run(ids)
    first = run(fits)
    assert first.flops.total() > 0 and not first.from_cache
    assert run(fits.clone()).from_cache  # the same ids: served from the cache
    for ids in (past, negative):  # the run of the ids that fit, cached, lets none of these through
        with pytest.raises(ModelRunError, match="IndexError: index out of range in self"):
            run(ids)


def test_the_zoo_gpt_refuses_ids_past_its_vocabulary() -> None:
    """The zoo's GPT takes the ids straight into its embedding (no view): the same check."""
    from modelmeter.zoo.registry import get_model

    model = get_model("gpt2_tiny")
    ids = torch.zeros(1, 8, dtype=torch.long)
    ids[0, 0] = 1000
    with pytest.raises(IndexError):
        model(ids)
    with pytest.raises(ModelRunError, match=r"into a table of 1000 rows"):
        analyze(model, ids, execution="fake", cache=False)


def test_the_disk_key_holds_the_ids_bounds_but_not_a_counters() -> None:
    """Ids of another least or greatest value are another key; ids of the same bounds, and a scalar counter that
    training moves (BatchNorm's ``num_batches_tracked``), are not: the key changes only where a check could."""
    from modelmeter.cache.fingerprint import trace_key

    model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(3)).eval()

    def key(ids: list[int]) -> str | None:
        return trace_key(RunSpec(model, (torch.tensor([ids]),)))

    before = key([0, 5, 9])
    assert before == key([9, 0, 5]) != key([0, 5, 10]) != key([1, 5, 9])
    model[1].num_batches_tracked += 7
    assert key([0, 5, 9]) == before


class SharedTable(nn.Module):
    """One embedding for two inputs (an encoder-decoder's shared vocabulary): its second call is the same call's
    metadata again, which must still be checked."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.table(a) + self.table(b)


def test_a_second_lookup_in_one_table_is_checked_too() -> None:
    fits, past = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 10]])
    with pytest.raises(IndexError):
        SharedTable()(fits, past)
    with pytest.raises(ModelRunError, match=r"indices from 4 to 10, into a table of 10 rows"):
        analyze(SharedTable(), (fits, past), execution="fake", cache=False)


class _ShiftedIds(nn.Module):
    """The caller's ids written over in place by another input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.table(ids.clone().add_(offsets))


def _outcome(model: nn.Module, inputs: tuple[torch.Tensor, ...], **options: Any) -> Any:
    try:
        return analyze(model, inputs, execution="fake", quiet=True, **options).flops.total()
    except ModelRunError:
        return "raised"


def test_ids_written_over_in_place_are_not_checked_by_bounds_the_caches_do_not_key(tmp_path: Path) -> None:
    # the mark "the caller's ids as given" outlived an in-place add: the ids after it were checked, by values the
    # caches' key (each input's least and greatest value) does not determine, and the trace of offsets that fit was
    # served to offsets of the same bounds that do not; such ids are now not checked, as any ids the model computes
    # from the caller's (docs/guide.md), so a cached run and a fresh one agree
    ids = torch.tensor([[1, 2, 3]])
    fits, past = torch.tensor([[8, 0, 0]]), torch.tensor([[0, 0, 8]])  # 1..9 fits a table of 10, 1..11 does not
    model = _ShiftedIds()
    cached = [_outcome(model, (ids, offsets), cache=True, cache_dir=str(tmp_path)) for offsets in (fits, past)]
    fresh = [_outcome(_ShiftedIds(), (ids, offsets), cache=False) for offsets in (fits, past)]
    assert cached == fresh == [0, 0]
