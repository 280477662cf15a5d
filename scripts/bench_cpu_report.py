"""The report of ``scripts/bench_cpu.py``: its measurements summed up (:func:`summarize`, the JSON line) and
printed (:func:`format_report`). Pure Python."""
from __future__ import annotations

import math
import os
import re
import statistics

#: fp32 bytes (the benchmark's models) over the planner's bf16 bytes of an activation element.
FP32_OVER_BF16 = 2.0

#: The executor's per-boundary transfer span (the exposed part).
EXPOSED_TRANSFER = re.compile(r"^w\d+ (fwd|bwd) transfer$")
#: The executor's per-message spans (``runtime/p2p.py: message_key``): a sender's post, a rank blocked on it.
MESSAGE_SPAN = re.compile(r"^(w\d+ (?:fwd|bwd) #\d+ \d+->\d+) (posted|awaited|send awaited)$")


#: The Spindle plan with its transfers posted at the consumer's wave boundary (``--waves``: no overlap).
BOUNDARY = "spindle-boundary"


def seq_name(passes: int) -> str:
    """The sequential baseline at ``passes`` passes per step (``sequential`` for one, as before)."""
    return "sequential" if passes == 1 else f"sequential/{passes}"


def _step_series(ranks: list[dict], system: str, key: str) -> list[float]:
    """Per timed step, the slowest rank's time (s)."""
    per_rank = [r["times"][system][key] for r in ranks]
    return [max(vals) for vals in zip(*per_rank)]


def _seconds(breakdown_ms: dict) -> dict:
    """``{"compute_ms": 12.0, ...}`` -> ``{"compute_s": 0.012, ...}``."""
    return {k.removesuffix("_ms") + "_s": v / 1e3 for k, v in breakdown_ms.items()}


def summarize(res: dict, opts: dict) -> dict:
    ranks = res["ranks"]
    meas = {k: statistics.median(_step_series(ranks, k, "step")) for k in ("sequential", "spindle")}
    optim = {k: statistics.median(_step_series(ranks, k, "optimizer")) for k in ("sequential", "spindle")}
    spread = {k: (min(_step_series(ranks, k, "step")), max(_step_series(ranks, k, "step")))
              for k in ("sequential", "spindle")}
    sims = res["pred"]["sims"]
    pred = {k: sims[k]["step_ms"] / 1e3 for k in ("sequential", "spindle")}
    cats = ("forward", "backward", "transfer", "sync")
    spindle_spans = {c: statistics.mean(statistics.median(s[c] for s in r["spans"]) for r in ranks) for c in cats[:2]}
    # exposed transfer: the per-boundary spans (per-message spans overlap compute since transfers are async)
    spindle_spans["transfer"] = _exposed_transfer(ranks)
    # the simulator predicts the exposed sync: the wait after backward, not the buckets' overlapped spans
    spindle_spans["sync"] = statistics.mean(statistics.median(w.get("gradient sync wait", 0.0) for w in r["waves"])
                                            for r in ranks)
    worst = 0.0
    for a, b in zip(res["losses"]["sequential"], res["losses"]["spindle"]):
        for t in a:
            worst = max(worst, abs(a[t] - b[t]) / max(abs(b[t]), 1e-12))
    m_ratio = meas["spindle"] / meas["sequential"]
    p_ratio = pred["spindle"] / pred["sequential"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    sweep = {p: statistics.median(_step_series(ranks, seq_name(p), "step")) for p in opts["sequential_passes"]}
    best = min(sweep, key=sweep.get)
    memory = {}
    for system, mode in res["memory"][0]:
        got = max(r[(system, mode)][0] for r in res["memory"])  # the most loaded rank
        planned = max(r[(system, mode)][1] for r in res["memory"])
        memory.setdefault(system, {})[mode] = {"measured_bytes": got, "planned_bytes": planned,
                                               "measured_over_planned": got / (planned * FP32_OVER_BF16)}
    memory["sequential"]["passes"] = best
    return {
        "model": opts["model"], "tasks": opts["tasks"], "batch": opts["batch"], "nproc": opts["nproc"],
        "threads_per_process": res["threads"], "steps": opts["steps"], "warmup": opts["warmup"],
        "measured_ratio": m_ratio, "predicted_ratio": p_ratio,
        "measured_step_s": meas["spindle"], "predicted_step_s": pred["spindle"],
        "prediction_error": pred["spindle"] / meas["spindle"] - 1,
        "sequential_measured_step_s": meas["sequential"], "sequential_predicted_step_s": pred["sequential"],
        "sequential_prediction_error": pred["sequential"] / meas["sequential"] - 1,
        "measured_speedup": 1 / m_ratio, "predicted_speedup": 1 / p_ratio,
        "step_range_s": spread, "optimizer_s": optim,
        "measured_ratio_with_optimizer": (meas["spindle"] + optim["spindle"]) / (meas["sequential"] + optim["sequential"]),
        "spindle_measured_breakdown_s": {**{c: spindle_spans[c] for c in cats}},
        "spindle_predicted_breakdown_s": _seconds(sims["spindle"]["breakdown"]),
        "sequential_predicted_breakdown_s": _seconds(sims["sequential"]["breakdown"]),
        "waves": res["pred"]["waves"], "max_loss_rel_diff": worst, "profile_s": res["profile_s"],
        "link": {k: res["pred"]["cluster"][k] for k in ("intra_latency_us", "intra_bandwidth_gbps")},
        "load_average_1min": load,
        "waves_detail": wave_table(res),
        "sequential_sweep_step_s": sweep, "sequential_best_passes": best,
        "sequential_best_micro_batch": opts["batch"] // best, "sequential_best_measured_step_s": sweep[best],
        "measured_ratio_vs_best_sequential": meas["spindle"] / sweep[best],
        "activation_memory": memory,
        **({"overlap": overlap_table(res, ranks)} if BOUNDARY in ranks[0]["times"] else {}),
    }


def _blocked(step: dict) -> float:
    """One rank's per-wave posting and blocked-waiting spans of one step, summed."""
    return sum(v for k, v in step.items() if EXPOSED_TRANSFER.match(k))


def _exposed_transfer(ranks: list[dict], key: str = "waves") -> float:
    """Transfer exposed per step: each rank's :func:`_blocked`, the median over steps, the mean over ranks."""
    return statistics.mean(statistics.median(_blocked(w) for w in r[key]) for r in ranks)


#: The parts of a rank's exposed transfer the trace tells apart (:func:`exposed_parts`).
MEASURED_PARTS = ("posting", "message", "send", "peer", "exposed")


def exposed_parts(ranks: list[dict], key: str = "waves", msgs: str = "messages") -> dict[str, float]:
    """A rank's per-wave posting and blocked spans (:func:`_exposed_transfer`) per step in parts, each rank's
    median over steps, the mean over ranks: ``message``, blocked on a receive after its sender had posted it
    (the ranks' ``perf_counter`` is one clock on this host); ``peer``, blocked on it before (the peer still
    computing or not yet at the point: idle in the simulator's terms); ``send``, blocked on its own sends at
    the pass's end; ``posting``, the rest (posting the batches); ``exposed``, all but ``peer``."""
    parts: dict[str, list[list[float]]] = {p: [[] for _ in ranks] for p in MEASURED_PARTS}
    for i in range(len(ranks[0][key])):
        posted = {}
        for r in ranks:
            for name, _, end in r[msgs][i]:
                m = MESSAGE_SPAN.match(name)
                if m.group(2) == "posted":
                    posted[m.group(1)] = end
        for k, r in enumerate(ranks):
            got = dict.fromkeys(MEASURED_PARTS, 0.0)
            for name, start, end in r[msgs][i]:
                m = MESSAGE_SPAN.match(name)
                if m.group(2) == "send awaited":
                    got["send"] += end - start
                elif m.group(2) == "awaited":
                    if m.group(1) not in posted:
                        raise ValueError(f"step {i}: rank {k} waited for message {m.group(1)} that no rank posted")
                    before = max(0.0, min(end, posted[m.group(1)]) - start)
                    got["peer"] += before
                    got["message"] += end - start - before
            total = _blocked(r[key][i])
            got["posting"] = max(0.0, total - got["peer"] - got["message"] - got["send"])
            got["exposed"] = total - got["peer"]
            for p in MEASURED_PARTS:
                parts[p][k].append(got[p])
    return {p: statistics.mean(statistics.median(x) for x in v) for p, v in parts.items()}


def overlap_table(res: dict, ranks: list[dict]) -> dict:
    """``--waves``: the Spindle plan with producer-posted transfers (``spindle``) and the same waves posted at
    the consumer's wave boundary (``spindle-boundary``), measured in the same run: step, transfer exposed per
    step, both predicted, and each one's speedup over sequential (one pass). The exposed transfer is the
    trace's (:func:`exposed_parts`: posting and waiting for messages their senders had posted) against the
    simulator's same split of each rank's time (``pred.waits``); waiting for a peer that had not posted yet
    beside it, and the simulator's other figure, what the transfers add to the pass (its breakdown)."""
    seq = statistics.median(_step_series(ranks, "sequential", "step"))
    sims = res["pred"]["sims"]
    out = {}
    for name, waves, msgs in (("spindle", "waves", "messages"), (BOUNDARY, "boundary_waves", "boundary_messages")):
        step = statistics.median(_step_series(ranks, name, "step"))
        parts = exposed_parts(ranks, waves, msgs)
        exposed, peer = parts["exposed"], parts["peer"]
        waits = res["pred"]["waits"][name]
        pred = statistics.mean(w["posting"] + w["message"] for w in waits) / 1e3
        out[name] = {"measured_step_s": step, "predicted_step_s": sims[name]["step_ms"] / 1e3,
                     "measured_exposed_transfer_s": exposed, "predicted_exposed_transfer_s": pred,
                     "exposed_transfer_error": pred / exposed - 1 if exposed > 0 else math.nan,
                     "measured_peer_wait_s": peer, "measured_parts_s": parts,
                     "predicted_parts_s": {p: statistics.mean(w[p] for w in waits) / 1e3 for p in waits[0]},
                     "predicted_peer_wait_s": statistics.mean(w["peer"] for w in waits) / 1e3,
                     "predicted_added_by_transfers_s": sims[name]["breakdown"]["transfer_ms"] / 1e3,
                     "measured_speedup_vs_sequential": seq / step,
                     "predicted_speedup_vs_sequential": sims["sequential"]["step_ms"] / sims[name]["step_ms"]}
    worst = 0.0
    for a, b in zip(res["losses"]["spindle"], res["losses"][BOUNDARY]):
        for t in a:
            worst = max(worst, abs(a[t] - b[t]) / max(abs(b[t]), 1e-12))
    out["max_loss_rel_diff"] = worst
    out["planned_posting"] = res["pred"]["planned_posting"]  # which of the two the planner picked
    return out


def format_overlap(o: dict) -> str:
    """The ``--waves`` comparison of producer-posted and boundary-posted transfers, one line each."""
    lines = [f"{'transfers posted':<34}{'step meas':>12}{'pred':>12}{'exposed transfer meas':>24}{'pred':>12}"
             f"{'error':>9}{'waiting for peers meas':>25}{'pred':>12}{'speedup vs sequential meas':>29}{'pred':>8}"]
    for name, label in (("spindle", "at the producer's end (overlap)"), (BOUNDARY, "at the consumer's wave")):
        r = o[name]
        lines.append(f"{label:<34}{r['measured_step_s'] * 1e3:>9.2f} ms{r['predicted_step_s'] * 1e3:>9.2f} ms"
                     f"{r['measured_exposed_transfer_s'] * 1e3:>21.2f} ms{r['predicted_exposed_transfer_s'] * 1e3:>9.2f} ms"
                     f"{r['exposed_transfer_error']:>+9.1%}{r['measured_peer_wait_s'] * 1e3:>22.2f} ms"
                     f"{r['predicted_peer_wait_s'] * 1e3:>9.2f} ms{r['measured_speedup_vs_sequential']:>28.2f}x"
                     f"{r['predicted_speedup_vs_sequential']:>7.2f}x")
    lines.append("exposed transfer: each rank's posting and waiting for messages their senders had posted, per step "
                 "(mean over ranks); waiting for peers: blocked before the sender had posted (idle)")
    for name, label in (("spindle", "at the producer's end"), (BOUNDARY, "at the consumer's wave")):
        m, p = o[name]["measured_parts_s"], o[name]["predicted_parts_s"]
        lines.append(f"  {label}: posting {m['posting'] * 1e3:.2f} ms (pred {p['posting'] * 1e3:.2f}), waiting for "
                     f"posted messages {m['message'] * 1e3:.2f} ms (pred {p['message'] * 1e3:.2f}), for sends at the "
                     f"pass's end {m['send'] * 1e3:.2f} ms (pred 0)")
    lines.append(f"losses of the two postings agree within {o['max_loss_rel_diff']:.1e} (relative, every step and task)")
    return "\n".join(lines)


def wave_table(res: dict) -> list[dict]:
    """Per Spindle wave: predicted compute and transfer, and measured (median over steps, slowest rank)."""
    out = []
    ranks = res["ranks"]
    for w in res["pred"]["wave_pred"]:
        comp, xfer = [], []
        for step in range(len(ranks[0]["waves"])):
            per_rank_c, per_rank_t = [], []
            for r, rr in enumerate(ranks):
                wt = rr["waves"][step]
                per_rank_c.append(sum(wt.get(f"{name} {d}", 0.0) for name, rs in w["slices"] if r in rs
                                      for d in ("fwd", "bwd")))
                per_rank_t.append(wt.get(f"w{w['index']} fwd transfer", 0.0) + wt.get(f"w{w['index']} bwd transfer", 0.0))
            comp.append(max(per_rank_c))
            xfer.append(max(per_rank_t))
        out.append({"wave": w["index"], "predicted_compute_s": w["compute_s"], "measured_compute_s": statistics.median(comp),
                    "predicted_transfer_s": w["transfer_s"], "measured_transfer_s": statistics.median(xfer),
                    "slices": [name for name, _ in w["slices"]]})
    return out


def format_report(s: dict) -> str:
    ms = lambda x: f"{x * 1e3:8.2f} ms"  # noqa: E731
    lines = [
        f"{s['model']}, {s['tasks']} tasks, tiny, batch {s['batch']} per task, on {s['nproc']} gloo processes "
        f"({s['threads_per_process']} thread each); {s['steps']} timed steps after {s['warmup']} warm-up, medians",
        f"link (profiled): latency {s['link']['intra_latency_us']:.0f} us, bandwidth "
        f"{s['link']['intra_bandwidth_gbps']:.2f} GB/s; profile took {s['profile_s']:.1f} s",
        "",
        f"{'system':<36}{'measured':>12}{'predicted':>12}{'error':>9}{'waves':>7}   measured range",
    ]
    for k, label in (("sequential", "sequential (Megatron DDP, task by task)"), ("spindle", "Spindle plan")):
        meas = s["measured_step_s"] if k == "spindle" else s["sequential_measured_step_s"]
        pred = s["predicted_step_s"] if k == "spindle" else s["sequential_predicted_step_s"]
        err = s["prediction_error"] if k == "spindle" else s["sequential_prediction_error"]
        lo, hi = s["step_range_s"][k]
        lines.append(f"{label:<36}{ms(meas):>12}{ms(pred):>12}{err:>+9.1%}{s['waves'][k]:>7}   "
                     f"{lo * 1e3:.1f}-{hi * 1e3:.1f} ms")
    lines += [
        "",
        f"Spindle / sequential step time: measured {s['measured_ratio']:.3f} (speedup {s['measured_speedup']:.2f}x), "
        f"predicted {s['predicted_ratio']:.3f} (speedup {s['predicted_speedup']:.2f}x)",
        f"with the optimizer update (SGD, not simulated: sequential {s['optimizer_s']['sequential'] * 1e3:.2f} ms, "
        f"Spindle {s['optimizer_s']['spindle'] * 1e3:.2f} ms): measured ratio {s['measured_ratio_with_optimizer']:.3f}",
        "Spindle step, measured (mean over ranks) vs predicted:",
    ]
    mb, pb = s["spindle_measured_breakdown_s"], s["spindle_predicted_breakdown_s"]
    lines.append(f"  compute (fwd+bwd) {(mb['forward'] + mb['backward']) * 1e3:7.2f} ms busy   predicted "
                 f"{pb['compute_s'] * 1e3:7.2f} ms busy + {pb['idle_s'] * 1e3:.2f} ms idle")
    lines.append(f"  transfer          {mb['transfer'] * 1e3:7.2f} ms        predicted {pb['transfer_s'] * 1e3:7.2f} ms"
                 "   (measured: inter-wave send/recv incl. waiting for the peer)")
    lines.append(f"  gradient sync     {mb['sync'] * 1e3:7.2f} ms        predicted {pb['sync_s'] * 1e3:7.2f} ms"
                 "   (measured incl. waiting for the peer's backward)")
    lines.append(f"losses of the two systems agree within {s['max_loss_rel_diff']:.1e} (relative, every step and task); "
                 f"1-min load average at the end {s['load_average_1min']:.2f}")
    sweep = ", ".join(f"{p} pass{'es' if p > 1 else ''} {t * 1e3:.2f} ms" for p, t in s["sequential_sweep_step_s"].items())
    lines += [
        "",
        f"sequential at each pass count (batch / passes per task per pass, measured): {sweep}",
        f"Spindle / best sequential ({s['sequential_best_passes']} pass{'es' if s['sequential_best_passes'] > 1 else ''}, "
        f"micro-batch {s['sequential_best_micro_batch']} per task): measured {s['measured_ratio_vs_best_sequential']:.3f}",
        "",
        "activation memory, largest rank: bytes kept for backward at the peak of a step (measured, fp32) / the "
        "planner's estimate (bf16, x2 for fp32)",
    ]
    kib = lambda b: f"{b / 1024:8.1f} KiB"  # noqa: E731
    for system, label in (("sequential", f"sequential ({s['activation_memory']['sequential']['passes']} pass(es))"),
                          ("spindle", "Spindle plan")):
        for mode in ("none", "selective", "full"):
            m = s["activation_memory"][system][mode]
            lines.append(f"  {label:<26}{mode:<10}{kib(m['measured_bytes'])} / {kib(m['planned_bytes'] * FP32_OVER_BF16)}"
                         f"   ({m['measured_over_planned']:.2f})")
    return "\n".join(lines)
