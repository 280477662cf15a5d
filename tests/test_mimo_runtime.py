"""A user's MIMO model (``examples/mimo/tiny_avlm.py``: two encoders and a language model, three tasks, one of
them text only) run from Spindle plans on 4 gloo ranks against the user's ``MimoModel`` in one process.

The reference is the provider's own model, its weights those every rank starts from
(:class:`megatron_spindle.models.mimo_reference.MimoReference`), run by ``MimoModel.forward`` task by task. After
3 SGD steps (momentum; see ``test_runtime_exec.py`` for why not Adam) every task's loss is within 1e-5 relative
and every parameter (each rank's shard against the same slice of the reference) within 1e-5 of the largest
entry, on these plans:

* ``a-sequential``: every MetaOp alone on all ranks (data parallel 4), level by level;
* ``b-concurrent-encoders``: the vision and the audio encoders' layers side by side on two ranks each;
* ``c-split-across-waves``: the image-text language layers split over two waves on different ranks;
* ``d-tensor-parallel``: the language model's embedding, layers and head, and the image projection, tensor
  parallel 2 (the one weight of the three tasks' MetaOps sharded alike);
* ``e-planner``: the plan ``spindle plan`` makes;
* ``f-encoder-parts-apart``: the audio encoder's embed and post parts (one weight) on disjoint ranks, each rank
  holding parameters only one of them uses.
"""
import pathlib

import numpy as np
import pytest

from mp_harness import run_ranks

WORLD, STEPS, LR, MOMENTUM, TOL = 4, 3, 0.05, 0.9, 1e-5
PROVIDER = "examples.mimo.tiny_avlm:tiny_avlm"
TASKS = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "mimo" / "tiny_tasks.toml")


def _source():
    from megatron_spindle.models.mimo_source import load_source
    return load_source(PROVIDER, TASKS)


def _plans(g):
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.metaops import contract

    def sequential(override=None, tp=None):
        override, waves, done = override or {}, [], set()
        for m in sorted(contract(g), key=lambda m: m.level):
            if m.name in done:
                continue
            if m.name in override:
                waves += override[m.name]
                done.update(x[0] for wave in override[m.name] for x in wave)
                continue
            waves.append([(m.name, 0, m.num_layers, tuple(range(WORLD)))])
        return plan_from_waves(g, WORLD, waves, tp=tp)

    vis, aud, lm = "image-text.images.clip.layers", "audio-text.audio.whisper.layers", "image-text.language.layers"
    emb, post = "audio-text.audio.whisper.embed", "audio-text.audio.whisper.post"
    lang = {f"{t}.language.{p}": 2 for t in g.tasks for p in ("embed", "layers", "head")}
    return {
        "a-sequential": sequential(),
        "b-concurrent-encoders": sequential({vis: [[(vis, 0, 2, (0, 1)), (aud, 0, 2, (2, 3))]]}),
        "c-split-across-waves": sequential({lm: [[(lm, 0, 1, (0, 1, 2, 3))], [(lm, 1, 1, (3, 1))]]}),
        "d-tensor-parallel": sequential(tp={**lang, "image-text.images.proj": 2}),
        "e-planner": make_plan(g, load_cluster(None, num_devices=WORLD, gpus_per_node=4)),
        "f-encoder-parts-apart": sequential({emb: [[(emb, 0, 1, (0, 1))]], post: [[(post, 0, 1, (2, 3))]]}),
    }


def _cases(rank, world):
    import torch
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.layer_state import shard_spec
    from megatron_spindle.runtime.executor import SpindleModel

    g = _source().workload().graph(1)
    out = {}
    for name, plan in _plans(g).items():
        model = SpindleModel(plan, g, seed=0, timeout_s=120)
        opt = torch.optim.SGD(model.unique_parameters(), lr=LR, momentum=MOMENTUM)
        data, losses = SyntheticData(g, seed=0), []
        for step in range(STEPS):
            st = model(data.batch(step))
            model.backward(st)
            model.finalize_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(model.reduce_losses(st))
        tp = {k: m.tp for m in plan.metaops for k in m.param_keys if k}
        shards = {(k, s, n): (p.detach().numpy().copy(), tp[k], shard_spec(p)) for k, s, mod in model.local_cores()
                  for n, p in mod.core.named_parameters()}
        out[name] = {"losses": losses, "shards": shards,
                     "tp": sorted({(s.metaop, plan.metaop(s.metaop).tp) for s in plan.slices()})}
        model.destroy()
    return out


def _reference():
    import torch
    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.mimo_reference import MimoReference

    apply_cpu_patches()
    g = _source().workload().graph(1)
    ref = MimoReference(g, seed=0)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    data, losses = SyntheticData(g, seed=0), []
    for step in range(STEPS):
        out = ref(data.batch(step))
        sum(out.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append({k: float(v) for k, v in out.items()})
    return losses, {(k, n): p.detach().clone() for k, n, p in ref.keyed_parameters()}, len(list(ref.parameters()))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, WORLD, timeout_s=600), _reference()


CASES = ["a-sequential", "b-concurrent-encoders", "c-split-across-waves", "d-tensor-parallel", "e-planner",
         "f-encoder-parts-apart"]


@pytest.mark.parametrize("case", CASES)
def test_a_plan_trains_the_users_mimo_model_as_one_process_does(results, case):
    from megatron_spindle.models.layer_state import shard_tensor

    out, (ref_losses, ref_params, n_params) = results
    assert len(ref_params) == n_params  # every parameter of the user's model is some operator's
    for step in range(STEPS):
        for task, want in ref_losses[step].items():
            assert out[0][case]["losses"][step][task] == pytest.approx(want, rel=TOL), (case, step, task)
    checked = set()
    for r in range(WORLD):
        for (key, shard, name), (value, tp, spec) in out[r][case]["shards"].items():
            full = ref_params[(key, name)]
            expect = full.numpy()
            if tp > 1 and spec is not None:
                expect = shard_tensor(full, dim=spec[0], stride=spec[1], rank=shard, size=tp).numpy()
            err = float(np.abs(value - expect).max()) / (float(np.abs(expect).max()) + 1e-12)
            assert err < TOL, (case, r, key, name, err)
            checked.add((key, name))
    assert checked == set(ref_params), sorted(set(ref_params) - checked)[:5]


def test_the_tensor_parallel_plan_shards_the_language_model(results):
    out, _ = results
    tp = dict(out[0]["d-tensor-parallel"]["tp"])
    assert tp["text.language.layers"] == tp["image-text.language.head"] == tp["image-text.images.proj"] == 2
    assert tp["image-text.images.clip.layers"] == 1
