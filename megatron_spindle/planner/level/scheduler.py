"""Per level: allocate, discretize, schedule waves; keep the shortest of a few candidate schedules.

The paper's pipeline for one MetaLevel is *bisection → bi-point discretization → Algorithm 1*. Rounding
layers to integers and packing power-of-two device counts loses time against ``C*``, and which variant
loses least depends on the level. Planning a level takes milliseconds, so we build several candidates and
keep the shortest (ties: fewer waves). Every candidate is a valid wave schedule; the paper's own pipeline
(``slack=0``, ``propose="paper"``, ``align="shortest"``) is always among them, so the result is never
worse than the paper's algorithm on the same curves.

Candidates:

* **tuples**: bi-point discretization at ``C*·(1+s)`` for ``s`` in :data:`SLACKS` (a little slack leaves
  room for the power-of-two packing; the scheduler's extension step gives the room back), and a *min-max*
  single count per MetaOp (upgrade the MetaOp that finishes last while devices remain);
* **propose**: the paper's greedy (largest count first) or *all-in* (every MetaOp at the smaller of its
  counts, then upgrades, longest remaining work first);
* **align**: the paper's (the shortest candidate ends the wave) or *finisher* (whichever candidate's end
  leaves the least idle device-time per unit of work).

Finally :func:`.solver.solve_level` certifies an integer-aware lower bound of the level (the area model,
solved exactly) and, where the heuristic is far enough above it, searches for a better wave schedule with
HiGHS (a fixed number of branch-and-bound nodes, warm-started from the heuristic's, so never worse).

Before that, local searches (a fixed seed per level and fixed step counts, so plans are reproducible)
change one MetaOp's tuples at a time (a single valid count, or a random layer split between two
neighbouring counts) and keep changes that shorten the level:

1. on Algorithm 1's waves, from the shortest candidate (:data:`LOCAL_SEARCH_STEPS` steps,
   :data:`LOCAL_SEARCH_STEPS_SMALL` on levels of at most :data:`SMALL_LEVEL` MetaOps);
2. on *polished* waves (:mod:`.polish`: layers moved between waves while that shortens the level), from
   each of the :data:`POLISH_STARTS` candidates whose polished waves are shortest, sharing
   :data:`POLISH_SEARCH_STEPS` steps (:data:`POLISH_SEARCH_STEPS_LARGE` on larger levels);
3. on polished waves with finer changes too (one layer moved between a MetaOp's two tuples, a split between
   any two counts), from search 1's result polished (:data:`POLISH_SEARCH_STEPS_2` /
   :data:`POLISH_SEARCH_STEPS_2_LARGE` steps).

The shortest of their results wins, so the level is never longer than search 1's result. On levels of at
most a few hundred MetaOps × devices (:data:`KNAPSACK_VARIANTS`) and 32 devices, polished *throughput waves*
(:mod:`.knapsack`) compete too.
A schedule is built once per (variant, tuples); a revisited trial is only rebuilt where it could win.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from . import solver
from .allocate import AllocTuple, LevelAllocation, allocate_level, bipoint
from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp
from .knapsack import throughput_waves, tuples_of
from .polish import polish
from .waves import Wave, copy_waves, schedule_level

SLACKS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)
#: Steps of the first local search. Source: ``scripts/bench_planner.py``'s 24 rows and 10-task Multitask-CLIP on
#: 256 and 1024 devices, against 60 steps: the same plan's simulated step on every row but one (Multitask-CLIP-10
#: / 8 GPUs, 0.35% shorter) and the levels' span over its bound moved by at most 0.001.
LOCAL_SEARCH_STEPS = 30
#: Levels of at most SMALL_LEVEL MetaOps schedule fast enough to search longer (the larger ones, 14 and 20
#: encoders in Multitask-CLIP-7 and -10, leave the time to the pattern LP's dives, :mod:`.patterns`).
SMALL_LEVEL = 12
#: A level candidate with fewer waves is timed on the whole step when its span is within this of the best.
ALT_SLACK = 0.03
LOCAL_SEARCH_STEPS_SMALL = 100
#: Steps of the second local search, on polished spans (:mod:`.polish`). Source, with the third search's below,
#: against 150 steps: on the 24 rows of ``scripts/bench_planner.py`` and 10-task
#: Multitask-CLIP on 256 and 1024 devices no plan's simulated step got longer (Multitask-CLIP-10 / 8 GPUs' 0.3%
#: shorter) and a level-by-level makespan moved by at most 0.17% (OFASys-7 / 8 GPUs, longer; 0.6% shorter on
#: Multitask-CLIP-4 / 16); the same results from 25 to 75 steps here and 10 to 25 on large levels.
POLISH_SEARCH_STEPS = 25
#: ... on levels of more than :data:`SMALL_LEVEL` MetaOps (each step costs more there).
POLISH_SEARCH_STEPS_LARGE = 10
#: The second search's steps are shared among the candidates with the shortest polished waves, at most this many.
POLISH_STARTS = 4
#: Steps of a third one, on polished spans with finer moves, from the first one's result (measured with the
#: second's above, against 100 steps).
POLISH_SEARCH_STEPS_2 = 40
POLISH_SEARCH_STEPS_2_LARGE = 10
PROPOSE = ("paper", "all")
ALIGN = ("shortest", "finisher")
#: Throughput waves (:mod:`.knapsack`) tried, as ``(max_durations, finishing, most MetaOps × devices)``: each
#: only on levels no larger than its last number (its cost grows with MetaOps × devices) and on at most
#: :data:`KNAPSACK_MAX_DEVICES` devices.
KNAPSACK_VARIANTS = ((20, True, 640), (80, False, 640))
KNAPSACK_MAX_DEVICES = 32


@dataclass
class LevelSchedule:
    level: int
    allocation: LevelAllocation
    tuples: Mapping[str, list[AllocTuple]]
    waves: list[Wave]
    variant: str
    """Which candidate won, e.g. ``bipoint+0.05/paper/finisher`` (``+milp``: improved by :mod:`.solver`;
    ``+dive``: replaced by the pattern LP's dives, :func:`.patterns.improve`)."""
    bound_ms: float = 0.0
    """Certified lower bound of the level (:func:`.solver.solve_level`; 0 when the solver did not run)."""
    bound_kind: str = "C*"
    first_search: "LevelSchedule | None" = None
    """The first local search's result (Algorithm 1's waves, not polished) when the level kept other waves:
    :mod:`.choose` times every level's first-search waves together on the whole step."""
    alternatives: tuple["LevelSchedule", ...] = ()
    """Other candidates worth timing on the whole step (:mod:`.choose`): the paper's pipeline, the best before
    the local searches, the one with the fewest waves within :data:`ALT_SLACK` of the shortest span and the
    first local search's result (before polishing)."""

    @property
    def span_ms(self) -> float:
        return sum(w.duration_ms for w in self.waves)


def minmax_tuples(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve],
                  num_devices: int) -> dict[str, list[AllocTuple]]:
    """One valid count per MetaOp: start at the smallest, upgrade the slowest while devices remain."""
    count = {m.name: m.valid_counts(num_devices)[0] for m in metaops}
    free = num_devices - sum(count.values())
    while True:
        slowest = max(metaops, key=lambda m: m.num_layers * curves[m.name].count_time(count[m.name]))
        nxt = [v for v in slowest.valid_counts(num_devices)
               if v > count[slowest.name] and v - count[slowest.name] <= free]
        if not nxt or curves[slowest.name].count_time(nxt[0]) >= curves[slowest.name].count_time(count[slowest.name]):
            break
        free -= nxt[0] - count[slowest.name]
        count[slowest.name] = nxt[0]
    return {m.name: [AllocTuple(count[m.name], m.num_layers, float(m.num_layers))] for m in metaops}


def plan_level(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], num_devices: int,
               start_ms: float = 0.0, *, search: bool = True, solve: bool = True) -> LevelSchedule:
    """Schedule one level. ``search=False`` runs only the paper's pipeline (no solver either);
    ``solve=False`` skips the solver (:mod:`.solver`, bounded by its node limit)."""
    N = num_devices
    if sum(1 for m in metaops if m.valid_counts(N)) != len(metaops):
        bad = next(m for m in metaops if not m.valid_counts(N))
        raise ValueError(f"MetaOp {bad.name!r} needs {bad.tp} devices (tensor parallel) but the cluster has {N}")
    level = metaops[0].level
    times = {m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(N)} for m in metaops}
    alloc = allocate_level({m.name: m.num_layers for m in metaops}, curves, N)
    variants: list[tuple[str, dict[str, list[AllocTuple]]]] = []
    for s in (SLACKS if search else (0.0,)):
        c = alloc.c_star_ms * (1 + s)
        ns = alloc.n_star if s == 0 else {m.name: curves[m.name].inverse(c / m.num_layers, n_cap=N)
                                          for m in metaops}
        variants.append((f"bipoint+{s:g}", {
            m.name: bipoint(m.num_layers, curves[m.name], ns[m.name], c, m.valid_counts(N)) for m in metaops}))
    if search:
        variants.append(("minmax", minmax_tuples(metaops, curves, N)))
    best: LevelSchedule | None = None
    cands: list[LevelSchedule] = []
    seen: dict[tuple, float] = {}  # a schedule is a function of its tuples and variant: build each once
    built: dict[tuple, list[Wave]] = {}  # ... and its waves by (propose, align, tuples), for the searches
    pmemo: dict = {}  # polished slices by slices (:func:`.polish.polish`'s memo, this level's)
    for tag, tuples in variants:
        for propose in (PROPOSE if search else ("paper",)):
            for align in (ALIGN if search else ("shortest",)):
                key = (propose, align, False, _tuple_key(metaops, tuples))
                if key in seen:  # the same waves as an earlier candidate, which wins every tie
                    continue
                waves = built[key[:2] + key[3:]] = schedule_level(level, metaops, tuples, curves, N, start_ms,
                                                         propose=propose, align=align, times=times)
                cand = LevelSchedule(level=level, allocation=alloc, tuples=tuples, waves=waves,
                                     variant=f"{tag}/{propose}/{align}")
                cands.append(cand)
                seen[key] = cand.span_ms
                if best is None or (cand.span_ms, len(cand.waves)) < (best.span_ms * (1 - 1e-12), len(best.waves)):
                    best = cand
    if not search:
        return best
    searched = _local_search(metaops, curves, N, start_ms, best, seen,
                             LOCAL_SEARCH_STEPS if len(metaops) > SMALL_LEVEL else LOCAL_SEARCH_STEPS_SMALL,
                             times=times, built=built)
    raw = searched
    # the same on polished spans, from the POLISH_STARTS candidates whose polished waves are shortest
    starts = sorted((dataclasses.replace(c, waves=polish(c.waves, metaops, curves, N, times, memo=pmemo),
                                         variant=c.variant + "+polish") for c in cands),
                    key=lambda c: c.span_ms)[:POLISH_STARTS]
    small = len(metaops) <= SMALL_LEVEL
    polished = None
    for start in starts:
        r = _local_search(metaops, curves, N, start_ms, start, seen,
                          (POLISH_SEARCH_STEPS if small else POLISH_SEARCH_STEPS_LARGE) // len(starts),
                          polished=True, times=times, built=built, pmemo=pmemo)
        if polished is None or r.span_ms < polished.span_ms * (1 - 1e-12):
            polished = r
    final = polish(searched.waves, metaops, curves, N, times, memo=pmemo)  # the first search's result, polished
    if sum(w.duration_ms for w in final) < searched.span_ms * (1 - 1e-12):
        searched = dataclasses.replace(searched, waves=final, variant=searched.variant + "+polish")
    # ... and from there, with finer moves
    searched = _local_search(metaops, curves, N, start_ms, searched, seen,
                             POLISH_SEARCH_STEPS_2 if small else POLISH_SEARCH_STEPS_2_LARGE,
                             polished=True, fine=True, times=times, built=built, pmemo=pmemo)
    if polished.span_ms < searched.span_ms * (1 - 1e-12):
        searched = polished
    for max_durations, finishing, most in KNAPSACK_VARIANTS:  # throughput waves (:mod:`.knapsack`), polished
        if len(metaops) * N <= most and N <= KNAPSACK_MAX_DEVICES:
            waves = polish(throughput_waves(metaops, times, N, start_ms, max_durations=max_durations,
                                            finishing=finishing), metaops, curves, N, times)
            if sum(w.duration_ms for w in waves) < searched.span_ms * (1 - 1e-12):
                searched = dataclasses.replace(searched, tuples=tuples_of(waves, metaops), waves=waves,
                                               variant=f"throughput{max_durations}{'+finishing' * finishing}+polish")
    if solve:
        searched = _solve(metaops, curves, N, start_ms, searched)
    fewest = min((c for c in cands if c.span_ms <= searched.span_ms * (1 + ALT_SLACK)),
                 key=lambda c: (len(c.waves), c.span_ms), default=None)
    alts, seen = [], {_signature(searched.waves)}
    # cands[0]: the paper's pipeline (bipoint+0/paper/shortest); raw: the first search's result
    for c in (cands[0], best, fewest, raw):
        if c is not None and _signature(c.waves) not in seen:
            seen.add(_signature(c.waves))
            alts.append(c)
    first = raw if _signature(raw.waves) != _signature(searched.waves) else None
    return dataclasses.replace(searched, alternatives=tuple(alts), first_search=first)


def _fine_moves(m: MetaOp, cur: list[AllocTuple], valid: Sequence[int], rng: random.Random) -> list:
    """More tuple changes for one MetaOp: one layer moved between its two tuples (either way), another
    split between neighbouring counts and a split between any two counts."""
    out, L = [], m.num_layers
    if len(cur) == 2:
        a, b = cur
        for d in (-1, 1):
            if 0 < a.layers + d < L:
                out.append([AllocTuple(a.devices, a.layers + d, float(a.layers + d)),
                            AllocTuple(b.devices, b.layers - d, float(b.layers - d))])
    if L > 1 and len(valid) > 1:
        i = rng.randrange(len(valid) - 1)
        k = rng.randrange(1, L)
        out.append([AllocTuple(valid[i + 1], k, float(k)), AllocTuple(valid[i], L - k, float(L - k))])
    if L > 1 and len(valid) > 2:
        i, j = sorted(rng.sample(range(len(valid)), 2))
        k = rng.randrange(1, L)
        out.append([AllocTuple(valid[j], k, float(k)), AllocTuple(valid[i], L - k, float(L - k))])
    return out


def _tuple_key(metaops: Sequence[MetaOp], tuples: Mapping[str, list[AllocTuple]]) -> tuple:
    """What :func:`.waves.schedule_level` reads of the tuples (it ignores ``layers_exact``)."""
    return tuple(tuple((t.devices, t.layers) for t in tuples[m.name]) for m in metaops)


def _signature(waves) -> tuple:
    return tuple(tuple((s.metaop, s.layer_start, s.layers, s.devices) for s in w.slices) for w in waves)


def _solve(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], N: int, start_ms: float,
           best: LevelSchedule) -> LevelSchedule:
    """Certified bound of the level and, where the gap is worth it, the solver's better schedule."""
    r = solver.solve_level(best.level, metaops, curves, N, best.allocation.c_star_ms, best.waves,
                           start_ms=start_ms)
    if r.waves:
        best = dataclasses.replace(best, waves=r.waves, variant=best.variant + "+milp")
    return dataclasses.replace(best, bound_ms=r.bound_ms, bound_kind=r.bound_kind)


def _local_search(metaops: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], N: int, start_ms: float,
                  best: LevelSchedule, seen: dict[tuple, float], steps: int, polished: bool = False,
                  fine: bool = False, times: Mapping[str, Mapping[int, float]] | None = None,
                  built: dict | None = None, pmemo: dict | None = None) -> LevelSchedule:
    """``steps`` random changes of one MetaOp's tuples, each kept when it shortens the level; ``polished``:
    every trial's waves are polished (:func:`.polish.polish`) and the polished span is what counts.

    ``fine``: :func:`_fine_moves` are among the changes too. ``seen``: spans already known by ``(propose,
    align, polished, tuples)``; a known trial no shorter than the best is not scheduled again (the same
    decision as scheduling it). ``best.waves`` must be Algorithm 1's waves of
    ``best.tuples`` (polished, when ``polished``). ``built``: Algorithm 1's waves by ``(propose, align,
    tuples)`` (each built once, handed out as copies); ``pmemo``: :func:`.polish.polish`'s memo."""
    built = {} if built is None else built
    rng = random.Random(1000 + best.level)
    _, propose, align = best.variant.split("/")
    align = align.split("+")[0]
    tag = "+polish" if polished else "+search"
    tuples = dict(best.tuples)
    ms = list(metaops)
    index = {m.name: i for i, m in enumerate(ms)}
    parts = list(_tuple_key(metaops, tuples))  # the key of ``tuples``, one part per MetaOp
    best_span = best.span_ms  # the same sum each time it is asked for: asked once per best
    seen.setdefault((propose, align, polished, tuple(parts)), best_span)
    for _ in range(steps):
        m = rng.choice(ms)
        valid = m.valid_counts(N)
        L = m.num_layers
        split = None
        if L > 1 and len(valid) > 1:
            i = rng.randrange(len(valid) - 1)
            k = rng.randrange(1, L)
            split = [AllocTuple(valid[i + 1], k, float(k)), AllocTuple(valid[i], L - k, float(L - k))]
        more = _fine_moves(m, tuples[m.name], valid, rng) if fine else []
        # the options: each valid count alone, the split, the finer moves (only the one drawn is built)
        j = rng.randrange(len(valid) + (split is not None) + len(more))
        if j < len(valid):
            choice = [AllocTuple(valid[j], L, float(L))]
        else:
            choice = split if split is not None and j == len(valid) else more[j - len(valid) - (split is not None)]
        trial = {**tuples, m.name: choice}
        trial_parts = parts.copy()
        trial_parts[index[m.name]] = tuple((t.devices, t.layers) for t in choice)
        key = (propose, align, polished, tuple(trial_parts))
        if seen.get(key, -1.0) >= best_span * (1 - 1e-12):
            continue
        bkey = key[:2] + key[3:]  # (propose, align, tuples): polished or not, Algorithm 1's waves are these
        got = built.get(bkey)
        if got is None:
            waves = built[bkey] = schedule_level(best.level, metaops, trial, curves, N, start_ms, propose=propose,
                                                 align=align, times=times)
        else:
            waves = copy_waves(got)
        if polished:
            waves = polish(waves, metaops, curves, N, times, memo=pmemo)
        span = seen[key] = sum(w.duration_ms for w in waves)
        if span < best_span * (1 - 1e-12):
            tuples, parts = trial, trial_parts
            best = LevelSchedule(level=best.level, allocation=best.allocation, tuples=trial, waves=waves,
                                 variant=best.variant.split(tag)[0] + tag)
            best_span = best.span_ms
    return best
