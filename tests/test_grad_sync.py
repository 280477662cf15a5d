"""megatron.core DDP gradient sync (``runtime/grad_sync.py``) against a single process, with accumulation.

Every case runs ``spindle_forward_backward`` (K passes of the plan, the first K-1 under ``no_sync``, one sync)
and an SGD step, twice, on 4 gloo ranks with ``overlap_grad_reduce`` on and small buckets (several per rank
set, so buckets fire during backward from the second step on); the reference is the whole model in one
process, the K passes' losses scaled by 1/K. Each case also runs with the distributed optimizer (ZeRO-1:
reduce-scatter, SGD on this rank's block of each bucket, parameter all-gather), and checks the global
gradient norm against the reference's. Tolerances as in ``test_runtime_exec.py`` (1e-5 relative);
K = 1 with overlap on is ``test_runtime_exec.py``'s equivalence test.

Plan ``g-local-copies`` gives rank 0 two copies of one text-encoder shard (tensor-parallel groups (0, 1)
and (0, 2)): the copies' gradients must be summed into one bucket before it fires.

The passes and the distributed optimizer are the plan's (``plan.passes``, ``plan.distributed_optimizer``): each
case's plan says them. Two phased plans of ``test_runtime_exec.py`` run too (a phase per task; two phases with
mixed recompute): a weight used in several phases is complete only after its last phase's backward, and a
bucket whose weights are done is posted while later phases still run (the order of completion follows the
phases).

A bf16 model keeps and reduces its gradients in bf16 (fp32 when asked, as Megatron-LM's ``--bf16`` does).

The overlap test reads span times of the executor's trace: a bucket's reduce is posted before the last
backward span of the step ends (no wall-clock limit).
All cases run in one group of 4 processes; one more, in this process, builds ``GradSync`` from its inputs alone.
"""
import numpy as np
import pytest

from mp_harness import run_ranks
from test_runtime_exec import LR, MOMENTUM, TOL, WORLD, _sequential, graph, lean_plans, plans

STEPS = 2
BUCKET = 20_000  # parameters per bucket: the tiny model's rank sets split into several buckets


def all_plans():
    g = graph()
    t, at = "vision-text.text.layers", "audio-text.text.layers"
    out = dict(plans())
    out["g-local-copies"] = _sequential(g, WORLD, {at: [[(at, 0, 4, (0, 2, 1, 3))]]}, tp={t: 2, at: 2})
    lean = lean_plans()
    out.update({k: lean[k] for k in ("h-phase-per-task", "i-two-phases+mixed")})
    return out


#: (plan, passes K, distributed optimizer)
CASES = ([(name, 2, False) for name in all_plans()] + [(name, 2, True) for name in all_plans()]
         + [(name, 4, False) for name in ("d-tensor-parallel", "f-planner", "g-local-copies", "h-phase-per-task")])


def _run(plan, g, k, zero):
    import dataclasses

    import torch
    from megatron_spindle.megatron.adapter.schedule import forward_step, reduce_reports, spindle_forward_backward
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    plan = dataclasses.replace(plan, passes=k, distributed_optimizer=zero)  # the plan decides both
    model = SpindleModel(plan, g, seed=0, timeout_s=60, bucket_size=BUCKET)
    opt = torch.optim.SGD(model.optimizer_parameters(), lr=LR, momentum=MOMENTUM)
    data = SyntheticData(g, seed=0)
    losses, buckets, norms = [], [], []
    for step in range(STEPS):
        model.trace.step = step
        reports = spindle_forward_backward(forward_step_func=forward_step, model=[model], num_microbatches=k,
                                           data_iterator=iter([data.batch(step * k + i) for i in range(k)]))
        buckets.append(len(model.grad_sync.bucket_times()))
        norms.append(model.grad_norm())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(reduce_reports(reports))
    model.grad_sync.gather_params()  # with the distributed optimizer: every rank's updated blocks
    shards = {(key, s, n): p.detach().numpy().copy() for key, s, mod in model.local_cores()
              for n, p in mod.core.named_parameters()}
    copies = sum(len(mods) - 1 for mods in model._copies.values())
    spans = [(s.cat, s.name, s.start_s, s.dur_s, s.step) for s in model.trace.spans]
    model.destroy()
    return {"losses": losses, "shards": shards, "spans": spans, "copies": copies, "buckets": buckets,
            "norms": norms, "optimizer_numel": sum(p.numel() for p in model.optimizer_parameters())}


def _dtypes_and_norm(plan, g, dtype, fp32_reduce=False, copies=False):
    """One pass and sync in ``dtype``: the gradient buffers' dtypes, the ``.grad`` dtypes and the global norm."""
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    model = SpindleModel(plan, g, seed=0, timeout_s=60, bucket_size=BUCKET, dtype=dtype,
                         grad_reduce_in_fp32=fp32_reduce, param_dtype_grads=copies)
    batch = {t: {k: v.to(dtype) if v.is_floating_point() else v for k, v in streams.items()}
             for t, streams in SyntheticData(g, seed=0).batch(0).items()}  # the data in the model's dtype
    model.backward(model(batch))
    model.finalize_grads()
    out = {"buffers": sorted({str(p.main_grad.dtype) for p in model.grad_sync._main_params}),
           "grads": sorted({str(p.grad.dtype) if p.grad is not None else "none" for p in model.unique_parameters()}),
           "copies": len(model.grad_sync._grad_copies), "norm": model.grad_norm()}
    model.destroy()
    return out


def _masters(plan, g, zero):
    """bf16 weights, fp32 buffers, fp32 masters under SGD: after one step, is every master's gradient its
    fp32 reduced gradient (the distributed optimizer's block, or the whole buffer) itself, no bf16 round trip?"""
    import dataclasses

    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.mixed_precision import MasterWeightsOptimizer

    plan = dataclasses.replace(plan, distributed_optimizer=zero)
    model = SpindleModel(plan, g, seed=0, timeout_s=60, bucket_size=BUCKET, dtype=torch.bfloat16,
                         grad_reduce_in_fp32=True)
    params = model.optimizer_parameters()
    opt = MasterWeightsOptimizer(params, lambda ms: torch.optim.SGD(ms, lr=LR))
    model.backward(model(SyntheticData(g, seed=0).batch(0)))
    model.finalize_grads()
    opt.step()
    blocks = [grad for _, grad, *_ in model.grad_sync._shards] if zero else [p.main_grad for p in params]
    out = {"n": len(params), "copies": len(model.grad_sync._grad_copies),
           "bf16_grads": sum(p.grad is not None for p in params),
           "fp32": all(m.grad.dtype == torch.float32 for m in opt.masters),
           "same": all(m.grad.data_ptr() == b.data_ptr() and torch.equal(m.grad, b)
                       for m, b in zip(opt.masters, blocks)),
           "representable": all(torch.equal(b, b.bfloat16().float()) for b in blocks)}
    model.destroy()
    return out


def _all(rank, world, cases, g):
    import torch
    out = {case: _run(plan, g, case[1], case[2]) for case, plan in cases.items()}
    plan = cases[("f-planner", 2, False)]
    out["dtype"] = {str(d): _dtypes_and_norm(plan, g, d) for d in (torch.float32, torch.bfloat16)}
    out["dtype"]["bf16, fp32 reduce"] = _dtypes_and_norm(plan, g, torch.bfloat16, fp32_reduce=True)
    out["dtype"]["bf16, fp32 reduce, copies"] = _dtypes_and_norm(plan, g, torch.bfloat16, fp32_reduce=True,
                                                                 copies=True)
    out["masters"] = {zero: _masters(plan, g, zero) for zero in (False, True)}
    return out


def _reference(g, k):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel

    ref = ReferenceModel(g, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    data = SyntheticData(g, seed=0)
    losses, norms = [], []
    for step in range(STEPS):
        mean = {}
        for i in range(k):
            out = ref(data.batch(step * k + i))
            (sum(out.values()) / k).backward()
            for t, v in out.items():
                mean[t] = mean.get(t, 0.0) + float(v.detach()) / k
        norms.append(float(sum(p.grad.double().pow(2).sum() for p in ref.parameters() if p.grad is not None)) ** 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean)
    return losses, norms, {(key, n): p.detach() for key, n, p in ref.keyed_parameters()}


@pytest.fixture(scope="module")
def results():
    g = graph()
    every = all_plans()
    cases = {case: every[case[0]] for case in CASES}
    out = run_ranks(_all, WORLD, cases, g, timeout_s=600)
    refs = {k: _reference(g, k) for k in sorted({case[1] for case in CASES})}
    return cases, out, refs


@pytest.mark.parametrize("name,k,zero", CASES)
def test_accumulated_steps_match_single_process(results, name, k, zero):
    from megatron_spindle.models.layer_state import shard_tensor

    cases, out, refs = results
    case = (name, k, zero)
    plan = cases[case]
    ref_losses, ref_norms, ref_params = refs[k]
    for step in range(STEPS):
        for task, want in ref_losses[step].items():
            assert out[0][case]["losses"][step][task] == pytest.approx(want, rel=TOL), (case, step, task)
        for r in range(WORLD):  # the global norm: every shard counted once
            assert out[r][case]["norms"][step] == pytest.approx(ref_norms[step], rel=TOL), (case, r, step)
    tp_of = {key: m.tp for m in plan.metaops for key in m.param_keys if key}
    checked, errs = set(), []
    for r in range(WORLD):
        for (key, shard, pname), value in out[r][case]["shards"].items():
            full = ref_params[(key, pname)]
            if tp_of[key] > 1 and value.shape != tuple(full.shape):
                dim = [i for i, (a, b) in enumerate(zip(value.shape, full.shape)) if a != b][0]
                expect = shard_tensor(full, dim=dim, stride=1, rank=shard, size=tp_of[key]).numpy()
            else:
                expect = full.numpy()
            err = float(np.abs(value - expect).max()) / (float(np.abs(expect).max()) + 1e-12)
            errs.append((err, r, key, pname))
            checked.add((key, pname))
    errs.sort(reverse=True)
    assert errs[0][0] < TOL, (case, errs[:5])
    assert checked == set(ref_params)
    # small buckets: every rank reduces several buckets per step
    assert all(min(out[r][case]["buckets"]) > 1 for r in range(WORLD))


def test_distributed_optimizer_steps_a_shard(results):
    """ZeRO-1: a rank's optimizer holds its block of each bucket, so the optimizer state shrinks where a
    rank set has several ranks (plan a: almost every weight on all 4 ranks)."""
    _, out, _ = results
    for r in range(WORLD):
        full = sum(v.size for v in out[r][("a-sequential", 2, False)]["shards"].values())
        assert out[r][("a-sequential", 2, False)]["optimizer_numel"] == full
        assert out[r][("a-sequential", 2, True)]["optimizer_numel"] < 0.4 * full


def test_gradients_are_reduced_in_the_parameters_dtype(results):
    """bf16 parameters: bf16 buffers and all-reduce (grad_reduce_in_fp32=False), norm near the fp32 run's."""
    _, out, _ = results
    for r in range(WORLD):
        got = out[r]["dtype"]
        assert got["torch.float32"]["buffers"] == got["torch.float32"]["grads"] == ["torch.float32"]
        assert got["torch.bfloat16"]["buffers"] == got["torch.bfloat16"]["grads"] == ["torch.bfloat16"]
        assert got["torch.bfloat16"]["norm"] == pytest.approx(got["torch.float32"]["norm"], rel=0.05)
        # Megatron-LM's --bf16 default (--accumulate-allreduce-grads-in-fp32): fp32 buffers, no bf16 copy of
        # every gradient (fp32 masters and Megatron's optimizers read main_grad), one when asked for
        assert got["bf16, fp32 reduce"]["buffers"] == ["torch.float32"]
        assert got["bf16, fp32 reduce"]["grads"] == ["none"] and got["bf16, fp32 reduce"]["copies"] == 0
        assert got["bf16, fp32 reduce"]["norm"] == pytest.approx(got["torch.float32"]["norm"], rel=0.05)
        assert got["bf16, fp32 reduce, copies"]["grads"] == ["torch.bfloat16"]
        assert got["bf16, fp32 reduce, copies"]["copies"] > 0


def test_fp32_masters_step_from_the_fp32_reduced_gradient(results):
    """bf16 + fp32 buffers, with and without ZeRO-1: every master's gradient is its fp32 reduced block (the
    same memory, so bitwise), not a bf16 copy of it read back; no bf16 copy is made."""
    _, out, _ = results
    for r in range(WORLD):
        for zero, got in out[r]["masters"].items():
            assert got["n"] > 0 and got["fp32"] and got["same"], (r, zero, got)
            assert got["copies"] == 0 and got["bf16_grads"] == 0, (r, zero, got)
        assert not all(out[r]["masters"][z]["representable"] for z in (False, True)), r  # bf16 would round


def test_local_copies_are_exercised(results):
    _, out, _ = results
    assert out[0][("g-local-copies", 2, False)]["copies"] > 0
    assert all(out[r][("a-sequential", 2, False)]["copies"] == 0 for r in range(WORLD))


@pytest.mark.parametrize("name", ["a-sequential", "f-planner", "h-phase-per-task"])
def test_early_bucket_reduce_starts_before_backward_ends(results, name):
    """From the second step on (megatron learns each bucket's uses in the first), some bucket's reduce is
    posted while backward waves are still to run on that rank."""
    _, out, _ = results
    for r in range(WORLD):
        spans = [s for s in out[r][(name, 2, False)]["spans"] if s[4] == 1]
        bwd_end = max(start + dur for cat, _, start, dur, _ in spans if cat == "backward")
        bwd_last_start = max(start for cat, _, start, _, _ in spans if cat == "backward")
        posts = sorted(start for cat, label, start, _, _ in spans if cat == "sync" and label.startswith("reduce "))
        assert posts, (name, r, "no bucket reduce spans")
        assert posts[0] < bwd_last_start < bwd_end, (name, r, posts[0], bwd_last_start)


def test_a_phased_plan_posts_buckets_before_its_later_phases_run(results):
    """A phase per task: the weights only the first tasks use are complete after their phase's backward, so
    (from the second step on) some bucket's reduce is posted before this rank's last forward of the pass."""
    _, out, _ = results
    for r in range(WORLD):
        spans = [s for s in out[r][("h-phase-per-task", 2, False)]["spans"] if s[4] == 1]
        last_fwd = max(start for cat, _, start, _, _ in spans if cat == "forward")
        posts = sorted(start for cat, label, start, _, _ in spans if cat == "sync" and label.startswith("reduce "))
        assert posts and posts[0] < last_fwd, (r, posts[:1], last_fwd)


def test_grad_sync_is_built_from_its_inputs_and_refuses_a_parameter_in_no_group(tmp_path):
    """``GradSync`` reads nothing but what it is given (plan, rank, copies, parameters, groups, trace, device):
    built beside a model from the model's inputs it covers every parameter; given one trainable parameter more,
    one in no parameter device group, it refuses it."""
    import torch
    import torch.distributed as dist

    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime.executor import SpindleModel
    from megatron_spindle.runtime.grad_sync import GradSync

    apply_cpu_patches()
    g = build_graph("multitask-clip", tasks=2, size="tiny", batch=2)
    plan = make_plan(g, load_cluster(None, num_devices=1))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = SpindleModel(plan, g, seed=0)
        inputs = dict(rank=model.rank, copies=model.layer_copies, registry=model.registry, trace=model.trace,
                      device=model.device, distributed_optimizer=plan.distributed_optimizer)
        extra = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(RuntimeError, match="1 parameters belong to no parameter device group"):
            GradSync(plan, params=model.unique_parameters() + [extra], **inputs)
        sync = GradSync(plan, params=model.unique_parameters(), **inputs)  # takes the parameters over
        assert not hasattr(sync, "model") and sync.trace is model.trace and sync.device == model.device
        assert len(sync._main_params) == len(model.trainable_parameters())
        sync.release()
    finally:
        dist.destroy_process_group()
