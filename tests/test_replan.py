"""A task joins and later leaves (and rejoins) mid-training: replan without restarting, keep weights and state.

Phases on 4 gloo ranks (tiny Multitask-CLIP): three tasks; the fourth joins; two leave; all four again.
Each phase runs under a plan made for its task set from the start; the losses of every step and every
parameter at the end must equal a single-process model trained on the same schedule (1e-5; SGD with
momentum, so the carried optimizer state matters; see test_runtime_exec.py for why not Adam).
"""
import numpy as np
import pytest

from mp_harness import run_ranks

from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.workloads import build_graph

WORLD, LR, MOMENTUM, TOL = 4, 0.05, 0.9, 1e-5
ALL = ("vision-text", "audio-text", "vision-depth", "vision-thermal")
PHASES = [(ALL[:3], 2), (ALL, 2), (ALL[:2], 2), (ALL, 1)]


def graph():
    return build_graph("multitask-clip", tasks=4, size="tiny", batch=8)


def _plans(g):
    cluster = load_cluster(None, num_devices=WORLD, gpus_per_node=4)
    return [make_plan(g.subset(tasks), cluster) for tasks, _ in PHASES]


def _spindle(rank, world, g, plans):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.replan import replan

    apply_cpu_patches()
    data = SyntheticData(g, seed=0)
    opt_of = lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)  # noqa: E731
    model, opt, losses, step, rebuilt = None, None, [], 0, []
    for (tasks, steps), plan in zip(PHASES, plans):
        sub = g.subset(tasks)
        if model is None:
            model = SpindleModel(plan, sub, seed=0, layer_graph=g)
            opt = opt_of(model.unique_parameters())
        else:
            before = {id(p) for p in model.unique_parameters()}
            model, opt = replan(model, opt, plan, sub, layer_graph=g, make_optimizer=opt_of)
            rebuilt.append(sum(id(p) not in before for p in model.unique_parameters()))
        for _ in range(steps):
            batch = data.batch(step)
            st = model({t: batch[t] for t in tasks})
            model.backward(st)
            model.finalize_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(model.reduce_losses(st))
            step += 1
    shards = {}
    for key, shard, mod in model.local_cores():
        for n, p in mod.core.named_parameters():
            shards[(key, n)] = p.detach().numpy().copy()
    for (key, _), (layer, _) in model.parked.items():
        for n, p in layer.core.named_parameters():
            shards.setdefault((key, n), p.detach().numpy().copy())
    return losses, shards, rebuilt


def _reference(g):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    ref = ReferenceModel(g, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    data, losses, step = SyntheticData(g, seed=0), [], 0
    for tasks, steps in PHASES:
        for _ in range(steps):
            batch = data.batch(step)
            out = ref({t: batch[t] for t in tasks})
            sum(out.values()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append({t: v.item() for t, v in out.items()})
            step += 1
    return losses, {(k, n): p.detach().numpy().copy() for k, n, p in ref.keyed_parameters()}


@pytest.fixture(scope="module")
def runs():
    g = graph()
    return run_ranks(_spindle, WORLD, g, _plans(g), timeout_s=400), _reference(g)


def test_losses_follow_the_task_schedule(runs):
    out, (ref_losses, _) = runs
    losses = out[0][0]
    assert len(losses) == len(ref_losses)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        for task, v in want.items():
            assert got[task] == pytest.approx(v, rel=TOL), (step, task)
        absent = set(ALL) - set(want)
        assert all(got.get(t, 0.0) == 0.0 for t in absent)


def test_every_weight_survives_leaving_and_rejoining(runs):
    out, (_, ref_params) = runs
    seen = set()
    for _, shards, _ in out:
        for (key, n), v in shards.items():
            want = ref_params[(key, n)]
            if v.shape != want.shape:
                continue  # a tensor-parallel shard (none in this tiny plan)
            err = float(np.abs(v - want).max()) / (float(np.abs(want).max()) + 1e-12)
            assert err < TOL, (key, n, err)
            seen.add((key, n))
    assert seen == set(ref_params)


def test_only_what_changed_is_rebuilt(runs):
    out, _ = runs
    total = [sum(r[2][i] for r in out) for i in range(len(PHASES) - 1)]
    all_params = sum(len(r[1]) for r in out)
    assert all(t < all_params for t in total)  # most parameters are taken over, not rebuilt
