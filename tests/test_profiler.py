"""The profiler: which points it measures, its cache, the fit of measured points, the curves file the planner
reads, and one live ``spindle profile`` on two gloo processes (data- and tensor-parallel points).

The live test runs the command twice in subprocesses (process start costs seconds; the rerun must measure
nothing) and plans with the file it wrote.
"""
import json
import os
import subprocess
import sys

import pytest

from megatron_spindle.cli import main
from megatron_spindle.planner.simulation.runtime_costs import RuntimeCosts
from megatron_spindle.planner.exact import GRID_MS
from megatron_spindle.planner.workload.analytic import CurvesFile, build_curves
from megatron_spindle.planner.assembly.assemble import make_metaops
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import Cluster, load_cluster
from megatron_spindle.planner.simulation.link_costs import allreduce_time_ms, boundary_time_ms
from megatron_spindle.planner.workload.workloads import build_graph
from megatron_spindle.profiler.fit import curves_document, summary_table, uncovered
from megatron_spindle.profiler.link import cluster_fields, fit_link
from megatron_spindle.profiler.points import (Point, ProfileCache, Where, measure_counts, points_of,
                                              schedule_rounds, targets_of)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = Where(backend="gloo", device_type="cpu", dtype="float32", threads=1)


def tiny_clip(batch=16):
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=batch)
    return g, make_metaops(g, Cluster(num_devices=8))


# -- what is measured ----------------------------------------------------------------------------------------
def test_counts_are_powers_of_two_replicas_plus_the_largest_valid_count():
    g, ms = tiny_clip(batch=12)
    layers = next(m for m in ms if m.name == "vision-text.vision.layers")
    assert layers.valid_counts(8) == (1, 2, 3, 4, 6)
    assert measure_counts(layers, 8) == (1, 2, 4, 6)
    loss = next(m for m in ms if m.op_type == "contrastive_loss")
    assert measure_counts(loss, 8) == (1,)  # the whole batch on one device


def test_targets_merge_metaops_with_one_workload_and_points_carry_the_local_batch():
    g, ms = tiny_clip()
    ts = targets_of(ms, 4)
    assert len(ts) == 13 and sum(len(t.metaops) for t in ts) == len(ms)
    vision = next(t for t in ts if t.metaops[0] == "vision-text.vision.layers")
    assert vision.metaops == ("vision-text.vision.layers", "vision-depth.vision.layers",
                              "vision-thermal.vision.layers")
    assert [(p.devices, p.local_batch) for p in points_of(ts) if p.target == ts.index(vision)] == \
        [(1, 16), (2, 8), (4, 4)]
    with pytest.raises(ValueError, match="not a valid count"):
        vision.local_batch(3)


def test_rounds_pack_tensor_parallel_points_into_aligned_blocks():
    pts = [Point(target=0, devices=2, tp=2, local_batch=4), Point(target=1, devices=1, tp=1, local_batch=8),
           Point(target=1, devices=2, tp=1, local_batch=4), Point(target=2, devices=4, tp=4, local_batch=8)]
    rounds = schedule_rounds(pts, 4)
    assert [[(p.target, p.devices, r) for p, r in rnd] for rnd in rounds] == [
        [(2, 4, (0, 1, 2, 3))], [(0, 2, (0, 1)), (1, 1, (2,)), (1, 2, (3,))]]
    with pytest.raises(ValueError, match="need tensor parallelism 4 .* use --nproc 4"):
        schedule_rounds(pts, 2)


def test_a_metaop_that_cannot_run_names_itself():
    g = build_graph("qwen-val", size="tiny", batch=4)
    ms = make_metaops(g, Cluster(num_devices=4, gpus_per_node=4, memory_gib=1e-4))
    with pytest.raises(ValueError, match="needs 4 devices .* up to 2 devices"):
        targets_of(ms, 2)


# -- the cache -------------------------------------------------------------------------------------------------
def test_cache_round_trips_and_is_keyed_by_where_it_was_measured(tmp_path):
    g, ms = tiny_clip()
    t = targets_of(ms, 4)[1]
    path = str(tmp_path / "sub" / "cache.json")
    cache = ProfileCache.load(path)
    assert len(cache) == 0
    e = cache.put(t, 2, CPU, samples_ms=[3.0, 1.0, 2.0, 10.0], local_batch=8, warmup=1)
    assert e["ms"] == 2.5  # the median
    cache.save()
    again = ProfileCache.load(path)
    assert again.get(t, 2, CPU)["samples_ms"] == [3.0, 1.0, 2.0, 10.0]
    assert again.get(t, 4, CPU) is None
    for other in (Where(backend="gloo", device_type="cpu", threads=2),
                  Where(backend="nccl", device_type="NVIDIA H200", dtype="bfloat16"),
                  Where(backend="gloo", device_type="cpu", dtype="bfloat16", threads=1),
                  Where(backend="gloo", device_type="cpu", threads=1, procs=4)):  # 4 processes at once
        assert again.get(t, 2, other) is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON.*--fresh"):
        ProfileCache.load(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text(json.dumps({"curves": []}))
    with pytest.raises(ValueError, match="is not a spindle-profile-cache file"):
        ProfileCache.load(str(tmp_path / "other.json"))


# -- fit -> curves file -> plan ----------------------------------------------------------------------------------
def _synthetic_profile(ts, f):
    """Cache entries as the profiler writes them, with times from ``f(target, local batch)``."""
    cache = ProfileCache(None)
    entries = {}
    for p in points_of(ts):
        t = ts[p.target]
        ms = f(t, p.local_batch)
        entries.setdefault(p.target, []).append(
            cache.put(t, p.devices, CPU, samples_ms=[ms * 1.01, ms, ms * 0.99], local_batch=p.local_batch,
                      warmup=0))
    return entries


def test_profile_output_fits_known_piecewise_curves_and_the_plan_uses_them():
    g, ms = tiny_clip(batch=64)
    ts = targets_of(ms, 32)  # local batches 64, 32, 16, 8, 4, 2

    def f(t, x):  # two segments with a breakpoint at 8 samples per device (continuous)
        a = 0.2 + 0.01 * t.layer.hidden
        return a + 0.05 * x if x < 8 else a + 0.4 + 0.2 * (x - 8)

    doc = curves_document(ts, _synthetic_profile(ts, f), measured={"backend": "gloo"}, memory_gib=80.0)
    vision = next(c for c in doc["curves"] if c["metaops"][0] == "vision-text.vision.layers")
    segs = vision["fit"]["segments"]
    assert len(segs) == 2 and vision["fit_error"] < 1e-9
    assert (segs[0]["alpha_ms"], segs[0]["beta_ms"]) == pytest.approx((0.2 + 0.52, 0.05), abs=1e-9)
    assert (segs[1]["x_start"], segs[1]["beta_ms"]) == pytest.approx((8.0, 0.2), abs=1e-9)
    assert "vision-text.vision.layers (+2)" in summary_table(doc)

    cf = CurvesFile.parse(json.loads(json.dumps(doc)))
    assert uncovered(cf, ms) == []
    cluster = Cluster(num_devices=32)
    curves = build_curves(ms, 32, curves_file=cf)
    assert all(c.source == "measured" for c in curves.values())
    m = next(m for m in ms if m.name == "vision-depth.vision.layers")  # shares the vision target
    t = next(t for t in ts if m.name in t.metaops)
    for n in (1, 2, 4, 8, 16, 32):
        assert curves[m.name].count_time(n) == pytest.approx(f(t, 64 / n), rel=1e-9)
    plan = make_plan(g, cluster, curves_file=cf)
    assert all(plan.curve(x.name).source == "measured" for x in plan.metaops)


def test_monotone_repair_of_noisy_profile_points():
    g, ms = tiny_clip(batch=16)
    ts = targets_of(ms, 8)
    noisy = {1: 10.0, 2: 6.0, 4: 6.5, 8: 3.0, 16: 3.2}  # slower on 4 than on 2, on 16 than on 8 (by local batch)

    doc = curves_document(ts, _synthetic_profile(ts, lambda t, x: noisy[16 // x]), measured={})
    c = CurvesFile.parse(doc)
    curves = build_curves(ms, 8, curves_file=c)
    for curve in curves.values():
        times = [curve.time(n) for n in (1, 1.5, 2, 3, 4, 6, 8)]
        assert all(a >= b - 1e-12 for a, b in zip(times, times[1:])) and min(times) > 0
    assert max(x["fit_error"] for x in doc["curves"] if x["signature"]["op_type"] != "contrastive_loss") > 0


def test_link_fit_recovers_the_simulators_own_latency_and_bandwidth():
    cl = Cluster(num_devices=4, intra_bandwidth_gbps=3.0, intra_latency_us=80.0)
    ms = []
    for s in (4e3, 6.4e4, 1e6, 4e6):
        ms.append({"kind": "exchange", "ranks": 2, "bytes": s, "ms": boundary_time_ms([(0, 1, s), (1, 0, s)], cl)})
        ms.append({"kind": "allreduce", "ranks": 4, "bytes": s, "ms": allreduce_time_ms(range(4), s, cl)})
    fit = fit_link(ms)
    assert fit["latency_us"] == pytest.approx(80.0, rel=1e-9)
    assert fit["bandwidth_gbps"] == pytest.approx(3.0, rel=1e-9)
    assert fit["fit_error"] < 1e-9
    fields = cluster_fields(fit, name="gloo-cpu", gpus_per_node=8, memory_gib=10.0)
    assert load_cluster.__name__  # the fields are a cluster file's fields:
    assert set(fields) <= {f for f in Cluster.__dataclass_fields__}
    # a latency-only link (no bandwidth term measurable) stays valid
    flat = fit_link([{"kind": "exchange", "ranks": 2, "bytes": s, "ms": 0.1} for s in (1e3, 1e6)])
    assert flat["latency_us"] == pytest.approx(100.0) and flat["bandwidth_gbps"] > 1e3


# -- live: spindle profile on two gloo processes -----------------------------------------------------------------
PROFILE = ["--model", "qwen-val", "--size", "tiny", "--batch", "4", "--nproc", "2", "--max-devices", "2",
           "--gpus-per-node", "2", "--memory-gib", "0.008", "--warmup", "1", "--repeats", "2", "--min-time", "0"]


def _spindle(args, env_extra=None):
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "megatron_spindle.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    files = {k: str(d / f"{k}.json") for k in ("curves", "cache", "cluster", "curves2")}
    first = _spindle(["profile", *PROFILE, "--out", files["curves"], "--cache", files["cache"],
                      "--cluster-out", files["cluster"]])
    second = _spindle(["profile", *PROFILE, "--out", files["curves2"], "--cache", files["cache"], "--no-link"])
    return files, first, second


def test_fresh_remeasures_its_points_and_keeps_other_entries_of_the_cache(tmp_path):
    cache = tmp_path / "cache.json"
    g, ms = tiny_clip(batch=16)
    other = ProfileCache(str(cache))
    other.put(targets_of(ms, 4)[0], 1, CPU, samples_ms=[1.0], local_batch=16, warmup=0)
    other.save()
    args = ["profile", "--model", "multitask-clip", "--tasks", "4", "--size", "tiny", "--batch", "4", "--nproc", "1",
            "--max-devices", "1", "--warmup", "0", "--repeats", "1", "--min-time", "0", "--no-link",
            "--cache", str(cache), "--out", str(tmp_path / "c.json"), "--fresh"]
    r = _spindle(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "13 points up to 1 devices (0 cached, 13 to measure) on 1 gloo process(es)" in r.stdout
    entries = json.load(open(cache))["entries"]
    assert len(entries) == 14  # 13 measured (batch 4) + the batch-16 entry, kept
    assert sum(e["signature"]["batch"] == 16 for e in entries) == 1


def test_live_profile_measures_data_and_tensor_parallel_points_and_shows_progress(live):
    files, first, _ = live
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "10 distinct, 17 points up to 2 devices (0 cached, 17 to measure) on 2 gloo process(es), cpu" in out
    assert "[17/17] " in out and "remaining ~" in out
    assert "n=2   (local batch 4, tp 2)" in out  # a tensor-parallel point: 2 processes, one replica of 4
    doc = json.load(open(files["curves"]))
    assert doc["measured"]["backend"] == "gloo" and doc["measured"]["nproc"] == doc["measured"]["procs"] == 2
    opt = doc["measured"]["optimizer"]  # both processes timed AdamW at once; the fit is what predictions read
    assert "optimizer step (AdamW): " in out and len(opt["measurements"]) >= 3
    assert min(opt["fixed_ms"], opt["per_tensor_ms"], opt["per_melement_ms"]) >= 0 and opt["per_melement_ms"] > 0
    rt = doc["measured"]["runtime"]  # the runtime's own costs, both processes at once (tests/test_runtime_costs.py)
    assert "runtime (gloo): posting a point's batch" in out and RuntimeCosts.from_measured(rt) is not None
    assert {m["kind"] for m in rt["measurements"]} == {"post", "collective", "grad_norm"}
    assert {m["pattern"] for m in rt["measurements"] if m["kind"] == "post"} == {"exchange", "one-way", "local"}
    assert all(m["delivery_ms"] >= 0 for m in rt["measurements"] if m.get("pattern") == "one-way")
    assert rt["post_local"]["fixed_ms"] + rt["post_local"]["per_op_ms"] > 0  # a point's local copies cost time
    assert {c["signature"]["tp"] for c in doc["curves"]} == {1, 2}
    for c in doc["curves"]:
        assert all(ms > 0 for _, ms in c["points"]) and c["detail"][0]["repeats"] == 2
    cl = json.load(open(files["cluster"]))
    assert cl["intra_bandwidth_gbps"] > 0 and cl["intra_latency_us"] > 0 and cl["allreduce_latency_us"] > 0
    assert load_cluster(files["cluster"], num_devices=2).intra_latency_us == cl["intra_latency_us"]


def test_live_rerun_measures_nothing_and_writes_the_same_curves(live):
    files, first, second = live
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(17 cached, 0 to measure)" in second.stdout
    a, b = json.load(open(files["curves"])), json.load(open(files["curves2"]))
    assert [c["points"] for c in a["curves"]] == [c["points"] for c in b["curves"]]


def test_spindle_plan_and_compare_use_the_measured_curves(live, capsys, tmp_path):
    files, first, _ = live
    assert first.returncode == 0
    plan_json = tmp_path / "plan.json"
    rc = main(["plan", "--model", "qwen-val", "--size", "tiny", "--batch", "4", "--passes", "1", "--gpus", "2",
               "--gpus-per-node", "2", "--curves", files["curves"], "--out", str(plan_json), "--json"])
    assert rc == 0, capsys.readouterr().err
    from megatron_spindle.planner.assembly.plan import Plan
    plan = Plan.load(str(plan_json))
    assert all(plan.curve(m.name).source == "measured" for m in plan.metaops)
    doc = json.load(open(files["curves"]))
    measured = {json.dumps(c["signature"], sort_keys=True): dict(map(tuple, c["points"])) for c in doc["curves"]}
    for m in plan.metaops:
        pts = measured[json.dumps(m.signature, sort_keys=True)]
        curve = plan.curve(m.name)  # fitted to exactly the measured points; the fit error says how well
        assert sorted(curve.points) == sorted((float(n), ms) for n, ms in pts.items())
        for n, ms in pts.items():
            # count_time is on the planner's time grid: within half a grid step of the fitted curve
            assert abs(curve.count_time(int(n)) - ms) <= curve.fit_error * ms * (1 + 1e-9) + GRID_MS
    capsys.readouterr()
    rc = main(["compare", "--model", "qwen-val", "--size", "tiny", "--batch", "4", "--gpus", "2",
               "--curves", files["curves"], "--cluster", files["cluster"], "--json"])
    assert rc == 0, capsys.readouterr().err


def test_what_is_measured_and_fitted_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "import megatron_spindle.profiler.points, megatron_spindle.profiler.fit, megatron_spindle.profiler.link\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_bad_profile_input_is_one_line_and_status_2(tmp_path):
    r = _spindle(["profile", "--model", "nope", "--nproc", "1", "--out", str(tmp_path / "c.json"), "--no-cache"])
    assert r.returncode == 2 and "spindle profile: error: unknown model 'nope'" in r.stderr
    assert "Traceback" not in r.stderr


def test_one_process_names_what_it_cannot_measure(tmp_path):
    """``--skip-unmeasurable`` (the GPU check on one device): MetaOps planned at tensor parallelism above
    ``--nproc`` are left out and named with the reason; the rest is measured. Without it: one line, status 2."""
    args = ["profile", "--model", "qwen-val", "--size", "tiny", "--nproc", "1", "--memory-gib", "0.005",
            "--max-devices", "4", "--warmup", "0", "--repeats", "1", "--min-time", "0", "--no-link", "--no-cache",
            "--out", str(tmp_path / "c.json")]
    r = _spindle([*args, "--skip-unmeasurable"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.load(open(tmp_path / "c.json"))
    missing = {m for n in doc["not_measured"] for m in n["metaops"]}
    assert "language.llm.layers" in missing and all("tensor parallelism" in n["reason"] for n in doc["not_measured"])
    measured = {m for c in doc["curves"] for m in c["metaops"]}
    assert measured and not measured & missing and {c["signature"]["tp"] for c in doc["curves"]} == {1}
    refused = _spindle(args)
    assert refused.returncode == 2 and "--nproc" in refused.stderr, refused.stderr[-2000:]
