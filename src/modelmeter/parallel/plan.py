"""A parallel plan: how many ranks along each mesh dimension, and the options of the data-parallel sharding.

Plain data, no torch: a plan is parsed from the command's ``--parallel dp=2,fsdp=64,tp=8,pp=4``, written back as
the same text (:meth:`ParallelPlan.__str__`), compared, hashed and kept in a trace. What it means on PyTorch's own
machinery (fake process group, DeviceMesh, ``fully_shard``, ``parallelize_module``) is :mod:`.apply`'s.

Mesh dimensions, outermost first (the order of the device mesh, as torchtitan lays it out: tensor parallel
innermost, where ranks share a node's fast links):

- ``pp``: pipeline stages. Carried, not run: the runner records the dp x fsdp x tp part of the plan on the whole
  model for one micro-batch, and :func:`~modelmeter.parallel.pipeline.stage_costs` derives the stages and the 1F1B
  schedule from that trace.
- ``dp``: replicated data parallel — DDP (torch's ``replicate``), or the replicate dimension of HSDP when
  ``fsdp`` > 1 too.
- ``fsdp``: sharded data parallel, sharded as ``zero`` says: 3 shards parameters, gradients and optimizer state
  (FSDP2 ``fully_shard``); 2 keeps the parameters unsharded after the forward pass
  (``fully_shard(reshard_after_forward=False)``); 1 all-reduces gradients as DDP does and shards only the optimizer
  state.
- ``tp``: tensor parallel (``parallelize_module``), with ``sequence_parallel`` for the norms and dropouts between
  its regions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import ParallelPlanError

#: The mesh dimensions, outermost first.
DIMS: tuple[str, ...] = ("pp", "dp", "fsdp", "tp")
#: Dtype names a mixed-precision option takes, and the short names the text may use for them.
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ZERO_STAGES = (1, 2, 3)
#: The most ranks a plan may have: torch's device mesh and process groups hold every rank (about 0.7 KB of memory and
#: 50 µs each to set up), so a world of 2**22 ranks takes some 3 GB and 3 minutes, and much larger ones cannot be
#: simulated (c10d's group size is a 32-bit integer).
MAX_WORLD_SIZE = 2**22
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class ParallelPlan:
    """Ranks per mesh dimension (``dp``, ``fsdp``, ``tp``, ``pp``; world size = their product) and options.

    ``zero``: the ZeRO stage of the ``fsdp`` dimension (3, the default: FSDP2 ``fully_shard``; 2: parameters kept
    unsharded after the forward; 1: gradients all-reduced, optimizer state sharded). ``sequence_parallel``:
    Megatron-style sequence parallelism in the tensor-parallel regions (needs ``tp`` > 1). ``param_dtype`` /
    ``reduce_dtype``: FSDP2's ``MixedPrecisionPolicy`` (parameters all-gathered and computed in ``param_dtype``,
    gradients reduced in ``reduce_dtype``; the sharded parameters — the master weights — keep the model's dtype).
    ``micro_batches``: micro-batches per step of the pipeline (needs ``pp`` > 1). ``rank``: the global rank whose
    run is simulated. ``tp_plan``: a tensor-parallel plan of the user's (module name -> ``ParallelStyle``) used
    instead of the default one; it is not part of the plan's text.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 3
    sequence_parallel: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    micro_batches: int = 1
    rank: int = 0
    tp_plan: tuple[tuple[str, Any], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in (*DIMS, "micro_batches"):
            _check_positive(name, getattr(self, name))
        if self.world_size > MAX_WORLD_SIZE:
            raise ParallelPlanError(f"{self.world_size} ranks (the product of the dimensions): at most "
                                    f"{MAX_WORLD_SIZE} can be simulated, as torch's device mesh holds every rank")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise ParallelPlanError(f"rank={self.rank!r}: a rank of the plan's {self.world_size} ranks "
                                    f"(0 to {self.world_size - 1}) is simulated")
        if self.zero not in _ZERO_STAGES or type(self.zero) is not int:
            raise ParallelPlanError(f"zero={self.zero!r}: the ZeRO stage is 1, 2 or 3")
        if self.zero != 3 and self.fsdp == 1:
            raise ParallelPlanError(f"zero={self.zero}: the ZeRO stage shards the fsdp dimension, which has one "
                                    "rank; give it ranks (e.g. 'fsdp=8,zero=1' rather than 'dp=8,zero=1')")
        if type(self.sequence_parallel) is not bool:
            raise ParallelPlanError(f"sequence_parallel={self.sequence_parallel!r}: True or False")
        if self.sequence_parallel and self.tp == 1:
            raise ParallelPlanError("sequence_parallel: sequence parallelism splits tensor-parallel regions; "
                                    "it needs tp > 1")
        if self.micro_batches > 1 and self.pp == 1:
            raise ParallelPlanError(f"micro_batches={self.micro_batches}: micro-batches are the pipeline's; they "
                                    "need pp > 1 (a rank's batch is the inputs given)")
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None:
                object.__setattr__(self, name, _dtype(name, dtype))
        if (self.param_dtype or self.reduce_dtype) and self.dp == 1 and self.fsdp == 1:
            raise ParallelPlanError("param_dtype/reduce_dtype: mixed precision is FSDP2's policy of the data-"
                                    "parallel dimensions; it needs dp > 1 or fsdp > 1")
        if isinstance(self.tp_plan, Mapping):
            object.__setattr__(self, "tp_plan", tuple(self.tp_plan.items()))
        if self.tp_plan is not None and self.tp == 1:
            raise ParallelPlanError("tp_plan: a tensor-parallel plan needs tp > 1")

    @property
    def world_size(self) -> int:
        """Ranks in all: the product of the dimensions."""
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def mesh(self) -> dict[str, int]:
        """The dimensions with more than one rank, outermost first: the device mesh's named dimensions."""
        return {name: getattr(self, name) for name in DIMS if getattr(self, name) > 1}

    def coordinates(self) -> dict[str, int]:
        """The simulated rank's index along each dimension of :attr:`mesh` (row-major, outermost first)."""
        coordinates = {}
        rest = self.rank
        for name, size in reversed(self.mesh.items()):
            rest, coordinates[name] = divmod(rest, size)
        return dict(reversed(coordinates.items()))

    def options(self) -> dict[str, Any]:
        """The options besides the dimensions, as plain data (``tp_plan`` as ``"custom"`` when one is given)."""
        return {"zero": self.zero, "sequence_parallel": self.sequence_parallel, "param_dtype": self.param_dtype,
                "reduce_dtype": self.reduce_dtype, "micro_batches": self.micro_batches,
                "tp_plan": None if self.tp_plan is None else "custom"}

    def __str__(self) -> str:
        """The plan's text, which :meth:`parse` reads back: the dimensions with more than one rank (``dp=1`` when
        none has), then the options that are not their defaults (a ``tp_plan`` is not written)."""
        parts = [f"{name}={size}" for name, size in self.mesh.items()] or ["dp=1"]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in DIMS or f.name == "tp_plan" or value == f.default:
                continue
            parts.append("sp" if f.name == "sequence_parallel" else f"{f.name}={value}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str, *, tp_plan: Mapping[str, Any] | None = None) -> ParallelPlan:
        """The plan in ``text``: comma-separated ``name=value`` parts, e.g. ``"dp=2,fsdp=64,tp=8,pp=4"``,
        ``"fsdp=8,zero=2,mp=bf16"``, ``"tp=4,sp"``. Names: the dimensions ``dp``, ``fsdp``, ``tp``, ``pp`` (positive
        integers, 1 when not given); ``zero`` (1, 2 or 3); ``sp`` or ``sequence_parallel`` (alone, or ``=true`` /
        ``=false``); ``mp`` (``bf16``/``fp16``: that ``param_dtype`` with ``reduce_dtype=float32``),
        ``param_dtype``, ``reduce_dtype``; ``micro_batches`` (or ``mb``); ``rank``. A
        :class:`~modelmeter.errors.ParallelPlanError` names the part that is wrong."""
        if not isinstance(text, str):
            raise ParallelPlanError(f"a parallel plan is text such as 'fsdp=8,tp=2', got {type(text).__name__}")
        if not text.strip():
            raise ParallelPlanError("an empty parallel plan: give dimensions such as 'fsdp=8,tp=2'")
        values: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> the part that set it
        for raw in text.split(","):
            part = raw.strip()
            name, eq, value = (s.strip() for s in part.partition("="))
            key = _ALIASES.get(name.lower(), name.lower())
            if not part:
                raise ParallelPlanError(f"an empty part in the parallel plan {text!r}")
            if key not in _PARSERS:
                raise ParallelPlanError(f"unknown part {part!r} of the parallel plan: known names are "
                                        f"{', '.join(_KNOWN)}")
            if not eq and key != "sequence_parallel":
                raise ParallelPlanError(f"part {part!r} of the parallel plan has no value: write {name}=<value>")
            for target in _TARGETS.get(key, (key,)):
                if target in given:
                    raise ParallelPlanError(f"part {part!r} of the parallel plan sets {target} again (set by "
                                            f"{given[target]!r})")
                given[target] = part
            values.update(_PARSERS[key](part, value if eq else "true"))
        return cls(**values, tp_plan=None if tp_plan is None else tuple(tp_plan.items()))

    def key(self) -> tuple[Any, ...]:
        """Everything that decides the rank's run, as hashable plain data for the caches' keys: the plan's text
        (the rank in it) and a user's ``tp_plan`` by each style's class and attributes (a style whose attributes
        print their address keys only itself: never a wrong hit, at worst a miss)."""
        styles = None if self.tp_plan is None else tuple(
            (name, type(style).__qualname__, tuple(sorted((k, repr(v)) for k, v in vars(style).items())))
            for name, style in self.tp_plan)
        return str(self), styles

    def with_rank(self, rank: int) -> ParallelPlan:
        """The same plan, simulating ``rank``."""
        return replace(self, rank=rank)


def as_plan(plan: str | ParallelPlan | None) -> ParallelPlan | None:
    """``plan`` as a :class:`ParallelPlan` (text is parsed); None stays None."""
    if plan is None or isinstance(plan, ParallelPlan):
        return plan
    if isinstance(plan, str):
        return ParallelPlan.parse(plan)
    raise ParallelPlanError(f"parallel must be a plan's text such as 'fsdp=8,tp=2' or a ParallelPlan, got "
                            f"{type(plan).__name__}")


def _check_positive(name: str, value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ParallelPlanError(f"{name}={value!r}: a positive whole number of ranks is needed")


def _dtype(name: str, value: Any) -> str:
    text = str(value).lower().removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(text, text)
    if dtype not in DTYPES:
        raise ParallelPlanError(f"{name}={value!r}: one of {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return dtype


def _integer(part: str, value: str) -> int:
    """``value`` in ASCII decimal digits, with an optional sign: not every spelling ``int`` reads (``2_0`` is 20
    to it, a typo more likely than twenty ranks; other scripts' digits)."""
    if not _DECIMAL.fullmatch(value):
        raise ParallelPlanError(f"part {part!r} of the parallel plan: {value!r} is not a whole number (decimal "
                                "digits 0-9)")
    return int(value)


_DECIMAL = re.compile(r"[+-]?[0-9]+")


def _positive(name: str) -> Any:
    def parse(part: str, value: str) -> dict[str, Any]:
        number = _integer(part, value)
        if number < 1:
            raise ParallelPlanError(f"part {part!r} of the parallel plan: {name} must be at least 1")
        return {name: number}

    return parse


def _flag(part: str, value: str) -> dict[str, Any]:
    text = value.lower()
    if text not in _TRUE + _FALSE:
        raise ParallelPlanError(f"part {part!r} of the parallel plan: {value!r} is not true or false")
    return {"sequence_parallel": text in _TRUE}


def _mixed_precision(part: str, value: str) -> dict[str, Any]:
    return {"param_dtype": _dtype("mp", value), "reduce_dtype": "float32"}


_PARSERS = {
    **{name: _positive(name) for name in (*DIMS, "micro_batches")},
    "zero": lambda part, value: {"zero": _integer(part, value)},
    "rank": lambda part, value: {"rank": _integer(part, value)},
    "sequence_parallel": _flag,
    "mp": _mixed_precision,
    "param_dtype": lambda part, value: {"param_dtype": _dtype("param_dtype", value)},
    "reduce_dtype": lambda part, value: {"reduce_dtype": _dtype("reduce_dtype", value)},
}
_ALIASES = {"sp": "sequence_parallel", "mb": "micro_batches"}
_TARGETS = {"mp": ("param_dtype", "reduce_dtype")}  # the fields a shorthand sets
_KNOWN = ("dp", "fsdp", "tp", "pp", "zero", "sp", "mp", "param_dtype", "reduce_dtype", "micro_batches", "rank")
