"""A certified lower bound on the whole step: compute, transfers and the cheapest gradient sync.

``Σ C*`` bounds the compute of level-by-level wave schedules only; a step also pays the gradient sync, which
on thin per-device batches decides it. This bound holds for *every* wave plan of the given MetaOps, curves and
passes on the cluster, whatever its allocation, waves or placement, under the step simulator's own model
(:mod:`.simulate`, :mod:`.timeline`, :mod:`.grad_buckets`, :mod:`.link_costs`). The argument, with ``K``
passes, ``N`` devices, ``t_pass`` one pass and every layer run on some count ``n`` (its time ``T_m(n)``):

1. ``step = K·t_pass + max(0, E − t_pass) = (K−1)·t_pass + max(t_pass, E)``, where ``E`` is the end of the
   last all-reduce, measured (as every bucket's ready time) from the start of the last pass.
2. **Area.** A device runs one slice at a time, so ``t_pass ≥ Σ_layers n·T_m(n) / N = X``.
3. **Paths.** A consumer's forward waits for its producer's and a producer's backward for its consumer's
   (the plan's edges, :mod:`.timeline`; consecutive slices of a MetaOp are such edges too), so for every
   source-to-sink path ``P`` of the MetaOp graph ``t_pass ≥ L_P``, the sum of ``T_m(n)`` over the path's
   layers.
4. **Sync.** The all-reduces on one device never overlap (:func:`.link_costs.schedule_collectives`) and each
   starts when its bucket is ready, which is after the forward of a whole path through the weight's MetaOp:
   at least ``F = FORWARD_SHARE · min_P Σ_{m∈P} L_m·min_n T_m(n)``. So ``E ≥ F + W_d`` for every device, ``W_d``
   the sum of the all-reduce times of the buckets it belongs to, and ``E ≥ F + Σ_d W_d / N = F + Y``. A ring
   all-reduce of ``S`` bytes over ``h`` devices costs each member at least ``2(h−1)/h·S/B`` (latency
   dropped), ``B`` the island's bandwidth when ``h`` fits in one island, else the per-node one; over its
   members that is ``2(h−1)·S/B``, and bucketing only adds latencies. A weight used by MetaOps on ``n``
   devices with tensor-parallel degree ``t`` has ``t`` shard groups of at least ``⌊n/t⌋`` devices each, ``1/t``
   of the bytes each (:func:`..assembly.dataflow.param_groups`); frozen weights have no gradient.
5. **Together.** ``step ≥ max(K·t_pass, (K−1)·t_pass + F + Y)`` and, for weights ``ν + Σ_P μ_P = 1``,
   ``t_pass ≥ ν·X + Σ_P μ_P·L_P``. For any ``λ ∈ [0, 1]``, ``max(a, b) ≥ λa + (1−λ)b``, so
   ``step ≥ (K−1+λ)·(ν·X + Σ_P μ_P·L_P) + (1−λ)·(F + Y)``: a sum over layers and weights whose minimum over
   every count of every layer (``1..N``, a superset of the valid counts) is exact per weight: the largest
   count among a weight's uses sets its group (``h``), and each use picks its cheapest count allowed by
   ``h``. Any weights give a valid bound; the path weights are improved by multiplicative updates
   (:data:`ROUNDS`), ``λ`` over :data:`LAMBDAS`, and the largest value found is the bound. ``λ = 1`` is the
   bound without sync (area and paths: :attr:`StepBound.compute_ms`).

6. **Paths with transfers** (:mod:`.path_bound`). A path's layers that change rank set pay the boundary's
   messages both ways (at least what one edge's bytes need at the fastest links): ``t_pass`` is at least the
   least path with them (a chain over the layers' counts, exact).
7. **The sync's end on a path** (:mod:`.path_bound`). A layer's gradient is complete no earlier than the
   forward of its path's layers before it and the forward and backward of those from it on, and its bucket's
   all-reduce starts no earlier: ``E ≥ r_j + AR_j``. The layers since the path last changed rank set share
   their devices, whose all-reduces run one after another (their sum counts); over every layer so far, their
   mean per device (``n/N`` of each) does. With ``step ≥ (K−1+λ)·X + (1−λ)·E`` (item 5, the area ``X`` at the
   same counts) for ``λ`` in :data:`.path_bound.LAMBDAS`, minimised over the counts and maximised over the
   layers and ``λ``. Counts on which no layer of a MetaOp fits memory are left out (``memory``).

Why the sync term of items 4-5 was zero on every row of the paper grid: ``E ≥ F + Y`` compares the *mean*
all-reduce time per device, after the forward of the cheapest path, with the pass; on 32-256 devices the
allocations that keep the area also keep ``Y`` well under ``(1−FORWARD_SHARE)·t_pass`` (a layer may sit on
few devices, and every device need hold only a share of the weights), so the best ``λ`` is 1. Items 6-7 tie the
sync and the transfers to the path that pays them; where the area still dominates (a plan may move each
layer to other devices for less than a hundredth of the all-reduce it saves), no plan is proved slower.

All-reduce and transfer latencies beyond one per term and the overlap of transfers with compute are not
counted (each only raises a plan's step), so the bound is loose where they bind. The module-level static
grids (:mod:`..systems.static_grids`) time a pipelined step with their own model, whose gradients may be
ready before ``(K−1)·t_pass``; the bound is checked against their recorded steps by the tests, not proved for
them.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..workload.cluster import Cluster
from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp
from ..workload.recompute import FORWARD_SHARE
from .path_bound import PathTerms, paths

#: The weights ``λ`` of the sync term tried (every one gives a valid bound; the best is kept). Fixed, so the
#: bound is the same bytes on every machine.
LAMBDAS = tuple(i / 32 for i in range(33))
#: Rounds of the weights of the area and path constraints (multiplicative updates; every round's value is a
#: valid bound, the largest is kept).
ROUNDS = 40
#: At most this many source-to-sink paths of the MetaOp graph get a weight (any subset keeps the bound valid).
MAX_PATHS = 256


@dataclass(frozen=True)
class StepBound:
    """A lower bound on the simulated step of every wave plan of some MetaOps, curves and passes."""

    bound_ms: float
    """No wave plan of these MetaOps, curves and passes has a shorter simulated step."""
    compute_ms: float
    """The same bound without the sync (``λ = 1``): ``K`` passes, each at least the area and every path."""
    area_ms: float
    """The area alone: ``K`` passes of every layer at its cheapest device-time over all devices."""
    weight: float
    """The ``λ`` that gave :attr:`bound_ms` (1: the sync adds nothing to the compute bound)."""
    sync_floor_ms: float
    """``Y`` of the allocation that attains the bound: the least mean per-device all-reduce time it pays."""
    path_ms: float = 0.0
    """``K`` passes of the longest least path with its boundary transfers (item 6)."""
    sync_step_ms: float = 0.0
    """The least step by the end of the sync on one path (item 7)."""

    @property
    def sync_ms(self) -> float:
        """What communication adds to the compute bound: :attr:`transfer_ms` and :attr:`allreduce_ms`."""
        return self.bound_ms - self.compute_ms

    @property
    def transfer_ms(self) -> float:
        """What the boundary transfers of a path add to the compute bound (item 6)."""
        return max(self.compute_ms, self.path_ms) - self.compute_ms

    @property
    def allreduce_ms(self) -> float:
        """What the gradient sync adds to the compute and transfer bound (items 4, 5 and 7)."""
        return self.bound_ms - max(self.compute_ms, self.path_ms)

    def to_json(self) -> dict:
        return {"bound_ms": self.bound_ms, "compute_ms": self.compute_ms, "area_ms": self.area_ms,
                "sync_ms": self.sync_ms, "transfer_ms": self.transfer_ms, "allreduce_ms": self.allreduce_ms,
                "weight": self.weight,
                "sync_floor_ms": self.sync_floor_ms, "path_ms": self.path_ms, "sync_step_ms": self.sync_step_ms}


def _link_gbps(h: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Fastest bandwidth a ring of ``h`` devices may get (one island when it fits, else across islands)."""
    inside = max(cluster.intra_bandwidth_gbps, cluster.inter_bandwidth_gbps)
    return np.where(h <= cluster.gpus_per_node, inside, cluster.inter_bandwidth_gbps)


class _Model:
    """The per-layer minimization of the module docstring's item 4, with the path weights."""

    def __init__(self, metaops, curves, cluster: Cluster, passes: int, grad_bytes: int) -> None:
        N = self.N = cluster.num_devices
        self.K = passes
        ns = np.arange(1, N + 1)
        self.metaops = list(metaops)
        self.time = [np.array([curves[m.name].time(int(n)) for n in ns], dtype=float) for m in self.metaops]
        self.area = [ns * t / N for t in self.time]
        self.paths = paths(self.metaops, MAX_PATHS)
        # every gradient is complete only after the forward of a whole path through its MetaOp (item 3')
        self.ready = FORWARD_SHARE * min((sum(m.num_layers * float(self.time[i].min()) for i, m in
                                              ((i, self.metaops[i]) for i in path)) for path in self.paths),
                                         default=0.0)
        frozen = {k for m in self.metaops if not m.trainable for k in m.param_keys if k}
        uses: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # weight -> MetaOp -> layers
        self.free = [0] * len(self.metaops)  # layers of each MetaOp without a gradient to reduce
        for i, m in enumerate(self.metaops):
            for k in m.param_keys:
                if k and k not in frozen:
                    uses[k][i] += 1
                else:
                    self.free[i] += 1
        kinds: dict[tuple, int] = defaultdict(int)  # weights with the same uses cost the same: counted once
        for k in uses:
            kinds[tuple(sorted(uses[k].items()))] += 1
        hs = np.arange(1, N + 1)  # devices of one shard's group
        gbps = _link_gbps(hs, cluster)
        self.kinds = []
        for kind in sorted(kinds):
            t = max(self.metaops[i].tp for i, _ in kind)
            params = t * min(self.metaops[i].params_per_layer // self.metaops[i].tp for i, _ in kind)
            y = 2.0 * (hs - 1) * params * grad_bytes / (gbps * 1e9) * 1e3 / N  # all shards, per device of N
            ar = 2.0 * (hs - 1) / hs * (params // t) * grad_bytes / (gbps * 1e9) * 1e3  # per member of one shard
            cap = np.minimum(N, hs * t + t - 1) - 1  # the largest count n with ⌊n/t⌋ ≤ h (index n - 1)
            self.kinds.append((kinds[kind], kind, y, ar, cap))

    def value(self, lam: float, pi: np.ndarray, sigma: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, float]:
        """``(bound, the area and path sums, the sync terms, Y)`` at weights ``λ``, ``π = (ν, μ_P...)`` (area,
        paths) and ``σ = (θ, ρ_kind...)`` (the mean sync ``Y``, one weight of each kind): the minimum over every
        layer's count, the ``X`` and ``L_P``, and the ``Y`` and one weight's member time per kind, of a
        minimizer."""
        a = self.K - 1 + lam
        nu, mu, theta = float(pi[0]), pi[1:], float(sigma[0])
        w = np.zeros(len(self.metaops))
        for mu_p, path in zip(mu, self.paths):
            w[list(path)] += mu_p
        total, X, Y = (1 - lam) * self.ready, 0.0, 0.0
        per_time = np.zeros(len(self.metaops))  # Σ over a MetaOp's layers of T at the chosen counts
        pre, arg = [], []
        for i in range(len(self.metaops)):
            gi = a * (nu * self.area[i] + w[i] * self.time[i])
            p = np.minimum.accumulate(gi)
            pre.append(p)
            arg.append(np.maximum.accumulate(np.where(gi <= p, np.arange(self.N), 0)))
            if self.free[i]:
                j = int(arg[i][-1])
                total += self.free[i] * float(p[-1])
                X += self.free[i] * float(self.area[i][j])
                per_time[i] += self.free[i] * float(self.time[i][j])
        member = np.zeros(len(self.kinds))
        for q, (mult, kind, y, ar, cap) in enumerate(self.kinds):
            compute = sum(layers * pre[i][cap] for i, layers in kind)
            for copies, rho in ((1, float(sigma[1 + q])), (mult - 1, 0.0)):  # the kind's weighted key, the rest
                if not copies:
                    continue
                cost = (1 - lam) * (theta * y + rho * ar) + compute
                h = int(np.argmin(cost))
                total += copies * float(cost[h])
                Y += copies * float(y[h])
                if rho:
                    member[q] = float(ar[h])
                for i, layers in kind:
                    j = int(arg[i][cap[h]])
                    X += copies * layers * float(self.area[i][j])
                    per_time[i] += copies * layers * float(self.time[i][j])
        lengths = np.array([sum(per_time[i] for i in path) for path in self.paths])
        return total, np.concatenate(([X], lengths)), np.concatenate(([Y], member)), Y

    def start(self) -> tuple[np.ndarray, np.ndarray]:
        """Uniform weights."""
        return (np.full(1 + len(self.paths), 1.0 / (1 + len(self.paths))),
                np.full(1 + len(self.kinds), 1.0 / (1 + len(self.kinds))))

    def best_weights(self, lam: float, pi: np.ndarray, sigma: np.ndarray) -> tuple:
        """The largest value over :data:`ROUNDS` multiplicative updates of ``π`` and ``σ`` from the given
        ones: ``(value, π, σ, Y of its minimizer)``."""
        best = (-np.inf, pi, sigma, 0.0)
        for r in range(ROUNDS):
            v, c, d, Y = self.value(lam, pi, sigma)
            if v > best[0]:
                best = (v, pi, sigma, Y)
            step = 2.0 / math.sqrt(r + 1)
            pi = _reweight(pi, c, step)
            if lam < 1:
                sigma = _reweight(sigma, d, step)
        return best


def _reweight(w: np.ndarray, gain: np.ndarray, step: float) -> np.ndarray:
    """Multiplicative update of simplex weights (``math`` per element and ``fsum``: the same bytes on every
    machine)."""
    scale = float(gain.max()) or 1.0
    out = [float(x) * math.exp(step * float(g) / scale) for x, g in zip(w, gain)]
    total = math.fsum(out)
    return np.array([x / total for x in out])


def step_bound(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], cluster: Cluster, passes: int, *,
               grad_bytes: int = 4, lambdas: Sequence[float] = LAMBDAS, memory: bool = True) -> StepBound:
    """The bound of the module docstring for ``metaops`` (their ``tp``) on ``cluster``, ``passes`` per step;
    ``memory``: leave out the counts on which no layer of a MetaOp fits the cluster's memory (item 7; the
    bound then holds for the plans that fit)."""
    model = _Model(metaops, curves, cluster, passes, grad_bytes)
    pi, sigma = model.start()
    area = model.value(1.0, np.eye(1 + len(model.paths))[0], sigma)[0]
    compute, pi, _, Y = model.best_weights(1.0, pi, sigma)  # no sync: the weights of the area and the paths
    best = (compute, 1.0, Y)
    for lam in lambdas:  # the sync's weight, at the compute bound's path weights
        v, _, _, Y = model.value(lam, pi, sigma)
        if v > best[0]:
            best = (v, lam, Y)
    if best[1] < 1.0:  # and every weight again at the best λ
        v, _, _, Y = model.best_weights(best[1], pi, sigma)
        if v > best[0]:
            best = (v, best[1], Y)
    terms = PathTerms(metaops, curves, cluster, passes, grad_bytes=grad_bytes,
                      memory_limit=cluster.memory_limit_bytes if memory else None)
    compute = max(compute, area)
    path = passes * terms.path_ms
    bound = max(best[0], compute, path, terms.sync_step_ms)
    return StepBound(bound_ms=float(bound), compute_ms=float(compute), area_ms=float(area),
                     weight=float(best[1]), sync_floor_ms=float(best[2]), path_ms=float(path),
                     sync_step_ms=float(terms.sync_step_ms))


def plan_step_bound(plan, cluster: Cluster) -> StepBound:
    """:func:`step_bound` of a plan's MetaOps, curves and passes on ``cluster`` (the plan's placement and
    waves play no part)."""
    return step_bound(plan.metaops, dict(plan.curves), cluster, plan.passes)
