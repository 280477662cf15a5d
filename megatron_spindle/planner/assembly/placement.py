"""Device placement: map every wave's slices to concrete devices.

Goals, in the paper's order of priority:

1. keep each slice, and each heavy inter-wave flow, inside one island (NVLink) where possible; the heaviest
   flows choose first; a flow that stays on its device is a free local copy;
2. tensor-parallel groups never cross an island;
3. balance memory: every device's estimate (model states of the layers it holds + its largest phase's
   stashed activations, :mod:`..workload.memory`) stays under the limit; prefer the emptiest devices and co-locate slices that share
   parameters (their weights are then stored once);
4. when a slice fits nowhere, try worse-communication candidates, then backtrack into earlier slices of the
   same wave and up to :data:`BACKTRACK_WAVES` earlier waves (a bounded-depth search).

For each slice we generate a few candidate device sets, ``affine`` (the producers' devices, then their
islands), ``colocate`` (devices already holding its weights), ``island`` (best-fit island, emptiest devices)
and ``emptiest``, score them by estimated transfer time plus a small memory-balance term, and search them
depth-first in score order. Inside a candidate, the data-parallel replicas are ordered so that a replica
sits on the device that already holds its samples when possible.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..workload.cluster import Cluster
from .dataflow import ACTIVATION_BYTES, Layout, island_messages, slice_layout
from ..workload.memory import layer_state_bytes, slice_activation_bytes, slice_param_keys
from ..workload.metaops import MetaOp, edge_elems_per_sample
from ..level.waves import Wave, WaveSlice
from .placement_state import PlacementState

BACKTRACK_WAVES = 2
NODE_BUDGET = 20000
MEMORY_WEIGHT_MS = 1e-3  # score units (ms) per unit of the fullest chosen device's memory fraction


class PlacementError(ValueError):
    """No placement fits in memory; the message names the wave, the slice, the device and the bytes."""


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


class Placer:
    def __init__(self, metaops: Sequence[MetaOp], waves: Sequence[Wave], cluster: Cluster, *,
                 distributed_optimizer: bool = False, node_budget: int = NODE_BUDGET) -> None:
        self.m = {m.name: m for m in metaops}
        self.distributed_optimizer = distributed_optimizer
        self.node_budget = node_budget
        self._states: dict[tuple[str, int], float] = {}
        self._layers_states: dict[tuple[str, int, int], float] = {}
        self.waves = waves
        self.cluster = cluster
        self.N = cluster.num_devices
        self.limit = cluster.memory_limit_bytes
        # where each MetaOp's layers run: (metaop, layer) -> (wave, slot)
        self.where: dict[tuple[str, int], tuple[int, int]] = {}
        for wi, w in enumerate(waves):
            for si, s in enumerate(w.slices):
                for layer in range(s.layer_start, s.layer_start + s.layers):
                    self.where[(s.metaop, layer)] = (wi, si)
        self.order: list[tuple[int, int]] = []
        for wi, w in enumerate(waves):
            slots = list(range(len(w.slices)))
            # heaviest inflow first; on a tie the smaller slice first, so a large slice does not take its
            # producers' island and push smaller slices fed from the same island across nodes
            slots.sort(key=lambda si: (-self._in_bytes(wi, si), w.slices[si].devices, si))
            self.order += [(wi, si) for si in slots]
        self.nodes = 0
        self.deepest: tuple[int, str] = (-1, "")
        self.worst: dict[tuple[int, ...], float] = {}
        """The fullest device of the last slice's candidates once the slice is placed on them."""
        # a column per (weight, TP shard) any slice may hold; a weight's columns over all its shards
        self.cols: dict[tuple[str, int], int] = {}
        self.key_cols: dict[str, list[int]] = {}
        for m in metaops:
            for k in m.param_keys:
                for shard in range(m.tp) if k else ():
                    if (k, shard) not in self.cols:
                        self.cols[(k, shard)] = len(self.cols)
                        self.key_cols.setdefault(k, []).append(self.cols[(k, shard)])
        self.island_of = np.arange(self.N) // cluster.gpus_per_node
        self.num_islands = int(self.island_of[-1]) + 1 if self.N else 0
        self._new_arrays: dict[tuple[str, int, int], np.ndarray] = {}
        self._terms: dict[tuple, tuple[float, ...]] = {}  # an edge's transfer times (:meth:`_edge_terms`)

    # -- flows ----------------------------------------------------------------------------------------
    def producers(self, wi: int, si: int) -> list[tuple[int, int, float]]:
        """(wave, slot, bytes) of the slices whose output this slice reads."""
        s = self.waves[wi].slices[si]
        m = self.m[s.metaop]
        out = []
        if s.layer_start > 0:
            pw, ps = self.where[(m.name, s.layer_start - 1)]
            out.append((pw, ps, 2.0 * m.out_elems_per_sample * m.batch))
        else:
            for p in m.producers:
                pm = self.m[p]
                pw, ps = self.where[(p, pm.num_layers - 1)]
                out.append((pw, ps, 2.0 * edge_elems_per_sample(pm, m) * pm.batch))
        return out

    def _in_bytes(self, wi: int, si: int) -> float:
        return sum(b for _, _, b in self.producers(wi, si))

    def layout(self, wi: int, si: int, ranks: Sequence[int]) -> Layout:
        return slice_layout(self.m[self.waves[wi].slices[si].metaop], ranks)

    def comm_ms(self, wi: int, si: int, ranks: Sequence[int], st: PlacementState) -> float:
        s = self.waves[wi].slices[si]
        dst = self.layout(wi, si, ranks)
        total = 0.0
        for pw, ps, nbytes in self.producers(wi, si):
            src = self.layout(pw, ps, st.placed[(pw, ps)])
            per_sample = nbytes / self.m[s.metaop].batch  # producer and consumer share the task's batch
            # the forward messages of the edge, as the plan will store them (bytes: the plan's own)
            plan_bytes = float(ACTIVATION_BYTES * edge_elems_per_sample(self.m[self.waves[pw].slices[ps].metaop],
                                                                        self.m[s.metaop]))
            key = (src, dst, plan_bytes, per_sample)
            terms = self._terms.get(key)
            if terms is None:
                terms = self._terms[key] = self._edge_terms(src, dst, plan_bytes, per_sample)
            for t in terms:  # added one by one to the slice's total, as before
                total += t
        return total

    def _edge_terms(self, src: Layout, dst: Layout, plan_bytes: float, per_sample: float) -> tuple[float, ...]:
        """Each message's transfer time (ms) of one edge, in message order (local copies are free)."""
        out = []
        for msg in island_messages(src, dst, self.cluster.gpus_per_node, plan_bytes):
            if msg.src == msg.dst:
                continue
            bw, lat = self.cluster.link(msg.src, msg.dst)
            out.append((msg.stop - msg.start) * per_sample / (bw * 1e9) * 1e3 + lat * 1e-3)
        return tuple(out)

    # -- candidates -----------------------------------------------------------------------------------
    def _chunks(self, prefer: Sequence[int], tp: int) -> list[tuple[int, ...]]:
        """TP groups of ``tp`` devices within one island, in order of first appearance in ``prefer``."""
        if tp == 1:
            return [(d,) for d in prefer]
        by_island: dict[int, list[int]] = {}
        first: dict[tuple[int, ...], int] = {}
        pos_of = {d: i for i, d in enumerate(prefer)}
        for pos, d in enumerate(prefer):
            by_island.setdefault(self.cluster.island(d), []).append(d)
        chunks = []
        for isl, ds in by_island.items():
            for k in range(0, len(ds) - tp + 1, tp):
                c = tuple(sorted(ds[k:k + tp]))  # ascending: plan position = rank in the TP group
                chunks.append(c)
                first[c] = min(pos_of[x] for x in c)
        chunks.sort(key=lambda c: first[c])
        return chunks

    def _order_replicas(self, wi: int, si: int, chunks: list[tuple[int, ...]], st: PlacementState) -> tuple[int, ...]:
        """Order replicas so that replica j sits where the main producer keeps samples of replica j."""
        prods = self.producers(wi, si)
        if not prods:
            return tuple(d for c in chunks for d in c)
        pw, ps, _ = max(prods, key=lambda p: p[2])
        src = self.layout(pw, ps, st.placed[(pw, ps)])
        s = self.waves[wi].slices[si]
        m = self.m[s.metaop]
        dp = len(chunks)
        per = m.batch // dp if m.batch_splittable else m.batch
        # each chunk prefers the replica whose samples its devices already hold (most overlap)
        prefer: list[tuple[int, int, int]] = []  # (-overlap, chunk index, replica)
        for ci, c in enumerate(chunks):
            held = [src.rank_samples(d) for d in c if src.holds(d)]
            if not held:
                continue
            s0, s1 = held[0]
            j = min(dp - 1, (s0 + s1) // 2 // per)
            a, b = j * per, (j + 1) * per
            prefer.append((-max(0, min(b, s1) - max(a, s0)), ci, j))
        slot: dict[int, tuple[int, ...]] = {}
        used: set[int] = set()
        for neg, ci, j in sorted(prefer):
            if neg < 0 and j not in slot:
                slot[j] = chunks[ci]
                used.add(ci)
        rest = iter(c for ci, c in enumerate(chunks) if ci not in used)
        out: list[int] = []
        for j in range(dp):
            out.extend(slot[j] if j in slot else next(rest))
        return tuple(out)

    def candidates(self, wi: int, si: int, free: set[int], st: PlacementState) -> list[tuple[float, tuple[int, ...]]]:
        s = self.waves[wi].slices[si]
        m = self.m[s.metaop]
        n, tp = s.devices, m.tp
        isl = self.cluster.island
        self.worst = {}
        F = np.array(sorted(free), dtype=np.int64)
        H, A = st.arrays()
        Hf, Af = H[F], A[F]
        mem = Af + Hf  # st.mem of every free device
        by_mem_a = F[np.lexsort((F, mem))]
        prods = sorted(self.producers(wi, si), key=lambda p: -p[2])
        src_devs: list[int] = []
        seen_src: set[int] = set()
        for pw, ps, _ in prods:
            for d in st.placed[(pw, ps)]:
                if d not in seen_src:
                    seen_src.add(d)
                    src_devs.append(d)
        src_islands = []
        for d in src_devs:
            if isl(d) not in src_islands:
                src_islands.append(isl(d))
        keys = set(slice_param_keys(m, s.layer_start, s.layers))
        prefs: dict[str, list[int]] = {}
        is_src_isl = np.zeros(self.num_islands, dtype=bool)  # membership by lookup, not np.isin
        is_src_isl[src_islands] = True
        in_src_isl = is_src_isl[self.island_of[by_mem_a]]
        is_src = np.zeros(self.N, dtype=bool)
        is_src[src_devs] = True
        not_src = ~is_src[by_mem_a]
        prefs["affine"] = ([d for d in src_devs if d in free] + by_mem_a[not_src & in_src_isl].tolist()
                           + by_mem_a[~in_src_isl].tolist())
        klist = sorted(keys)
        if keys:  # most of its weights held first (any shard), then the emptiest
            held = st.has[np.ix_(F, [c for k in klist for c in self.key_cols[k]])]
            sizes = [len(self.key_cols[k]) for k in klist]
            if len(set(sizes)) == 1:
                shared = held.reshape(len(F), len(klist), sizes[0]).any(axis=2).sum(axis=1)
            else:
                bounds = np.cumsum([0] + sizes)
                shared = sum(held[:, a:b].any(axis=1).astype(np.int64) for a, b in zip(bounds[:-1], bounds[1:]))
            prefs["colocate"] = F[np.lexsort((F, mem, -shared))].tolist()
        counts = np.bincount(self.island_of[F], minlength=self.num_islands)
        present = np.nonzero(counts)[0].tolist()  # islands with free devices, best fit first
        fit = sorted(present, key=lambda i: (counts[i] < n, counts[i] if counts[i] >= n else -counts[i], i))
        rank = np.zeros(len(counts), dtype=np.int64)
        rank[fit] = np.arange(len(fit))
        prefs["island"] = by_mem_a[np.argsort(rank[self.island_of[by_mem_a]], kind="stable")].tolist()
        act = slice_activation_bytes(m, s.layers, n)
        ph = self.waves[wi].phase
        # _mem_after(d, 0, ...) of every free device
        lacking = len(klist) - (st.has[np.ix_(F, [self.cols[(k, 0)] for k in klist])].sum(axis=1) if klist else 0)
        new = self._new_array(m, n, len(klist))
        phase_act = st.phase_act(ph)[F]
        after = (Hf + new[lacking]) + np.maximum(Af, phase_act + act)
        prefs["emptiest"] = F[np.lexsort((F, after))].tolist()
        seen, out = set(), []
        for pref in prefs.values():
            if len(pref) < n:  # fewer devices than the slice needs (and so fewer whole TP groups)
                continue
            chunks = self._chunks(pref if tp > 1 else pref[:n], tp)
            if len(chunks) * tp < n:
                continue
            chosen = chunks[:n // tp]
            devs = frozenset(d for c in chosen for d in c)  # the replicas' order moves no device in or out
            if devs in seen:
                continue
            seen.add(devs)
            ranks = self._order_replicas(wi, si, chosen, st)
            worst = float(self._after(ranks, klist, m, act, st, ph, n).max())
            self.worst[ranks] = worst
            score = self.comm_ms(wi, si, ranks, st) + MEMORY_WEIGHT_MS * worst / self.limit
            out.append((score, ranks))
        out.sort(key=lambda x: x[0])
        return out

    def _after(self, ranks: tuple[int, ...], klist: list[str], m: MetaOp, act: float, st: PlacementState, phase: int,
               devices: int) -> np.ndarray:
        """:meth:`_mem_after` of every rank of a candidate (its TP shard ``pos % tp``), at once."""
        R = np.array(ranks, dtype=np.int64)
        H, A = st.arrays()
        if klist:
            cols = np.array([[self.cols[(k, shard)] for k in klist] for shard in range(m.tp)], dtype=np.int64)
            lacking = len(klist) - st.has[R[:, None], cols[np.arange(len(R)) % m.tp]].sum(axis=1)
        else:
            lacking = np.zeros(len(R), dtype=np.int64)
        new = self._new_array(m, devices, len(klist))
        phase_act = st.phase_act(phase)[R]
        return (H[R] + new[lacking]) + np.maximum(A[R], phase_act + act)

    def _state_bytes(self, m: MetaOp, devices: int) -> float:
        """One layer's states per device; with the distributed optimizer its shard is split over at least the
        slice's replicas (the final plan counts every holder: never more than this)."""
        key = (m.name, devices)
        got = self._states.get(key)
        if got is None:
            got = self._states[key] = layer_state_bytes(m, holders=max(1, devices // m.tp),
                                                        distributed_optimizer=self.distributed_optimizer)
        return got

    def _new_bytes(self, m: MetaOp, devices: int, n: int) -> float:
        """``n`` layers' states summed one by one (as a sum over the keys a device lacks)."""
        key = (m.name, devices, n)
        got = self._layers_states.get(key)
        if got is None:
            one = self._state_bytes(m, devices)
            got = self._layers_states[key] = sum(one for _ in range(n))
        return got

    def _new_array(self, m: MetaOp, devices: int, keys: int) -> np.ndarray:
        """``[_new_bytes(m, devices, j) for j in 0..keys]`` as an array (kept: read only)."""
        key = (m.name, devices, keys)
        got = self._new_arrays.get(key)
        if got is None:
            got = self._new_arrays[key] = np.array([self._new_bytes(m, devices, j) for j in range(keys + 1)],
                                                   dtype=float)
        return got

    def _mem_after(self, d: int, shard: int, keys: set[str], m: MetaOp, act: float, st: PlacementState, phase: int,
                   devices: int) -> float:
        held = st.held[d]
        h, a = st.sums(d)
        n = sum(1 for k in keys if (k, shard) not in held) if held else len(keys)
        return h + self._new_bytes(m, devices, n) + max(a, st.mem_act[d].get(phase, 0.0) + act)

    # -- search ---------------------------------------------------------------------------------------
    def run(self) -> dict[tuple[int, int], tuple[int, ...]]:
        st = PlacementState(self.N, self.cols)
        ok, _ = self._dfs(0, st, {})
        if not ok:
            raise PlacementError(self.deepest[1])
        return dict(st.placed)

    def _dfs(self, i: int, st: PlacementState, used: dict[int, set[int]]) -> tuple[bool, int]:
        if i == len(self.order):
            return True, -1
        self.nodes += 1
        wi, si = self.order[i]
        s = self.waves[wi].slices[si]
        m = self.m[s.metaop]
        free = set(range(self.N)) - used.get(wi, set())
        keys = set(slice_param_keys(m, s.layer_start, s.layers))
        act = slice_activation_bytes(m, s.layers, s.devices)
        ph = self.waves[wi].phase
        # every device of the candidate within the limit once the slice is there
        cands = [c for c in self.candidates(wi, si, free, st) if self.worst[c[1]] <= self.limit]
        if not cands:
            self._record_failure(i, wi, s, m, free, keys, act, st)
            return False, wi
        fail_wave = wi
        for k, (_, ranks) in enumerate(cands):
            if k > 0 and self.nodes > self.node_budget:
                break
            added = {d: [(k2, pos % m.tp) for k2 in keys if (k2, pos % m.tp) not in st.held[d]]
                     for pos, d in enumerate(ranks)}
            for d in ranks:
                st.add_act(d, ph, act)
                for k2 in added[d]:
                    st.hold(d, k2, self._state_bytes(m, s.devices))
            st.placed[(wi, si)] = ranks
            used.setdefault(wi, set()).update(ranks)
            ok, fw = self._dfs(i + 1, st, used)
            if ok:
                return True, -1
            used[wi].difference_update(ranks)
            del st.placed[(wi, si)]
            for d in ranks:
                st.add_act(d, ph, -act)  # x + (-a) is x - a, bit for bit
                for k2 in added[d]:
                    st.drop(d, k2)
            fail_wave = max(fail_wave, fw)
            if fw - wi > BACKTRACK_WAVES:  # failure too far ahead: do not search alternatives here
                break
        return False, fail_wave

    def _record_failure(self, i, wi, s: WaveSlice, m: MetaOp, free, keys, act, st: PlacementState) -> None:
        if i <= self.deepest[0]:
            return
        if not free or len(free) < s.devices:
            msg = f"wave {wi}: slice {m.name}[{s.layer_start}-{s.layer_start + s.layers - 1}] needs {s.devices} devices, {len(free)} free"
        else:  # report the device that decides: the n-th emptiest after placing the slice
            ph = self.waves[wi].phase
            d = sorted(free, key=lambda d: self._mem_after(d, 0, keys, m, act, st, ph, s.devices))[s.devices - 1]
            need = self._mem_after(d, 0, keys, m, act, st, ph, s.devices) - st.mem(d)
            msg = (f"out of memory in wave {wi}: slice {m.name}[{s.layer_start}-{s.layer_start + s.layers - 1}] "
                   f"on {s.devices} devices needs {_gib(need)} on device {d}, which already holds {_gib(st.mem(d))} "
                   f"(limit {_gib(self.limit)}); no {s.devices} devices can take it, also after "
                   f"backtracking {BACKTRACK_WAVES} waves. Use more devices, a larger --memory-gib, or a smaller batch")
        self.deepest = (i, msg)


def place(metaops: Sequence[MetaOp], waves: Sequence[Wave], cluster: Cluster, *,
          distributed_optimizer: bool = False, node_budget: int = NODE_BUDGET) -> dict[tuple[int, int], tuple[int, ...]]:
    """Ranks of every slice, keyed by (wave index, slice index in the wave); memory is checked per phase
    (:attr:`..level.waves.Wave.phase`) with the states of the distributed optimizer when it is on.
    ``node_budget``: search nodes after which no further alternative is tried (a work limit)."""
    return Placer(metaops, waves, cluster, distributed_optimizer=distributed_optimizer,
                  node_budget=node_budget).run()


def sequential_placement(waves: Sequence[Wave]) -> dict[tuple[int, int], tuple[int, ...]]:
    """The naive placement (ablation): each wave's slices on consecutive devices from 0, in slice order."""
    out = {}
    for wi, w in enumerate(waves):
        nxt = 0
        for si, s in enumerate(w.slices):
            out[(wi, si)] = tuple(range(nxt, nxt + s.devices))
            nxt += s.devices
    return out
