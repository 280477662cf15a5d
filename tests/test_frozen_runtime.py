"""Frozen modules in the runtime, on 2 gloo ranks, against a single process with the same modules frozen.

* **The executor** (SGD with momentum, as ``test_runtime_exec.py``, so every parameter can be compared) on
  Multitask-CLIP tiny with ``vision`` and ``text.layers`` frozen (forward-only MetaOps, an input-gradient-only
  MetaOp between two trained ones) under a sequential plan, tensor parallelism 2 on the frozen text layers,
  two encoders side by side, and a planner plan; and with ``vision`` and ``text`` frozen (``vision-text`` then
  trains nothing, its loss runs forward only): after 3 steps every task's loss and every parameter within 1e-5
  of the single process, frozen weights bit-identical to their initial values, with ``requires_grad=False``
  and no gradient, in no gradient-sync bucket and no parameter process group; every rank posts exactly the
  plan's messages (none back to a forward-only slice).
* **The built-in trainer** (AdamW, global-norm clip, ``--spindle-freeze vision,text.layers``): its losses over 3
  steps equal a single-process AdamW run's, its trainable weights agree (Adam turns the exactly-zero gradient
  of a transformer's key bias into rounding noise with a sign of its own, so the key rows of ``linear_qkv.bias``
  are left out; see ``test_runtime_exec.py``), frozen weights never change and have no optimizer state;
  ``--spindle-check-equivalence`` passes.
* **Checkpoints** of the ImageBind-style spec (``imagebind``, vision and text frozen) trained 4 steps: saved at
  step 2 without optimizer state for the frozen weights (only ``model/...`` keys) and resumed with exactly the
  uninterrupted losses.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os

import numpy as np
import pytest

from mp_harness import run_ranks
from test_runtime_exec import _plan_posts  # the plan's messages a rank posts in one step

from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.assembly.manual import plan_from_waves
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.workload.workloads import build_graph

WORLD, STEPS = 2, 3
LR, MOMENTUM = 0.05, 0.9
TOL = 1e-5
#: Weights after AdamW steps: its per-element normalization (m / (sqrt(v) + 1e-8)) turns the float32 rounding of
#: a near-zero gradient into a larger share of the step, and that rounding depends on the CPU's torch kernels
#: (seen: under 1e-5 on one machine; 1.14e-5 of a bias's largest entry, about 3e-8 absolute, on another with the
#: same plan and pins); losses keep TOL.
ADAM_TOL = 5e-5
FREEZE = ["vision", "text.layers"]
TRAIN = ["--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4", "--lr", "1e-3",
         "--lr-decay-style", "constant", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "7",
         "--log-interval", "1", "--spindle-predict-interval", "0", "--spindle"]


def _sequential(g, n, tp=None, together=()):
    """Every MetaOp alone on all ranks in level order; the MetaOps in ``together`` share one wave, one rank each."""
    waves = []
    for m in sorted(contract(g), key=lambda m: m.level):
        if m.name in together[1:]:
            continue
        if m.name == (together[0] if together else None):
            waves.append([(name, 0, m.num_layers, (r,)) for r, name in enumerate(together)])
            continue
        waves.append([(m.name, 0, m.num_layers, tuple(range(n if m.batch_splittable else 1)))])
    return plan_from_waves(g, n, waves, tp=tp)


def cases():
    a = build_graph("multitask-clip", tasks=4, size="tiny", batch=8, freeze=FREEZE)
    b = build_graph("multitask-clip", tasks=4, size="tiny", batch=8, freeze=["vision", "text"])
    cluster = load_cluster(None, num_devices=WORLD, gpus_per_node=WORLD)
    t, at = "vision-text.text.layers", "audio-text.text.layers"
    return {
        "a-sequential": (a, _sequential(a, WORLD)),
        "a-tensor-parallel-frozen": (a, _sequential(a, WORLD, tp={t: 2, at: 2})),
        "a-encoders-side-by-side": (a, _sequential(a, WORLD, together=("vision-text.vision.layers", t))),
        "a-planner": (a, make_plan(a, cluster)),
        "b-planner": (b, make_plan(b, cluster)),
    }


def _shards(model):
    return {(k, s, n): p.detach().numpy().copy() for k, s, mod in model.local_cores()
            for n, p in mod.core.named_parameters()}


def _executor_case(plan, g):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.runtime.executor import SpindleModel

    model = SpindleModel(plan, g, seed=0, timeout_s=60)
    init = _shards(model)
    opt = torch.optim.SGD(model.trainable_parameters(), lr=LR, momentum=MOMENTUM)
    data = SyntheticData(g, seed=0)
    losses, grad_after_sync = [], {}
    for step in range(STEPS):
        st = model(data.batch(step))
        model.backward(st)
        model.finalize_grads()
        grad_after_sync = {(k, n): p.grad is not None for k, _, mod in model.local_cores()
                           for n, p in mod.core.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(model.reduce_losses(st))
    synced = {id(p) for inst in model.grad_sync.instances for p in inst.ddp.module.params}
    out = {"losses": losses, "init": init, "final": _shards(model), "grad": grad_after_sync,
           "requires_grad": {(k, n): p.requires_grad for k, _, mod in model.local_cores()
                             for n, p in mod.core.named_parameters()},
           "synced": {(k, n) for k, _, mod in model.local_cores() for n, p in mod.core.named_parameters()
                      if id(p) in synced}}
    model.destroy()
    return out


def _trainer(argv, grab=False):
    """The built-in trainer on ``argv``: progress lines, log text, and (``grab``) its weights and optimizer."""
    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.trainer.loop import Trainer

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("megatron_spindle")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    trainer = Trainer(build_parser().parse_args(argv))
    losses, step = [], trainer.train_step

    def train_step(it):
        got = step(it)
        losses.append(got[0])
        return got

    trainer.train_step = train_step
    try:
        init = _shards(trainer.model) if grab else None
        trainer.train()
        out = {"losses": losses, "log": buf.getvalue()}
        if grab:
            opt_ids = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
            out.update(init=init, final=_shards(trainer.model), in_optimizer={
                (k, n) for k, _, mod in trainer.model.local_cores() for n, p in mod.core.named_parameters()
                if id(p) in opt_ids and trainer.optimizer.state.get(p)})
    finally:
        logger.removeHandler(handler)
        trainer.close()
    return out


def _ranks(rank, world, cases, ckpt):
    from megatron.core import dist_checkpointing as dc

    from megatron_spindle.runtime import p2p
    from megatron_spindle.planner.assembly.communicators import plan_rank_sets
    posted, real = [], p2p.post_p2p

    def recording(ops):  # what the executor posts, then post it
        posted.extend((kind, peer, tag, int(t.shape[0])) for kind, t, peer, tag in ops)
        return real(ops)

    p2p.post_p2p = recording
    out = {}
    for name, (g, plan) in cases.items():
        posted.clear()
        out[name] = _executor_case(plan, g)
        out[name].update(groups=sorted(plan_rank_sets(plan)), posted=sorted(posted))
    p2p.post_p2p = real
    out["trainer"] = _trainer(TRAIN + ["--spindle-freeze", ",".join(FREEZE), "--train-iters", str(STEPS),
                                       "--spindle-check-equivalence"], grab=True)
    ib = TRAIN + ["--spindle-model", "imagebind", "--train-iters", "4"]
    out["ib-full"] = _trainer(ib)
    out["ib-first"] = _trainer(ib + ["--save", ckpt, "--exit-interval", "2"])
    out["ib-resumed"] = _trainer(ib + ["--load", ckpt])
    out["ckpt-keys"] = sorted(dc.load_tensors_metadata(os.path.join(ckpt, "iter_0000002")))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cs = cases()
    ckpt = str(tmp_path_factory.mktemp("frozen_ckpt"))
    out = run_ranks(_ranks, WORLD, cs, ckpt, timeout_s=900)
    return cs, out


def _reference(g, *, adam=False, seed=0):
    """The single process with the same modules frozen: losses per step, initial and final weights."""
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel

    ref = ReferenceModel(g, seed=seed)
    init = {(k, n): p.detach().clone().numpy() for k, n, p in ref.keyed_parameters()}
    params = [p for p in ref.parameters() if p.requires_grad]
    decayed = [{"params": [p for p in params if p.dim() > 1]},  # Megatron's rule: no decay on 1-D weights
               {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    opt = (torch.optim.AdamW(decayed, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01) if adam else
           torch.optim.SGD(params, lr=LR, momentum=MOMENTUM))
    data = SyntheticData(g, seed=seed)
    losses = []
    for step in range(STEPS):
        out = ref(data.batch(step))
        sum(out.values()).backward()
        if adam:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append({k: float(v.detach()) for k, v in out.items()})
    return losses, init, {(k, n): p.detach().numpy() for k, n, p in ref.keyed_parameters()}, g.frozen_param_keys()


def _expect(full, value, shard, tp):
    from megatron_spindle.models.layer_state import shard_tensor
    import torch
    if value.shape == full.shape:
        return full
    dim = [i for i, (a, b) in enumerate(zip(value.shape, full.shape)) if a != b][0]
    return shard_tensor(torch.from_numpy(full), dim=dim, stride=1, rank=shard, size=tp).numpy()


def _err(a, b):
    return float(np.abs(a - b).max()) / (float(np.abs(b).max()) + 1e-12)


@pytest.mark.parametrize("case", list(cases()))
def test_executor_with_frozen_modules_equals_single_process(results, case):
    cs, out = results
    g, plan = cs[case]
    losses, init, final, frozen = _reference(g)
    assert frozen and out[0][case]["losses"][0].keys() == losses[0].keys()
    for step in range(STEPS):
        for task, want in losses[step].items():
            assert out[0][case]["losses"][step][task] == pytest.approx(want, rel=TOL), (case, step, task)
    tp = {k: m.tp for m in plan.metaops for k in m.param_keys if k}
    seen = set()
    for r in range(WORLD):
        got = out[r][case]
        for (key, shard, name), value in got["final"].items():
            assert _err(value, _expect(final[(key, name)], value, shard, tp[key])) < TOL, (case, r, key, name)
            is_frozen = key in frozen
            assert got["requires_grad"][(key, name)] is not is_frozen
            if is_frozen:  # never changed, never had a gradient, never synchronised
                assert np.array_equal(value, got["init"][(key, shard, name)]), (case, key, name)
                assert np.array_equal(value, _expect(init[(key, name)], value, shard, tp[key]))
                assert not got["grad"][(key, name)] and (key, name) not in got["synced"]
            seen.add((key, name))
        assert not [n for n in got["groups"] if n.startswith("param/") and n.split("/")[1] in frozen]
    assert seen == set(final)


def test_executor_posts_exactly_the_plans_messages_and_none_back_to_forward_only_slices(results):
    cs, out = results
    for case, (g, plan) in cs.items():
        ms, src = {m.name: m for m in plan.metaops}, {s.name: s.metaop for s in plan.slices()}
        assert all(not t.backward for t in plan.transfers if not ms[src[t.src]].trainable
                   and not ms[src[t.src]].input_grad)
        for r in range(WORLD):
            assert out[r][case]["posted"] == sorted(_plan_posts(plan, r) * STEPS), (case, r)
    assert any(out[r][c]["posted"] for c in cs for r in range(WORLD))


def test_a_task_with_nothing_trainable_reports_its_loss_and_trains_the_rest(results):
    cs, out = results
    g, plan = cs["b-planner"]
    ms = {m.name: m for m in plan.metaops}
    assert not ms["vision-text.loss"].trainable and not ms["vision-text.loss"].input_grad
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel

    untrained, data = ReferenceModel(g, seed=0), SyntheticData(g, seed=0)
    for step, got in enumerate(out[0]["b-planner"]["losses"]):  # nothing of it trains: the initial model's loss
        with torch.no_grad():
            want = float(untrained({"vision-text": data.batch(step)["vision-text"]})["vision-text"])
        assert got["vision-text"] == pytest.approx(want, rel=TOL), step


def test_builtin_trainer_with_spindle_freeze_equals_single_process(results):
    _, out = results
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=8, freeze=FREEZE)
    losses, init, final, frozen = _reference(g, adam=True, seed=7)
    got = out[0]["trainer"]
    diff = float(got["log"].split("equivalence: max relative difference ")[1].split()[0])
    assert diff < TOL
    assert len(got["losses"]) == STEPS
    for step in range(STEPS):
        for task, want in losses[step].items():
            assert got["losses"][step][task] == pytest.approx(want, rel=TOL), (step, task)
    heads = {op.param_key: op.layer.num_heads for op in g.operators}
    for r in range(WORLD):
        t = out[r]["trainer"]
        for (key, shard, name), value in t["final"].items():
            want = final[(key, name)]
            assert value.shape == want.shape
            if key in frozen:
                assert np.array_equal(value, t["init"][(key, shard, name)]) and (key, name) not in t["in_optimizer"]
            if name.endswith("linear_qkv.bias"):  # per head [q, k, v]: leave out the key rows (see the doc)
                value, want = (np.delete(x.reshape(heads[key], 3, -1), 1, axis=1) for x in (value, want))
            assert _err(value, want) < ADAM_TOL, (r, key, name)
            if key not in frozen:
                assert (key, name) in t["in_optimizer"]


def test_imagebind_trains_and_resumes_exactly_without_frozen_optimizer_state(results):
    _, out = results
    full, first, resumed = (out[0][k]["losses"] for k in ("ib-full", "ib-first", "ib-resumed"))
    assert len(full) == 4 and first == full[:2] and resumed == full[2:]
    keys = out[0]["ckpt-keys"]
    assert any(k.startswith("model/vision.layers.0/") for k in keys)
    assert not any(k.startswith("optim/vision") for k in keys)  # 4 tasks: ImageBind's image pairs, no text
    assert any(k.startswith("optim/audio.layers.0/") for k in keys)


@pytest.mark.parametrize("value,match", [("vison", "--spindle-freeze vison: cannot freeze 'vison': not a module of "
                                                   "model 'multitask-clip'; modules: vision.embed, vision.layers"),
                                         ("loss", "--spindle-freeze loss: cannot freeze 'loss'"),
                                         ("vision,", "argument --spindle-freeze: 'vision,' has an empty name")])
def test_spindle_freeze_is_checked_in_one_line(value, match, capfd):
    """The launch scripts' one-process check (the trainer's own exit would end this test's process)."""
    from megatron_spindle.megatron.adapter.flags import preflight_main

    with pytest.raises(SystemExit) if value.endswith(",") else contextlib.nullcontext():
        assert preflight_main(["--spindle-size", "tiny", "--spindle-tasks", "4", "--spindle-freeze", value]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert match in err[-1] and (len(err) == 1 or value.endswith(","))  # argparse adds its usage line

