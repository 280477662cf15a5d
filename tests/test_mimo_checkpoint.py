"""A MIMO model's checkpoints are MIMO's: Spindle writes them under the ``MimoModel``'s own ``sharded_state_dict()``
keys, so the user's model reads them, and Megatron-LM's own loop without Spindle (``SPINDLE=0``) and a ``--spindle``
run load each other's.

* built-in loop (2 gloo ranks, ``examples/mimo/tiny_avlm.py``): a plan with the language model and a projection
  tensor parallel 2 (so the SwiGLU ``linear_fc1`` factory, a vocabulary-parallel embedding and replicated norms)
  saves with its AdamW state; in one process the user's ``MimoModel`` loads the checkpoint through its own
  ``sharded_state_dict()`` and has every parameter of the run's (:func:`...mimo_reference.load_run_weights`),
  the moments sit under Megatron's ``optimizer.state.exp_avg.<key>``, and the checkpoint loads back under another
  plan to the same parameters;
* Megatron-LM's loop (``.venv-mlm``: megatron.training; ``scripts/run_mimo.sh``): ``SPINDLE=0`` on 2 ranks stopped
  at iteration 2 and continued under ``--spindle`` on 4 ranks logs the iteration-3 and -4 losses and learning rates
  that ``SPINDLE=0`` continuing its own checkpoint logs (a cosine schedule; iteration 4 comes after a step with the
  loaded Adam moments), and the reverse, every task within 1e-5; both checkpoints hold the same model and optimizer
  keys.
"""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from mp_harness import run_ranks

PROVIDER = "examples.mimo.tiny_avlm:tiny_avlm"
REPO = pathlib.Path(__file__).resolve().parent.parent
TASKS = str(REPO / "examples" / "mimo" / "tiny_tasks.toml")
WORLD = 2


def _graph():
    from megatron_spindle.models.mimo_source import load_source
    return load_source(PROVIDER, TASKS).workload().graph(1)


def _plans(g):
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    from megatron_spindle.planner.workload.metaops import contract

    waves = [[(m.name, 0, m.num_layers, tuple(range(WORLD)))] for m in sorted(contract(g), key=lambda m: m.level)]
    lang = {f"{t}.language.{p}": 2 for t in g.tasks for p in ("embed", "layers", "head")}
    return (plan_from_waves(g, WORLD, waves, tp={**lang, "image-text.images.proj": 2}),
            plan_from_waves(g, WORLD, waves))


def _save_and_reload(rank, world, root):
    import torch

    from megatron_spindle.megatron.checkpoint.save_load import load_checkpoint, save_checkpoint
    from megatron_spindle.runtime.executor import SpindleModel

    g = _graph()
    tensor_parallel, data_parallel = _plans(g)
    model = SpindleModel(tensor_parallel, g, seed=0, timeout_s=120)
    opt = torch.optim.AdamW(model.unique_parameters(), lr=1e-3)
    for p in model.unique_parameters():  # moments that differ from the weights and from each other
        opt.state[p].update(step=torch.tensor(3.0), exp_avg=p.detach() * 0.5, exp_avg_sq=p.detach() ** 2)
    save_checkpoint(root, 2, model, opt)
    model.destroy()
    other = SpindleModel(data_parallel, g, seed=7, timeout_s=120)  # other weights until the load
    opt2 = torch.optim.AdamW(other.unique_parameters(), lr=1e-3)
    it, _, missing = load_checkpoint(root, other, opt2)
    params = {(k, n): p.detach().numpy().copy() for k, _, mod in other.local_cores()
              for n, p in mod.core.named_parameters()}
    moments = {(k, n): opt2.state[p]["exp_avg"].numpy().copy() for k, _, mod in other.local_cores()
               for n, p in mod.core.named_parameters()}
    other.destroy()
    return it, missing, params, moments


def _mimo_model():
    """The user's ``MimoModel`` in one process, its megatron modules asked for their state with one-rank groups."""
    from megatron.core.transformer.module import MegatronModule

    from megatron_spindle.compat.cpu import apply_cpu_patches
    from megatron_spindle.models.blocks import LocalGroup
    from megatron_spindle.models.mimo_build import call_provider, single_process_groups
    from megatron_spindle.models.mimo_layers import provider

    apply_cpu_patches()
    with single_process_groups():
        mimo = call_provider(provider(), PROVIDER)
    for m in mimo.modules():
        if isinstance(m, MegatronModule) and not hasattr(m, "tp_group"):
            m.tp_group = LocalGroup()
    return mimo


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mimo_ckpt"))
    return root, run_ranks(_save_and_reload, WORLD, root, timeout_s=600)


def _read_as_mimo(rank, world, root):
    """In one process: the user's ``MimoModel`` loads the checkpoint with its own ``sharded_state_dict()``; returns
    the checkpoint's keys and every parameter that differs from the run's (:func:`load_run_weights`)."""
    import torch
    from megatron.core import dist_checkpointing as dc

    from megatron_spindle.megatron.checkpoint.files import restrict_metadata_unpickling
    from megatron_spindle.models.blocks import LocalGroup
    from megatron_spindle.models.mimo_reference import load_run_weights

    g = _graph()
    mimo, want = _mimo_model(), _mimo_model()
    load_run_weights(want, g, seed=0)
    with torch.no_grad():
        for p in mimo.parameters():
            p.zero_()
    sd = mimo.sharded_state_dict(metadata={"dp_cp_group": LocalGroup()})
    path = str(pathlib.Path(root) / "iter_0000002")
    restrict_metadata_unpickling()
    meta = sorted(dc.load_tensors_metadata(path))
    mimo.load_state_dict(dc.load(sd, path), strict=False)
    theirs, mine = dict(want.named_parameters()), dict(mimo.named_parameters())
    return meta, sorted(set(theirs) ^ set(mine)), [n for n, p in mine.items() if not torch.equal(p, theirs[n])]


def test_the_users_mimo_model_loads_spindles_checkpoint_through_its_own_keys(saved):
    from megatron.core.models.mimo.submodules.base import ModalitySubmodules
    if "sharded_state_dict" not in vars(ModalitySubmodules):
        pytest.skip("megatron-core 0.16.1's MimoModel checkpoints its encoders as plain tensors keyed layer by layer "
                    "(its ModalitySubmodules has no sharded_state_dict); Spindle writes 0.17+'s keys")
    meta, unmatched, differ = run_ranks(_read_as_mimo, 1, saved[0], timeout_s=300)[0]
    assert "language_model.decoder.layers.mlp.linear_fc1.weight" in meta
    assert "optimizer.state.exp_avg.modality_submodules.images.encoders.clip.decoder.layers.mlp.linear_fc1.weight" \
        in meta
    assert not [k for k in meta if k.startswith(("model/", "optim/"))]
    assert unmatched == [] and differ == []


def test_a_mimo_checkpoint_loads_back_under_another_plan(saved):
    from megatron_spindle.models.mimo_reference import load_run_weights

    _, out = saved
    g = _graph()
    want = _mimo_model()
    load_run_weights(want, g, seed=0)
    full = dict(want.named_parameters())
    seen = set()
    for it, missing, params, moments in out:
        assert it == 2 and missing == []
        for (key, name), value in params.items():
            expect = full[f"{key}.{name}"].detach()
            assert np.array_equal(value, expect.numpy()), (key, name)
            assert np.array_equal(moments[(key, name)], (expect * 0.5).numpy()), (key, name)
            seen.add(f"{key}.{name}")
    assert seen == set(full)


def _megatron_losses(text: str) -> dict[int, dict[str, float]]:
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|(.*)", text):
        out[int(m.group(1))] = {k: float(v) for k, v in re.findall(r"\| ([\w -]+): ([0-9.E+-]+)", m.group(2))
                                if k in ("image-text", "audio-text", "text", "learning rate")}
    return out


MEGATRON = ["--lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--log-interval", "1",
            "--eval-interval", "10", "--eval-iters", "1", "--seed", "1234"]
#: ``SPINDLE=0`` on 2 ranks and ``--spindle`` on 4 train the same samples per task per step (4).
WITHOUT = {"SPINDLE": "0", "GPUS_PER_NODE": "2", "MICRO_BATCH": "2", "TRAIN_ITERS": "4"}
WITH = ({"SPINDLE_BACKEND": "megatron", "GPUS_PER_NODE": "4", "MICRO_BATCH": "1", "TRAIN_ITERS": "4"},
        ["--global-batch-size", "4"])


def _keys(path) -> set[str]:
    from megatron.core import dist_checkpointing as dc

    from megatron_spindle.megatron.checkpoint.files import restrict_metadata_unpickling

    restrict_metadata_unpickling()
    return set(dc.load_tensors_metadata(str(path)))


def test_spindle_and_megatron_lms_own_loop_continue_each_others_checkpoints(tmp_path):
    pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                        "(Python >= 3.12): run `make test-megatron-lm`")
    from test_mimo_launch import run_mimo

    def run(name, env, *args):
        d = tmp_path / name
        d.mkdir()
        rc, text, _ = run_mimo(d, *MEGATRON, *args, env=env)
        assert rc == 0, text[-3000:]
        return _megatron_losses(text)

    stop = ["--save-interval", "2", "--exit-interval", "2", "--save"]
    load = ["--override-opt_param-scheduler", "--load"]  # the two count a step's samples differently
    without, spindle = tmp_path / "without", tmp_path / "spindle"
    for name, (env, extra), ckpt, (other_env, other_extra) in (
            ("a", (WITHOUT, []), without, WITH), ("b", WITH, spindle, (WITHOUT, []))):
        assert sorted(run(f"{name}-stopped", env, *extra, *stop, str(ckpt))) == [1, 2]
        own = run(f"{name}-own", env, *extra, *load, str(ckpt))  # what the writer's loop continues with
        got = run(f"{name}-other", other_env, *other_extra, *load, str(ckpt))
        assert sorted(got) == sorted(own) == [3, 4]  # 4: after a step with the loaded moments and schedule
        for it in (3, 4):
            assert set(got[it]) == set(own[it]) == {"image-text", "audio-text", "text", "learning rate"}
            for key, v in own[it].items():
                assert got[it][key] == pytest.approx(v, rel=1e-5), (name, it, key)
    a, b = _keys(without / "iter_0000002"), _keys(spindle / "iter_0000002")
    assert "language_model.decoder.layers.mlp.linear_fc1.weight" in a
    assert {k for k in a if not k.startswith("rng")} == {k for k in b if not k.startswith("rng")}
