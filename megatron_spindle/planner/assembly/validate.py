"""Plan validation: pure, numbered rules. Each violation names its rule, wave and device.

Rules:

1. every slice's ranks are distinct devices in ``[0, world_size)``;
2. no device is used twice in one wave;
3. a slice's device count is valid for its MetaOp (``tp · d``, ``d`` dividing the batch) and its ``tp``
   equals the MetaOp's; every tensor-parallel group lies in one island and lists its ranks in ascending
   order (a device's position in the group is its rank in the torch process group); MetaOps that share a
   weight shard it one way (the same ``tp``: a device's copies of one shard are summed into one gradient);
4. every layer of every MetaOp is scheduled exactly once;
5. dependencies: a slice starts after its MetaOp's earlier layers and its producers' last layers, i.e. in a
   later wave;
6. waves are in time order (each starts when the previous one ends) and levels never go back;
7. every device's memory estimate, its NCCL communicators' buffers included (:mod:`.communicators`), is
   within the limit;
8. parameter device groups are exactly the devices that hold each weight shard;
9. the plan is for the graph it is used with (fingerprint and world size), when those are given;
10. the stored data flow (transfers and their messages) is what :mod:`.dataflow` derives from the slices, so
    the simulator and the executor, which read only the stored messages, agree with the slices;
11. execution settings: phases never go back with the wave index and no transfer crosses a phase (a phase's
    backward runs before the next phase's forward, so an edge between phases would return its gradient too
    late); a MetaOp recomputes only if its layer type can (:mod:`..workload.recompute`); ``passes`` is a
    positive integer.

:func:`check_plan` raises :class:`PlanError` listing every violation, with the wave × device grid and the
offending cell marked (``>…<``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..workload.recompute import options as recompute_options
from .communicators import communicators_per_device
from .dataflow import param_groups, plan_transfers
from .plan import Plan, SliceRef
from .render import grid


@dataclass(frozen=True)
class Violation:
    rule: int
    message: str
    wave: int | None = None
    device: int | None = None

    def __str__(self) -> str:
        where = []
        if self.wave is not None:
            where.append(f"wave {self.wave}")
        if self.device is not None:
            where.append(f"device {self.device}")
        return f"rule {self.rule}" + (f" ({', '.join(where)})" if where else "") + f": {self.message}"


class PlanError(ValueError):
    def __init__(self, violations: Sequence[Violation], grid: str = "") -> None:
        self.violations = list(violations)
        text = "invalid plan:\n  " + "\n  ".join(str(v) for v in self.violations[:20])
        if len(self.violations) > 20:
            text += f"\n  ... and {len(self.violations) - 20} more"
        if grid:
            text += "\n" + grid
        super().__init__(text)


def violations(plan: Plan) -> list[Violation]:
    out: list[Violation] = []
    N = plan.world_size
    by_name = {m.name: m for m in plan.metaops}
    # 1-3
    for w in plan.waves:
        seen: dict[int, str] = {}
        for s in w.slices:
            m = by_name.get(s.metaop)
            if m is None:
                out.append(Violation(4, f"slice {s.name} names unknown MetaOp {s.metaop!r}", w.index))
                continue
            if len(set(s.ranks)) != len(s.ranks):
                out.append(Violation(1, f"slice {s.name} lists a device twice: {s.ranks}", w.index))
            for r in s.ranks:
                if not 0 <= r < N:
                    out.append(Violation(1, f"slice {s.name} uses device {r} outside 0..{N - 1}", w.index, r))
                elif r in seen and seen[r] != s.name:
                    out.append(Violation(2, f"device used by both {seen[r]} and {s.name}", w.index, r))
                seen[r] = s.name
            if len(s.ranks) not in m.valid_counts(N):
                out.append(Violation(3, f"slice {s.name} runs on {len(s.ranks)} devices; valid counts for "
                                        f"{m.name} are {m.valid_counts(N)}", w.index))
            if s.tp != m.tp:
                out.append(Violation(3, f"slice {s.name} has tp={s.tp} but {m.name} uses tp={m.tp}", w.index))
            elif s.tp > 1:
                for i in range(0, len(s.ranks), s.tp):
                    grp = s.ranks[i:i + s.tp]
                    if len({r // plan.gpus_per_node for r in grp}) > 1:
                        out.append(Violation(3, f"slice {s.name}: tensor-parallel group {grp} crosses islands",
                                             w.index, grp[0]))
                    if list(grp) != sorted(grp):
                        out.append(Violation(3, f"slice {s.name}: tensor-parallel group {grp} is not in ascending "
                                                f"rank order (a device's position must be its rank in the group)",
                                             w.index, grp[0]))
    held_at: dict[str, tuple[int, str]] = {}  # weight -> (tp, first MetaOp holding it)
    for m in plan.metaops:
        for key in dict.fromkeys(k for k in m.param_keys if k):
            tp, first = held_at.setdefault(key, (m.tp, m.name))
            if tp != m.tp:
                out.append(Violation(3, f"{m.name} holds weight {key!r} at tp={m.tp}, {first} at tp={tp}: MetaOps "
                                        f"that share a weight must shard it the same way"))
    # 4
    layers_of: dict[str, list[tuple[int, int, int]]] = {m.name: [] for m in plan.metaops}
    for w in plan.waves:
        for s in w.slices:
            if s.metaop in layers_of:
                layers_of[s.metaop].append((s.layer_start, s.layer_stop, w.index))
    done_wave: dict[tuple[str, int], int] = {}
    for m in plan.metaops:
        count = [0] * m.num_layers
        for a, b, wi in layers_of[m.name]:
            for layer in range(a, b):
                if 0 <= layer < m.num_layers:
                    count[layer] += 1
                    done_wave[(m.name, layer)] = wi
                else:
                    out.append(Violation(4, f"{m.name} has {m.num_layers} layers; a slice schedules layer {layer}", wi))
        for layer, c in enumerate(count):
            if c != 1:
                out.append(Violation(4, f"layer {layer} of {m.name} is scheduled {c} times (must be once)"))
    # 5
    for w in plan.waves:
        for s in w.slices:
            m = by_name.get(s.metaop)
            if m is None:
                continue
            needs = [(m.name, s.layer_start - 1)] if s.layer_start > 0 else \
                [(p, by_name[p].num_layers - 1) for p in m.producers if p in by_name]
            for key in needs:
                pw = done_wave.get(key)
                if pw is not None and pw >= w.index:
                    out.append(Violation(5, f"slice {s.name} needs layer {key[1]} of {key[0]}, which runs in "
                                            f"wave {pw} (not earlier)", w.index))
    # 6
    clock, level = None, -1
    for i, w in enumerate(plan.waves):
        if w.index != i:
            out.append(Violation(6, f"wave at position {i} has index {w.index}", i))
        if clock is not None and abs(w.start_ms - clock) > 1e-6 * max(1.0, clock):
            out.append(Violation(6, f"starts at {w.start_ms:.3f} ms, previous wave ends at {clock:.3f} ms", i))
        if w.level < level:
            out.append(Violation(6, f"level {w.level} after level {level}", i))
        clock, level = w.start_ms + w.duration_ms, max(level, w.level)
    # 7
    per = plan.communicator_bytes
    for d, (b, n) in enumerate(zip(plan.device_memory_bytes, communicators_per_device(plan))):
        if b + n * per > plan.memory_limit_bytes * (1 + 1e-9):
            out.append(Violation(7, f"needs {(b + n * per) / 2**30:.2f} GiB ({n} communicators at "
                                    f"{per / 2**20:g} MiB included), limit {plan.memory_limit_bytes / 2**30:.2f} GiB",
                                 device=d))
    if len(plan.device_memory_bytes) != N:
        out.append(Violation(7, f"{len(plan.device_memory_bytes)} memory entries for {N} devices"))
    # 8
    expect = {(g.param_key, g.tp_rank): g.ranks for g in param_groups(plan.metaops, list(plan.slices()))}
    got = {(g.param_key, g.tp_rank): g.ranks for g in plan.param_groups}
    for key in sorted(set(expect) | set(got)):
        if expect.get(key) != got.get(key):
            out.append(Violation(8, f"parameter group of {key[0]} shard {key[1]} is {got.get(key)}, the slices "
                                    f"put it on {expect.get(key)}"))
    # 10
    derived_list = plan_transfers(plan)
    before = len(out)
    derived = {(t.dst, t.input_index): t for t in derived_list}
    stored = {(t.dst, t.input_index): t for t in plan.transfers}
    for key in sorted(set(derived) | set(stored)):
        want, got = derived.get(key), stored.get(key)
        if want != got:
            what = "is missing" if got is None else "is not an edge of the slices" if want is None else \
                f"differs from its derivation (from {want.src}: {len(want.forward)} forward, " \
                f"{len(want.backward)} backward messages)"
            out.append(Violation(10, f"transfer into {key[0]} input {key[1]} {what}: re-plan",
                                 (got or want).wave))
    if len(stored) != len(plan.transfers):
        out.append(Violation(10, f"{len(plan.transfers) - len(stored)} transfers are listed twice"))
    if len(out) == before and list(plan.transfers) != derived_list:
        out.append(Violation(10, "transfers are not in plan order (consumer wave, slice, input index): the "
                                 "message tags would not match between ranks"))
    # 11
    phase = -1
    for w in plan.waves:
        if w.phase < phase:
            out.append(Violation(11, f"phase {w.phase} after phase {phase}", w.index))
        phase = max(phase, w.phase)
    phase_of = {w.index: w.phase for w in plan.waves}
    for t in plan.transfers:
        a, b = SliceRef.from_str(t.src).wave, SliceRef.from_str(t.dst).wave
        if phase_of.get(a) != phase_of.get(b):
            out.append(Violation(11, f"transfer {t.src} -> {t.dst} crosses from phase {phase_of.get(a)} to "
                                     f"phase {phase_of.get(b)}", b))
    for m in plan.metaops:
        if m.recompute not in recompute_options(m):
            out.append(Violation(11, f"{m.name} ({m.op_type}) cannot recompute {m.recompute!r}; it can "
                                     f"{recompute_options(m)}"))
    if isinstance(plan.passes, bool) or not isinstance(plan.passes, int) or plan.passes < 1:
        out.append(Violation(11, f"passes={plan.passes!r} must be a positive integer"))
    return out


def check_plan(plan: Plan, *, graph_fingerprint: str | None = None, world_size: int | None = None) -> None:
    """Raise :class:`PlanError` if the plan breaks any rule (rule 9 checks the given graph and world)."""
    vs = violations(plan)
    if graph_fingerprint is not None and graph_fingerprint != plan.graph_fingerprint:
        vs.append(Violation(9, f"plan was made for model {plan.model!r} with graph {plan.graph_fingerprint}, "
                               f"not for this model's graph {graph_fingerprint} (different model, task set, "
                               f"sizes or batch): re-plan"))
    if world_size is not None and world_size != plan.world_size:
        vs.append(Violation(9, f"plan is for {plan.world_size} devices but the job has {world_size}"))
    if vs:
        marks = {(v.wave, v.device) for v in vs if v.wave is not None and v.device is not None}
        raise PlanError(vs, grid(plan, mark=marks) if plan.world_size <= 64 else "")
