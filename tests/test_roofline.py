"""The roofline time against the same roofline computed by hand from a datasheet, operator by operator.

Every expected number here is a hand count: FLOPs from the shapes (2 per multiply-add, 1 per bias add or
element-wise result), bytes from the shapes (every input read once, every output written once, at 4 bytes a
float32 and 2 a bfloat16), and time ``max(flops / peak, bytes / bandwidth)`` from the test device's round numbers.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model_helpers import Fn
from modelmeter.devices import Device
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.trace import Trace
from modelmeter.engine.tracer import record_trace
from modelmeter.handles.conventions import get_convention
from modelmeter.metrics.counting import count
from modelmeter.metrics.roofline import Roofline, RooflineSettings, roofline
from modelmeter.metrics.traffic import count_bytes

BANDWIDTH = 1e12
FP32 = 10e12        # vector float32 (no float32 tensor cores)
TF32 = 50e12
BF16 = 100e12       # matrix bfloat16
BF16_VECTOR = 20e12
GPU = Device("testgpu", "Test GPU", 10**10, BANDWIDTH, {"tf32": TF32, "bf16": BF16, "fp16": BF16},
             {"fp32": FP32, "bf16": BF16_VECTOR, "fp16": BF16_VECTOR})


def trace_of(model: nn.Module, inputs: Any, backward: bool = False) -> Trace:
    return record_trace(RunSpec.of(model, inputs, backward=backward))


def run(model: nn.Module, inputs: Any, backward: bool = False, **settings: Any) -> Roofline:
    return roofline(trace_of(model, inputs, backward), RooflineSettings(GPU, **settings))


def roof(flops: float, moved: float, peak: float) -> float:
    """The datasheet roofline of one kernel."""
    return max(flops / peak, moved / BANDWIDTH)


def total(stats: Any, key: str, module: str = "") -> Any:
    return stats.counts[module][key]


# --- one operator at a time ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_linear_float32_forward_by_hand(bias: bool) -> None:
    m, k, n = 64, 256, 128
    out = run(nn.Linear(k, n, bias=bias), torch.randn(m, k))
    flops = 2 * m * n * k + m * n * bias
    moved = 4 * (m * k + k * n + n * bias + m * n)  # x, weight, bias read; y written
    assert total(out.flops, "linear") == flops
    assert total(out.bytes, "linear") == moved
    assert total(out.time, "linear") == pytest.approx(roof(flops, moved, FP32), rel=1e-12)
    assert set(out.time.counts[""]) == {"linear"}  # t is a view: no unit of its own


def test_conv2d_forward_by_hand_and_tf32() -> None:
    b, cin, cout, h, w, kk = 8, 64, 64, 32, 32, 3
    model, x = nn.Conv2d(cin, cout, kk), torch.randn(b, cin, h, w)
    ho, wo = h - kk + 1, w - kk + 1
    flops = 2 * b * cout * ho * wo * cin * kk * kk + b * cout * ho * wo
    moved = 4 * (b * cin * h * w + cout * cin * kk * kk + cout + b * cout * ho * wo)
    trace = trace_of(model, x)
    plain = roofline(trace, RooflineSettings(GPU))
    tf32 = roofline(trace, RooflineSettings(GPU, tf32=True))
    assert (total(plain.flops, "conv"), total(plain.bytes, "conv")) == (flops, moved)
    assert total(plain.time, "conv") == pytest.approx(roof(flops, moved, FP32), rel=1e-12)
    assert total(tf32.time, "conv") == pytest.approx(roof(flops, moved, TF32), rel=1e-12)
    assert flops / FP32 > moved / BANDWIDTH and flops / TF32 > moved / BANDWIDTH  # compute-bound either way
    assert plain.summary["device"]["peak"] == FP32 and tf32.summary["device"]["peak"] == TF32
    assert plain.summary["settings"]["tf32"] is False and tf32.summary["settings"]["tf32"] is True


def test_elementwise_chain_is_memory_bound_one_unit_per_kernel() -> None:
    n = 1 << 16
    out = run(Fn(lambda x: (x * 2 + 1).exp()), torch.randn(n), launch_overhead=1e-6)
    for key in ("mul", "add", "exp"):  # 1 flop per element, read and write n float32 each
        assert total(out.flops, key) == n
        assert total(out.bytes, key) == 8 * n
        assert total(out.time, key) == pytest.approx(8 * n / BANDWIDTH + 1e-6, rel=1e-12)
        assert out.compute_bound_time.counts.get("", {}).get(key) is None  # memory-bound
    assert out.summary["compute_bound_share"] == 0.0
    assert out.summary["time"]["total"] == pytest.approx(3 * (8 * n / BANDWIDTH + 1e-6), rel=1e-12)


def test_sdpa_forward_by_hand() -> None:
    b, h, length, e = 2, 4, 256, 64
    q = torch.randn(b, h, length, e)
    out = run(Fn(F.scaled_dot_product_attention), (q, q.clone(), q.clone()))
    pairs = b * h * length * length
    flops = 2 * pairs * (e + e) + 6 * pairs  # q·k and p·v; scale, max, subtract, exp, sum, divide per pair
    moved = 4 * (3 * b * h * length * e + b * h * length * e + b * h * length)  # Q, K, V; O and the log-sum-exp
    key = "scaled_dot_product_attention"
    assert (total(out.flops, key), total(out.bytes, key)) == (flops, moved)
    assert total(out.time, key) == pytest.approx(roof(flops, moved, FP32), rel=1e-12)
    assert total(out.compute_bound_time, key) == total(out.time, key)  # 2 x 64 x 2 FLOPs per pair ≫ ridge 10


def test_sdpa_backward_is_one_unit_per_call_at_the_fused_kernels_cost() -> None:
    b, h, length, e = 1, 2, 1024, 64
    qkv = tuple(torch.randn(b, h, length, e, requires_grad=True) for _ in range(3))
    out = run(Fn(F.scaled_dot_product_attention), qkv, backward=True)
    pairs = b * h * length * length
    # recompute q·k, dV, dP, dQ, dK (5 products); dS, recomputed P (6 per pair); D = rowsum(dO·O) (2 per output)
    flops = 2 * pairs * 5 * e + 6 * pairs + 2 * b * h * length * e
    key = "scaled_dot_product_attention_backward"
    assert total(out.flops, key) == flops
    assert out.time.by_phase["backward"][""][key] == pytest.approx(flops / FP32, rel=1e-12)  # compute-bound
    # reads Q, K, V, O, dO and the log-sum-exp, writes dQ, dK, dV: at least that much
    assert total(out.bytes, key) >= 4 * (8 * b * h * length * e + b * h * length)
    assert set(out.time.by_phase["backward"][""]) <= {key, "ones_like"}  # the loss's seed, and one unit


def test_linear_backward_by_hand() -> None:
    m, k, n = 32, 64, 16
    out = run(nn.Linear(k, n), torch.randn(m, k), backward=True)
    backward = out.time.by_phase["backward"][""]
    # dW = dYᵀ·X, where dY, the gradient of the default loss (a sum), is one element expanded: read once
    mm_flops, mm_bytes = 2 * m * n * k, 4 * (1 + m * k + n * k)
    assert out.flops.by_phase["backward"][""]["mm"] == mm_flops
    assert out.bytes.by_phase["backward"][""]["mm"] == mm_bytes
    assert backward["mm"] == pytest.approx(roof(mm_flops, mm_bytes, FP32), rel=1e-12)
    assert out.flops.by_phase["backward"][""]["sum"] == m * n  # db: sum of dY over the rows


# --- bound, batch and dtype ---------------------------------------------------------------------------------
def test_bfloat16_linear_turns_compute_bound_at_the_ridge_point() -> None:
    k = n = 1024
    ridge = BF16 / BANDWIDTH  # 100 FLOPs per byte, from the datasheet numbers
    bound = {}
    for m in (8, 16, 32, 64, 96, 128, 256, 1024):
        layer = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="meta")
        out = run(layer, torch.empty(m, k, dtype=torch.bfloat16, device="meta"))
        flops, moved = 2 * m * n * k, 2 * (m * k + k * n + m * n)
        assert total(out.time, "linear") == pytest.approx(roof(flops, moved, BF16), rel=1e-12)
        assert out.summary["dtype"] == "bfloat16" and out.summary["device"]["peak"] == BF16
        assert out.summary["device"]["ridge"] == ridge
        [row] = out.summary["operators"]
        assert row["intensity"] == pytest.approx(flops / moved, rel=1e-12)
        bound[m] = row["compute_bound"]
        assert bound[m] == (flops / moved >= ridge)
    # 2mnk / 2(mk + kn + mn) = 100  <=>  m = 100·1024 / (1024 - 200) ≈ 124.3: the crossing lies between 96 and 128
    assert [m for m, b in bound.items() if b] == [128, 256, 1024]


def test_efficiency_and_launch_overhead() -> None:
    m, k, n = 4, 8, 8
    flops, moved = 2 * m * n * k + m * n, 4 * (m * k + k * n + n + m * n)
    trace = trace_of(nn.Linear(k, n), torch.randn(m, k))
    pure = roofline(trace, RooflineSettings(GPU)).time.counts[""]["linear"]
    slow = roofline(trace, RooflineSettings(GPU, efficiency=0.5, launch_overhead=5e-6)).time.counts[""]["linear"]
    assert pure == pytest.approx(moved / BANDWIDTH, rel=1e-12)
    assert slow == pytest.approx(2 * moved / BANDWIDTH + 5e-6, rel=1e-12)  # one kernel: addmm (t is a view)
    assert flops / FP32 < moved / BANDWIDTH


def test_dominant_dtype_is_that_of_most_matrix_flops() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.Linear(8, 8)
            self.big = nn.Linear(256, 256, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.big(self.small(x).to(torch.bfloat16).repeat(1, 32))

    out = run(Mixed(), torch.randn(16, 8))
    assert out.summary["dtype"] == "bfloat16"
    assert out.time.dtypes["big"] == {"bfloat16": total(out.time, "linear", "big")}
    assert out.time.dtypes["small"] == {"float32": total(out.time, "linear", "small")}
    assert total(out.time, "linear", "big") == pytest.approx(
        roof(2 * 16 * 256 * 256 + 16 * 256, 2 * (16 * 256 + 256 * 256 + 256 + 16 * 256), BF16), rel=1e-12)


def test_vector_work_runs_at_the_vector_peak_of_its_dtype() -> None:
    slow = Device("slowvec", "Slow vector units", 10**9, BANDWIDTH, {"bf16": BF16}, {"fp32": 1e9, "bf16": 2e9})
    n = 4096
    for dtype, peak in ((torch.float32, 1e9), (torch.bfloat16, 2e9)):
        trace = trace_of(Fn(lambda x: x * 2), torch.randn(n, dtype=dtype))
        out = roofline(trace, RooflineSettings(slow))
        assert total(out.time, "mul") == pytest.approx(n / peak, rel=1e-12)  # compute-bound on these units
        assert total(out.compute_bound_time, "mul") == total(out.time, "mul")
        assert out.summary["compute_bound_share"] == 1.0


def test_autocast_work_is_timed_in_the_dtype_its_kernel_ran_in() -> None:
    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.l(x)

    trace = record_trace(RunSpec.of(Autocast(), torch.randn(5, 8), execution="real"))
    out = roofline(trace, RooflineSettings(GPU, launch_overhead=1.0))
    assert out.summary["dtype"] == "bfloat16"  # the linear was called in float32; its addmm ran in bfloat16
    assert set(out.time.dtypes[""]) == {"bfloat16"}
    # one unit: the linear call, its three casts to bfloat16 and the addmm (four kernels; t is a view)
    assert out.time.counts[""] == {"linear": pytest.approx(4.0, rel=1e-6)}


# --- modules, phases, summary -------------------------------------------------------------------------------
def test_module_time_is_the_sum_of_its_units() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    m = 16
    out = run(model, torch.randn(m, 32))
    first = roof(2 * m * 64 * 32 + m * 64, 4 * (m * 32 + 32 * 64 + 64 + m * 64), FP32)
    gelu = roof(m * 64, 4 * 2 * m * 64, FP32)
    last = roof(2 * m * 8 * 64 + m * 8, 4 * (m * 64 + 64 * 8 + 8 + m * 8), FP32)
    assert out.time.counts["0"] == {"linear": pytest.approx(first, rel=1e-12)}
    assert out.time.counts["1"] == {"gelu": pytest.approx(gelu, rel=1e-12)}
    assert out.time.counts["2"] == {"linear": pytest.approx(last, rel=1e-12)}
    assert out.time.counts[""] == {"linear": pytest.approx(first + last, rel=1e-12),
                                   "gelu": pytest.approx(gelu, rel=1e-12)}
    assert out.summary["time"] == {"forward": pytest.approx(first + gelu + last, rel=1e-12),
                                   "total": pytest.approx(first + gelu + last, rel=1e-12)}


def test_nested_modules_add_up_through_every_parent() -> None:
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Tanh()), nn.Linear(8, 4))
    m = 2
    out = run(model, torch.randn(m, 8))
    inner = roof(2 * m * 8 * 8 + m * 8, 4 * (m * 8 + 8 * 8 + 8 + m * 8), FP32)
    tanh = roof(m * 8, 4 * 2 * m * 8, FP32)
    last = roof(2 * m * 4 * 8 + m * 4, 4 * (m * 8 + 8 * 4 + 4 + m * 4), FP32)
    for name in ("0.0.0", "0.0"):
        assert out.time.counts[name] == {"linear": pytest.approx(inner, rel=1e-12)}
    assert out.time.counts["0"] == {"linear": pytest.approx(inner, rel=1e-12), "tanh": pytest.approx(tanh, rel=1e-12)}
    assert out.time.counts[""] == {"linear": pytest.approx(inner + last, rel=1e-12),
                                   "tanh": pytest.approx(tanh, rel=1e-12)}
    assert out.time.dtypes["0"] == {"float32": pytest.approx(inner + tanh, rel=1e-12)}
    assert out.flops.by_phase["forward"]["0.0"] == {"linear": 2 * m * 8 * 8 + m * 8}


def test_training_step_phases_sum_to_total_and_mfu_hfu_from_a_measured_time() -> None:
    m, k, n = 64, 128, 256

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(k, n)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda y: F.gelu(self.l(y)), x, use_reentrant=False)

    out = run(Checkpointed(), torch.randn(m, k), backward=True, measured_time=1e-3)
    summary = out.summary
    assert set(summary["time"]) == {"forward", "backward", "recompute", "total"}
    phases = summary["time"]["forward"] + summary["time"]["backward"] + summary["time"]["recompute"]
    assert phases == pytest.approx(summary["time"]["total"], rel=1e-12)
    for phase in ("forward", "backward", "recompute"):
        assert sum(out.time.by_phase[phase][""].values()) == pytest.approx(summary["time"][phase], rel=1e-12)
    # forward: linear 2mnk + mn, gelu mn (the default loss is taken outside the model); backward: gelu' mn,
    # dW 2mnk, db mn; recompute: the linear again (gelu's saved input)
    model_flops = 2 * m * n * k + m * n + m * n + m * n + 2 * m * n * k + m * n
    recompute = 2 * m * n * k + m * n
    assert summary["model_flops"] == model_flops
    assert summary["flops"] == model_flops + recompute
    assert summary["mfu"] == pytest.approx(model_flops / (1e-3 * FP32), rel=1e-12)
    assert summary["hfu"] == pytest.approx((model_flops + recompute) / (1e-3 * FP32), rel=1e-12)
    assert summary["predicted_mfu"] == pytest.approx(model_flops / (summary["time"]["total"] * FP32), rel=1e-12)
    assert summary["measured_time"] == 1e-3


def test_without_a_measured_time_there_is_no_mfu() -> None:
    summary = run(nn.Linear(4, 4), torch.randn(2, 4)).summary
    assert summary["measured_time"] is None and summary["mfu"] is None and summary["hfu"] is None


def test_items_and_throughput_for_images_tokens_and_samples() -> None:
    images = run(nn.Conv2d(3, 4, 3), torch.randn(6, 3, 16, 16)).summary
    assert images["items"] == {"count": 6, "unit": "images"}
    assert images["throughput"] == pytest.approx(6 / images["time"]["total"], rel=1e-12)
    tokens = run(nn.Embedding(100, 16), torch.zeros(3, 40, dtype=torch.long)).summary
    assert tokens["items"] == {"count": 120, "unit": "tokens"}
    assert tokens["throughput"] == pytest.approx(120 / tokens["time"]["total"], rel=1e-12)
    samples = run(nn.Linear(4, 4), torch.randn(5, 7, 4)).summary
    assert samples["items"] == {"count": 5, "unit": "samples"}


def test_summary_is_plain_json_with_the_documented_fields() -> None:
    import json

    summary = run(nn.Linear(16, 16), torch.randn(4, 16), efficiency=0.8, launch_overhead=2e-6).summary
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary) == {"device", "dtype", "settings", "time", "flops", "model_flops", "bytes",
                            "compute_bound_share", "predicted_mfu", "measured_time", "mfu", "hfu", "items",
                            "throughput", "operators"}
    assert summary["device"] == {"name": "testgpu", "label": "Test GPU", "memory": 10**10, "bandwidth": BANDWIDTH,
                                 "peak": FP32, "vector_peak": FP32, "ridge": FP32 / BANDWIDTH}
    assert summary["settings"] == {"efficiency": 0.8, "launch_overhead": 2e-6, "tf32": False}
    [row] = summary["operators"]
    assert set(row) == {"operator", "dtype", "flops", "bytes", "time", "compute_bound", "intensity"}
    assert (row["operator"], row["dtype"]) == ("linear", "float32")


def test_operators_aggregate_per_key_and_dtype_over_the_run() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.bfloat16))

    class Cast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return model[2](model[1](model[0](x)).to(torch.bfloat16))

    rows = {(r["operator"], r["dtype"]): r for r in run(Cast(), torch.randn(2, 8)).summary["operators"]}
    per_layer = 2 * 2 * 8 * 8 + 2 * 8
    assert rows[("linear", "float32")]["flops"] == 2 * per_layer
    assert rows[("linear", "bfloat16")]["flops"] == per_layer
    assert rows[("linear", "float32")]["bytes"] == 2 * 4 * (2 * 8 + 8 * 8 + 8 + 2 * 8)


def test_totals_pair_every_count_exactly_once() -> None:
    """The four statistics add up to what each metric counts on its own: no count lost or taken twice by the
    pairing (a linear's FLOPs at the call, its bytes at the addmm inside)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    model(torch.randn(2, 3, 12, 12))
    trace = trace_of(model, torch.randn(2, 3, 12, 12), backward=True)
    out = roofline(trace, RooflineSettings(GPU))
    convention = get_convention("flops")
    flops = count(trace, convention.handles, elementwise=convention.elementwise)
    moved = count_bytes(trace)
    assert sum(out.flops.counts[""].values()) == sum(flops.counts[""].values()) == out.summary["flops"]
    assert sum(out.bytes.counts[""].values()) == sum(moved.counts[""].values()) == out.summary["bytes"]
    assert sum(out.time.counts[""].values()) == pytest.approx(out.summary["time"]["total"], rel=1e-12)
    assert out.flops.uncalled == out.time.uncalled == set()


def test_nothing_to_count_gives_zero_time_and_no_ratios() -> None:
    summary = run(nn.Identity(), torch.randn(3)).summary
    assert summary["time"] == {"forward": 0, "total": 0} or summary["time"] == {"total": 0}
    assert summary["predicted_mfu"] is None and summary["throughput"] is None


# --- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("efficiency", 0), ("efficiency", 1.5), ("efficiency", math.nan), ("efficiency", True), ("efficiency", "1"),
    ("launch_overhead", -1e-6), ("launch_overhead", math.inf), ("measured_time", 0), ("measured_time", -1.0)])
def test_bad_settings_are_named(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        RooflineSettings(GPU, **{field: value})


def test_device_must_be_a_device() -> None:
    with pytest.raises(TypeError, match="device must be"):
        RooflineSettings("h100")  # type: ignore[arg-type]


# --- what the roofline reads from counting ------------------------------------------------------------------
def test_units_carry_their_key_and_tables_false_makes_only_the_units() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.l(x).view(1, 2, 2, 8)
            return F.scaled_dot_product_attention(y, y, y)

    trace = trace_of(Block(), torch.randn(4, 8, requires_grad=True), backward=True)
    convention = get_convention("flops")
    with_tables: list[Any] = []
    without: list[Any] = []
    stats = count(trace, convention.handles, elementwise=convention.elementwise, units=with_tables)
    bare = count(trace, convention.handles, elementwise=convention.elementwise, units=without, tables=False)
    assert with_tables == without
    assert {u.key for u in without} >= {"linear", "scaled_dot_product_attention",
                                        "scaled_dot_product_attention_backward", "mm"}
    [whole] = [u for u in without if u.whole_backward]
    assert whole.key == "scaled_dot_product_attention_backward"
    assert trace.events[trace.events[whole.event].origin].op == "aten::scaled_dot_product_attention"
    assert sum(u.total for u in without) == sum(stats.counts[""].values())
    assert bare.counts == {} and all(table == {} for table in bare.by_phase.values()) and bare.dtypes == {}


@pytest.mark.slow
def test_benchmark_quick_run_reports_every_ratio(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "roofline_bench.py"
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(script), "--quick", "--repeat", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"resnet18", "llama2_tiny"}
    for rows in report.values():
        assert set(rows) == {"forward", "forward+backward"}
        for row in rows.values():
            assert row["events"] > 0 and row["ratio"]["runs"] == 2
            assert 1 < row["ratio"]["min"] <= row["ratio"]["median"] <= row["ratio"]["max"]


def _small_models() -> dict[str, tuple[Any, Any]]:
    import torchvision

    from modelmeter.zoo import get_model

    return {
        "llama2_tiny": (lambda: get_model("llama2_tiny"), torch.zeros(2, 16, dtype=torch.long)),
        "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(), torch.randn(2, 3, 32, 32)),
        "encoder": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                                  enable_nested_tensor=False), torch.randn(2, 10, 32)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2_tiny", "mobilenet_v2", "encoder"])
@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_real_models_pair_every_count_once_and_add_up(name: str, kernel: str) -> None:
    build, x = _small_models()[name]
    trace = trace_of(build(), x, backward=True)
    out = roofline(trace, RooflineSettings(GPU, launch_overhead=1e-6), attention_kernel=kernel)
    convention = get_convention("flops", attention_kernel=kernel)
    flops = count(trace, convention.handles, elementwise=convention.elementwise)
    assert sum(out.flops.counts[""].values()) == sum(flops.counts[""].values())
    assert sum(out.bytes.counts[""].values()) == sum(count_bytes(trace, kernel).counts[""].values())
    summary = out.summary
    assert sum(summary["time"][phase] for phase in trace.phases()) == pytest.approx(summary["time"]["total"])
    assert sum(row["time"] for row in summary["operators"]) == pytest.approx(summary["time"]["total"])
    assert sum(row["flops"] for row in summary["operators"]) == summary["flops"]
    for module, row in out.time.counts.items():  # a module's time is its operators' and at most its parent's
        parent = module.rpartition(".")[0]
        assert sum(row.values()) <= sum(out.time.counts[parent].values()) * (1 + 1e-12) or module == ""
        assert out.compute_bound_time.counts.get(module, {}).keys() <= row.keys()


# --- the optimizer's step -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "flops_per_element", "states", "kernels_per_parameter"),
                         [("sgd", 2, 0, 1), ("momentum", 4, 1, 2), ("adam", 13, 2, 7), ("adamw", 14, 2, 8)])
def test_the_optimizers_step_by_hand(name: str, flops_per_element: int, states: int,
                                     kernels_per_parameter: int) -> None:
    from modelmeter.metrics.memory import optimizer_spec

    k, n = 256, 128
    trace = trace_of(nn.Linear(k, n), torch.randn(4, k), backward=True)
    elements, parameters = k * n + n, 2
    moved = 4 * elements * (3 + 2 * states)  # p read and written, g read, each state read and written
    flops = flops_per_element * elements
    overhead = 1e-6
    out = roofline(trace, RooflineSettings(GPU, launch_overhead=overhead), optimizer=optimizer_spec(name))
    step = out.time.by_phase["optimizer"][""][f"{name}.step"]
    assert out.bytes.by_phase["optimizer"][""][f"{name}.step"] == moved
    assert out.flops.by_phase["optimizer"][""][f"{name}.step"] == flops
    assert step == pytest.approx(roof(flops, moved, FP32) + parameters * kernels_per_parameter * overhead, rel=1e-12)
    foreach = roofline(trace, RooflineSettings(GPU, launch_overhead=overhead),
                       optimizer=optimizer_spec(name, foreach=True))
    assert foreach.time.by_phase["optimizer"][""][f"{name}.step"] == pytest.approx(
        roof(flops, moved, FP32) + kernels_per_parameter * overhead, rel=1e-12)  # one launch per list
    summary = out.summary
    assert summary["time"]["optimizer"] == pytest.approx(step)
    assert summary["time"]["total"] == pytest.approx(sum(t for p, t in summary["time"].items() if p != "total"))
    plain = roofline(trace, RooflineSettings(GPU, launch_overhead=overhead))
    assert summary["model_flops"] == plain.summary["model_flops"]  # the model's FLOPs, not the optimizer's
    assert summary["time"]["total"] == pytest.approx(plain.summary["time"]["total"] + step)
    assert "optimizer" not in plain.summary["time"]


def test_an_optimizer_of_the_users_leaves_its_step_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """An OptimizerSpec of the user's describes memory, not an update: the time of the step is left out and said."""
    from modelmeter.metrics.memory import OptimizerSpec

    trace = trace_of(nn.Linear(16, 8), torch.randn(4, 16), backward=True)
    plain = roofline(trace, RooflineSettings(GPU))
    with caplog.at_level("WARNING", logger="modelmeter"):
        out = roofline(trace, RooflineSettings(GPU), optimizer=OptimizerSpec("lion", states=1))
    assert out.summary["time"] == plain.summary["time"] and "optimizer" not in out.summary["time"]
    assert "optimizer 'lion'" in caplog.text and "leaves it out" in caplog.text


def test_the_optimizers_states_in_their_own_dtype() -> None:
    from modelmeter.metrics.memory import optimizer_spec

    trace = trace_of(nn.Linear(64, 32, bias=False), torch.randn(4, 64), backward=True)
    elements = 64 * 32
    out = roofline(trace, RooflineSettings(GPU), optimizer=optimizer_spec("adam", state_dtype="bfloat16"))
    assert out.bytes.by_phase["optimizer"][""]["adam.step"] == 4 * elements * 3 + 2 * elements * 2 * 2
