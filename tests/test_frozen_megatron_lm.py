"""Frozen modules under Megatron-LM's own ``pretrain`` (``megatron.training``) on 2 gloo CPU ranks.

Run by ``make test-megatron-lm`` (``.venv-mlm``: Python 3.12, megatron-core 0.19.2); skipped without
``megatron.training``. Multitask-CLIP tiny with ``--spindle-freeze vision,text.layers``:

* Megatron's ``train_step`` ran our schedule and gradient sync, and its losses over 3 steps equal the built-in
  trainer's on the same flags within 1e-6 (which ``tests/test_frozen_runtime.py`` holds against a single
  process with the same modules frozen);
* the frozen weights never change, have ``requires_grad=False`` and are in none of Megatron's optimizer
  parameter groups (no optimizer state); the trained ones are;
* a checkpoint written by Megatron at iteration 2 holds the frozen weights (``model/...``) but no optimizer
  state for them, and resuming from it reproduces the uninterrupted run's iteration-3 losses exactly.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("megatron.training.training", reason="megatron.training needs megatron-core >= 0.17 "
                    "(Python >= 3.12): run `make test-megatron-lm`")

from mp_harness import run_ranks  # noqa: E402
from test_megatron_lm import _loop_run  # noqa: E402 - the built-in trainer's losses on the same flags

FLAGS = ["--spindle", "--spindle-model", "multitask-clip", "--spindle-size", "tiny", "--spindle-tasks", "4",
         "--spindle-freeze", "vision,text.layers", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
         "--weight-decay", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--clip-grad", "1.0",
         "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"]
FROZEN_PREFIXES = ("vision.", "text.layers.")


def _weights(chunk) -> dict:
    return {(k, s, n): p.detach().float().numpy().copy() for k, s, mod in chunk.module.local_cores()
            for n, p in mod.core.named_parameters()}


def _megatron_run(argv: list[str]) -> dict:
    """One ``pretrain_spindle(backend="megatron")``: losses, call counts, weights before and after, and which
    weights Megatron's optimizer steps."""
    import megatron.training.training as mt

    from megatron_spindle.megatron.adapter import hooks

    counts = {"train_step": 0, "spindle_forward_backward": 0}
    seen: dict = {"losses": [], "init": None, "optimized": None}
    originals = (mt.train_step, hooks.megatron_forward_backward)

    def train_step(*a, **kw):
        counts["train_step"] += 1
        if seen["init"] is None:
            chunk = hooks._BUILT[0]
            seen["init"] = _weights(chunk)
            optimizer = a[3] if len(a) > 3 else kw["optimizer"]
            ids = {id(p) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                   for g in opt.optimizer.param_groups for p in g["params"]}
            seen["optimized"] = {(k, n) for k, _, mod in chunk.module.local_cores()
                                 for n, p in mod.core.named_parameters() if id(p) in ids}
        out = originals[0](*a, **kw)
        seen["losses"].append({k: float(v) for k, v in out[0].items()})
        return out

    def forward_backward(**kw):
        if not kw.get("forward_only"):
            counts["spindle_forward_backward"] += 1
        return originals[1](**kw)

    mt.train_step, hooks.megatron_forward_backward = train_step, forward_backward
    sys.argv = ["pretrain_spindle.py", *argv]
    try:
        hooks.pretrain_spindle(backend="megatron")
        chunk = hooks._BUILT[0]
        final = _weights(chunk)
        grad = {(k, n): p.requires_grad for k, _, mod in chunk.module.local_cores()
                for n, p in mod.core.named_parameters()}
        chunk.module.destroy()
    finally:
        mt.train_step, hooks.megatron_forward_backward = originals
        hooks.uninstall()
        hooks._BUILT.clear()
        mt.destroy_global_state()
    return {**seen, "final": final, "requires_grad": grad, "counts": counts}


def _rank(rank: int, world: int, tmp: str) -> dict:
    from megatron.core import dist_checkpointing as dc

    from megatron_spindle import comm
    full = os.path.join(tmp, "full")
    out = {"megatron": _megatron_run(FLAGS + ["--train-iters", "3", "--save", full, "--save-interval", "2"])}
    resume = os.path.join(tmp, "resume")
    if rank == 0:
        shutil.copytree(os.path.join(full, "iter_0000002"), os.path.join(resume, "iter_0000002"))
        with open(os.path.join(resume, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    comm.barrier()
    out["resumed"] = _megatron_run(FLAGS + ["--train-iters", "3", "--load", resume])
    out["loop"] = _loop_run(FLAGS + ["--train-iters", "3"])
    out["keys"] = sorted(dc.load_tensors_metadata(os.path.join(full, "iter_0000002"))) if rank == 0 else None
    return out


def _frozen(key: str) -> bool:
    return key.startswith(FROZEN_PREFIXES)


def test_megatron_pretrain_with_frozen_modules(tmp_path):
    import numpy as np

    results = run_ranks(_rank, 2, str(tmp_path), timeout_s=900)
    r0 = results[0]
    run = r0["megatron"]
    assert run["counts"] == {"train_step": 3, "spindle_forward_backward": 3}, run["counts"]
    for step, (mega, loop) in enumerate(zip(run["losses"], r0["loop"])):
        assert set(mega) == set(loop) and all(abs(mega[k] - loop[k]) <= 1e-6 * abs(loop[k]) for k in mega), step
    assert r0["resumed"]["losses"] == run["losses"][2:], "resuming at iteration 2 changed the losses"
    held_frozen = 0
    for r in results:
        m = r["megatron"]
        for (key, shard, name), w in m["final"].items():
            if _frozen(key):
                held_frozen += 1
                assert np.array_equal(w, m["init"][(key, shard, name)]), (key, name)
                assert not m["requires_grad"][(key, name)] and (key, name) not in m["optimized"]
            else:
                assert m["requires_grad"][(key, name)] and (key, name) in m["optimized"]
    assert held_frozen
    keys = r0["keys"]
    assert any(k.startswith("model/vision.layers.0/") for k in keys)
    optim = [k for k in keys if not k.startswith("model/")]  # Megatron's: optimizer.state.exp_avg.model/<key>/...
    assert not [k for k in optim if "model/vision." in k or "model/text.layers." in k], optim[:5]
    assert any("model/audio.layers.0/" in k for k in optim)  # trained weights keep theirs
