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

from dataclasses import dataclass, field
from typing import Sequence

from ..workload.cluster import Cluster
from .dataflow import Layout, messages, slice_layout
from ..workload.memory import layer_state_bytes, slice_activation_bytes, slice_param_keys
from ..workload.metaops import MetaOp
from ..level.waves import Wave, WaveSlice

BACKTRACK_WAVES = 2
NODE_BUDGET = 20000
MEMORY_WEIGHT_MS = 1e-3  # score units (ms) per unit of the fullest chosen device's memory fraction


class PlacementError(ValueError):
    """No placement fits in memory; the message names the wave, the slice, the device and the bytes."""


@dataclass
class _State:
    mem_act: list[dict[int, float]]  # device -> {phase: stashed activation bytes}
    held: list[dict[tuple[str, int], float]]  # device -> {(param_key, tp shard): bytes}
    placed: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # (wave, slot) -> ranks

    def mem(self, d: int) -> float:
        return max(self.mem_act[d].values(), default=0.0) + sum(self.held[d].values())

    def act_after(self, d: int, phase: int, act: float) -> float:
        """The device's largest phase's activations once ``act`` more is stashed in ``phase``."""
        acts = self.mem_act[d]
        return max(max(acts.values(), default=0.0), acts.get(phase, 0.0) + act)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


class Placer:
    def __init__(self, metaops: Sequence[MetaOp], waves: Sequence[Wave], cluster: Cluster, *,
                 distributed_optimizer: bool = False, node_budget: int = NODE_BUDGET) -> None:
        self.m = {m.name: m for m in metaops}
        self.distributed_optimizer = distributed_optimizer
        self.node_budget = node_budget
        self._states: dict[tuple[str, int], float] = {}
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
                out.append((pw, ps, 2.0 * pm.out_elems_per_sample * pm.batch))
        return out

    def _in_bytes(self, wi: int, si: int) -> float:
        return sum(b for _, _, b in self.producers(wi, si))

    def layout(self, wi: int, si: int, ranks: Sequence[int]) -> Layout:
        return slice_layout(self.m[self.waves[wi].slices[si].metaop], ranks)

    def comm_ms(self, wi: int, si: int, ranks: Sequence[int], st: _State) -> float:
        s = self.waves[wi].slices[si]
        dst = self.layout(wi, si, ranks)
        total = 0.0
        for pw, ps, nbytes in self.producers(wi, si):
            src = self.layout(pw, ps, st.placed[(pw, ps)])
            per_sample = nbytes / self.m[s.metaop].batch  # producer and consumer share the task's batch
            for msg in messages(src, dst, island_of=self.cluster.island):
                if msg.src == msg.dst:
                    continue
                bw, lat = self.cluster.link(msg.src, msg.dst)
                total += (msg.stop - msg.start) * per_sample / (bw * 1e9) * 1e3 + lat * 1e-3
        return total

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

    def _order_replicas(self, wi: int, si: int, chunks: list[tuple[int, ...]], st: _State) -> tuple[int, ...]:
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

    def candidates(self, wi: int, si: int, free: set[int], st: _State) -> list[tuple[float, tuple[int, ...]]]:
        s = self.waves[wi].slices[si]
        m = self.m[s.metaop]
        n, tp = s.devices, m.tp
        isl = self.cluster.island
        by_mem = sorted(free, key=lambda d: (st.mem(d), d))
        prods = sorted(self.producers(wi, si), key=lambda p: -p[2])
        src_devs: list[int] = []
        for pw, ps, _ in prods:
            src_devs += [d for d in st.placed[(pw, ps)] if d not in src_devs]
        src_islands = []
        for d in src_devs:
            if isl(d) not in src_islands:
                src_islands.append(isl(d))
        keys = set(slice_param_keys(m, s.layer_start, s.layers))
        prefs: dict[str, list[int]] = {}
        prefs["affine"] = ([d for d in src_devs if d in free]
                           + [d for d in by_mem if d not in src_devs and isl(d) in src_islands]
                           + [d for d in by_mem if isl(d) not in src_islands])
        if keys:
            prefs["colocate"] = sorted(free, key=lambda d: (-len(keys & {k for k, _ in st.held[d]}), st.mem(d), d))
        free_in: dict[int, list[int]] = {}
        for d in by_mem:
            free_in.setdefault(isl(d), []).append(d)
        fit = sorted(free_in, key=lambda i: (len(free_in[i]) < n, len(free_in[i]) if len(free_in[i]) >= n
                                             else -len(free_in[i]), i))
        prefs["island"] = [d for i in fit for d in free_in[i]]
        act = slice_activation_bytes(m, s.layers, n)
        ph = self.waves[wi].phase
        prefs["emptiest"] = sorted(free, key=lambda d: (self._mem_after(d, 0, keys, m, act, st, ph, n), d))
        seen, out = set(), []
        for pref in prefs.values():
            chunks = self._chunks(pref, tp)
            if len(chunks) * tp < n:
                continue
            chosen = chunks[:n // tp]
            ranks = self._order_replicas(wi, si, chosen, st)
            if frozenset(ranks) in seen:
                continue
            seen.add(frozenset(ranks))
            worst = max(self._mem_after(d, pos % tp, keys, m, act, st, ph, n) for pos, d in enumerate(ranks))
            score = self.comm_ms(wi, si, ranks, st) + MEMORY_WEIGHT_MS * worst / self.limit
            out.append((score, ranks))
        out.sort(key=lambda x: x[0])
        return out

    def _state_bytes(self, m: MetaOp, devices: int) -> float:
        """One layer's states per device; with the distributed optimizer its shard is split over at least the
        slice's replicas (the final plan counts every holder: never more than this)."""
        key = (m.name, devices)
        got = self._states.get(key)
        if got is None:
            got = self._states[key] = layer_state_bytes(m, holders=max(1, devices // m.tp),
                                                        distributed_optimizer=self.distributed_optimizer)
        return got

    def _mem_after(self, d: int, shard: int, keys: set[str], m: MetaOp, act: float, st: _State, phase: int,
                   devices: int) -> float:
        new = sum(self._state_bytes(m, devices) for k in keys if (k, shard) not in st.held[d])
        return sum(st.held[d].values()) + new + st.act_after(d, phase, act)

    # -- search ---------------------------------------------------------------------------------------
    def run(self) -> dict[tuple[int, int], tuple[int, ...]]:
        st = _State(mem_act=[{} for _ in range(self.N)], held=[{} for _ in range(self.N)])
        ok, _ = self._dfs(0, st, {})
        if not ok:
            raise PlacementError(self.deepest[1])
        return dict(st.placed)

    def _dfs(self, i: int, st: _State, used: dict[int, set[int]]) -> tuple[bool, int]:
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
        cands = [c for c in self.candidates(wi, si, free, st)
                 if all(self._mem_after(d, pos % m.tp, keys, m, act, st, ph, s.devices) <= self.limit
                        for pos, d in enumerate(c[1]))]
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
                st.mem_act[d][ph] = st.mem_act[d].get(ph, 0.0) + act
                for k2 in added[d]:
                    st.held[d][k2] = self._state_bytes(m, s.devices)
            st.placed[(wi, si)] = ranks
            used.setdefault(wi, set()).update(ranks)
            ok, fw = self._dfs(i + 1, st, used)
            if ok:
                return True, -1
            used[wi].difference_update(ranks)
            del st.placed[(wi, si)]
            for d in ranks:
                st.mem_act[d][ph] -= act
                for k2 in added[d]:
                    del st.held[d][k2]
            fail_wave = max(fail_wave, fw)
            if fw - wi > BACKTRACK_WAVES:  # failure too far ahead: do not search alternatives here
                break
        return False, fail_wave

    def _record_failure(self, i, wi, s: WaveSlice, m: MetaOp, free, keys, act, st: _State) -> None:
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
