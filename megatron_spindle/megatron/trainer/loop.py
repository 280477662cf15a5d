"""The built-in trainer: Megatron's training loop on megatron.core, for machines where ``pretrain`` can't run.

Megatron-LM's own loop asserts CUDA; where it cannot run (no GPU, or ``megatron.training`` absent),
:class:`Trainer` does what ``pretrain`` does with our hooks, with the same pieces (:mod:`..adapter.model` for graph,
plan and model, :mod:`..adapter.schedule` for the forward-backward contract, :mod:`..checkpoint.save_load`): build everything in
``__init__`` (``torch.distributed``, the plan, this rank's slices, AdamW under megatron.core's learning-rate
schedule, a resumed checkpoint), then :meth:`Trainer.train_step` per iteration (accumulated passes,
group-wise gradient sync, global-norm clip, optimizer step) and :meth:`Trainer.train` around it (task-mix
changes, progress lines, predictions, validation (:mod:`.evaluate`), checkpoints, the trace). The optimizer and
its schedule are Megatron-LM's, from its flags (:mod:`.optim`). Without ``--spindle`` the plan is the
``sequential`` baseline: every task over all ranks, one after another, as Megatron runs multi-task models.

Rank 0 logs the plan grid, a progress line per ``--log-interval`` (iteration, loss per task, step time,
samples/s, model TFLOP/s per GPU and MFU against the planning cluster's peak, as Megatron-LM users read them;
recompute not counted), every ``--spindle-predict-interval`` iterations the predicted against measured step time, and
ends with one JSON line (``steps``, ``final_loss``, ``step_time_s``, ``host_syncs_per_step`` (the most times
the host waited for the device in one iteration, :mod:`...runtime.host_sync`), ...).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ... import comm
from ...log import get_logger, setup_logging
from ...models.megatron_state import seed_rng
from ...planner.assembly.render import grid
from ...planner.workload.flops import mfu, step_model_flops, tflops_per_device
from ...runtime.host_sync import HostSyncCounter
from ...runtime.replan import replan
from ...runtime.trace import gather_chrome_trace
from ..checkpoint.save_load import load_checkpoint, save_checkpoint
from ..adapter.data import train_batches
from ..adapter.flags import check_args, fallback_args, parse_task_schedule, spindle_args, world_from_env
from ..checkpoint.directory import latest_iteration
from .evaluate import Evaluation
from .guard import NumericGuard
from .optim import make_optimizer, make_scheduler
from ..adapter.train_flags import check_training_values
from ..job.lifeline import LIFE, SAVE_SIGNALS, say_per_node, signal_name
from .logs import TrainLogs
from ..adapter.model import (build_model, graph_for, layer_backend, log_plan, make_cluster, plan_for, run_device,
                    step_passes)
from .prediction import StepCosts, compute_scale, grad_bytes_of, predict_step
from ..job.preflight import check_machine_memory, check_save_space, hold_save_lock
from .session import Stopped, join_job, restart_source, run_entry
from ..adapter.schedule import forward_step, reduce_reports, spindle_forward_backward

log = get_logger(__name__)


def metaop_errors(model, steps, runtime=None, *, passes: int = 1,
                  compute_scale: float = 1.0) -> list[tuple[str, float, float]]:
    """``[(MetaOp, predicted ms, measured ms)]`` per pass, largest error first, for this rank's slices over
    ``steps``.

    Measured: the median over ``steps`` of this rank's forward + backward spans of each MetaOp's slices, over
    the step's ``passes``; predicted: the slices' times in the plan (times ``compute_scale`` for CPU ranks
    sharing cores), with the profile's per-slice costs (``runtime``, a
    :class:`...planner.simulation.runtime_costs.RuntimeCosts`) where it measured them.
    """
    steps = [steps] if isinstance(steps, int) else list(steps)
    times = [model.trace.wave_times(st) for st in steps]
    times = [t for t in times if t] or [{}]
    scale, extra = ((runtime.per_slice_scale, runtime.per_slice_fwd_ms + runtime.per_slice_bwd_ms)
                    if runtime is not None else (1.0, 0.0))
    pred: dict[str, float] = {}
    got: dict[str, list[float]] = {}
    for s in model.plan.rank_slices(model.rank):
        pred[s.metaop] = pred.get(s.metaop, 0.0) + scale * compute_scale * s.time_ms + extra
        per = got.setdefault(s.metaop, [0.0] * len(times))
        for i, t in enumerate(times):
            per[i] += (t.get(f"{s.name} fwd", 0.0) + t.get(f"{s.name} bwd", 0.0)) * 1e3 / passes
    rows = [(m, pred[m], statistics.median(got[m])) for m in pred]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))


class Trainer:
    """One training run of the built-in loop. Build in ``__init__``, then :meth:`train` (or
    :meth:`train_step` per iteration); :meth:`close` frees the process groups."""

    def __init__(self, args, *, extra_json: dict | None = None) -> None:
        self.args = args
        self.extra_json = dict(extra_json or {})
        check_training_values(args)  # Megatron's own checks of its optimizer, schedule and model flags
        check_args(args, world_from_env())  # every rank, before any collective: the same one line everywhere
        layer_backend(args)  # --transformer-impl transformer_engine where TE cannot run: the same line, before joining
        join_job(args)
        self.lock = hold_save_lock(args.save)
        try:
            self._build(args)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def _build(self, args) -> None:
        """Everything after the rendezvous: graph, plan, data, model, optimizer, a resumed checkpoint."""
        self.device = run_device()
        seed_rng(args.seed)  # as Megatron's --seed: the dropout masks follow it
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.graph = graph_for(args, self.world)
        self.schedule = parse_task_schedule(args.spindle_task_schedule, self.graph.tasks, args.train_iters)
        if len(self.schedule) > 1 and args.spindle_plan:
            raise ValueError("--spindle-task-schedule plans each task set itself; it cannot use --spindle-plan")
        if args.bf16 and (args.save or args.load or len(self.schedule) > 1):
            raise ValueError("--bf16 with --save/--load/--spindle-task-schedule needs Megatron-LM's loop (its "
                             "optimizer checkpoints the fp32 master weights); the built-in trainer does not")
        sub = self.graph.subset(self.schedule[0][1]) if len(self.schedule) > 1 else self.graph
        self.micro = self.graph.operators[0].batch
        glob = args.global_batch_size
        if glob is not None and glob % self.micro:
            raise ValueError(f"--global-batch-size {glob} is not a multiple of one pass's batch {self.micro} "
                             f"(--micro-batch-size x {self.world} ranks)")
        LIFE.stage = "planning (rank 0) and sharing the plan; a rank stopped or planning takes long"
        self.plan = plan_for(args, sub, self.world, passes=glob // self.micro if glob else 1)
        self.accum = step_passes(self.plan, glob, self.micro)  # the plan's passes (a loaded plan decides)
        self.glob = self.accum * self.micro  # Megatron's global batch: what its scheduler steps by per iteration
        if getattr(args, "spindle_data", None) and args.eval_iters:
            raise ValueError(f"--eval-iters {args.eval_iters} with --spindle-data: the energon datasets hold a "
                             f"training split only; use --eval-iters 0")
        if self.plan.distributed_optimizer and (args.save or args.load or len(self.schedule) > 1):
            raise ValueError("the plan shards the optimizer state (distributed_optimizer), but the built-in "
                             "trainer's checkpoints and task-mix changes keep it per parameter: drop "
                             "--save/--load/--spindle-task-schedule or use a plan without the distributed optimizer")
        check_machine_memory(self.plan, self.device)  # before any layer is built
        log_plan(args, self.plan, self.graph, self.world, passes=self.accum)
        LIFE.stage = "creating this rank's process groups and layers; a rank stopped"
        self.start = 0
        self.data = train_batches(args, self.graph, self.plan, self.rank)
        self.model = build_model(args, self.plan, sub, layer_graph=self.graph, device=self.device,
                                 first_batch=self.data.peek())
        self.model.trace.max_spans = args.spindle_trace_max_spans
        self.trace_full = 0  # the iteration at which the trace reached its cap (0: not yet)
        self.optimizer = self._optimizer(self.model.optimizer_parameters())  # ZeRO-1: this rank's shards; frozen: none
        self.scheduler = make_scheduler(self.optimizer, args, self.glob)
        LIFE.disarm()  # start-up is done; loading a checkpoint takes what it takes (bounded by --spindle-timeout)
        self.phase = 0
        self.load, attempt = restart_source(args)
        if self.load:
            for j in range(1, self._phase_of(latest_iteration(self.load) or 0) + 1):
                self.change_tasks(self.schedule[j][0])  # the task mixes so far: every module trained is held
            self.start, _, missing = load_checkpoint(self.load, self.model, self.optimizer)
            log.info((f"torchrun restart {attempt}: " if self.load != args.load else "")
                     + f"resumed from {self.load} at iteration {self.start}"
                     + (f"; fresh weights for {', '.join(missing)}" if missing else ""))
            self.scheduler = make_scheduler(self.optimizer, args, self.glob)
            if self.start:
                self.scheduler.step(self.start * self.glob)
        self.data.position = self.start * self.accum
        self.evaluation = Evaluation(self.graph, args.seed, self.plan.tasks, self.accum, args.eval_iters,
                                     consumed=(self.start // args.eval_interval) * args.eval_iters
                                     if args.eval_interval else 0)
        if args.save:
            check_save_space(args.save, self.model, self.optimizer)
        self.guard = NumericGuard(args.spindle_nonfinite_skips)
        self.logs = TrainLogs(args, self.rank, config={"model": self.graph.model, "tasks": list(self.graph.tasks),
                                                       "world_size": self.world, "system": self.plan.system})
        self.step_times: list[float] = []
        self.syncs = HostSyncCounter(self.device)  # the host's waits for the device, per iteration
        self.last: dict[str, float] = {}
        self._prediction = None  # (cluster, compute scale, step costs) of the prediction line

    def _optimizer(self, params):
        return make_optimizer(params, self.args, flat=self.plan.distributed_optimizer)

    def _phase_of(self, it: int) -> int:
        return max(i for i, (s0, _) in enumerate(self.schedule) if s0 <= it)

    def change_tasks(self, it: int) -> None:
        """The task mix changes at iteration ``it``: replan without restarting, keep weights and moments."""
        self.phase = self._phase_of(it)
        sub = self.graph.subset(self.schedule[self.phase][1])
        self.plan = plan_for(self.args, sub, self.world, passes=self.accum)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.model, self.optimizer = replan(self.model, self.optimizer, self.plan, sub, layer_graph=self.graph,
                                            seed=self.args.seed,
                                            make_optimizer=self._optimizer)
        self.model.trace.max_spans = self.args.spindle_trace_max_spans
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.scheduler = make_scheduler(self.optimizer, self.args, self.glob)
        if it:
            self.scheduler.step(it * self.glob)
        self.data.tasks = self.plan.tasks
        if hasattr(self, "evaluation"):  # built after a resume's replans, from the plan they leave
            self.evaluation.valid.tasks = self.evaluation.test.tasks = self.plan.tasks
        self._prediction = None  # this rank's parameters changed
        log.info(f"iteration {it}: tasks now {', '.join(self.plan.tasks)}; replanned ({len(self.plan.waves)} "
                 f"waves), weights and optimizer state kept")
        log.info(grid(self.plan))

    def train_step(self, it: int) -> tuple[dict[str, float], float, float]:
        """One optimizer step (``accum`` passes of the plan): ``(task losses, grad norm, seconds)``."""
        model = self.model
        model.trace.step = it
        t0, m0 = time.perf_counter(), model.trace.now()  # marks: CUDA events on a GPU (runtime/trace.py)
        reports = spindle_forward_backward(forward_step_func=forward_step, data_iterator=self.data, model=[model],
                                           num_microbatches=self.accum, seq_length=None, micro_batch_size=self.micro)
        m_end = model.trace.now()
        norm = model.clip_grads(self.args.clip_grad)
        losses = reduce_reports(reports)  # the step's one wait for the losses: the marks so far are complete
        model.trace.span("step end", "gradient norm + loss all-reduce", m_end)
        m_opt = model.trace.now()
        if self.guard.check(it, losses, norm, model):  # a non-finite loss or norm never reaches the optimizer
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step(self.glob)  # Megatron's increment: the iteration's samples
        model.trace.span("optimizer", "optimizer step", m_opt)
        dt = time.perf_counter() - t0
        model.trace.span("step", "step", m0)
        model.trace.resolve()  # what the device has passed, without waiting (the rest with the next step)
        return losses, norm, dt

    def _log_progress(self, it: int, losses: dict[str, float], norm: float, dt: float) -> None:
        per = " ".join(f"{t} {v:.4f}" for t, v in losses.items())
        samples = self.accum * self.micro * len(self.plan.tasks)
        flops, peak = self._model_flops()
        tf = tflops_per_device(flops, dt * 1e3, self.world)
        # MFU only where the peak is the device's: CPU ranks have no GPU peak to be a fraction of
        util = f"MFU {mfu(flops, dt * 1e3, self.world, peak):.2%} of {peak:g} | " if self.device.type == "cuda" else ""
        log.info(f"iteration {it + 1:5d}/{self.args.train_iters} | loss {sum(losses.values()):.4f} ({per}) | "
                 f"step {dt:.3f} s | {samples / dt:8.1f} samples/s | {tf:.3g} TFLOP/s per GPU | {util}"
                 f"grad norm {norm:.3f} | lr {self.optimizer.param_groups[0]['lr']:.2e}")

    def _model_flops(self) -> tuple[float, float]:
        """(model FLOPs of one step of the current task set, peak TFLOP/s per device of the planning cluster)."""
        key = (tuple(self.plan.tasks), self.accum)
        if getattr(self, "_flops_key", None) != key:
            tasks = list(self.plan.tasks)
            g = self.graph if list(self.graph.tasks) == tasks else self.graph.subset(tasks)
            cluster, curves = make_cluster(self.args, self.world)
            self._flops_key = key
            self._flops = (step_model_flops(g, self.accum),
                           curves.device.peak_tflops if curves is not None else cluster.peak_tflops)
        return self._flops

    def _log_prediction(self, it: int) -> None:
        src = {c.source for _, c in self.plan.curves}
        note = "" if src == {"measured"} else " [analytic curves: run `spindle profile` and pass --spindle-curves]"
        since = max(self.start + 1, it + 1 - self.args.spindle_predict_interval)  # the run's first step warms up
        runtime, scale = None, 1.0
        try:
            if self._prediction is None:  # read the curves file once, not every prediction line
                self._prediction = self._prediction_setup()
            cluster, scale, costs = self._prediction
            runtime = costs.runtime
            pred = predict_step(self.plan, cluster, self.model.trace, range(min(since, it), it + 1), self.rank,
                                passes=self.accum,
                                grad_bytes=grad_bytes_of(self.args), compute_scale=scale, costs=costs)
            whole = pred.format()
            self.logs.prediction(it + 1, pred.predicted_ms, pred.measured_ms)
        except ValueError as e:  # e.g. a --spindle-plan made for other islands: say so, keep training
            whole = f"no step prediction ({' '.join(str(e).split())})"
        rows = metaop_errors(self.model, range(min(since, it), it + 1), runtime, passes=self.accum,
                             compute_scale=scale)
        worst = ", ".join(f"{m} {p:.1f}/{q:.1f} ms" for m, p, q in rows[:3])
        log.info(f"prediction | rank {self.rank}: {whole} | largest MetaOp errors (predicted/measured "
                 f"ms per pass, this rank): {worst}{note}")

    def _prediction_setup(self):
        """The prediction line's cluster, compute scale and step costs (see :mod:`.prediction`).

        A curves file from ``spindle profile`` on this backend, with at least as many processes as the run has
        ranks, carries the link it measured (latency, bandwidth): the prediction uses it instead of the preset's
        (a profile of one node says nothing about the links between nodes, so a larger run keeps the preset's).
        CPU ranks sharing cores: the compute scale is the run's ranks per core. The runtime's own costs the
        profile measured (``measured.runtime``) count under the same condition as its link.
        """
        cluster, curves = make_cluster(self.args, self.world)
        measured = curves.measured if curves is not None else {}
        backend = dist.get_backend()
        if (curves is not None and curves.cluster and measured.get("backend") == backend
                and self.world <= int(measured.get("nproc", 0))):
            link = {k: curves.cluster[k] for k in ("intra_bandwidth_gbps", "inter_bandwidth_gbps",
                                                   "intra_latency_us", "inter_latency_us", "allreduce_latency_us")
                    if k in curves.cluster}
            cluster = dataclasses.replace(cluster, **link)
        scale = 1.0
        if self.device.type == "cpu":
            scale = compute_scale(int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), os.cpu_count() or 1)
        params = self.model.optimizer_parameters()
        costs = StepCosts.from_measured(measured if measured.get("backend") == backend else None,
                                        tensors=len(params), elements=sum(p.numel() for p in params))
        if self.world > int(measured.get("nproc", 0)):  # its collectives were timed over fewer ranks, as the link
            costs = dataclasses.replace(costs, runtime=None)
        return cluster, scale, costs

    def last_checkpoint(self) -> str:
        """Where the run stands on disk, for a stop line."""
        save = self.args.save
        it = latest_iteration(save) if save else None
        if it is not None:
            return f"last checkpoint: {save} at iteration {it} (resume with --load {save})"
        if save:
            return f"no checkpoint in {save} yet"
        return "nothing saved (no --save)"

    def agreed_stop(self) -> int:
        """Collective: the stop signal any rank received (0: none), so every rank stops after the same step."""
        flag = torch.full((1,), float(LIFE.pending()), dtype=torch.float64, device=comm.comm_device())
        return int(comm.all_reduce(flag, op=comm.ReduceOp.MAX).item())  # made on the device: one read

    def stop(self, sig: int, it: int, saved: bool) -> None:
        """After iteration ``it`` every rank agreed to stop on ``sig``: with ``--exit-signal-handler`` and
        SIGTERM or SIGHUP, save (unless just saved) and return (exit 0); otherwise one line and :class:`Stopped`."""
        args = self.args
        if sig in SAVE_SIGNALS and args.exit_signal_handler:
            LIFE.phase = "finishing"
            if args.save and not saved:
                save_checkpoint(args.save, it + 1, self.model, self.optimizer)
            where = f"saved checkpoint {args.save} at iteration {it + 1}" if args.save else "nothing saved (no --save)"
            log.info(f"{signal_name(sig)}: finished iteration {it + 1} of {args.train_iters} and {where}; exiting "
                     f"(--exit-signal-handler)")
            return
        say_per_node(f"stopped by {signal_name(sig)} after iteration {it + 1} of {args.train_iters}; "
                     f"{self.last_checkpoint()}")  # each node's output says it
        raise Stopped(sig)

    def train(self) -> dict:
        """Run to ``--train-iters`` (or ``--exit-interval``, or a signal); returns the summary rank 0 also logs
        as JSON."""
        args = self.args
        LIFE.training()
        here = [self.start]
        LIFE.describe = lambda: f"at iteration {here[0]}; {self.last_checkpoint()}"
        for it in range(self.start, args.train_iters):
            if self._phase_of(it) != self.phase:
                self.change_tasks(it)
            with comm.during(f"iteration {it + 1}"), self.syncs.counting():
                losses, norm, dt = self.train_step(it)
            here[0] = it + 1
            self.step_times.append(dt)
            self.last = losses
            self.logs.step(it + 1, losses=losses, grad_norm=norm, lr=self.optimizer.param_groups[0]["lr"],
                           batch_size=self.accum * self.micro * len(self.plan.tasks), step_s=dt)
            if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters:
                self._log_progress(it, losses, norm, dt)
            if not self.trace_full and len(self.model.trace) >= self.model.trace.max_spans:
                self.trace_full = it + 1
                log.warning(f"warning: the step trace reached its cap of {self.model.trace.max_spans} spans at "
                            f"iteration {it + 1}: later iterations are not traced (the trace file ends there, no "
                            f"more prediction lines); raise the cap with --spindle-trace-max-spans")
            if args.spindle_predict_interval and (it + 1) % args.spindle_predict_interval == 0 and not self.trace_full:
                self._log_prediction(it)
            if args.eval_iters and args.eval_interval and (it + 1) % args.eval_interval == 0:
                with comm.during(f"iteration {it + 1}: evaluating"):
                    self.evaluation.log(self.model, f"iteration {it + 1}")
            stop = bool(args.exit_interval) and (it + 1) % args.exit_interval == 0 and it + 1 < args.train_iters
            saved = bool(args.save) and ((args.save_interval and (it + 1) % args.save_interval == 0) or stop
                                         or it + 1 == args.train_iters)
            if saved:
                with comm.during(f"iteration {it + 1}: saving checkpoint {args.save}"):
                    save_checkpoint(args.save, it + 1, self.model, self.optimizer)
                log.info(f"saved checkpoint {args.save} at iteration {it + 1}")
            with comm.during(f"after iteration {it + 1}"), self.syncs.counting():
                sig = self.agreed_stop()
            self.syncs.end_step()
            if sig:
                self.stop(sig, it, saved)
                break
            if stop:
                log.info(f"exiting at iteration {it + 1} (--exit-interval {args.exit_interval})")
                break
        if args.eval_iters and here[0] == args.train_iters:  # Megatron's end of training (not after an exit):
            with comm.during("evaluating after training"):  # the validation, then the test set
                for test in (False, True):
                    self.evaluation.log(self.model, f"iteration {here[0]} on {'test' if test else 'validation'} set",
                                        test=test)
        if args.spindle_trace:
            try:
                path = gather_chrome_trace(self.model.trace, args.spindle_trace)
            except ValueError as e:  # rank 0 could not write it (a full disk...): the training is done all the same
                path = None
                log.warning(f"warning: --spindle-trace {args.spindle_trace}: {' '.join(str(e).split())}; no trace "
                            f"written, training finished")
            if path:
                log.info(f"Chrome trace of every rank written to {path}")
        return self.summary()

    def summary(self) -> dict:
        steady = self.step_times[1:] or self.step_times
        per_step = self.accum * self.micro * len(self.plan.tasks)
        result = {"steps": len(self.step_times), "final_loss": sum(self.last.values()) if self.last else None,
                  "task_losses": self.last, "step_time_s": statistics.median(steady) if steady else None,
                  "samples_per_s": (per_step / statistics.median(steady)) if steady else None,
                  "world_size": self.world, "system": self.plan.system, "waves": len(self.plan.waves),
                  "host_syncs_per_step": self.syncs.most(), **self.extra_json}
        log.info(json.dumps(result))
        return result

    def close(self) -> None:
        self.logs.close()
        self.model.destroy()
        if self.lock is not None:
            self.lock.release()


def pretrain(args, *, extra_json: dict | None = None) -> dict:
    """Train per ``args`` (:func:`..adapter.flags.build_parser`); returns the final summary."""
    trainer = Trainer(args, extra_json=extra_json)
    try:
        return trainer.train()
    finally:
        trainer.close()


def main(argv=None, description: str = "") -> int:
    """``python -m megatron_spindle.megatron.trainer.loop``: exit statuses and lines as :func:`run_entry` says."""
    LIFE.start()
    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    plan = spindle_args(argv).spindle_plan
    status = run_entry(lambda: pretrain(fallback_args(argv)[0]), plan)  # the flag contract first, one line
    if status or LIFE.signal:  # a stop on a signal races the launcher's grace period: no interpreter teardown
        LIFE.exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
