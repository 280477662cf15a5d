"""The HiGHS level solver: optimal on small instances against brute force, valid bounds, and a
planner that works without the solver package."""
import functools
import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from megatron_spindle.planner.level import patterns

from megatron_spindle.planner.level import solver
from megatron_spindle.planner.level.allocate import allocate_level
from megatron_spindle.planner.workload.curves import fit_piecewise
from megatron_spindle.planner.workload.graph import LayerConfig, Operator, TaskGraph, data_input
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.level.scheduler import plan_level

pytestmark = pytest.mark.skipif(not solver.available(), reason="highspy is not installed")


def written_on():
    """The analytic device the built-in solver instances below were chosen on: the constants (transformer
    floor 0.21 ms, every type by its operator count, ``max_efficiency`` 0.73). These tests exercise the solver on
    those instances, not the cost model (the default is now the eager floor)."""
    from megatron_spindle.planner.workload.analytic import FWD_BWD_OPS, DeviceModel
    return DeviceModel(max_efficiency=0.73, layer_latency_ms={k: round(0.21 * v / 55, 4) for k, v in FWD_BWD_OPS.items()})


def instance(rng: random.Random):
    """2-3 MetaOps of 1-4 layers, batch 4 or 8, on 2-8 devices, with random power-law curves."""
    n = rng.randint(2, 8)
    specs = [(rng.randint(1, 4), rng.choice((4, 8)), rng.uniform(1.0, 20.0), rng.uniform(0.3, 0.95))
             for _ in range(rng.randint(2, 3))]
    return (*level_of(specs, n), n)


def level_of(specs, n):
    """MetaOps (one chain of ``layers`` per task, batch ``batch``) and power-law curves ``t1 · shrink^log2(k)``
    on ``n`` devices, from ``(layers, batch, t1, shrink)`` per MetaOp."""
    ops = []
    for j, (layers, batch, _, _) in enumerate(specs):
        for i in range(layers):
            ops.append(Operator(name=f"t{j}.m.{i}", task=f"t{j}", module="m", op_type="transformer_layer",
                                batch=batch, layer=LayerConfig(hidden=8, num_heads=1, ffn_hidden=8, seq_len=2),
                                param_key=f"t{j}.{i}",
                                inputs=(f"t{j}.m.{i - 1}",) if i else (data_input(f"t{j}", "x"),),
                                fwd_flops=1e9, param_count=1, out_elems_per_sample=1, act_bytes_per_sample=1.0))
    graph = TaskGraph(model="bf", tasks=tuple(f"t{j}" for j in range(len(specs))), operators=tuple(ops))
    metaops = contract(graph)
    curves = {}
    for m, (_, _, t1, shrink) in zip(metaops, specs):
        c = m.valid_counts(n)
        curves[m.name] = fit_piecewise([(k, t1 * shrink ** math.log2(k)) for k in c], batch=m.batch, counts=c)
    return metaops, curves


def brute_force(metaops, curves, n):
    """Optimal wave schedule of one level: shortest path over remaining-layer states, every wave tried."""
    names = [m.name for m in metaops]
    counts = {m.name: m.valid_counts(n) for m in metaops}

    @functools.lru_cache(maxsize=None)
    def best(rem):
        if not any(rem):
            return 0.0
        out = math.inf
        options = [[(0, 0)] + ([(c, k) for c in counts[nm] for k in range(1, r + 1)] if r else [])
                   for nm, r in zip(names, rem)]
        for choice in itertools.product(*options):
            if sum(c for c, _ in choice) > n or not any(k for _, k in choice):
                continue
            dur = max(k * curves[nm].count_time(c) for (c, k), nm in zip(choice, names) if k)
            out = min(out, dur + best(tuple(r - k for r, (_, k) in zip(rem, choice))))
        return out

    return best(tuple(m.num_layers for m in metaops))


def area_milp(metaops, curves, n):
    """Model 1 of :mod:`.solver` as a MILP, solved to optimality by HiGHS."""
    mdl = solver._Model()
    C = mdl.var(0.0, math.inf, cost=1.0)
    area = {C: -float(n)}
    for m in metaops:
        xs = {c: mdl.var(0.0, m.num_layers, integer=True) for c in m.valid_counts(n)}
        mdl.row(m.num_layers, m.num_layers, {x: 1.0 for x in xs.values()})
        mdl.row(-math.inf, 0.0, {**{x: curves[m.name].count_time(c) for c, x in xs.items()}, C: -1.0})
        area.update({x: c * curves[m.name].count_time(c) for c, x in xs.items()})
    mdl.row(-math.inf, 0.0, area)
    sol = mdl.solve(60.0)
    assert sol.optimal
    return sol.value


@pytest.mark.parametrize("seed", range(24))
def test_solver_is_optimal_and_its_bound_valid_on_small_instances(seed):
    metaops, curves, n = instance(random.Random(seed))
    opt = brute_force(metaops, curves, n)
    heuristic = plan_level(metaops, curves, n, solve=False)
    c_star = allocate_level({m.name: m.num_layers for m in metaops}, curves, n).c_star_ms
    r = solver.solve_level(0, metaops, curves, n, c_star, heuristic.waves, time_limit_s=20.0, max_nodes=None,
                           exact_max_cells=10_000)
    span = sum(w.duration_ms for w in r.waves) if r.waves else heuristic.span_ms
    assert r.bound_kind == "optimal", (seed, r)
    assert span == pytest.approx(opt, rel=1e-6)                  # the solver's schedule is optimal
    assert c_star <= r.bound_ms * (1 + 1e-9) and r.bound_ms <= opt * (1 + 1e-6)   # its bound is valid
    # the area model alone is a valid bound too, between C* and the optimum, and :mod:`.area` solves it
    # exactly: the same optimum as HiGHS's MILP of it
    a = solver.area_bound(metaops, curves, n)
    assert c_star * (1 - 1e-6) <= a <= opt * (1 + 1e-6)
    assert a == pytest.approx(area_milp(metaops, curves, n), rel=1e-6)
    # the pattern bound (configuration LP) is valid too: after any number of rounds, with and without the
    # heuristic's span as the longest wave priced, and it is never above the optimum
    for rounds in (1, 3, 200):
        assert patterns.pattern_bound(metaops, curves, n, rounds=rounds) <= opt * (1 + 1e-6)
        assert patterns.pattern_bound(metaops, curves, n, heuristic=heuristic.waves, max_span=heuristic.span_ms,
                                      rounds=rounds) <= opt * (1 + 1e-6)
    # the wave model's schedule is a real schedule: whole layers, every layer once, devices within N
    for w in r.waves:
        assert sum(s.devices for s in w.slices) <= n
        assert len({s.metaop for s in w.slices}) == len(w.slices)
    if r.waves:
        done = {m.name: sum(s.layers for w in r.waves for s in w.slices if s.metaop == m.name) for m in metaops}
        assert done == {m.name: m.num_layers for m in metaops}


@pytest.mark.parametrize("seed", range(12))
def test_area_bound_is_the_area_models_optimum_on_larger_levels(seed):
    """Up to 6 MetaOps of up to 24 layers on up to 64 devices: the frontier sweep of :mod:`.area` equals
    HiGHS's optimum of the same MILP (and lies between C* and every schedule, here the heuristic's)."""
    rng = random.Random(100 + seed)
    n = rng.choice((8, 16, 32, 64))
    specs = [(rng.randint(1, 24), rng.choice((8, 16, 64)), rng.uniform(1.0, 20.0), rng.uniform(0.3, 0.95))
             for _ in range(rng.randint(2, 6))]
    metaops, curves = level_of(specs, n)
    a = solver.area_bound(metaops, curves, n)
    assert a == pytest.approx(area_milp(metaops, curves, n), rel=1e-6)
    c_star = allocate_level({m.name: m.num_layers for m in metaops}, curves, n).c_star_ms
    assert c_star * (1 - 1e-6) <= a <= plan_level(metaops, curves, n, solve=False).span_ms * (1 + 1e-9)


def assert_schedule(waves, metaops, n):
    """Whole layers, every layer once, at most one slice per MetaOp per wave, devices within ``n``, valid counts."""
    for w in waves:
        assert sum(s.devices for s in w.slices) <= n
        assert len({s.metaop for s in w.slices}) == len(w.slices)
        assert w.duration_ms == pytest.approx(max(s.time_ms for s in w.slices))
    for m in metaops:
        mine = sorted((s.layer_start, s.layers, s.devices) for w in waves for s in w.slices if s.metaop == m.name)
        assert all(d in m.valid_counts(n) for _, _, d in mine)
        assert [a for a, _, _ in mine] == list(itertools.accumulate([0] + [k for _, k, _ in mine[:-1]]))
        assert sum(k for _, k, _ in mine) == m.num_layers


@pytest.mark.parametrize("seed", range(8))
def test_pattern_dives_are_real_schedules_and_the_bound_stays_below_the_optimum(seed):
    """:func:`.patterns.improve` on small instances: its bound is at most the brute-force optimum, and its
    schedule (when it returns one) is a valid wave schedule, shorter than the heuristic's it started from,
    and no shorter than the optimum."""
    metaops, curves, n = instance(random.Random(200 + seed))
    opt = brute_force(metaops, curves, n)
    heuristic = plan_level(metaops, curves, n, solve=False)
    bound, waves = patterns.improve(metaops, curves, n, heuristic.waves)
    assert bound <= opt * (1 + 1e-6)
    if waves:
        assert_schedule(waves, metaops, n)
        span = sum(w.duration_ms for w in waves)
        assert opt * (1 - 1e-6) <= span < heuristic.span_ms


@pytest.mark.parametrize("model, tasks, devices, level", [("ofasys", 7, 8, 3), ("multitask-clip", 4, 16, 1)])
def test_pattern_dives_shorten_the_big_levels(model, tasks, devices, level):
    """On these levels (deterministic) the LP's dives find a schedule shorter than the level's heuristics
    (Algorithm 1 variants, local searches, throughput waves, polish): 0.4% on OFASys-7's third level on 8
    devices, 0.5% on Multitask-CLIP-4's encoders on 16 (with the analytic curves of
    docs/results/analytic_curves.md; on the former curves: 3.6%, and 0.3% on Multitask-CLIP-4's on 8)."""
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import make_metaops
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.metaops import levels
    from megatron_spindle.planner.workload.workloads import build_graph
    metaops = make_metaops(build_graph(model, tasks=tasks), load_cluster(None, num_devices=devices))
    curves = build_curves(metaops, devices, device=written_on())
    lv = levels(metaops)[level]
    heuristic = plan_level(lv, curves, devices)
    bound, waves = patterns.improve(lv, curves, devices, heuristic.waves, level=level)
    assert waves, "no dive beat the heuristic"
    assert_schedule(waves, lv, devices)
    span = sum(w.duration_ms for w in waves)
    assert bound <= span < heuristic.span_ms * (1 - 1e-3)


@pytest.mark.parametrize("model, tasks, devices", [("multitask-clip", 10, 16), ("ofasys", 7, 32)])
def test_patterns_backtracked_from_the_pricing_tables_are_the_repriced_ones(model, tasks, devices):
    """:meth:`.patterns._Pool.backtrack` (the best patterns read from the tables the last pricing kept)
    gives the same patterns, bit for bit, as :meth:`.patterns._Pool.patterns` pricing those durations
    again, for random duals over every duration and over a subset."""
    import numpy as np
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import make_metaops
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.metaops import levels
    from megatron_spindle.planner.workload.workloads import build_graph
    metaops = make_metaops(build_graph(model, tasks=tasks), load_cluster(None, num_devices=devices))
    curves = build_curves(metaops, devices, device=written_on())
    lv = levels(metaops)[1]
    heuristic = plan_level(lv, curves, devices)
    pool = patterns._pool(lv, curves, devices, heuristic.waves, heuristic.span_ms)
    rng = np.random.default_rng(7)
    for trial in range(6):
        pi = rng.random(len(lv)) * (rng.random(len(lv)) < 0.8)  # some MetaOps without a dual
        D = len(pool.Ds)
        rows = np.arange(D) if trial % 2 == 0 else np.sort(rng.choice(D, min(D, 128), replace=False))
        pool.price(pi, rows)
        positions = [int(d) for d in rng.choice(len(rows), 24, replace=False)]
        got = pool.backtrack(pi, rows, positions)
        want = pool.patterns(pi, [int(rows[d]) for d in positions])
        assert got is not None and len(got) == len(want)
        for (d1, a1, k1), (d2, a2, k2) in zip(got, want):
            assert d1 == d2 and a1.tolist() == a2.tolist() and k1.tolist() == k2.tolist()
    assert pool.backtrack(pi.copy(), rows, positions) is None  # other duals than the last pricing's


def test_planner_levels_carry_a_certified_bound():
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.assembly.render import certified_bound_ms
    from megatron_spindle.planner.workload.workloads import build_graph
    plan = make_plan(build_graph("ofasys", tasks=4), load_cluster(None, num_devices=8))
    for lv in plan.levels:
        assert lv.certified_bound_ms >= lv.c_star_ms and lv.bound_kind in ("C*", "area", "patterns", "cover", "waves",
                                                                            "optimal")
    assert plan.lower_bound_ms <= certified_bound_ms(plan) <= plan.makespan_ms * (1 + 1e-9)


@pytest.mark.parametrize("seed", (0, 5, 9, 13))
def test_pattern_bound_is_tighter_than_the_area_bound_where_waves_align_badly(seed):
    """The area model lets a wave's slices end at different times for free; every wave schedule pays for its
    longest slice. On these instances (2-3 MetaOps of 1-4 layers; deterministic) the configuration LP over
    wave patterns lies more than 3% above the area bound and below the brute-force optimum."""
    metaops, curves, n = instance(random.Random(seed))
    opt = brute_force(metaops, curves, n)
    a = solver.area_bound(metaops, curves, n)
    p = patterns.pattern_bound(metaops, curves, n, rounds=500)
    assert a * 1.03 < p <= opt * (1 + 1e-6), (a, p, opt)


def test_near_optimal_bound_is_valid_and_raises_the_lp(monkeypatch):
    """:mod:`.near_optimal` on 40 small levels (half with two identical MetaOps, whose duals it averages and
    whose layers it counts per type), with a ladder up to half the LP's bound and no column or node limit:
    never above the brute-force optimum, above the configuration LP on 11 of them (measured), at the
    optimum on 39."""
    from megatron_spindle.planner.level import near_optimal
    monkeypatch.setattr(near_optimal, "LADDER", (0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
    monkeypatch.setattr(near_optimal, "MAX_COLUMNS", 10**6)
    monkeypatch.setattr(near_optimal, "MAX_NODES", 10**6)
    raised = at_opt = 0
    for seed in range(40):
        rng = random.Random(1000 + seed)
        if seed % 2:
            metaops, curves, n = instance(rng)
        else:
            n = rng.randint(2, 8)
            twin, other = [(rng.randint(1, 4), rng.choice((4, 8)), rng.uniform(1.0, 20.0), rng.uniform(0.3, 0.95))
                           for _ in range(2)]
            metaops, curves = level_of([twin, twin, other], n)
        opt = brute_force(metaops, curves, n)
        h = plan_level(metaops, curves, n, solve=False)
        kw = dict(heuristic=h.waves, max_span=h.span_ms, rounds=200)
        lp = patterns.pattern_bound(metaops, curves, n, **kw)
        near = patterns.pattern_bound(metaops, curves, n, near=True, **kw)
        assert lp * (1 - 1e-9) <= near <= opt * (1 + 1e-6), (seed, lp, near, opt)
        raised += near > lp * (1 + 1e-6)
        at_opt += near >= opt * (1 - 1e-6)
    assert raised >= 8 and at_opt >= 36


def test_near_optimal_bound_raises_clip10_64s_encoder_bound():
    """Multitask-CLIP-10 / 64 GPUs: its encoders' best schedule lies over 3% above the configuration LP (6%),
    so the plan is not certified within 3% by the LP alone; the near-optimal cover (asked for: ``certify=True``,
    which ``make_plan`` leaves out) raises that level's bound above the LP and never above its schedule. (The cover was built for Multitask-CLIP-7 / 16; with the
    analytic curves of docs/results/analytic_curves.md the LP alone certifies that row within 3% (2.5%), and
    this is the built-in row that uses the cover.) What a correct planner keeps on any machine is asserted
    (valid bounds, the cover raising the LP); the tight figures are in ``scripts/bench_planner.py``."""
    metaops, curves, scheds = _clip10_64_schedules()
    enc = scheds[1]
    lp = patterns.pattern_bound(_levels(metaops)[1], curves, 64, heuristic=enc.waves, max_span=enc.span_ms)
    assert enc.bound_kind == "cover" and lp * (1 + 1e-4) < enc.bound_ms <= enc.span_ms, (lp, enc.bound_ms)
    for ls in scheds:
        assert ls.allocation.c_star_ms * (1 - 1e-9) <= ls.bound_ms <= ls.span_ms * (1 + 1e-9)


def _levels(metaops):
    from megatron_spindle.planner.workload.metaops import levels
    return levels(metaops)


@functools.lru_cache(maxsize=1)
def _clip10_64_schedules():
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import make_metaops, schedule
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    metaops = make_metaops(build_graph("multitask-clip", tasks=10), load_cluster(None, num_devices=64))
    curves = build_curves(metaops, 64, device=written_on())
    return metaops, curves, schedule(metaops, curves, 64, certify=True)


def test_planner_works_without_the_solver_package():
    code = ("import sys, json; sys.modules['highspy'] = None\n"
            "from megatron_spindle.planner.level import solver\n"
            "from megatron_spindle.planner.step.build import make_plan\n"
            "from megatron_spindle.planner.workload.cluster import load_cluster\n"
            "from megatron_spindle.planner.workload.workloads import build_graph\n"
            "p = make_plan(build_graph('ofasys', tasks=4), load_cluster(None, num_devices=8))\n"
            "print(json.dumps([solver.available(), [lv.bound_kind for lv in p.levels], p.makespan_ms]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    avail, kinds, makespan = json.loads(r.stdout)
    # no HiGHS: bounds from C* and the area model (:mod:`.area` needs only numpy), never the wave model's
    assert avail is False and set(kinds) <= {"C*", "area", "optimal"} and makespan > 0


def test_cli_plan_prints_bound_and_gap():
    # --no-search: the paper's pipeline, level by level, so its makespan has Σ C* and the certified bound beside it
    args = [sys.executable, "-m", "megatron_spindle.cli", "plan", "--model", "ofasys", "--tasks", "4", "--gpus", "8",
            "--passes", "4", "--no-search"]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["level_by_level"] and d["lower_bound_ms"] <= d["certified_bound_ms"] <= d["makespan_ms"]
    assert d["gap"] == pytest.approx(d["makespan_ms"] / d["certified_bound_ms"] - 1)
    r = subprocess.run(args, capture_output=True, text=True)
    assert "certified for level-by-level wave schedules" in r.stdout and "gap to the certified bound" in r.stdout


def test_cli_says_in_one_line_when_highs_is_missing():
    code = ("import sys; sys.modules['highspy'] = None\n"
            "from megatron_spindle.cli import main\n"
            "sys.exit(main(['plan', '--model', 'multitask-clip', '--size', 'tiny', '--tasks', '2', '--gpus', '2', "
            "'--passes', '1', '--json']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "highspy" in line]
    assert len(notes) == 1 and notes[0].startswith("note: highspy (HiGHS) is not installed") and \
        "pip install highspy" in notes[0], r.stderr


@pytest.mark.parametrize("seed", range(6))
def test_anneal_fit_is_the_shortest_duration_of_a_wave(seed):
    """:func:`.anneal.fit_wave` against every assignment of valid counts: the shortest duration of a wave with
    given layers per MetaOp on ``n`` devices (``inf`` when the MetaOps do not fit); ``_Level.plus`` (one
    layer more, without a fit when it fits under the wave's end) against a fresh fit."""
    from megatron_spindle.planner.level.anneal import _Level
    rng = random.Random(300 + seed)
    metaops, curves, n = instance(rng)
    times = {m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(n)} for m in metaops}
    lv = _Level(metaops, times, n)
    for _ in range(20):
        w = tuple(rng.randint(0, m.num_layers) for m in metaops)
        best = math.inf
        options = [[0] if not a else list(times[m.name]) for m, a in zip(metaops, w)]
        for cs in itertools.product(*options):
            if sum(cs) <= n:
                best = min(best, max((a * times[m.name][c] for m, a, c in zip(metaops, w, cs) if a), default=0.0))
        d, k = lv.fit(w)
        assert d == pytest.approx(best)
        m = rng.randrange(len(metaops))  # one layer more, by the shortcut: the same as fitting it afresh
        x, dx = lv.plus(w, m)
        assert x == w[:m] + (w[m] + 1,) + w[m + 1:]
        assert dx == pytest.approx(_Level(metaops, times, n).fit(x)[0])
        present = [m for m, a in enumerate(w) if a]
        if present and d < math.inf:  # the counts it picked reach that duration on at most n devices
            assert sum(lv.counts[m][k[m]] for m in present) <= n
            assert max(w[m] * lv.T[m][k[m]] for m in present) == pytest.approx(d)


@pytest.mark.parametrize("moves,rebuild_work,at_least", [(3000, 0, 10), (1, 6000, 11)])
def test_anneal_and_rebuild_give_real_schedules_and_mostly_the_optimum(moves, rebuild_work, at_least):
    """:func:`.anneal.anneal` from the paper's pipeline (no search) on 12 small instances, as annealing alone
    (3000 moves) and as ruin and recreate alone (one annealing move, :func:`.anneal.rebuild`'s runs): what it
    returns is a valid wave schedule, shorter than its input and no shorter than the brute-force optimum;
    the annealing ends at the optimum on 10 of the 12, ruin and recreate on at least 11 (measured: 12; the
    paper's pipeline alone: 2)."""
    from megatron_spindle.planner.level.anneal import anneal
    optimal = 0
    for seed in range(12):
        metaops, curves, n = instance(random.Random(400 + seed))
        opt = brute_force(metaops, curves, n)
        start = plan_level(metaops, curves, n, search=False, solve=False).waves
        span = sum(w.duration_ms for w in start)
        waves = anneal(start, metaops, curves, n, moves=moves, level=seed, rebuild_work=rebuild_work)
        if waves:
            assert_schedule(waves, metaops, n)
            assert opt * (1 - 1e-6) <= sum(w.duration_ms for w in waves) < span
            span = sum(w.duration_ms for w in waves)
        optimal += span <= opt * (1 + 1e-6)
    assert optimal >= at_least


def _encoders_after_dives(tasks: int, devices: int):
    """Multitask-CLIP's encoder level on ``devices``: ``(MetaOps, curves, the best of the heuristics and the
    pattern LP's dives, the planner's annealing moves)``."""
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import ANNEAL_WORK, make_metaops
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.metaops import levels
    from megatron_spindle.planner.workload.workloads import build_graph
    metaops = make_metaops(build_graph("multitask-clip", tasks=tasks), load_cluster(None, num_devices=devices))
    curves = build_curves(metaops, devices, device=written_on())
    lv = levels(metaops)[1]
    heuristic = plan_level(lv, curves, devices)
    _, dived = patterns.improve(lv, curves, devices, heuristic.waves, level=1)
    return lv, curves, dived or heuristic.waves, ANNEAL_WORK // sum(len(m.valid_counts(devices)) for m in lv)


def test_rebuild_shortens_the_annealing_best_on_clip7_16(monkeypatch):
    """On Multitask-CLIP-7 / 16 GPUs' encoders, with the planner's work limits, the ruin-and-recreate runs
    shorten the heuristics + dives + annealing's best when all six run (measured with the analytic curves of
    docs/results/analytic_curves.md: 129.92 -> 129.31 ms, 0.5%, found by the sixth seed) and stay above the
    level's bound; by default they stop after two runs in a row find nothing shorter (planning
    time), never longer than the annealing alone."""
    from megatron_spindle.planner.level import anneal as anneal_mod
    from megatron_spindle.planner.assembly.assemble import REBUILD_WORK
    lv, curves, start, moves = _encoders_after_dives(7, 16)
    annealed = anneal_mod.anneal(start, lv, curves, 16, moves=moves, level=1) or start
    runs = []
    rebuild = anneal_mod.rebuild
    monkeypatch.setattr(anneal_mod, "rebuild", lambda *a: runs.append(1) or rebuild(*a))
    stopped = anneal_mod.anneal(start, lv, curves, 16, moves=moves, level=1, rebuild_work=REBUILD_WORK) or annealed
    assert len(runs) == anneal_mod.REBUILD_FRUITLESS  # both found nothing: no third run
    assert sum(w.duration_ms for w in stopped) <= sum(w.duration_ms for w in annealed) * (1 + 1e-12)
    monkeypatch.setattr(anneal_mod, "REBUILD_FRUITLESS", anneal_mod.REBUILD_STARTS)
    waves = anneal_mod.anneal(start, lv, curves, 16, moves=moves, level=1, rebuild_work=REBUILD_WORK)
    assert waves, "nothing shorter than the start"
    assert_schedule(waves, lv, 16)
    span = sum(w.duration_ms for w in waves)
    assert span < sum(w.duration_ms for w in annealed) * (1 - 1e-4)
    assert span >= patterns.pattern_bound(lv, curves, 16, heuristic=waves, max_span=span) * (1 - 1e-9)


def test_anneal_shortens_the_dives_best_schedule():
    """On Multitask-CLIP-7 / 8 GPUs' encoders the annealing, with the planner's work limit, shortens the best
    schedule of the heuristics and the pattern LP's dives (measured with the analytic curves of
    docs/results/analytic_curves.md: 250.73 -> 249.92 ms, 0.3%; on the former curves Multitask-CLIP-4 / 16,
    70.64 -> 69.94 ms; asserted: any gain of more than 0.01%)."""
    from megatron_spindle.planner.level.anneal import anneal
    lv, curves, start, moves = _encoders_after_dives(7, 8)
    waves = anneal(start, lv, curves, 8, moves=moves, level=1)
    assert waves, "the annealing found nothing shorter"
    assert_schedule(waves, lv, 8)
    assert sum(w.duration_ms for w in waves) < sum(w.duration_ms for w in start) * (1 - 1e-4)
