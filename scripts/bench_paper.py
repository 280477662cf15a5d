#!/usr/bin/env python
"""Every workload of the paper's Figure 8, every system, one run: the comparison table beside the paper's numbers.

    python scripts/bench_paper.py [--out-dir docs/results] [--cluster a800-8x8] [--no-sensitivity]

Writes ``paper_table.md`` (the tables, each number beside the paper's where the paper gives one, the targets
met or missed and why), ``paper_fig8.png`` (speedup over sequential, the paper's Figure 8), ``paper_breakdown.png``
(where a step goes, the paper's Figure 10) and ``compare_readme_section.md`` (the summary table and the commands
that made it, for the README). Pure planner code: no GPU, no torch; a few minutes on two CPU cores.

Nothing here is tuned: the cluster is the ``--cluster`` preset (constants and their sources in
``megatron_spindle/planner/workload/cluster.py``), the curves are the analytic device model, the global batches are the
built-in workloads' defaults (the published recipes' global batches per optimizer step, split over the specs'
passes per step). The two sensitivity runs change one documented input each (InfiniBand per GPU instead of per
node; one pass of the former per-pass defaults, no accumulation) to show which conclusions depend on it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_spindle.compare import Comparison, compare, plot  # noqa: E402
from megatron_spindle.planner.step.baselines import BASELINES  # noqa: E402
from megatron_spindle.planner.workload.cluster import PRESETS, load_cluster  # noqa: E402
from megatron_spindle.planner.workload.workloads import build_graph, resolve_passes  # noqa: E402

#: The paper's Figure 8 grid: (model, tasks, device counts).
GRID = [("multitask-clip", k, (8, 16, 32)) for k in (4, 7, 10)] + \
       [("ofasys", k, (8, 16, 32)) for k in (4, 7)] + [("qwen-val", 3, (32, 64))]
#: Beyond the paper's grid, to check "never slower" on every device count we can plan.
EXTRA = [("multitask-clip", k, (64, 256, 1024)) for k in (4, 7, 10)] + \
        [("ofasys", k, (64, 256, 1024)) for k in (4, 7)] + [("qwen-val", 3, (16, 256, 1024))]
#: The paper's numbers (Wang et al., ASPLOS 2025; see shared/DESIGN.md).
PAPER_BEST_OVER_SEQUENTIAL = {("multitask-clip", 8): 1.37, ("multitask-clip", 16): 1.33, ("multitask-clip", 32): 1.71,
                              ("qwen-val", 32): 1.16, ("qwen-val", 64): 1.63}
PAPER_TASK_LEVEL_BEST = 1.44
PAPER_INTRA_TASK_BEST = 1.20
PAPER_TRANSFER = "1.7-6.2%"
PAPER_NAIVE_TRANSFER = "10-27%"
PAPER_SYNC = "5-15%"
PAPER_GAP = 1.07
SENSITIVITY_GRID = [("multitask-clip", 4, (16, 32)), ("multitask-clip", 10, (32,)), ("ofasys", 7, (16, 32)),
                    ("qwen-val", 3, (32, 64))]


def label(model: str, k: int) -> str:
    name = {"multitask-clip": "Multitask-CLIP", "ofasys": "OFASys", "qwen-val": "Qwen-VAL"}[model]
    return f"{name} {k} tasks"


#: Sensitivity B: one pass per step of the per-task batch the specs had before issue 11.
FORMER_PASS_BATCH = {"multitask-clip": 128, "ofasys": 64, "qwen-val": 8}


def run(grid, cluster: str, former: bool = False) -> list[tuple[str, str, str, list[Comparison]]]:
    """Every workload of ``grid`` at its default global batch and passes (``former``: one pass of the former
    per-pass batch); the third item describes the batch per task."""
    out = []
    for model, k, gpus in grid:
        batch = FORMER_PASS_BATCH[model] if former else None
        passes = resolve_passes(model, batch=batch)
        graph = build_graph(model, tasks=k, batch=batch, passes=passes)
        per_pass = sorted({op.batch for op in graph.operators})
        what = f"{'/'.join(str(b * passes) for b in per_pass)}" + (f" = {passes} x {'/'.join(map(str, per_pass))}"
                                                                   if passes > 1 else "")
        t0 = time.perf_counter()
        cmps = compare(graph, gpus, cluster=cluster, passes=passes)
        print(f"  {label(model, k):24s} batch {what:18s} on {','.join(map(str, gpus)):9s} "
              f"{time.perf_counter() - t0:5.1f} s", file=sys.stderr)
        out.append((model, label(model, k), what, cmps))
    return out


# --------------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------------
def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def pct(v: float) -> str:
    return f"{v:.1%}"


def share(c: Comparison, system: str, part: str) -> float | None:
    r = c.results[system]
    return r.sim.breakdown.shares()[part] if r.ok else None


def speed(c: Comparison, over: str) -> str:
    v = c.speedup("spindle", over)
    r = c.results[over]
    if v is None:
        return "no plan"
    return x(v) + ("*" if r.over_memory else "")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def speedup_rows(results) -> list[list[str]]:
    rows = []
    for model, name, batch, cmps in results:
        for c in cmps:
            sp = c.results["spindle"]
            if not sp.ok:
                rows.append([name, str(c.gpus), f"no plan: {sp.error[:80]}"] + [""] * 5)
                continue
            won = "" if not sp.schedule else (f" ({sp.schedule} waves)" if sp.schedule in ("backfilled", "cross-level")
                                              else f" ({sp.schedule}'s schedule)")
            rows.append([name, str(c.gpus), f"{sp.sim.step_ms:.1f}{won}", speed(c, "sequential"), speed(c, "task-level"),
                         speed(c, "intra-task"), speed(c, "spindle-naive-placement"),
                         f"{x(c.speedup('task-level', 'sequential'))} / {x(c.speedup('intra-task', 'sequential'))}"])
    return rows


def breakdown_rows(results) -> list[list[str]]:
    rows = []
    for model, name, batch, cmps in results:
        for c in cmps:
            sp = c.results["spindle"]
            if not sp.ok:
                continue
            b = sp.sim.breakdown.shares()
            nv = share(c, "spindle-naive-placement", "transfer")
            seq = c.results["sequential"]
            mem_seq = f"{seq.sim.max_memory_gib:.1f} / {seq.sim.memory_spread_gib:.1f}" if seq.ok else "-"
            rows.append([name, str(c.gpus), pct(b["compute"]), pct(b["transfer"]),
                         "-" if nv is None else pct(nv), pct(b["sync"]), pct(b["idle"]),
                         f"{sp.sim.makespan_ms / c.lower_bound_ms:.3f}",
                         f"{sp.sim.step_ms / (c.passes * c.lower_bound_ms):.2f}",
                         f"{sp.sim.max_memory_gib:.1f} / {sp.sim.memory_spread_gib:.1f}", mem_seq])
    return rows


def all_cmps(results):
    return [(name, c) for _, name, _, cmps in results for c in cmps]


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------
def breakdown_figure(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = ["spindle", "sequential", "task-level", "intra-task", "spindle-naive-placement"]
    short = {"spindle": "Spindle", "sequential": "seq.", "task-level": "task", "intra-task": "intra",
             "spindle-naive-placement": "naive pl."}
    parts = [("compute", "#4c72b0"), ("transfer", "#dd8452"), ("sync", "#55a868"), ("idle", "#bbbbbb")]
    picks = [(name, c) for name, c in all_cmps(results) if c.gpus in (16, 32)]
    cols = min(4, len(picks))
    rows = -(-len(picks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows + 0.5), squeeze=False)
    for ax, (name, c) in zip(axes.flat, picks):
        ref = c.step_ms("spindle") or 1.0
        for i, s in enumerate(systems):
            r = c.results[s]
            if not r.ok:
                continue
            bottom = 0.0
            for part, color in parts:
                v = getattr(r.sim.breakdown, f"{part}_ms") / ref
                ax.bar(i, v, 0.7, bottom=bottom, color=color, label=part)
                bottom += v
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels([short[s] for s in systems], fontsize=6, rotation=30)
        ax.set_title(f"{name}, {c.gpus} GPUs", fontsize=8)
        ax.set_ylabel("step / Spindle's step", fontsize=7)
    for ax in list(axes.flat)[len(picks):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------
def report(main, extra, sens_ib, sens_batch, cluster: str, seconds: float, command: str) -> tuple[str, str]:
    cl = load_cluster(cluster, num_devices=64)
    ok = [(n, c) for n, c in all_cmps(main) if c.results["spindle"].ok]
    # targets
    best = {}
    for model, name, batch, cmps in main:
        for c in cmps:
            v = c.speedup("spindle", "sequential")
            if v is not None:
                key = (model, c.gpus)
                if v > best.get(key, (0, ""))[0]:
                    best[key] = (v, name)
    best32 = max((v for (m, n), (v, _) in best.items() if n == 32), default=0.0)
    transfer = [(share(c, "spindle", "transfer"), n, c.gpus) for n, c in ok]
    over6 = [t for t in transfer if t[0] > 0.06]
    gap = [(c.results["spindle"].sim.makespan_ms / c.lower_bound_ms, n, c.gpus) for n, c in ok]
    over7 = [g for g in gap if g[0] > PAPER_GAP]
    slower = [(n, c.gpus, b, c.speedup("spindle", b)) for n, c in all_cmps(main) + all_cmps(extra)
              if c.results["spindle"].ok for b in BASELINES
              if c.speedup("spindle", b) is not None and c.speedup("spindle", b) < 1.0]
    slower_main = [s for s in slower if any(s[0] == n and s[1] == c.gpus for n, c in all_cmps(main))]
    tr_isl = sum(c.results["spindle"].sim.breakdown.transfer_ms for _, c in ok)
    tr_naive = sum(c.results["spindle-naive-placement"].sim.breakdown.transfer_ms for _, c in ok
                   if c.results["spindle-naive-placement"].ok)
    # placement is compared where Spindle runs its own waves (elsewhere a baseline's schedule won the step)
    naive_better = [(n, c.gpus) for n, c in ok if c.results["spindle-naive-placement"].ok
                    and not c.results["spindle"].schedule
                    and share(c, "spindle-naive-placement", "transfer") < share(c, "spindle", "transfer")]
    naive_faster = [f"{n} {c.gpus}" for n, c in ok if c.results["spindle-naive-placement"].ok
                    and c.speedup("spindle", "spindle-naive-placement") < 1 - 1e-12]
    from megatron_spindle.planner.step.simulate import GRAD_BYTES_PER_PARAM, allreduce_time_ms
    clip_params = build_graph("multitask-clip", tasks=4).total_params()
    clip_sync_ms = allreduce_time_ms(range(32), clip_params * GRAD_BYTES_PER_PARAM, load_cluster(cluster, num_devices=32))
    clip32 = [c.results["sequential"].sim.makespan_ms for m, _, _, cmps in main for c in cmps
              if m == "multitask-clip" and c.gpus == 32 and c.results["sequential"].ok] or [0.0]
    sync8 = [share(c, "spindle", "sync") for _, c in ok if c.gpus <= 8]
    sync16 = [share(c, "spindle", "sync") for _, c in ok if c.gpus >= 16]
    ratio = [c.results["spindle"].sim.breakdown.transfer_ms / c.results["spindle"].sim.breakdown.compute_ms
             for _, c in ok]
    ofa_task = [c.speedup("spindle", "task-level") for m, _, _, cmps in main for c in cmps
                if m == "ofasys" and c.speedup("spindle", "task-level")]
    sb = [(n, c.gpus, c.speedup("spindle", "sequential"), share(c, "spindle", "transfer"), share(c, "spindle", "sync"))
          for n, c in all_cmps(sens_batch or []) if c.results["spindle"].ok and c.speedup("spindle", "sequential")]
    sa = [(share(c, "spindle", "transfer"), share(c, "spindle", "sync"), c.speedup("spindle", "sequential"), m)
          for m, n, _, cmps in (sens_ib or []) for c in cmps if c.results["spindle"].ok]
    task_best = max((c.speedup("task-level", "sequential") or 0) for _, c in all_cmps(main))
    intra_best = max((c.speedup("intra-task", "sequential") or 0) for _, c in all_cmps(main))
    below_bound = [(n, c.gpus, c.results["task-level"].sim.makespan_ms / c.lower_bound_ms) for n, c in all_cmps(main)
                   if c.results["task-level"].ok and c.results["task-level"].sim.makespan_ms < c.lower_bound_ms]
    align = [(n, c.gpus, s, (c.results[s].sim.makespan_ms - c.results[s].ideal_makespan_ms)
              / c.results[s].sim.makespan_ms) for n, c in all_cmps(main) for s in ("task-level", "intra-task")
             if c.results[s].ok and c.results[s].ideal_makespan_ms]
    oom = [(n, c.gpus, s) for n, c in all_cmps(main) for s in BASELINES if c.results[s].over_memory]

    def mark(good: bool) -> str:
        return "**met**" if good else "**missed**"

    out = [f"# Spindle against the baselines on the paper's workloads (simulated)", "",
           f"Made by `{command}` in {seconds:.0f} s on this machine's CPUs (pure planner code, no GPU). "
           f"Every plan is timed by the same step simulator (`megatron_spindle/planner/step/simulate.py`; its "
           f"docstring states the model: waves and their transfers one after another, transfers charged per NVLink "
           f"device and per InfiniBand node, fp32 gradients all-reduced in buckets per parameter device group as soon "
           f"as their last backward wave ends, overlapped with the rest of the backward; a step is the spec's passes "
           f"of the plan, then the sync's exposed part). The baselines get the same overlap and accumulation.", "",
           f"* cluster `{cluster}`: {cl.gpus_per_node} devices per island, {cl.intra_bandwidth_gbps:g} GB/s NVLink per "
           f"device, {cl.inter_bandwidth_gbps:g} GB/s InfiniBand per node, {cl.memory_gib:g} GiB "
           f"({cl.usable_memory_fraction:g} usable), {cl.peak_tflops:g} TFLOP/s; constants and sources in "
           f"`megatron_spindle/planner/workload/cluster.py` (achieved = line rate x 0.8, NCCL's measured efficiency);",
           "* curves: the analytic device model (`planner/workload/analytic.py`), not profiled curves;",
           "* global batch per task per optimizer step: the specs' defaults, from the published recipes (README, "
           "'Default batches'): Multitask-CLIP 512, 2048 for the audio tasks (ImageBind), 16 passes; OFASys 256 "
           "(OFA's 2048 in total), 4 passes; Qwen-VAL 4096, 2048 for language (Qwen-VL stage 2, Qwen-7B), 512 passes. "
           "Each pass is planned; `batch/task` below is global = passes x per pass;",
           "* sequential = Megatron-LM/DeepSpeed, task-level = Spindle-Optimus, intra-task = DistMM-MT "
           "(`planner/step/baselines.py`); `*` marks a baseline whose plan exceeds device memory in the wave runtime "
           "(timed all the same, see Memory below).", "",
           "The paper's speedups are over DeepSpeed/Megatron-LM, i.e. our `sequential` column.", "",
           "## Speedup of Spindle (ratio of simulated step times)", "",
           table(["workload", "GPUs", "Spindle step ms", "over sequential", "over task-level", "over intra-task",
                  "over naive placement", "task-level / intra-task over sequential"], speedup_rows(main)), "",
           "### Best speedup over sequential per device count, beside the paper", "",
           table(["model", "GPUs", "ours (best over task counts)", "paper"],
                 [[m, str(n), f"{v:.2f}x ({nm})", f"{PAPER_BEST_OVER_SEQUENTIAL[(m, n)]:.2f}x"
                   if (m, n) in PAPER_BEST_OVER_SEQUENTIAL else "-"] for (m, n), (v, nm) in sorted(best.items())]), "",
           f"Baselines' own best speedup over sequential: task-level {task_best:.2f}x (paper: at most "
           f"{PAPER_TASK_LEVEL_BEST:.2f}x), intra-task {intra_best:.2f}x (paper: at most {PAPER_INTRA_TASK_BEST:.2f}x).", "",
           "## Where Spindle's step goes (the paper's Figure 10), and the gap to the bound", "",
           f"Paper: inter-wave transfer {PAPER_TRANSFER} of a step with island-aware placement, {PAPER_NAIVE_TRANSFER} "
           f"with naive placement; parameter sync {PAPER_SYNC}; compute makespan within {PAPER_GAP - 1:.0%} of ΣC*.", "",
           table(["workload", "GPUs", "compute", "transfer", "transfer, naive placement", "sync", "idle",
                  "makespan / ΣC*", "step / ΣC*", "Spindle mem GiB max / spread", "sequential mem GiB max / spread"],
                 breakdown_rows(main)), "",
           "## Beyond the paper's grid", "",
           "Spindle's plan is chosen by the simulated step among its own level-by-level waves (island-aware and naive placement), "
           "waves across levels (backfilled or cross-level) and the baselines' schedules (`planner/step/choose.py`); "
           "the step column names the schedule when it is not Spindle's level-by-level waves.", "",
           table(["workload", "GPUs", "Spindle step ms", "over sequential", "over task-level", "over intra-task",
                  "over naive placement", "task-level / intra-task over sequential"], speedup_rows(extra)), "",
           "## Targets", "",
           f"1. Best speedup over sequential on 32 devices at least 1.5x (paper 1.71x): {best32:.2f}x, {mark(best32 >= 1.5)}.",
           f"2. Inter-wave transfer at most 6% of a step: {len(transfer) - len(over6)} of {len(transfer)} "
           f"configurations, largest {max(transfer)[0]:.1%} ({max(transfer)[1]}, {max(transfer)[2]} GPUs); "
           f"{mark(not over6)}.",
           f"3. Spindle within 7% of ΣC* (compute makespan): {len(gap) - len(over7)} of {len(gap)} configurations, "
           f"largest {max(gap)[0]:.3f} ({max(gap)[1]}, {max(gap)[2]} GPUs); {mark(not over7)}. The whole step is "
           f"{min(c.results['spindle'].sim.step_ms / (c.passes * c.lower_bound_ms) for _, c in ok):.2f}-"
           f"{max(c.results['spindle'].sim.step_ms / (c.passes * c.lower_bound_ms) for _, c in ok):.2f}x passes x ΣC*, "
           f"because ΣC* counts compute only.",
           f"4. Spindle never slower than a baseline: on the paper's grid "
           + ("yes, " + mark(True) if not slower_main else f"no ({slower_main}), " + mark(False))
           + (f"; beyond it: slower in {', '.join(f'{n} {g} GPUs vs {b} ({v:.3f}x)' for n, g, b, v in slower if (n, g, b, v) not in slower_main)}."
              if len(slower) > len(slower_main) else "; beyond it (64, 256 and 1024 GPUs; Qwen-VAL on 16, 256, 1024): "
              "also never slower."),
           f"5. Island-aware placement moves less than naive placement: total inter-wave transfer over the grid "
           f"{tr_isl:.0f} ms vs {tr_naive:.0f} ms naive; the naive placement's step is never shorter than Spindle's "
           f"({'met' if not naive_faster else 'shorter on ' + ', '.join(naive_faster)}): the plan is chosen by the "
           f"whole step, so in {len(naive_better)} of {len(ok)} configurations "
           f"({', '.join(f'{n} {g}' for n, g in naive_better) or 'none'}) Spindle keeps an island-aware placement "
           f"that moves more activations but syncs its gradients faster; "
           f"{mark(tr_isl < tr_naive and not naive_faster)}.", "",
           "### Why the misses", "",
           f"* **Parameter sync** (Spindle's exposed sync: {min(sync16):.0%}-{max(sync16):.0%} of a step at 16 GPUs "
           f"and more, {min(sync8):.0%}-{max(sync8):.0%} on 8 GPUs; paper {PAPER_SYNC}). Gradients are all-reduced "
           f"in fp32 (Megatron's bf16 default) over InfiniBand at {cl.inter_bandwidth_gbps:g} GB/s per node: "
           f"{clip_sync_ms:.0f} ms for 4-task Multitask-CLIP's {clip_params / 1e9:.2f} B parameters over 4 nodes "
           f"when nothing hides it. Two things now shrink it, as in Megatron: buckets reduce while later backward "
           f"waves run, and a step accumulates the recipes' global batch over several passes with one sync. "
           f"Sensitivity B below shows the step without accumulation (one pass of the former per-pass batches): "
           f"there sync is "
           + (f"{min(t[4] for t in sb):.0%}-{max(t[4] for t in sb):.0%}" if sb else "-")
           + " of Spindle's step.",
           f"* **Inter-wave transfer above 6%.** Transfer and compute both grow with the batch, so their ratio "
           f"({min(ratio):.0%}-{max(ratio):.0%} of Spindle's compute here) does not depend on it. Most of the time is "
           f"cross-island traffic: a node's "
           f"{cl.inter_bandwidth_gbps:g} GB/s is 1/{cl.intra_bandwidth_gbps * cl.gpus_per_node / cl.inter_bandwidth_gbps:.0f} "
           f"of its NVLink bandwidth, and boundaries where a MetaOp grows across islands (8 -> 16 devices: half the "
           f"samples change island) or where a whole batch funnels into the 1-2 devices of a pool head or loss cannot stay "
           f"inside an island. "
           + (f"With 400 Gb/s per GPU instead of per node (sensitivity A) the transfer share falls to "
              f"{min(a[0] for a in sa):.1%}-{max(a[0] for a in sa):.1%} and sync to "
              f"{min(a[1] for a in sa if a[3] != 'qwen-val'):.0%}-{max(a[1] for a in sa if a[3] != 'qwen-val'):.0%} "
              f"(Multitask-CLIP, OFASys), close to the paper's breakdown, and the speedup over sequential rises to "
              f"{min(a[2] for a in sa):.2f}-{max(a[2] for a in sa):.2f}x. We keep the issue's reading, 400 Gb/s per node, "
              f"as the headline." if sa else ""),
           f"* **Compute makespan above 1.07 ΣC*** on {', '.join(sorted({g[1] for g in over7})) or 'no workload'}: rounding "
           f"layers to whole numbers and device counts to divisors of the batch (OFASys' 64-sample batches allow only "
           f"powers of two), and short levels (embeddings, heads) whose single layer sets the wave. This is the "
           f"planner's own makespan, independent of the simulator.",
           "* **Island-aware vs naive placement.** An earlier `placement.py` placed a wave's slices heaviest-inflow "
           "first with ties broken by *more* devices first, so the largest slice took its producers' island and pushed "
           "smaller slices fed from the same island across nodes; it also scores candidates by the *sum* of message "
           "times while a boundary costs its busiest link. Ties now go to the smaller slice first, and the planner keeps "
           "the naive layout when it fits memory and the simulator times its transfers lower (target 5 above).",
           "* **ΣC* is a bound for level-by-level schedules only.** The task-level baseline lets each task run at its own "
           "pace, so its compute can end below ΣC*"
           + (f" (here: {', '.join(f'{n} {g} GPUs at {r:.2f} ΣC*' for n, g, r in below_bound)})" if below_bound else "")
           + ". Spindle's level barriers cost most on OFASys, whose tasks have different depths: there Spindle is "
           + (f"as little as {min(ofa_task):.2f}x faster than task-level." if ofa_task else "close to task-level."),
           f"* **Speedups over sequential above the paper's** (Multitask-CLIP {min(v for (m, n), (v, _) in best.items() if m == 'multitask-clip'):.2f}-"
           f"{max(v for (m, n), (v, _) in best.items() if m == 'multitask-clip'):.2f}x, paper 1.33-1.71x). Every system "
           f"runs the same passes, sized so that the wave runtime (which keeps every task's activations until the "
           f"pass's backward) fits 8 devices: 32 samples per task per pass for Multitask-CLIP. Sequential spreads "
           f"each MetaOp over all devices, one sample per device or less at 32 GPUs, where the analytic curves lose "
           f"most efficiency; Megatron-LM frees a task's activations after its backward, so its real passes could be "
           f"larger and sequential faster than timed here. The paper's batches are not stated in what we have.",
           f"* **Accumulation favours Spindle's ratios** (sensitivity B): without it, sync is a larger fixed cost "
           f"in every system's step and compresses every ratio: Spindle over sequential "
           + (f"{min(t[2] for t in sb):.2f}-{max(t[2] for t in sb):.2f}x there" if sb else "-")
           + ". The runtime still stashes every task's activations until the pass's backward, so the specs' passes "
             "are chosen for the passes to fit 8 devices of 80 GB.", "",
           "## Baselines: alignment and memory", "",
           f"* Concurrent lanes (task-level, intra-task) run in aligned waves, as in a wave runtime; that costs "
           f"{min(a[3] for a in align):.1%}-{max(a[3] for a in align):.1%} of their compute makespan over free-running "
           f"lanes (`unaligned_makespan_ms` in `spindle compare --json`).",
           "* Memory is estimated with the wave runtime's semantics for every system: every activation is stashed until "
           "the backward pass. Megatron-LM itself frees a task's activations after that task's backward, so the "
           "baselines that run tasks one after another (sequential, intra-task) need less under Megatron than here; "
           "their step times are unaffected. Over the limit here: "
           + (", ".join(f"{s} on {n} {g} GPUs" for n, g, s in oom) or "none") + ".",
           ""]
    for title, res in (("A: InfiniBand 400 Gb/s per GPU (inter_bandwidth_gbps x8)", sens_ib),
                       ("B: one pass of the former per-pass batch, no accumulation", sens_batch)):
        if res is None:
            continue
        rows = []
        for model, name, batch, cmps in res:
            for c in cmps:
                sp = c.results["spindle"]
                if not sp.ok:
                    rows.append([name, str(batch), str(c.gpus), "no plan: " + sp.error[:60], "", "", "", ""])
                    continue
                b = sp.sim.breakdown.shares()
                nv = share(c, "spindle-naive-placement", "transfer")
                rows.append([name, str(batch), str(c.gpus), speed(c, "sequential"), speed(c, "task-level"),
                             pct(b["transfer"]), "-" if nv is None else pct(nv), pct(b["sync"])])
        out += [f"## Sensitivity {title}", "",
                table(["workload", "batch/task per step", "GPUs", "over sequential", "over task-level", "transfer",
                       "transfer, naive", "sync"], rows), ""]
    out += ["## Figures", "", "![speedup over sequential](paper_fig8.png)", "",
            "![where the step goes](paper_breakdown.png)", ""]
    md = "\n".join(out)

    readme = ["## Spindle against today's systems (simulated)", "",
              "One training step of every workload in the paper's Figure 8, planned by Spindle and by three baselines "
              "written in the same plan format, timed by the same step simulator on the paper's cluster "
              f"(`{cluster}`: 8 x A800 per node, NVLink, 400 Gb/s InfiniBand per node; analytic curves; the recipes' "
              "global batches per step accumulated over the specs' passes, see 'Default batches'; gradient buckets "
              "reduced during the backward for every system). Speedup = baseline step time / Spindle step time.", "",
              table(["workload", "GPUs", "Spindle step ms", "over sequential (Megatron-LM/DeepSpeed)",
                     "over task-level (Optimus)", "over intra-task (DistMM-MT)",
                     "paper: best over sequential at this GPU count"],
                    [[name, str(c.gpus), f"{c.step_ms('spindle'):.1f}", speed(c, "sequential"), speed(c, "task-level"),
                      speed(c, "intra-task"),
                      f"{PAPER_BEST_OVER_SEQUENTIAL[(m, c.gpus)]:.2f}x" if (m, c.gpus) in PAPER_BEST_OVER_SEQUENTIAL else "-"]
                     for m, name, _, cmps in main for c in cmps if c.results["spindle"].ok]), "",
              "`*`: that baseline's plan exceeds device memory in the wave runtime, which stashes every activation "
              "until the backward pass (timed all the same). The paper reports its best speedup per GPU count over all "
              "task counts, so its column repeats across task counts.", "",
              "Made by:", "", "```", command, "```", "",
              "One workload, with the full breakdown and memory per system:", "", "```",
              "spindle compare --model multitask-clip --tasks 4 --gpus 8,16,32 --plot compare.png", "```", "",
              f"Spindle's exposed parameter sync is {min(sync8 + sync16):.0%}-{max(sync8 + sync16):.0%} of its step "
              f"(paper {PAPER_SYNC}); its inter-wave transfer exceeds the paper's 6% on several workloads; "
              "`docs/results/paper_table.md` has the breakdown, the paper's numbers beside ours, and why.", ""]
    return md, "\n".join(readme)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "results"))
    ap.add_argument("--cluster", default="a800-8x8", help="cluster preset or JSON file")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the two what-if runs")
    args = ap.parse_args(argv)
    command = "python scripts/bench_paper.py" + (f" --cluster {args.cluster}" if args.cluster != "a800-8x8" else "") + \
              (" --no-sensitivity" if args.no_sensitivity else "")
    t0 = time.perf_counter()
    print("paper grid:", file=sys.stderr)
    main_res = run(GRID, args.cluster)
    print("beyond the paper's grid:", file=sys.stderr)
    extra = run(EXTRA, args.cluster)
    sens_ib = sens_batch = None
    if not args.no_sensitivity:
        import json
        import tempfile
        base = dict(PRESETS[args.cluster]) if args.cluster in PRESETS else {}
        fast = {"preset": args.cluster, "inter_bandwidth_gbps": load_cluster(args.cluster, num_devices=8).inter_bandwidth_gbps * 8} \
            if base else None
        if fast:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
                json.dump(fast, fh)
            print("sensitivity A (IB per GPU):", file=sys.stderr)
            sens_ib = run(SENSITIVITY_GRID, fh.name)
            os.unlink(fh.name)
        print("sensitivity B (one pass of the former per-pass batch):", file=sys.stderr)
        sens_batch = run(SENSITIVITY_GRID, args.cluster, former=True)
    seconds = time.perf_counter() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    md, readme = report(main_res, extra, sens_ib, sens_batch, args.cluster, seconds, command)
    with open(os.path.join(args.out_dir, "paper_table.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out_dir, "compare_readme_section.md"), "w") as fh:
        fh.write(readme)
    paper_marks = {(label(m, k), n): v for (m, n), v in PAPER_BEST_OVER_SEQUENTIAL.items() if m == "qwen-val"
                   for k in (3,)}
    plot([(name, cmps) for _, name, _, cmps in main_res], os.path.join(args.out_dir, "paper_fig8.png"),
         paper=paper_marks)
    breakdown_figure(main_res, os.path.join(args.out_dir, "paper_breakdown.png"))
    print(f"wrote paper_table.md, compare_readme_section.md, paper_fig8.png, paper_breakdown.png to "
          f"{os.path.normpath(args.out_dir)} in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
