"""The device catalog: datasheet numbers, the peak rules, lookups, user device files and ``modelmeter devices``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from modelmeter.cli import main
from modelmeter.devices import (
    DEVICES,
    Device,
    DeviceError,
    device_from_dict,
    device_to_dict,
    get_device,
    list_devices,
    load_devices,
    precision,
)

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
DOC = (ROOT / "docs" / "devices.md").read_text(encoding="utf-8")

# --- the datasheets, as they print them ------------------------------------------------------------------------
# TFLOP/s (TOP/s for int8) exactly as each document states them; ``S(x)``: a figure the datasheet gives "with
# sparsity", whose dense rate is half of it. Memory in GB and bandwidth in GB/s, decimal.


def S(sparse: float) -> float:
    return sparse / 2


DATASHEETS: dict[str, dict[str, object]] = {
    "a100": {"memory": 80, "bandwidth": 2039,  # A100 80GB SXM datasheet column; whitepaper Table 1 (fp16/bf16)
             "matrix": {"fp64": 19.5, "tf32": S(312), "bf16": S(624), "fp16": S(624), "int8": S(1248)},
             "vector": {"fp64": 9.7, "fp32": 19.5, "fp16": 78, "bf16": 39}},
    "h100": {"memory": 80, "bandwidth": 3350,  # H100 SXM datasheet column; Hopper whitepaper Table 3 (fp16/bf16)
             "matrix": {"fp64": 67, "tf32": S(989), "bf16": S(1979), "fp16": S(1979), "fp8": S(3958),
                        "int8": S(3958)},
             "vector": {"fp64": 34, "fp32": 67, "fp16": 133.8, "bf16": 133.8}},
    "h100-pcie": {"memory": 80, "bandwidth": 2000,  # H100 PCIe datasheet column; fp16/bf16: 2 x fp32 (notes)
                  "matrix": {"fp64": 51, "tf32": S(756), "bf16": S(1513), "fp16": S(1513), "fp8": S(3026),
                             "int8": S(3026)},
                  "vector": {"fp64": 26, "fp32": 51, "fp16": 102, "bf16": 102}},
    "h200": {"memory": 141, "bandwidth": 4800,  # H200 SXM datasheet column; fp16/bf16 the H100 SXM5's
             "matrix": {"fp64": 67, "tf32": S(989), "bf16": S(1979), "fp16": S(1979), "fp8": S(3958),
                        "int8": S(3958)},
             "vector": {"fp64": 34, "fp32": 67, "fp16": 133.8, "bf16": 133.8}},
    "b200": {"memory": 180, "bandwidth": 7700,  # HGX B200 per GPU, in PFLOPS with sparsity but FP32/FP64
             "matrix": {"fp64": 37, "tf32": S(2.2e3), "bf16": S(4.5e3), "fp16": S(4.5e3), "fp8": S(9e3),
                        "fp4": S(18e3), "int8": S(9e3)},
             "vector": {"fp64": 37, "fp32": 75}},
    "l4": {"memory": 24, "bandwidth": 300,  # L4 datasheet; fp64 at Ada's 1/64 of fp32 (notes)
           "matrix": {"tf32": S(120), "bf16": S(242), "fp16": S(242), "fp8": S(485), "int8": S(485)},
           "vector": {"fp64": 30.3 / 64, "fp32": 30.3}},
    "mi300x": {"memory": 192, "bandwidth": 5300,  # ROCm's MI300X peak table (dense) and the MI300X data sheet
               "matrix": {"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
                          "fp8": 2614.9, "int8": 2614.9},
               "vector": {"fp64": 81.7, "fp32": 163.4}},
}


GOOD = {"memory": 16e9, "bandwidth": 5e11, "vector": {"fp32": 2e13}}  # the fields a device file needs


def test_the_catalog_has_the_issues_devices() -> None:
    assert list(DEVICES) == list(DATASHEETS)


@pytest.mark.parametrize("name", list(DATASHEETS))
def test_every_number_is_the_datasheets(name: str) -> None:
    sheet, device = DATASHEETS[name], DEVICES[name]
    assert device.memory == sheet["memory"] * 10**9 and isinstance(device.memory, int)
    assert device.bandwidth == pytest.approx(sheet["bandwidth"] * 1e9, rel=1e-12)
    for part in ("matrix", "vector"):
        expected = {key: tflops * 1e12 for key, tflops in sheet[part].items()}  # type: ignore[attr-defined]
        assert dict(getattr(device, part)) == pytest.approx(expected, rel=1e-12), part


@pytest.mark.parametrize("device", DEVICES.values(), ids=list(DEVICES))
def test_every_device_cites_its_documents(device: Device) -> None:
    assert re.search(r"https://\S+(nvidia|amd)\.com", device.source)
    assert re.search(r"datasheet|data sheet|specifications", device.source, re.IGNORECASE)
    # the rules that filled what a document does not list are said
    if "fp16" not in device.vector:
        assert "fp32 vector rate" in device.notes
    if "fp8" not in device.matrix:
        assert "fp8" in device.notes


@pytest.mark.parametrize("name", list(DATASHEETS))
def test_the_docs_table_has_the_catalogs_numbers(name: str) -> None:
    device = DEVICES[name]
    row = next(line for line in DOC.splitlines() if line.startswith(f"| `{name}` "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == device.label
    assert cells[2] == f"{device.memory // 10**9} GB"
    assert float(cells[3].removesuffix(" TB/s")) * 1e12 == pytest.approx(device.bandwidth)
    assert float(cells[6].split()[0]) * 1e12 == pytest.approx(device.matrix["bf16"])
    assert float(cells[10].split()[0]) * 1e12 == pytest.approx(device.vector["fp32"])
    assert all(alias in cells[0] for alias in device.aliases)


# --- the peak rules ---------------------------------------------------------------------------------------------
def _dtype_names() -> list[str]:
    """Every dtype the installed torch has, named as a trace names it."""
    dtypes = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    return sorted(str(dtype).removeprefix("torch.") for dtype in dtypes)


@pytest.mark.parametrize(("dtype", "key"), [
    ("float64", "fp64"), ("complex128", "fp64"), ("float32", "fp32"), ("complex64", "fp32"), ("bfloat16", "bf16"),
    ("bcomplex32", "bf16"), ("float16", "fp16"), ("complex32", "fp16"), ("float8_e4m3fn", "fp8"),
    ("float8_e5m2", "fp8"),
    ("float8_e4m3fnuz", "fp8"), ("float8_e8m0fnu", "fp8"), ("float4_e2m1fn_x2", "fp4"), ("int8", "int8"),
    ("uint8", "int8"), ("qint8", "int8"), ("int64", "int"), ("int32", "int"), ("uint16", "int"), ("bool", "int"),
    ("other", "int"), ("bits8", "int"), ("quint4x2", "int"),
])
def test_each_dtype_has_a_precision(dtype: str, key: str) -> None:
    assert precision(dtype) == key


def test_a_name_that_is_no_dtype_is_refused() -> None:
    with pytest.raises(DeviceError, match="no peak rule for dtype 'float31'"):
        DEVICES["h100"].peak("float31", matrix=True)


@pytest.mark.parametrize("device", DEVICES.values(), ids=list(DEVICES))
def test_every_torch_dtype_has_a_positive_peak_on_every_device(device: Device) -> None:
    for dtype in [*_dtype_names(), "other"]:
        for matrix in (True, False):
            for tf32 in (True, False):
                rate = device.peak(dtype, matrix=matrix, tf32=tf32)
                assert 0 < rate < math.inf, (dtype, matrix, tf32)


@pytest.mark.parametrize(("name", "dtype", "matrix", "tf32", "tflops"), [
    # float32 matrix products: the fp32 (vector) rate unless TF32 is allowed, as PyTorch's default
    ("h100", "float32", True, False, 67), ("h100", "float32", True, True, S(989)),
    ("a100", "float32", True, False, 19.5), ("a100", "float32", True, True, S(312)),
    ("mi300x", "float32", True, False, 163.4), ("mi300x", "float32", True, True, 653.7),  # fp32 matrix cores
    ("a100", "complex64", True, False, 19.5),
    # the tensor-core rate of the dtype
    ("h100", "bfloat16", True, False, S(1979)), ("a100", "float16", True, False, S(624)),
    ("h100", "float8_e4m3fn", True, False, S(3958)), ("h100", "float8_e5m2", True, False, S(3958)),
    ("h100", "float64", True, False, 67), ("l4", "int8", True, False, S(485)), ("l4", "uint8", True, False, S(485)),
    ("b200", "float4_e2m1fn_x2", True, False, S(18e3)),
    # no matrix rate of its own: the next wider format's (fp4 -> fp8 -> fp16), else the vector units
    ("a100", "float8_e4m3fn", True, False, S(624)), ("h100", "float4_e2m1fn_x2", True, False, S(3958)),
    ("a100", "float4_e2m1fn_x2", True, False, S(624)), ("l4", "float64", True, False, 30.3 / 64),
    ("h100", "int64", True, False, 67), ("h100", "bool", True, False, 67),
    # vector work: its own rate, else the fp32 rate; tf32 changes nothing there
    ("a100", "bfloat16", False, False, 39), ("a100", "float16", False, True, 78), ("h100", "float64", False, False, 34),
    ("b200", "bfloat16", False, False, 75), ("h100", "float32", False, True, 67),
    ("h100", "float8_e4m3fn", False, False, 67), ("mi300x", "int32", False, False, 163.4),
    ("l4", "other", False, False, 30.3),
])
def test_the_peak_rules(name: str, dtype: str, matrix: bool, tf32: bool, tflops: float) -> None:
    assert DEVICES[name].peak(dtype, matrix=matrix, tf32=tf32) == pytest.approx(tflops * 1e12, rel=1e-12)


def test_the_ridge_is_peak_over_bandwidth() -> None:
    assert DEVICES["h100"].ridge() == pytest.approx(S(1979e12) / 3.35e12)
    assert DEVICES["a100"].ridge("float32", tf32=True) == pytest.approx(S(312e12) / 2039e9)
    assert DEVICES["l4"].ridge("float32", matrix=False) == pytest.approx(30.3e12 / 300e9)


def _device(**changes: object) -> Device:
    fields: dict[str, object] = {"name": "mine", "label": "Mine", "memory": 10**9, "bandwidth": 1e11,
                                 "matrix": {"bf16": 1e13}, "vector": {"fp32": 1e12}}
    return Device(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_device_without_fp64_refuses_float64_work_rather_than_guess() -> None:
    mine = _device()
    assert mine.peak("float32", matrix=True) == 1e12 and mine.peak("float16", matrix=False) == 1e12
    assert mine.peak("float8_e4m3fn", matrix=True) == 1e12  # fp8 -> fp16 -> no matrix rate: vector fp32
    with pytest.raises(DeviceError, match="device 'mine' has no fp64 rate for float64 work"):
        mine.peak("float64", matrix=True)


@pytest.mark.parametrize(("changes", "words"), [
    ({"memory": 0}, "memory must be a positive whole number of bytes"),
    ({"memory": 1.5e9}, "memory must be a positive whole number of bytes"),
    ({"bandwidth": -1.0}, "bandwidth must be a positive, finite number of bytes/s"),
    ({"bandwidth": math.inf}, "bandwidth must be a positive, finite"),
    ({"matrix": {"bf16": math.nan}}, "matrix.bf16 must be a positive, finite number of FLOP/s"),
    ({"matrix": {"bf16": True}}, "matrix.bf16 must be a positive, finite number"),
    ({"vector": {"fp32": 1e12, "tf32": 1e12}}, "vector.tf32 is not a precision (a tensor-core format"),
    ({"matrix": {"fp12": 1e12}}, "matrix.fp12 is not a precision; known: fp64, fp32, tf32"),
    ({"vector": {"fp16": 1e12}}, "vector.fp32 is missing"),
    ({"name": " "}, "device name must be a non-empty string"),
    ({"aliases": "mine2"}, "aliases must be a list of names"),
])
def test_a_device_is_checked_where_it_is_made(changes: dict[str, object], words: str) -> None:
    with pytest.raises(DeviceError, match=re.escape(words)):
        _device(**changes)


def test_a_device_is_a_value() -> None:
    h100 = DEVICES["h100"]
    assert pickle.loads(pickle.dumps(h100)) == h100  # the command's sweeps send settings to other processes
    assert hash(h100) == hash(get_device("h100-sxm"))
    matrix = {"bf16": 1e13}
    mine = _device(matrix=matrix)
    matrix["bf16"] = 1.0  # the Device keeps its own copy
    assert mine.matrix["bf16"] == 1e13


@pytest.mark.parametrize("device", [*DEVICES.values(), _device(aliases=("m",), source="s", notes="n")],
                         ids=[*DEVICES, "mine"])
def test_a_device_round_trips_through_json(device: Device) -> None:
    data = json.loads(json.dumps(device_to_dict(device)))
    back = device_from_dict(data)
    assert back == device and back.notes == device.notes and back.label == device.label
    assert device_from_dict(dataclasses.asdict(device)) == device  # what a saved trace keeps of a user's device
    assert data["name"] == device.name and data["memory"] == device.memory and data["matrix"] == device.matrix
    assert data["aliases"] == list(device.aliases) and data["source"] == device.source


@pytest.mark.parametrize(("data", "words"), [
    ({"label": "x"}, "saved: expected a table of a device's fields and its 'name'"),
    ([1], "saved: expected a table of a device's fields and its 'name'"),
    ({"name": "g", **GOOD, "vector": {}}, "saved: device 'g': vector.fp32 is missing"),
])
def test_device_data_is_checked(data: object, words: str) -> None:
    with pytest.raises(DeviceError, match=re.escape(words)):
        device_from_dict(data, "saved")


# --- lookups -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "expected"), [
    ("h100", "h100"), ("H100", "h100"), ("h100-sxm", "h100"), ("H100 SXM5", "h100"), ("h100_sxm5_80gb", "h100"),
    ("  A100-SXM4-80GB ", "a100"), ("a100-sxm4", "a100"), ("h100-pcie", "h100-pcie"), ("h200-sxm", "h200"),
    ("B200", "b200"), ("l4", "l4"), ("MI300X", "mi300x"), ("amd-mi300x", "mi300x"),
])
def test_names_and_aliases_in_any_case(name: str, expected: str) -> None:
    assert get_device(name) is DEVICES[expected]


def test_names_and_aliases_are_unique_and_canonical() -> None:
    names = [n for device in DEVICES.values() for n in (device.name, *device.aliases)]
    assert len(names) == len(set(names))
    assert all(n == "-".join(n.lower().split()) and "_" not in n for n in names)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(DeviceError) as info:
        get_device("h1000")
    message = str(info.value)
    assert message.startswith("unknown device 'h1000' (did you mean 'h100'?); known: a100, h100, h100-pcie, ")
    assert all(name in message for name in DEVICES) and ".json/.toml" in message


def test_a_device_is_its_own_name() -> None:
    mine = _device()
    assert get_device(mine) is mine
    with pytest.raises(DeviceError, match="a device is a name .*, not None"):
        get_device(None)  # type: ignore[arg-type]


def test_a_device_added_to_the_catalog_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DEVICES, "mine", _device(name="Mine", aliases=("My GPU",)))
    assert get_device("MY_GPU") is DEVICES["mine"] and get_device("mine") is DEVICES["mine"]


# --- devices of your own -----------------------------------------------------------------------------------------
def _doc_example(language: str) -> str:
    """The example device file of docs/devices.md in ``language``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC, re.DOTALL)
    assert len(blocks) == 1, language
    return str(blocks[0])


@pytest.mark.parametrize(("language", "suffix"), [("toml", ".toml"), ("json", ".json")])
def test_the_docs_example_loads(tmp_path: Path, language: str, suffix: str) -> None:
    path = tmp_path / f"my_devices{suffix}"
    path.write_text(_doc_example(language), encoding="utf-8")
    devices = load_devices(path)
    assert list(devices) == ["rtx4090"]
    rtx = devices["rtx4090"]
    assert rtx.label == "NVIDIA GeForce RTX 4090" and rtx.memory == 24 * 10**9 and isinstance(rtx.memory, int)
    assert rtx.bandwidth == 1008e9 and rtx.aliases == ("4090",)
    assert rtx.matrix == {"tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12, "fp8": 330.3e12, "int8": 660.6e12}
    assert rtx.vector == {"fp32": 82.6e12, "fp16": 82.6e12, "fp64": 1.29e12}
    assert rtx.peak("bfloat16", matrix=True) == 165.2e12
    assert get_device("4090", devices_file=path) == rtx
    assert get_device(str(path)) == rtx  # a file of one device names it


def test_both_formats_say_the_same() -> None:
    assert json.loads(_doc_example("json")) == _toml_module().loads(_doc_example("toml"))


def _toml_module() -> types.ModuleType:
    import tomllib

    return tomllib


def _write(tmp_path: Path, text: str, suffix: str = ".json") -> Path:
    path = tmp_path / f"devs{suffix}"
    path.write_text(text, encoding="utf-8")
    return path


def test_your_devices_come_first(tmp_path: Path) -> None:
    mine = {"h100": {**GOOD, "label": "my H100"}, "Tiny_GPU": {**GOOD, "aliases": ["tiny"], "notes": "n"}}
    path = _write(tmp_path, json.dumps({"devices": mine}))
    assert get_device("h100", devices_file=path).label == "my H100"
    assert get_device("h100-sxm", devices_file=path) is DEVICES["h100"]  # the catalog's alias, not taken
    tiny = get_device("TINY", devices_file=str(path))
    assert tiny.name == "tiny-gpu" and tiny.label == "Tiny_GPU" and tiny.source == str(path) and tiny.notes == "n"
    assert [d.name for d in list_devices(path)] == ["h100", "tiny-gpu", "a100", "h100-pcie", "h200", "b200", "l4",
                                                    "mi300x"]
    with pytest.raises(DeviceError, match=rf"known \(2 from {re.escape(str(path))}\): h100, tiny-gpu, a100"):
        get_device("huge", devices_file=path)
    with pytest.raises(DeviceError, match=r"describes 2 devices \(h100, tiny-gpu\): name one"):
        get_device(str(path))


@pytest.mark.parametrize(("text", "words"), [
    (json.dumps({"devices": {"g": {"memory": 1e9, "vector": {"fp32": 1e12}}}}),
     "device 'g': the field 'bandwidth' (bytes/s) is missing"),
    (json.dumps({"devices": {"g": {**GOOD, "bandwith": 1e12}}}),
     "device 'g': unknown field 'bandwith' (did you mean 'bandwidth'?); fields: label, memory"),
    (json.dumps({"devices": {"g": {**GOOD, "bandwidth": "5e11"}}}),
     "device 'g': bandwidth must be a positive, finite number of bytes/s, not '5e11'"),
    (json.dumps({"devices": {"g": {**GOOD, "matrix": {"bf16": -1}}}}),
     "device 'g': matrix.bf16 must be a positive, finite number of FLOP/s, not -1"),
    ('{"devices": {"g": {"memory": 1e9, "bandwidth": NaN, "vector": {"fp32": 1e12}}}}',
     "device 'g': bandwidth must be a positive, finite number of bytes/s, not nan"),
    (json.dumps({"devices": {"g": {**GOOD, "memory": 1.5}}}),
     "device 'g': memory must be a positive whole number of bytes, not 1.5"),
    (json.dumps({"devices": {"g": {**GOOD, "vector": {"fp16": 1e12}}}}), "device 'g': vector.fp32 is missing"),
    (json.dumps({"devices": {"g": {**GOOD, "matrix": [1e12]}}}),
     "device 'g': matrix must be a table of FLOP/s by precision, not [1000000000000.0]"),
    (json.dumps({"devices": {"g": {**GOOD, "aliases": "h"}}}), "device 'g': aliases must be a list of names"),
    (json.dumps({"devices": {"g": {**GOOD, "label": 3}}}), "device 'g': label must be a string, not 3"),
    (json.dumps({"devices": {"g": 3}}), "device 'g': expected a table of fields, not 3"),
    (json.dumps({"devices": {"g": GOOD, "h": {**GOOD, "aliases": ["G"]}}}),
     "device 'h': the name 'g' is also device 'g''s"),
    (json.dumps({"devices": {"g.json": GOOD}}), "'g.json' cannot name a device"),
    (json.dumps({"devices": {}}), "'devices' must be a table of devices by name, and name one at least"),
    (json.dumps({"g": GOOD}), "expected a table 'devices' of devices by name"),
    (json.dumps([GOOD]), "expected a table 'devices' of devices by name"),
    (json.dumps({"devices": {"g": GOOD}, "version": 1}), "unknown key 'version' at the top"),
    ('{"devices": ', "not valid JSON: Expecting value: line 1 column 13"),
])
def test_a_bad_json_file_names_the_file_the_device_and_the_field(tmp_path: Path, text: str, words: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(DeviceError) as info:
        load_devices(path)
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value), str(info.value)


@pytest.mark.parametrize(("text", "words"), [
    ("[devices.g]\nmemory = 1e9\nbandwidth = 1e11\n[devices.g.vector]\nfp32 = 'fast'\n",
     "device 'g': vector.fp32 must be a positive, finite number of FLOP/s, not 'fast'"),
    ("[devices.g]\nmemory = 1e9\nbandwidth = 1e11\n[devices.g.matrix]\nbf16 = 1e13\n",
     "device 'g': the field 'vector' (a table of FLOP/s) is missing"),
    ("[devices.g]\nmemory = 1e9\nbandwidth = \n", "not valid TOML: "),
])
def test_a_bad_toml_file_names_the_file_the_device_and_the_field(tmp_path: Path, text: str, words: str) -> None:
    path = _write(tmp_path, text, ".toml")
    with pytest.raises(DeviceError) as info:
        load_devices(path)
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value), str(info.value)


def test_a_file_that_is_not_there_or_not_json_or_toml(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match="missing.toml: no such device file"):
        load_devices(tmp_path / "missing.toml")
    with pytest.raises(DeviceError, match="missing.json: no such device file"):
        get_device(str(tmp_path / "missing.json"))
    with pytest.raises(DeviceError, match=r"devs.yaml: a device file is JSON \(.json\) or TOML \(.toml\)"):
        load_devices(_write(tmp_path, "devices: {}", ".yaml"))


def test_toml_on_python_310(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.10 has no tomllib: the ``tomli`` package reads TOML when it is installed; without it, an error
    that says to install it or write JSON."""
    path = _write(tmp_path, _doc_example("toml"), ".toml")
    monkeypatch.setattr(sys, "version_info", (3, 10, 12, "final", 0))
    monkeypatch.setitem(sys.modules, "tomli", None)  # not installed
    with pytest.raises(DeviceError, match=r"needs Python 3.11 or the 'tomli' package .*; or write the devices as JSON"):
        load_devices(path)
    fake = types.ModuleType("tomli")
    fake.loads = _toml_module().loads  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tomli", fake)
    assert list(load_devices(path)) == ["rtx4090"]


# --- modelmeter devices ------------------------------------------------------------------------------------------
def _run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


def test_the_listing_has_a_row_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = _run(capsys, "devices")
    rows = {line.split()[0]: line for line in out.splitlines()[3:] if line and not line.startswith(("-", "*"))}
    assert list(rows) == list(DEVICES)
    h100 = rows["h100"].split("  ")
    cells = [cell.strip() for cell in h100 if cell.strip()]
    # name, label, memory, bandwidth, bf16, fp16, fp32, tf32, fp8 (TFLOP/s), ridge (FLOPs/byte) by hand
    assert cells == ["h100", "NVIDIA H100 SXM5 80GB", "80 GB", "3.35 TB/s", "989.5", "989.5", "67", "494.5",
                     "1979", f"{989.5 / 3.35:.0f}"]
    assert rows["a100"].split()[-2] == "-"  # no fp8 tensor cores
    assert rows["mi300x"].split()[-4] == "163.4"  # fp32 matrix products on the matrix cores


def test_the_listing_as_json_and_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    rows = json.loads(_run(capsys, "devices", "--format", "json")[0])
    assert [row["name"] for row in rows] == list(DEVICES)
    for row in rows:
        device = DEVICES[row["name"]]
        assert row["matrix"] == device.matrix and row["vector"] == device.vector and row["origin"] == "built-in"
        assert row["memory"] == device.memory and row["bandwidth"] == device.bandwidth
        assert row["ridge"] == pytest.approx(device.peak("bfloat16", matrix=True) / device.bandwidth)
        assert row["source"] == device.source and row["aliases"] == list(device.aliases)
    out, _ = _run(capsys, "devices", "--format", "markdown")
    lines = out.splitlines()
    assert lines[0] == "| name | device | memory | bandwidth | bf16 | fp16 | fp32 | tf32 | fp8 | ridge |"
    assert lines[2] == "| a100 | NVIDIA A100 SXM4 80GB | 80 GB | 2.04 TB/s | 312 | 312 | 19.5 | 156 | - | 153 |"


def test_the_listing_with_your_devices(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _write(tmp_path, _doc_example("toml"), ".toml")
    out, _ = _run(capsys, "devices", "--devices-file", str(path))
    cells = [cell.strip() for cell in out.splitlines()[3].split("  ") if cell.strip()]
    assert cells == ["rtx4090*", "NVIDIA GeForce RTX 4090", "24 GB", "1.01 TB/s", "165.2", "165.2", "82.6", "82.6",
                     "330.3", f"{165.2 / 1.008:.0f}"]
    assert f"*: from {path}" in out
    rows = json.loads(_run(capsys, "devices", "--devices-file", str(path), "--format", "json")[0])
    assert rows[0]["name"] == "rtx4090" and rows[0]["origin"] == str(path) and rows[1]["origin"] == "built-in"


def test_a_bad_devices_file_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"devices": {"g": {**GOOD, "bandwith": 1}}}))
    _, err = _run(capsys, "devices", "--devices-file", str(path), code=2)
    assert err.startswith(f"modelmeter: --devices-file: {path}: device 'g': unknown field 'bandwith'")
    assert err.count("\n") == 1


def test_the_help_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = _run(capsys, "--help")
    assert "\n       modelmeter devices [--devices-file FILE]" in out
    assert "`modelmeter devices`" in " ".join(out.split())
    out, _ = _run(capsys, "devices", "--help")
    assert out.startswith("usage: modelmeter devices ") and "--devices-file FILE" in out and "--sweep" not in out


@pytest.mark.parametrize(("argv", "words"), [
    (["devices"], "h100-pcie"), (["devices", "--format", "json"], '"h100-pcie"'),
    (["devices", "--help"], "usage: modelmeter devices"),
])
def test_the_listing_does_not_import_torch(argv: list[str], words: str) -> None:
    """In a fresh process (this one has torch already): the command answers, and torch was never imported."""
    code = (f"import sys; from modelmeter_cli import main; status = main({argv!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    assert words in done.stdout and not done.stderr
