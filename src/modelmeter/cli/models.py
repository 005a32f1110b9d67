"""What the ``modelmeter`` command's MODEL argument names: a model, its default inputs and a display name.

A spec is one of

* a zoo name (``resnet50``; ``modelmeter list`` shows them);
* ``torchvision:NAME`` — ``torchvision.models.get_model(NAME, weights=None)`` (and ``weights_backbone=None``
  where the builder takes it);
* ``timm:NAME`` — ``timm.create_model(NAME, pretrained=False)``;
* ``transformers:CONFIG`` — a config class (``LlamaConfig``) or model type (``llama``) of Hugging Face
  transformers, built with ``AutoModelForCausalLM.from_config`` (decoder-only configs) or
  ``AutoModel.from_config``; ``key=value`` overrides follow as extra arguments or after commas
  (``transformers:LlamaConfig,num_hidden_layers=2``);
* ``path/to/file.py:factory`` or ``package.module:factory`` — ``factory()`` returns a module, or a
  ``(model, inputs)`` pair.

``key=value`` overrides go to the config (transformers) or as keyword arguments to the builder or
factory (everything else). Values are read as Python literals (ints, floats, lists, ``None``), ``true`` /
``false`` as booleans, anything else as a string. Nothing is downloaded: no weights (a ``key=value`` asking
for them is a usage error), no hub configs. An image model built for a size (``image_size=64``) gets default
inputs of that size.

Models are built on the meta device (``device="meta"``, the default: shapes without storage, so a 70B
model costs nothing) or wherever ``device`` says; ``file.py:factory`` models are built where the factory
builds them.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..engine.inputs import map_tensors
from ..errors import InvalidTypeError, InvalidValueError, ModelMeterError, cuda_failure
from .errors import MAX_TENSOR_BYTES, ModelSpecError, one_line, suggest

__all__ = [
    "InputKind",
    "LoadedModel",
    "MissingPackageError",
    "ModelLoadError",
    "ModelSpecError",
    "load_model",
    "parse_overrides",
    "suggest",
]

InputKind = Literal["image", "tokens", "tensor", "custom"]

_EXTRAS = {"torchvision": "vision", "timm": "timm", "transformers": "transformers"}
_DEFAULT_SEQ_LEN = 128
_DEFAULT_IMAGE = (3, 224, 224)


class ModelLoadError(ModelMeterError, RuntimeError):
    """The spec names a model, but building it failed."""


class MissingPackageError(ModelLoadError):
    """The spec needs an optional package that is not installed."""


@dataclass
class LoadedModel:
    """A model ready to analyse, with what it is called with by default.

    ``kind`` says how default inputs are made: ``"image"`` (batch x C x H x W floats, ``resolution``
    sets H and W), ``"tokens"`` (batch x sequence token ids, ``seq_len``), ``"tensor"`` (a fixed
    shape whose first dimension is the batch), ``"custom"`` (the inputs the factory returned).
    """

    model: nn.Module
    name: str
    kind: InputKind
    default_shape: tuple[int, ...] = ()
    input_dtype: torch.dtype = torch.float32
    input_names: tuple[str, ...] = ()  # keyword names the default inputs are passed as; () = positional
    custom_inputs: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        """Where the model's state lives (cpu for a stateless model)."""
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            return tensor.device
        return torch.device("cpu")

    def describe_default_input(self) -> str:
        if self.kind == "custom":
            return "the factory's inputs"
        shape = "x".join(map(str, self.default_shape))
        return f"{shape} {str(self.input_dtype).removeprefix('torch.')}"

    def inputs(self, *, batch: int | None = None, resolution: int | None = None, seq_len: int | None = None,
               dtype: torch.dtype | None = None, real: bool = False) -> Any:
        """The default inputs for ``batch`` samples at ``resolution`` / ``seq_len``: meta tensors (a shape and
        a dtype, no memory), or with ``real`` zeros on the model's device, for a run of real kernels.

        ``dtype`` is the dtype of floating-point inputs (token ids stay integers). Raises
        :class:`ModelSpecError` for an option that does not apply to this model (``resolution`` of a
        language model, say) and for sizes no tensor can have.
        """
        if resolution is not None and self.kind != "image":
            raise ModelSpecError(f"--resolution applies to image models; {self.name} takes {self._what()}")
        if seq_len is not None and self.kind != "tokens":
            raise ModelSpecError(f"--seq-len applies to token models; {self.name} takes {self._what()}")
        if self.kind == "custom":
            if batch is not None:
                raise ModelSpecError(f"the batch of {self.name}'s inputs cannot be set (by --batch, --sweep "
                                     "batch=... or --fit): its factory returned them; give their shapes with --input "
                                     "instead (one run)")
            if dtype is None:
                return self.custom_inputs
            return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, self.custom_inputs)
        if not self.default_shape:
            raise ModelSpecError(f"{self.name} has no default input: give its shape with --input (one run: --sweep "
                                 "and --fit vary the default input), or return (model, inputs) from the factory")
        shape = list(self.default_shape)
        if batch is not None:
            shape[0] = batch
        if resolution is not None:
            shape[-2:] = [resolution, resolution]
        if seq_len is not None:
            shape[1] = seq_len
        tensor_dtype = dtype if dtype is not None and self.input_dtype.is_floating_point else self.input_dtype
        return self._pack([self._zeros(tuple(shape), tensor_dtype, real) for _ in self._slots()])

    def explicit_inputs(self, shapes: Sequence[tuple[tuple[int, ...], torch.dtype | None]],
                        dtype: torch.dtype | None = None, real: bool = False) -> Any:
        """Inputs of the given shapes (each with an optional dtype), passed positionally or by this model's
        input names: meta tensors, or zeros on the model's device with ``real``. Without a dtype an input gets
        the model's input dtype (token ids for language models), or ``dtype`` when that is floating point."""
        default = self.input_dtype if self.kind != "custom" else torch.float32
        if dtype is not None and default.is_floating_point:
            default = dtype
        tensors = [self._zeros(shape, d or default, real) for shape, d in shapes]
        if self.input_names and len(tensors) <= len(self.input_names):
            return dict(zip(self.input_names, tensors, strict=False))
        return tuple(tensors)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, real: bool) -> torch.Tensor:
        """An input: on the meta device (no memory: a fake run needs no values) or, with ``real``, zeros on the
        model's device. Sizes beyond what a tensor can hold are a usage error, found before anything runs."""
        _check_tensor_size(shape, dtype)
        if not real:
            return torch.zeros(shape, dtype=dtype, device="meta")
        try:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # the memory a real run needs is not there
            raise ModelSpecError(f"cannot allocate the input {_shape_text(shape, dtype)} for a run of real "
                                 f"kernels ({type(exc).__name__}: {one_line(exc)}); without --real inputs take no "
                                 "memory") from None

    def _slots(self) -> tuple[str, ...]:
        return self.input_names or ("",)

    def _pack(self, tensors: list[torch.Tensor]) -> Any:
        if self.input_names:
            return dict(zip(self.input_names, tensors, strict=True))
        return tensors[0]

    def _what(self) -> str:
        return {"image": "images", "tokens": "token ids", "tensor": f"a {len(self.default_shape)}-d tensor",
                "custom": "the inputs its factory returned"}[self.kind]


def _check_tensor_size(shape: Sequence[int], dtype: torch.dtype) -> None:
    """Raise :class:`ModelSpecError` for a shape no tensor can have: a size below 1, or more bytes than torch
    can count (2**63 - 1)."""
    if any(size < 1 for size in shape):
        raise ModelSpecError(f"input sizes must be positive, got {_shape_text(shape, dtype)}")
    if math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES:
        raise ModelSpecError(f"an input of {_shape_text(shape, dtype)} would take more bytes than a tensor can hold "
                             "(2**63 - 1): give smaller sizes")


def _shape_text(shape: Sequence[int], dtype: torch.dtype) -> str:
    return "x".join(map(str, shape)) + " " + str(dtype).removeprefix("torch.")


# --- overrides -------------------------------------------------------------------------------------------
_OVERRIDE_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")


def parse_value(text: str) -> Any:
    """``"32"`` -> 32, ``"0.1"`` -> 0.1, ``"true"`` -> True, ``"none"`` -> None, ``"[2,2]"`` -> [2, 2];
    anything else is the text itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["a=1", "b=x,c=2.5"]`` -> ``{"a": 1, "b": "x", "c": 2.5}`` (commas separate ``key=value`` pairs)."""
    out: dict[str, Any] = {}
    for item in items:
        for part in _OVERRIDE_SPLIT.split(item):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise ModelSpecError(f"expected key=value, got {part!r}")
            if key in out:  # the last would win, silently
                raise ModelSpecError(f"{key} is given twice ({key}={out[key]!r} and {part.strip()}): keep one")
            out[key] = parse_value(value)
    return out


def _unknown(what: str, name: str, choices: Sequence[str], fallback: str) -> ModelSpecError:
    close = suggest(name, choices)
    hint = f"did you mean {', '.join(close)}?" if close else fallback
    return ModelSpecError(f"unknown {what} {name!r}; {hint}")


# --- loading ---------------------------------------------------------------------------------------------
def load_model(spec: str, overrides: Sequence[str] = (), *, device: str | torch.device = "meta",
               resolution: int | None = None,
               factory_check: Callable[[Any, Any], None] | None = None) -> LoadedModel:
    """Build the model ``spec`` names (see the module docstring), applying ``key=value`` ``overrides``.

    ``device``: where zoo, torchvision, timm and transformers models are built (meta: no storage).
    ``resolution``: for models whose resolution is fixed at build time (ViTs), the side length to build
    them for. ``factory_check(module, factory)``, if given, runs before a ``file.py:factory`` or
    ``package.module:factory`` is called (the cost guard confines what a baseline file may call). The model
    is returned in eval mode.

    Raises :class:`ModelSpecError` for a spec naming nothing (a usage error), :class:`MissingPackageError`
    when the needed optional package is missing, :class:`ModelLoadError` when building fails.
    """
    spec = spec.strip()
    source, sep, rest = spec.partition(":")
    items = list(overrides)
    if sep and source in ("torchvision", "timm", "transformers"):
        name, *inline = _OVERRIDE_SPLIT.split(rest)
        name = name.strip()
        if not name:
            raise ModelSpecError(f"{spec!r} names no model; e.g. {source}:{_EXAMPLES[source]}")
        kwargs = parse_overrides([*inline, *items])
        loaded = _LOADERS[source](name, kwargs, torch.device(device), resolution)
    elif sep:
        target, _, factory = spec.rpartition(":")
        loaded = _load_factory(target, factory, parse_overrides(items), factory_check)
    elif spec.endswith(".py"):
        raise ModelSpecError(_file_without_factory(spec))
    else:
        loaded = _load_zoo(spec, parse_overrides(items), torch.device(device), resolution)
    _to_eval_mode(loaded, spec)
    return loaded


def _to_eval_mode(loaded: LoadedModel, spec: str) -> None:
    """The model in eval mode. One that cannot switch (torch.export's module, whose graph fixed the mode it was
    exported in, raises NotImplementedError) runs as it is, and the run's assumptions say so."""
    with _building(f"{spec!r} in eval mode"):
        try:
            loaded.model.eval()
        except NotImplementedError as exc:
            loaded.notes.append(f"the model cannot be put in eval mode ({one_line(exc)}): it runs in the mode it "
                                "was made in (torch.export fixes it at export)")


_EXAMPLES = {"torchvision": "resnet50", "timm": "resnet50", "transformers": "LlamaConfig"}


def _require(package: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise MissingPackageError(f"{package} is not installed ({exc}); pip install modelmeter[{_EXTRAS[package]}]") \
            from None


@contextlib.contextmanager
def _building(what: str) -> Iterator[None]:
    """Turn any failure while building into a ModelLoadError naming ``what``."""
    try:
        yield
    except ModelMeterError:
        raise
    except Exception as exc:
        reason = cuda_failure(exc) or f"{type(exc).__name__}: {one_line(exc)}"
        raise ModelLoadError(f"could not build {what}: {reason}") from exc


def _build(builder: Callable[..., nn.Module], kwargs: dict[str, Any], device: torch.device,
           size_key: str | None = None, resolution: int | None = None) -> nn.Module:
    """``builder(**kwargs)`` on ``device``; with ``resolution``, first try passing it as ``size_key``
    (for models like ViTs whose input size is fixed at build time) unless the user set that key."""
    if size_key and resolution is not None and size_key not in kwargs:
        try:
            with torch.device(device):
                return builder(**kwargs, **{size_key: resolution})
        except TypeError as exc:
            if isinstance(exc, ModelMeterError):  # the zoo's own check of an argument: say it, do not retry
                raise
            # the builder takes no size: any resolution works
    with torch.device(device):
        return builder(**kwargs)


# key=value words that name the size of the inputs the command makes, and the option that sets it
_INPUT_OPTIONS = {"batch": "--batch", "batch_size": "--batch", "seq_len": "--seq-len", "seq_length": "--seq-len",
                  "resolution": "--resolution", "image_size": "--resolution"}


def _check_keywords(builder: Callable[..., Any], kwargs: dict[str, Any], what: str) -> None:
    """A ``key=value`` that ``builder`` does not take is a usage error naming the key (with the keys it does
    take), found before anything is built; builders that take ``**kwargs`` are left to say it themselves."""
    try:
        parameters = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return
    missing = [p.name for p in parameters if p.default is p.empty and p.name not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:  # the command calls it with the key=value arguments alone
        needed = " ".join(f"{name}=VALUE" for name in missing)
        raise ModelSpecError(f"{what} has required arguments: write `{what} {needed}`")
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        option = _INPUT_OPTIONS.get(key)
        if key not in accepted and option:  # an input's size, written as a builder's argument
            raise ModelSpecError(f"{what} takes no argument {key!r}: the inputs the command makes are sized by "
                                 f"{option} N")
        if key not in accepted:
            raise _unknown(f"{what} argument", key, accepted,
                           f"it takes {', '.join(accepted)}" if accepted else "it takes no key=value arguments")


def _load_zoo(name: str, kwargs: dict[str, Any], device: torch.device, resolution: int | None) -> LoadedModel:
    from ..zoo import ZOO, available_models, get_model

    if name not in ZOO:
        raise _unknown("model", name, available_models(),
                       "`modelmeter list` shows the built-in models; others: torchvision:NAME, timm:NAME, "
                       "transformers:CONFIG, path/file.py:factory, package.module:factory")
    entry = ZOO[name]
    _check_keywords(entry.builder, kwargs, name)
    size_key = "image_size" if "image_size" in inspect.signature(entry.builder).parameters else None
    shape = tuple(entry.input_shape)
    dtype = entry.input_dtype
    if len(shape) == 4 and dtype.is_floating_point:
        kind: InputKind = "image"
        shape = _image_input(kwargs, size_key, resolution, shape) if size_key else shape
    elif len(shape) == 2 and not dtype.is_floating_point:
        kind = "tokens"
    else:
        kind = "tensor"
    try:
        with _building(name):
            model = _build(lambda **kw: get_model(name, device=device, **kw), kwargs, device, size_key, resolution)
    except (InvalidValueError, InvalidTypeError) as exc:  # the zoo's builders raise these for their arguments
        raise ModelSpecError(str(exc)) from None
    return LoadedModel(model, _display(name, kwargs), kind, shape, dtype)


def _load_torchvision(name: str, kwargs: dict[str, Any], device: torch.device,
                      resolution: int | None) -> LoadedModel:
    torchvision = _require("torchvision")
    names = torchvision.models.list_models()
    if name not in names:
        raise _unknown("torchvision model", name, names, "torchvision.models.list_models() lists them")
    what = f"torchvision:{name}"
    builder = torchvision.models.get_model_builder(name)
    weightless = _without_weights(what, kwargs, [p for p in _TORCHVISION_WEIGHTS
                                                 if p in inspect.signature(builder).parameters])
    shape = _image_input(kwargs, "image_size", resolution, (1, *_DEFAULT_IMAGE))
    with _building(what):
        model = _build(lambda **kw: builder(**kw), {**kwargs, **weightless}, device, "image_size", resolution)
    return LoadedModel(model, _display(what, kwargs), "image", shape)


def _load_timm(name: str, kwargs: dict[str, Any], device: torch.device, resolution: int | None) -> LoadedModel:
    timm = _require("timm")
    if not timm.is_model(name):
        raise _unknown("timm model", name, timm.list_models(), "timm.list_models() lists them")
    what = f"timm:{name}"
    built = {**kwargs, **_without_weights(what, kwargs, ["pretrained"], none=False)}
    _built_side(kwargs, "img_size", resolution)  # before the build: a contradiction is a usage error
    notes = []
    with _building(what):
        try:
            model = _build(lambda **kw: timm.create_model(name, **kw), built, device, "img_size", resolution)
        except Exception as exc:  # some timm constructors read tensor values (.item()); build those for real
            if device.type != "meta":
                raise
            model = _build(lambda **kw: timm.create_model(name, **kw), built, torch.device("cpu"), "img_size",
                           resolution)
            notes.append(f"built on cpu: building on meta failed ({type(exc).__name__}: {one_line(exc)})")
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    shape = _image_input(kwargs, "img_size", resolution, (1, *(cfg.get("input_size") or _DEFAULT_IMAGE)))
    return LoadedModel(model, _display(what, kwargs), "image", shape, notes=notes)


# the arguments of torchvision's builders that load (and download) pretrained weights
_TORCHVISION_WEIGHTS = ("weights", "weights_backbone")


def _without_weights(what: str, kwargs: dict[str, Any], keys: Sequence[str], none: Any = None) -> dict[str, Any]:
    """The ``keys`` of a builder that load pretrained weights, each set to ``none`` (no weights); a usage error
    when a ``key=value`` asks for weights: the command builds no weights and downloads nothing (the counts do not
    depend on them), so a model with weights is not what it would analyse."""
    for key in keys:
        if key in kwargs and kwargs[key] not in (None, none):
            raise ModelSpecError(f"{what} {key}={kwargs[key]!r}: modelmeter loads no weights and downloads nothing "
                                 f"(the counts do not depend on them): drop {key}=")
    return dict.fromkeys(keys, none)


def _image_input(kwargs: dict[str, Any], size_key: str, resolution: int | None,
                 default: tuple[int, ...]) -> tuple[int, ...]:
    """The default input of an image model: ``default``, or images of the side the model was built for with
    ``size_key=N`` (``image_size=64`` builds a ViT that takes nothing else)."""
    side = _built_side(kwargs, size_key, resolution)
    if side is None:
        return default
    if isinstance(side, int) and not isinstance(side, bool):
        height, width = side, side
    elif isinstance(side, (tuple, list)) and len(side) == 2 and all(type(s) is int for s in side):
        height, width = side
    else:  # not a size: the builder says what it takes
        return default
    return (*default[:-2], height, width)


def _built_side(kwargs: dict[str, Any], size_key: str, resolution: int | None) -> Any:
    """The image side a ``size_key=N`` argument builds the model for (None if not given); a usage error when
    ``--resolution`` asks for another."""
    side = kwargs.get(size_key)
    if side is not None and resolution is not None and side != resolution:
        raise ModelSpecError(f"{size_key}={side!r} builds the model for images of that size, and --resolution "
                             f"{resolution} asks for {resolution}x{resolution} ones: keep one")
    return side


def _load_transformers(name: str, kwargs: dict[str, Any], device: torch.device,
                       resolution: int | None) -> LoadedModel:
    transformers = _require("transformers")
    config_cls = _config_class(transformers, name)
    with _building(f"transformers:{name}"):
        defaults = config_cls()
    known = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    for key in kwargs:
        if key not in known and key != "attn_implementation" and not hasattr(defaults, key):
            raise _unknown(f"{config_cls.__name__} setting", key, sorted(known | set(defaults.to_dict())),
                           f"see {config_cls.__name__}'s documentation")
    vision = hasattr(defaults, "image_size") and hasattr(defaults, "num_channels")
    if vision and resolution is not None:
        _built_side(kwargs, "image_size", resolution)
        kwargs.setdefault("image_size", resolution)
    what = f"transformers:{config_cls.__name__}"
    with _building(what):
        config = config_cls(**kwargs)
        auto = transformers.AutoModelForCausalLM if _is_decoder_only(config) else transformers.AutoModel
        with torch.device(device):
            model = auto.from_config(config)
    name_shown = f"{_display(what, kwargs)} ({type(model).__name__})"
    if vision:
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return LoadedModel(model, name_shown, "image", (1, config.num_channels, height, width),
                           input_names=("pixel_values",))
    names = ("input_ids", "decoder_input_ids") if getattr(config, "is_encoder_decoder", False) else ("input_ids",)
    return LoadedModel(model, name_shown, "tokens", (1, _default_seq_len(config)), torch.long, input_names=names)


def _default_seq_len(config: Any) -> int:
    """The default sequence length: 128 tokens, or fewer when the config's positions are fewer (a learned position
    table of 16 rows takes 16 tokens at most; on fake tensors no lookup past its end fails, so 128 would be counted
    for a model that cannot run them)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < _DEFAULT_SEQ_LEN:
        return limit
    return _DEFAULT_SEQ_LEN


def _config_class(transformers: Any, name: str) -> Any:
    """The config class ``name`` (``LlamaConfig``) or of model type ``name`` (``llama``)."""
    candidate = None
    if name.endswith("Config"):
        with contextlib.suppress(Exception):
            candidate = getattr(transformers, name)
    else:
        mapping = transformers.CONFIG_MAPPING
        if name in mapping:
            candidate = mapping[name]
    if isinstance(candidate, type) and issubclass(candidate, _config_base(transformers)):
        return candidate
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # the models' config classes, by name (not AutoConfig nor quantization configs, which build no model)
    choices = sorted({*CONFIG_MAPPING_NAMES.values(), *CONFIG_MAPPING_NAMES.keys()} - {name})
    raise _unknown("transformers config", name, choices,
                   "name a config class such as LlamaConfig, or a model type such as llama")


def _config_base(transformers: Any) -> type:
    return getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig


def _is_decoder_only(config: Any) -> bool:
    """A causal language model that is not also a masked-LM encoder (BERT) or an encoder-decoder (BART)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "")
    return (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_encoder_decoder", False))


def _file_without_factory(path: str) -> str:
    """What to write for a model file named without its factory: ``FILE.py:NAME``, with the functions the file
    defines (read, not imported: its code does not run for a mistake)."""
    file = Path(path).expanduser()
    if not file.is_file():
        return f"no such file: {path}"
    try:
        tree = ast.parse(file.read_bytes())
    except (SyntaxError, ValueError, OSError):
        tree = ast.Module(body=[], type_ignores=[])
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    defines = f"; it defines: {', '.join(names)}" if names else ""
    return f"{path} is a file: name the function that returns the model, {path}:FACTORY{defines}"


def _load_factory(target: str, factory: str, kwargs: dict[str, Any],
                  factory_check: Callable[[Any, Any], None] | None = None) -> LoadedModel:
    if not target or not factory.isidentifier():
        raise ModelSpecError(f"expected path/file.py:factory or package.module:factory, got {target}:{factory}")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if is_file:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ModelSpecError(f"no such file: {target}")
        folder = str(path.resolve().parent)  # the file may import its neighbours, as when run as a script
    else:
        folder = os.getcwd()  # as with `python -m`: packages in the working directory are importable
    with on_path(folder):
        module = _import_file(target, path) if is_file else _import_module(target)
        fn = getattr(module, factory, None)
        if not callable(fn):
            own = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__]
            close = suggest(factory, own)
            hint = f"did you mean {', '.join(close)}?" if close else f"it defines: {', '.join(own) or 'no functions'}"
            raise ModelSpecError(f"{target} has no factory {factory!r}; {hint}")
        if factory_check is not None:
            factory_check(module, fn)
        spec = f"{target}:{factory}"
        _check_keywords(fn, kwargs, spec)
        with _building(spec):
            made = fn(**kwargs)
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, inputs = made
    if not isinstance(made, nn.Module):
        raise ModelLoadError(f"{spec} returned {type(made).__name__}; expected an nn.Module or a (model, inputs) pair")
    if isinstance(inputs, list):  # a list of arguments reads naturally; the analysis takes a tuple
        inputs = tuple(inputs)
    kind: InputKind = "custom" if inputs is not None else "tensor"
    return LoadedModel(made, _display(spec, kwargs), kind, custom_inputs=inputs)


@contextlib.contextmanager
def on_path(folder: str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a user's module is imported and its factory runs."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def _import_file(target: str, path: Path) -> Any:
    resolved = path.resolve()
    module_name = f"_modelmeter_user_{resolved.stem}_{abs(hash(str(resolved)))}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {target} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickling and typing look their module up there
    try:
        with _building(target):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _import_module(target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise ModelSpecError(f"no module named {target!r} (nor a file: write path/file.py:factory)") from None
        raise ModelLoadError(f"could not import {target}: {type(exc).__name__}: {one_line(exc)}") from exc
    except Exception as exc:
        raise ModelLoadError(f"could not import {target}: {type(exc).__name__}: {one_line(exc)}") from exc


def _display(name: str, kwargs: dict[str, Any]) -> str:
    return " ".join([name, *(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in kwargs.items())])


_LOADERS: dict[str, Callable[[str, dict[str, Any], torch.device, int | None], LoadedModel]] = {
    "torchvision": _load_torchvision,
    "timm": _load_timm,
    "transformers": _load_transformers,
}
