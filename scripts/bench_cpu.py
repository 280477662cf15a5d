"""Measured comparison on this machine: Megatron-style sequential training against the Spindle plan.

One run, ``--nproc`` gloo processes (default: one per core), the same tiny multi-task model, the same data:

1. **profile** (:mod:`megatron_spindle.profiler`) every MetaOp on these processes at 1 … ``nproc`` devices, and
   the gloo link (latency, bandwidth), unless ``--curves FILE`` (a ``spindle profile`` output with its
   ``cluster``) is given;
2. **plan** with those curves on that link: the Spindle plan (:func:`~megatron_spindle.planner.step.build.make_plan`)
   and the ``sequential`` baseline plan, and **predict** both steps with the simulator
   (:func:`~megatron_spindle.planner.simulation.simulate.simulate`: compute from the curves, inter-wave transfers and the
   gradient all-reduces from the measured link);
3. **train** both on the same processes, steps interleaved (A B B A …, so slow drift in other load on the
   machine hits both alike), after ``--warmup`` steps:

   * *sequential*, the way Megatron-LM trains several tasks today, not through the Spindle runtime: the whole
     multi-task model (every rank holds every weight) is wrapped once in megatron.core's
     ``DistributedDataParallel`` over all ranks; each task in turn runs ``forward_backward_no_pipelining``
     (one microbatch, the task's encoders, heads and loss on the rank's ``B / nproc`` samples), gradients
     accumulate over the tasks in DDP's buffers, and ``finalize_model_grads`` all-reduces them once per step
     (as Megatron does for microbatches). The contrastive loss needs every pair, so the task's two pooled
     embeddings are all-gathered (in one collective, with gradient) before it, as CLIP trainers do;
   * *Spindle*: :class:`~megatron_spindle.runtime.executor.SpindleModel` executing the plan (waves, inter-wave
     send/recv, gradient sync over each parameter's device group).

   A step is timed from a common barrier to the last rank's end of gradient sync (forward, backward, sync:
   what the simulator predicts); the optimizer update (SGD, same for both) is timed apart and reported. Medians
   over the timed steps. Both start from the same weights and see the same batches, so their losses must agree
   (reported: largest relative difference over all steps and tasks);
4. the **sequential baseline at its best micro-batch**: it also trains, interleaved with the others, at every
   valid pass count ``P`` (``--sequential-passes``; default every ``P`` whose micro-batch ``batch / P`` splits
   over the processes): ``P`` microbatches per task per step through ``forward_backward_no_pipelining``,
   gradients accumulated, one sync. Each is measured; the fastest is reported and Spindle against it;
5. the **activation memory** of the best sequential run and of the Spindle plan, each as built and with every
   transformer layer recomputing ``selective`` and ``full``: one step measured with
   :class:`~megatron_spindle.runtime.stash.StashMeter` (bytes saved for backward still held when a task's,
   resp. a phase's, forward ends; largest rank), beside the planner's estimate of the same
   (:func:`~megatron_spindle.planner.workload.memory.slice_activation_bytes`, bf16, shown x2 for fp32): for
   the sequential run a task at a time (its forward and backward before the next task's), for the plan its
   largest phase.

Output: a table of measured and predicted step times, the Spindle / sequential ratio measured and predicted,
the prediction error of the Spindle plan, and the measured vs predicted breakdown of the Spindle step. With
``--json`` the last line is one JSON object (``measured_ratio``, ``predicted_ratio``, ``measured_step_s``,
``predicted_step_s``, ``prediction_error`` and more; ratios are Spindle / sequential step time, the error is
``predicted / measured - 1`` of the Spindle step; ``sequential_sweep_step_s``, ``sequential_best_passes``,
``measured_ratio_vs_best_sequential``, ``activation_memory`` for items 4 and 5).

Megatron on CPU: ``DistributedDataParallel``, ``forward_backward_no_pipelining`` and ``finalize_model_grads``
run unchanged on gloo, given (a) :func:`~megatron_spindle.compat.cpu.apply_cpu_patches`
(``torch.cuda.current_device`` -> CPU: DDP allocates its grad buffers there) and (b) :class:`CudaToCpu`, a
``TorchFunctionMode`` that turns ``device="cuda"`` into CPU for tensors megatron creates in Python (the
schedule's token counter). Their gradients equal the single-process reference's (``tests/test_bench_cpu.py``).

Run: ``TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 python scripts/bench_cpu.py [--json]``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_spindle.planner.workload.graph import TaskGraph  # noqa: E402  (pure Python)
from bench_cpu_predict import (best_passes, planned_peak, planned_task_by_task, predict,  # noqa: E402
                               recomputed, sequential_passes)  # (this folder)
from bench_cpu_report import BOUNDARY, MESSAGE_SPAN, format_overlap, format_report, seq_name, summarize  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The Megatron-style baseline (torch + megatron.core)
# --------------------------------------------------------------------------------------------------
def _cuda_to_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        """Rewrite ``device="cuda"`` (or ``cuda:N``) in torch calls made from Python to ``cpu``."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            d = kwargs.get("device")
            if d is not None and torch.device(d).type == "cuda":
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    return CudaToCpu()




def patch_schedule_devices() -> None:
    """On CPU, make megatron's schedules create their token counter on CPU (idempotent).

    ``forward_backward_no_pipelining`` builds ``torch.zeros([], dtype=torch.int, device="cuda")``; the module's
    ``torch`` is replaced by a proxy whose ``zeros`` maps ``device="cuda"`` to CPU and forwards everything else.
    Unlike a ``TorchFunctionMode`` held around the whole step, this costs nothing per tensor operation
    (the mode put 10-20 us of Python on every op of the forward and backward passes).
    """
    import torch
    from megatron.core.pipeline_parallel import schedules

    if torch.cuda.is_available() or isinstance(schedules.torch, _CpuTorch):
        return
    schedules.torch = _CpuTorch(torch)


class _CpuTorch:
    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, **kwargs):
        if kwargs.get("device") is not None and self._torch.device(kwargs["device"]).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return self._torch.zeros(*args, **kwargs)


class MegatronSequential:
    """Every task in turn over all ranks: megatron.core DDP + ``forward_backward_no_pipelining``.

    Only graphs whose losses are contrastive (multitask-clip) are supported: their one loss per task is
    computed on the all-gathered batch on every rank (see the module docstring).
    """

    def __init__(self, graph: TaskGraph, *, seed: int = 0, recompute: str = "none") -> None:
        import torch
        import torch.distributed as dist
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.enums import ModelType
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_spindle import comm
        from megatron_spindle.models.data import parse_data_input
        from megatron_spindle.models.reference import ReferenceModel
        from megatron_spindle.runtime.groups import ProcessGroupRegistry
        from megatron_spindle.compat.cpu import apply_cpu_patches

        bad = sorted({op.op_type for op in graph.operators if op.op_type in ("lm_head",)})
        if bad:
            raise ValueError(f"the Megatron-style baseline supports contrastive losses only, not {bad}")
        apply_cpu_patches()
        patch_schedule_devices()
        self.graph = graph
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp = dist.new_group(list(range(self.world)))
        one = ProcessGroupRegistry({}).one  # every rank, at the same point
        self.pgc = ProcessGroupCollection(tp=one, pp=one, cp=one, tp_cp=one, mp=one, dp=self.dp, dp_cp=self.dp,
                                          intra_dp_cp=self.dp, ep=one, expt_tp=one, expt_dp=one, tp_ep_pp=one,
                                          embd=None, pos_embd=None)
        dp_group, rank, world = self.dp, self.rank, self.world

        class AllGather(torch.autograd.Function):
            """Concatenate every rank's samples; backward sums the gradient over ranks, keeps this rank's rows."""

            @staticmethod
            def forward(ctx, x):
                parts = comm.all_gather(x, group=dp_group)
                ctx.rows = x.shape[0]
                return torch.cat(parts, 0)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                comm.all_reduce(grad, group=dp_group)
                return grad[rank * ctx.rows:(rank + 1) * ctx.rows]

        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   use_cpu_initialization=True)
        ref = ReferenceModel(graph, seed=seed, recompute=recompute)

        class MultiTaskModel(MegatronModule):
            """The whole multi-task model; ``forward(task, batch)`` is one task's loss on local samples."""

            def __init__(self) -> None:
                super().__init__(config=config)
                self.model_type = ModelType.encoder_or_decoder
                self.ref = ref

            def set_input_tensor(self, tensor) -> None:  # no pipeline stages
                pass

            def forward(self, task, batch):
                acts, loss = {}, None
                for op in graph.operators:
                    if op.task != task:
                        continue
                    if op.op_type == "contrastive_loss":  # both embeddings in one all-gather
                        pair = [acts[name] for name in op.inputs]
                        both = AllGather.apply(torch.cat(pair, dim=1))
                        inputs = list(torch.split(both, [x.shape[1] for x in pair], dim=1))
                    else:
                        inputs = [batch[parse_data_input(name)[1]] if name.startswith("data:") else acts[name]
                                  for name in op.inputs]
                    out = self.ref.layer(op.name)(inputs)
                    if op.op_type == "contrastive_loss":
                        loss = out if loss is None else loss + out
                    else:
                        acts[op.name] = out
                return loss

        with _cuda_to_cpu_mode():  # construction only: DDP's buffers
            self.model = DistributedDataParallel(config, DistributedDataParallelConfig(), MultiTaskModel(),
                                                 pg_collection=self.pgc)
        self.params = [p for p in self.model.parameters()]

    def parameters(self):
        return self.params

    def step(self, batch, meter=None) -> dict[str, float]:
        """Forward, backward and gradient sync of every task; ``param.grad`` holds the synced gradient.

        ``batch``: one batch, or a list of ``P`` (one per pass: Megatron's microbatches, ``P`` per task, the
        gradient accumulated over them, each pass's loss divided by ``P`` by Megatron's schedule). ``meter``
        (a :class:`~megatron_spindle.runtime.stash.StashMeter`): what each task's forward keeps for backward
        (taken when the loss exists, before its backward frees it; a "phase" per task).
        """
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

        passes = batch if isinstance(batch, list) else [batch]
        losses = {}
        self.model.zero_grad_buffer()
        for ti, task in enumerate(self.graph.tasks):
            rows = next(iter(passes[0][task].values())).shape[0] // self.world
            local = [{k: v[self.rank * rows:(self.rank + 1) * rows] for k, v in b[task].items()} for b in passes]

            def forward_step(it, model, task=task, ti=ti):
                with meter.slice(task) if meter is not None else contextlib.nullcontext():
                    out = model(task, next(it))

                def loss_func(out):
                    if meter is not None:
                        meter.phase_done(ti)
                    return out, {"loss": out.detach()}
                return out, loss_func

            store = forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=iter(local), model=self.model,
                num_microbatches=len(local), seq_length=0, micro_batch_size=rows, pg_collection=self.pgc)
            losses[task] = sum(r["loss"] for r in store) / len(store)
        finalize_model_grads([self.model], pg_collection=self.pgc)
        for p in self.params:
            p.grad = p.main_grad
        return losses

    def losses_value(self, losses) -> dict[str, float]:
        return {t: float(v) for t, v in losses.items()}


class SpindleRunner:
    """The Spindle runtime on a plan, with the same step interface as :class:`MegatronSequential`."""

    def __init__(self, plan, graph: TaskGraph, *, seed: int = 0, overlap: bool = True) -> None:
        from megatron_spindle.runtime.executor import SpindleModel
        self.model = SpindleModel(plan, graph, seed=seed, timeout_s=300, overlap_grad_reduce=overlap)

    def parameters(self):
        return self.model.unique_parameters()

    def step(self, batch, meter=None):
        if meter is not None:
            self.model.stash = meter
        st = self.model(batch)
        self.model.backward(st)
        self.model.finalize_grads()
        return st

    def losses_value(self, st) -> dict[str, float]:
        return self.model.reduce_losses(st)


# --------------------------------------------------------------------------------------------------
# One process of the benchmark
# --------------------------------------------------------------------------------------------------
def bench_rank(rank: int, world: int, opts: dict) -> dict | None:
    """Profile (unless curves are given), plan, predict, then train both systems; results on rank 0."""
    import torch

    from megatron_spindle import comm
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.profiler.run import ProfileConfig, profile_rank
    from megatron_spindle.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    graph = build_graph(opts["model"], tasks=opts["tasks"], size="tiny", batch=opts["batch"])
    doc = opts.get("curves_doc")
    t0 = time.perf_counter()
    if doc is None:
        doc = profile_rank(ProfileConfig(
            model=opts["model"], tasks=opts["tasks"], size="tiny", batch=opts["batch"], nproc=world,
            max_devices=world, out=opts["curves_out"], cache=opts["cache"], fresh=opts["fresh"],
            repeats=opts["repeats"], min_seconds=opts["min_seconds"], verbose=opts["verbose"]))
    profile_s = time.perf_counter() - t0
    box = [predict(graph, doc, world, opts.get("placement", "spindle")) if rank == 0 else None]
    comm.broadcast_object_list(box, src=0)
    pred = box[0]

    n_steps = opts["warmup"] + opts["steps"]
    # the sequential baseline at every valid pass count P (P microbatches of batch / P per task, one sync)
    graphs = {p: build_graph(opts["model"], tasks=opts["tasks"], size="tiny", batch=opts["batch"] // p)
              for p in opts["sequential_passes"]}
    batches = {}
    for p, g in graphs.items():
        data = SyntheticData(g, seed=opts["seed"])
        batches[seq_name(p)] = [[data.batch(i * p + j) for j in range(p)] for i in range(n_steps)]
    batches["spindle"] = [b[0] for b in batches[seq_name(1)]] if 1 in graphs else \
        [SyntheticData(graph, seed=opts["seed"]).batch(i) for i in range(n_steps)]
    systems = {seq_name(p): MegatronSequential(g, seed=opts["seed"]) for p, g in graphs.items()}
    systems["spindle"] = SpindleRunner(pred["spindle_plan"], graph, seed=opts["seed"], overlap=opts.get("overlap", True))
    if opts.get("waves"):  # the same waves, transfers posted at the consumer's wave boundary
        systems[BOUNDARY] = SpindleRunner(pred["boundary_plan"], graph, seed=opts["seed"],
                                          overlap=opts.get("overlap", True))
        batches[BOUNDARY] = batches["spindle"]
    opt = {k: torch.optim.SGD(list(s.parameters()), lr=opts["lr"]) for k, s in systems.items()}
    times = {k: {"step": [], "optimizer": []} for k in systems}
    losses = {k: [] for k in systems}
    spans = []
    order = list(systems)
    for i in range(n_steps):
        for name in (order if i % 2 == 0 else order[::-1]):
            sysm = systems[name]
            if name in ("spindle", BOUNDARY):
                sysm.model.trace.step = i
            comm.barrier()
            a = time.perf_counter()
            out = sysm.step(batches[name][i])
            b = time.perf_counter()
            opt[name].step()
            opt[name].zero_grad(set_to_none=True)
            c = time.perf_counter()
            if i >= opts["warmup"]:
                times[name]["step"].append(b - a)
                times[name]["optimizer"].append(c - b)
            losses[name].append(sysm.losses_value(out))
    tr = systems["spindle"].model.trace
    waves = []
    for i in range(opts["warmup"], n_steps):
        spans.append(tr.totals(i))
        waves.append(tr.wave_times(i))
    mine = {"times": times, "spans": spans, "waves": waves, "messages": message_spans(tr, opts["warmup"], n_steps)}
    if BOUNDARY in systems:
        bt = systems[BOUNDARY].model.trace
        mine["boundary_waves"] = [bt.wave_times(i) for i in range(opts["warmup"], n_steps)]
        mine["boundary_messages"] = message_spans(bt, opts["warmup"], n_steps)
        systems[BOUNDARY].model.destroy()
    gathered = comm.all_gather_object(mine)
    systems["spindle"].model.destroy()
    # the activation memory of the best sequential pass count and of the Spindle plan, with each recompute mode
    best = best_passes(gathered, opts["sequential_passes"])
    memory = {}
    for mode in ("none", "selective", "full"):
        seq = MegatronSequential(graphs[best], seed=opts["seed"], recompute=mode)
        memory[("sequential", mode)] = (stash_of(seq, batches[seq_name(best)][0]),
                                        planned_task_by_task(graphs[best], world, mode))
        plan = recomputed(pred["spindle_plan"], mode)
        sp = SpindleRunner(plan, graph, seed=opts["seed"])
        memory[("spindle", mode)] = (stash_of(sp, batches["spindle"][0]), planned_peak(plan, rank))
        sp.model.destroy()
    memory = comm.all_gather_object(memory)
    if rank != 0:
        return None
    return {"pred": {k: v for k, v in pred.items() if k not in ("spindle_plan", "boundary_plan")}, "ranks": gathered,
            "losses": losses, "profile_s": profile_s, "curves_doc": doc, "memory": memory,
            "plan_summary": pred["plan_summary"], "threads": torch.get_num_threads()}


def message_spans(trace, first: int, stop: int) -> list[list[tuple[str, float, float]]]:
    """Each step's per-message spans (:data:`bench_cpu_report.MESSAGE_SPAN`: posted, awaited) as ``(name, start,
    end)`` in ``perf_counter`` seconds: CLOCK_MONOTONIC, one clock for every process on this host, so a
    receiver's wait can be set against its sender's post."""
    out = [[] for _ in range(first, stop)]
    for s in trace.spans:
        if first <= s.step < stop and MESSAGE_SPAN.match(s.name):
            t0 = trace.origin + s.start_s
            out[s.step - first].append((s.name, t0, t0 + s.dur_s))
    return out


def stash_of(system, batch) -> int:
    """Bytes ``system`` keeps for backward at its peak over one step (:class:`~megatron_spindle.runtime.stash.StashMeter`:
    saved for backward and still held when a task's (sequential) or a phase's (Spindle) forward ends)."""
    from megatron_spindle.runtime.stash import StashMeter
    meter = StashMeter(system.parameters())
    system.step(batch, meter=meter)
    return meter.peak_bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="multitask-clip", help="built-in model (contrastive losses only)")
    p.add_argument("--tasks", type=int, default=7, help="tasks (default 7: vision, text, audio, depth, thermal, imu)")
    p.add_argument("--batch", type=int, default=64, help="global batch per task (default 64)")
    p.add_argument("--nproc", type=int, default=os.cpu_count() or 1, help="gloo processes (default: cores)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per system (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curves", default=None, metavar="FILE", help="use these profiled curves (with 'cluster') "
                   "instead of profiling now")
    p.add_argument("--curves-out", default=os.path.join(ROOT, "out", "bench_cpu", "curves.json"),
                   help="where the profile writes its curves")
    p.add_argument("--cache", default=None, help="profile cache (default: the profiler's)")
    p.add_argument("--fresh", action="store_true", help="profile every point again")
    p.add_argument("--repeats", type=int, default=10, help="profile repeats per point (at least)")
    p.add_argument("--min-time", type=float, default=0.3, help="profile seconds per point (at least)")
    p.add_argument("--plan", action="store_true", help="print the Spindle plan (MetaOps and wave grid)")
    p.add_argument("--waves", action="store_true", help="print predicted and measured times of every Spindle wave, "
                   "and train the same waves with their transfers posted at the consumer's wave boundary too: "
                   "transfer exposed per step with and without overlap")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    p.add_argument("--sequential-passes", default=None, metavar="P,P,...",
                   help="pass counts to run the sequential baseline at (default: every count whose micro-batch "
                        "splits over the processes; 1 is always run)")
    p.add_argument("--placement", choices=("spindle", "naive"), default="spindle",
                   help="naive: Spindle's waves on consecutive processes in slice order, so activations move "
                   "between them (the planner's own plan may keep every edge on one process)")
    p.add_argument("--no-overlap", action="store_true",
                   help="reduce gradient buckets only after the whole backward (megatron DDP overlap_grad_reduce off)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from megatron_spindle.profiler.launch import spawn
    from megatron_spindle.profiler.points import default_cache_path

    args = parse_args(argv)
    if args.nproc < 2:
        raise SystemExit("bench_cpu: needs at least 2 processes (--nproc)")
    opts = {"model": args.model, "tasks": args.tasks, "batch": args.batch, "nproc": args.nproc,
            "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "seed": args.seed,
            "curves_out": args.curves_out, "cache": args.cache or default_cache_path(), "fresh": args.fresh,
            "repeats": args.repeats, "min_seconds": args.min_time, "verbose": True, "overlap": not args.no_overlap,
            "waves": args.waves, "placement": args.placement,
            "sequential_passes": sequential_passes(args)}
    if args.curves:
        with open(args.curves) as fh:
            opts["curves_doc"] = json.load(fh)
    res = spawn(bench_rank, args.nproc, opts)[0]
    s = summarize(res, opts)
    if args.plan:
        print(res["plan_summary"])
        print()
    if args.waves:
        print(f"{'wave':<6}{'compute pred':>13}{'meas':>9}{'transfer pred':>15}{'meas':>9}   slices")
        for w in s["waves_detail"]:
            print(f"w{w['wave']:<5}{w['predicted_compute_s'] * 1e3:>13.2f}{w['measured_compute_s'] * 1e3:>9.2f}"
                  f"{w['predicted_transfer_s'] * 1e3:>15.2f}{w['measured_transfer_s'] * 1e3:>9.2f}   "
                  f"{' '.join(w['slices'])}")
        print()
        print(format_overlap(s["overlap"]))
        print()
    print(format_report(s))
    if args.json:
        print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
