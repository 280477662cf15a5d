"""Plans: JSON round trip, validation rules, placement, property tests, brute force, the CLI."""
import dataclasses
import functools
import itertools
import json
import math
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_spindle.planner.level.allocate import allocate_level
from megatron_spindle.planner.workload.analytic import CurvesFile
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.curves import fit_piecewise
from megatron_spindle.planner.workload.graph import LayerConfig, Operator, TaskGraph, data_input
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.assembly.placement import PlacementError
from megatron_spindle.planner.assembly.plan import Plan, SliceRef
from megatron_spindle.planner.level.scheduler import plan_level
from megatron_spindle.planner.simulation.simulate import step_time_ms
from megatron_spindle.planner.simulation.step_bound import plan_step_bound
from megatron_spindle.planner.assembly.validate import PlanError, check_plan
from megatron_spindle.planner.workload.workloads import build_graph


@functools.lru_cache(maxsize=None)
def clip_plan(n=16):
    return make_plan(build_graph("multitask-clip", tasks=4), load_cluster(None, num_devices=n))


def test_plan_json_round_trips_exactly(tmp_path):
    p = clip_plan()
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    path = tmp_path / "plan.json"
    p.save(str(path))
    assert Plan.load(str(path)) == p


def test_transfer_posting_round_trips_and_old_plans_post_at_the_producer():
    p = clip_plan()
    assert p.transfer_posting == "producer" and "transfer_posting" not in p.to_json()
    b = dataclasses.replace(p, transfer_posting="boundary")
    assert b.to_json()["transfer_posting"] == "boundary"
    assert Plan.from_json(json.loads(json.dumps(b.to_json()))) == b
    d = b.to_json()
    del d["transfer_posting"]  # a plan written before the field: its transfers run producer-posted
    assert Plan.from_json(d) == p
    d["transfer_posting"] = "early"
    with pytest.raises(ValueError, match="transfer_posting 'early' must be one of producer, boundary"):
        Plan.from_json(d)


def test_plan_refuses_other_schema_and_garbage(tmp_path):
    d = clip_plan().to_json()
    d["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version 99"):
        Plan.from_json(d)
    with pytest.raises(ValueError, match="not a Spindle plan"):
        Plan.from_json({"waves": []})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(str(bad))


def test_slice_names_parse_back():
    for s in clip_plan().slices():
        assert SliceRef.from_str(s.name) == s.ref
        assert clip_plan().slice(s.name) == s
    assert str(SliceRef.from_str("w3:vision-text.vision.layers[8-15]x4tp2")) == "w3:vision-text.vision.layers[8-15]x4tp2"
    with pytest.raises(ValueError, match="not a slice name"):
        SliceRef.from_str("vision[0-3]")


def _replace_slice(plan, wave, idx, **kw):
    waves = list(plan.waves)
    slices = list(waves[wave].slices)
    slices[idx] = dataclasses.replace(slices[idx], **kw)
    waves[wave] = dataclasses.replace(waves[wave], slices=tuple(slices))
    return dataclasses.replace(plan, waves=tuple(waves))


def _rules(plan):
    with pytest.raises(PlanError) as e:
        check_plan(plan)
    return {v.rule for v in e.value.violations}, str(e.value)


def test_validation_rules_name_the_wave_and_device():
    p = clip_plan()
    check_plan(p)
    w = next(i for i, w in enumerate(p.waves) if len(w.slices) >= 2)
    a, b = p.waves[w].slices[:2]
    clash = _replace_slice(p, w, 1, ranks=(a.ranks[0],) + b.ranks[1:])
    rules, text = _rules(clash)
    assert 2 in rules and f"rule 2 (wave {w}, device {a.ranks[0]})" in text
    assert ">" in text and "<" in text  # the grid marks the bad cell
    s0 = p.waves[w].slices[0]
    rules, _ = _rules(_replace_slice(p, w, 0, num_layers=s0.num_layers + 1))
    assert 4 in rules
    over = dataclasses.replace(p, device_memory_bytes=(p.memory_limit_bytes * 2,) + p.device_memory_bytes[1:])
    rules, text = _rules(over)
    assert 7 in rules and "device 0" in text
    # a slice moved before its producer: dependency rule
    last = p.waves[-1]
    moved = dataclasses.replace(p, waves=(dataclasses.replace(p.waves[0], slices=p.waves[0].slices + tuple(
        dataclasses.replace(s, wave=0) for s in last.slices)),) + p.waves[1:-1] + (dataclasses.replace(last, slices=()),))
    rules, _ = _rules(moved)
    assert 5 in rules
    # two MetaOps sharing a weight at different tensor-parallel degrees (their shards could not be summed)
    def doubles(x):  # every slice of x has the devices for twice its tensor-parallel degree
        return all(len(s.ranks) % (2 * x.tp) == 0 for s in p.slices() if s.metaop == x.name)
    shared, m = next((k, x) for k in sorted({k for m in p.metaops for k in m.param_keys if k})
                     if sum(k in m.param_keys for m in p.metaops) > 1
                     for x in p.metaops if k in x.param_keys and doubles(x))
    rules, text = _rules(dataclasses.replace(p, metaops=tuple(
        dataclasses.replace(x, tp=x.tp * 2) if x is m else x for x in p.metaops)))
    assert 3 in rules and f"holds weight {shared!r} at tp=" in text
    with pytest.raises(PlanError, match="rule 9"):
        check_plan(p, world_size=8)
    with pytest.raises(PlanError, match="not for this model"):
        check_plan(p, graph_fingerprint=build_graph("ofasys", tasks=4).fingerprint())


def test_placement_keeps_tp_groups_in_islands_and_prefers_local_flows():
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import assemble_plan, make_metaops, schedule
    from megatron_spindle.planner.step.choose import step_ms
    from megatron_spindle.planner.assembly.placement import place, sequential_placement
    graph, cluster = build_graph("qwen-val"), load_cluster(None, num_devices=32)
    p = make_plan(graph, cluster)
    for s in p.slices():
        for i in range(0, len(s.ranks), s.tp):
            assert len({r // 8 for r in s.ranks[i:i + s.tp]}) == 1
    moved = sum(t.bytes - t.local_bytes for t in p.transfers)
    assert moved < sum(t.bytes for t in p.transfers)
    # the chosen plan is never slower than the naive placement of the level-by-level waves
    naive = make_plan(graph, cluster, placement="sequential")
    assert step_ms(p, cluster) <= step_ms(naive, cluster) * (1 + 1e-12)
    # on the same waves (the paper's pipeline here), island-aware placement moves fewer bytes across islands
    metaops = make_metaops(graph, cluster)
    curves = build_curves(metaops, 32)
    waves = [w for ls in schedule(metaops, curves, 32, search=False) for w in ls.waves]
    aware, seq = (assemble_plan(graph, cluster, metaops, curves, [], waves, ranks, system="spindle")
                  for ranks in (place(metaops, waves, cluster), sequential_placement(waves)))
    assert sum(t.cross_island_bytes for t in aware.transfers) < sum(t.cross_island_bytes for t in seq.transfers)


def test_out_of_memory_names_wave_device_and_bytes():
    with pytest.raises(PlacementError) as e:
        # one pass of 8 per task on 40 GiB devices: Qwen-VAL's 7B LLM and its optimizer state alone take more
        make_plan(build_graph("qwen-val", batch=8), load_cluster(None, num_devices=8, memory_gib=40))
    msg = str(e.value)
    assert "out of memory in wave" in msg and "on device" in msg and "GiB" in msg and "limit" in msg


def test_planning_is_fast_and_close_to_the_bound():
    p = clip_plan(32)
    assert p.makespan_ms >= p.lower_bound_ms * (1 - 1e-9)
    assert p.makespan_ms <= 1.10 * p.lower_bound_ms


# -- property tests on random graphs and curves -------------------------------------------------------------
@st.composite
def random_workload(draw):
    ntasks = draw(st.integers(1, 3))
    ops, tasks = [], []
    batch_choices = [4, 6, 8, 12]
    for t in range(ntasks):
        task = f"t{t}"
        tasks.append(task)
        B = draw(st.sampled_from(batch_choices))
        heads = []
        for e in range(draw(st.integers(1, 2))):  # encoders
            h = draw(st.sampled_from([16, 32]))
            prev_e = [data_input(task, f"x{e}")]
            for i in range(draw(st.integers(1, 5))):
                name = f"{task}.enc{e}.{i}"
                ops.append(Operator(name=name, task=task, module=f"enc{e}", op_type="transformer_layer",
                                    batch=B, layer=LayerConfig(hidden=h, num_heads=2, ffn_hidden=2 * h, seq_len=4),
                                    param_key=f"shared{e}.{i}" if draw(st.booleans()) else name,
                                    inputs=tuple(prev_e), fwd_flops=draw(st.floats(1e9, 1e13)),
                                    param_count=draw(st.integers(10, 10**6)), out_elems_per_sample=4 * h,
                                    act_bytes_per_sample=draw(st.floats(1.0, 1e5))))
                prev_e = [name]
            heads.append(prev_e[0])
        ops.append(Operator(name=f"{task}.loss", task=task, module="loss", op_type="contrastive_loss", batch=B,
                            layer=LayerConfig(hidden=16, proj_dim=16), param_key="", inputs=tuple(heads),
                            fwd_flops=1e6, param_count=0, out_elems_per_sample=1, act_bytes_per_sample=8.0,
                            batch_splittable=False, tp_splittable=False))
    graph = TaskGraph(model="random", tasks=tuple(tasks), operators=tuple(ops))
    n = draw(st.integers(1, 8))
    curves = []
    for m in contract(graph):
        pts, t = [], draw(st.floats(0.1, 50.0))
        for c in m.valid_counts(n):
            pts.append([c, t])
            t = t * draw(st.floats(0.3, 1.1))  # may be non-monotone: the fit must repair it
        curves.append({"metaop": m.name, "points": pts})
    return graph, n, CurvesFile.parse({"curves": curves})


def below_bound_case():
    """The case hypothesis once found (3 tasks on 2 devices): the whole-step choice's winner, task-level's
    schedule with a step search, runs t2's 8 ms loss (level 1) beside three layers of t0's encoder (level 0), so
    its waves cross levels and take 16 ms against Σ C* = 9 + 8 ms. The bound is right (it bounds level-by-level
    waves); the plan is not level by level, which its variant did not say and :attr:`Plan.level_by_level` does."""
    def enc(task, e, i, inputs):
        name = f"{task}.enc{e}.{i}"
        return Operator(name=name, task=task, module=f"enc{e}", op_type="transformer_layer", batch=4,
                        layer=LayerConfig(hidden=16, num_heads=2, ffn_hidden=32, seq_len=4), param_key=name,
                        inputs=inputs, fwd_flops=1e9, param_count=10, out_elems_per_sample=64,
                        act_bytes_per_sample=1.0)

    def loss(task, inputs):
        return Operator(name=f"{task}.loss", task=task, module="loss", op_type="contrastive_loss", batch=4,
                        layer=LayerConfig(hidden=16, proj_dim=16), param_key="", inputs=inputs, fwd_flops=1e6,
                        param_count=0, out_elems_per_sample=1, act_bytes_per_sample=8.0, batch_splittable=False,
                        tp_splittable=False)

    ops = [enc("t0", 0, 0, (data_input("t0", "x0"),)), enc("t0", 1, 0, (data_input("t0", "x1"),))]
    ops += [enc("t0", 1, i, (f"t0.enc1.{i - 1}",)) for i in range(1, 5)] + [loss("t0", ("t0.enc0.0", "t0.enc1.4"))]
    for t in ("t1", "t2"):
        ops += [enc(t, 0, 0, (data_input(t, "x0"),)), loss(t, (f"{t}.enc0.0",))]
    graph = TaskGraph(model="random", tasks=("t0", "t1", "t2"), operators=tuple(ops))
    points = {"t0.enc0.0": [[1, 1.0], [2, 1.0]], "t0.enc1.layers": [[1, 3.0], [2, 1.5]], "t0.loss": [[1, 1.0]],
              "t1.enc0.0": [[1, 1.0], [2, 1.0]], "t1.loss": [[1, 1.0]], "t2.enc0.0": [[1, 1.0], [2, 1.0]],
              "t2.loss": [[1, 8.0]]}
    return graph, 2, CurvesFile.parse({"curves": [{"metaop": m, "points": p} for m, p in points.items()]})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_workload())
@example(below_bound_case())
def test_random_plans_validate_and_never_beat_the_bound(work):
    graph, n, curves = work
    plan = make_plan(graph, load_cluster(None, num_devices=n, gpus_per_node=4), curves_file=curves)
    check_plan(plan)
    if plan.level_by_level:  # the waves one after another, level by level: Σ C* bounds their makespan
        assert plan.makespan_ms >= plan.lower_bound_ms * (1 - 1e-9)
    cluster = load_cluster(None, num_devices=n, gpus_per_node=4)
    assert step_time_ms(plan, cluster) >= plan_step_bound(plan, cluster).bound_ms * (1 - 1e-9)  # every plan
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_the_below_bound_case_is_not_level_by_level():
    graph, n, curves = below_bound_case()
    plan = make_plan(graph, load_cluster(None, num_devices=n, gpus_per_node=4), curves_file=curves)
    assert plan.makespan_ms < plan.lower_bound_ms and not plan.level_by_level
    own = make_plan(graph, load_cluster(None, num_devices=n, gpus_per_node=4), curves_file=curves, search=False)
    assert own.level_by_level and own.makespan_ms >= own.lower_bound_ms * (1 - 1e-9)


# -- differential test against brute force --------------------------------------------------------------------
def brute_force_level(metaops, curves, n):
    """Optimal wave schedule of one level by shortest path over remaining-layer states (tiny cases)."""
    names = [m.name for m in metaops]
    counts = {m.name: m.valid_counts(n) for m in metaops}

    @functools.lru_cache(maxsize=None)
    def best(rem):
        if not any(rem):
            return 0.0
        out = math.inf
        options = []
        for i, name in enumerate(names):
            opts = [(0, 0)]
            if rem[i]:
                opts += [(c, k) for c in counts[name] for k in range(1, rem[i] + 1)]
            options.append(opts)
        for choice in itertools.product(*options):
            if sum(c for c, _ in choice) > n or not any(k for _, k in choice):
                continue
            dur = max(k * curves[name].time(c) for (c, k), name in zip(choice, names) if k)
            nxt = tuple(r - k for r, (_, k) in zip(rem, choice))
            out = min(out, dur + best(nxt))
        return out

    return best(tuple(m.num_layers for m in metaops))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.lists(st.tuples(st.integers(1, 4), st.floats(1.0, 20.0), st.floats(0.2, 0.9)),
                                   min_size=2, max_size=3))
def test_scheduler_against_brute_force(n, specs):
    ops = []
    for j, (layers, t1, shrink) in enumerate(specs):
        for i in range(layers):
            ops.append(Operator(name=f"t{j}.m.{i}", task=f"t{j}", module="m", op_type="transformer_layer", batch=4,
                                layer=LayerConfig(hidden=8, num_heads=1, ffn_hidden=8, seq_len=2),
                                param_key=f"t{j}.{i}", inputs=(f"t{j}.m.{i - 1}",) if i else (data_input(f"t{j}", "x"),),
                                fwd_flops=1e9, param_count=1, out_elems_per_sample=1, act_bytes_per_sample=1.0))
    graph = TaskGraph(model="bf", tasks=tuple(f"t{j}" for j in range(len(specs))), operators=tuple(ops))
    metaops = contract(graph)
    curves = {}
    for m, (_, t1, shrink) in zip(metaops, specs):
        c = m.valid_counts(n)
        curves[m.name] = fit_piecewise([(k, t1 * shrink ** math.log2(k)) for k in c], batch=m.batch, counts=c)
    sched = plan_level(metaops, curves, n)
    opt = brute_force_level(metaops, curves, n)
    c_star = allocate_level({m.name: m.num_layers for m in metaops}, curves, n).c_star_ms
    assert c_star <= opt * (1 + 1e-9)          # C* is a true lower bound
    assert opt <= sched.span_ms * (1 + 1e-9)    # no schedule beats the optimum (accounting is right)
    assert sched.span_ms <= 1.5 * opt           # and the heuristic stays close to it


# -- CLI -----------------------------------------------------------------------------------------------------
def spindle(*args):
    return subprocess.run([sys.executable, "-m", "megatron_spindle.cli", *args], capture_output=True, text=True)


def check_figures(d: dict) -> None:
    """``spindle plan --json``'s figures: the step and its bound for every plan; the per-pass makespan with Σ C*
    only for a level-by-level plan, and then within 10% of it."""
    assert d["step_ms"] >= d["step_bound_ms"] * (1 - 1e-9)
    keys = ("makespan_ms", "lower_bound_ms", "certified_bound_ms", "ratio", "gap")
    if d["level_by_level"]:
        assert 1 - 1e-9 <= d["makespan_ms"] / d["lower_bound_ms"] <= 1.10 and d["ratio"] == pytest.approx(
            d["makespan_ms"] / d["lower_bound_ms"])
        assert d["lower_bound_ms"] <= d["certified_bound_ms"] * (1 + 1e-9)
    else:
        assert all(d[k] is None for k in keys), d


def test_cli_plan_json_and_files(tmp_path):
    r = spindle("plan", "--model", "multitask-clip", "--tasks", "4", "--gpus", "8", "--json",
                "--out", str(tmp_path / "p.json"), "--gantt", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("makespan_ms", "lower_bound_ms", "planning_s", "num_waves", "num_metaops", "num_levels", "step_ms",
              "step_bound_ms", "configuration", "schedule", "level_by_level"):
        assert k in d
    check_figures(d)
    assert d["configuration"]["given"] is False and d["passes"] == d["configuration"]["passes"]
    assert Plan.load(str(tmp_path / "p.json")).world_size == 8
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plan_prints_the_step_compare_prints():
    """One step figure: ``spindle plan`` plans at the configuration ``spindle compare`` picks for Spindle."""
    work = ["--model", "multitask-clip", "--size", "tiny", "--tasks", "4", "--gpus", "4"]
    r = spindle("plan", *work, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    r = spindle("compare", *work, "--json", "--no-band")
    assert r.returncode == 0, r.stderr
    sp = json.loads(r.stdout)["results"][0]["systems"]["spindle"]
    assert plan["step_ms"] == pytest.approx(sp["step_ms"], rel=1e-12)
    assert plan["configuration"]["label"] == sp["configuration"]["label"]
    check_figures(plan)


def test_cli_plan_tables():
    r = spindle("plan", "--model", "ofasys", "--tasks", "4", "--gpus", "8", "--passes", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "MetaOp" in out and "wave level" in out and "planning time" in out and "\nkey: A caption." in out
    assert "configuration P=2 recompute=none (given: --passes" in out
    assert re.search(r"^step +[\d.]+ ms +\(simulated whole step: 2 passes", out, flags=re.M)
    assert re.search(r"^step bound +[\d.]+ ms", out, flags=re.M)
    r = spindle("plan", "--model", "ofasys", "--tasks", "4", "--gpus", "8", "--passes", "2", "--json")
    d = json.loads(r.stdout)
    check_figures(d)
    if d["level_by_level"]:
        assert "sum C*" in out and "makespan / sum C*" in out
    else:
        assert not re.search(r"^sum C\*", out, flags=re.M) and "makespan / sum C*" not in out
        assert "not level by level" in out


def test_grid_level_column_is_the_metaops_level_for_a_baselines_schedule_too():
    """A baseline numbers its waves' ``level`` field by wave; the grid prints the MetaLevel of the MetaOps."""
    from megatron_spindle.planner.step.build import plan_system
    from megatron_spindle.planner.assembly.render import grid

    graph, cluster = build_graph("multitask-clip", tasks=4, size="tiny"), load_cluster(None, num_devices=8)
    for system in ("sequential", "spindle"):
        plan = plan_system(system, graph, cluster)
        level = {m.name: m.level for m in plan.metaops}
        shown = dict(re.findall(r"^w(\d+) L(\S+) ", grid(plan), flags=re.M))
        assert len(shown) == len(plan.waves), system
        for w in plan.waves:
            assert shown[str(w.index)] == ",".join(str(x) for x in sorted({level[s.metaop] for s in w.slices}))
    assert shown == {str(w.index): str(w.level) for w in plan.waves}  # Spindle's waves go level by level
    seq = plan_system("sequential", graph, cluster)
    assert max(w.level for w in seq.waves) == len(seq.waves) - 1 > max(m.level for m in seq.metaops)


def test_gantt_names_devices_on_the_axis():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from megatron_spindle.planner.assembly.render import device_ticks, gantt_figure

    fig = gantt_figure(clip_plan(16))
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"d{d}" for d in range(16)]
        assert list(ax.get_yticks()) == list(range(16))
    finally:
        plt.close(fig)
    assert device_ticks(64) == list(range(0, 64, 2)) and device_ticks(256)[:3] == [0, 8, 16]
    assert device_ticks(32) == list(range(32)) and len(device_ticks(1000)) <= 32


def test_gantt_at_32_devices_has_the_step_a_full_key_and_no_overlapping_labels():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from megatron_spindle.plan_output import pass_timeline, step_title
    from megatron_spindle.planner.assembly.render import codes, gantt_figure, grid, grid_key
    from megatron_spindle.planner.simulation.simulate import simulate

    cluster = load_cluster(None, num_devices=32)
    plan = make_plan(build_graph("multitask-clip", tasks=10, passes=16), cluster, passes=16)
    sim = simulate(plan, cluster, check_memory=False)
    fig = gantt_figure(plan, timeline=pass_timeline(plan, cluster), step=step_title(sim))
    try:
        ax, key = fig.axes
        assert f"step {sim.step_ms:.1f} ms = 16 passes of {sim.pass_ms:.1f} ms" in ax.get_title()
        names = [t.get_text() for t in key.get_legend().get_texts()]
        assert len(names) == len(plan.metaops) and all(n.endswith(m.name) for n, m in zip(names, plan.metaops))
        fig.canvas.draw()
        boxes = [t.get_window_extent() for t in ax.texts]
        assert boxes and not [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
        assert ax.get_xlim()[1] == pytest.approx(sim.pass_ms)  # one pass, forward and backward
    finally:
        plt.close(fig)
    text = grid(plan) + "\n" + grid_key(plan)  # the terminal grid prints its key
    assert all(f"{code} {name}" in " ".join(text.split()) for name, code in codes(plan).items())


@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt5", "--gpus", "8"], "unknown model 'gpt5'"),
    (["--model", "multitask-clip", "--tasks", "11", "--gpus", "8"], "trains 1 to 10 tasks"),
    (["--model", "multitask-clip", "--tasks", "0", "--gpus", "8"], "argument --tasks: 0 must be positive"),
    (["--model", "multitask-clip", "--gpus", "0"], "argument --gpus: 0 must be positive"),
    (["--gpus", "8"], "give --model NAME|SPEC.toml or --model-provider"),
    (["--model", "qwen-val", "--gpus", "2"], "needs 8 devices"),
    (["--model", "qwen-val", "--gpus", "8", "--curves", "/nonexistent.json"], "does not exist"),
])
def test_cli_bad_input_one_clear_line(args, needle):
    r = spindle("plan", *args)
    assert r.returncode == 2
    assert needle in r.stderr and r.stderr.count("\n") == 1


def test_cli_malformed_curves(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"curves": [{"metaop": "x", "points": [[1, -2]]}]}))
    r = spindle("plan", "--model", "qwen-val", "--gpus", "16", "--curves", str(f))
    assert r.returncode == 2 and "invalid point [1, -2]" in r.stderr


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(tasks=d["tasks"][:-1], task_weights=d["task_weights"][:-1]), "does not match the tasks"),
    (lambda d: d.update(tasks=d["tasks"] + d["tasks"][:1], task_weights=d["task_weights"] + [1.0]), "each task once"),
    (lambda d: d.update(task_weights=[float("nan")] + d["task_weights"][1:]), "task_weights"),
    (lambda d: d.update(task_weights=d["task_weights"][:-1]), "one finite non-negative number per task"),
    (lambda d: d.update(model=""), "plan field model"),
])
def test_plan_task_fields_are_checked_when_read(edit, needle):
    d = json.loads(json.dumps(clip_plan().to_json()))
    edit(d)
    with pytest.raises(ValueError, match=needle):
        Plan.from_json(d)


@pytest.mark.parametrize("doc,needle", [
    ({"curves": []}, "has no curves"),
    ({}, "has no curves"),
    ({"curves": [{"metaop": "x", "points": [[1, 1e300]]}]}, "invalid point"),
    ({"curves": [{"metaop": "x", "points": [[1.5, 1.0]]}]}, "invalid point"),
    ({"curves": [{"metaop": "x", "points": [[100000, 1.0]]}]}, "invalid point"),
    ({"measured": {"optimizer": {"fixed_ms": float("nan")}}, "curves": [{"metaop": "x", "points": [[1, 1.0]]}]},
     "measured.optimizer.fixed_ms = nan"),
    ({"device": {"peak_tflops": float("inf")}, "curves": [{"metaop": "x", "points": [[1, 1.0]]}]}, "not a finite"),
    ({"device": {"layer_latency_ms": {"lm_head": -1}}, "curves": [{"metaop": "x", "points": [[1, 1.0]]}]},
     "layer_latency_ms.lm_head"),
])
def test_curves_files_are_finite_non_empty_and_bounded(doc, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        CurvesFile.parse(doc, origin="c.json")


def test_help_lists_every_shipped_model():
    from megatron_spindle.planner.workload.spec import shipped_models

    r = spindle("plan", "--help")
    assert r.returncode == 0 and len(shipped_models()) == 4
    text = " ".join(r.stdout.split())
    assert all(m in text for m in shipped_models()) and "30b, 70b" in text


def test_any_task_count_from_one_trains_the_first_k():
    from megatron_spindle.planner.workload.spec import load_spec

    for model in ("multitask-clip", "ofasys", "qwen-val", "imagebind"):
        names = load_spec(model).task_names()
        for k in range(1, load_spec(model).task_counts[-1] + 1):
            assert build_graph(model, tasks=k, size="tiny").tasks == names[:k]
    with pytest.raises(ValueError, match=r"trains 1 to 3 tasks .*not 4"):
        build_graph("qwen-val", tasks=4)


@pytest.mark.parametrize("command,flag", [("plan", "--gantt"), ("compare", "--plot")])
def test_without_matplotlib_the_picture_flags_are_one_line_before_planning(tmp_path, command, flag):
    png = str(tmp_path / "x.png")
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from megatron_spindle.cli import main\n"
            f"sys.exit(main([{command!r}, '--model', 'multitask-clip', '--size', 'tiny', '--tasks', '2', "
            f"'--gpus', '2', {flag!r}, {png!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == f"spindle {command}: error: {flag} needs matplotlib: pip install -e '.[plot]' (matplotlib)\n"
