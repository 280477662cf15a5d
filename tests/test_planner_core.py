"""Pure planner tests: contraction, curves, allocation, discretization, the paper's worked example."""
import subprocess
import sys

import pytest

from megatron_spindle.planner.level.allocate import allocate_level, bipoint
from megatron_spindle.planner.workload.curves import ScalingCurve, Segment, fit_piecewise
from megatron_spindle.planner.workload.graph import LayerConfig, Operator, TaskGraph, data_input
from megatron_spindle.planner.workload.metaops import contract, levels
from megatron_spindle.planner.workload.workloads import build_graph


def linear_curve(a: float, counts=(1, 2, 3, 4)) -> ScalingCurve:
    """T(n) = a/n (perfect scaling) with a negligible latency."""
    return ScalingCurve(batch=12, segments=(Segment(0.0, 1e-12, a / 12),), counts=counts)


# -- the paper's worked example (Figure 5a): 3 MetaOps with 8, 12, 6 layers on 4 devices -----------------
def test_paper_worked_example_allocation_and_bipoint():
    curves = {"m1": linear_curve(1.5), "m2": linear_curve(1.0), "m3": linear_curve(4 / 3)}
    layers = {"m1": 8, "m2": 12, "m3": 6}
    alloc = allocate_level(layers, curves, 4)
    assert alloc.c_star_ms == pytest.approx(8.0, rel=1e-6)
    assert alloc.n_star["m2"] == pytest.approx(1.5, rel=1e-6)
    assert sum(alloc.n_star.values()) == pytest.approx(4.0, rel=1e-6)
    for m in layers:  # everyone finishes together at C*
        assert layers[m] * curves[m].time(alloc.n_star[m]) == pytest.approx(alloc.c_star_ms, rel=1e-6)
    tuples = bipoint(12, curves["m2"], alloc.n_star["m2"], alloc.c_star_ms, (1, 2, 3, 4))
    assert [(t.devices, t.layers) for t in tuples] == [(2, 8), (1, 4)]


def test_bipoint_keeps_layers_and_finish_time():
    curve = linear_curve(1.0)
    for n_star, c_star in [(1.5, 8.0), (2.5, 4.8), (3.2, 3.75)]:
        ts = bipoint(12, curve, n_star, c_star, (1, 2, 3, 4))
        assert sum(t.layers for t in ts) == 12
        assert sum(t.layers_exact for t in ts) == pytest.approx(12)
        assert sum(t.layers_exact * curve.time(t.devices) for t in ts) == pytest.approx(c_star, rel=1e-9)


def test_bipoint_dummy_and_exact():
    curve = linear_curve(1.0)
    assert [(t.devices, t.layers) for t in bipoint(5, curve, 0.4, 2.0, (1, 2))] == [(1, 5)]
    assert [(t.devices, t.layers) for t in bipoint(5, curve, 2.0, 2.5, (1, 2))] == [(2, 5)]


# -- contraction and levels ----------------------------------------------------------------------------
def _op(name, task, inputs, op_type="transformer_layer", batch=8, hidden=16, key=None):
    return Operator(name=name, task=task, module=name.split(".")[1], op_type=op_type, batch=batch,
                    layer=LayerConfig(hidden=hidden, num_heads=2, ffn_hidden=32, seq_len=4),
                    param_key=key if key is not None else name, inputs=tuple(inputs), fwd_flops=1e6,
                    param_count=100, out_elems_per_sample=64, act_bytes_per_sample=100.0)


def test_contraction_merges_chains_and_keeps_shared_weights_separate():
    ops = [
        _op("a.enc.0", "a", [data_input("a", "x")], key="enc.0"), _op("a.enc.1", "a", ["a.enc.0"], key="enc.1"),
        _op("a.enc.2", "a", ["a.enc.1"], key="enc.2"),
        # task b uses the same weights with another batch: its own MetaOp, same param keys
        _op("b.enc.0", "b", [data_input("b", "x")], batch=4, key="enc.0"),
        _op("b.enc.1", "b", ["b.enc.0"], batch=4, key="enc.1"),
        # a different layer shape breaks the chain
        _op("a.dec.0", "a", ["a.enc.2"], hidden=32), _op("a.dec.1", "a", ["a.dec.0"], hidden=32),
        # in-degree 2 starts a new MetaOp
        _op("a.mix.0", "a", ["a.dec.1", "b.enc.1"], hidden=32), _op("a.mix.1", "a", ["a.mix.0"], hidden=32),
    ]
    ms = contract(TaskGraph(model="toy", tasks=("a", "b"), operators=tuple(ops)))
    by = {m.name: m for m in ms}
    assert sorted(by) == ["a.dec.layers", "a.enc.layers", "a.mix.layers", "b.enc.layers"]
    assert by["a.enc.layers"].num_layers == 3 and by["b.enc.layers"].num_layers == 2
    assert by["a.enc.layers"].param_keys[:2] == by["b.enc.layers"].param_keys
    assert by["a.mix.layers"].inputs == ("a.dec.layers", "b.enc.layers")
    assert [m.level for m in ms] == [0, 0, 1, 2]
    assert [[m.name for m in lv] for lv in levels(ms)] == [["a.enc.layers", "b.enc.layers"], ["a.dec.layers"],
                                                          ["a.mix.layers"]]


def test_branching_output_ends_a_metaop():
    ops = [_op("a.x.0", "a", [data_input("a", "x")]), _op("a.x.1", "a", ["a.x.0"]),
           _op("a.x.2", "a", ["a.x.1"]), _op("a.y.0", "a", ["a.x.1"])]
    ms = contract(TaskGraph(model="toy", tasks=("a",), operators=tuple(ops)))
    assert [(m.name, m.num_layers) for m in ms] == [("a.x.layers", 2), ("a.x.2", 1), ("a.y.0", 1)]


def test_builtin_workloads_sizes_and_structure():
    clip = build_graph("multitask-clip", tasks=4)
    assert 1.1e9 < clip.total_params() < 1.3e9  # ~1.2B, ImageBind structure
    ms = contract(clip)
    layer_ops = [m for m in ms if m.op_type == "transformer_layer"]
    assert {m.num_layers for m in layer_ops} == {32, 24, 12}
    assert len(levels(ms)) == 4  # embeddings, encoders, heads, losses
    assert 9e9 < build_graph("qwen-val").total_params() < 1.05e10  # ~9.25B in the paper
    assert 0.6e9 < build_graph("ofasys", tasks=7).total_params() < 0.8e9  # ~0.66B
    assert len(build_graph("multitask-clip", tasks=10).tasks) == 10
    q = contract(build_graph("qwen-val"))
    llm = [m for m in q if m.name.endswith("llm.layers")]
    assert len(llm) == 3 and len({m.param_keys for m in llm}) == 1  # one LLM shared by all three tasks
    assert all(m.tp > 1 for m in llm)  # 6.5B of LLM states do not fit one device: tensor parallel


@pytest.mark.parametrize("model,tasks,match", [("nope", None, "unknown model 'nope'"),
                                               ("multitask-clip", 11, "not 11"), ("qwen-val", 4, "not 4"),
                                               ("ofasys", 0, "not 0")])
def test_bad_workload_names_the_value(model, tasks, match):
    with pytest.raises(ValueError, match=match):
        build_graph(model, tasks=tasks)


def test_tiny_sizes_keep_structure():
    for model in ("multitask-clip", "qwen-val", "ofasys"):
        full, tiny = build_graph(model), build_graph(model, size="tiny", batch=8)
        assert full.tasks == tiny.tasks
        assert len(contract(full)) == len(contract(tiny))


# -- curves -------------------------------------------------------------------------------------------------
def test_fit_recovers_known_piecewise_parameters():
    def f(x):  # two segments, breakpoint at x = 8 samples per device
        return 0.5 + 0.1 * x if x < 8 else 1.3 + 0.3 * (x - 8)
    B = 64
    c = fit_piecewise([(n, f(B / n)) for n in (1, 2, 4, 8, 16, 32, 64)], batch=B)
    assert len(c.segments) == 2
    s0, s1 = c.segments
    assert (s0.alpha_ms, s0.beta_ms) == pytest.approx((0.5, 0.1), abs=1e-9)
    assert (s1.x_start, s1.beta_ms) == pytest.approx((8.0, 0.3), abs=1e-9)
    assert c.fit_error < 1e-9


def test_fit_repairs_non_monotone_points():
    pts = [(1, 10.0), (2, 5.0), (4, 6.0), (8, 2.0), (16, 2.5)]  # slower on 4 than on 2, on 16 than on 8
    c = fit_piecewise(pts, batch=16)
    times = [c.time(n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 32)]
    assert all(a >= b - 1e-12 for a, b in zip(times, times[1:]))
    assert all(t > 0 for t in times)
    assert c.fit_error > 0  # the repair is reported, not hidden


def test_curve_validation_rejects_bad_curves():
    with pytest.raises(ValueError, match="beta_ms=-1"):
        ScalingCurve(batch=4, segments=(Segment(0.0, 1.0, -1.0),))
    with pytest.raises(ValueError, match="latency"):
        ScalingCurve(batch=4, segments=(Segment(0.0, 0.0, 1.0),))
    with pytest.raises(ValueError, match="not monotone"):
        ScalingCurve(batch=4, segments=(Segment(0.0, 1.0, 1.0), Segment(2.0, 0.0, 1.0)))
    with pytest.raises(ValueError, match="invalid curve point"):
        fit_piecewise([(1, 1.0), (2, -1.0)], batch=4)


def test_relaxed_curve_interpolates_speedup_between_valid_counts():
    c = fit_piecewise([(1, 10.0), (2, 6.0), (4, 4.0)], batch=4, counts=(1, 2, 4))
    r = 1 / c.time(1) + 0.5 * (1 / c.time(2) - 1 / c.time(1))
    assert c.time(1.5) == pytest.approx(1 / r)
    assert c.time(0.5) == pytest.approx(2 * c.time(1))  # time sharing below the smallest count
    assert c.time(100) == c.time(4)  # no speed-up beyond the largest count
    t = c.time(3)
    assert c.inverse(t) == pytest.approx(3, rel=1e-6)


def test_planner_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "import importlib, pkgutil, megatron_spindle.planner as P\n"
            "for m in pkgutil.iter_modules(P.__path__): importlib.import_module('megatron_spindle.planner.' + m.name)\n"
            "from megatron_spindle.planner.step.build import make_plan\n"
            "from megatron_spindle.planner.workload.cluster import load_cluster\n"
            "from megatron_spindle.planner.workload.workloads import build_graph\n"
            "make_plan(build_graph('qwen-val'), load_cluster(None, num_devices=16))\n"
            "assert not any(k.startswith(('torch', 'megatron.')) and sys.modules[k] is not None for k in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("model,tasks,gpus", [("multitask-clip", 7, 32), ("ofasys", 7, 8), ("qwen-val", 3, 16)])
def test_polish_keeps_a_valid_schedule_and_never_lengthens_it(model, tasks, gpus):
    """:func:`.polish.polish` on Algorithm 1's waves of every level: whole layers in order, every layer once,
    one slice per MetaOp per wave, valid counts within the devices, times that match the curves, no longer
    span, and the same result on a second run (deterministic); and so are throughput waves."""
    from megatron_spindle.planner.level.allocate import bipoint as bp
    from megatron_spindle.planner.workload.analytic import build_curves
    from megatron_spindle.planner.assembly.assemble import make_metaops
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.level.knapsack import throughput_waves
    from megatron_spindle.planner.level.polish import polish
    from megatron_spindle.planner.level.waves import schedule_level
    metaops = make_metaops(build_graph(model, tasks=tasks), load_cluster(None, num_devices=gpus))
    curves = build_curves(metaops, gpus)
    for lv in levels(metaops):
        alloc = allocate_level({m.name: m.num_layers for m in lv}, curves, gpus)
        tuples = {m.name: bp(m.num_layers, curves[m.name], alloc.n_star[m.name], alloc.c_star_ms,
                             m.valid_counts(gpus)) for m in lv}
        waves = schedule_level(lv[0].level, lv, tuples, curves, gpus, 5.0)
        span = sum(w.duration_ms for w in waves)
        out = polish(waves, lv, curves, gpus)
        assert sum(w.duration_ms for w in waves) == span  # the input is not changed
        assert sum(w.duration_ms for w in out) <= span * (1 + 1e-12)
        _check_level_schedule(out, lv, curves, gpus, 5.0)
        # throughput waves (:mod:`.knapsack`) are a valid schedule of the level too
        times = {m.name: {c: curves[m.name].count_time(c) for c in m.valid_counts(gpus)} for m in lv}
        for max_durations, finishing in ((20, True), (80, False)):
            _check_level_schedule(throughput_waves(lv, times, gpus, 5.0, max_durations=max_durations,
                                                   finishing=finishing), lv, curves, gpus, 5.0)
        again = polish(waves, lv, curves, gpus)
        assert [[(s.metaop, s.layers, s.devices) for s in w.slices] for w in again] == \
               [[(s.metaop, s.layers, s.devices) for s in w.slices] for w in out]


def _check_level_schedule(waves, lv, curves, gpus, start_ms):
    """Whole layers in order, every layer once, one slice per MetaOp per wave, valid counts within the devices,
    times that match the curves, waves back to back from ``start_ms``."""
    nxt, clock = {m.name: 0 for m in lv}, start_ms
    for w in waves:
        assert w.start_ms == pytest.approx(clock) and w.level == lv[0].level
        assert sum(s.devices for s in w.slices) <= gpus and len({s.metaop for s in w.slices}) == len(w.slices)
        for s in w.slices:
            m = next(x for x in lv if x.name == s.metaop)
            assert s.devices in m.valid_counts(gpus) and s.layers >= 1 and s.layer_start == nxt[s.metaop]
            assert s.time_ms == pytest.approx(s.layers * curves[s.metaop].count_time(s.devices))
            nxt[s.metaop] += s.layers
        assert w.duration_ms == pytest.approx(max(s.time_ms for s in w.slices))
        clock += w.duration_ms
    assert nxt == {m.name: m.num_layers for m in lv}
