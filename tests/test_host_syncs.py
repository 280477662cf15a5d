"""The host waits for the device a small, fixed number of times per training step, whatever the tasks, passes
and slices (``runtime/host_sync.py`` counts them; the run's final JSON line reports ``host_syncs_per_step``).

On these CPU ranks the count is the values this package's code reads from tensors per iteration (what makes
a GPU's host wait; a GPU run counts every synchronizing CUDA call through torch's sync debug mode instead,
``scripts/gpu_check.sh``). The built-in trainer on 2 gloo ranks, at 4 tasks with 1 pass per step and at 7
tasks with 2 passes (more slices, more messages): every iteration waits exactly ``SYNCS`` times, for the
gradient norm, the losses (every task's in one all-reduce) and the stop agreement.
"""
from __future__ import annotations

from mp_harness import run_ranks

SYNCS = 3
CASES = (("4 tasks, 1 pass", ["--spindle-tasks", "4", "--micro-batch-size", "4"]),
         ("7 tasks, 2 passes", ["--spindle-tasks", "7", "--micro-batch-size", "4", "--global-batch-size", "16"]))


def _train(rank, world):
    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.trainer.loop import Trainer

    out = {}
    for name, extra in CASES:
        args = build_parser().parse_args(["--spindle", "--spindle-size", "tiny", "--train-iters", "3", "--lr", "1e-3",
                                          "--log-interval", "10", "--spindle-predict-interval", "0", *extra])
        trainer = Trainer(args)
        try:
            summary = trainer.train()
            out[name] = {"summary": summary["host_syncs_per_step"], "per_step": trainer.syncs.per_step,
                         "sites": sorted(trainer.syncs.sites), "passes": trainer.accum,
                         "slices": len(trainer.plan.rank_slices(rank))}
        finally:
            trainer.close()
    return out


def test_host_syncs_per_step_are_a_constant():
    for rank, out in enumerate(run_ranks(_train, 2, timeout_s=400)):
        small, large = (out[name] for name, _ in CASES)
        assert large["passes"] == 2 and small["passes"] == 1 and large["slices"] > small["slices"], out
        for name, got in out.items():
            assert got["per_step"] == [SYNCS] * 3 and got["summary"] == SYNCS, (rank, name, got)
        assert small["sites"] == large["sites"], (rank, small["sites"], large["sites"])
