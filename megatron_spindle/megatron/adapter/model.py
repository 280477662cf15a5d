"""This rank's Spindle model for a run: the task graph, the plan, the model on its device.

Shared by both trainers (Megatron-LM's ``pretrain`` through :mod:`.hooks`, and :mod:`..trainer.loop`), so a run
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

import dataclasses

import torch
import torch.distributed as dist

from ... import comm
from ...compat.cpu import apply_cpu_patches
from ...log import get_logger
from ...models.blocks import LayerSettings
from ...models.data import SyntheticData
from ...planner.workload.analytic import CurvesFile
from ...planner.step.build import plan_system
from ...planner.assembly.execution import Execution
from ...planner.assembly.placement import PlacementError
from ...planner.workload.cluster import load_cluster
from ...planner.assembly.plan import Plan
from ...planner.assembly.render import gantt, grid, summary
from ...planner.tuning.tune_spindle import tune_spindle
from ...planner.tuning.tune import FixedPasses
from ...planner.assembly.validate import check_plan
from ...planner.workload.metaops import tp_divides
from ...planner.workload.recompute import options as recompute_options
from ...runtime.executor import SpindleModel
from .equivalence import check_first_step
from ..job.input_files import check_plan_fields, check_plan_passes, init_of, load_plan
from .flag_contract import Constraints
from .flags import run_graph
from ..job.gpu_node import node_cluster

log = get_logger(__name__)


def graph_for(args, world: int):
    """The task graph of this run (the model's default batch when ``--micro-batch-size`` is not given;
    ``--spindle-freeze`` applied): :func:`.flags.run_graph`."""
    return run_graph(args, world)


def make_cluster(args, world: int, *, say: bool = False):
    """``(cluster, curves file or None)`` for planning, from the node this runs on (:func:`..job.gpu_node.node_cluster`):
    ``--spindle-cluster`` or the GPU's preset, islands of ``--spindle-gpus-per-node`` or the node's NVLink island
    (at most the ranks per node), memory from ``--spindle-memory-gib``, the device, or the curves file's device."""
    curves = CurvesFile.load(args.spindle_curves) if args.spindle_curves else None
    node = node_cluster(args, world)
    mem = node.memory_gib if node.memory_gib is not None else (curves.device.memory_gib if curves else None)
    cluster = load_cluster(node.preset, num_devices=world, gpus_per_node=node.gpus_per_node, memory_gib=mem)
    if not comm.is_nccl():  # gloo ranks: no NCCL communicator buffers on a device to charge
        cluster = dataclasses.replace(cluster, communicator_mib=0.0)
    if say:  # the plan's log: what the planner was told about the node, and from where
        log.info(f"spindle: cluster {cluster.name}, {cluster.memory_gib:.1f} GiB per device, islands of "
                 f"{cluster.gpus_per_node} devices" + (f" ({node.source})" if node.source else ""))
    return cluster, curves


def plan_for(args, graph, world: int, *, passes: int = 1) -> Plan:
    """The plan of this job: loaded (checked against the model and world) or made on rank 0 and broadcast.

    ``passes``: the passes of the plan accumulated per optimizer step (Megatron's number of microbatches);
    the planner chooses among its candidates by ``passes`` x pass + one gradient sync, the step the run takes.
    Where Spindle's plain plan does not fit memory, the tuner (:mod:`...planner.tuning.tune_spindle`) adds
    recompute, phases and the distributed optimizer where memory binds, at the run's passes.
    The mapped Megatron flags (:class:`.flag_contract.Constraints`: ``--tensor-model-parallel-size``,
    ``--recompute-granularity``, ``--use-distributed-optimizer``) are the planner's ``Execution``, without the
    tuner's fallback; a loaded plan must keep them (:func:`check_constraints`).
    Collective. A planning error on rank 0 is raised on every rank with the same message.
    """
    limits = Constraints.of(args)  # the mapped Megatron flags (--tensor-model-parallel-size, ...): the plan keeps them
    if args.spindle_plan:
        plan = load_plan(args.spindle_plan)
        check_plan(plan, graph_fingerprint=graph.fingerprint(), world_size=world)
        check_plan_fields(plan, graph, args.spindle_plan)
        check_constraints(plan, limits, args.spindle_plan)
        return plan
    execution = Execution(passes=passes, tp=limits.tp, distributed_optimizer=limits.distributed_optimizer,
                          recompute=limits.recompute)
    box = [None]
    if dist.get_rank() == 0:
        try:
            cluster, curves = make_cluster(args, world, say=True)
            try:
                p = plan_system("spindle" if args.spindle else "sequential", graph, cluster, curves_file=curves,
                                execution=execution)
            except PlacementError as e:  # memory binds: recompute, phases, ZeRO-1 where they make it fit
                if not args.spindle or limits.given():  # the user's flags fixed them
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


def check_constraints(plan: Plan, limits: Constraints, path: str) -> None:
    """A loaded plan must keep what the mapped Megatron flags ask (:class:`.flag_contract.Constraints`): one
    ``ValueError`` naming the plan's choice and the flag otherwise."""
    fix = "drop the flag, or drop --spindle-plan to plan with it"
    if limits.distributed_optimizer and not plan.distributed_optimizer:
        raise ValueError(f"--spindle-plan {path} keeps whole optimizer states in every slice, but "
                         f"--use-distributed-optimizer asks for ZeRO-1 in every slice: {fix}")
    for m in plan.metaops:
        if (limits.tp > m.tp and m.tp_splittable and limits.tp <= plan.gpus_per_node and tp_divides(m.layer, limits.tp)
                and m.valid_counts(plan.world_size)):
            raise ValueError(f"--spindle-plan {path} runs MetaOp {m.name} at tensor-parallel {m.tp}, but "
                             f"--tensor-model-parallel-size {limits.tp} asks for at least {limits.tp}: {fix}")
        if limits.recompute != "none" and limits.recompute in recompute_options(m) and m.recompute != limits.recompute:
            raise ValueError(f"--spindle-plan {path} runs MetaOp {m.name} with recompute {m.recompute}, but "
                             f"--recompute-granularity {limits.recompute} asks for {limits.recompute}: {fix}")


def step_passes(plan: Plan, global_batch: int | None, per_pass: int) -> int:
    """Passes of the plan per optimizer step: ``plan.passes``. ``--global-batch-size`` (samples of every task per
    step; Megatron's ``num_microbatches`` is it over ``per_pass = --micro-batch-size x ranks``), when given, must
    say the same: one line naming the values otherwise."""
    return check_plan_passes(plan.passes, global_batch, per_pass)


def layer_backend(args) -> str:
    """The layers' implementation by Megatron-LM's ``--transformer-impl`` (``args.transformer_impl``): ``"local"``
    (megatron.core's modules) or ``"te"`` (TransformerEngine's), never by whether TransformerEngine imports.
    ``transformer_engine`` where it cannot run is a ``ValueError`` naming the flag (one line, exit status 2)."""
    impl = getattr(args, "transformer_impl", None) or "local"
    if impl == "local":
        return "local"
    if impl != "transformer_engine":
        raise ValueError(f"--transformer-impl {impl}: Spindle builds its layers with local or transformer_engine")
    try:
        import transformer_engine.pytorch  # noqa: F401  # optional: TransformerEngine, asked for by the flag
    except Exception as e:  # noqa: BLE001 - missing, or built against another torch or CUDA
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(f"--transformer-impl transformer_engine: TransformerEngine does not import here ({why}); "
                         f"install it or use --transformer-impl local") from None
    if not torch.cuda.is_available():
        raise ValueError("--transformer-impl transformer_engine needs a CUDA device (TransformerEngine's layers run "
                         "on GPUs only); use --transformer-impl local here")
    return "te"


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
    limits = Constraints.of(args)
    if limits.given():
        log.info(f"spindle: the plan keeps {limits.flags()} (Megatron's flags as constraints: docs/megatron.md)")
    if not getattr(args, "spindle_data", None):
        log.info("spindle: training on synthetic data (seeded random samples of every task's shapes); "
                 "--spindle-data DIR trains on one megatron-energon dataset per task")
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
    settings = LayerSettings.from_args(args)  # Megatron's --init-method-std, --hidden-dropout, --attention-dropout
    if settings.dropout and args.spindle_check_equivalence:
        raise ValueError(f"--spindle-check-equivalence compares one step with the single-process reference, which "
                         f"draws other dropout masks: use --hidden-dropout 0 --attention-dropout 0 with it (given "
                         f"{settings.hidden_dropout:g} and {settings.attention_dropout:g})")
    bf16 = bool(getattr(args, "bf16", False))
    dtype = torch.bfloat16 if bf16 else torch.float32
    init = init_of(args)
    backend = layer_backend(args)
    # fp32 gradient buffers and reductions under --bf16, as Megatron-LM forces (accumulate_allreduce_grads_in_fp32)
    fp32_grads = bf16 or bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False))
    model = SpindleModel(plan, graph, seed=args.seed, timeout_s=args.spindle_timeout, dtype=dtype, device=device,
                         backend=backend, layer_graph=layer_graph, bucket_size=getattr(args, "ddp_bucket_size", None),
                         grad_reduce_in_fp32=fp32_grads, init=init, settings=settings)
    if init:
        log.info("pretrained weights: " + ", ".join(f"{m} <- {d}" for m, d in init.items())
                 + " (each rank read its own shards)"
                 + (f"; not in the checkpoint, kept initialised: {', '.join(model.kept_init)}" if model.kept_init else ""))
    if args.spindle_check_equivalence:
        full = layer_graph or graph
        if first_batch is None:
            first_batch = SyntheticData(full, seed=args.seed).batch(0)
        diff = check_first_step(model, full, first_batch, args.seed, backend=backend)
        log.info(f"equivalence: max relative difference {diff:.3e}")
    return model
