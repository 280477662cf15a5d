"""``--spindle-check-equivalence``: the first step, also run as a single process on rank 0.

Every rank runs one forward and backward pass of the plan on the first batch and syncs gradients (no
optimizer step); rank 0 builds the whole model in one process with the same seed (the reference: fp32, on
the run's device, so the CUDA device under NCCL; for a MIMO provider the user's own ``MimoModel``,
:mod:`...models.mimo_reference`), runs the same batch, and compares every task's loss and
every parameter's gradient (each rank's shard against the same slice of the reference gradient). A bf16 run
is thus measured against full precision. The result is the largest relative difference, per tensor relative
to its largest reference entry. Gradients are cleared afterwards, so training is unchanged.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ... import comm
from ...models.layer_state import shard_spec, shard_tensor
from ...mimo.graph import is_mimo_graph
from ...models.mimo_reference import MimoReference
from ...models.reference import ReferenceModel
from ...runtime.mixed_precision import fp32_grad


def check_first_step(model, graph, batch, seed: int, *, backend: str = "local") -> float:
    """The largest relative difference (see the module doc); ``backend``: the run's layers (the reference's)."""
    batch = {t: batch[t] for t in model.plan.tasks}
    state = model(batch)
    model.backward(state)
    model.finalize_grads()
    losses = model.reduce_losses(state)
    tp_of = {k: m.tp for m in model.plan.metaops for k in m.param_keys if k}
    mine = {}
    for key, shard, mod in model.local_cores():
        for name, p in mod.core.named_parameters():
            g = fp32_grad(p)
            g = torch.zeros_like(p) if g is None else g
            spec = shard_spec(p) if tp_of[key] > 1 else None
            mine[(key, shard, name)] = (g.detach().float().cpu().numpy(), spec)
    gathered = comm.gather_object(mine, dst=0)
    for p in model.unique_parameters():
        p.grad = None
    worst = torch.zeros((), dtype=torch.float64, device=model.device)
    if dist.get_rank() == 0:
        # fp32 reference on the run's device: a bf16 run is measured against full precision
        reference = MimoReference if is_mimo_graph(graph) else ReferenceModel  # a MIMO plan: the user's MimoModel
        same = {} if reference is MimoReference else {"settings": model.options["settings"]}  # the run's init std
        ref = reference(graph, seed=seed, dtype=torch.float32, device=model.device, init=model.init, backend=backend,
                        **same)
        out = ref({t: {k: v.to(model.device) for k, v in streams.items()} for t, streams in batch.items()})
        sum(out.values()).backward()
        ref_loss = {t: v.item() for t, v in out.items()}
        w = max(abs(losses[t] - ref_loss[t]) / max(abs(ref_loss[t]), 1e-12) for t in out)
        grads = {(k, n): torch.zeros_like(p) if p.grad is None else p.grad  # a frozen weight: none
                 for k, n, p in ref.keyed_parameters()}
        for shards in gathered:
            for (key, shard, name), (g, spec) in shards.items():
                full = grads[(key, name)]
                if spec is not None:
                    dim, stride = spec
                    full = shard_tensor(full, dim=dim, stride=stride, rank=shard, size=tp_of[key])
                f = full.float().cpu().numpy()
                w = max(w, float(np.abs(g - f).max()) / max(float(np.abs(f).max()), 1e-6))
        worst.fill_(w)
    comm.broadcast(worst, src=0)
    return float(worst)
