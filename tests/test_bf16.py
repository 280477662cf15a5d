"""bf16 the way Megatron does it: bf16 layers take fp32 inputs (cast like ``Float16Module``), losses are fp32,
under ``--bf16`` gradients accumulate and are reduced in fp32 (``main_grad`` buffers in fp32, as Megatron-LM forces
``accumulate_allreduce_grads_in_fp32``; see ``runtime/grad_sync.py``), the optimizer steps fp32 master weights;
a bf16 run tracks an fp32 run.

Stated tolerance (``BF16_LOSS_RTOL``): over 3 steps of the tiny Multitask-CLIP on 2 gloo ranks, every task's
bf16 loss is within 3e-2 relative of the fp32 loss (bf16 keeps 8 significant bits, about 4e-3 per rounding;
measured here: at most 7.0e-3).
"""
from __future__ import annotations

import torch

from mp_harness import run_ranks

BF16_LOSS_RTOL = 3e-2


def test_bf16_layer_takes_fp32_inputs_and_returns_fp32_loss():
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.planner.workload.workloads import build_graph

    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=4)
    batch = SyntheticData(graph, seed=3).batch(0)
    assert any(v.dtype == torch.float32 for streams in batch.values() for v in streams.values())
    ref = ReferenceModel(graph, seed=3, dtype=torch.bfloat16)
    losses = ref(batch)  # fp32 patches into bf16 layers: cast at each layer's input
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values()), losses
    sum(losses.values()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in ref.parameters())
    fp32 = ReferenceModel(graph, seed=3)(batch)
    for t in losses:
        assert abs(float(losses[t]) - float(fp32[t])) <= BF16_LOSS_RTOL * abs(float(fp32[t]))


def _bf16_rank(rank: int, world: int) -> dict:
    from megatron_spindle.megatron.adapter.flags import fallback_args
    from megatron_spindle.megatron.trainer.loop import Trainer, pretrain

    out = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        got, original = [], Trainer.train_step
        dtypes = out.setdefault(f"{name}_dtypes", set())

        def train_step(self, it, _o=original, _g=got, _d=dtypes):
            result = _o(self, it)
            _g.append(result[0])
            for p in self.model.unique_parameters():  # (parameter dtype, gradient buffer dtype) after the sync
                main = getattr(p, "main_grad", None)
                _d.add((str(p.dtype), None if main is None else str(main.dtype)))
            return result

        Trainer.train_step = train_step
        try:
            args, _ = fallback_args(["--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4",
                                             "--micro-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
                                             "--log-interval", "10", *extra])
            pretrain(args)
        finally:
            Trainer.train_step = original
        out[name] = got
    return out


def test_bf16_training_tracks_fp32():
    result = run_ranks(_bf16_rank, 2, timeout_s=300)[0]
    assert len(result["bf16"]) == len(result["fp32"]) == 3
    for step, (b, f) in enumerate(zip(result["bf16"], result["fp32"])):
        for task in f:
            assert abs(b[task] - f[task]) <= BF16_LOSS_RTOL * abs(f[task]), (step, task, b[task], f[task])
    assert result["bf16"] != result["fp32"]  # it really ran in bf16
    # --bf16: bf16 weights, fp32 gradient buffers (accumulated and all-reduced in fp32, as Megatron-LM does)
    assert result["bf16_dtypes"] == {("torch.bfloat16", "torch.float32")}, result["bf16_dtypes"]
    assert result["fp32_dtypes"] == {("torch.float32", "torch.float32")}, result["fp32_dtypes"]


def test_master_weights_optimizer_steps_in_fp32():
    from megatron_spindle.runtime.mixed_precision import MasterWeightsOptimizer

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightsOptimizer([p], lambda ps: torch.optim.SGD(ps, lr=1e-3))
    for _ in range(10):  # 10 steps of 1e-3 below bf16's resolution at 1.0 (2^-7): only fp32 masters see them
        p.grad = torch.ones_like(p)
        p.main_grad = torch.ones(4)
        opt.step()
        opt.zero_grad()
    assert opt.masters[0].dtype == torch.float32
    assert torch.allclose(opt.masters[0], torch.full((4,), 0.99))
    assert p.dtype == torch.bfloat16 and float(p[0]) == float(torch.tensor(0.99).to(torch.bfloat16))
