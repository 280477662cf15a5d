"""A small Megatron-style training loop on megatron.core, driven by the same hooks as the Megatron adapter.

Megatron-LM's own loop asserts CUDA; where it cannot run (no GPU, or ``megatron.training`` absent), this
loop does what ``pretrain`` does with our hooks: initialise ``torch.distributed``, plan (rank 0, then
broadcast) or load a plan, build this rank's slices, and for every iteration run
:func:`~megatron_spindle.megatron.schedule.spindle_forward_backward` (accumulated passes, group-wise
gradient sync), clip the global gradient norm, step AdamW under megatron.core's learning-rate schedule,
log on rank 0, and checkpoint. Without ``--spindle`` the plan is the ``sequential`` baseline: every task
over all ranks, one after another, as Megatron runs multi-task models today.

Rank 0 prints the plan grid, a progress line per ``--log-interval`` (iteration, loss per task, step time,
samples/s), every ``--spindle-predict-interval`` iterations the predicted against measured step time, and
ends with one JSON line (``steps``, ``final_loss``, ``step_time_s``, ...).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist


def log0(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def init_distributed(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # a plain `python script.py`: a one-rank job
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        from .preflight import explain_init_error
        raise (explain_init_error(e, timeout_s) or e) from None


def make_graph(args, world: int = 1):
    """The task graph of this run. ``--micro-batch-size`` is per rank, as in Megatron: one pass of the plan
    carries ``micro_batch_size x world`` samples of every task (the plan's batch)."""
    from ..planner.workloads import build_graph
    return build_graph(args.spindle_model, tasks=args.spindle_tasks, size=args.spindle_size,
                       batch=args.micro_batch_size * world if args.micro_batch_size else None)


def make_cluster(args, world: int):
    from ..planner.analytic import CurvesFile
    from ..planner.cluster import load_cluster
    curves = CurvesFile.load(args.spindle_curves) if args.spindle_curves else None
    per_node = args.spindle_gpus_per_node or min(8, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    mem = args.spindle_memory_gib if args.spindle_memory_gib is not None else (
        curves.device.memory_gib if curves else None)
    return load_cluster(None, num_devices=world, gpus_per_node=per_node, memory_gib=mem), curves


def plan_for(args, graph, world: int):
    """The plan of this job: loaded (checked against the model and world) or made on rank 0 and broadcast."""
    from ..planner.baselines import plan_system
    from ..planner.plan import Plan
    from ..planner.validate import check_plan

    if args.spindle_plan:
        plan = Plan.load(args.spindle_plan)
        check_plan(plan, graph_fingerprint=graph.fingerprint(), world_size=world)
        return plan
    box = [None]
    if dist.get_rank() == 0:
        cluster, curves = make_cluster(args, world)
        try:
            p = plan_system("spindle" if args.spindle else "sequential", graph, cluster, curves_file=curves)
            box[0] = p.to_json()
        except ValueError as e:
            box[0] = {"error": str(e)}
    dist.broadcast_object_list(box, src=0)
    if "error" in box[0]:
        raise ValueError(box[0]["error"])
    return Plan.from_json(box[0])


def make_optimizer(model, args):
    return make_optimizer_params(model.unique_parameters(), args)


def make_optimizer_params(params, args):
    return torch.optim.AdamW(params, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             weight_decay=args.weight_decay)


def make_scheduler(optimizer, args):
    """megatron.core's OptimizerParamScheduler over the torch optimizer's parameter groups."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    for g in optimizer.param_groups:
        g.setdefault("max_lr", args.lr)
        g.setdefault("min_lr", args.min_lr)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(args.train_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")


class _Batches:
    """The multi-task data iterator: synthetic, deterministic in (seed, pass index), restricted to the
    plan's tasks. ``position`` is the pass index, so a resumed run sees the same data."""

    def __init__(self, graph, seed: int, tasks: Sequence[str], position: int = 0) -> None:
        from ..models.data import SyntheticData
        self.data = SyntheticData(graph, seed=seed)
        self.tasks = tuple(tasks)
        self.position = position

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.data.batch(self.position)
        self.position += 1
        return {t: batch[t] for t in self.tasks}


def predicted_vs_measured(model, step: int) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(predicted ms, measured ms, [(MetaOp, predicted ms, measured ms)] worst first) for rank 0's view.

    Measured: this rank's forward + backward span of each slice it ran in ``step``; predicted: the slice's
    time in the plan. The step's measured time is the wall time of the step on this rank.
    """
    times = model.trace.wave_times(step)
    per: dict[str, list[float]] = {}
    for s in model.plan.rank_slices(model.rank):
        got = times.get(f"{s.name} fwd", 0.0) + times.get(f"{s.name} bwd", 0.0)
        acc = per.setdefault(s.metaop, [0.0, 0.0])
        acc[0] += s.time_ms
        acc[1] += got * 1e3
    rows = sorted(((m, p, q) for m, (p, q) in per.items()), key=lambda r: -abs(r[2] - r[1]))
    measured = model.trace.totals(step)["step"] * 1e3
    return model.plan.makespan_ms, measured, rows


def pretrain(args, *, extra_json: dict | None = None) -> dict:
    """Train per ``args`` (see :mod:`.args`); returns the final summary (rank 0 also prints it as JSON)."""
    from ..planner.render import gantt, grid, summary
    from ..runtime.cpu_compat import apply_cpu_patches
    from ..runtime.executor import SpindleModel
    from ..runtime.trace import write_chrome_trace
    from .checkpoint import load_checkpoint, save_checkpoint
    from .schedule import forward_step, reduce_reports, spindle_forward_backward

    from .args import check_args, world_from_env
    check_args(args, world_from_env())  # every rank, before any collective: the same one line everywhere
    init_distributed(args.spindle_timeout)
    apply_cpu_patches()
    rank, world = dist.get_rank(), dist.get_world_size()
    graph = make_graph(args, world)
    from .args import parse_task_schedule
    schedule = parse_task_schedule(args.spindle_task_schedule, graph.tasks)
    if len(schedule) > 1 and args.spindle_plan:
        raise ValueError("--spindle-task-schedule plans each task set itself; it cannot use --spindle-plan")
    phase_of = lambda it: max(i for i, (s0, _) in enumerate(schedule) if s0 <= it)  # noqa: E731
    sub = graph.subset(schedule[0][1]) if len(schedule) > 1 else graph
    plan = plan_for(args, sub, world)
    micro = graph.operators[0].batch
    glob = args.global_batch_size or micro
    if glob % micro:
        raise ValueError(f"--global-batch-size {glob} is not a multiple of one pass's batch {micro} "
                         f"(--micro-batch-size x {world} ranks)")
    accum = glob // micro
    log0(f"spindle: {'wave plan' if args.spindle else 'sequential (Megatron-style) plan'} for "
         f"{graph.model} ({len(graph.tasks)} tasks, {args.spindle_size}) on {world} ranks, "
         f"batch {micro} per task per pass x {accum} passes")
    log0(grid(plan))
    log0(summary(plan))
    if rank == 0 and args.spindle_gantt:
        gantt(plan, args.spindle_gantt)
        log0(f"Gantt chart written to {args.spindle_gantt}")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    model = SpindleModel(plan, sub, seed=args.seed, timeout_s=args.spindle_timeout, dtype=dtype, device=device,
                         layer_graph=graph)
    optimizer = make_optimizer(model, args)
    sched = make_scheduler(optimizer, args)
    start = 0
    if args.load:
        start, common, missing = load_checkpoint(args.load, model, optimizer)
        log0(f"resumed from {args.load} at iteration {start}"
             + (f"; fresh weights for {', '.join(missing)}" if missing else ""))
    sched.step(start) if start else None
    if args.save:
        from .preflight import check_save_space
        check_save_space(args.save, model, optimizer)
    from .guard import NumericGuard
    guard = NumericGuard(args.spindle_nonfinite_skips)
    data = _Batches(graph, args.seed, plan.tasks, position=start * accum)
    if args.spindle_check_equivalence:
        from .equivalence import check_first_step
        diff = check_first_step(model, graph, data.data.batch(data.position), args.seed)
        log0(f"equivalence: max relative difference {diff:.3e}")
    step_times, last = [], {}
    phase = phase_of(start)
    if phase and args.load:
        raise ValueError("resuming inside a later phase of --spindle-task-schedule is not supported")
    for it in range(start, args.train_iters):
        if phase_of(it) != phase:  # the task mix changes: replan without restarting
            from ..runtime.replan import replan
            phase = phase_of(it)
            sub = graph.subset(schedule[phase][1])
            plan = plan_for(args, sub, world)
            lrs = [g["lr"] for g in optimizer.param_groups]
            model, optimizer = replan(model, optimizer, plan, sub, layer_graph=graph, seed=args.seed,
                                      make_optimizer=lambda ps: make_optimizer_params(ps, args))
            for g, lr in zip(optimizer.param_groups, lrs):
                g["lr"] = lr
            sched = make_scheduler(optimizer, args)
            sched.step(it) if it else None
            data.tasks = plan.tasks
            log0(f"iteration {it}: tasks now {', '.join(plan.tasks)}; replanned ({len(plan.waves)} waves), "
                 f"weights and optimizer state kept")
            log0(grid(plan))
        model.trace.step = it
        t0 = time.perf_counter()
        reports = spindle_forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                           num_microbatches=accum, seq_length=None, micro_batch_size=micro)
        norm = model.clip_grads(args.clip_grad)
        losses = reduce_reports(reports)
        t_opt = time.perf_counter()
        if guard.check(it, losses, norm, model):  # a non-finite loss or norm never reaches the optimizer
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sched.step(1)
        model.trace.span("optimizer", "optimizer step", t_opt)
        dt = time.perf_counter() - t0
        model.trace.span("step", "step", t0)
        step_times.append(dt)
        last = losses
        if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters:
            per = " ".join(f"{t} {v:.4f}" for t, v in losses.items())
            log0(f"iteration {it + 1:5d}/{args.train_iters} | loss {sum(losses.values()):.4f} ({per}) | "
                 f"step {dt:.3f} s | {accum * micro * len(plan.tasks) / dt:8.1f} samples/s | "
                 f"grad norm {norm:.3f} | lr {optimizer.param_groups[0]['lr']:.2e}")
        if args.spindle_predict_interval and (it + 1) % args.spindle_predict_interval == 0:
            pred, meas, rows = predicted_vs_measured(model, it)
            worst = ", ".join(f"{m} {p:.1f}/{q:.1f} ms" for m, p, q in rows[:3])
            src = {c.source for _, c in plan.curves}
            note = "" if src == {"measured"} else " [analytic curves: run `spindle profile` and pass --spindle-curves]"
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if not torch.cuda.is_available() and local > (os.cpu_count() or 1):
                note += f" [{local} ranks share {os.cpu_count()} cores: compute runs about {local / os.cpu_count():.0f}x slower]"
            log0(f"prediction | step predicted {pred:.1f} ms (compute), measured {meas:.1f} ms on rank {rank} "
                 f"({(meas - pred) / pred:+.0%}) | largest MetaOp errors (predicted/measured, this rank): {worst}{note}")
        stop = bool(args.exit_interval) and (it + 1) % args.exit_interval == 0 and it + 1 < args.train_iters
        if args.save and ((args.save_interval and (it + 1) % args.save_interval == 0) or stop
                          or it + 1 == args.train_iters):
            save_checkpoint(args.save, it + 1, model, optimizer)
            log0(f"saved checkpoint {args.save} at iteration {it + 1}")
        if stop:
            log0(f"exiting at iteration {it + 1} (--exit-interval {args.exit_interval})")
            break
    if args.spindle_trace:
        events = [None] * world
        dist.all_gather_object(events, model.trace.chrome_events())
        if rank == 0:
            path = os.path.join(args.spindle_trace, "trace.json")
            write_chrome_trace(path, [e for ev in events for e in ev])
            log0(f"Chrome trace of every rank written to {path}")
    steady = step_times[1:] or step_times
    result = {"steps": len(step_times), "final_loss": sum(last.values()) if last else None,
              "task_losses": last, "step_time_s": statistics.median(steady) if steady else None,
              "samples_per_s": (accum * micro * len(plan.tasks) / statistics.median(steady)) if steady else None,
              "world_size": world, "system": plan.system, "waves": len(plan.waves), **(extra_json or {})}
    log0(json.dumps(result))
    model.destroy()
    return result


def main(argv=None, description: str = "") -> int:
    from .args import build_parser
    args = build_parser(description).parse_args(argv)
    try:
        pretrain(args)
    except ValueError as e:
        from ..planner.validate import PlanError
        if isinstance(e, PlanError):  # the violated rules, without the grid
            msg = "; ".join(str(v) for v in e.violations[:3])
            print(f"error: invalid plan {args.spindle_plan or ''}: {msg}".replace("  ", " "), file=sys.stderr)
        else:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
