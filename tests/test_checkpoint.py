"""modelmeter.checkpoint: fvcore-compatible names/layout/messages, safety, atomicity, recovery, distributed, URLs."""

from __future__ import annotations

import functools
import http.server
import json
import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import checkpoint_helpers as helpers
from modelmeter.checkpoint import (
    Checkpointer,
    CheckpointError,
    PeriodicCheckpointer,
    get_missing_parameters_message,
    get_unexpected_parameters_message,
)

LOGGER = "modelmeter.checkpoint"
HELPERS = os.path.join(os.path.dirname(__file__), "checkpoint_helpers.py")


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive exact equality: tensors bit for bit (torch.equal), containers element by element."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _ours(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    """Messages of modelmeter.checkpoint's logger at ``level`` or above."""
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def _model_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- fvcore compatibility: layout, names, messages ----------------------------------------------------------------


def test_save_layout_last_checkpoint_and_load_rest(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(model, str(tmp_path), optimizer=opt)
    assert not ckpt.has_checkpoint() and ckpt.get_checkpoint_file() == ""
    ckpt.save("checkpoint_file", iteration=5, foo="bar")

    assert sorted(os.listdir(tmp_path)) == ["checkpoint_file.pth", "last_checkpoint"]
    assert (tmp_path / "last_checkpoint").read_bytes() == b"checkpoint_file.pth"  # basename, no newline
    assert ckpt.has_checkpoint()
    assert ckpt.get_checkpoint_file() == os.path.join(str(tmp_path), "checkpoint_file.pth")
    assert ckpt.get_all_checkpoint_files() == [os.path.join(str(tmp_path), "checkpoint_file.pth")]
    data = torch.load(tmp_path / "checkpoint_file.pth", weights_only=True)
    assert list(data) == ["model", "optimizer", "iteration", "foo"]
    assert f"Saving checkpoint to {tmp_path / 'checkpoint_file.pth'}" in _ours(caplog, logging.INFO)

    fresh = nn.Linear(3, 2)
    rest = Checkpointer(fresh, str(tmp_path), optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1)).load(
        ckpt.get_checkpoint_file()
    )
    assert rest == {"iteration": 5, "foo": "bar"}
    assert _model_equal(model, fresh)
    # load(path, checkpointables=[]) leaves the optimizer state in the returned dict, as fvcore
    rest = Checkpointer(fresh, optimizer=opt).load(ckpt.get_checkpoint_file(), checkpointables=[])
    assert sorted(rest) == ["foo", "iteration", "optimizer"]
    assert Checkpointer(fresh).load("") == {}
    assert "No checkpoint found. Initializing model from scratch" in _ours(caplog, logging.INFO)

    # saving is off without save_dir or with save_to_disk=False
    Checkpointer(model, "").save("nothing")
    Checkpointer(model, str(tmp_path / "off"), save_to_disk=False).save("nothing")
    assert not (tmp_path / "off").exists() and not os.path.exists("nothing.pth")


def test_paths_may_be_path_objects(tmp_path: pathlib.Path) -> None:
    """fvcore's loader takes any path its PathManager takes (``os.fspath``); ``load(pathlib.Path)`` raised a bare
    AttributeError ('PosixPath' object has no attribute 'startswith')."""
    model = nn.Linear(2, 2)
    Checkpointer(model, tmp_path, sharded=False).save("plain", iteration=1)
    Checkpointer(model, tmp_path, sharded=True).save("sharded", iteration=2)
    for name, iteration in (("plain.pth", 1), ("sharded", 2)):
        target = nn.Linear(2, 2)
        assert Checkpointer(target).load(tmp_path / name) == {"iteration": iteration}
        assert _model_equal(target, model)
        assert Checkpointer(target).resume_or_load(tmp_path / name, resume=False) == {"iteration": iteration}


def test_add_checkpointable_errors() -> None:
    ckpt = Checkpointer(nn.Linear(1, 1), optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1))
    with pytest.raises(KeyError, match="Key optimizer already used in the Checkpointer"):
        ckpt.add_checkpointable("optimizer", torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1))
    with pytest.raises(TypeError, match="add_checkpointable needs an object with 'state_dict\\(\\)' method."):
        ckpt.add_checkpointable("x", object())
    # "model" is the model's own entry: an EMA copy registered under that name replaced the weights in every save
    for key in ("model", "__modelmeter_checkpoint__"):
        with pytest.raises(KeyError, match=f"Key {key} is the checkpoint's own entry"):
            ckpt.add_checkpointable(key, nn.Linear(1, 1))


def test_periodic_checkpointer_fvcore_example(tmp_path: pathlib.Path) -> None:
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path))
    periodic = PeriodicCheckpointer(ckpt, period=3, max_iter=10, max_to_keep=2, file_prefix="ckpt")
    for iteration in range(10):
        periodic.step(iteration)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000005.pth", "ckpt_0000008.pth", "ckpt_final.pth", "last_checkpoint"]
    assert (tmp_path / "last_checkpoint").read_text() == "ckpt_final.pth"
    assert ckpt.load(ckpt.get_checkpoint_file()) == {"iteration": 9}

    other = tmp_path / "default"
    periodic = PeriodicCheckpointer(Checkpointer(nn.Linear(2, 2), str(other)), period=10, max_iter=10)
    for iteration in range(10):
        periodic.step(iteration, loss=1.5)
    assert sorted(os.listdir(other)) == ["last_checkpoint", "model_0000009.pth", "model_final.pth"]
    assert torch.load(other / "model_0000009.pth", weights_only=True)["loss"] == 1.5


@pytest.mark.parametrize("sharded", [False, True])
def test_path_for_is_where_save_puts_the_checkpoint(tmp_path: pathlib.Path, sharded: bool) -> None:
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path), sharded=sharded)
    assert ckpt.is_writer()
    ckpt.save("step")
    where = pathlib.Path(ckpt.path_for("step"))
    assert str(where) == ckpt.get_checkpoint_file()
    assert where.exists() and where.is_dir() == sharded  # a sharded checkpoint is a directory
    # the processes that write nothing: no save_dir, or save_to_disk=False (fvcore's way for non-main ranks)
    assert not Checkpointer(nn.Linear(2, 2), "").is_writer()
    assert not Checkpointer(nn.Linear(2, 2), str(tmp_path), save_to_disk=False).is_writer()


def test_max_to_keep_cleans_up_an_earlier_run(tmp_path: pathlib.Path) -> None:
    model = nn.Linear(2, 2)
    first = PeriodicCheckpointer(Checkpointer(model, str(tmp_path)), period=3, max_iter=12, file_prefix="ckpt")
    for iteration in range(12):  # no retention: 2, 5, 8, 11 and final stay
        first.step(iteration)
    Checkpointer(model, str(tmp_path)).save("other_0000001")
    (tmp_path / "ckpt_0000099.pth").write_bytes((tmp_path / "ckpt_0000011.pth").read_bytes())  # a later iteration

    # The job restarts (say from iteration 5) with retention: older files of the same prefix are cleaned up too,
    # oldest iteration first; ckpt_final.pth, other prefixes and higher iteration numbers are left alone.
    second = PeriodicCheckpointer(Checkpointer(model, str(tmp_path)), period=3, max_to_keep=2, file_prefix="ckpt")
    second.step(14)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt_")) == [
        "ckpt_0000011.pth",
        "ckpt_0000014.pth",
        "ckpt_0000099.pth",
        "ckpt_final.pth",
    ]
    assert "other_0000001.pth" in os.listdir(tmp_path)
    second.step(17)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt_0")) == [
        "ckpt_0000014.pth",
        "ckpt_0000017.pth",
        "ckpt_0000099.pth",
    ]
    # saving the same iteration twice never deletes the checkpoint just written
    third = PeriodicCheckpointer(Checkpointer(model, str(tmp_path)), period=1, max_to_keep=1, file_prefix="ckpt")
    third.step(20)
    third.step(20)
    assert (tmp_path / "ckpt_0000020.pth").exists()
    assert (tmp_path / "last_checkpoint").read_text() == "ckpt_0000020.pth"

    # never the checkpoint last_checkpoint names (here pinned to an old one by a checkpointer that does not retag)
    pinned_dir = tmp_path / "pinned"
    pinned = Checkpointer(model, str(pinned_dir))
    pinned.save("ckpt_0000002")
    pinned.tag_last_checkpoint = lambda name: None  # type: ignore[method-assign]
    fourth = PeriodicCheckpointer(pinned, period=3, max_to_keep=1, file_prefix="ckpt")
    fourth.step(5)
    fourth.step(8)
    assert sorted(os.listdir(pinned_dir)) == ["ckpt_0000002.pth", "ckpt_0000008.pth", "last_checkpoint"]


def test_grouped_key_messages() -> None:
    assert get_missing_parameters_message(["a.b.weight", "c", "a.b.bias"]) == (
        "Some model parameters or buffers are not found in the checkpoint:\na.b.{bias, weight}\nc"
    )
    assert get_unexpected_parameters_message(["x.y.weight", "x.y.bias", "z"]) == (
        "The checkpoint state_dict contains keys that are not used by the model:\n  x.y.{bias, weight}\n  z"
    )
    assert get_missing_parameters_message(["backbone.fpn.weight"]).endswith("\nbackbone.fpn.weight")


class Detector(nn.Module):
    def __init__(self, head_out: int = 3) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.stem = nn.Linear(4, 4)
        self.backbone.fpn = nn.Linear(4, 4)
        self.head = nn.Linear(4, head_out)


def test_load_reports_missing_unexpected_and_misshaped_keys(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = Detector(head_out=5)
    state = OrderedDict((k, v) for k, v in source.state_dict().items() if not k.startswith("backbone.fpn."))
    state["extra.conv.weight"] = torch.zeros(1)
    state["extra.conv.bias"] = torch.zeros(1)
    state["stray"] = torch.zeros(1)
    torch.save({"model": state, "iteration": 3}, tmp_path / "ckpt.pth")

    target = Detector(head_out=3)
    head_before = target.head.weight.clone()
    caplog.set_level(logging.INFO, logger=LOGGER)
    rest = Checkpointer(target).load(str(tmp_path / "ckpt.pth"))
    assert rest == {"iteration": 3}
    assert _ours(caplog) == [
        "Skip loading parameter 'head.weight' to the model due to incompatible shapes: (5, 4) in the checkpoint but "
        "(3, 4) in the model! You might want to double check if this is expected.",
        "Skip loading parameter 'head.bias' to the model due to incompatible shapes: (5,) in the checkpoint but "
        "(3,) in the model! You might want to double check if this is expected.",
        "Some model parameters or buffers are not found in the checkpoint:\n"
        "backbone.fpn.{bias, weight}\nhead.{bias, weight}",
        "The checkpoint state_dict contains keys that are not used by the model:\n  extra.conv.{bias, weight}\n  stray",
    ]
    assert torch.equal(target.head.weight, head_before)  # the mis-shaped tensor was skipped, not loaded
    assert torch.equal(target.backbone.stem.weight, source.backbone.stem.weight)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.embed.weight  # shared parameter: two names, one tensor
        self.reused = nn.Linear(4, 4)
        self.alias = self.reused  # shared module


def test_shared_parameter_loaded_under_one_name_is_not_missing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = Tied()
    state = {k: v for k, v in source.state_dict().items() if k in ("embed.weight", "reused.weight", "reused.bias")}
    torch.save({"model": state}, tmp_path / "tied.pth")
    target = Tied()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(target).load(str(tmp_path / "tied.pth"))
    assert _ours(caplog) == []
    assert torch.equal(target.out.weight, source.embed.weight)

    # but a tensor missing under all its names is reported (all names)
    torch.save({"model": {"reused.weight": source.reused.weight}}, tmp_path / "partial.pth")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(Tied()).load(str(tmp_path / "partial.pth"))
    assert _ours(caplog)[-1] == (
        "Some model parameters or buffers are not found in the checkpoint:\n"
        "alias.bias\nembed.weight\nout.weight\nreused.bias"
    )


def test_uniform_module_prefix_is_stripped(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    source = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    wrapped = OrderedDict(("module." + k, v) for k, v in source.state_dict().items())
    wrapped._metadata = OrderedDict(  # type: ignore[attr-defined]
        ("module" + ("." + k if k else ""), v)
        for k, v in source.state_dict()._metadata.items()  # type: ignore[attr-defined]
    )
    torch.save({"model": wrapped}, tmp_path / "ddp_style.pth")
    target = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(target).load(str(tmp_path / "ddp_style.pth"))
    assert _ours(caplog) == []
    assert _model_equal(source, target)

    # not uniform: nothing is stripped, so the keys are reported
    mixed = {"module.0.weight": source[0].weight, "0.bias": source[0].bias}
    torch.save({"model": mixed}, tmp_path / "mixed.pth")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(nn.Sequential(nn.Linear(2, 3))).load(str(tmp_path / "mixed.pth"))
    assert "  module.0.weight" in _ours(caplog)[-1]


class HoldsModule(nn.Module):
    """A plain model (no wrapper) whose child is called ``module``: its own keys start with ``module.``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((prefix + k, v) for k, v in state.items())


def test_module_prefixes_are_stripped_only_down_to_the_models_own(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """fvcore strips one ``module.`` whatever the model's keys: a model whose child is named ``module`` lost every
    weight on its own save/load round trip, and a state dict of a twice-wrapped model kept one prefix."""
    source = HoldsModule()
    with torch.no_grad():
        source.module[1].running_mean.uniform_()
    Checkpointer(source, str(tmp_path)).save("own")
    plain = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    torch.save({"model": _prefixed(source.module.state_dict(), "module.module.")}, tmp_path / "twice.pth")
    torch.save({"model": _prefixed(source.state_dict(), "module.")}, tmp_path / "wrapped_own.pth")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for name in ("own", "wrapped_own"):
            target = HoldsModule()
            Checkpointer(target).load(str(tmp_path / f"{name}.pth"))
            assert _model_equal(source, target), name
        Checkpointer(plain).load(str(tmp_path / "twice.pth"))
    assert _ours(caplog) == []
    assert _model_equal(source.module, plain)


class WithInnerDP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.DataParallel(nn.Sequential(nn.Linear(3, 3), nn.DataParallel(nn.Linear(3, 3))))
        self.head = nn.Linear(3, 1)


def test_save_unwraps_root_and_nested_data_parallel(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.DataParallel(WithInnerDP())
    Checkpointer(model, str(tmp_path)).save("wrapped")
    keys = list(torch.load(tmp_path / "wrapped.pth", weights_only=True)["model"])
    assert keys == [
        "backbone.0.weight",
        "backbone.0.bias",
        "backbone.1.weight",
        "backbone.1.bias",
        "head.weight",
        "head.bias",
    ]

    plain = nn.Sequential()
    plain.backbone = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    plain.head = nn.Linear(3, 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(plain).load(str(tmp_path / "wrapped.pth"))  # into a model without wrappers
        again = WithInnerDP()
        Checkpointer(nn.DataParallel(again)).load(str(tmp_path / "wrapped.pth"))  # and back into wrapped ones
    assert _ours(caplog) == []
    assert torch.equal(plain.backbone[1].weight, model.module.backbone.module[1].module.weight)
    assert _model_equal(again, model.module)


# --- safety -------------------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this calls pathlib.Path.touch(marker): the classic code-execution-on-load attack."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"model": nn.Linear(2, 2).state_dict(), "iteration": _Payload(str(marker))}, evil)

    with pytest.raises(CheckpointError) as info:
        Checkpointer(nn.Linear(2, 2)).load(str(evil))
    message = str(info.value)
    assert str(evil) in message and "weights_only=False" in message and "it imports builtins.getattr" in message
    assert info.value.reason == "unsafe" and info.value.path == str(evil)
    assert not marker.exists()

    # as the last checkpoint: resume_or_load refuses too; it does not silently skip to an older checkpoint
    save_dir = tmp_path / "run"
    ckpt = Checkpointer(nn.Linear(2, 2), str(save_dir))
    ckpt.save("model_0000001", iteration=1)
    (save_dir / "model_0000002.pth").write_bytes(evil.read_bytes())
    ckpt.tag_last_checkpoint("model_0000002.pth")
    with pytest.raises(CheckpointError, match="Refused to load checkpoint"):
        ckpt.resume_or_load("")
    assert not marker.exists()

    # a DCP directory whose .metadata is a malicious pickle is refused the same way
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(__import__("pickle").dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="Refused to load checkpoint"):
        Checkpointer(nn.Linear(2, 2)).load(str(sharded))
    assert not marker.exists()


def test_weights_only_opt_out_for_trusted_legacy_files(tmp_path: pathlib.Path) -> None:
    legacy = tmp_path / "legacy.pth"
    model = nn.Linear(2, 2)
    torch.save({"model": model.state_dict(), "config": helpers.TinyNet}, legacy)  # pickles a class reference
    with pytest.raises(CheckpointError, match="checkpoint_helpers.TinyNet"):
        Checkpointer(nn.Linear(2, 2)).load(str(legacy))
    assert Checkpointer(nn.Linear(2, 2)).load(str(legacy), weights_only=False) == {"config": helpers.TinyNet}
    assert Checkpointer(nn.Linear(2, 2), weights_only=False).load(str(legacy)) == {"config": helpers.TinyNet}
    assert Checkpointer(nn.Linear(2, 2), safe_globals=[helpers.TinyNet]).load(str(legacy)) == {
        "config": helpers.TinyNet
    }


def test_numpy_state_loads_under_weights_only(tmp_path: pathlib.Path) -> None:
    source = nn.Linear(3, 2)
    np_state = {k: v.detach().numpy().copy() for k, v in source.state_dict().items()}
    extras = {
        "np_rng": np.random.RandomState(3).get_state(),
        "np_generator": np.random.default_rng(3).bit_generator.state,
        "scalars": [np.float64(1.5), np.int64(7), np.float32(2.0), np.bool_(True)],
        "dtype": np.dtype("float16"),
        "table": np.arange(6, dtype=np.int32).reshape(2, 3),
        "py_rng": random.Random(3).getstate(),
        "torch_rng": torch.get_rng_state(),
    }
    torch.save({"model": np_state, **extras}, tmp_path / "np.pth")
    target = nn.Linear(3, 2)
    rest = Checkpointer(target).load(str(tmp_path / "np.pth"))  # weights_only=True by default
    assert _model_equal(source, target)
    _assert_same(list(rest), list(extras))
    for key in ("np_rng", "np_generator", "scalars", "py_rng", "torch_rng"):
        _assert_same(rest[key], extras[key], key)
    assert rest["dtype"] == np.dtype("float16") and np.array_equal(rest["table"], extras["table"])


# --- atomicity and recovery ---------------------------------------------------------------------------------------


def test_failed_save_leaves_previous_checkpoint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    ckpt = Checkpointer(model, str(tmp_path))
    ckpt.save("model_0000001", iteration=1)
    before = sorted(os.listdir(tmp_path))

    def broken_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="Could not save checkpoint .*model_0000002.pth: OSError: disk full"):
        ckpt.save("model_0000002", iteration=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before  # no partial file, no temp file, last_checkpoint untouched
    assert ckpt.resume_or_load("") == {"iteration": 1}


def test_truncated_checkpoint_is_detected_and_resume_falls_back(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = helpers.TinyNet()
    periodic = PeriodicCheckpointer(Checkpointer(model, str(tmp_path)), period=1)
    periodic.step(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.fc1.weight.add_(1.0)
    periodic.step(1)
    newest = tmp_path / "model_0000001.pth"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    fresh = helpers.TinyNet()
    with pytest.raises(CheckpointError) as info:
        Checkpointer(fresh).load(str(newest))
    assert str(newest) in str(info.value) and "truncated or corrupt" in str(info.value)
    assert info.value.reason == "corrupt"

    caplog.set_level(logging.WARNING, logger=LOGGER)
    rest = Checkpointer(fresh, str(tmp_path)).resume_or_load("")
    assert rest == {"iteration": 0}
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    messages = "\n".join(_ours(caplog))
    assert str(newest) in messages and "falling back" in messages
    assert f"Resumed from {tmp_path / 'model_0000000.pth'} instead of {newest}." in messages

    # nothing loadable at all: an error naming the last checkpoint, never a silent fresh start
    (tmp_path / "model_0000000.pth").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="No checkpoint in .* could be loaded"):
        Checkpointer(helpers.TinyNet(), str(tmp_path)).resume_or_load("")

    # a last_checkpoint naming a file that no longer exists falls back as well
    other = tmp_path / "other"
    ckpt = Checkpointer(helpers.TinyNet(), str(other))
    ckpt.save("a", iteration=1)
    ckpt.tag_last_checkpoint("deleted.pth")
    assert ckpt.resume_or_load("") == {"iteration": 1}


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork() and SIGKILL")
def test_sigkill_during_save_never_loses_the_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    """A child process saves in a loop (resuming each time) and is SIGKILLed after a random delay, many times."""
    runs = [
        {"dir": str(tmp_path / "pth"), "trials": 30, "seed": 1234, "format": "pth"},
        {"dir": str(tmp_path / "safetensors"), "trials": 12, "seed": 99, "format": "safetensors"},
    ]
    proc = subprocess.run(
        [sys.executable, HELPERS, "kill-loop", json.dumps(runs)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print("kill-loop results:", json.dumps(results))
    # some kills landed inside an atomic write (a temp file was left behind), the real test of atomicity
    assert sum(r["interrupted_writes"] for r in results) > 0
    for run, result in zip(runs, results, strict=True):
        iterations = result["iterations"]
        assert len(iterations) == run["trials"] + 1
        assert iterations == sorted(iterations)  # never went back: the last checkpoint always survived
        assert iterations[-1] > 0  # children did make progress (so kills landed during saves)
        # after the kills, one complete save: retention (max_to_keep=2) also removed what killed runs left behind
        final = result["final_iteration"]
        assert final == iterations[-1] + 1
        assert result["checkpoints"] == [f"model_{final - 1:07d}.pth", f"model_{final:07d}.pth"]
        # and from the test process: the surviving state resumes without any fallback
        model = helpers.KillNet()
        assert Checkpointer(model, run["dir"]).resume_or_load("") == {"iteration": final}
        assert torch.all(model.big == float(final))


# --- round trip ---------------------------------------------------------------------------------------------------


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.bn(self.drop(torch.relu(self.fc1(x)))))


def _make_run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = DropNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    return model, opt, sched


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    y = torch.randn(8, 1, generator=g) + np.random.standard_normal() + random.random()  # consumes every RNG
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_resume_is_bit_identical_and_training_continues_identically(tmp_path: pathlib.Path, fmt: str) -> None:
    steps, cut = 8, 4
    model, opt, sched = _make_run(0)
    _seed_all(1)
    uninterrupted = [_train_step(model, opt, sched, s) for s in range(steps)]

    model, opt, sched = _make_run(0)
    _seed_all(1)
    first = [_train_step(model, opt, sched, s) for s in range(cut)]
    ckpt = Checkpointer(model, str(tmp_path), format=fmt, optimizer=opt, scheduler=sched)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    ckpt.save("model_0000003", iteration=cut - 1, rng=rng)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}

    model2, opt2, sched2 = _make_run(123)  # a different start, and RNGs moved on
    _seed_all(7)
    rest = Checkpointer(model2, str(tmp_path), optimizer=opt2, scheduler=sched2).resume_or_load("")
    assert rest["iteration"] == cut - 1
    _assert_same(model2.state_dict(), saved["model"], "model")
    _assert_same(opt2.state_dict(), saved["optimizer"], "optimizer")
    _assert_same(sched2.state_dict(), saved["scheduler"], "scheduler")
    torch.set_rng_state(rest["rng"]["torch"])
    np.random.set_state(rest["rng"]["numpy"])
    random.setstate(rest["rng"]["python"])
    second = [_train_step(model2, opt2, sched2, s) for s in range(cut, steps)]
    assert all(torch.equal(a, b) for a, b in zip(first + second, uninterrupted, strict=True))


@pytest.mark.parametrize("sharded", [False, True])
def test_optimizer_with_state_for_some_parameters_only(tmp_path: pathlib.Path, sharded: bool) -> None:
    """A frozen or unused parameter has no optimizer state. A sharded checkpoint of such an optimizer could not be
    loaded into a fresh one ("Missing key in checkpoint state_dict: ...momentum_buffer"); the oracle is torch's
    own ``optimizer.load_state_dict`` of the saved state."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.BatchNorm1d(2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, opt = make()
    model[0].weight.requires_grad_(False)  # frozen
    model[1](torch.randn(4, 3)).sum().backward()  # model[0] and the BatchNorm get no gradient either
    opt.step()
    Checkpointer(model, str(tmp_path), sharded=sharded, optimizer=opt).save("partial", iteration=1)
    _, expected = make()
    expected.load_state_dict(opt.state_dict())

    target, target_opt = make()
    assert Checkpointer(target, str(tmp_path), optimizer=target_opt).resume_or_load("") == {"iteration": 1}
    _assert_same(target_opt.state_dict(), expected.state_dict(), "optimizer")
    _assert_same(target.state_dict(), model.state_dict(), "model")


# --- safetensors --------------------------------------------------------------------------------------------------


def test_safetensors_format(tmp_path: pathlib.Path) -> None:
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(model, str(tmp_path), format="safetensors", optimizer=opt)
    ckpt.save("model_final", iteration=9)
    assert sorted(os.listdir(tmp_path)) == ["last_checkpoint", "model_final.pth", "model_final.safetensors"]
    assert (tmp_path / "last_checkpoint").read_text() == "model_final.pth"
    from safetensors.torch import load_file

    assert "embed.weight" in load_file(tmp_path / "model_final.safetensors")  # a plain safetensors file

    for path in ("model_final.pth", "model_final.safetensors"):  # detected from either file
        target = Tied()
        rest = Checkpointer(target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1)).load(str(tmp_path / path))
        assert rest == {"iteration": 9}
        assert _model_equal(target, model) and target.out.weight is target.embed.weight

    # a lone .safetensors file (no .pth next to it) holds just the model weights
    lone = tmp_path / "lone"
    lone.mkdir()
    os.replace(tmp_path / "model_final.safetensors", lone / "weights.safetensors")
    target = Tied()
    assert Checkpointer(target).load(str(lone / "weights.safetensors")) == {}
    assert _model_equal(target, model)

    # .pth and weights from different saves of the same name are detected (and a truncated weights file too)
    Checkpointer(model, str(tmp_path)).save("mix", format="safetensors")
    first_weights = (tmp_path / "mix.safetensors").read_bytes()
    Checkpointer(model, str(tmp_path)).save("mix", format="safetensors")
    (tmp_path / "mix.safetensors").write_bytes(first_weights)
    with pytest.raises(CheckpointError, match="mix.safetensors does not belong"):
        Checkpointer(Tied()).load(str(tmp_path / "mix.pth"))
    (tmp_path / "mix.safetensors").write_bytes(first_weights[:100])
    with pytest.raises(CheckpointError, match="mix.safetensors is truncated or corrupt"):
        Checkpointer(Tied()).load(str(tmp_path / "mix.pth"))
    # saving the name again in the default format drops the stale weights file
    Checkpointer(model, str(tmp_path)).save("mix")
    assert not (tmp_path / "mix.safetensors").exists()
    with pytest.raises(ValueError, match="Unknown checkpoint format"):
        Checkpointer(model, format="npz")


def test_safetensors_format_with_tensors_safetensors_cannot_hold(tmp_path: pathlib.Path) -> None:
    """safetensors stores dense tensors only: a sparse or quantized buffer made save() fail with a bare
    NotImplementedError from deep inside. Such tensors go to the .pth beside the weights, like non-tensor state."""
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.eye(2).to_sparse())
    model.register_buffer("codes", torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.qint8))
    Checkpointer(model, str(tmp_path), format="safetensors").save("odd", iteration=1)
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "odd.safetensors")) == ["bias", "weight"]
    target = nn.Linear(2, 2)
    target.register_buffer("mask", torch.zeros(2, 2).to_sparse())
    target.register_buffer("codes", torch.quantize_per_tensor(torch.zeros(4), 0.5, 0, torch.qint8))
    assert Checkpointer(target).load(str(tmp_path / "odd.pth")) == {"iteration": 1}
    loaded = target.state_dict()
    for key, value in model.state_dict().items():
        if value.is_sparse:
            assert torch.equal(loaded[key].to_dense(), value.to_dense()), key
        else:
            assert torch.equal(loaded[key], value), key


# --- distributed --------------------------------------------------------------------------------------------------


def test_distributed_ddp_and_fsdp2_save_load(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """2 CPU processes with gloo: DDP (rank 0 writes, both load) and FSDP2 (sharded save, 2-rank and 1-rank load)."""
    import torch.multiprocessing as mp

    mp.spawn(helpers.dist_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["ddp_file_visible_after_save"], rank  # save returned only after rank 0 finished writing
        assert result["ddp_extra"] == {"iteration": 2}
        assert result["ddp_loaded_equal"] and result["ddp_momentum_equal"], rank
        assert result["param_type"] == "DTensor"
        assert result["sharded_extra"] == {"iteration": 7}
        assert result["sharded_reload_equal"] and result["sharded_opt_equal"] and result["sharded_sched_equal"]
    assert results[0]["ddp_writes"] == ["ddp_model.pth", "last_checkpoint"] and results[1]["ddp_writes"] == []
    assert results[0]["sharded_writes"] == ["extra.pth", "last_checkpoint"] and results[1]["sharded_writes"] == []

    ddp_state = torch.load(tmp_path / "ddp" / "ddp_model.pth", weights_only=True)["model"]
    assert list(ddp_state) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # no "module."

    sharded_dir = tmp_path / "sharded"
    assert sorted(os.listdir(sharded_dir)) == ["last_checkpoint", "sharded"]
    assert (sharded_dir / "last_checkpoint").read_text() == "sharded"
    assert sorted(os.listdir(sharded_dir / "sharded")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pth"]

    # 2 ranks -> 1: an unsharded model in this (non-distributed) process
    reference = torch.load(tmp_path / "sharded_reference.pt", weights_only=True)
    model = helpers.TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ckpt = Checkpointer(model, str(sharded_dir), optimizer=opt, scheduler=sched)
    assert ckpt.get_all_checkpoint_files() == [str(sharded_dir / "sharded")]
    assert ckpt.resume_or_load("") == {"iteration": 7}
    _assert_same(OrderedDict(model.state_dict()), OrderedDict(reference["model"]), "model")
    names = [n for n, _ in model.named_parameters()]
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state_dict()["state"][index][key], reference["optimizer"]["state"][name][key])
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.0025)

    # a mis-shaped model: the same fvcore messages as for plain checkpoints, and the rest still loads
    narrow = helpers.TinyNet(width=5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(narrow).load(str(sharded_dir / "sharded"))
    messages = _ours(caplog)
    assert messages[0] == (
        "Skip loading parameter 'fc1.weight' to the model due to incompatible shapes: (8, 4) in the checkpoint "
        "but (5, 4) in the model! You might want to double check if this is expected."
    )
    assert messages[-1] == (
        "Some model parameters or buffers are not found in the checkpoint:\nfc1.{bias, weight}\nfc2.weight"
    )
    assert torch.equal(narrow.fc2.bias, reference["model"]["fc2.bias"])


# --- URLs ---------------------------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def http_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[pathlib.Path, str]]:
    served = tmp_path / "served"
    served.mkdir()
    monkeypatch.setenv("MODELMETER_CACHE", str(tmp_path / "cache"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_load_from_http_url(http_dir: tuple[pathlib.Path, str]) -> None:
    served, base = http_dir
    model = helpers.TinyNet()
    Checkpointer(model, str(served)).save("model_final", iteration=4)
    Checkpointer(model, str(served)).save("weights", format="safetensors", iteration=5)

    target = helpers.TinyNet()
    assert Checkpointer(target).resume_or_load(f"{base}/model_final.pth", resume=False) == {"iteration": 4}
    assert _model_equal(target, model)
    target = helpers.TinyNet()
    assert Checkpointer(target).load(f"{base}/weights.pth") == {"iteration": 5}  # fetches weights.safetensors too
    assert _model_equal(target, model)
    with pytest.raises(CheckpointError, match="could not be downloaded") as info:
        Checkpointer(target).load(f"{base}/absent.pth")
    assert f"{base}/absent.pth" in str(info.value)


@pytest.mark.parametrize("name", ["model 50%41", "run#2", "what?", "\u00fcber"])
def test_safetensors_checkpoint_from_a_url_whose_name_needs_quoting(
    http_dir: tuple[pathlib.Path, str], name: str
) -> None:
    """The weights file's name was appended to the URL unquoted: '%41' was decoded to 'A', '#' and '?' cut the
    name off, so the weights of such a checkpoint were "not found" (over http:// and file://)."""
    served, base = http_dir
    model = helpers.TinyNet()
    Checkpointer(model, str(served)).save(name, format="safetensors", iteration=6)
    quoted = urllib.parse.quote(f"{name}.pth")
    for url in (f"{base}/{quoted}", (served / f"{name}.pth").as_uri()):
        target = helpers.TinyNet()
        assert Checkpointer(target).load(url) == {"iteration": 6}, url
        assert _model_equal(target, model)


def test_urls_are_read_as_the_path_manager_reads_them(tmp_path: pathlib.Path) -> None:
    """The checkpointer knew ``http://``, ``https://`` and ``file://`` only: the short file URL (``file:/abs``) and a
    scheme in capitals were looked for as local files ("not found"), and a scheme no handler serves (``s3://``) as
    well, where PathManager, which serves the checkpointer's URLs, reads the first two and refuses the third."""
    model = helpers.TinyNet()
    Checkpointer(model, str(tmp_path)).save("model", iteration=3)
    path = (tmp_path / "model.pth").resolve()
    for url in (f"file:{path}", f"FILE://{path}"):
        target = helpers.TinyNet()
        assert Checkpointer(target).load(url) == {"iteration": 3}, url
        assert _model_equal(target, model)
    with pytest.raises(CheckpointError, match="No handler serves s3://"):
        Checkpointer(helpers.TinyNet()).load("s3://bucket/model.pth")
