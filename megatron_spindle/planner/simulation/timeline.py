"""One pass of a plan as the wave executor runs it: per device, in dependency order, no global barrier.

The executor (``runtime/executor.py``) runs on every rank its own slices, wave after wave, each as soon as the
rank is free and the slice's inputs have arrived; nothing waits for the other slices of a wave. So the pass is
a dataflow timeline, not a sum of wave durations: two lanes on disjoint devices (two encoders, two tasks, two
modules) each run at their own pace, and a wave's shorter slices do not wait for its longest.

1. **Forward**, phase by phase (each phase's forward waves in order, then their backward in reverse): a slice
   starts when all its devices are free (its layers' collectives bind them) and its inputs have arrived;
   it takes :data:`..workload.recompute.FORWARD_SHARE` of its time.
2. **Inputs**, as the plan's ``transfer_posting`` says (:func:`..assembly.dataflow.posting_key`).
   a. ``boundary``: a rank posts a boundary's messages in one batch when it reaches the boundary, so a
      consumer's input arrives once its producer has run, the producer's and the consumer's devices have
      reached the boundary, and the boundary's whole batch has moved (:func:`.link_costs.boundary_time_ms` of
      every message into that wave: the links it shares).
   b. ``producer`` (the default): every rank walks the same points, each slice of each wave in plan order,
      and posts at each the batch of that slice's outputs it sends or receives (the sender right after the
      slice; a receiver when its own earlier slices are done: under NCCL its receive waits for its compute
      stream). An edge's messages arrive ``t_batch`` (:func:`.link_costs.boundary_time_ms` of the point's
      whole batch) after the later of its two ends has posted, so they travel while both compute later
      slices and are exposed only where the consumer has nothing else to run. Batches of different points
      are not charged for sharing links with each other.
3. **Backward**, in reverse (a wave's slices too): a slice's backward starts when its devices are free and the
   gradients of every consumer have come back (the same rules, on the stored backward messages; producer
   posting: a consumer's input gradients are posted right after its backward).

The pass ends when the last device finishes. Returned with every slice's backward end, which is when its
weights' gradients are complete (:mod:`.grad_buckets`).

With the runtime's measured costs (``runtime``, :mod:`.runtime_costs`), a rank that sends or receives ``k``
messages at a point also spends ``post_ms(k)`` of host time posting the batch (boundary posting, forward: when
it reaches the boundary, before the wave's slices; backward: after the wave's backward; producer posting: at
the point), and the messages arrive after the
later of the two ends has posted, the measured delivery plus ``t_boundary`` less the link's latency later
(``transit_ms``); and every slice takes its curve time times the executor's measured ``per_slice_scale``,
plus its fixed per-slice cost (``per_slice_fwd_ms`` on its forward, ``per_slice_bwd_ms`` on its backward),
also with ``transfers=False``.
Without them, as before: no host time, arrival ``t_boundary`` after both ends reached the boundary.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from ..workload.cluster import Cluster
from ..workload.recompute import FORWARD_SHARE
from .link_costs import boundary_time_ms
from .runtime_costs import RuntimeCosts
from ..assembly.dataflow import posting_key
from ..assembly.plan import Plan


def dataflow_pass(plan: Plan, cluster: Cluster, slice_ms: Mapping[str, float], *,
                  transfers: bool = True, runtime: RuntimeCosts | None = None,
                  spans: dict | None = None, waits: list | None = None) -> tuple[float, dict[str, float]]:
    """``(pass ms, backward end of every slice)`` of one pass (module docstring); ``transfers=False`` times it
    with free communication (the difference is the pass's exposed transfer); ``runtime``: the measured costs
    of posting each boundary's batch (module docstring); ``spans``, when given, receives every slice's
    ``(start, end)`` under ``(name, "fwd")`` and ``(name, "bwd")`` (the Gantt draws them); ``waits``, a list
    of one :data:`WAIT_PARTS` dict per rank when given, receives each rank's host time as the runtime's trace
    splits it (:data:`WAIT_PARTS`)."""
    N = plan.world_size
    free = [0.0] * N
    fwd_end: dict[str, float] = {}
    bwd_end: dict[str, float] = {}
    ranks = {s.name: s.ranks for s in plan.slices()}
    into: dict[str, list] = defaultdict(list)  # consumer slice -> its input edges
    back_to: dict[str, list] = defaultdict(list)  # producer slice -> edges returning its gradients
    for t in plan.transfers:
        into[t.dst].append(t)
        back_to[t.src].append(t)
    producer = plan.transfer_posting == "producer"
    cost_f: dict = {}
    cost_b: dict = {}
    if transfers:
        flows_f: dict = defaultdict(list)
        flows_b: dict = defaultdict(list)
        for t in plan.transfers:  # each posting point's batch
            flows_f[posting_key(plan, t, backward=False)].append(t.forward)
            flows_b[posting_key(plan, t, backward=True)].append(t.backward)
        cost_f = {k: _batch_ms(v, cluster) for k, v in flows_f.items()}
        cost_b = {k: _batch_ms(v, cluster) for k, v in flows_b.items()}
    post_f: dict = {}  # posting key -> rank -> host ms posting its batch (measured costs only)
    post_b: dict = {}
    if transfers and runtime is not None:
        (post_f, most_f), (post_b, most_b) = _posts(plan, runtime, False), _posts(plan, runtime, True)
        cost_f = {k: runtime.transit_ms(v, _latency_ms(flows_f[k], cluster), most_f.get(k, 0))
                  for k, v in cost_f.items()}
        cost_b = {k: runtime.transit_ms(v, _latency_ms(flows_b[k], cluster), most_b.get(k, 0))
                  for k, v in cost_b.items()}
    waves = {w.index: w for w in plan.waves}
    arrival: dict[tuple[int, bool], float] = {}  # producer posting: (edge id, backward) -> when its messages are in
    sent: dict[tuple[int, bool], float] = {}  # producer posting: (edge id, backward) -> when its senders had posted

    extra_f, extra_b = (runtime.per_slice_fwd_ms, runtime.per_slice_bwd_ms) if runtime is not None else (0.0, 0.0)
    stretch = runtime.per_slice_scale if runtime is not None else 1.0

    def posted(name: str, out_edges, cost: dict, post: dict, backward: bool) -> None:
        """Producer posting (rule 2b): every rank posts its batch of slice ``name``'s point when it gets there
        (now: ``free``), its host time after; each edge's messages arrive the batch's time after the later
        of their ends has posted."""
        at = {}
        for r, ms in post.get(name, {}).items():
            free[r] += ms
            at[r] = free[r]
            if waits is not None:
                waits[r]["posting"] += ms
        for t in out_edges[name]:
            msgs = t.backward if backward else t.forward
            ends = {r for m in msgs if not m.local for r in (m.src, m.dst)}
            done = bwd_end[name] if backward else fwd_end[name]
            arrival[(id(t), backward)] = max([done] + [at.get(r, free[r]) for r in ends]) + cost[name] \
                if ends else done
            if waits is not None:
                sent[(id(t), backward)] = max([done] + [at.get(m.src, free[m.src]) for m in msgs if not m.local])

    def run(wi: int, edges, peer, done: dict, cost: dict, share: float, post: dict, backward: bool) -> None:
        """Every slice of wave ``wi`` in one direction (its end into ``done``): ready when each edge's peer
        slice (``peer(t)``) is done and its messages have moved (rule 2), started when its devices are free,
        ``share`` of its time long. Boundary posting: each rank's ``post`` ms at this boundary before the
        slices (forward) or after them (backward), and both directions move an edge's messages in the batch
        of its consumer's wave (``t.wave``); producer posting: each slice's point right after it."""
        if not backward and not producer:  # forward: the boundary's batch is posted before the wave's slices
            for r, ms in post.get(wi, {}).items():
                free[r] += ms
                if waits is not None:
                    waits[r]["posting"] += ms
        at_boundary = list(free)
        reached: dict[str, float] = {}  # a slice's devices' latest arrival at this boundary

        def arrived(name: str) -> float:
            got = reached.get(name)
            if got is None:
                got = reached[name] = max((at_boundary[r] for r in ranks[name]), default=0.0)
            return got

        for s in (reversed(waves[wi].slices) if backward and producer else waves[wi].slices):
            ready = given = 0.0  # given: when the last sender had posted (the runtime's trace splits waits there)
            for t in edges[s.name]:
                p = peer(t)
                if not transfers:
                    ready = max(ready, done[p])
                elif producer:
                    ready = max(ready, arrival[(id(t), backward)])
                    if waits is not None:
                        given = max(given, sent[(id(t), backward)])
                else:
                    both = max(arrived(p), arrived(s.name))
                    ready = max(ready, max(done[p], both) + cost[t.wave])
                    if waits is not None:
                        given = max(given, done[p], arrived(p))
            if not transfers:
                given = ready
            if waits is not None and edges[s.name]:
                for r in s.ranks:
                    waits[r]["message"] += max(0.0, ready - max(free[r], given))
                    waits[r]["peer"] += max(0.0, min(ready, given) - free[r])
            start = max(ready, max(free[r] for r in s.ranks))
            e = done[s.name] = start + share * stretch * slice_ms[s.name] + (extra_b if backward else extra_f)
            if spans is not None:
                spans[(s.name, "bwd" if backward else "fwd")] = (start, e)
            for r in s.ranks:
                free[r] = e
            if transfers and producer:
                posted(s.name, into if backward else back_to, cost, post, backward)
        if backward and not producer:  # backward: posted after the wave's backward
            for r, ms in post.get(wi, {}).items():
                free[r] += ms
                if waits is not None:
                    waits[r]["posting"] += ms

    for phase in plan.phases:
        for wi in phase:  # forward: inputs from producers, the consumer's wave's batch
            run(wi, into, lambda t: t.src, fwd_end, cost_f, FORWARD_SHARE, post_f, False)
        for wi in reversed(phase):  # backward: gradients from consumers, the consumer's wave's batch
            run(wi, back_to, lambda t: t.dst, bwd_end, cost_b, 1 - FORWARD_SHARE, post_b, True)
    return max(free, default=0.0), bwd_end


#: A rank's host time beside its slices, as the runtime's trace splits it (``runtime/p2p.py``): ``posting``
#: its batches, blocked on a ``message`` its sender had already posted (what the transfer itself exposes), and
#: blocked on a ``peer`` that had not yet posted it (still computing, or not yet at the boundary: idle).
WAIT_PARTS = ("posting", "message", "peer")


def new_waits(world: int) -> list[dict[str, float]]:
    """One empty :data:`WAIT_PARTS` dict per rank, for :func:`dataflow_pass`'s ``waits``."""
    return [dict.fromkeys(WAIT_PARTS, 0.0) for _ in range(world)]


def _posts(plan: Plan, runtime: RuntimeCosts, backward: bool) -> tuple[dict, dict]:
    """``({posting key: {rank: post ms}}, {posting key: most operations one rank posts})`` of each posting
    point's batch in one direction (:func:`..assembly.dataflow.posting_key`): every rank's point-to-point
    operations (non-local messages it sends or receives) and local copies."""
    ops: dict = defaultdict(lambda: defaultdict(int))
    local: dict = defaultdict(lambda: defaultdict(int))
    for t in plan.transfers:
        k = posting_key(plan, t, backward=backward)
        for m in (t.backward if backward else t.forward):
            if m.local:
                local[k][m.src] += 1
            else:
                ops[k][m.src] += 1
                ops[k][m.dst] += 1
    none: dict = {}
    return ({w: {r: runtime.post_ms(ops.get(w, none).get(r, 0), local.get(w, none).get(r, 0))
                 for r in {*ops.get(w, none), *local.get(w, none)}} for w in {*ops, *local}},
            {w: max(by.values()) for w, by in ops.items()})


def _latency_ms(batch: list, cluster: Cluster) -> float:
    """The link latency :func:`.link_costs.boundary_time_ms` charges a batch: between islands if a message
    crosses, else inside one."""
    g = cluster.gpus_per_node
    cross = any(m.src // g != m.dst // g for msgs in batch for m in msgs if not m.local)
    return (cluster.inter_latency_us if cross else cluster.intra_latency_us) * 1e-3


#: Batches already timed: ``(cluster's id, ids of the batch's message tuples) -> (the cluster and the tuples,
#: kept so their ids stay theirs, ms)``. The data flow hands out the same message tuple objects for the same
#: edge layouts (:func:`..assembly.dataflow.island_messages`), so the whole-step choice's candidates, which share most of
#: their waves, meet the same batches again.
_BATCHES: dict[tuple, tuple] = {}
#: At most this many (a plan has two per wave; the entries keep their message tuples alive).
BATCHES_KEPT = 1024


def _batch_ms(batch: list, cluster: Cluster) -> float:
    """:func:`.link_costs.boundary_time_ms` of the messages of ``batch`` (a list of message tuples), in order."""
    key = (id(cluster), tuple(map(id, batch)))
    got = _BATCHES.get(key)
    if got is None:
        if len(_BATCHES) >= BATCHES_KEPT:
            _BATCHES.clear()
        ms = boundary_time_ms([(m.src, m.dst, m.bytes) for msgs in batch for m in msgs], cluster)
        got = _BATCHES[key] = ((cluster, batch), ms)
    return got[1]
