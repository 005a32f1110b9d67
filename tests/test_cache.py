"""Trace caching: one trace per analysis in-process, and the persistent, opt-in cache on disk.

Every test runs with ``MODELMETER_CACHE`` pointing at its own temporary directory (autouse fixture below), so
nothing is ever written to the real user cache. Whether the model ran is observed with a forward pre-hook
(a plain module-level function, so registering it on two identical models keeps their keys equal).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import gzip
import json
import logging
import math
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import modelmeter
from families import _llama
from modelmeter import (
    ActivationCountAnalysis,
    Args,
    FlopCountAnalysis,
    OpEvent,
    RunSpec,
    TensorMeta,
    Trace,
    analyze,
    flop_count_table,
)
from modelmeter.cache import TraceCache, cache_info, clear_cache, parse_size, trace_from_dict, trace_key, trace_to_dict
from modelmeter.cli import main
from modelmeter.engine import serialize
from modelmeter.engine.inputs import split_inputs
from modelmeter.engine.serialize import dumps, loads
from modelmeter.engine.trace import Storage
from trace_equality import assert_same_trace


@pytest.fixture(autouse=True)
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory for every test, via the environment (never the user's real cache)."""
    root = tmp_path / "modelmeter-cache"
    monkeypatch.setenv("MODELMETER_CACHE", str(root))
    monkeypatch.delenv("MODELMETER_CACHE_SIZE", raising=False)
    return root


# --- models and helpers ----------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, stride: int = 1, p: float = 0.1, eps: float = 1e-5, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, stride=stride, padding=1)
        self.bn = nn.BatchNorm2d(channels, eps=eps)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(y.mean((2, 3)) * scale)


def image(batch: int = 2, size: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, dtype=dtype)


RUNS: Counter[str] = Counter()


def _count_run(module: nn.Module, args: Any) -> None:
    RUNS[type(module).__name__] += 1


def watched(model: nn.Module) -> nn.Module:
    """``model`` with a forward pre-hook counting its calls in ``RUNS`` (reset here)."""
    RUNS.clear()
    model.register_forward_pre_hook(_count_run)
    return model


def runs(model: nn.Module) -> int:
    return RUNS[type(model).__name__]


def key(model: nn.Module, inputs: Any, execution: str = "auto") -> str:
    args, kwargs = split_inputs(inputs)
    k = trace_key(RunSpec(model, args, kwargs, execution=execution))
    assert k is not None
    return k


def entries(root: Path) -> list[Path]:
    """The trace entries of the cache in ``root``."""
    return sorted(p for p in (root / "traces").glob("*.json.gz") if not p.name.endswith(".result.json.gz"))


def results(root: Path) -> list[Path]:
    """The results kept beside the traces of the cache in ``root``."""
    return sorted((root / "traces").glob("*.result.json.gz"))


# --- in-process: one trace for every metric ---------------------------------------------------------------
def test_analyze_runs_the_model_once_for_every_metric() -> None:
    model = watched(Net().eval())
    result = analyze(model, image())
    assert runs(model) == 1
    assert result.flops.trace is result.activations.trace is result.trace
    assert result.flops.total() == FlopCountAnalysis(Net().eval(), image()).total()
    assert result.activations.total() > 0
    assert result.parameters[""] == sum(p.numel() for p in model.parameters())
    report = result.result(name="net")
    assert report.total("flops") == result.flops.total() and report.total("activations") == result.activations.total()
    assert "#activations" in result.table()
    result.flops.set_op_handle("aten::linear", None)  # recomputes from the trace
    result.activations.ancestor_mode("caller")
    result.flops.total(), result.activations.by_module()
    assert runs(model) == 1
    assert not result.from_cache and result.assumptions() == []
    assert "flops" in repr(result)


def test_flop_count_table_with_activations_runs_the_model_once(recordings: list[Any]) -> None:
    model = Net().eval()
    x = image()
    flops, acts = FlopCountAnalysis(model, x), ActivationCountAnalysis(model, x)
    table = flop_count_table(flops, activations=acts)
    assert len(recordings) == 1
    assert "#activations" in table and acts.trace is flops.trace
    flop_count_table(flops, activations=acts, max_depth=1)
    assert len(recordings) == 1


def test_analyze_is_exported() -> None:
    assert modelmeter.analyze is analyze and "analyze" in modelmeter.__all__ and "Analysis" in modelmeter.__all__


# --- keys -------------------------------------------------------------------------------------------------
def _make_class(body: str) -> type[nn.Module]:
    """A module class named ``Twin`` made by exec: no source file, so only its code objects tell them apart."""
    namespace: dict[str, Any] = {"nn": nn, "torch": torch}
    exec(textwrap.dedent(f"""
        class Twin(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                {body}
        """), namespace)
    return namespace["Twin"]


def test_forward_code_is_keyed_even_without_source() -> None:
    first, second, again = (_make_class(b) for b in ("return self.fc(x)", "return self.fc(x) * 2",
                                                      "return self.fc(x)"))
    assert first.__qualname__ == second.__qualname__ == "Twin"
    x = torch.randn(1, 4)
    assert key(first(), x) != key(second(), x)
    assert key(first(), x) == key(again(), x)  # same code, another class object


def _with(model: nn.Module, change: Any) -> nn.Module:
    change(model)
    return model


BASE_X = image()
MUTATIONS: dict[str, tuple[Any, Any, str]] = {
    # name: (model, inputs, execution), each one change away from (Net(), image(), "auto")
    "parameter shape": (Net(channels=6), BASE_X, "auto"),
    "parameter dtype": (Net().double(), BASE_X, "auto"),
    "buffer": (_with(Net(), lambda m: m.register_buffer("extra", torch.zeros(3))), BASE_X, "auto"),
    "buffer dtype": (_with(Net(), lambda m: setattr(m.bn, "running_mean", m.bn.running_mean.half())), BASE_X, "auto"),
    "requires_grad": (_with(Net(), lambda m: m.fc.weight.requires_grad_(False)), BASE_X, "auto"),
    "training flag": (Net().eval(), BASE_X, "auto"),
    "submodule training flag": (_with(Net(), lambda m: m.drop.eval()), BASE_X, "auto"),
    "conv stride": (Net(stride=2), BASE_X, "auto"),
    "dropout p": (Net(p=0.5), BASE_X, "auto"),
    "eps": (Net(eps=1e-3), BASE_X, "auto"),
    "meta device": (Net().to("meta"), BASE_X, "auto"),
    "tied weights": (_with(Net(), lambda m: setattr(m, "head", m.fc)), BASE_X, "auto"),
    "forward hook": (_with(Net(), lambda m: m.fc.register_forward_hook(lambda *a: None)), BASE_X, "auto"),
    "instance forward": (_with(Net(), lambda m: setattr(m.drop, "forward", lambda x: x)), BASE_X, "auto"),
    "input shape": (Net(), image(size=16), "auto"),
    "input batch": (Net(), image(batch=3), "auto"),
    "input dtype": (Net(), image(dtype=torch.float64), "auto"),
    "input requires_grad": (Net(), image().requires_grad_(), "auto"),
    "input structure": (Net(), Args(x=BASE_X), "auto"),
    "non-tensor input": (Net(), Args(BASE_X, scale=2.0), "auto"),
    "non-tensor input value": (Net(), Args(BASE_X, scale=3.0), "auto"),
    "execution fake": (Net(), BASE_X, "fake"),
    "execution real": (Net(), BASE_X, "real"),
}


def test_every_change_is_a_miss_and_an_identical_setup_a_hit() -> None:
    base = key(Net(), BASE_X)
    assert key(Net(), image()) == base  # a fresh model object and fresh values: the same key
    keys = {name: key(*setup) for name, setup in MUTATIONS.items()}
    for name, k in keys.items():
        assert k != base, f"{name} did not change the key"
    assert len(set(keys.values())) == len(keys), "two different changes gave one key"


class Tagged(torch.Tensor):
    """A tensor subclass of the user's: keyed by its code."""


class OddParts(Net):
    """What the persistent walk's shortcuts must key as its plain path does: volatile attributes, a parameter and a
    buffer registered as None, a non-persistent buffer, a tensor subclass, hooks of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self._build_time = 1.0  # volatile: not keyed
        self.register_parameter("nothing", None)
        self.register_buffer("unset", None)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_buffer("tagged", torch.zeros(2).as_subclass(Tagged))
        self.fc.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
        self.bn.register_forward_hook(lambda module, args, out: None, always_call=True)


def test_the_fingerprint_shortcuts_give_the_plain_walks_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The persistent walk's shortcuts (a module without hooks, the texts of dtypes, devices and layouts, which
    attribute names are volatile, torch's own tensor classes) change no byte it digests: every key of the changes
    above, and of a module with each odd part, is the key the walk makes without them."""
    from modelmeter.cache import fingerprint

    setups = [(Net(), BASE_X, "auto"), (OddParts(), BASE_X, "auto"), (OddParts().to("meta"), BASE_X, "auto"),
              *MUTATIONS.values()]
    fast = [key(*setup) for setup in setups]
    monkeypatch.setattr(fingerprint._Fingerprint, "module_hooks", fingerprint.CodeWalk.hooks)
    monkeypatch.setattr(fingerprint, "_text", str)
    monkeypatch.setattr(fingerprint, "_volatile", lambda name: fingerprint._VOLATILE.fullmatch(name) is not None)
    monkeypatch.setattr(fingerprint, "_TORCH_TENSOR_TYPES", frozenset())
    assert [key(*setup) for setup in setups] == fast
    assert len(set(fast)) == len(fast)


def test_run_options_and_versions_are_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = Net(), BASE_X
    base = key(model, x)
    with torch.no_grad():
        assert key(model, x) != base
    with torch.inference_mode():
        assert key(model, x) != base
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert key(model, x) != base
    finally:
        torch.set_default_dtype(previous)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(model, x) != base
    assert key(model, x) == base
    monkeypatch.setattr(modelmeter._version, "__version__", "99.0")
    assert key(model, x) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert key(model, x) != base


def test_the_engine_and_the_package_source_are_digested(cache_env: Path) -> None:
    """The trace key holds a digest of the recording engine's source (the trace format included), a kept result's
    key one of the whole package: never the empty fallback of a package not installed as files."""
    from modelmeter.cache.fingerprint import _recorder_digest, package_digest

    assert re.fullmatch("[0-9a-f]{64}", _recorder_digest()) and re.fullmatch("[0-9a-f]{64}", package_digest())
    assert _recorder_digest() != package_digest()
    cache_env.mkdir()
    for _ in range(2):  # kept in the cache directory (the source is settled), then read back: the same digests
        assert _recorder_digest.__wrapped__(str(cache_env)) == _recorder_digest()
        assert package_digest.__wrapped__(str(cache_env)) == package_digest()
    assert len(list(cache_env.glob("source-digest-*.json"))) == 4  # engine/, parallel/, _torch_compat.py, the package


def test_the_parallel_runner_is_part_of_the_recording_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's trace is written by parallel/ as much as by engine/: a change to either reads no trace recorded
    before it (a trace cached without the runner's newer fields gave the old per-rank numbers)."""
    from modelmeter.cache import fingerprint

    digested: list[str] = []
    real = fingerprint._source_digest

    def spy(root: str, memo_dir: str | None) -> str:
        digested.append(os.path.basename(root))
        return real(root, memo_dir)

    monkeypatch.setattr(fingerprint, "_source_digest", spy)
    before = fingerprint._recorder_digest.__wrapped__()
    assert digested == ["engine", "parallel", "_torch_compat.py"]
    monkeypatch.setattr(fingerprint, "_source_digest", lambda root, memo: "changed" if "parallel" in root else
                        real(root, memo))
    assert fingerprint._recorder_digest.__wrapped__() != before


def test_the_source_digest_memos_are_the_caches_own_files(cache_env: Path) -> None:
    """The memos go beside the entries, nothing in the cache directory itself, and clearing the cache removes them."""
    analyze(Net(), image(), cache=True).result()
    assert [p.name for p in cache_env.iterdir()] == ["traces"]
    assert len(list((cache_env / "traces").glob("source-digest-*.json"))) == 4  # as above
    clear_cache(cache_env)
    assert list((cache_env / "traces").iterdir()) == []


def _source_tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    (root / "notes.txt").write_text("not source")
    return root


def test_the_source_digest_is_kept_under_the_files_stats_and_follows_every_edit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source digest kept in the cache is read back only while every file's stats are the ones it was kept
    under: an edit of the same size, even with its modification time put back, gives the digest of the contents."""
    from modelmeter.cache import fingerprint

    monkeypatch.setattr(fingerprint, "SETTLED_SECONDS", -60.0)  # the files were just written: keep it anyway
    root, memo_dir = str(_source_tree(tmp_path / "pkg")), str(tmp_path / "cache")
    os.mkdir(memo_dir)
    unkept = fingerprint._source_digest(root, None)
    assert fingerprint._source_digest(root, memo_dir) == unkept
    [memo] = Path(memo_dir).iterdir()
    kept = json.loads(memo.read_text())
    memo.write_text(json.dumps({**kept, "digest": "f" * 64}))
    assert fingerprint._source_digest(root, memo_dir) == "f" * 64  # read back, not recomputed
    time.sleep(0.05)  # past the file clock's tick
    before = os.stat(tmp_path / "pkg" / "a.py")
    (tmp_path / "pkg" / "a.py").write_text("x = 3\n")
    os.utime(tmp_path / "pkg" / "a.py", ns=(before.st_atime_ns, before.st_mtime_ns))  # as `cp -p` or a tool might
    edited = fingerprint._source_digest(root, None)
    assert edited != unkept and fingerprint._source_digest(root, memo_dir) == edited
    assert fingerprint._source_digest(root, memo_dir) == edited  # and kept under the new stats
    (tmp_path / "pkg" / "notes.txt").write_text("not source either")  # not a .py file: the same digest
    assert fingerprint._source_digest(root, memo_dir) == edited
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "sub" / "c.py")  # a rename changes the digest
    assert fingerprint._source_digest(root, memo_dir) == fingerprint._source_digest(root, None) != edited
    memo.write_text("garbage")
    assert fingerprint._source_digest(root, memo_dir) == fingerprint._source_digest(root, None)


def test_a_source_digest_is_not_kept_while_a_file_was_just_written(tmp_path: Path) -> None:
    """A file changed within the file clock's tick could keep its stats: the digest of so fresh a tree is
    computed from the contents every time, never kept."""
    from modelmeter.cache import fingerprint

    root, memo_dir = str(_source_tree(tmp_path / "pkg")), str(tmp_path / "cache")
    os.mkdir(memo_dir)
    assert fingerprint._source_digest(root, memo_dir) == fingerprint._source_digest(root, None)
    assert os.listdir(memo_dir) == []


def test_a_cache_in_use_is_not_probed_again(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a cache whose ``traces`` folder exists writes no probe file (a cached analysis of a small model
    would pay more for it than the hit saves); a new cache directory is still probed, and an unwritable one
    still falls back to the temporary directory's."""
    from modelmeter.io import cache_dir

    probes = []
    real_mkstemp = cache_dir.tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> Any:
        probes.append(kwargs.get("dir"))
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(cache_dir.tempfile, "mkstemp", mkstemp)
    assert analyze(Net(), image(), cache=True).result() is not None and probes == [str(cache_env)]
    analysis = analyze(Net(), image(), cache=True)
    assert analysis.result() is not None and analysis.from_cache and probes == [str(cache_env)]
    os.chmod(cache_env / "traces", 0o500)
    try:
        if os.access(cache_env / "traces", os.W_OK):
            pytest.skip("this user may write in any directory (root)")
        TraceCache()
        assert len(probes) == 2
    finally:
        os.chmod(cache_env / "traces", 0o700)


def test_object_attributes_are_keyed_without_what_varies_between_equal_objects() -> None:
    class Config:
        def __init__(self, act: str) -> None:
            self.act = act
            self._impl = "sdpa"
            self._object_hash = id(self)  # where it lives, not what it does: not keyed

    class WithConfig(Net):
        def __init__(self, config: Config) -> None:
            super().__init__()
            self.config = config

    x = BASE_X
    base = key(WithConfig(Config("relu")), x)
    assert key(WithConfig(Config("relu")), x) == base
    assert key(WithConfig(Config("gelu")), x) != base
    private = Config("relu")
    private._impl = "eager"
    assert key(WithConfig(private), x) != base


def test_transformers_models_are_keyed_by_their_config() -> None:
    transformers = pytest.importorskip("transformers")

    def llama(**kwargs: Any) -> nn.Module:
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, **kwargs)
        return transformers.AutoModelForCausalLM.from_config(config)

    ids = torch.zeros(1, 8, dtype=torch.long)
    base = key(llama(), ids)
    assert key(llama(), ids) == base  # GenerationConfig's hash(self) and the like are not keyed
    assert key(llama(attn_implementation="eager"), ids) != base
    assert key(llama(rms_norm_eps=1e-3), ids) != base
    assert key(llama(hidden_act="gelu"), ids) != base


def test_real_execution_is_keyed_by_values() -> None:
    model = Net()
    x = image()
    assert key(model, x, "real") == key(model, x.clone(), "real")
    assert key(model, x, "real") != key(model, x + 1, "real")
    changed = Net()
    changed.load_state_dict(model.state_dict())
    assert key(changed, x, "real") == key(model, x, "real")
    with torch.no_grad():
        changed.fc.bias.add_(1)
    assert key(changed, x, "real") != key(model, x, "real")
    assert key(model, x, "auto") == key(changed, x + 1, "auto")  # a fake run never reads values


# --- the persistent cache ---------------------------------------------------------------------------------
def test_off_by_default(cache_env: Path) -> None:
    analyze(Net(), image())
    FlopCountAnalysis(Net(), image()).total()
    assert not cache_env.exists() or not entries(cache_env)


def test_a_fresh_identical_model_is_served_from_the_cache(cache_env: Path) -> None:
    first = analyze(watched(Net().eval()), image(), cache=True)
    assert runs(first.model) == 1 and not first.from_cache
    assert len(entries(cache_env)) == 1
    model = watched(Net().eval())
    second = analyze(model, image(), cache=True)
    assert runs(model) == 0 and second.from_cache
    assert second.flops.by_module_and_operator() == first.flops.by_module_and_operator()
    assert second.activations.by_module_and_operator() == first.activations.by_module_and_operator()
    assert second.result().to_dict() == first.result().to_dict()
    third = FlopCountAnalysis(model, image(), cache=True)
    assert third.total() == first.flops.total() and runs(model) == 0
    assert third.copy().total() == first.flops.total() and runs(model) == 0
    changed = watched(Net(stride=2).eval())
    analyze(changed, image(), cache=True)
    assert runs(changed) == 1 and len(entries(cache_env)) == 2


def test_cache_dir_argument_turns_the_cache_on(tmp_path: Path, cache_env: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    FlopCountAnalysis(watched(Net()), image(), cache_dir=elsewhere).total()
    assert len(entries(elsewhere)) == 1 and not entries(cache_env)
    model = watched(Net())
    assert ActivationCountAnalysis(model, image(), cache_dir=str(elsewhere)).total() > 0
    assert runs(model) == 0
    FlopCountAnalysis(Net(), image(), cache=False, cache_dir=elsewhere).total()
    assert cache_info(elsewhere)["entries"] == 1


def test_registered_handles_are_counted_and_not_kept(cache_env: Path, counted: list[int]) -> None:
    """A formula given with ``register_handle`` is code the key cannot see: a kept result is neither read nor kept
    while one is in place."""
    expected = analyze(Net(), image(), cache=True).result()
    modelmeter.register_handle("aten::linear", lambda inputs, outputs: 1000, convention="fvcore")
    try:
        result = analyze(Net(), image(), cache=True).result()
    finally:
        modelmeter.unregister_handle("aten::linear", convention="fvcore")
    assert result.row("fc").metrics["flops"] == 1000 != expected.row("fc").metrics["flops"]
    assert len(counted) == 2 and len(results(cache_env)) == 1
    assert repr(analyze(Net(), image(), cache=True).result()) == repr(expected) and len(counted) == 2


def test_a_device_file_that_changes_counts_again(cache_env: Path, tmp_path: Path) -> None:
    """A device given as a file is keyed by what the file says when the result is made, not by its path."""
    device_file = tmp_path / "gpu.json"

    def describe(bandwidth: float) -> None:
        device_file.write_text(json.dumps({"devices": {"gpu": {
            "label": "a test GPU", "memory": 1e9, "bandwidth": bandwidth, "source": "this test",
            "matrix": {"fp32": 1e12}, "vector": {"fp32": 1e12}}}}))

    describe(1e12)
    fast = analyze(Net(), image(), cache=True, device=str(device_file)).result()
    describe(1e9)
    slow = analyze(Net(), image(), cache=True, device=str(device_file)).result()
    fresh = analyze(Net(), image(), cache=False, device=str(device_file)).result()
    assert slow.roofline["time"]["total"] == fresh.roofline["time"]["total"] > fast.roofline["time"]["total"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "valid gzip, wrong json", "another key"])
def test_a_damaged_entry_is_discarded_recomputed_and_rewritten(cache_env: Path, damage: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    expected = analyze(watched(Net()), image(), cache=True).flops.by_module_and_operator()
    (path,) = entries(cache_env)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "valid gzip, wrong json":
        path.write_bytes(gzip.compress(b'{"format": "modelmeter-trace-cache-entry", "trace": [1, 2]}'))
    else:
        entry = json.loads(gzip.decompress(data))
        entry["key"] = "0" * 64
        path.write_bytes(gzip.compress(json.dumps(entry).encode()))
    model = watched(Net())
    with caplog.at_level(logging.WARNING, logger="modelmeter.cache"):
        again = analyze(model, image(), cache=True)
    assert runs(model) == 1 and not again.from_cache
    assert again.flops.by_module_and_operator() == expected
    assert any("damaged trace cache entry" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert entries(cache_env) == [path]
    assert path.read_bytes() == data  # rewritten, byte for byte what the first run wrote
    model = watched(Net())
    assert analyze(model, image(), cache=True).from_cache and runs(model) == 0


def test_an_unusable_cache_never_fails_the_analysis(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        flops = FlopCountAnalysis(Net(), image(), cache_dir=blocked / "cache")
        assert flops.total() > 0
    # a trace value that JSON cannot hold: used, not stored, with a warning
    cache = TraceCache(tmp_path / "ok")
    odd = Trace(events=[OpEvent("aten::odd", "dispatch", -1, 0, "forward", [object()], [])], scopes=[()])
    with caplog.at_level(logging.WARNING, logger="modelmeter.cache"):
        assert cache.store("a" * 64, odd) is False
    assert any("Cannot cache this trace" in r.getMessage() for r in caplog.records)
    assert cache.info()["entries"] == 0


def test_runs_that_fell_back_to_real_kernels_are_not_stored(cache_env: Path) -> None:
    class NeedsValues(nn.Module):  # reads a value that depends on a weight (inputs' own values are known)
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[: int((x.sum() * self.scale).item() > 0) + 1] * 2

    model = watched(NeedsValues())
    analysis = analyze(model, torch.ones(3, 2), cache=True)
    assert analysis.trace.execution == "real" and runs(model) >= 1
    assert not entries(cache_env)
    model = watched(NeedsValues())
    assert not analyze(model, torch.ones(3, 2), cache=True).from_cache and runs(model) >= 1
    real = analyze(watched(NeedsValues()), torch.ones(3, 2), execution="real", cache=True)
    assert real.trace.execution == "real" and len(entries(cache_env)) == 1  # keyed by values: stored
    model = watched(NeedsValues())
    assert analyze(model, torch.ones(3, 2), execution="real", cache=True).from_cache and runs(model) == 0
    model = watched(NeedsValues())
    assert not analyze(model, -torch.ones(3, 2), execution="real", cache=True).from_cache and runs(model) == 1


def test_least_recently_used_entries_are_evicted(tmp_path: Path) -> None:
    cache = TraceCache(tmp_path / "lru")
    traces = {str(c) * 64: FlopCountAnalysis(Net(channels=c), image()).trace for c in (1, 2, 3, 4)}
    names = list(traces)
    for i, name in enumerate(names[:3]):
        assert cache.store(name, traces[name])
        os.utime(cache.entry_path(name), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # 1 s apart, oldest first
    size = max(os.path.getsize(cache.entry_path(n)) for n in names[:3])
    assert cache.load(names[0]) is not None  # a hit makes the oldest the most recently used
    cache.size_limit = 3 * size + size // 2  # room for three entries
    assert cache.store(names[3], traces[names[3]])
    assert cache.load(names[1]) is None  # the least recently used went
    assert all(cache.load(n) is not None for n in (names[0], names[2], names[3]))
    assert cache.info()["entries"] == 3 and cache.info()["bytes"] <= cache.size_limit
    cache.size_limit = 0
    assert cache.evict() == 3 and cache.info()["entries"] == 0
    assert cache.store(names[0], traces[names[0]]) is False  # nothing is kept under a limit of 0


def test_size_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert cache_info()["limit"] == 1 << 30
    monkeypatch.setenv("MODELMETER_CACHE_SIZE", "200M")
    assert cache_info()["limit"] == 200 << 20
    monkeypatch.setenv("MODELMETER_CACHE_SIZE", "nonsense")
    with caplog.at_level(logging.WARNING, logger="modelmeter.cache"):
        assert cache_info()["limit"] == 1 << 30
    assert "MODELMETER_CACHE_SIZE" in caplog.text
    assert [parse_size(v) for v in (0, "1024", "64k", "1.5GiB", "2 MB")] == [0, 1024, 65536, 3 << 29, 2 << 20]
    with pytest.raises(ValueError):
        parse_size("-1")
    assert TraceCache(size_limit="1K").size_limit == 1024


def test_cache_info_and_clear(cache_env: Path) -> None:
    assert cache_info() == {"path": str(cache_env / "traces"), "entries": 0, "bytes": 0, "limit": 1 << 30}
    analyze(Net(), image(), cache=True)
    analyze(Net(p=0.2), image(), cache=True)
    info = cache_info()
    assert info["entries"] == 2 and info["bytes"] == sum(p.stat().st_size for p in entries(cache_env))
    assert clear_cache() == 2
    assert cache_info()["entries"] == 0 and clear_cache() == 0
    assert not [p for p in (cache_env / "traces").iterdir()]  # no lock or temporary files left either


CONCURRENT = """
import json, os, sys, time
import torch
from torch import nn
import modelmeter

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        time.sleep(0.5)  # keep the others waiting on the lock
        return self.fc(x).relu()

ready = sys.argv[1]
open(os.path.join(ready, str(os.getpid())), "w").close()
deadline = time.time() + 60
while len(os.listdir(ready)) < int(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.01)
a = modelmeter.analyze(Slow(), torch.randn(2, 16), cache=True)
print(json.dumps({"flops": a.flops.total(), "acts": a.activations.total(), "cached": a.from_cache}))
"""


def test_concurrent_processes_share_one_entry(tmp_path: Path, cache_env: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(CONCURRENT)
    ready = tmp_path / "ready"
    ready.mkdir()
    n = 4
    env = {**os.environ, "MODELMETER_CACHE": str(cache_env)}
    procs = [subprocess.Popen([sys.executable, str(script), str(ready), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({(o["flops"], o["acts"]) for o in outputs}) == 1
    assert outputs[0]["flops"] == 2 * 16 * 16
    assert sum(not o["cached"] for o in outputs) == 1  # one process ran the model; the others waited and read
    assert len(entries(cache_env)) == 1
    assert [p.name for p in (cache_env / "traces").iterdir() if p.name.startswith(".tmp")] == []


# --- results kept beside the trace (issue 20) --------------------------------------------------------------
class Odd(nn.Module):
    """A model with an operator no handle counts (an FFT) and a module that never runs: the warnings a kept result
    must log as counting does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.fc(x)).real.sum(-1)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often ``Analysis.result()`` counted (built a result from the views' statistics) instead of reading one."""
    import modelmeter.analysis

    calls: list[int] = []
    build = modelmeter.analysis.build_result

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(modelmeter.analysis, "build_result", counting)
    return calls


RICH = {"backward": True, "memory": True, "optimizer": "adamw", "device": "h100", "efficiency": 0.5,
        "quiet": True}


def test_a_kept_result_is_read_instead_of_counted_and_equals_a_fresh_count_exactly(cache_env: Path,
                                                                                   counted: list[int]) -> None:
    fresh = analyze(*transformer_block(), cache=False, **RICH).result()  # the oracle: counted from a new recording
    counted.clear()
    block, x = transformer_block()
    first = analyze(block, x, cache=True, **RICH).result()
    assert counted == [1] and len(results(cache_env)) == 1
    again, y = transformer_block()  # a new identical model: the disk cache, not the in-process recording
    analysis = analyze(again, y, cache=True, **RICH)
    kept = analysis.result()
    assert analysis.from_cache and counted == [1]  # read, not counted
    assert repr(kept) == repr(fresh) == repr(first)  # every field, its types too (1 is not 1.0, a list no tuple)
    assert kept.to_json() == fresh.to_json()
    assert analysis.result() is not kept  # each call its own object: changing one changes no other
    kept.modules[0].metrics["flops"] = -1
    assert analysis.result().total("flops") == fresh.total("flops")


def test_an_analysis_sharing_a_recording_reads_and_keeps_results_beside_its_trace(cache_env: Path,
                                                                                 counted: list[int]) -> None:
    """A second analysis of the same call takes the first one's recording in-process: it reads and keeps results
    beside the disk entry that recording was stored in (or, when the first analysis did not use the cache, the
    entry of its key, if there is one), as a disk hit would."""
    flops = {**RICH, "convention": "flops"}
    fresh = analyze(*transformer_block(), cache=False, **RICH).result()  # the oracle: counted from a new recording
    fresh_flops = analyze(*transformer_block(), cache=False, **flops).result()
    counted.clear()
    block, x = transformer_block()
    first = analyze(block, x, cache=True, **RICH)
    assert repr(first.result()) == repr(fresh) and counted == [1] and len(results(cache_env)) == 1
    second = analyze(block, x, cache=True, **RICH)
    assert second.trace is first.trace and not second.from_cache  # shared in-process, not read from the disk
    assert repr(second.result()) == repr(fresh) and counted == [1]  # read, not counted
    other = analyze(block, x, cache=True, **flops)
    assert other.trace is first.trace and repr(other.result()) == repr(fresh_flops)
    assert counted == [1, 1] and len(results(cache_env)) == 2  # counted once, and kept beside the same entry
    assert repr(analyze(block, x, cache=True, **flops).result()) == repr(fresh_flops) and counted == [1, 1]

    uncached, y = transformer_block()  # recorded without the cache, then shared with an analysis using it
    assert analyze(uncached, y, cache=False, **RICH).trace is analyze(uncached, y, cache=True, **RICH).trace
    assert repr(analyze(uncached, y, cache=True, **RICH).result()) == repr(fresh) and counted == [1, 1]

    clear_cache()  # no entry to find: the result is counted, and not kept
    unkept, z = transformer_block()
    assert analyze(unkept, z, cache=False, **RICH).trace.events
    assert repr(analyze(unkept, z, cache=True, **RICH).result()) == repr(fresh) and counted == [1, 1, 1]
    assert results(cache_env) == []


@pytest.mark.parametrize("change", [
    {"convention": "flops"}, {"dense_attention": True}, {"attention_kernel": "math"},
    {"memory": False, "optimizer": None}, {"optimizer": "sgd"}, {"state_dtype": "bfloat16"}, {"foreach": True},
    {"device": "a100"}, {"device": None, "efficiency": 1.0}, {"efficiency": 0.7}, {"launch_overhead": 1e-6},
    {"tf32": True}, {"measured_time": 0.01},
])
def test_changed_settings_count_again(cache_env: Path, counted: list[int], change: dict[str, Any]) -> None:
    settings = {**RICH, **change}
    oracle = analyze(*transformer_block(), cache=False, **settings).result()
    analyze(*transformer_block(), cache=True, **RICH).result()
    counted.clear()
    analysis = analyze(*transformer_block(), cache=True, **settings)
    result = analysis.result()
    assert analysis.from_cache and counted == [1]  # the trace from the cache, the result counted
    assert repr(result) == repr(oracle)
    assert len(results(cache_env)) == 2  # kept beside the first one
    assert repr(analyze(*transformer_block(), cache=True, **settings).result()) == repr(result) and counted == [1]


def test_another_name_or_another_source_counts_again(cache_env: Path, counted: list[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    analyze(Net(), image(), cache=True).result()
    assert analyze(Net(), image(), cache=True).result(name="Renamed").model == "Renamed" and len(counted) == 2
    monkeypatch.setattr(modelmeter.session, "package_digest", lambda *_: "edited")  # a development checkout, edited
    analyze(Net(), image(), cache=True).result()
    assert len(counted) == 3 and len(results(cache_env)) == 3
    analyze(Net(), image(), cache=True).result()
    assert len(counted) == 3


def test_custom_handles_and_ancestor_modes_are_counted_and_not_kept(cache_env: Path, counted: list[int]) -> None:
    expected = analyze(Net(), image(), cache=True).result()
    assert len(results(cache_env)) == 1
    custom = analyze(Net(), image(), cache=True)
    custom.flops.set_op_handle("aten::linear", lambda inputs, outputs: 1000)
    result = custom.result()
    assert custom.from_cache and result.total("flops") != expected.total("flops")
    assert result.row("fc").metrics["flops"] == 1000
    caller = analyze(Net(), image(), cache=True)
    caller.activations.ancestor_mode("caller")
    caller.result()
    cleared = analyze(Net(), image(), cache=True)
    cleared.flops.clear_op_handles()
    assert cleared.result().total("flops") == 0
    assert len(counted) == 4 and len(results(cache_env)) == 1  # each counted, none kept
    assert repr(analyze(Net(), image(), cache=True).result()) == repr(expected) and len(counted) == 4


@pytest.mark.parametrize("damage", ["truncate", "garbage", "valid gzip, wrong json", "another key",
                                    "another trace entry", "wrong fields", "wrong types", "a row of other fields",
                                    "a row not a dict", "a row's field of another type"])
def test_a_damaged_or_stale_result_is_counted_again_and_replaced(cache_env: Path, counted: list[int], damage: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    expected = analyze(Net(), image(), cache=True).result()
    (path,) = results(cache_env)
    data = path.read_bytes()
    kept = json.loads(gzip.decompress(data))
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "valid gzip, wrong json":
        path.write_bytes(gzip.compress(b'{"format": "modelmeter-result-cache-entry", "result": [1, 2]}'))
    else:
        if damage == "another key":
            kept["key"] = "0" * 64
        elif damage == "another trace entry":  # counted from a trace entry that has since been replaced
            kept["entry"] = "0" * 64
        elif damage == "wrong fields":
            del kept["result"]["device"]
        elif damage == "a row of other fields":
            kept["result"]["modules"][-1]["extra"] = 1
        elif damage == "a row not a dict":
            kept["result"]["modules"][-1] = [1, 2]
        elif damage == "a row's field of another type":
            kept["result"]["modules"][-1]["called"] = 1  # a number where a bool belongs
        else:
            kept["result"]["model"] = 7  # the model's name, a number
        path.write_bytes(gzip.compress(json.dumps(kept).encode()))
    counted.clear()
    with caplog.at_level(logging.INFO, logger="modelmeter"):
        result = analyze(Net(), image(), cache=True).result()
    assert counted == [1] and repr(result) == repr(expected)
    assert caplog.records and all(r.levelno <= logging.WARNING for r in caplog.records)
    assert results(cache_env) == [path] and path.read_bytes() == data  # replaced by what the first run wrote
    assert repr(analyze(Net(), image(), cache=True).result()) == repr(expected) and counted == [1]


def test_a_replaced_trace_entry_is_not_read_with_the_old_result(cache_env: Path, counted: list[int]) -> None:
    analyze(Net(), image(), cache=True).result()
    (entry,) = entries(cache_env)
    entry.write_bytes(gzip.compress(gzip.decompress(entry.read_bytes()), compresslevel=1))  # same trace, new bytes
    analysis = analyze(Net(), image(), cache=True)
    analysis.result()
    assert analysis.from_cache and len(counted) == 2  # the result of the former entry is not this one's


def test_a_kept_result_logs_the_warnings_counting_logs_once(cache_env: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    def messages(cache: bool) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="modelmeter"):
            analysis = analyze(Odd(), torch.randn(2, 8), cache=cache)
            analysis.result()
            analysis.result()
            analysis.flops.total()
        return [r.getMessage() for r in caplog.records]

    expected = messages(cache=False)
    assert len(expected) == 2 and "aten::fft_rfft" in expected[0] and "unused" in expected[1]
    assert messages(cache=True) == expected  # counted, and kept
    assert messages(cache=True) == expected  # read: the same warnings, once


def test_cache_info_and_clear_count_kept_results(cache_env: Path) -> None:
    analyze(Net(), image(), cache=True).result()
    analyze(Net(), image(), cache=True, convention="flops").result()
    info = cache_info()
    files = [*entries(cache_env), *results(cache_env)]
    assert info["entries"] == 1 and len(results(cache_env)) == 2
    assert info["bytes"] == sum(p.stat().st_size for p in files)
    assert clear_cache() == 1 and not [p for p in (cache_env / "traces").iterdir()]


def test_eviction_removes_a_trace_with_its_results(tmp_path: Path) -> None:
    root = tmp_path / "c"
    analyze(Net(), image(), cache_dir=root).result()
    time.sleep(0.05)
    analyze(Net(p=0.3), image(), cache_dir=root).result()
    _, second = sorted(entries(root), key=lambda p: p.stat().st_mtime_ns)
    kept = {p: p.stat().st_size for p in [*entries(root), *results(root)]}
    cache = TraceCache(root, size_limit=sum(kept.values()) - 1)
    assert cache.evict() == 2  # the oldest trace, and its result with it
    assert entries(root) == [second] and [p.name[:64] for p in results(root)] == [second.name[:64]]


def test_eviction_of_a_result_older_than_its_trace_removes_that_result_alone(cache_env: Path) -> None:
    """A hit with other settings refreshes the trace and keeps a second result: the first result is then the
    oldest file, and goes alone."""
    analyze(Net(), image(), cache=True).result()
    analyze(Net(), image(), cache=True, convention="macs").result()
    (entry,), (first, second) = entries(cache_env), sorted(results(cache_env), key=lambda p: p.stat().st_mtime_ns)
    for age, path in enumerate((first, entry, second)):
        os.utime(path, ns=(10**18 + age * 10**9,) * 2)
    sizes = [p.stat().st_size for p in (first, entry, second)]
    assert TraceCache(cache_env, size_limit=sum(sizes) - 1).evict() == 1
    assert entries(cache_env) == [entry] and results(cache_env) == [second]


# --- serialization ----------------------------------------------------------------------------------------
def exact(a: Any, b: Any) -> bool:
    """Equal values of identical types all the way down (NaN equals NaN, -0.0 differs from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return exact(a.real, b.real) and exact(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(exact(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(exact(a[k], b[k]) for k in a)
    if isinstance(a, (Trace, OpEvent, TensorMeta)):
        return all(exact(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return bool(a == b)


def round_trip(trace: Trace) -> Trace:
    data = trace_to_dict(trace)
    text = json.dumps(data, allow_nan=False)  # plain JSON, nothing Python-specific
    back = trace_from_dict(json.loads(text))
    assert exact(loads(dumps(trace)), back) and exact(loads(dumps(trace, compress=False)), back)
    return back


metas = st.builds(TensorMeta, st.lists(st.integers(0, 2**40), max_size=5).map(tuple),
                  st.sampled_from(["float32", "bfloat16", "int64", "complex64", "bool"]),
                  st.sampled_from(["cpu", "meta", "cuda:0"]))
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.complex_numbers(allow_nan=True, allow_infinity=True) | st.text(max_size=8) | metas)
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3)
                   | st.frozensets(st.text(max_size=4), max_size=3)),
    max_leaves=12,
)


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    scopes = [(), *draw(st.lists(st.lists(st.text(max_size=6), min_size=1, max_size=3).map(tuple), max_size=3))]
    events = []
    for i in range(draw(st.integers(0, 6))):
        events.append(OpEvent(
            op=draw(st.text(max_size=12)), level=draw(st.sampled_from(["function", "dispatch"])),
            parent=draw(st.integers(-1, i - 1)), scope=draw(st.integers(0, len(scopes) - 1)),
            phase=draw(st.sampled_from(["forward", "backward"])),
            inputs=draw(st.lists(values, max_size=4)), outputs=draw(st.lists(values, max_size=3)),
            kwargs=draw(st.dictionaries(st.text(max_size=6), values, max_size=3))))
    return Trace(events=events, scopes=scopes, called=draw(st.sets(st.text(max_size=6), max_size=4)),
                 assumptions=draw(st.lists(st.text(max_size=20), max_size=2)),
                 execution=draw(st.sampled_from(["fake", "real"])), inputs=draw(st.lists(metas, max_size=3)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_serialization_round_trip_is_exact(trace: Trace) -> None:
    assert exact(round_trip(trace), trace)


def test_serialization_rejects_what_it_cannot_write_or_read() -> None:
    with pytest.raises(TypeError):
        trace_to_dict(Trace(events=[OpEvent("x", "dispatch", -1, 0, "forward", [torch.zeros(1)], [])], scopes=[()]))
    good = trace_to_dict(Trace(events=[OpEvent("x", "dispatch", -1, 0, "forward", [1], [])], scopes=[()],
                               storages=[Storage(8, "float32", "cpu", "input")]))
    fields = list(dataclasses.fields(OpEvent))
    column = {f.name: i for i, f in enumerate(fields)}

    def packed(numbers: list[Any]) -> list[str]:
        """A column as the format writes it: 64-bit little-endian integers, base64."""
        return ["q", base64.b64encode(struct.pack(f"<{len(numbers)}q", *numbers)).decode()]

    def unpacked(data: list[str]) -> list[int]:
        raw = base64.b64decode(data[1])
        return list(struct.unpack(f"<{len(raw) // struct.calcsize(data[0])}{data[0]}", raw))

    inputs, outputs, kwargs = (unpacked(good["events"][column[name]])[0] for name in ("inputs", "outputs", "kwargs"))

    def numbers(value: Any) -> bool:
        return type(value) is list and all(type(n) is int for n in value)

    def event(**changes: Any) -> list[Any]:
        """The one event's columns, some replaced (lists of numbers are packed, anything else is written as given)."""
        return [packed(changes[f.name]) if numbers(changes.get(f.name)) else changes.get(f.name, good["events"][i])
                for i, f in enumerate(fields)]

    def storage(**changes: Any) -> list[Any]:
        return [packed(changes[f.name]) if f.name in changes else good["storages"][i]
                for i, f in enumerate(dataclasses.fields(Storage))]

    assert trace_from_dict({**good, "events": event(parent=[-1], python=[0])}).events[0].python is False  # oracle
    for broken in (
        {**good, "version": 999},
        {**good, "version": 5},  # an entry of the format before the columns
        {**good, "format": "pickle"},
        {**good, "events": event(parent=[5])},  # parent after itself
        {**good, "events": event(parent=[0])},  # parent is itself
        {**good, "events": event(origin=[3])},
        {**good, "events": event(scope=[1])},  # no such scope
        {**good, "events": event(level=[len(good["strings"])])},  # no such string
        {**good, "strings": [*good["strings"][:-1], "sideways"]},  # a storage kind that does not exist
        {**good, "strings": [*good["strings"][:-1], 7]},
        {**good, "values": [[{"$py/object": "os.system"}], *good["values"][1:]]},
        {**good, "events": event(inputs=[99])},  # refers to no value
        {**good, "events": event(inputs=[-1])},
        {**good, "events": event(inputs=[kwargs])},  # inputs that are a dict
        {**good, "events": event(kwargs=[inputs])},  # kwargs that are a list
        {**good, "events": event(python=[2])},  # a boolean neither 0 nor 1
        {**good, "events": event(outputs=["d", packed([outputs])[1]])},  # not an integer type
        {**good, "events": event(outputs=["q", "not base64!"])},
        {**good, "events": event(outputs=["q", "AAAA"])},  # 3 bytes: not a whole 8-byte item
        {**good, "events": event(outputs=["q", packed([outputs])[1], "more"])},
        {**good, "events": event(outputs=[[outputs]])},  # numbers unpacked, as format 5 wrote them
        {**good, "events": event(outputs=3)},
        {**good, "events": event(op=[])},  # columns of different lengths
        {**good, "events": event()[:-1]},  # a column short
        {**good, "events": good["events"][0]},
        {**good, "storages": storage(nbytes=[-1])},
        {**good, "storages": storage(died=[2])},  # after the run's last event
        {**good, "storages": storage(saved_scope=[1])},
        {**good, "storages": storage(kind=[0])},  # a storage of kind "x"
        {key: value for key, value in good.items() if key != "values"},
        {key: value for key, value in good.items() if key != "storages"},
        {**good, "fields": {**good["fields"], "scopes": [["not a tuple"]]}},
        {**good, "fields": {**good["fields"], "storages": []}},  # a columnar field among the plain ones
        [1, 2, 3],
    ):
        with pytest.raises(ValueError):
            trace_from_dict(broken)
    with pytest.raises(ValueError):
        loads(b"\x1f\x8b garbage")
    text = json.dumps(good)
    for bad in ('{"$py/object": "os.system"}', '{"$d": [[[1, 2], 3]]}', '{"$m": [{"$t": ["x"]}, "f", "cpu"]}',
                '{"$f": "1e999"}', '{"$c": [1, 2]}'):
        with pytest.raises(ValueError):
            loads(text.replace("[1]", f"[{bad}]").encode())
    assert loads(text.encode()).events[0].inputs == [1]


def test_dicts_are_plain_objects_unless_they_could_read_as_a_tag() -> None:
    odd = [{"a": 1}, {"$t": [1]}, {"$t": 1, "b": (2,)}, {1: "x"}, {}]
    trace = Trace(events=[OpEvent("x", "dispatch", -1, 0, "forward", [], [], kwargs=d) for d in odd], scopes=[()])
    data = trace_to_dict(trace)
    assert {"a": 1} in data["values"] and {"$t": 1, "b": {"$t": [2]}} in data["values"]
    assert {"$d": [["$t", [1]]]} in data["values"] and {"$d": [[1, "x"]]} in data["values"]
    for back in (loads(dumps(trace)), trace_from_dict(json.loads(json.dumps(data)))):
        assert [e.kwargs for e in back.events] == odd and exact(back, trace)


def test_every_field_of_events_and_storages_has_a_column() -> None:
    assert tuple(serialize._EVENT_COLUMNS) == tuple(f.name for f in dataclasses.fields(OpEvent))
    assert tuple(serialize._STORAGE_COLUMNS) == tuple(f.name for f in dataclasses.fields(Storage))


def test_equal_arguments_are_written_once_and_read_as_each_events_own() -> None:
    """The values table: a repeated argument description is stored once; every event reads its own list."""
    meta = TensorMeta((2, 3), "float32", "cpu")
    events = [OpEvent("aten::relu", "dispatch", -1, 0, "forward", [meta], [meta]) for _ in range(50)]
    trace = Trace(events=events, scopes=[()])
    data = trace_to_dict(trace)
    assert len(data["values"]) == 2  # [meta] and {} (the kwargs)
    back = loads(dumps(trace))
    assert exact(back, trace)
    back.events[0].inputs.append(1)
    assert back.events[1].inputs == [meta]


def transformer_block() -> tuple[nn.Module, torch.Tensor]:
    block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True).eval()
    return block, torch.randn(2, 10, 32)


@pytest.mark.parametrize("build", ["resnet18", "transformer block"])
def test_real_traces_round_trip_to_identical_counts(build: str) -> None:
    if build == "resnet18":
        model: nn.Module = torchvision.models.resnet18().eval()
        x = torch.randn(1, 3, 224, 224)
    else:
        model, x = transformer_block()
    flops = FlopCountAnalysis(model, x)
    back = round_trip(flops.trace)
    assert exact(back, flops.trace)
    for cls in (FlopCountAnalysis, ActivationCountAnalysis):
        original = cls(model, x, trace=flops.trace)
        copy = cls(model, x, trace=back)
        for mode in ("owner", "caller"):
            original.ancestor_mode(mode), copy.ancestor_mode(mode)
            assert copy.by_module_and_operator() == original.by_module_and_operator()
            assert copy.unsupported_ops() == original.unsupported_ops()
            assert copy.uncalled_modules() == original.uncalled_modules()


# --- a trace read back is made on first read (issue 20) ---------------------------------------------------
# A hit makes its trace's events and storages only when something reads them: a hit with a result kept beside the
# trace makes none, and what is made equals the recording, field by field, and counts what the recording counts
# (results compared by ``repr``, every field and its type).
@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often a trace read back made its events and storages."""
    calls: list[int] = []
    make = serialize._Records.__call__

    def counting(self: Any) -> Any:
        calls.append(1)
        return make(self)

    monkeypatch.setattr(serialize._Records, "__call__", counting)
    return calls


def _cnn() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    return model, torch.randn(2, 3, 16, 16)


def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(4, 16)


def _tiny_llama() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return _llama()


TRAINING = {"backward": True, "memory": True, "optimizer": "adamw", "device": "h100", "quiet": True}
CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], dict[str, Any]]] = {
    "attention, a training step": (transformer_block, TRAINING),
    "llama, backward and memory": (_tiny_llama, {"backward": True, "memory": True, "quiet": True}),
    "cnn, inference memory": (_cnn, {"memory": True, "device": "a100", "quiet": True}),
    # No device: a roofline counted in this process before the plan's run would fail it (the FSDP operators' byte
    # formulas bound before torch.distributed registers their schemas; a failure of its own, not the cache's).
    "parallel plan": (_mlp, {"backward": True, "memory": True, "optimizer": "adamw", "quiet": True,
                             "parallel": "fsdp=2"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hit_makes_no_events_for_a_kept_result_and_counts_what_a_recording_counts(cache_env: Path, made: list[int],
                                                                                     case: str) -> None:
    build, settings = CASES[case]
    other = {**settings, "convention": "flops"}  # a result not kept: counted from the trace read back
    fresh = analyze(*build(), cache=False, **settings)  # the oracle: a recording, no cache
    expected, expected_other = repr(fresh.result()), repr(analyze(*build(), cache=False, **other).result())
    first = analyze(*build(), cache=True, **settings)
    assert not first.from_cache and repr(first.result()) == expected  # recorded, stored, its result kept
    hit = analyze(*build(), cache=True, **settings)  # a new model: the disk cache, not the in-process recording
    assert hit.from_cache and repr(hit.result()) == expected
    assert made == []  # the kept result needed no events
    assert repr(analyze(*build(), cache=True, **other).result()) == expected_other and made == [1]
    assert hit.trace == fresh.trace and made == [1, 1]
    assert_same_trace(hit.trace, fresh.trace)


def _small_trace() -> Trace:
    meta = TensorMeta((2, 3), "float32", "cpu")
    events = [OpEvent("aten::relu", "dispatch", -1, 0, "forward", [meta], [meta]),
              OpEvent("aten::add", "dispatch", -1, 0, "backward", [meta, 1.5], [meta], {"alpha": 2}, origin=0)]
    return Trace(events=events, scopes=[()], storages=[Storage(24, "float32", "cpu", "input"),
                                                       Storage(24, "float32", "cpu", "activation", born=0, died=2)],
                 backward=True, model="Toy")


def test_a_deferred_trace_behaves_as_the_trace_it_was_read_from(made: list[int]) -> None:
    trace = _small_trace()
    back = loads(dumps(trace))
    assert back.size("events") == 2 and back.size("storages") == 2 and back.size("scopes") == 1 and made == []
    assert back.model == "Toy" and made == []  # fields that were never deferred
    assert back == trace and repr(back) == repr(trace) and made == [1]
    assert back.size("events") == 2 and back.events[1].kwargs == {"alpha": 2}
    for other in (copy.copy(loads(dumps(trace))), copy.deepcopy(loads(dumps(trace))),
                  pickle.loads(pickle.dumps(loads(dumps(trace)))),
                  dataclasses.replace(loads(dumps(trace)), model="Toy")):
        assert other == trace
    assert dataclasses.asdict(loads(dumps(trace))) == dataclasses.asdict(trace)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = loads(dumps(trace)).nothing  # type: ignore[attr-defined]
    assert not hasattr(back, "nothing") and getattr(loads(dumps(trace)), "nothing", 7) == 7


def test_a_field_assigned_before_the_deferred_ones_are_made_keeps_its_value(made: list[int]) -> None:
    trace = _small_trace()
    back = loads(dumps(trace))
    back.events = trace.events[:1]
    assert back.size("events") == 1 and back.size("storages") == 2 and made == []
    assert back.storages == trace.storages and made == [1]
    assert back.events == trace.events[:1]


def test_a_damaged_column_is_found_when_the_entry_is_read_not_when_a_metric_reads_it() -> None:
    data = serialize.trace_to_dict(_small_trace())
    origin = [f.name for f in dataclasses.fields(OpEvent)].index("origin")
    data["events"][origin] = serialize._packed([-1, 1])  # the second event's origin is itself
    with pytest.raises(ValueError, match="origin is not an earlier event"):
        serialize.trace_from_dict(data)


# --- the command ------------------------------------------------------------------------------------------
def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def test_cli_caches_by_default(capsys: pytest.CaptureFixture[str], cache_env: Path, counted: list[int]) -> None:
    first = run(capsys, "gpt2_tiny", "--depth", "1")
    assert "from the cache" not in first.splitlines()[0]
    assert len(entries(cache_env)) == 1 and len(results(cache_env)) == 1 and counted == [1]
    second = run(capsys, "gpt2_tiny", "--depth", "1")
    assert "(fake run, from the cache," in second.splitlines()[0]
    assert first.splitlines()[1:] == second.splitlines()[1:] and counted == [1]  # the result read, not counted
    assert run(capsys, "gpt2_tiny", "--depth", "1", "--convention", "flops") != second and counted == [1, 1]
    info = json.loads(run(capsys, "cache", "info", "--format", "json"))
    assert info["entries"] == 1 and info["path"] == str(cache_env / "traces") and info["bytes"] > 0
    assert "entries:     1" in run(capsys, "cache", "info")
    assert run(capsys, "cache", "clear").startswith("removed 1 cached trace from")
    assert json.loads(run(capsys, "cache", "info", "--format", "json"))["entries"] == 0


def test_cli_no_cache_and_cache_dir(capsys: pytest.CaptureFixture[str], cache_env: Path, tmp_path: Path) -> None:
    run(capsys, "gpt2_tiny", "--depth", "0", "--no-cache")
    assert not cache_env.exists() or not entries(cache_env)
    other = tmp_path / "other"
    run(capsys, "gpt2_tiny", "--depth", "0", "--cache-dir", str(other))
    assert len(entries(other)) == 1 and not entries(cache_env)
    assert "from the cache" in run(capsys, "gpt2_tiny", "--depth", "0", "--cache-dir", str(other)).splitlines()[0]
    assert json.loads(run(capsys, "cache", "clear", "--cache-dir", str(other), "--format", "json"))["removed"] == 1
    assert main(["cache", "wipe"]) == 2
    assert "usage: modelmeter cache info|clear" in capsys.readouterr().err


# --- the key covers the user's code: helper modules, constants, closures (issue 16) ---------------------
# Each scenario: helper files (formatted with the repeat count n) and a model file; the model's flops scale with
# n, so a stale entry shows as the old count. A subprocess runs every scenario with the cache (and once without,
# the oracle), so edited files are imported afresh, as a user would meet them.
HELPER_SCENARIOS: dict[str, tuple[dict[str, str], str]] = {
    "function imported by name": (
        {"h": "import torch\ndef act(x):\n    return torch.cat([x] * {n})\n"},
        "from {h} import act\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc(act(x))\n"),
    "function called through its module": (
        {"h": "import torch\ndef post(x):\n    return torch.cat([x] * {n})\n"},
        "import {h}\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc({h}.post(x))\n"),
    "module-level constant of the helper": (
        {"h": "import torch\nREPEAT = {n}\ndef act(x):\n    return torch.cat([x] * REPEAT)\n"},
        "from {h} import act\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc(act(x))\n"),
    "constant read through the module": (
        {"h": "REPEAT = {n}\n"},
        "import torch, {h}\n\nclass M(Base):\n    def forward(self, x):\n"
        "        return self.fc(torch.cat([x] * {h}.REPEAT))\n"),
    "nested container constant": (
        {"h": "CONF = {{'repeat': [1, {n}]}}\n"},
        "import torch, {h}\n\nclass M(Base):\n    def forward(self, x):\n"
        "        return self.fc(torch.cat([x] * {h}.CONF['repeat'][1]))\n"),
    "default argument": (
        {"h": "import torch\ndef act(x, n={n}):\n    return torch.cat([x] * n)\n"},
        "from {h} import act\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc(act(x))\n"),
    "closure variable": (
        {"h": "import torch\ndef make(n):\n    def act(x):\n        return torch.cat([x] * n)\n    return act\n"
              "act = make({n})\n"},
        "from {h} import act\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc(act(x))\n"),
    "class attribute of a helper class": (
        {"h": "class Cfg:\n    repeat = {n}\n"},
        "import torch\nfrom {h} import Cfg\n\nclass M(Base):\n    def forward(self, x):\n"
        "        return self.fc(torch.cat([x] * Cfg.repeat))\n"),
    "lambda": (
        {"h": "import torch\nact = lambda x: torch.cat([x] * {n})\n"},
        "from {h} import act\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc(act(x))\n"),
    "method of a base class in another file": (
        {"h": "import torch\nfrom torch import nn\nclass Expand(nn.Module):\n    def expand(self, x):\n"
              "        return torch.cat([x] * {n})\n"},
        "from {h} import Expand\n\nclass M(Base, Expand):\n    def forward(self, x):\n"
        "        return self.fc(self.expand(x))\n"),
    "helper of a helper": (
        {"h": "import {h}_inner as inner\ndef act(x):\n    return inner.act(x)\n",
         "h_inner": "import torch\ndef act(x):\n    return torch.cat([x] * {n})\n"},
        "import {h}\n\nclass M(Base):\n    def forward(self, x):\n        return self.fc({h}.act(x))\n"),
    "import inside forward": (
        {"h": "import torch\ndef act(x):\n    return torch.cat([x] * {n})\n"},
        "class M(Base):\n    def forward(self, x):\n        from {h} import act\n        return self.fc(act(x))\n"),
    "function found by a computed name": (  # static reading cannot see it: never stored
        {"h": "import torch\ndef post(x):\n    return torch.cat([x] * {n})\n"},
        "import {h}\n\nclass M(Base):\n    def forward(self, x):\n"
        "        return self.fc(getattr({h}, ''.join(['po', 'st']))(x))\n"),
}
NEVER_STORED = {"function found by a computed name"}

HELPER_RUNNER = """
import json, logging, sys, torch
from torch import nn
import modelmeter
from helper_issue import act
import helper_issue

class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

class IssueModel(Base):  # the issue's own case: a script with `from helper import act` and `helper.post(...)`
    def forward(self, x):
        return self.fc(helper_issue.post(act(x)))

models = {"the issue's script": IssueModel}
for i, name in enumerate(json.loads(sys.argv[1])):
    namespace = {"Base": Base}
    with open(f"model_{i}.py") as f:
        exec(compile(f.read(), f"model_{i}.py", "exec"), namespace)
    models[name] = namespace["M"]
out = {}
for name, cls in models.items():
    x = torch.randn(4, 16)
    oracle = modelmeter.analyze(cls(), x).flops.total()
    cached = modelmeter.analyze(cls(), x, cache=True)
    out[name] = [oracle, cached.flops.total(), cached.from_cache]
print(json.dumps(out))
"""


def _write_helpers(root: Path, n: int) -> None:
    (root / "helper_issue.py").write_text(
        f"import torch\ndef act(x):\n    return torch.cat([x] * {n})\ndef post(x):\n    return torch.cat([x] * 2)\n")
    for i, (helpers, model) in enumerate(HELPER_SCENARIOS.values()):
        h = f"helper_{i}"
        for stem, text in helpers.items():
            (root / f"{stem.replace('h', h, 1)}.py").write_text(text.format(n=n, h=h))
        (root / f"model_{i}.py").write_text(model.format(h=h))


def _run_helpers(root: Path, cache: Path) -> dict[str, list[Any]]:
    env = {**os.environ, "MODELMETER_CACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", HELPER_RUNNER, json.dumps(list(HELPER_SCENARIOS))], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_editing_user_code_or_constants_is_never_served_a_stale_count(tmp_path: Path, cache_env: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_helpers(src, 2)
    first = _run_helpers(src, cache_env)
    again = _run_helpers(src, cache_env)
    _write_helpers(src, 4)
    edited = _run_helpers(src, cache_env)
    for name in first:
        (oracle, flops, cached), (oracle2, flops2, cached2) = first[name], again[name]
        assert flops == oracle and not cached, name
        assert flops2 == oracle2 == oracle, name
        assert cached2 == (name not in NEVER_STORED), f"{name}: an unchanged setup should be served from the cache"
        oracle4, flops4, _ = edited[name]
        assert flops4 == oracle4 == 2 * oracle, f"{name}: {flops4} served where a fresh run counts {oracle4}"


SCALE = torch.ones(3)
NP_SCALE = __import__("numpy").float32(2.0)


class UsesConstants(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * SCALE.sum() * float(NP_SCALE)


def test_module_level_tensors_and_extension_scalars_are_keyed_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 3)
    base = key(UsesConstants(), x)
    assert key(UsesConstants(), x) == base
    monkeypatch.setattr(sys.modules[__name__], "SCALE", torch.full((3,), 2.0))
    assert key(UsesConstants(), x) != base
    monkeypatch.undo()
    monkeypatch.setattr(sys.modules[__name__], "NP_SCALE", __import__("numpy").float32(3.0))
    assert key(UsesConstants(), x) != base


def test_code_the_key_cannot_see_into_is_not_cached(monkeypatch: pytest.MonkeyPatch, cache_env: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import zlib

    class Native(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.checksum = zlib.adler32  # compiled code: stands in for a C extension of the user's own

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (self.checksum(b"x") % 3)

    x = torch.randn(2, 3)
    assert trace_key(RunSpec(Native(), (x,))) is not None  # zlib is installed: keyed by Python's version
    monkeypatch.setattr(zlib.adler32, "__module__", "my_native_extension")
    with caplog.at_level(logging.INFO, logger="modelmeter.cache"):
        assert trace_key(RunSpec(Native(), (x,))) is None
        analysis = analyze(Native(), x, cache=True)
    assert analysis.flops.total() == FlopCountAnalysis(Native(), x).total() and not entries(cache_env)
    assert "my_native_extension.adler32 is compiled code outside the installed packages" in caplog.text


def test_a_run_that_cannot_be_watched_is_not_stored(cache_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    def other_profiler(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.setprofile(other_profiler)
    try:
        with caplog.at_level(logging.INFO, logger="modelmeter.cache"):
            analysis = analyze(Net(), image(), cache=True)
        assert sys.getprofile() is other_profiler  # left as it was
    finally:
        sys.setprofile(None)
    assert analysis.flops.total() == FlopCountAnalysis(Net(), image()).total() and not entries(cache_env)
    assert "another profiler is active" in caplog.text
    assert analyze(Net(), image(), cache=True).trace and len(entries(cache_env)) == 1


# --- cost guards never read the cache (issue 16) -----------------------------------------------------------
GUARDED_MODEL = """
from torch import nn

def build(width=16):
    return nn.Sequential(nn.Linear(16, width))
"""


def _poison(source: Path, target: Path) -> None:
    """Put the single entry of cache ``source`` under the key of the single entry of cache ``target``."""
    (good,), (victim,) = entries(source), entries(target)
    entry = json.loads(gzip.decompress(good.read_bytes()))
    entry["key"] = victim.name.removesuffix(".json.gz")
    victim.write_bytes(gzip.compress(json.dumps(entry).encode()))


def test_cost_guards_run_the_model_and_never_read_a_poisoned_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "guarded.py").write_text(GUARDED_MODEL)
    monkeypatch.chdir(tmp_path)  # a baseline may name only files of its own project, by relative path
    spec = "guarded.py:build"
    small_cache, big_cache = tmp_path / "small", tmp_path / "big"
    small, big = [spec, "width=8", "--input", "4x16"], [spec, "--input", "4x16"]
    small_flops, big_flops = 4 * 16 * 8, 4 * 16 * 16  # hand counts (multiply-adds)

    def status(*argv: str) -> int:
        code = main(list(argv))
        capsys.readouterr()
        return code

    assert status(*small, "--cache-dir", str(small_cache)) == 0
    assert status(*big, "--cache-dir", str(big_cache)) == 0
    _poison(small_cache, big_cache)  # the big model's entry now holds the small model's trace
    poisoned = json.loads(run(capsys, *big, "--cache-dir", str(big_cache), "--format", "json"))
    assert poisoned["modules"][0]["metrics"]["flops"] == small_flops  # plain runs are served the poison

    assert status(*big, "--cache-dir", str(big_cache), "--budget", f"flops={small_flops}") == 1
    baseline = tmp_path / "baseline.json"
    assert status(*small, "--name", "m", "--save-baseline", str(baseline), "--no-cache") == 0
    assert status(*big, "--name", "m", "--cache-dir", str(big_cache), "--check-baseline", str(baseline)) == 1
    saved = tmp_path / "saved.json"
    assert status(*big, "--name", "m", "--cache-dir", str(big_cache), "--save-baseline", str(saved)) == 0
    assert status(*big, "--name", "m", "--no-cache", "--budget", f"flops={big_flops}") == 0
    assert status(*big, "--name", "m", "--no-cache", "--check-baseline", str(saved), "--tolerance", "0") == 0

    # --check-baseline FILE alone re-runs every entry: a cache poisoned the other way (a bigger trace under the
    # small model's key) would make it fail; it must pass, since the model did not change.
    fresh_big = tmp_path / "fresh-big"
    assert status(*big, "--cache-dir", str(fresh_big)) == 0
    _poison(fresh_big, small_cache)
    small_baseline = tmp_path / "small.json"
    assert status(*small, "--name", "s", "--save-baseline", str(small_baseline), "--no-cache") == 0
    assert status("--check-baseline", str(small_baseline), "--cache-dir", str(small_cache)) == 0
    served = json.loads(run(capsys, *small, "--cache-dir", str(small_cache), "--format", "json"))
    assert served["modules"][0]["metrics"]["flops"] == big_flops  # the poison is still there for plain runs


def test_assert_cost_never_reads_the_cache(tmp_path: Path, cache_env: Path) -> None:
    from modelmeter.guard import CostAssertionError, assert_cost

    baseline = tmp_path / "costs.json"
    x = torch.randn(4, 16)
    assert_cost(nn.Sequential(nn.Linear(16, 8)), x, baseline, name="m", update=True)
    analyze(nn.Sequential(nn.Linear(16, 8)), x, cache=True)
    analyze(nn.Sequential(nn.Linear(16, 16)), x, cache=True)
    small, big = sorted(entries(cache_env), key=lambda p: p.stat().st_mtime_ns)
    entry = json.loads(gzip.decompress(small.read_bytes()))
    entry["key"] = big.name.removesuffix(".json.gz")
    big.write_bytes(gzip.compress(json.dumps(entry).encode()))
    assert analyze(nn.Sequential(nn.Linear(16, 16)), x, cache=True).flops.total() == 4 * 16 * 8  # poisoned
    with pytest.raises(CostAssertionError):
        assert_cost(nn.Sequential(nn.Linear(16, 16)), x, baseline, name="m")


# --- the cache deletes only what it wrote; bombs; leftovers (issue 16) ------------------------------------
def _user_files(traces: Path, outside: Path) -> dict[str, bytes]:
    """Files a user keeps in a folder that is also the cache directory, named like the cache's own."""
    files = {"notes.json.gz": b"mine", ".draft.tmp": b"mine", "data.lock": b"mine", "README": b"mine",
             "0" * 63 + ".json.gz": b"one digit short", "A" * 64 + ".json.gz": b"upper case",
             "a" * 64 + ".json.gz.bak": b"backup", ".x.json.gz.host.1.abcdef12.tmp": b"not a key"}
    traces.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (traces / name).write_bytes(data)
    (traces / ("b" * 64 + ".json.gz")).mkdir(exist_ok=True)  # a folder named like an entry
    outside.write_bytes(b"precious")
    (traces / ("c" * 64 + ".json.gz")).symlink_to(outside)  # a link named like an entry: not the cache's
    return files


def test_clear_and_eviction_delete_only_the_caches_own_files(tmp_path: Path) -> None:
    project = tmp_path / "project"
    outside = tmp_path / "precious.bin"
    files = _user_files(project / "traces", outside)
    analyze(Net(), image(), cache_dir=project)
    analyze(Net(p=0.3), image(), cache_dir=project)
    assert cache_info(project)["entries"] == 2  # the user's look-alikes are not counted as entries
    assert clear_cache(project) == 2
    TraceCache(project, size_limit=0).evict()
    for name, data in files.items():
        assert (project / "traces" / name).read_bytes() == data, name
    assert (project / "traces" / ("b" * 64 + ".json.gz")).is_dir() and outside.read_bytes() == b"precious"
    assert (project / "traces" / ("c" * 64 + ".json.gz")).is_symlink()
    left = {p.name for p in (project / "traces").iterdir()}
    assert left == {*files, "b" * 64 + ".json.gz", "c" * 64 + ".json.gz"}  # entries and their lock files went


def _held_lock(path: Path) -> subprocess.Popen[str]:
    """A process holding the lock file ``path`` until its stdin closes."""
    code = ("import sys, filelock; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.skipif(sys.platform == "win32", reason="lock probing by flock, temp names by pid")
def test_leftover_locks_and_temporary_files_go_only_when_abandoned(tmp_path: Path) -> None:
    from modelmeter.io.atomic import owner_tag

    cache = TraceCache(tmp_path / "c")
    traces = Path(cache.path)
    host = owner_tag().rpartition(".")[0]
    free, held, recent = (traces / f"{c * 64}.json.gz.lock" for c in "abc")
    dead_temp = traces / f".{'d' * 64}.json.gz.{host}.{_dead_pid()}.0123abcd.tmp"
    live_temp = traces / f".{'e' * 64}.json.gz.{owner_tag()}.0123abcd.tmp"  # this process: still writing
    foreign_temp = traces / f".{'f' * 64}.json.gz.otherhost.12.0123abcd.tmp"  # another host: judged by age
    for path in (free, held, recent, dead_temp, live_temp, foreign_temp):
        path.write_bytes(b"")
    hour_ago = time.time() - 2 * 3600
    for path in (free, held, foreign_temp):
        os.utime(path, (hour_ago, hour_ago))
    holder = _held_lock(held)
    try:
        cache.evict()  # automatic clean-up: old, unheld locks; temporary files of ended or old writers
        assert sorted(p.name for p in traces.iterdir()) == sorted(p.name for p in (held, recent, live_temp))
        cache.clear()  # clear: every lock nobody holds
        assert sorted(p.name for p in traces.iterdir()) == sorted(p.name for p in (held, live_temp))
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    cache.clear()
    assert [p.name for p in traces.iterdir()] == [live_temp.name]


def _bomb(key: str, size: int) -> bytes:
    """A valid-looking entry for ``key`` whose JSON starts with ``size`` spaces: a few KB that inflate to ``size``."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b" " * (1 << 20)
    parts = [deflate.compress(chunk) for _ in range(size // len(chunk))]
    tail = json.dumps({"format": "modelmeter-trace-cache-entry", "key": key, "trace": None}).encode()
    return b"".join([*parts, deflate.compress(tail), deflate.flush()])


def test_a_decompression_bomb_is_refused_within_the_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import tracemalloc

    assert serialize.MAX_ENTRY_BYTES <= 1 << 30  # the default keeps a bomb far from the memory of a laptop
    monkeypatch.setattr(serialize, "MAX_ENTRY_BYTES", 4 << 20)
    cache = TraceCache(tmp_path / "c")
    key = "9" * 64
    data = _bomb(key, 256 << 20)
    assert len(data) < 1 << 20
    Path(cache.entry_path(key)).write_bytes(data)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="modelmeter.cache"):
            assert cache.load(key) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20  # never near the 256 MiB it would inflate to
    assert "decompression bomb" in caplog.text and not os.path.exists(cache.entry_path(key))
    with pytest.raises(ValueError, match="decompression bomb"):
        loads(data)
    # what fits is read as before
    trace = FlopCountAnalysis(Net(), image()).trace
    assert cache.store(key, trace) and exact(cache.load(key), trace)


def test_code_made_by_exec_is_the_users_only_when_the_user_made_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import timeit
    import types

    from modelmeter.cache.fingerprint import Key, watch_code

    fileless = types.ModuleType("fileless_module")  # torch makes such modules while it imports lazily
    monkeypatch.setitem(sys.modules, "fileless_module", fileless)
    nothing = Key("0" * 64, frozenset())
    with watch_code() as seen:
        timeit.timeit("pass", number=1, globals=vars(fileless))  # the standard library execs code in it
    assert seen is not None and nothing.uncovered(seen) == []
    with watch_code() as seen:
        exec(compile("def made():\n    pass\nmade()\n", "<made by the user>", "exec"), vars(fileless))
    assert seen is not None and nothing.uncovered(seen) == ["<made by the user>:1 <module>",
                                                            "<made by the user>:1 made"]


FAMILIES_RUNNER = """
import json, sys
import modelmeter
from modelmeter.cli.models import load_model

out = {}
for spec in sys.argv[1:]:
    hits = []
    for _ in range(2):  # two builds of the same model: the second must be served from the cache
        loaded = load_model(spec)
        hits.append(modelmeter.analyze(loaded.model, loaded.inputs(), cache=True).from_cache)
    out[spec] = hits
print(json.dumps(out))
"""


def test_real_model_families_stay_cacheable(cache_env: Path) -> None:
    # A fresh process: the first run also meets torch's lazy imports (code made by exec while the model runs).
    specs = ["resnet18", "timm:convnext_atto", "torchvision:mobilenet_v3_small", "llama2_tiny", "bert_tiny"]
    proc = subprocess.run([sys.executable, "-c", FAMILIES_RUNNER, *specs], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MODELMETER_CACHE": str(cache_env)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {spec: [False, True] for spec in specs}


@dataclasses.dataclass
class _Settings:
    width: int = 4


class _Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.settings = _Settings()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, : self.settings.width]


def test_copying_an_object_of_a_class_the_key_reads_keeps_the_key() -> None:
    # copy.copy and pickle write __slotnames__ on the class, a cache of copyreg's: a run that copies a model's
    # config (a parallel plan's ranks do) must not make every later key of the process differ from the stored one
    x = torch.randn(2, 4)
    before = key(_Configured(), x)
    copy.copy(_Settings())
    assert "__slotnames__" in vars(_Settings)
    assert key(_Configured(), x) == before
