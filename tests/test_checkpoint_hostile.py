"""modelmeter.checkpoint against hostile and odd files: unsafe vs corrupt by content, confinement to save_dir,
odd contents, full disks and bad names (issue 16, section 5)."""

from __future__ import annotations

import builtins
import copyreg
import errno
import io
import logging
import os
import pathlib
import pickle
import random
import subprocess
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import checkpoint_helpers as helpers
from modelmeter.checkpoint import Checkpointer, CheckpointError, PeriodicCheckpointer

LOGGER = "modelmeter.checkpoint"


def _state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- hostile pickles ----------------------------------------------------------------------------------------------
#
# Each builder writes a file that, unpickled in full, creates the sentinel file (or would run code that could).
# The loader must call every one of them "unsafe", run none of them, and resume_or_load must not skip them.


class _Reduce:
    """Pickles as ``func(*args)``: what an attacker's __reduce__ returns."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


class _LooksAllowed:
    """A class whose pickle claims to be collections.OrderedDict rebuilt with a harmless-looking argument."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (OrderedDictLookalike, (_Reduce(pathlib.Path.touch, pathlib.Path(self.sentinel)),))


class OrderedDictLookalike(dict):  # type: ignore[type-arg]
    """Named like an allow-listed container, defined elsewhere."""


class Config:
    """A plain class a trusted checkpoint may carry (allowed with safe_globals)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def _touch_command(sentinel: pathlib.Path) -> str:
    return f"touch {sentinel}"


def _torch_save(obj: Any, path: pathlib.Path, **kwargs: Any) -> None:
    torch.save({"model": nn.Linear(2, 2).state_dict(), "iteration": 1, "payload": obj}, path, **kwargs)


def _raw_pickle(body: bytes) -> bytes:
    """A protocol-2 pickle of a dict {"model": {}, "payload": <body>}: body is a sequence of opcodes."""
    return b"\x80\x02}q\x00(X\x05\x00\x00\x00modelq\x01}q\x02X\x07\x00\x00\x00payloadq\x03" + body + b"u."


def _global_call(module: str, name: str, arg: str) -> bytes:
    encoded = arg.encode()
    return f"c{module}\n{name}\n".encode() + b"X" + len(encoded).to_bytes(4, "little") + encoded + b"\x85R"


def _with_data_pkl(good: pathlib.Path, data_pkl: bytes, out: pathlib.Path) -> None:
    """A copy of the zip checkpoint ``good`` whose data.pkl is replaced."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info, data)


def _hostile_builders() -> dict[str, Callable[[pathlib.Path, pathlib.Path], None]]:
    def os_system(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(os.system, _touch_command(sentinel)), path)

    def os_system_legacy(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(os.system, _touch_command(sentinel)), path, _use_new_zipfile_serialization=False)

    def legacy_cut_after_payload(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        os_system_legacy(path, sentinel)
        data = path.read_bytes()
        path.write_bytes(data[: data.index(b"system") + 12])  # the import is complete, the rest is gone

    def popen(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(subprocess.Popen, ["touch", str(sentinel)]), path)

    def eval_(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(builtins.eval, f"open({str(sentinel)!r}, 'w')"), path)

    def getattr_trick(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(pathlib.Path.touch, pathlib.Path(sentinel)), path)  # pickles as getattr(Path, "touch")

    def getattr_raw(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        # getattr(__import__("os"), "system")("touch ...") spelled out in opcodes
        body = (
            b"c__builtin__\ngetattr\n"
            + _global_call("__builtin__", "__import__", "os")
            + b"X\x06\x00\x00\x00system\x86R"
            + b"X"
            + len(_touch_command(sentinel)).to_bytes(4, "little")
            + _touch_command(sentinel).encode()
            + b"\x85R"
        )
        path.write_bytes(_raw_pickle(body))

    def nested_pickle(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        inner = pickle.dumps(_Reduce(os.system, _touch_command(sentinel)))
        _torch_save(_Reduce(pickle.loads, inner), path)

    def nested_torch_load(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        inner = io.BytesIO()
        torch.save(_Reduce(os.system, _touch_command(sentinel)), inner)
        _torch_save(_Reduce(torch.load, io.BytesIO(inner.getvalue())), path)

    def lookalike_class(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_LooksAllowed(str(sentinel)), path)

    def lookalike_torch_name(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        # a name next to the allow-listed torch._utils._rebuild_tensor_v2 that is not on the list
        path.write_bytes(_raw_pickle(_global_call("torch._utils", "_rebuild_tensor_v9", _touch_command(sentinel))))

    def module_reduce(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(nn.Linear(2, 2), path)  # a torch class, but not an allow-listed one

    def bad_data_pkl(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        good = path.with_suffix(".good")
        torch.save({"model": nn.Linear(2, 2).state_dict()}, good)
        _with_data_pkl(good, _raw_pickle(_global_call("posix", "system", _touch_command(sentinel))), path)
        good.unlink()

    def stack_global(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        path.write_bytes(pickle.dumps({"model": {}, "x": _Reduce(os.system, _touch_command(sentinel))}, protocol=4))

    def stack_global_in_zip(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        _torch_save(_Reduce(os.system, _touch_command(sentinel)), path, pickle_protocol=4)

    def extension_code(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        path.write_bytes(_raw_pickle(b"\x82\x01"))  # EXT1 1: whatever copyreg's registry holds under code 1

    def legacy_tar(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        payload = pickle.dumps(_Reduce(os.system, _touch_command(sentinel)), protocol=2)
        with tarfile.open(path, "w") as tar:
            for name in ("sys_info", "pickle", "storages", "tensors"):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))

    def torchscript(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(path))  # code, not weights

    def unsupported_opcode(path: pathlib.Path, sentinel: pathlib.Path) -> None:
        # well-formed, no import at all, but in opcodes (protocol 4 framing) the weights-only loader refuses
        path.write_bytes(pickle.dumps({"model": {}, "iteration": 1}, protocol=4))

    return {
        f.__name__.rstrip("_"): f
        for f in (
            os_system,
            os_system_legacy,
            legacy_cut_after_payload,
            popen,
            eval_,
            getattr_trick,
            getattr_raw,
            nested_pickle,
            nested_torch_load,
            lookalike_class,
            lookalike_torch_name,
            module_reduce,
            bad_data_pkl,
            stack_global,
            stack_global_in_zip,
            extension_code,
            legacy_tar,
            torchscript,
            unsupported_opcode,
        )
    }


HOSTILE = _hostile_builders()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_file_is_unsafe_never_runs_and_is_never_skipped(
    kind: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    sentinel = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    HOSTILE[kind](evil, sentinel)
    assert not sentinel.exists()

    model = helpers.TinyNet()
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(model).load(str(evil))
    assert info.value.reason == "unsafe", str(info.value)
    assert info.value.path == str(evil) and str(evil) in str(info.value)
    assert "Refused to load checkpoint" in str(info.value) and "weights_only=False" in str(info.value)
    assert not sentinel.exists()
    assert _state_equal(before, model.state_dict())

    # As the last checkpoint: resume_or_load raises; it does not fall back to the older, valid checkpoint.
    run = tmp_path / "run"
    ckpt = Checkpointer(helpers.TinyNet(), str(run))
    ckpt.save("model_0000001", iteration=1)
    (run / "model_0000002.pth").write_bytes(evil.read_bytes())
    ckpt.tag_last_checkpoint("model_0000002.pth")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(model, str(run)).resume_or_load("")
    assert info.value.reason == "unsafe" and info.value.path == str(run / "model_0000002.pth")
    assert _state_equal(before, model.state_dict())
    assert not any("Resumed from" in r.getMessage() for r in caplog.records)

    # Met during a fallback (the last checkpoint is truncated): raises too, not skipped to an even older one.
    (run / "model_0000003.pth").write_bytes(b"PK\x03\x04 truncated")
    os.utime(run / "model_0000001.pth", (1, 1))  # the hostile file is the newest fallback candidate
    ckpt.tag_last_checkpoint("model_0000003.pth")
    with pytest.raises(CheckpointError) as info:
        Checkpointer(model, str(run)).resume_or_load("")
    assert info.value.reason == "unsafe" and info.value.path == str(run / "model_0000002.pth")
    assert _state_equal(before, model.state_dict())
    assert not sentinel.exists()


def test_unsafe_verdict_does_not_depend_on_torchs_wording(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.load re-raising every failure with other words (or with the words of a refusal) changes nothing."""
    sentinel = tmp_path / "pwned"
    evil, garbage = tmp_path / "evil.pth", tmp_path / "garbage.pth"
    HOSTILE["os_system"](evil, sentinel)
    garbage.write_bytes(random.Random(5).randbytes(4096))
    real_load = torch.load

    def reworded(words: str) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:
            try:
                return real_load(*args, **kwargs)
            except pickle.UnpicklingError as exc:
                raise pickle.UnpicklingError(words) from exc

        return load

    for words in ("something went wrong", "Weights only load failed. Unsupported global: GLOBAL posix.system"):
        monkeypatch.setattr(torch, "load", reworded(words))
        with pytest.raises(CheckpointError) as info:
            Checkpointer(nn.Linear(2, 2)).load(str(evil))
        assert info.value.reason == "unsafe"
        with pytest.raises(CheckpointError) as info:
            Checkpointer(nn.Linear(2, 2)).load(str(garbage))
        assert info.value.reason == "corrupt"
    assert not sentinel.exists()


def test_allowed_classes_make_a_refused_file_loadable(tmp_path: pathlib.Path) -> None:
    """The verdict uses the allow-list of the load: classes passed as safe_globals are not unsafe."""
    path = tmp_path / "config.pth"
    torch.save({"model": nn.Linear(2, 2).state_dict(), "config": Config(3)}, path)
    with pytest.raises(CheckpointError, match="it imports test_checkpoint_hostile.Config") as info:
        Checkpointer(nn.Linear(2, 2)).load(str(path))
    assert info.value.reason == "unsafe"
    rest = Checkpointer(nn.Linear(2, 2), safe_globals=[Config]).load(str(path))
    assert isinstance(rest["config"], Config) and rest["config"].depth == 3


# --- truncated and corrupt files keep the fallback -------------------------------------------------------------


def _corrupt_builders() -> dict[str, Callable[[pathlib.Path], None]]:
    def saved(path: pathlib.Path, **kwargs: Any) -> bytes:
        torch.save({"model": helpers.TinyNet().state_dict(), "iteration": 9}, path, **kwargs)
        return path.read_bytes()

    def truncated_zip(path: pathlib.Path) -> None:
        data = saved(path)
        path.write_bytes(data[: len(data) // 2])

    def truncated_legacy(path: pathlib.Path) -> None:
        data = saved(path, _use_new_zipfile_serialization=False)
        path.write_bytes(data[: len(data) // 3])

    def legacy_missing_storage(path: pathlib.Path) -> None:
        data = saved(path, _use_new_zipfile_serialization=False)
        path.write_bytes(data[:-20])

    def zero_bytes(path: pathlib.Path) -> None:
        path.write_bytes(b"")

    def garbage_data_pkl(path: pathlib.Path) -> None:
        good = path.with_suffix(".good")
        saved(good)
        _with_data_pkl(good, random.Random(1).randbytes(300), path)
        good.unlink()

    builders: dict[str, Callable[[pathlib.Path], None]] = {
        f.__name__: f for f in (truncated_zip, truncated_legacy, legacy_missing_storage, zero_bytes, garbage_data_pkl)
    }
    for seed in range(12):
        builders[f"random_{seed}"] = lambda path, seed=seed: path.write_bytes(random.Random(seed).randbytes(2000))
    builders["text"] = lambda path: path.write_text("model_0000004.pth\n")
    return builders


CORRUPT = _corrupt_builders()


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_file_is_corrupt_and_resume_falls_back(
    kind: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.pth"
    CORRUPT[kind](bad)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(helpers.TinyNet()).load(str(bad))
    assert info.value.reason == "corrupt", str(info.value)
    assert str(bad) in str(info.value) and "truncated or corrupt" in str(info.value)

    run = tmp_path / "run"
    source = helpers.TinyNet()
    ckpt = Checkpointer(source, str(run))
    ckpt.save("model_0000001", iteration=1)
    (run / "model_0000002.pth").write_bytes(bad.read_bytes())
    ckpt.tag_last_checkpoint("model_0000002.pth")
    target = helpers.TinyNet()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert Checkpointer(target, str(run)).resume_or_load("") == {"iteration": 1}
    assert _state_equal(source.state_dict(), target.state_dict())
    assert any("falling back" in r.getMessage() for r in caplog.records)


# --- last_checkpoint stays inside save_dir ------------------------------------------------------------------------


def _outside_setup(tmp_path: pathlib.Path) -> tuple[pathlib.Path, nn.Module, nn.Module]:
    """save_dir with a valid checkpoint (iteration 1) and, outside it, another valid one (iteration 666)."""
    run = tmp_path / "run"
    inside = helpers.TinyNet()
    Checkpointer(inside, str(run)).save("model_0000001", iteration=1)
    outside = helpers.TinyNet()
    Checkpointer(outside, str(tmp_path)).save("outside", iteration=666)
    return run, inside, outside


@pytest.mark.parametrize(
    "pointer",
    ["../outside.pth", "ABSOLUTE", "link.pth", "sub/../../outside.pth", "..", "sub/model.pth", ".hidden.pth"],
)
def test_last_checkpoint_outside_save_dir_is_refused(tmp_path: pathlib.Path, pointer: str) -> None:
    run, _, _ = _outside_setup(tmp_path)
    if pointer == "ABSOLUTE":
        pointer = str(tmp_path / "outside.pth")
    if pointer == "link.pth":
        (run / "link.pth").symlink_to(tmp_path / "outside.pth")
    if pointer == "sub/model.pth":
        (run / "sub").mkdir()
        (run / "sub" / "model.pth").write_bytes((run / "model_0000001.pth").read_bytes())
    (run / "last_checkpoint").write_text(pointer)
    model = helpers.TinyNet()
    before = _snapshot(model)
    ckpt = Checkpointer(model, str(run))
    for call in (ckpt.get_checkpoint_file, lambda: ckpt.resume_or_load("")):
        with pytest.raises(CheckpointError) as info:
            call()
        assert info.value.reason == "unsafe"
        message = str(info.value)
        assert "Refused to load" in message and os.path.join(str(run), pointer) in message, message
        assert str(run / "last_checkpoint") in message or "symlink" in message, message
    assert _state_equal(before, model.state_dict())  # neither the outside file nor a fallback was loaded


@pytest.mark.parametrize("content", [b"", b"   \n", b"\x00", b"\xff\xfe\x00garbage"])
def test_empty_or_garbled_last_checkpoint_is_corrupt_and_falls_back(
    tmp_path: pathlib.Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    run, inside, _ = _outside_setup(tmp_path)
    (run / "last_checkpoint").write_bytes(content)
    ckpt = Checkpointer(helpers.TinyNet(), str(run))
    with pytest.raises(CheckpointError, match="does not name a checkpoint") as info:
        ckpt.get_checkpoint_file()
    assert info.value.reason == "corrupt" and info.value.path == str(run / "last_checkpoint")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ckpt.resume_or_load("") == {"iteration": 1}  # never a silent start from scratch
    assert _state_equal(inside.state_dict(), ckpt.model.state_dict())
    assert any(str(run / "last_checkpoint") in r.getMessage() for r in caplog.records)


def test_fallback_never_follows_a_symlink_out_of_save_dir(tmp_path: pathlib.Path) -> None:
    run, _, _ = _outside_setup(tmp_path)
    (run / "model_0000005.pth").symlink_to(tmp_path / "outside.pth")
    (run / "model_0000009.pth").write_bytes(b"garbage")
    Checkpointer(helpers.TinyNet(), str(run)).tag_last_checkpoint("model_0000009.pth")
    os.utime(run / "model_0000001.pth", (1, 1))
    model = helpers.TinyNet()
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match="symlink that leads out") as info:
        Checkpointer(model, str(run)).resume_or_load("")
    assert info.value.reason == "unsafe" and info.value.path == str(run / "model_0000005.pth")
    assert _state_equal(before, model.state_dict())


# --- odd contents that pass the safe loader -----------------------------------------------------------------------


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def get_extra_state(self) -> dict[str, int]:
        return {"version": 1}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"extra state must be a dict, got {type(state).__name__}")


def _good_state() -> dict[str, torch.Tensor]:
    return dict(helpers.TinyNet().state_dict())


def _with_metadata(metadata: Any) -> OrderedDict[str, torch.Tensor]:
    state = OrderedDict(_good_state())
    state._metadata = metadata  # type: ignore[attr-defined]
    return state


ODD: dict[str, tuple[Any, str, str]] = {
    # name: (saved object, expected reason, a phrase of the message)
    "model_is_int": ({"model": 5}, "corrupt", "'model' is a int where a state dict belongs"),
    "model_is_str": ({"model": "weights"}, "corrupt", "'model' is a str"),
    "model_is_list": ({"model": [torch.zeros(2)]}, "corrupt", "'model' is a list"),
    "str_for_tensor": ({"model": {**_good_state(), "fc1.weight": "abc"}}, "corrupt", "'fc1.weight' is a str"),
    "list_for_tensor": ({"model": {**_good_state(), "fc2.bias": [1.0, 2.0]}}, "corrupt", "'fc2.bias' is a list"),
    "none_for_tensor": ({"model": {"fc1.weight": None}}, "corrupt", "'fc1.weight' is a NoneType"),
    "numpy_strings": ({"model": {"fc1.bias": np.array(["a"] * 8)}}, "corrupt", "'fc1.bias' is a ndarray"),
    "metadata_not_a_dict": ({"model": _with_metadata(5)}, "corrupt", "malformed _metadata"),
    "metadata_values": ({"model": _with_metadata({"": 5, "fc1": {}})}, "corrupt", "malformed _metadata"),
    "int_keys": ({"model": {0: torch.zeros(8, 4)}}, "corrupt", "has a int key 0"),
    "bare_int_keys": ({0: torch.zeros(8, 4)}, "corrupt", "has a int key 0"),
    "no_model_key": ({"iteration": 3}, "incompatible", "no 'model' key"),
    "top_level_list": ([1, 2, 3], "corrupt", "does not hold a dict (found list)"),
    "top_level_str": ("model", "corrupt", "does not hold a dict (found str)"),
    "top_level_tensor": (torch.zeros(3), "corrupt", "does not hold a dict (found Tensor)"),
    "sparse_tensor": ({"model": {"fc1.weight": torch.zeros(8, 4).to_sparse()}}, "incompatible", "sparse_coo"),
    "meta_tensor": ({"model": {"fc1.weight": torch.zeros(8, 4, device="meta")}}, "incompatible", "meta"),
    "quantized_tensor": (
        {"model": {"fc1.weight": torch.quantize_per_tensor(torch.zeros(8, 4), 0.1, 0, torch.qint8)}},
        "incompatible",
        "quantized",
    ),
    "optimizer_is_int": ({"model": _good_state(), "optimizer": 5}, "incompatible", "'optimizer' state"),
    "optimizer_garbled": (
        {"model": _good_state(), "optimizer": {"state": {}, "param_groups": "x"}},
        "incompatible",
        "'optimizer' state",
    ),
    "safetensors_marker_garbled": (
        {"__modelmeter_checkpoint__": {"format": "safetensors", "weights": "../x.safetensors"}},
        "corrupt",
        "malformed safetensors marker",
    ),
    "marker_not_a_dict": ({"__modelmeter_checkpoint__": 5, "model": _good_state()}, "corrupt", "malformed"),
}


@pytest.mark.parametrize("kind", sorted(ODD))
def test_odd_contents_raise_checkpoint_error_and_resume_falls_back(
    kind: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    obj, reason, phrase = ODD[kind]
    odd = tmp_path / "odd.pth"
    torch.save(obj, odd)
    model = helpers.TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(model, optimizer=opt).load(str(odd))
    assert info.value.reason == reason, str(info.value)
    assert phrase in str(info.value) and str(odd) in str(info.value), str(info.value)
    if "optimizer" not in kind:
        assert _state_equal(before, model.state_dict())  # checked before anything was copied

    run = tmp_path / "run"
    source = helpers.TinyNet()
    Checkpointer(source, str(run), optimizer=torch.optim.SGD(source.parameters(), lr=0.1)).save(
        "model_0000001", iteration=1
    )
    (run / "model_0000002.pth").write_bytes(odd.read_bytes())
    Checkpointer(source, str(run)).tag_last_checkpoint("model_0000002.pth")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert Checkpointer(model, str(run), optimizer=opt).resume_or_load("") == {"iteration": 1}
    assert _state_equal(source.state_dict(), model.state_dict())
    assert f"Resumed from {run / 'model_0000001.pth'}" in caplog.text


def test_extra_state_refused_by_the_module_is_a_checkpoint_error(tmp_path: pathlib.Path) -> None:
    state = WithExtraState().state_dict()
    state["_extra_state"] = "not a dict"
    torch.save({"model": state}, tmp_path / "extra.pth")
    with pytest.raises(CheckpointError, match="extra state must be a dict") as info:
        Checkpointer(WithExtraState()).load(str(tmp_path / "extra.pth"))
    assert info.value.reason == "incompatible" and info.value.path == str(tmp_path / "extra.pth")


def test_loading_into_a_model_on_the_meta_device_is_an_error(tmp_path: pathlib.Path) -> None:
    """Copying into a meta tensor is a no-op: the load 'succeeded' and the model still held no weights (torch only
    emitted a UserWarning). It is an incompatible checkpoint for that model, raised before anything is copied."""
    Checkpointer(helpers.TinyNet(), str(tmp_path)).save("real")
    with torch.device("meta"):
        model = helpers.TinyNet()
    with pytest.raises(CheckpointError, match=r"fc1\.weight.* meta device.*to_empty") as info:
        Checkpointer(model).load(str(tmp_path / "real.pth"))
    assert info.value.reason == "incompatible"
    assert all(t.is_meta for t in model.state_dict().values())


def test_mis_shaped_tensors_are_skipped_with_fvcores_warning_not_a_crash(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """fvcore's documented leniency stays: a tensor of another shape (also 0-d for 2-d) is skipped and reported."""
    state = _good_state()
    state["fc1.weight"] = torch.tensor(3.0)
    state["fc2.weight"] = torch.zeros(5, 5)
    torch.save({"model": state}, tmp_path / "shapes.pth")
    model = helpers.TinyNet()
    before = _snapshot(model)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Checkpointer(model).load(str(tmp_path / "shapes.pth"))
    assert torch.equal(model.fc1.weight, before["fc1.weight"]) and torch.equal(model.fc1.bias, state["fc1.bias"])
    assert "Skip loading parameter 'fc1.weight'" in caplog.text and "() in the checkpoint but (8, 4)" in caplog.text


def test_sharded_checkpoint_odd_and_hostile_contents(tmp_path: pathlib.Path) -> None:
    """The DCP path: a hostile non-tensor value is unsafe, a malformed marker or metadata corrupt, and a storage
    file outside the checkpoint directory is refused."""
    sentinel = tmp_path / "pwned"

    def save(directory: pathlib.Path, lr: Any = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = helpers.TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.param_groups[0]["lr"] = lr
        Checkpointer(model, str(directory), sharded=True, optimizer=opt).save("s", iteration=3)
        return model, opt

    def load(directory: pathlib.Path) -> dict[str, Any]:
        model = helpers.TinyNet()
        return Checkpointer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)).load(str(directory / "s"))

    save(tmp_path / "good")
    assert load(tmp_path / "good") == {"iteration": 3}

    save(tmp_path / "evil", lr=_Reduce(pathlib.Path.touch, pathlib.Path(sentinel)))
    with pytest.raises(CheckpointError) as info:
        load(tmp_path / "evil")
    assert info.value.reason == "unsafe" and "getattr" in str(info.value)
    assert not sentinel.exists()

    marker = tmp_path / "good" / "s" / "extra.pth"
    torch.save({"__modelmeter_checkpoint__": {"optimizers": 5}, "iteration": 3}, marker)
    with pytest.raises(CheckpointError, match="malformed sharded-checkpoint marker") as info:
        load(tmp_path / "good")
    assert info.value.reason == "corrupt"

    save(tmp_path / "outside")
    metadata_file = tmp_path / "outside" / "s" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for storage in metadata.storage_data.values():
        storage.relative_path = "../../good/s/" + storage.relative_path
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="lies outside the checkpoint") as info:
        load(tmp_path / "outside")
    assert info.value.reason == "unsafe"

    metadata_file.write_bytes(random.Random(3).randbytes(500))
    with pytest.raises(CheckpointError) as info:
        load(tmp_path / "outside")
    assert info.value.reason == "corrupt"

    # .metadata or extra.pth as symlinks that lead out of the checkpoint directory
    for name in (".metadata", "extra.pth"):
        save(tmp_path / name)
        linked = tmp_path / name / "s" / name
        linked.unlink()
        linked.symlink_to(tmp_path / "good" / "s" / name)
        with pytest.raises(CheckpointError, match="symlink that leads out") as info:
            load(tmp_path / name)
        assert info.value.reason == "unsafe" and info.value.path == str(linked)


# --- a full disk, and names that are no file name -----------------------------------------------------------------


def _no_space(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
@pytest.mark.parametrize("where", ["torch.save", "os.fsync", "os.replace", "half_written"])
def test_full_disk_says_no_space_and_leaves_nothing_partial(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fmt: str, where: str
) -> None:
    model = helpers.TinyNet()
    ckpt = Checkpointer(model, str(tmp_path), format=fmt)
    ckpt.save("model_0000001", iteration=1)
    before = sorted(os.listdir(tmp_path))

    def half_written(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a zip")
        _no_space()

    if where == "half_written":
        monkeypatch.setattr(torch, "save", half_written)
    elif where == "torch.save":
        monkeypatch.setattr(torch, "save", _no_space)
    else:
        monkeypatch.setattr(os, where.removeprefix("os."), _no_space)
    with pytest.raises(CheckpointError) as info:
        ckpt.save("model_0000002", iteration=2)
    monkeypatch.undo()
    message = str(info.value)
    assert info.value.reason == "write" and "no space left on device" in message
    assert str(tmp_path / "model_0000002.pth") in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == before  # no partial file, no temp file, no orphan weights
    assert Checkpointer(helpers.TinyNet(), str(tmp_path)).resume_or_load("") == {"iteration": 1}


def test_other_write_errors_name_the_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path))

    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(torch, "save", denied)
    with pytest.raises(CheckpointError, match=r"Could not save checkpoint .*model\.pth: Permission denied") as info:
        ckpt.save("model")
    assert info.value.reason == "write" and "no space" not in str(info.value)

    def over_quota(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(torch, "save", over_quota)
    with pytest.raises(CheckpointError, match=r"model\.pth: no space left \(disk quota exceeded\)"):
        ckpt.save("model")
    assert os.listdir(tmp_path) == []


def test_full_disk_during_a_sharded_save(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = helpers.TinyNet()
    ckpt = Checkpointer(model, str(tmp_path), sharded=True)
    ckpt.save("s1", iteration=1)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        ckpt.save("s2", iteration=2)
    monkeypatch.undo()
    assert info.value.reason == "write" and str(tmp_path / "s2") in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before  # the partial shard directory is gone
    assert Checkpointer(helpers.TinyNet(), str(tmp_path)).resume_or_load("") == {"iteration": 1}


BAD_NAMES = ["", "   ", " model", "a/b", "../escape", "/abs/model", "a\x00b", ".", "..", ".hidden", "x\ny", "a\\b"]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("sharded", [False, True])
def test_save_refuses_names_that_are_not_a_plain_file_name(tmp_path: pathlib.Path, name: str, sharded: bool) -> None:
    run = tmp_path / "run"
    ckpt = Checkpointer(nn.Linear(2, 2), str(run), sharded=sharded)
    with pytest.raises(ValueError, match=r"^Checkpoint name .* (is empty|whitespace|control|relative|path|'\.')"):
        ckpt.save(name)
    with pytest.raises(ValueError, match=r"^last_checkpoint entry"):
        ckpt.tag_last_checkpoint(name + ".pth" if name.strip() else name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_extra_data_may_not_overwrite_the_model_or_a_checkpointable(
    tmp_path: pathlib.Path, sharded: bool, fmt: str
) -> None:
    """``save(name, model=...)`` used to replace the weights in the file (fvcore's ``data.update(kwargs)``): the
    save succeeded and the model state was gone; an extra key named like a checkpointable replaced its state."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters())
    ckpt = Checkpointer(model, str(tmp_path), format=fmt, sharded=sharded, optimizer=optimizer)
    ckpt.save("good", iteration=1)
    for key in ("model", "optimizer", "__modelmeter_checkpoint__"):
        with pytest.raises(ValueError, match=f"extra data {key!r} .* the checkpoint's own"):
            ckpt.save("bad", **{key: "resnet50"})
    assert "bad" not in " ".join(os.listdir(tmp_path))
    assert ckpt.resume_or_load("") == {"iteration": 1}


@pytest.mark.parametrize(
    ("name", "fmt", "sharded"),
    [
        ("a" * 251, "pth", False),
        ("b" * 243, "safetensors", False),
        ("\U0001f600" * 62, "pth", False),
        ("c" * 255, "pth", True),
    ],
    ids=["pth", "safetensors", "emoji", "sharded"],
)
def test_longest_names_save_and_load(tmp_path: pathlib.Path, name: str, fmt: str, sharded: bool) -> None:
    """A name whose checkpoint file (or directory) fits in 255 bytes saves: the hidden temporary names are
    shortened to fit (they were ~30 bytes longer and failed with "File name too long")."""
    model = nn.Linear(2, 2)
    Checkpointer(model, str(tmp_path), format=fmt, sharded=sharded).save(name, iteration=2)
    target = nn.Linear(2, 2)
    assert Checkpointer(target, str(tmp_path), sharded=sharded).resume_or_load("") == {"iteration": 2}
    assert _state_equal(target.state_dict(), model.state_dict())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_retention_of_the_longest_names(tmp_path: pathlib.Path) -> None:
    """Deleting an old ``<name>.pth`` also tries ``<name>.safetensors``, which is too long a name to exist: that
    must not raise ENAMETOOLONG out of ``step``."""
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path))
    periodic = PeriodicCheckpointer(ckpt, 1, max_to_keep=1, file_prefix="p" * 240)
    for iteration in range(3):
        periodic.step(iteration)
    assert sorted(os.listdir(tmp_path)) == ["last_checkpoint", "p" * 240 + "_0000002.pth"]


def test_names_that_are_no_valid_unicode_are_refused_before_writing(tmp_path: pathlib.Path) -> None:
    """A lone surrogate (os.listdir's escape for undecodable bytes) wrote the .pth, then failed with a bare
    UnicodeEncodeError writing last_checkpoint, leaving a checkpoint that last_checkpoint did not name."""
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path))
    with pytest.raises(ValueError, match="not valid Unicode"):
        ckpt.save("model\udcff")
    with pytest.raises(ValueError, match="not valid Unicode"):
        PeriodicCheckpointer(ckpt, period=1, file_prefix="\ud800")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sharded", [False, True])
def test_saving_what_the_checkpointer_cannot_load_back_warns(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, sharded: bool
) -> None:
    """``save(..., args=argparse.Namespace(...))`` or a ``pathlib.Path`` wrote a checkpoint that the same
    Checkpointer then refused (weights_only) when resuming, found out only at the restart; now the save says so."""
    import argparse

    model = nn.Linear(2, 2)
    ckpt = Checkpointer(model, str(tmp_path), sharded=sharded)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ckpt.save("plain", iteration=1, rng=np.random.get_state(), counts={"a": {1, 2}})
        assert [r.getMessage() for r in caplog.records] == []
        ckpt.save("args", args=argparse.Namespace(lr=0.1), iteration=2)
        ckpt.save("args2", args=argparse.Namespace(lr=0.2), iteration=3)  # said once per checkpointer
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "argparse.Namespace" in message and "safe_globals" in message and "args" in message
    with pytest.raises(CheckpointError) as info:
        ckpt.resume_or_load("")
    assert info.value.reason == "unsafe"  # what the warning announced
    caplog.clear()
    trusting = Checkpointer(model, str(tmp_path), sharded=sharded, safe_globals=[argparse.Namespace])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trusting.save("args3", args=argparse.Namespace(lr=0.3))
        assert trusting.resume_or_load("")["args"].lr == 0.3
        Checkpointer(model, str(tmp_path), sharded=sharded, weights_only=False).save("args4", args=argparse.Namespace())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_quick_save_check_agrees_with_the_exact_scan(tmp_path: pathlib.Path) -> None:
    """The check after a save searches the pickle bytes for imports before disassembling them; it must say what
    the pickletools scan says (equality with the un-optimised path) and what loading then does."""
    import argparse

    from modelmeter.checkpoint._storage import _scan_checkpoint, refused_import, safe_globals

    extras: list[Any] = [
        1,
        "c\nx\n",
        "cos\nsystem\n",
        {1, 2},
        np.random.get_state(),
        torch.Size([2]),
        range(3),
        slice(1),
        argparse.Namespace(a=1),
        pathlib.Path("x"),
        _Reduce(pathlib.Path.touch, pathlib.Path(tmp_path / "never")),
        frozenset([1]),
        OrderedDict(a=torch.zeros(2)),
        torch.zeros(2).to_sparse(),
    ]
    path = tmp_path / "x.pth"
    for extra in extras:
        torch.save({"model": nn.Linear(2, 2).state_dict(), "extra": extra}, path)
        with safe_globals():
            exact, _ = _scan_checkpoint(str(path))
        assert refused_import(str(path)) == exact, extra
        try:
            Checkpointer(nn.Linear(2, 2)).load(str(path))
        except CheckpointError as exc:
            assert exc.reason == "unsafe" and exact is not None, extra
        else:
            assert exact is None, extra
    assert not (tmp_path / "never").exists()


def test_names_checked_by_periodic_checkpointer(tmp_path: pathlib.Path) -> None:
    ckpt = Checkpointer(nn.Linear(2, 2), str(tmp_path))
    for prefix in ("../model", "", "a/b", ".x"):
        with pytest.raises(ValueError, match="file_prefix"):
            PeriodicCheckpointer(ckpt, period=1, file_prefix=prefix)
    for period in (0, -1, 1.5, True, "3", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="period must be a positive whole number"):
            PeriodicCheckpointer(ckpt, period=period)  # type: ignore[arg-type]
    assert PeriodicCheckpointer(ckpt, period=np.int64(3)).period == 3
    assert PeriodicCheckpointer(ckpt, period=1000.0).period == 1000  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'last_checkpoint' is the file that names the newest checkpoint"):
        Checkpointer(nn.Linear(2, 2), str(tmp_path), sharded=True).save("last_checkpoint")
    assert os.listdir(tmp_path) == []


def test_random_and_truncated_bytes_are_never_unsafe(tmp_path: pathlib.Path) -> None:
    """Bytes that start like an import by chance (a STACK_GLOBAL or EXT opcode byte, 'c' + junk) stay corrupt."""
    path = tmp_path / "x.pth"
    samples = [random.Random(seed).randbytes(random.Random(seed).randint(0, 2000)) for seed in range(400)]
    state = {"model": nn.Linear(3, 3).state_dict(), "iteration": 3, "rng": np.random.get_state()}
    for legacy in (False, True):
        buffer = io.BytesIO()
        torch.save(state, buffer, _use_new_zipfile_serialization=not legacy)
        data = buffer.getvalue()
        samples += [data[:n] for n in range(0, len(data) - 1, 11)]
    for data in samples:
        path.write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            Checkpointer(nn.Linear(3, 3)).load(str(path))
        assert info.value.reason == "corrupt", (data[:40], str(info.value))


def test_registered_copyreg_extension_is_named(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = 0x7ABC
    monkeypatch.setitem(copyreg._extension_registry, ("posix", "system"), code)  # type: ignore[attr-defined]
    monkeypatch.setitem(copyreg._inverted_registry, code, ("posix", "system"))  # type: ignore[attr-defined]
    path = tmp_path / "ext.pth"
    path.write_bytes(_raw_pickle(b"\x83" + code.to_bytes(2, "little") + b"X\x02\x00\x00\x00id\x85R"))
    with pytest.raises(CheckpointError, match=r"imports posix\.system \(copyreg extension code 31420\)") as info:
        Checkpointer(nn.Linear(2, 2)).load(str(path))
    assert info.value.reason == "unsafe"
