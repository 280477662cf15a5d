"""Communication cost primitives of the step simulator (:mod:`.simulate`, items 2 and 3 of its docstring).

Pure Python, hand-checkable (the tests use them directly): a wave boundary's batched point-to-point time, a
ring all-reduce's time, all-reduces scheduled on shared devices and NICs, and the floor their busiest device or
NIC puts under them.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..workload.cluster import Cluster


def boundary_time_ms(flows: Iterable[tuple[int, int, float]], cluster: Cluster) -> float:
    """Time of one wave boundary moving ``(src, dst, bytes)`` flows concurrently (see the module docstring)."""
    dev_out: dict[int, float] = defaultdict(float)
    dev_in: dict[int, float] = defaultdict(float)
    node_out: dict[int, float] = defaultdict(float)
    node_in: dict[int, float] = defaultdict(float)
    g = cluster.gpus_per_node  # cluster.island(d) is d // g
    for src, dst, nbytes in flows:
        if src == dst or nbytes <= 0:
            continue
        a, b = src // g, dst // g
        if a == b:
            dev_out[src] += nbytes
            dev_in[dst] += nbytes
        else:
            node_out[a] += nbytes
            node_in[b] += nbytes
    t = 0.0
    if dev_out:
        peak = max(max(dev_out.values()), max(dev_in.values()))
        t = max(t, peak / (cluster.intra_bandwidth_gbps * 1e9) * 1e3 + cluster.intra_latency_us * 1e-3)
    if node_out:
        peak = max(max(node_out.values()), max(node_in.values()))
        t = max(t, peak / (cluster.inter_bandwidth_gbps * 1e9) * 1e3 + cluster.inter_latency_us * 1e-3)
    return t


def ring_bytes(n: int, nbytes: float) -> float:
    """Bytes each member of a ring all-reduce over ``n`` devices sends (and receives)."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def allreduce_time_ms(ranks: Sequence[int], nbytes: float, cluster: Cluster) -> float:
    """Standalone time of a ring all-reduce of ``nbytes`` over ``ranks`` (0 for one device).

    ``2(n-1)`` ring steps: inside one island each pays the island's step latency; a ring over ``k`` islands
    crosses between them in ``2(k-1)`` of its steps and stays inside one in the other ``2(n-k)``, and each
    pays its own link's latency (NCCL's own cost model, ``src/graph/tuning.cc`` ``ncclTopoTuneModel``: ring
    latency ``(nsteps - nInterSteps)·intraLat + nInterSteps·interLat``, ``nInterSteps = 2(nNodes-1)``). The
    bytes go at the slowest link's bandwidth: the node's NIC when the ring spans islands."""
    n = len(set(ranks))
    if n <= 1 or nbytes <= 0:
        return 0.0
    inside = cluster.intra_latency_us if cluster.allreduce_latency_us is None else cluster.allreduce_latency_us
    if cluster.spans_islands(ranks):
        k = len({d // cluster.gpus_per_node for d in set(ranks)})
        bw, lat_us = cluster.inter_bandwidth_gbps, 2 * (k - 1) * cluster.inter_latency_us + 2 * (n - k) * inside
    else:
        bw, lat_us = cluster.intra_bandwidth_gbps, 2 * (n - 1) * inside
    return lat_us * 1e-3 + ring_bytes(n, nbytes) / (bw * 1e9) * 1e3


def schedule_collectives(collectives: Iterable[tuple[Sequence[int], float, float]],
                         cluster: Cluster) -> list[tuple[float, float]]:
    """``(start, end)`` of every gradient all-reduce ``(ranks, bytes, ready_ms)``, posted in the given order
    (see the module docstring, item 3): each starts when it is ready, when every device of it has finished
    the all-reduces posted before it, and, when it spans islands, when every NIC of its nodes has moved the
    bytes of the cross-island all-reduces posted before it."""
    dev_free: dict[int, float] = defaultdict(float)
    nic_free: dict[int, float] = defaultdict(float)
    out = []
    for ranks, nbytes, ready in collectives:
        t = allreduce_time_ms(ranks, nbytes, cluster)
        if t == 0.0:
            out.append((ready, ready))
            continue
        members = set(ranks)
        g = cluster.gpus_per_node  # cluster.island(d) is d // g
        nodes = {d // g for d in members} if cluster.spans_islands(ranks) else set()
        start = max([ready] + [dev_free[d] for d in members] + [nic_free[n] for n in nodes])
        end = start + t
        for d in members:
            dev_free[d] = end
        for n in nodes:
            nic_free[n] = start + ring_bytes(len(members), nbytes) / (cluster.inter_bandwidth_gbps * 1e9) * 1e3
        out.append((start, end))
    return out


def sync_time_ms(collectives: Iterable[tuple[Sequence[int], float]], cluster: Cluster) -> float:
    """Time of gradient all-reduces ``(ranks, bytes)`` all ready at once, posted in the given order."""
    return max((end for _, end in schedule_collectives(((r, b, 0.0) for r, b in collectives), cluster)),
               default=0.0)



@dataclass(frozen=True)
class SyncFloor:
    """What a set of gradient all-reduces must spend on its busiest resource: ``resource`` (``"device d"``: every
    all-reduce occupies its members for its standalone time; ``"node n NIC"``: its cross-island ring bytes,
    ``2(n-1)/n`` of its bytes at the inter-island bandwidth) is busy ``busy_ms`` with all-reduces that are ready
    at ``from_ms`` or later, so no order of them ends before ``end_ms = from_ms + busy_ms`` (item 3 of
    :mod:`.simulate`)."""

    resource: str
    from_ms: float
    busy_ms: float

    @property
    def end_ms(self) -> float:
        return self.from_ms + self.busy_ms

    def to_json(self, step_floor_ms: float) -> dict:
        """With the step it forces (:func:`.simulate.step_sync_floor`)."""
        return {"resource": self.resource, "from_ms": self.from_ms, "busy_ms": self.busy_ms,
                "step_floor_ms": step_floor_ms}


def sync_floor(collectives: Iterable[tuple[Sequence[int], float, float]], cluster: Cluster) -> SyncFloor | None:
    """The latest end any one device or NIC forces on all-reduces ``(ranks, bytes, ready_ms)`` (``None``: none
    takes time): per resource, for every ready time ``r`` of the all-reduces on it, ``r`` plus their time on it
    from ``r`` on (one machine with release times: a lower bound on the end of any schedule of them,
    :func:`schedule_collectives`' included). Ties: devices before NICs, the lowest index, the earliest ``r``."""
    jobs: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)  # (0 device | 1 NIC, index)
    g = cluster.gpus_per_node
    for ranks, nbytes, ready in collectives:
        members = set(ranks)
        t = allreduce_time_ms(ranks, nbytes, cluster)
        if t == 0.0:
            continue
        for d in members:
            jobs[(0, d)].append((ready, t))
        if cluster.spans_islands(ranks):
            nic = ring_bytes(len(members), nbytes) / (cluster.inter_bandwidth_gbps * 1e9) * 1e3
            for n in {d // g for d in members}:
                jobs[(1, n)].append((ready, nic))
    best: tuple[float, tuple[int, int], float, float] | None = None  # (end, resource, from, busy)
    for key in sorted(jobs):
        tail = 0.0
        for ready, t in sorted(jobs[key], reverse=True):  # latest first: ``tail`` is the time from ``ready`` on
            tail += t
            if best is None or ready + tail > best[0]:
                best = (ready + tail, key, ready, tail)
    if best is None:
        return None
    _, (kind, index), ready, tail = best
    return SyncFloor(resource=f"device {index}" if kind == 0 else f"node {index} NIC", from_ms=ready, busy_ms=tail)
