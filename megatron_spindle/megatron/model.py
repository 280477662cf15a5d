"""This rank's Spindle model for a run: the task graph, the plan, the model on its device.

Shared by both trainers (Megatron-LM's ``pretrain`` through :mod:`.hooks`, and :mod:`.trainer`), so a run
builds the same graph and plan either way:

* :func:`graph_for`: the one graph builder. ``--micro-batch-size`` is per rank, as in Megatron: one pass of the
  plan carries ``micro_batch_size x world`` samples of every task (the graph's batch);
* :func:`plan_for`: a loaded plan (checked against the model and world) or one made on rank 0 and broadcast;
* :func:`step_passes`: the passes per optimizer step, the plan's (``plan.passes``), checked against
  ``--global-batch-size``;
* :func:`build_model`: logs the plan, builds this rank's slices in the run's dtype on its device, and runs
  ``--spindle-check-equivalence``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import comm
from ..compat import apply_cpu_patches
from ..log import get_logger
from ..models.data import SyntheticData
from ..planner.workload.analytic import CurvesFile
from ..planner.step.build import plan_system
from ..planner.step.execution import Execution
from ..planner.step.placement import PlacementError
from ..planner.workload.cluster import load_cluster
from ..planner.step.plan import Plan
from ..planner.step.render import gantt, grid, summary
from ..planner.systems.tune_spindle import tune_spindle
from ..planner.systems.tuning import FixedPasses
from ..planner.step.validate import check_plan
from ..runtime.executor import SpindleModel
from .equivalence import check_first_step
from .flags import check_plan_fields, init_of, load_plan, run_graph

log = get_logger(__name__)


def graph_for(args, world: int):
    """The task graph of this run (the model's default batch when ``--micro-batch-size`` is not given;
    ``--spindle-freeze`` applied): :func:`.flags.run_graph`."""
    return run_graph(args, world)


def make_cluster(args, world: int):
    """``(cluster, curves file or None)`` for planning: islands of ``--spindle-gpus-per-node`` (default the
    ranks per node, at most 8), memory from ``--spindle-memory-gib`` or the curves file's device."""
    curves = CurvesFile.load(args.spindle_curves) if args.spindle_curves else None
    per_node = args.spindle_gpus_per_node or min(8, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    mem = args.spindle_memory_gib if args.spindle_memory_gib is not None else (
        curves.device.memory_gib if curves else None)
    return load_cluster(None, num_devices=world, gpus_per_node=per_node, memory_gib=mem), curves


def plan_for(args, graph, world: int, *, passes: int = 1) -> Plan:
    """The plan of this job: loaded (checked against the model and world) or made on rank 0 and broadcast.

    ``passes``: the passes of the plan accumulated per optimizer step (Megatron's number of microbatches);
    the planner chooses among its candidates by ``passes`` x pass + one gradient sync, the step the run takes.
    Where Spindle's plain plan does not fit memory, the tuner (:mod:`..planner.systems.tune_spindle`) adds
    recompute, phases and the distributed optimizer where memory binds, at the run's passes.
    Collective. A planning error on rank 0 is raised on every rank with the same message.
    """
    if args.spindle_plan:
        plan = load_plan(args.spindle_plan)
        check_plan(plan, graph_fingerprint=graph.fingerprint(), world_size=world)
        check_plan_fields(plan, graph, args.spindle_plan)
        return plan
    box = [None]
    if dist.get_rank() == 0:
        try:
            cluster, curves = make_cluster(args, world)
            try:
                p = plan_system("spindle" if args.spindle else "sequential", graph, cluster, curves_file=curves,
                                passes=passes)
            except PlacementError as e:  # memory binds: recompute, phases, ZeRO-1 where they make it fit
                if not args.spindle:
                    raise
                tuned = tune_spindle(FixedPasses(graph, passes), cluster, curves_file=curves,
                                     hints=[Execution(passes=passes)])
                if tuned.plan is None:
                    raise e from None
                log.info(f"spindle: the plain plan does not fit memory ({e}); planned with "
                         f"{tuned.execution.label()} instead")
                p = tuned.plan
            box[0] = p.to_json()
        except ValueError as e:
            box[0] = {"error": str(e)}
    comm.broadcast_object_list(box, src=0)
    if "error" in box[0]:
        raise ValueError(box[0]["error"])
    return Plan.from_json(box[0])


def step_passes(plan: Plan, global_batch: int | None, per_pass: int) -> int:
    """Passes of the plan per optimizer step: ``plan.passes``. ``--global-batch-size`` (samples of every task per
    step; Megatron's ``num_microbatches`` is it over ``per_pass = --micro-batch-size x ranks``), when given, must
    say the same: one line naming the values otherwise."""
    if global_batch is not None and global_batch != plan.passes * per_pass:
        want = plan.passes * per_pass
        raise ValueError(f"--global-batch-size {global_batch} is not the plan's {plan.passes} pass"
                         f"{'es' if plan.passes > 1 else ''} per step x {per_pass} samples per pass "
                         f"(--micro-batch-size x ranks) = {want}: give --global-batch-size {want} or a plan made "
                         f"for {global_batch / per_pass:g} passes")
    return plan.passes


def run_device() -> torch.device:
    """Where this rank computes and communicates (:func:`megatron_spindle.comm.comm_device`: its CUDA device
    under NCCL, the CPU under gloo); on the CPU with megatron.core's CPU stand-ins applied."""
    device = comm.comm_device()
    if device.type == "cpu":
        apply_cpu_patches()
    return device


def log_plan(args, plan: Plan, graph, world: int, passes: int | None = None) -> None:
    """Rank 0: what is planned, the wave x device grid, the summary table, and the Gantt picture."""
    what = "wave plan" if getattr(args, "spindle", False) else "sequential (Megatron-style) plan"
    per = f"batch {graph.operators[0].batch} per task per pass" + (f" x {passes} passes" if passes else "")
    log.info(f"spindle: {what} for {graph.model} ({len(graph.tasks)} tasks, {args.spindle_size}) on {world} "
             f"ranks, {per}")
    log.info(grid(plan))
    log.info(summary(plan))
    analytic = [m for m, c in plan.curves if c.source != "measured"]
    if getattr(args, "spindle_curves", None) and analytic:
        log.warning(f"warning: --spindle-curves {args.spindle_curves} has no curve for {len(analytic)} of "
                    f"{len(plan.curves)} MetaOps ({', '.join(analytic[:3])}{', ...' if len(analytic) > 3 else ''}): "
                    f"the analytic model times them")
    if args.spindle_gantt and dist.get_rank() == 0:
        gantt(plan, args.spindle_gantt)
        log.info(f"Gantt chart written to {args.spindle_gantt}")


def build_model(args, plan: Plan, graph, *, layer_graph=None, device=None, first_batch=None) -> SpindleModel:
    """This rank's slices of ``plan`` (collective: creates the per-slice process groups).

    ``layer_graph``: the full model's graph when ``graph`` is a task subset (task-mix changes size shared
    tables from it). With ``--spindle-check-equivalence`` the first step is also run as a single process
    (:func:`.equivalence.check_first_step`) on ``first_batch`` (default: the first synthetic batch).
    """
    device = device or run_device()
    if plan.distributed_optimizer and args.spindle_check_equivalence:
        raise ValueError("--spindle-check-equivalence compares whole gradients, but the plan shards them "
                         "(distributed_optimizer): drop the flag or use a plan without the distributed optimizer")
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float32
    init = init_of(args)
    model = SpindleModel(plan, graph, seed=args.seed, timeout_s=args.spindle_timeout, dtype=dtype, device=device,
                         layer_graph=layer_graph, bucket_size=getattr(args, "ddp_bucket_size", None),
                         grad_reduce_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
                         init=init)
    if init:
        log.info("pretrained weights: " + ", ".join(f"{m} <- {d}" for m, d in init.items())
                 + " (each rank read its own shards)"
                 + (f"; not in the checkpoint, kept initialised: {', '.join(model.kept_init)}" if model.kept_init else ""))
    if args.spindle_check_equivalence:
        full = layer_graph or graph
        if first_batch is None:
            first_batch = SyntheticData(full, seed=args.seed).batch(0)
        diff = check_first_step(model, full, first_batch, args.seed)
        log.info(f"equivalence: max relative difference {diff:.3e}")
    return model
