"""Repeated calls of a forward on meta tensors are replayed, not run again (engine/replay.py).

The oracle is the run without replay (``replay_disabled()``): the trace with replay must equal it event by event and
storage by storage (tests/trace_equality.py), on models made of repeated layers and on the cases a replay must not
take — views and in-place operators, known values, storages the run has not seen, autocast, grad mode, a scalar's
type or sign, the default dtype changed inside the forward. That replay happens at all is checked by counting the
replayed calls, so none of these tests passes by replaying nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modelmeter
from modelmeter.engine import recorder, replay
from modelmeter.engine.naming import ModuleNames
from modelmeter.engine.recorder import Recorder
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.trace import OpEvent, Trace
from modelmeter.engine.tracer import record_trace
from modelmeter.errors import ModelRunError
from trace_equality import assert_same_trace


@contextlib.contextmanager
def _counting() -> Iterator[list[str]]:
    """The operator of every call replayed."""
    replayed: list[str] = []
    run = replay._Template.replay

    def counted(self: Any, rec: Any, arguments: list[torch.Tensor]) -> Any:
        replayed.append(self.events[0][0])
        return run(self, rec, arguments)

    replay._Template.replay = counted  # type: ignore[method-assign]
    try:
        yield replayed
    finally:
        replay._Template.replay = run  # type: ignore[method-assign]


def _same(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Trace, list[str]]:
    """The trace with replay (checked equal to the one without), and the operators replayed. The run without replay
    goes first: a process's first call of some kernels imports modules, and such a call is not kept."""
    with replay.replay_disabled():
        slow = record_trace(RunSpec(model, args, kwargs))
    with _counting() as replayed:
        fast = record_trace(RunSpec(model, args, kwargs))
    assert_same_trace(fast, slow)
    return fast, replayed


def _stack(layers: int, width: int = 8) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))).eval()


_VERSIONS: list[int] = []  # what the model below saw (kept outside it: a run leaves the model as it found it)


class _InPlace(nn.Module):
    """In-place updates of activations, repeated: each bumps its tensor's version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(4):
            y = h * 2
            y.relu_().mul_(3)
            h.add_(y)
            _VERSIONS.extend((y._version, h._version))
        return h


def test_versions_bumped_in_place_are_bumped_by_a_replay() -> None:
    seen = []
    for replayed in (True, False):
        _VERSIONS.clear()
        with contextlib.ExitStack() as stack:
            if not replayed:
                stack.enter_context(replay.replay_disabled())
            calls = stack.enter_context(_counting())
            record_trace(RunSpec(_InPlace(), (torch.randn(2, 8),), {}))
        seen.append(list(_VERSIONS))
        if replayed:
            assert {"aten::relu_", "aten::mul_", "aten::add_"} <= set(calls)
    assert seen[0] == seen[1] == [2, 1, 2, 2, 2, 3, 2, 4]


def test_a_stack_of_repeated_layers_is_replayed_after_its_first_layer() -> None:
    trace, replayed = _same(_stack(20), torch.randn(3, 8))
    assert sorted(set(replayed)) == ["aten::gelu", "aten::linear"]
    # a key's first call makes its template, the second is replayed; the first layer's input has known values (the
    # caller's), the others' not: the third linear layer is the first replayed
    assert replayed.count("aten::linear") == 18 and replayed.count("aten::gelu") == 19
    assert [e.op for e in trace.events[:5]] == ["aten::linear", "aten::t", "aten::addmm", "aten::gelu", "aten::gelu"]


def test_what_a_replay_counts_is_what_a_run_counts() -> None:
    model, x = _stack(6), torch.randn(2, 8)
    fast = modelmeter.analyze(model, x, cache=False, quiet=True, memory=True, device="h100").result()
    with replay.replay_disabled():
        slow = modelmeter.analyze(model, x.clone(), cache=False, quiet=True, memory=True, device="h100").result()
    assert fast.to_dict() == slow.to_dict()


class _Block(nn.Module):
    """Convolution, batch norm (eval: its statistics have known values), an in-place ReLU and residual sum (their
    input's version counter bumped, as the run would)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.norm(self.conv(x)))
        y += x
        return F.max_pool2d(y, 1)


def test_convolutions_and_batch_norm_with_known_statistics() -> None:
    model = nn.Sequential(*(_Block(4) for _ in range(4))).eval()
    _, replayed = _same(model, torch.randn(2, 4, 8, 8))
    assert {"aten::conv2d", "aten::batch_norm", "aten::max_pool2d", "aten::relu", "aten::add_"} <= set(replayed)


class _Mixed(nn.Module):
    """Calls of many kinds, each three times on the same shapes (a first call may import, and is not kept): views,
    several outputs, lists of tensors, in-place updates, known values (positions from ``arange``), scalars of other
    types and signs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> Any:
        outs = []
        for _ in range(3):
            h = self.proj(x)
            a, b = h.chunk(2, dim=-1)
            top, where = torch.max(a, dim=-1)
            pieces = torch.split(b, 3, dim=-1)
            joined = torch.cat([a, b], dim=-1)
            stacked = torch.stack([a, b])
            values, indices = torch.topk(joined, 2)
            positions = torch.arange(x.shape[0], device=x.device).unsqueeze(-1)
            mask = positions > 0
            filled = joined.masked_fill(mask, 0.0)
            scaled = filled * 0.0 + filled * -0.0 + filled * 2 + filled * 2.0 + filled * True
            moved = scaled.transpose(0, 1).contiguous().view(-1)[..., 1:][None][0]
            converted = moved.to(torch.float16).float() + 1
            normed = self.norm(x).relu_()
            softened = F.softmax(joined, dim=-1) @ joined.transpose(-1, -2)
            outs += [top, where, *pieces, stacked, values, indices, converted, normed, softened, mask.long() + 1]
        return outs


def test_calls_of_every_kind_repeated_record_as_a_run_does() -> None:
    _, replayed = _same(_Mixed().eval(), torch.randn(3, 8))
    assert {"aten::linear", "aten::max", "aten::cat", "aten::stack", "aten::topk", "aten::softmax", "aten::chunk",
            "aten::split", "aten::transpose", "aten::view", "aten::relu_", "aten::contiguous", "aten::index"
            } <= set(replayed)


class _GlobalTensor(nn.Module):
    """Adds a tensor held by no module (one the run has never seen) after every layer."""

    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.extra = [extra]  # out of the module's tables: the run does not know its storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)  # a sum of storages the run has seen...
            x = x + self.extra[0]  # ...then one whose storage it has not: never replayed on that tensor
        return x


def test_a_storage_the_run_has_not_seen_is_never_replayed() -> None:
    with torch.device("meta"):
        model = _GlobalTensor(torch.ones(8))
    _, replayed = _same(model, torch.zeros(2, 8, device="meta"))
    assert replayed.count("aten::linear") == 3
    assert replayed.count("aten::add") == 3  # the sums of the second to fourth layer; none with the unseen tensor


_REQUIRES_GRAD: list[bool] = []  # what the model below saw (kept outside it: a run leaves the model as it found it)


class _Switches(nn.Module):
    """The same call under autocast, with grad enabled (on tensors that require grad and that do not), and with
    another default dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(2, 8))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [self.lin(x), self.lin(x), self.lin(x)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs += [self.lin(x), self.lin(x), self.lin(x)]
        with torch.enable_grad():
            outs += [self.lin(x), self.lin(x), self.lin(x)]
            plain = self.lin(x).detach()
            products = [plain * 2, plain * 2, plain * 2, self.scale * 2]  # the last on a tensor that requires grad
            _REQUIRES_GRAD.extend(p.requires_grad for p in products)
        ints = torch.ones(2, dtype=torch.long, device=x.device)
        outs += [ints * 0.5]
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            outs += [ints * 0.5]
        finally:
            torch.set_default_dtype(before)
        return outs


def test_autocast_grad_mode_and_the_default_dtype_are_part_of_a_call() -> None:
    _REQUIRES_GRAD.clear()
    trace, replayed = _same(_Switches().eval(), torch.randn(2, 8))
    assert _REQUIRES_GRAD == [False, False, False, True] * 2
    assert replayed.count("aten::linear") == 2  # the second and third plain calls: not under autocast, nor with grad
    halves = [e for e in trace.events if e.op == "aten::mul" and e.level == "function" and e.inputs[0].dtype == "int64"]
    assert [e.outputs[0].dtype for e in halves] == ["float32", "float64"]


@pytest.mark.parametrize("op", [
    torch.ops.aten.bernoulli_.float, torch.ops.aten.randn.default, torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten.index.Tensor,
    torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Tensor])
def test_operators_whose_record_is_not_their_metadata_are_never_replayed(op: Any) -> None:
    assert not replay.replayable(op, collective=False)
    assert replay.replayable(torch.ops.aten.addmm.default, collective=False)
    assert not replay.replayable(torch.ops.aten.addmm.default, collective=True)


class _Negated(nn.Module):
    """The same product on a plain tensor and on a negative view of it (a bit that operators resolve themselves),
    and a view as another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.lin(x)
        return [*(h * 2 for _ in range(3)), *(torch._neg_view(h) * 2 for _ in range(3)),
                *(h.view(torch.int32) + 1 for _ in range(3))]


def test_a_negative_view_or_one_of_another_dtype_is_not_taken_for_a_plain_view() -> None:
    _, replayed = _same(_Negated().eval(), torch.randn(2, 8))
    assert replayed.count("aten::mul") == 2 and replayed.count("aten::add") == 2


@pytest.mark.parametrize("frees", [False, True])
def test_a_call_during_which_an_older_storage_is_freed_is_recorded_every_time(frees: bool) -> None:
    """Driven by hand: a call whose recording frees a storage made before it (which no torch function does today)."""
    rec = Recorder(ModuleNames(nn.Identity()))
    memo = replay.CallMemo(rec)
    x = torch.empty(2, device="meta")
    older = [torch.empty(3, device="meta") for _ in range(3)]  # one freed by each call
    rec.storages.existing(x, "input")
    for i in range(3):
        rec.storages.existing(older[i], "input")
    recorded = []

    def record() -> torch.Tensor:
        recorded.append(1)
        rec.trace.events.append(OpEvent("aten::neg", "function", -1, rec.current_scope(), "forward", [], [], {}))
        out = torch.empty(2, device="meta")
        rec.storages.outputs(out, len(rec.trace.events) - 1)
        if frees:
            older.pop()
        return out

    outputs = [memo.run(torch.neg, (x,), {}, record) for _ in range(3)]
    assert len(recorded) == (3 if frees else 1)
    assert [o.shape for o in outputs] == [(2,)] * 3 and outputs[1] is not outputs[2]


def test_a_transformer_encoder_and_recurrent_layers() -> None:
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3,
                                    enable_nested_tensor=False).eval()
    _, replayed = _same(encoder, torch.randn(2, 5, 16))
    assert "aten::linear" in replayed
    lstm = nn.Sequential(nn.LSTM(8, 8, batch_first=True)).eval()
    _same(lstm, torch.randn(2, 4, 8))


def test_a_backward_pass_is_recorded_every_time() -> None:
    model = _stack(4)
    with _counting() as replayed:
        record_trace(RunSpec(model, (torch.randn(2, 8),), {}, backward=True))
    assert replayed == []


class _MaskedAttention(nn.Module):
    """Attention through ``F.multi_head_attention_forward`` (Python: a call around the attention operator) under
    masks of one shape and several windows: the attended pairs are read from the masks' values."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        steps = torch.arange(x.shape[1], device=x.device)
        outs = []
        for window in (1, 2, 2, 5):
            far = (steps[None, :] - steps[:, None]).abs() > window
            mask = torch.zeros(far.shape, device=x.device).masked_fill(far, float("-inf"))
            outs.append(self.attention(x, x, x, attn_mask=mask, need_weights=False)[0])
        return outs


def test_a_call_around_attention_is_recorded_every_time(monkeypatch: Any) -> None:
    """Even where every operator inside counted as replayable (today the CPU's attention kernel draws random numbers
    for its dropout, which alone keeps the call from being replayed)."""
    monkeypatch.setattr(recorder, "_OPERATORS", {})  # worked out again, with the replaceable rule below
    monkeypatch.setattr(recorder, "replayable", lambda func, collective: not collective)
    trace, _ = _same(_MaskedAttention().eval(), torch.randn(1, 7, 8))
    attended = [meta.attended for event in trace.events for meta in event.inputs
                if getattr(meta, "attended", None) is not None]
    assert attended == [38, 58, 58, 94]


class _Residual(nn.Module):
    """``y = linear(x); y += x``: an in-place sum on the layer's own output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y += x
        return y


class _Views(nn.Module):
    """Views of views, a slice of a concatenation, and a copy made contiguous."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1).view(x.shape).transpose(0, -1)
        return torch.cat([flat, flat], 0)[: flat.shape[0]].transpose(0, -1).contiguous()


# Layers whose calls keep their input's shape (so any sequence of them runs), and a width for each.
_LAYERS = {
    "residual": _Residual, "views": lambda w: _Views(),
    "linear": lambda w: nn.Linear(w, w), "linear_nobias": lambda w: nn.Linear(w, w, bias=False),
    "gelu": lambda w: nn.GELU(), "tanh_gelu": lambda w: nn.GELU("tanh"), "relu": lambda w: nn.ReLU(),
    "relu_inplace": lambda w: nn.ReLU(inplace=True), "silu": lambda w: nn.SiLU(), "norm": lambda w: nn.LayerNorm(w),
    "dropout": lambda w: nn.Dropout(0.1), "softmax": lambda w: nn.Softmax(-1), "identity": lambda w: nn.Identity(),
}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(sorted(_LAYERS)), min_size=1, max_size=5), st.integers(1, 4),
       st.integers(1, 9), st.integers(1, 3), st.sampled_from([torch.float32, torch.float16, torch.float64]))
def test_any_repeated_block_records_as_a_run_does(kinds: list[str], repeats: int, width: int, batch: int,
                                                   dtype: torch.dtype) -> None:
    blocks = [nn.Sequential(*(_LAYERS[kind](width) for kind in kinds)) for _ in range(repeats)]
    model = nn.Sequential(*blocks).eval().to(dtype)
    _same(model, torch.randn(batch, width, dtype=dtype))


def _architectures() -> dict[str, Any]:
    """Real architectures, built without weights: (model, inputs) makers."""
    torchvision = pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")

    def llama() -> tuple[nn.Module, tuple[Any, ...]]:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).eval()
        return model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),)

    def gpt2() -> tuple[nn.Module, tuple[Any, ...]]:
        config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=100, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval(), (torch.randint(0, 100, (1, 16)),)

    return {
        "resnet50": lambda: (torchvision.models.resnet50().eval(), (torch.randn(1, 3, 224, 224),)),
        "vit_b_16": lambda: (torchvision.models.vit_b_16().eval(), (torch.randn(1, 3, 224, 224),)),
        "swin_t": lambda: (torchvision.models.swin_t().eval(), (torch.randn(1, 3, 224, 224),)),
        "mobilenet_v3_small": lambda: (torchvision.models.mobilenet_v3_small().eval(),
                                       (torch.randn(1, 3, 224, 224),)),
        "llama_on_meta": llama, "gpt2": gpt2,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "vit_b_16", "swin_t", "mobilenet_v3_small", "llama_on_meta", "gpt2"])
def test_real_architectures_record_the_same_with_replay(name: str) -> None:
    model, args = _architectures()[name]()
    _, replayed = _same(model, *args)
    assert replayed


class _Positions(nn.Module):
    """One learned position table looked up three times, with positions the model makes (known values): the last
    run of positions is past the table."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(20, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        out = x.new_zeros(length, 4)
        for start in (0, length, 2 * length):
            out = out + self.positions(torch.arange(start, start + length, device=x.device))
        return out


def test_a_call_on_other_known_values_is_checked_again() -> None:
    """The replay key had whether a tensor's values are known, not what a check reads of them: the second and third
    lookups replayed the first's template (the same metadata), and positions past the table were counted."""
    with pytest.raises(IndexError):
        _Positions()(torch.zeros(1, 8))  # 16 to 23 in a table of 20
    with pytest.raises(ModelRunError, match="index out of range"):
        record_trace(RunSpec(_Positions(), (torch.zeros(1, 8),), {}))
    _, replayed = _same(_Positions(), torch.zeros(1, 6))  # 12 to 17: it fits, each lookup recorded
    assert "aten::embedding" not in replayed
