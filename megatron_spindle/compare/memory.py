"""Memory per device in ``spindle compare``: each system's peak and how evenly it spreads over the devices.

The figures are each plan's own estimate of every device's peak (:attr:`..planner.assembly.plan.Plan.device_memory_bytes`:
model states of the layers a device holds plus its largest phase's stash, under the system's own runtime
memory rule, the one its tuner fitted it with); this module only reads them. *Spread* is the largest minus the
smallest peak over all the cluster's devices (a device that holds nothing counts at 0 GiB: memory it could
have held), *stdev* their standard deviation. The paper (Wang et al., ASPLOS 2025) reports Spindle's
per-device memory lower and more balanced than the baselines'; :func:`memory_line` says where each row
stands against that claim.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

GIB = 2**30


def memory_stats(peaks: Sequence[float]) -> dict:
    """``{max_gib, min_gib, mean_gib, spread_gib, stdev_gib}`` of per-device peaks in bytes."""
    if not peaks:
        return {"max_gib": 0.0, "min_gib": 0.0, "mean_gib": 0.0, "spread_gib": 0.0, "stdev_gib": 0.0}
    mean = math.fsum(peaks) / len(peaks)
    var = math.fsum((p - mean) ** 2 for p in peaks) / len(peaks)
    return {"max_gib": max(peaks) / GIB, "min_gib": min(peaks) / GIB, "mean_gib": mean / GIB,
            "spread_gib": (max(peaks) - min(peaks)) / GIB, "stdev_gib": math.sqrt(var) / GIB}


def memory_line(stats: Mapping[str, dict], usable_gib: float) -> str | None:
    """One line: Spindle's peak and spread against the baselines', beside the paper's claim (``stats``:
    system -> :func:`memory_stats`, in table order; ``None`` without Spindle or a baseline)."""
    sp = stats.get("spindle")
    others = {k: v for k, v in stats.items() if k not in ("spindle", "spindle-naive-placement")}
    if sp is None or not others:
        return None
    lowest = min(others, key=lambda k: others[k]["max_gib"])
    even = min(others, key=lambda k: others[k]["spread_gib"])
    lower = sp["max_gib"] <= others[lowest]["max_gib"] * (1 + 1e-9)
    flatter = sp["spread_gib"] <= others[even]["spread_gib"] * (1 + 1e-9)
    verdict = {(True, True): "at or below every baseline's in peak and in spread (the paper: lower and more balanced)",
               (True, False): "the lowest peak, but not the most even",
               (False, True): "the most even, but not the lowest peak",
               (False, False): "neither the lowest peak nor the most even"}[(lower, flatter)]
    return (f"memory per device (peak of each device, {usable_gib:.1f} GiB usable): Spindle max "
            f"{sp['max_gib']:.1f} GiB, spread {sp['spread_gib']:.1f} (max - min over the devices); lowest baseline "
            f"max {lowest} {others[lowest]['max_gib']:.1f}, most balanced baseline {even} "
            f"{others[even]['spread_gib']:.1f}: Spindle's is {verdict}")


def plot_memory(ax, cmps, systems: Sequence[str], colors: Mapping[str, str]) -> None:
    """Grouped bars of each system's peak memory per device (one group per device count), a line from the
    least-loaded device's peak to the most-loaded one's, and the usable memory dashed."""
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        for i, c in enumerate(cmps):
            r = c.results.get(system)
            if r is None or not r.ok:
                continue
            st = memory_stats(r.sim.peak_memory_bytes)
            x = i + (j - (len(systems) - 1) / 2) * width
            ax.bar([x], [st["max_gib"]], width, color=colors.get(system), alpha=0.85)
            ax.plot([x, x], [st["min_gib"], st["max_gib"]], color="black", linewidth=0.8)
            ax.plot([x - width / 4, x + width / 4], [st["min_gib"]] * 2, color="black", linewidth=0.8)
    usable = [c.usable_memory_gib for c in cmps if c.usable_memory_gib]
    if usable:
        ax.axhline(max(usable), color="black", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(cmps)))
    ax.set_xticklabels([f"{c.gpus} GPUs" for c in cmps])
    ax.set_ylabel("GiB per device\n(bar: max, line: min to max)", fontsize=7)
    ax.set_title("memory per device (dashed: usable per device)", fontsize=8)
