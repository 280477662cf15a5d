"""The wave executor against a single-process reference: same seeds, same data, same losses and parameters.

Tolerance: every task's loss within 1e-5 relative and every parameter within 1e-5 of the reference
(relative to the tensor's largest entry) after 3 optimizer steps. The multi-process runs sum gradients in
another order than the single process, so they differ by float32 rounding (seen: ~3e-6).

The equivalence runs use SGD with momentum, not Adam: a transformer's key bias has an exactly zero gradient
in exact arithmetic (softmax ignores a constant added to every score), so its computed gradient is pure
rounding noise, and Adam's normalisation turns that noise into ±lr updates whose signs differ between any
two summation orders. With SGD every parameter is compared; AdamW is exercised by the training loop tests.

All cases run in one group of 4 gloo processes (process start costs seconds).
"""
import json
import os
import re
import time

import numpy as np
import pytest

from mp_harness import RanksFailed, run_ranks

from megatron_spindle.planner.build import make_plan
from megatron_spindle.planner.cluster import load_cluster
from megatron_spindle.planner.manual import plan_from_waves
from megatron_spindle.planner.metaops import contract
from megatron_spindle.planner.workloads import build_graph

WORLD = 4
STEPS = 3
LR, MOMENTUM = 0.05, 0.9
TOL = 1e-5


def graph():
    return build_graph("multitask-clip", tasks=4, size="tiny", batch=8)


def _sequential(g, n, override=None, tp=None):
    """Every MetaOp alone on all ranks in level order; ``override`` replaces some MetaOps' waves."""
    override = override or {}
    waves, done = [], set()
    for m in sorted(contract(g), key=lambda m: m.level):
        if m.name in done:
            continue
        if m.name in override:
            for wave in override[m.name]:
                waves.append(wave)
                done.update(x[0] for x in wave)
            continue
        waves.append([(m.name, 0, m.num_layers, tuple(range(n if m.batch_splittable else 1)))])
    return plan_from_waves(g, n, waves, tp=tp)


def plans():
    g = graph()
    v, t, at = "vision-text.vision.layers", "vision-text.text.layers", "audio-text.text.layers"
    return {
        "a-sequential": _sequential(g, WORLD),
        "b-concurrent-encoders": _sequential(g, WORLD, {v: [[(v, 0, 4, (0, 1)), (t, 0, 4, (2, 3))]]}),
        "c-split-across-waves": _sequential(g, WORLD, {v: [[(v, 0, 2, (0, 1, 2, 3))], [(v, 2, 2, (3, 1))]]}),
        "d-tensor-parallel": _sequential(g, WORLD, {t: [[(t, 0, 3, (0, 1, 2, 3))], [(t, 3, 1, (2, 3))]]},
                                         tp={t: 2, at: 2}),
        "e-shared-across-groups": _sequential(g, WORLD, {t: [[(t, 0, 4, (0, 1)), (at, 0, 4, (2, 3))]]}),
        "f-planner": make_plan(g, load_cluster(None, num_devices=WORLD, gpus_per_node=4)),
    }


def _run_case(plan, g):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    model = SpindleModel(plan, g, seed=0, timeout_s=60)
    opt = torch.optim.SGD(model.unique_parameters(), lr=LR, momentum=MOMENTUM)
    data = SyntheticData(g, seed=0)
    losses = []
    for step in range(STEPS):
        model.trace.step = step
        st = model(data.batch(step))
        model.backward(st)
        model.finalize_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(model.reduce_losses(st))
    shards = {(k, s, n): p.detach().numpy().copy() for k, s, mod in model.local_cores()
              for n, p in mod.core.named_parameters()}
    n_params = sum(p.numel() for p in model.unique_parameters())
    events = model.trace.chrome_events()
    model.destroy()
    return {"losses": losses, "shards": shards, "held": sorted(model.held_param_keys()), "n_params": n_params,
            "events": events}


def _all_cases(rank, world, cases, g):
    from megatron_spindle.compat.cpu import apply_cpu_patches
    apply_cpu_patches()
    return {name: _run_case(plan, g) for name, plan in cases.items()}


def _reference(g):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    ref = ReferenceModel(g, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    data = SyntheticData(g, seed=0)
    losses = []
    for step in range(STEPS):
        out = ref(data.batch(step))
        sum(out.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append({k: float(v) for k, v in out.items()})
    return losses, {(k, n): p.detach() for k, n, p in ref.keyed_parameters()}


@pytest.fixture(scope="module")
def results():
    g = graph()
    cases = plans()
    t0 = time.time()
    out = run_ranks(_all_cases, WORLD, cases, g, timeout_s=400)
    ref = _reference(g)
    return cases, out, ref, time.time() - t0


@pytest.mark.parametrize("case", ["a-sequential", "b-concurrent-encoders", "c-split-across-waves",
                                  "d-tensor-parallel", "e-shared-across-groups", "f-planner"])
def test_losses_and_parameters_match_single_process(results, case):
    from megatron_spindle.models.layer_state import shard_tensor

    cases, out, (ref_losses, ref_params), _ = results
    plan = cases[case]
    for step in range(STEPS):
        for task, want in ref_losses[step].items():
            got = out[0][case]["losses"][step][task]
            assert got == pytest.approx(want, rel=TOL), (case, step, task)
        for r in range(1, WORLD):  # every rank reports the same reduced losses
            assert out[r][case]["losses"][step] == out[0][case]["losses"][step]
    checked = set()
    tp_of = {}
    for m in plan.metaops:
        for k in m.param_keys:
            tp_of[k] = m.tp
    for r in range(WORLD):
        for (key, shard, name), value in out[r][case]["shards"].items():
            full = ref_params[(key, name)]
            tp = tp_of[key]
            if tp > 1 and value.shape != tuple(full.shape):
                dim = [i for i, (a, b) in enumerate(zip(value.shape, full.shape)) if a != b][0]
                expect = shard_tensor(full, dim=dim, stride=1, rank=shard, size=tp).numpy()
            else:
                expect = full.numpy()
            scale = float(np.abs(expect).max()) + 1e-12
            err = float(np.abs(value - expect).max()) / scale
            assert err < TOL, (case, r, key, name, err)
            checked.add((key, name))
    assert checked == set(ref_params), f"{case}: parameters held by no rank: {sorted(set(ref_params) - checked)[:5]}"


def test_each_rank_holds_exactly_its_slices_parameters(results):
    cases, out, _, _ = results
    for case, plan in cases.items():
        for r in range(WORLD):
            want = set()
            for s in plan.rank_slices(r):
                m = plan.metaop(s.metaop)
                pos = s.ranks.index(r)
                for k in m.param_keys[s.layer_start:s.layer_stop]:
                    if k:
                        want.add((k, pos % m.tp))
            assert set(map(tuple, out[r][case]["held"])) == want, (case, r)
            mine = [g for g in plan.param_groups if r in g.ranks]
            # a TP shard holds 1/tp of the sharded weights plus the replicated norms and biases
            low, high = sum(g.params for g in mine), sum(g.params * g.tp for g in mine)
            n = out[r][case]["n_params"]
            assert (n == low) if all(g.tp == 1 for g in mine) else (low <= n <= high), (case, r, n, low, high)
    # memory is only spent where used: in the planner's plan no rank holds every weight
    all_keys = {g.param_key for g in cases["f-planner"].param_groups}
    assert all({k for k, _ in out[r]["f-planner"]["held"]} < all_keys for r in range(WORLD))


def test_trace_records_every_wave_phase(results, tmp_path):
    from megatron_spindle.runtime.trace import write_chrome_trace
    cases, out, _, _ = results
    plan = cases["f-planner"]
    events = [e for r in range(WORLD) for e in out[r]["f-planner"]["events"]]
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert {"forward", "backward", "transfer", "sync"} <= cats
    names = {e["name"] for e in events if e.get("ph") == "X"}
    for w in range(len(plan.waves)):
        assert f"w{w} fwd transfer" in names and f"w{w} bwd transfer" in names
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), events)
    data = json.loads(path.read_text())
    assert {e["pid"] for e in data["traceEvents"]} == set(range(WORLD))


# -- faults ------------------------------------------------------------------------------------------------
def _hang_or_die(rank, world, plan, g, mode):
    from megatron_spindle.compat.cpu import apply_cpu_patches
    apply_cpu_patches()
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    model = SpindleModel(plan, g, seed=0, timeout_s=3)
    if rank == world - 1:
        if mode == "die":
            os._exit(17)  # a crashed rank: the harness reports its exit code
        time.sleep(30)   # a hung rank: the others must give up after 3 s
        return "slept"
    st = model(SyntheticData(g, seed=0).batch(0))
    model.backward(st)
    return "finished"


def test_a_hung_peer_fails_the_others_with_wave_slice_and_peer():
    g = graph()
    plan = plans()["a-sequential"]
    t0 = time.time()
    with pytest.raises(RanksFailed) as e:
        run_ranks(_hang_or_die, WORLD, plan, g, "hang", timeout_s=60)
    msg = str(e.value)
    assert time.time() - t0 < 30
    # e.g. "SpindleTimeout: rank 0: wave 24 forward: receive for w24:vision-text.loss[0-0]x1 from
    #       w16:vision-text.vision.head[0-0]x4 samples [6, 8) from rank 3 failed: ... Timed out waiting 3000ms"
    assert re.search(r"SpindleTimeout: rank \d: wave \d+ forward: receive for w\d+:\S+ from w\d+:\S+ "
                     r"samples \[\d+, \d+\) from rank 3 failed: .*Timed out", msg), msg[-2000:]


def test_plan_for_another_world_or_model_is_refused():
    from megatron_spindle.planner.validate import PlanError, check_plan
    g = graph()
    plan = plans()["a-sequential"]
    with pytest.raises(PlanError, match="plan is for 4 devices but the job has 2"):
        check_plan(plan, graph_fingerprint=g.fingerprint(), world_size=2)
    other = build_graph("multitask-clip", tasks=4, size="tiny", batch=16)
    with pytest.raises(PlanError, match="not for this model"):
        check_plan(plan, graph_fingerprint=other.fingerprint(), world_size=4)
