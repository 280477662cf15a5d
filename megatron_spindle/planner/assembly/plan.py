"""The plan: the only seam between the planner and the runtime.

Frozen dataclasses with a schema version, written to plain JSON that round-trips exactly
(``Plan.from_json(p.to_json()) == p``). A person can read it too: :mod:`.render` prints it as a wave ×
device grid and draws a Gantt chart.

Short names that parse back: a slice prints as ``w3:vision-text.vision.layers[8-15]x4tp2`` (wave 3, layers 8
to 15 inclusive of that MetaOp, on 4 devices with tensor parallelism 2; ``tp1`` is omitted) and
:meth:`SliceRef.from_str` reads it back.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Mapping

from ...atomic import write_file
from ..jsonfile import read_json
from ..workload.cluster import NCCL_COMMUNICATOR_MIB
from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp

SCHEMA_VERSION = 4
"""4: a transfer names the ``token`` it moves where its consumer reads one. 3: MetaOps carry ``recompute``,
``trainable``, ``input_grad``; waves a ``phase``; the plan ``passes``, ``distributed_optimizer``. 2: transfers
carry their messages (1 had byte totals only)."""
PLAN_KIND = "spindle-plan"
#: When a rank posts a transfer's messages (:attr:`Plan.transfer_posting`): ``producer``, right after the slice
#: that makes them; ``boundary``, at the consumer's wave (the paper's runtime). See ``dataflow.posting_key``.
TRANSFER_POSTINGS = ("producer", "boundary")

_SLICE_RE = re.compile(r"^w(\d+):([A-Za-z0-9_.+\-]+)\[(\d+)-(\d+)\]x(\d+)(?:tp(\d+))?$")


@dataclass(frozen=True)
class SliceRef:
    """The parsed short name of a slice."""

    wave: int
    metaop: str
    first_layer: int
    last_layer: int
    devices: int
    tp: int = 1

    def __str__(self) -> str:
        tp = f"tp{self.tp}" if self.tp > 1 else ""
        return f"w{self.wave}:{self.metaop}[{self.first_layer}-{self.last_layer}]x{self.devices}{tp}"

    @classmethod
    def from_str(cls, text: str) -> "SliceRef":
        """Parse a slice name back.

        >>> str(SliceRef.from_str("w3:vision-text.vision.layers[8-15]x4tp2"))
        'w3:vision-text.vision.layers[8-15]x4tp2'
        """
        m = _SLICE_RE.match(text.strip())
        if not m:
            raise ValueError(f"not a slice name: {text!r} (expected like 'w3:vision-text.vision.layers[8-15]x4tp2')")
        w, name, a, b, n, tp = m.groups()
        return cls(int(w), name, int(a), int(b), int(n), int(tp) if tp else 1)


@dataclass(frozen=True, kw_only=True)
class Slice:
    """``num_layers`` consecutive layers of one MetaOp on ``ranks`` during one wave."""

    wave: int
    metaop: str
    layer_start: int
    num_layers: int
    ranks: tuple[int, ...]
    """Devices in order: data-parallel replica ``i`` is ``ranks[i*tp:(i+1)*tp]``."""
    tp: int
    time_ms: float
    """Predicted forward + backward time of the slice."""

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp

    @property
    def layer_stop(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def ref(self) -> SliceRef:
        return SliceRef(self.wave, self.metaop, self.layer_start, self.layer_stop - 1, len(self.ranks), self.tp)

    @property
    def name(self) -> str:
        """``str(self.ref)``, formatted once per slice (the simulator and the data flow look it up often; the
        slice is frozen, so it cannot go stale)."""
        got = self.__dict__.get("_name")
        if got is None:
            got = self.__dict__["_name"] = str(self.ref)
        return got

    def to_json(self) -> dict:
        return {"wave": self.wave, "metaop": self.metaop, "layer_start": self.layer_start,
                "num_layers": self.num_layers, "ranks": list(self.ranks), "tp": self.tp,
                "time_ms": self.time_ms}

    @classmethod
    def from_json(cls, d: Mapping) -> "Slice":
        return cls(wave=d["wave"], metaop=d["metaop"], layer_start=d["layer_start"],
                   num_layers=d["num_layers"], ranks=tuple(d["ranks"]), tp=d["tp"], time_ms=d["time_ms"])


@dataclass(frozen=True, kw_only=True)
class WavePlan:
    index: int
    level: int
    start_ms: float
    duration_ms: float
    slices: tuple[Slice, ...]
    phase: int = 0
    """The runtime runs a pass phase by phase: the forward of the phase's waves in order, then their backward
    in reverse, then the next phase (so a phase's activations are freed before the next one's exist). Phases
    are non-decreasing with the wave index and no transfer crosses one (validation rule 11)."""

    def to_json(self) -> dict:
        return {"index": self.index, "level": self.level, "phase": self.phase, "start_ms": self.start_ms,
                "duration_ms": self.duration_ms, "slices": [s.to_json() for s in self.slices]}

    @classmethod
    def from_json(cls, d: Mapping) -> "WavePlan":
        return cls(index=d["index"], level=d["level"], phase=d["phase"], start_ms=d["start_ms"],
                   duration_ms=d["duration_ms"], slices=tuple(Slice.from_json(s) for s in d["slices"]))


@dataclass(frozen=True, kw_only=True)
class Message:
    """Samples ``[start, stop)`` of one edge's tensor go from rank ``src`` to rank ``dst``.

    ``src == dst`` is a local copy (no communication). ``bytes`` is what the message moves at bf16
    (:data:`.dataflow.ACTIVATION_BYTES` per element).
    """

    src: int
    dst: int
    start: int
    stop: int
    bytes: float

    @property
    def local(self) -> bool:
        return self.src == self.dst

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}[{self.start}:{self.stop}]"

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "start": self.start, "stop": self.stop, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: Mapping) -> "Message":
        return cls(src=d["src"], dst=d["dst"], start=d["start"], stop=d["stop"], bytes=d["bytes"])


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """An edge between slices: ``src`` slice's output feeds ``dst`` slice, which runs in a later wave.

    ``input_index`` is the position among the destination MetaOp's inputs (0 when the same MetaOp continues).
    ``forward``: the messages that move the activation, ``backward`` those that return its gradient, both
    computed once by :mod:`.dataflow`; the simulator times them and the executor posts them, in this order."""

    src: str
    dst: str
    input_index: int
    forward: tuple[Message, ...]
    backward: tuple[Message, ...]
    cross_island_bytes: float
    """Forward bytes that leave their island."""
    token: int | None = None
    """The one token a sample the consumer reads, all the edge moves (``cls`` pool head 0, ``eos`` -1: the last)."""

    @property
    def wave(self) -> int:
        """The consumer's wave: the boundary before it carries this edge (parsed once)."""
        got = self.__dict__.get("_wave")
        if got is None:
            got = self.__dict__["_wave"] = SliceRef.from_str(self.dst).wave
        return got

    @property
    def bytes(self) -> float:
        """Forward bytes, local copies included (backward moves as many bytes of gradient)."""
        return sum(m.bytes for m in self.forward)

    @property
    def local_bytes(self) -> float:
        """Forward bytes that stay on their device (local copies)."""
        return sum(m.bytes for m in self.forward if m.local)

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "input_index": self.input_index,
                "cross_island_bytes": self.cross_island_bytes, "token": self.token,
                "forward": [m.to_json() for m in self.forward], "backward": [m.to_json() for m in self.backward]}

    @classmethod
    def from_json(cls, d: Mapping) -> "Transfer":
        return cls(src=d["src"], dst=d["dst"], input_index=d["input_index"],
                   cross_island_bytes=d["cross_island_bytes"], token=d["token"],
                   forward=tuple(Message.from_json(m) for m in d["forward"]),
                   backward=tuple(Message.from_json(m) for m in d["backward"]))


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """A parameter device group: the devices holding shard ``tp_rank`` of ``param_key``'s layer.

    After backward its gradient is all-reduced (summed) over exactly these ranks.
    """

    param_key: str
    tp_rank: int
    tp: int
    ranks: tuple[int, ...]
    params: int
    """Parameters of this shard."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["ranks"] = list(self.ranks)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "ParamGroup":
        return cls(param_key=d["param_key"], tp_rank=d["tp_rank"], tp=d["tp"], ranks=tuple(d["ranks"]),
                   params=d["params"])


@dataclass(frozen=True, kw_only=True)
class LevelInfo:
    index: int
    c_star_ms: float
    """The level's relaxed optimum (lower bound)."""
    n_star: tuple[tuple[str, float], ...]
    """(MetaOp, relaxed device count) in MetaOp order."""
    variant: str
    """Which candidate schedule won (see :mod:`..step.scheduler`)."""
    bound_ms: float = 0.0
    """Certified integer-aware lower bound of the level's wave schedules (:mod:`..step.solver`); 0 = only ``C*``."""
    bound_kind: str = "C*"
    """How ``bound_ms`` was found: ``C*``, ``area``, ``waves`` or ``optimal``."""

    @property
    def certified_bound_ms(self) -> float:
        return max(self.c_star_ms, self.bound_ms)

    def to_json(self) -> dict:
        return {"index": self.index, "c_star_ms": self.c_star_ms,
                "n_star": [{"metaop": m, "devices": n} for m, n in self.n_star], "variant": self.variant,
                "bound_ms": self.bound_ms, "bound_kind": self.bound_kind}

    @classmethod
    def from_json(cls, d: Mapping) -> "LevelInfo":
        return cls(index=d["index"], c_star_ms=d["c_star_ms"],
                   n_star=tuple((x["metaop"], x["devices"]) for x in d["n_star"]), variant=d["variant"],
                   bound_ms=float(d.get("bound_ms", 0.0)), bound_kind=str(d.get("bound_kind", "C*")))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything the runtime needs to execute one training step of a multi-task model."""

    schema_version: int = SCHEMA_VERSION
    system: str = "spindle"
    """Which planner made it: ``spindle`` or a baseline (``sequential``, ``task-level``, ``intra-task``)."""
    model: str
    graph_fingerprint: str
    """Hash of the task graph the plan was made for: a plan for another model is refused."""
    tasks: tuple[str, ...]
    task_weights: tuple[float, ...]
    world_size: int
    gpus_per_node: int
    memory_limit_bytes: float
    metaops: tuple[MetaOp, ...]
    curves: tuple[tuple[str, ScalingCurve], ...]
    """(MetaOp name, scaling curve) in MetaOp order."""
    levels: tuple[LevelInfo, ...]
    waves: tuple[WavePlan, ...]
    transfers: tuple[Transfer, ...]
    """Every slice-to-slice edge with its messages, by consumer wave (see :mod:`.dataflow`)."""
    param_groups: tuple[ParamGroup, ...]
    device_memory_bytes: tuple[float, ...]
    """Estimated peak memory of each device (parameters, gradients, optimizer state, activations)."""
    makespan_ms: float
    """Predicted compute time of one step (sum of wave durations; transfers and sync not included)."""
    lower_bound_ms: float
    """Σ over levels of C*."""
    passes: int = 1
    """Passes of the plan per optimizer step (gradient accumulation; each pass carries ``1/passes`` of every
    task's global batch per step)."""
    distributed_optimizer: bool = False
    """Whether the optimizer state is sharded over each weight's devices (megatron.core's distributed optimizer);
    the memory estimate assumes it."""
    transfer_posting: str = "producer"
    """When messages are posted (:data:`TRANSFER_POSTINGS`); in the JSON only when not ``producer``, the default."""
    communicator_bytes: float = NCCL_COMMUNICATOR_MIB * 2**20
    """Device memory of one communicator with peers on each member, charged on top of ``device_memory_bytes`` in
    the memory check (:mod:`.communicators`; the cluster's ``communicator_mib``). In the JSON only when it is
    not NCCL's default."""

    # -- lookups ------------------------------------------------------------------------------------
    def metaop(self, name: str) -> MetaOp:
        for m in self.metaops:
            if m.name == name:
                return m
        raise KeyError(f"plan has no MetaOp {name!r}")

    def curve(self, name: str) -> ScalingCurve:
        for m, c in self.curves:
            if m == name:
                return c
        raise KeyError(f"plan has no curve for MetaOp {name!r}")

    def slices(self):
        for w in self.waves:
            yield from w.slices

    def slice(self, name: str | SliceRef) -> Slice:
        ref = name if isinstance(name, SliceRef) else SliceRef.from_str(name)
        for s in self.waves[ref.wave].slices:
            if s.ref == ref:
                return s
        raise KeyError(f"plan has no slice {ref}")

    def rank_slices(self, rank: int) -> list[Slice]:
        """The slices ``rank`` runs, in wave order."""
        return [s for s in self.slices() if rank in s.ranks]

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def level_by_level(self) -> bool:
        """Whether the plan's waves run level by level, as the level scheduler builds them: every wave runs
        MetaOps of the one level its ``level`` names, the waves' levels never go back, and each wave starts
        where the one before it ends. ``makespan_ms`` is then the compute of one pass and ``lower_bound_ms``
        (Σ C*) and the levels' certified bounds bound it. Other plans (a baseline's schedule, task lanes whose
        waves run side by side, a step search's waves across levels) are not bounded by them: only the whole
        step and its bound (:mod:`..simulation.step_bound`) measure those."""
        members = {lv.index: {m for m, _ in lv.n_star} for lv in self.levels}
        clock, last = 0.0, -1
        for w in self.waves:
            if w.level < last or w.level not in members or any(s.metaop not in members[w.level] for s in w.slices):
                return False
            if abs(w.start_ms - clock) > 1e-6 * max(1.0, clock):
                return False
            clock, last = w.start_ms + w.duration_ms, w.level
        return True

    @property
    def phases(self) -> list[list[int]]:
        """Wave indices of each phase, in execution order (see :attr:`WavePlan.phase`)."""
        out: dict[int, list[int]] = {}
        for w in self.waves:
            out.setdefault(w.phase, []).append(w.index)
        return [out[p] for p in sorted(out)]

    # -- JSON -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "kind": PLAN_KIND, "schema_version": self.schema_version, "system": self.system,
            "model": self.model, "graph_fingerprint": self.graph_fingerprint, "tasks": list(self.tasks),
            "task_weights": list(self.task_weights), "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node, "memory_limit_bytes": self.memory_limit_bytes,
            "metaops": [m.to_json() for m in self.metaops],
            "curves": [{"metaop": m, "curve": c.to_json()} for m, c in self.curves],
            "levels": [lv.to_json() for lv in self.levels],
            "waves": [w.to_json() for w in self.waves],
            "transfers": [t.to_json() for t in self.transfers],
            "param_groups": [g.to_json() for g in self.param_groups],
            "device_memory_bytes": list(self.device_memory_bytes),
            "makespan_ms": self.makespan_ms, "lower_bound_ms": self.lower_bound_ms,
            "passes": self.passes, "distributed_optimizer": self.distributed_optimizer,
            **({} if self.transfer_posting == "producer" else {"transfer_posting": self.transfer_posting}),
            **({} if self.communicator_bytes == NCCL_COMMUNICATOR_MIB * 2**20
               else {"communicator_bytes": self.communicator_bytes}),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "Plan":
        if not isinstance(d, Mapping) or d.get("kind") != PLAN_KIND:
            raise ValueError("not a Spindle plan (missing \"kind\": \"spindle-plan\")")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {d.get('schema_version')!r} is not supported (this version "
                             f"reads {SCHEMA_VERSION}): re-plan with `spindle plan ... --out PLAN.json`")
        try:
            plan = cls(
                schema_version=d["schema_version"], system=d["system"], model=d["model"],
                graph_fingerprint=d["graph_fingerprint"], tasks=tuple(d["tasks"]),
                task_weights=tuple(d["task_weights"]), world_size=d["world_size"],
                gpus_per_node=d["gpus_per_node"], memory_limit_bytes=d["memory_limit_bytes"],
                metaops=tuple(MetaOp.from_json(m) for m in d["metaops"]),
                curves=tuple((c["metaop"], ScalingCurve.from_json(c["curve"])) for c in d["curves"]),
                levels=tuple(LevelInfo.from_json(x) for x in d["levels"]),
                waves=tuple(WavePlan.from_json(w) for w in d["waves"]),
                transfers=tuple(Transfer.from_json(t) for t in d["transfers"]),
                param_groups=tuple(ParamGroup.from_json(g) for g in d["param_groups"]),
                device_memory_bytes=tuple(d["device_memory_bytes"]),
                makespan_ms=d["makespan_ms"], lower_bound_ms=d["lower_bound_ms"], passes=d["passes"],
                distributed_optimizer=d["distributed_optimizer"],
                transfer_posting=d.get("transfer_posting", "producer"),
                communicator_bytes=d.get("communicator_bytes", NCCL_COMMUNICATOR_MIB * 2**20))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed plan: {type(e).__name__}: {e}") from None
        _check_task_fields(plan)
        if plan.transfer_posting not in TRANSFER_POSTINGS:
            raise ValueError(f"plan field transfer_posting {plan.transfer_posting!r} must be one of "
                             f"{', '.join(TRANSFER_POSTINGS)}")
        return plan

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str) -> str:
        """Write atomically (:func:`megatron_spindle.atomic.write_file`); returns the path written."""
        return write_file(path, self.dumps(), "plan file")

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_json(read_json(path, "plan file"))


def _check_task_fields(plan: Plan) -> None:
    """``model``, ``tasks`` and ``task_weights`` of a plan read from JSON: a name, the tasks its MetaOps run
    (each once), one finite non-negative weight per task. (The runtime compares them with its graph.)"""
    if not isinstance(plan.model, str) or not plan.model:
        raise ValueError(f"plan field model {plan.model!r} must be the model's name")
    names = plan.tasks
    if not names or not all(isinstance(t, str) and t for t in names) or len(set(names)) != len(names):
        raise ValueError(f"plan field tasks {list(plan.tasks)!r} must name each task once")
    used = {m.task for m in plan.metaops}
    if used != set(plan.tasks):
        odd = sorted(used - set(plan.tasks)) or sorted(set(plan.tasks) - used)
        raise ValueError(f"plan field tasks {list(plan.tasks)!r} does not match the tasks of its MetaOps "
                         f"({', '.join(odd)} {'missing' if used - set(plan.tasks) else 'without a MetaOp'})")
    w = plan.task_weights
    if len(w) != len(plan.tasks) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                            and math.isfinite(x) and x >= 0 for x in w):
        raise ValueError(f"plan field task_weights {list(w)!r} must be one finite non-negative number per task "
                         f"({len(plan.tasks)})")
