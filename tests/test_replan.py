"""A task joins and later leaves (and rejoins) mid-training: replan without restarting, keep weights and state.

Phases on 4 gloo ranks (tiny Multitask-CLIP): three tasks; the fourth joins; two leave; all four again.
Each phase runs under a plan made for its task set from the start; the losses of every step and every
parameter at the end must equal a single-process model trained on the same schedule (1e-5; SGD with
momentum, so the carried optimizer state matters; see test_runtime_exec.py for why not Adam). After each
replan the old model's megatron.core DDP instances are gone (a weak reference to each is dead) and every
reused parameter's gradient accumulator holds exactly one DDP hook, the new one's.

A bf16 model with fp32 master weights under AdamW (Megatron's mixed precision) is replanned past step 256 on
2 ranks, from a plan that holds every weight on rank 0 to one that holds it on rank 1 and back: every weight
travels twice with its optimizer state. Each state tensor keeps its dtype and device on the way (AdamW's
``step`` a float32 tensor on the CPU, exactly 257; the moments and masters fp32), and the three steps after
the round trip give bitwise the losses, masters and state of the same three steps without it.
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


def _ddp_hooks(p) -> int:
    """How many of megatron DDP's hooks sit on ``p``'s gradient accumulator."""
    acc = p.expand_as(p).grad_fn.next_functions[0][0]
    handle = acc.register_hook(lambda *a: None)
    hooks = handle.hooks_dict_ref()
    handle.remove()
    return sum(getattr(fn, "__qualname__", "").startswith("DistributedDataParallel.") for fn in hooks.values())


def _spindle(rank, world, g, plans):
    import gc
    import weakref

    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.replan import replan

    apply_cpu_patches()
    data = SyntheticData(g, seed=0)
    opt_of = lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)  # noqa: E731
    model, opt, losses, step, rebuilt, alive, hooks = None, None, [], 0, [], [], []
    for (tasks, steps), plan in zip(PHASES, plans):
        sub = g.subset(tasks)
        if model is None:
            model = SpindleModel(plan, sub, seed=0, layer_graph=g)
            opt = opt_of(model.unique_parameters())
        else:
            before = {id(p) for p in model.unique_parameters()}
            old = [weakref.ref(inst.ddp) for inst in model.grad_sync.instances]
            model, opt = replan(model, opt, plan, sub, layer_graph=g, make_optimizer=opt_of)
            rebuilt.append(sum(id(p) not in before for p in model.unique_parameters()))
            gc.collect()
            alive.append(sum(r() is not None for r in old))
            hooks.append(sorted({_ddp_hooks(p) for p in model.grad_sync._main_params if id(p) in before}))
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
    return losses, shards, rebuilt, alive, hooks


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
    for _, shards, *_ in out:
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


def test_the_old_ddp_is_collected_after_a_replan(runs):
    """megatron's DDP hooks on reused parameters' gradient accumulators are removed with the old model, so its
    DDP instances (and their gradient buffers) are collected; the new model's hook is the only one left."""
    out, _ = runs
    for rank, (*_, alive, hooks) in enumerate(out):
        assert alive == [0] * (len(PHASES) - 1), (rank, alive)
        assert all(h == [1] for h in hooks if h), (rank, hooks)
        assert any(hooks), rank  # some parameters were reused on every rank


# -- bf16 with fp32 masters and AdamW, past step 256, across replans that move every weight ----------------------
BF16_STEPS, AFTER = 257, 3


def _one_rank_plans(g):
    """Every MetaOp on rank 0 (then on rank 1) of 2: a replan between them moves every weight."""
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    from megatron_spindle.planner.workload.metaops import contract

    order = sorted(contract(g), key=lambda m: m.level)
    return [plan_from_waves(g, 2, [[(m.name, 0, m.num_layers, (r,))] for m in order]) for r in (0, 1)]


def _state(model, opt):
    """{(param_key, name): {what: (dtype, device, bytes)}} for the weights this rank holds, master and state."""
    import torch

    out = {}
    for key, _, mod in model.local_cores():
        for n, p in mod.core.named_parameters():
            st = {"param": p, **opt.param_state(p)}
            out[(key, n)] = {k: (str(t.dtype), str(t.device),
                                 t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                             for k, t in st.items()}
    return out


def _bf16_round_trip(rank, world, g, plans):
    import copy

    import torch
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.mixed_precision import MasterWeightsOptimizer
    from megatron_spindle.runtime.replan import replan

    apply_cpu_patches()
    on_0, on_1 = plans
    def opt_of(params):  # a rank holding nothing still needs an optimizer object: torch refuses an empty list
        return MasterWeightsOptimizer(params, lambda ms: torch.optim.AdamW(
            ms or [torch.nn.Parameter(torch.zeros(1))], lr=1e-3))

    data = SyntheticData(g, seed=0)

    def step(model, opt, i):
        st = model(data.batch(i))
        model.backward(st)
        model.finalize_grads()
        opt.step()
        opt.zero_grad()
        return model.reduce_losses(st)

    model = SpindleModel(on_0, g, seed=0, dtype=torch.bfloat16, grad_reduce_in_fp32=True)
    opt = opt_of(model.trainable_parameters())
    for i in range(BF16_STEPS):
        step(model, opt, i)
    params = [p.detach().clone() for p in opt.params]
    masters = [m.detach().clone() for m in opt.masters]
    inner = copy.deepcopy(opt.inner.state_dict())
    at_257 = _state(model, opt)
    uninterrupted = [step(model, opt, BF16_STEPS + j) for j in range(AFTER)], _state(model, opt)
    with torch.no_grad():  # back to step 257, then the round trip and the same steps
        for p, m, v, w in zip(opt.params, opt.masters, params, masters):
            p.copy_(v)
            m.copy_(w)
    opt.inner.load_state_dict(inner)
    assert _state(model, opt) == at_257
    moved, mopt = replan(model, opt, on_1, g, make_optimizer=opt_of)
    on_rank_1 = _state(moved, mopt)
    back, bopt = replan(moved, mopt, on_0, g, make_optimizer=opt_of)
    after = _state(back, bopt)
    replanned = [step(back, bopt, BF16_STEPS + j) for j in range(AFTER)], _state(back, bopt)
    steps = sorted({float(t) for p in bopt.params for k, t in bopt.param_state(p).items() if k == "step"})
    return {"at_257": at_257, "on_rank_1": on_rank_1, "after": after, "uninterrupted": uninterrupted,
            "replanned": replanned, "steps": steps}


@pytest.fixture(scope="module")
def bf16_runs():
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=2)
    return run_ranks(_bf16_round_trip, 2, g, _one_rank_plans(g), timeout_s=600)


def test_optimizer_state_keeps_its_dtype_and_device_across_a_replan(bf16_runs):
    r0, r1 = bf16_runs
    assert r0["at_257"] and not r1["at_257"] and r1["on_rank_1"] and not r0["on_rank_1"]
    assert r1["on_rank_1"] == r0["at_257"]  # every tensor's dtype, device and bytes, on the other rank
    assert r0["after"] == r0["at_257"]
    some = next(iter(r0["at_257"].values()))
    assert some["param"][0] == "torch.bfloat16" and some["master"][0] == some["exp_avg"][0] == "torch.float32"
    assert some["step"][:2] == ("torch.float32", "cpu")
    assert r0["steps"] == [float(BF16_STEPS + AFTER)]  # 257 survives the round trip (bf16 holds 256 or 258)


def test_a_bf16_run_past_step_256_matches_the_uninterrupted_run_across_replans(bf16_runs):
    r0, _ = bf16_runs
    losses, state = r0["replanned"]
    want_losses, want_state = r0["uninterrupted"]
    assert losses == want_losses
    assert state == want_state
