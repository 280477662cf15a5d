"""The files and outputs a run's ``--spindle*`` flags name, checked before any worker trains (both loops):
pretrained weights, a loaded plan (for this model and world), a curves file (for this model and size), the
cluster the planner will use, energon datasets, the Gantt chart and trace outputs.

Pure (no torch): each check raises one ``ValueError`` line naming the flag and the value.
"""
from __future__ import annotations

import importlib.util
import os

from ...atomic import check_output
from ...data.shards import check_dataset_shards
from ...models.hf_files import check_weight_files
from ...models.hf_mapping import init_targets
from ...planner.assembly.plan import Plan
from ...planner.workload.analytic import CurvesFile
from ...planner.workload.cluster import load_cluster
from ...planner.workload.spec import load_spec


def init_of(args) -> dict[str, str]:
    """Pretrained weights of this run: the spec's ``[model] init`` at ``--spindle-size``, then every
    ``--spindle-init MODULE=DIR`` (a flag wins over the spec for the same module). A MIMO provider's model has
    none: its provider loads what it wants."""
    if getattr(args, "spindle_model_provider", None):
        require(not getattr(args, "spindle_init", None), f"--spindle-init {' '.join(args.spindle_init)}: a MIMO "
              f"provider's model (--spindle-model-provider) loads its own pretrained weights in its provider")
        return {}
    init = load_spec(args.spindle_model).init_for(args.spindle_size)
    for item in getattr(args, "spindle_init", None) or []:
        module, sep, path = item.partition("=")
        if not sep or not module or not path:
            raise ValueError(f"--spindle-init {item!r}: want MODULE=DIR, e.g. vision=hf/clip-vit")
        init[module] = path
    return init


def load_plan(path: str) -> Plan:
    """``--spindle-plan``'s plan; a plan that does not read names the flag and the file."""
    try:
        return Plan.load(path)
    except ValueError as e:
        text = str(e)
        raise ValueError(text if repr(path) in text else f"--spindle-plan {path!r}: {text}") from None


def check_plan_fields(plan: Plan, graph, path: str, world: int | None = None) -> None:
    """A loaded plan must be for this run: its graph (fingerprint) and world size, and then its ``model``,
    ``tasks`` and ``task_weights`` (the fingerprint covers the graph it was made for, not these copies of it,
    which the runtime reads)."""
    if plan.graph_fingerprint != graph.fingerprint():
        raise ValueError(f"--spindle-plan {path!r}: plan was made for model {plan.model!r} with graph "
                         f"{plan.graph_fingerprint}, not for this model's graph {graph.fingerprint()} (different "
                         f"model, task set, sizes or batch): re-plan")
    if world is not None and plan.world_size != world:
        raise ValueError(f"--spindle-plan {path!r}: plan is for {plan.world_size} devices but the job has {world}")
    for field, mine in (("model", graph.model), ("tasks", list(graph.tasks)),
                        ("task_weights", list(graph.task_weights))):
        theirs = getattr(plan, field)
        theirs = theirs if field == "model" else list(theirs)
        if theirs != mine:
            raise ValueError(f"--spindle-plan {path!r}: field {field} is {theirs!r}, this run's model has {mine!r}: "
                             f"re-plan (spindle plan ... --out) instead of editing the plan")


def check_plan_passes(passes: int, global_batch: int | None, per_pass: int) -> int:
    """A plan's ``passes`` per optimizer step against ``--global-batch-size`` (samples of every task per step;
    ``per_pass``: ``--micro-batch-size`` x ranks): one line naming the values where they differ. Returns
    ``passes``."""
    if global_batch is not None and global_batch != passes * per_pass:
        want = passes * per_pass
        raise ValueError(f"--global-batch-size {global_batch} is not the plan's {passes} pass"
                         f"{'es' if passes > 1 else ''} per step x {per_pass} samples per pass "
                         f"(--micro-batch-size x ranks) = {want}: give --global-batch-size {want} or a plan made "
                         f"for {global_batch / per_pass:g} passes")
    return passes


def check_curves_model(curves, path: str, model: str, size: str) -> None:
    """Refuse a profile of another model or size: its times would plan this one (a file without a
    ``measured`` record, written by hand, is taken as it is)."""
    got_model, got_size = curves.measured.get("model"), curves.measured.get("size")
    if got_model is not None and (got_model != model or (got_size is not None and got_size != size)):
        raise ValueError(f"--spindle-curves {path!r} was profiled for model {got_model!r} at size {got_size!r}, this "
                         f"run trains {model!r} at size {size!r}: profile this model (spindle profile --model ... "
                         f"--size ...) or leave --spindle-curves out")


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def check_spindle_inputs(args, world: int, graph) -> None:
    """The ``--spindle*`` files and outputs (both loops): curves, cluster, pretrained weights, plan, data, Gantt,
    trace."""
    need = require
    curves = CurvesFile.load(args.spindle_curves) if args.spindle_curves else None
    if curves is not None:
        check_curves_model(curves, args.spindle_curves, graph.model, args.spindle_size)
    per_node = args.spindle_gpus_per_node or min(8, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    spec = getattr(args, "spindle_cluster", None)
    try:
        load_cluster(spec, num_devices=world, gpus_per_node=per_node,
                     memory_gib=args.spindle_memory_gib if args.spindle_memory_gib is not None else
                     (curves.device.memory_gib if curves else None))
    except ValueError as e:
        raise ValueError(f"--spindle-cluster {spec}: {e}" if spec else str(e)) from None
    init = init_of(args)
    if init:
        init_targets(graph, init)  # names, directories, config.json against the spec; shapes when loading
        for module, path in sorted(init.items()):
            try:
                check_weight_files(path)  # truncated files, an index naming a missing shard
            except ValueError as e:
                raise ValueError(f"pretrained weights of {module} ({path}): {e}") from None
    if args.spindle_plan:
        plan = load_plan(args.spindle_plan)
        check_plan_fields(plan, graph, args.spindle_plan, world)
        check_plan_passes(plan.passes, getattr(args, "global_batch_size", None), graph.operators[0].batch)
    if getattr(args, "spindle_data", None):
        need(os.path.isdir(args.spindle_data), f"--spindle-data {args.spindle_data!r} is not a directory")
        missing = [t for t in graph.tasks if not os.path.isdir(os.path.join(args.spindle_data, t, ".nv-meta"))]
        need(not missing, f"--spindle-data {args.spindle_data}: no energon dataset for task(s) {', '.join(missing)} "
                          f"(expected {os.path.join(args.spindle_data, missing[0]) if missing else ''} prepared with "
                          f"`energon prepare`)")
        for task in graph.tasks:
            check_dataset_shards(args.spindle_data, task, max(op.batch for op in graph.operators if op.task == task))
    if args.spindle_gantt:
        check_output(args.spindle_gantt, "--spindle-gantt")
        need(importlib.util.find_spec("matplotlib") is not None,
             "--spindle-gantt needs matplotlib, which is not installed here (pip install matplotlib)")
    if args.spindle_trace:
        check_output(os.path.join(args.spindle_trace, "trace.json"), "--spindle-trace")
