"""Path terms of the whole-step bound with communication: every path of MetaOps pays its
boundary transfers, and its earliest gradients are complete only at the end of the backward.

Used by :mod:`.step_bound`; the argument is the simulator's own model (:mod:`.timeline`, :mod:`.grad_buckets`,
:mod:`.link_costs`, :mod:`..assembly.dataflow`). Take a source-to-sink path of the MetaOp graph and list its layers
``0..M-1`` in order (every layer of every MetaOp on the path); in a plan layer ``i`` runs in some slice on
``n_i`` devices (a valid count: validation's rule), ``T_i = T(n_i)`` (forward + backward).

1. **Edges.** Consecutive layers in different slices are an edge of the plan (the next slice of a MetaOp reads
   the one before it; a MetaOp's first slice reads its producers' last), and the consumer's forward (the
   producer's backward) starts only after the batch holding its messages has moved, posted no earlier than
   the producer's end (:func:`.timeline.dataflow_pass`, either posting), which takes at least as long as this
   edge's own messages (:func:`.link_costs.boundary_time_ms` only grows
   with more flows). With ``B`` samples, a producer on ``n`` devices in ``dp`` replicas (each rank holds its
   replica's ``B/dp``) and a consumer on ``n'`` devices in ``dp'``: a consumer rank that is no producer rank
   (there is one when ``n' > n``) receives all its ``B/dp'`` samples, one that is receives at least
   ``B/dp' − B/dp``, and the producer ranks send all that is received. A device's bytes ``x`` inside its
   island and ``y`` across take at least ``max(x/B_intra, y/B_inter) ≥ (x+y)/(B_intra+B_inter)`` plus the
   smaller latency (:func:`edge_ms`). Layers in one slice have equal counts, and the bound is 0 there: so
   every plan pays at least ``c(n_{i-1}, n_i)`` forward and (when the producer's backward runs) the mirror
   image backward. When the two rank sets differ but the counts are equal, some consumer rank is no producer
   rank (``moved``), so a change of rank set always costs at least one rank's share of the batch.
2. **Path.** So the pass is at least ``Σ_i T_i + Σ_edges (forward + backward)``, at the counts that minimise it
   (a chain: dynamic programming over the counts, exact).
3. **Tail.** Layer ``j``'s gradient on this path is complete (:mod:`.grad_buckets`: a slice's layers complete
   in reverse) no earlier than ``r_j = FORWARD_SHARE · Σ_{i<j} T_i + Σ_{i≥j} T_i`` + every edge's forward +
   the backward of the edges after ``j``, from the start of the last pass. Its weight's group holds at least
   the ``⌊n_j/tp⌋`` ranks of one shard of its slice (:func:`..assembly.dataflow.param_groups`), so the bucket
   holding it starts no earlier and runs at least one ring all-reduce of the shard over that many devices
   (:func:`.link_costs.allreduce_time_ms`, with the faster link and the smaller latency unless it cannot fit
   one island): the sync ends at ``E ≥ r_j + AR_j(n_j)``, and ``step = (K−1)·t_pass + max(t_pass, E)``.
4. **Shared devices.** The layers ``s..j`` since the path last changed rank set run on the same devices, so
   every one of those devices holds all their weights; their gradients are complete no earlier than
   layer ``j``'s (the backward runs down the path), and the all-reduces on one device run one after another
   (:func:`.link_costs.schedule_collectives`): ``E ≥ r_j + Σ_{i=s..j} AR_i`` (the bytes parts, and one latency:
   weights in one bucket share it). And over every layer ``i ≤ j`` of the path, each weight's groups hold at
   least ``n_i`` device memberships in all, so some device pays at least the mean ``Σ_i n_i·AR_i / N``:
   ``E ≥ r_j + Σ_{i≤j} n_i·AR_i/N``. A weight met twice on the path counts once.
5. **Memory.** Where a count cannot hold one layer's stash and its weight's smallest state (bf16 weight and
   fp32 gradient, the optimizer sharded over every device), no plan that fits memory uses it: such counts
   are left out (``memory_limit``; ``None`` keeps every valid count).
6. **With the area.** ``step ≥ K·t_pass`` and ``step ≥ (K−1)·t_pass + E``, so for ``λ ∈ [0, 1]``
   ``step ≥ (K−1+λ)·X + (1−λ)·E`` with ``X`` the area (every layer's ``n·T(n)/N``) at the same counts: the
   layers off the path at their cheapest, the path's in the chain. For each ``λ`` of :data:`LAMBDAS` the
   least over the counts (prefix programs for items 3-4 meeting suffix programs at layer ``j``, exact on the
   chain), then the largest over ``j``, ``λ`` and the paths.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from ..assembly.dataflow import ACTIVATION_BYTES, needs_output_grad
from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from ..workload.memory import layer_state_bytes, slice_activation_bytes
from ..workload.metaops import MetaOp, edge_elems_per_sample
from ..workload.recompute import FORWARD_SHARE

#: Weights ``λ`` of the pass against the sync's end (item 6); every one gives a valid bound, the largest is kept.
LAMBDAS = tuple(i / 16 for i in range(17))
#: The time of a count a MetaOp cannot use (finite, so that a zero weight times it is zero).
UNUSABLE = 1e30
#: At most this many source-to-sink paths of the MetaOp graph are weighed (any subset keeps a bound valid).
MAX_PATHS = 256


def paths(metaops: Sequence[MetaOp], limit: int = MAX_PATHS) -> list[tuple[int, ...]]:
    """Source-to-sink paths of the MetaOp graph (indices into ``metaops``), at most ``limit``."""
    index = {m.name: i for i, m in enumerate(metaops)}
    consumers: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(metaops):
        for p in m.producers:
            if p in index:
                consumers[index[p]].append(i)
    out: list[tuple[int, ...]] = []
    stack = [(i,) for i, m in reversed(list(enumerate(metaops))) if not any(p in index for p in m.producers)]
    while stack and len(out) < limit:
        path = stack.pop()
        nxt = consumers.get(path[-1])
        if not nxt:
            out.append(path)
        else:
            stack.extend(path + (j,) for j in reversed(nxt))
    return out


def _replicas(m: MetaOp, n: np.ndarray) -> np.ndarray:
    """Data-parallel replicas of a slice of ``m`` on ``n`` devices (:func:`..assembly.dataflow.slice_layout`; at
    least 1: a count below ``tp`` is one ``m`` cannot use, and its time rules it out)."""
    return np.maximum(1, n // m.tp) if m.batch_splittable else np.ones_like(n)


def edge_ms(src: MetaOp, ns: np.ndarray, dst: MetaOp, nd: np.ndarray, bytes_per_sample: float,
            cluster: Cluster, *, moved: bool = False) -> np.ndarray:
    """Least time of one edge's messages from a layout of ``src`` on ``ns`` devices to one of ``dst`` on ``nd``
    (item 1; ``ns`` a column, ``nd`` a row: the matrix over both). ``moved``: the two rank sets differ, so with
    ``nd = ns`` some consumer rank is no producer rank (and with ``nd > ns`` always)."""
    per, dper = src.batch / _replicas(src, ns), dst.batch / _replicas(dst, nd)
    inside = np.minimum(ns, nd) - ((ns == nd) if moved else 0)  # consumer ranks that may be producer ranks
    short = np.maximum(0.0, dper - per)
    top_in = np.where((nd > ns) | ((nd == ns) & moved), dper, short)
    total = (nd - inside) * dper + inside * short
    load = np.maximum(top_in, total / ns) * bytes_per_sample
    bw = (cluster.intra_bandwidth_gbps + cluster.inter_bandwidth_gbps) * 1e9
    lat = min(cluster.intra_latency_us, cluster.inter_latency_us) * 1e-3
    return np.where(load > 0, load / bw * 1e3 + lat, 0.0)


def allreduce_parts_ms(h: np.ndarray, nbytes: float, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes, latency)`` parts of the least time of a ring all-reduce of ``nbytes`` over at least ``h``
    devices (item 3). Weights in one bucket share its latencies, their bytes add up: a sum over weights counts
    the bytes parts and one latency. Latency (:func:`.link_costs.allreduce_time_ms`): a ring over ``h``
    devices in ``k`` islands pays ``2(k-1)`` steps between islands and ``2(h-k)`` inside one; ``k`` is at
    least ``⌈h/g⌉`` and at most ``h``, and the latency is linear in ``k``, so the least is at one end (or
    inside one island, when ``h`` fits one)."""
    inside = cluster.intra_latency_us if cluster.allreduce_latency_us is None else cluster.allreduce_latency_us
    fits = h <= cluster.gpus_per_node
    bw = np.where(fits, max(cluster.intra_bandwidth_gbps, cluster.inter_bandwidth_gbps),
                  cluster.inter_bandwidth_gbps) * 1e9
    hh = np.maximum(h, 1)
    k = np.maximum(2, -(-hh // cluster.gpus_per_node))  # islands of a ring that spans them
    span = np.minimum(2 * (k - 1) * cluster.inter_latency_us + 2 * (hh - k) * inside,
                      2 * (hh - 1) * cluster.inter_latency_us)
    lat = np.where(fits, np.minimum(2 * (hh - 1) * inside, span), span) * 1e-3
    return (np.where(h > 1, 2.0 * (hh - 1) / hh * nbytes / bw * 1e3, 0.0),
            np.where(h > 1, lat, 0.0))


def allreduce_floor_ms(h: np.ndarray, nbytes: float, cluster: Cluster) -> np.ndarray:
    """Least time of a ring all-reduce of ``nbytes`` over at least ``h`` devices (item 3)."""
    moved, lat = allreduce_parts_ms(h, nbytes, cluster)
    return moved + lat


class PathTerms:
    """Items 1-6 for every path: ``path_ms`` (the largest least pass over the paths, item 2) and
    ``sync_step_ms`` (the largest least step by the end of the sync, items 3-6)."""

    def __init__(self, metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], cluster: Cluster,
                 passes: int = 1, *, grad_bytes: int = 4, memory_limit: float | None = None,
                 lambdas: Sequence[float] = LAMBDAS) -> None:
        self.metaops = list(metaops)
        self.cluster = cluster
        self.passes = passes
        self.lambdas = np.array(lambdas, dtype=float)[:, None]
        N = cluster.num_devices
        frozen = {k for m in self.metaops if not m.trainable for k in m.param_keys if k}
        shard_params: dict[str, int] = {}
        state: dict[str, float] = {}
        for m in self.metaops:
            for k in m.param_keys:
                if k:
                    shard_params[k] = min(shard_params.get(k, m.params_per_layer // m.tp), m.params_per_layer // m.tp)
                    s = layer_state_bytes(m, holders=N, distributed_optimizer=True)
                    state[k] = min(state.get(k, s), s)
        counts = []
        for m in self.metaops:
            ns = np.array(m.valid_counts(N), dtype=np.int64)
            if memory_limit is not None and len(ns):
                need = min((state.get(k, 0.0) if k else 0.0 for k in m.param_keys), default=0.0)
                act = np.array([slice_activation_bytes(m, 1, int(n)) for n in ns])
                ok = need + act <= memory_limit * (1 + 1e-9)  # some layer of m fits on n devices
                ns = ns[ok] if ok.any() else ns  # none fits: no plan fits memory; every count is kept
            counts.append(ns)
        self.counts = counts
        # one grid of counts for every MetaOp (a run of layers may cross MetaOps); inf where a count is not valid
        self.grid = np.array(sorted({int(n) for ns in counts for n in ns}), dtype=np.int64)
        self.time, self.area, self.layer_ar = [], [], []
        for m, ns in zip(self.metaops, counts):
            t = np.full(len(self.grid), UNUSABLE)
            t[np.searchsorted(self.grid, ns)] = [curves[m.name].time(int(n)) for n in ns]
            self.time.append(t)
            self.area.append(np.where(t < UNUSABLE, self.grid * t / N, UNUSABLE))
            self.layer_ar.append([None if not k or k in frozen else
                                  allreduce_parts_ms(self.grid // m.tp, shard_params[k] * grad_bytes, cluster)
                                  for k in m.param_keys])
        self.paths = paths(self.metaops)
        self._edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.path_ms, self.sync_step_ms = 0.0, 0.0
        for p in self.paths:
            if all(len(counts[i]) for i in p):  # else no plan runs that MetaOp at all
                length, step = self._chain(p)
                self.path_ms, self.sync_step_ms = max(self.path_ms, length), max(self.sync_step_ms, step)

    def _edge(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Least costs of an edge from MetaOp ``a`` (rows: counts) to ``b``: forward, forward when the rank sets
        differ, backward."""
        got = self._edges.get((a, b))
        if got is None:
            src, dst = self.metaops[a], self.metaops[b]
            bps = float(ACTIVATION_BYTES * edge_elems_per_sample(src, dst))
            ns, nd = self.grid[:, None], self.grid[None, :]
            fwd = edge_ms(src, ns, dst, nd, bps, self.cluster)
            away = edge_ms(src, ns, dst, nd, bps, self.cluster, moved=True)
            bwd = edge_ms(dst, nd, src, ns, bps, self.cluster) if needs_output_grad(src) else np.zeros_like(fwd)
            got = self._edges[(a, b)] = (fwd, away, bwd)
        return got

    def _chain(self, path: Sequence[int]) -> tuple[float, float]:
        """``(least pass, least step by the sync's end)`` of one path (items 2-6)."""
        layers = [(i, j) for i in path for j in range(self.metaops[i].num_layers)]
        seen: set[str] = set()
        ar = []  # a weight met twice on the path counts at its first layer only
        for i, j in layers:
            k = self.metaops[i].param_keys[j]
            ar.append(self.layer_ar[i][j] if k not in seen else None)
            seen.add(k)
        on = set(path)
        rest = sum(m.num_layers * float(self.area[i].min()) for i, m in enumerate(self.metaops)
                   if i not in on and len(self.counts[i]))  # a MetaOp no plan can run adds nothing
        M, lam = len(layers), self.lambdas
        wa, wt = self.passes - 1 + lam, 1 - lam  # weights of the area and of the sync's end (item 6)
        suf = [None] * M  # layers t.. at full time, every edge after t both ways, given n_t (and its area)
        a = layers[-1][0]
        suf[-1] = wa * self.area[a] + wt * self.time[a]
        plain = self.time[a]
        for t in range(M - 2, -1, -1):
            a, b = layers[t][0], layers[t + 1][0]
            f, _, g = self._edge(a, b)
            plain = self.time[a] + (f + g + plain[None, :]).min(axis=1)
            suf[t] = wa * self.area[a] + wt * self.time[a] + (wt[:, :, None] * (f + g) + suf[t + 1][:, None, :]).min(axis=2)
        length = float(plain.min())
        # prefix: layers before t at their forward share, the edges up to t forward, given n_t; ``run`` adds the
        # all-reduces of the layers since the last change of rank set, ``mean`` their mean per device (item 4)
        best = 0.0
        pre = np.zeros((len(lam), len(self.grid)))
        run, mean = pre.copy(), pre.copy()
        share = self.grid / self.cluster.num_devices
        for t, (a, _) in enumerate(layers):
            if t:
                prev = layers[t - 1][0]
                f, away, _ = self._edge(prev, a)
                unary = (wa * self.area[prev] + wt * FORWARD_SHARE * self.time[prev])[:, :, None]
                pre, run, mean = ((pre[:, :, None] + unary + wt[:, :, None] * f).min(axis=1),
                                  np.minimum(run + unary[:, :, 0], (pre[:, :, None] + unary + wt[:, :, None] * away).min(axis=1)),
                                  (mean[:, :, None] + unary + wt[:, :, None] * f).min(axis=1))
            if ar[t] is not None:
                moved, lat = ar[t]
                run = run + wt * moved
                mean = mean + wt * share * moved
                least = np.maximum((run + wt * lat + suf[t]).min(axis=1), (mean + wt * share * lat + suf[t]).min(axis=1))
                best = max(best, float((least + wa[:, 0] * rest).max()))
        return length, best
