"""How a plan runs, beside which slices run where: passes per step, activation recompute, phases, the
distributed optimizer and tensor-parallel degrees. The tuner (:mod:`..tuning.tune`) searches these for every system;
a plan stores what was chosen (``Plan.passes``, ``Plan.distributed_optimizer``, each MetaOp's ``recompute``
and ``tp``, each wave's ``phase``), and the runtime executes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..workload.cluster import Cluster
from ..workload.metaops import RECOMPUTE, MetaOp, tp_divides
from ..workload.recompute import options as recompute_options


@dataclass(frozen=True, kw_only=True)
class Execution:
    """One configuration of a training step."""

    passes: int = 1
    """Passes per optimizer step (gradient accumulation): each pass carries ``1/passes`` of every task's batch."""
    recompute: str | tuple[tuple[str, str], ...] = "none"
    """One mode for every MetaOp that can recompute (``none``, ``selective``, ``full``: what Megatron-LM's
    ``--recompute-*`` flags do for a whole model), or ``(MetaOp, mode)`` pairs (Spindle: where memory binds)."""
    groups: tuple[tuple[str, ...], ...] = ()
    """Spindle's phases: the tasks of each phase, in execution order (a phase's forward and backward run before
    the next phase's); empty: one phase."""
    distributed_optimizer: bool = False
    """megatron.core's distributed optimizer (ZeRO-1): optimizer state sharded over a weight's devices."""
    tp: int = 0
    """0: each MetaOp's tensor-parallel degree from the memory rule (:mod:`..workload.metaops`); ``k``: at least
    ``k`` for every MetaOp that can be split ``k`` ways within an island (Megatron-LM's ``--tensor-model-parallel-size``)."""

    def __post_init__(self) -> None:
        if isinstance(self.passes, bool) or not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"passes must be a positive integer, got {self.passes!r}")
        if isinstance(self.recompute, str) and self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 0:
            raise ValueError(f"tp must be a non-negative integer, got {self.tp!r}")

    @property
    def recomputed(self) -> Mapping[str, str]:
        return dict(self.recompute) if not isinstance(self.recompute, str) else {}

    def label(self) -> str:
        """Short, e.g. ``P=2 recompute=full zero1 tp2 phases=3``."""
        if isinstance(self.recompute, str):
            rc = f"recompute={self.recompute}"
        else:
            modes = [m for _, m in self.recompute if m != "none"]
            rc = f"recompute={len(modes)} MetaOps" if modes else "recompute=none"
        parts = [f"P={self.passes}", rc]
        if self.distributed_optimizer:
            parts.append("zero1")
        if self.tp:
            parts.append(f"tp{self.tp}")
        if len(self.groups) > 1:
            parts.append(f"phases={len(self.groups)}")
        return " ".join(parts)

    def to_json(self) -> dict:
        return {"passes": self.passes, "distributed_optimizer": self.distributed_optimizer, "tp": self.tp,
                "recompute": self.recompute if isinstance(self.recompute, str) else dict(self.recompute),
                "phases": [list(g) for g in self.groups] or None}

    @classmethod
    def from_json(cls, d: Mapping) -> "Execution":
        rc = d.get("recompute", "none")
        return cls(passes=int(d["passes"]), distributed_optimizer=bool(d.get("distributed_optimizer", False)),
                   tp=int(d.get("tp", 0)), recompute=rc if isinstance(rc, str) else tuple(sorted(rc.items())),
                   groups=tuple(tuple(g) for g in d.get("phases") or ()))


def configure(metaops: Sequence[MetaOp], ex: Execution, cluster: Cluster) -> tuple[MetaOp, ...]:
    """``metaops`` with ``ex``'s recompute modes and tensor-parallel degrees."""
    per = ex.recomputed
    unknown = set(per) - {m.name for m in metaops}
    if unknown:
        raise ValueError(f"recompute given for unknown MetaOps {sorted(unknown)}")
    out = []
    for m in metaops:
        mode = ex.recompute if isinstance(ex.recompute, str) else per.get(m.name, "none")
        if mode not in recompute_options(m):
            mode = "none"
        tp = m.tp
        if ex.tp > m.tp and m.tp_splittable and ex.tp <= cluster.gpus_per_node and tp_divides(m.layer, ex.tp) \
                and m.valid_counts(cluster.num_devices):
            tp = ex.tp
        out.append(m if (mode, tp) == (m.recompute, m.tp) else dataclasses.replace(m, recompute=mode, tp=tp))
    return tuple(out)


def task_groups(tasks: Sequence[str], weights: Mapping[str, float], k: int) -> tuple[tuple[str, ...], ...]:
    """``k`` groups of tasks with balanced ``weights`` (longest processing time first, ties by task order),
    each group's tasks in their original order, groups ordered by their first task."""
    if not 1 <= k <= len(tasks):
        raise ValueError(f"cannot split {len(tasks)} tasks into {k} groups")
    load = [0.0] * k
    members: list[list[str]] = [[] for _ in range(k)]
    for t in sorted(tasks, key=lambda t: (-weights.get(t, 0.0), tasks.index(t))):
        j = min(range(k), key=lambda j: (load[j], j))
        members[j].append(t)
        load[j] += weights.get(t, 0.0)
    groups = [tuple(t for t in tasks if t in g) for g in members if g]
    return tuple(sorted(groups, key=lambda g: tasks.index(g[0])))
