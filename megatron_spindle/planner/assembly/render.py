"""Plans as people read them: a MetaOp table, a wave × device grid, a summary, and a Gantt PNG.

The grid names each MetaOp by a short code (``A``, ``B``, … ``AA``) listed in the MetaOp table; a cell reads
``C8-15`` (layers 8 to 15 of MetaOp C). Adjacent devices whose columns are identical in every wave are
merged into one column (``d0-7``) so large clusters stay readable. Matplotlib is needed only for the PNG.
"""
from __future__ import annotations

import string
from typing import Iterable

from ...atomic import write_file
from .plan import Plan


def codes(plan: Plan) -> dict[str, str]:
    """MetaOp name -> short code, in MetaOp order."""
    out = {}
    letters = string.ascii_uppercase
    for i, m in enumerate(plan.metaops):
        code = ""
        j = i
        while True:
            code = letters[j % 26] + code
            j = j // 26 - 1
            if j < 0:
                break
        out[m.name] = code
    return out


def _cell_table(plan: Plan) -> list[list[str]]:
    c = codes(plan)
    rows = []
    for w in plan.waves:
        row = ["."] * plan.world_size
        for s in w.slices:
            label = f"{c[s.metaop]}{s.layer_start}" + (f"-{s.layer_stop - 1}" if s.num_layers > 1 else "")
            for r in s.ranks:
                if 0 <= r < plan.world_size:
                    row[r] = label if row[r] == "." else row[r] + "!"
        rows.append(row)
    return rows


def wave_levels(plan: Plan, wave) -> str:
    """The MetaLevels of the MetaOps a wave runs: ``1``, ``0-2`` (consecutive) or ``0,2``; ``-`` for an empty
    wave. Read from the MetaOps, not from the wave's ``level`` field: a baseline's schedule numbers that field
    by wave (its waves are not level-by-level) and a manual plan leaves it 0."""
    level = {m.name: m.level for m in plan.metaops}
    found = sorted({level[s.metaop] for s in wave.slices})
    if not found:
        return "-"
    if len(found) > 1 and found == list(range(found[0], found[-1] + 1)):
        return f"{found[0]}-{found[-1]}"
    return ",".join(map(str, found))


def grid(plan: Plan, *, mark: Iterable[tuple[int, int]] = ()) -> str:
    """The wave × device grid; cells in ``mark`` ((wave, device) pairs) are shown as ``>cell<``."""
    rows = _cell_table(plan)
    mark = set(mark)
    # merge identical adjacent device columns (never merge a marked cell)
    groups: list[tuple[int, int]] = []
    for d in range(plan.world_size):
        col = [r[d] for r in rows]
        if (groups and [r[groups[-1][0]] for r in rows] == col and plan.world_size > 16
                and not any((w, d) in mark or (w, groups[-1][0]) in mark for w in range(len(rows)))):
            groups[-1] = (groups[-1][0], d)
        else:
            groups.append((d, d))
    heads = [f"d{a}" if a == b else f"d{a}-{b}" for a, b in groups]
    cells = []
    for wi, r in enumerate(rows):
        line = []
        for (a, b) in groups:
            v = r[a]
            line.append(f">{v}<" if any((wi, d) in mark for d in range(a, b + 1)) else v)
        cells.append(line)
    width = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(heads)]
    phased = len(plan.phases) > 1
    lead = [f"w{w.index} L{wave_levels(plan, w)}{f' P{w.phase}' if phased else ''} {w.duration_ms:8.2f}ms"
            for w in plan.waves]
    lw = max([len("wave level   time")] + [len(x) for x in lead])
    head = "wave level phase   time" if phased else "wave level   time"
    lw = max(lw, len(head))
    out = [head.ljust(lw) + " | " + " ".join(h.ljust(width[i]) for i, h in enumerate(heads))]
    out.append("-" * len(out[0]))
    for wi, line in enumerate(cells):
        out.append(lead[wi].ljust(lw) + " | " + " ".join(v.ljust(width[i]) for i, v in enumerate(line)))
    return "\n".join(out)


def backward_kind(m) -> str:
    """What a MetaOp's backward computes: ``full``, ``input grad`` (frozen weights, a trainable MetaOp
    before it) or ``none`` (forward only: frozen, nothing trainable before it)."""
    if m.trainable:  # a MetaOp without weights is "trainable" exactly when a MetaOp before it is
        return "full"
    return "input grad" if m.input_grad else "none"


def metaop_table(plan: Plan) -> str:
    """One row per MetaOp; with frozen MetaOps a ``backward`` column says what their backward computes
    (``input grad (frozen)``, ``none (frozen)``)."""
    c = codes(plan)
    n_star = {m: n for lv in plan.levels for m, n in lv.n_star}
    frozen = any(backward_kind(m) != "full" for m in plan.metaops)
    rows = [("code", "MetaOp", "lvl", "layers", "batch", "tp", "recompute", "n*", "slices (devices x layers)",
             "curve", "fit err") + (("backward",) if frozen else ())]
    for m in plan.metaops:
        sl = [s for s in plan.slices() if s.metaop == m.name]
        desc = " ".join(f"{len(s.ranks)}x{s.num_layers}" for s in sl)
        kind = backward_kind(m) + ("" if m.trainable or not any(m.param_keys) else " (frozen)")
        rows.append((c[m.name], m.name, str(m.level), str(m.num_layers), str(m.batch), str(m.tp),
                     "-" if m.recompute == "none" else m.recompute,
                     f"{n_star.get(m.name, 0):.2f}", desc, plan.curve(m.name).source,
                     f"{plan.curve(m.name).fit_error:.1%}") + ((kind,) if frozen else ()))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(width[i]) for i, v in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def certified_bound_ms(plan: Plan) -> float:
    """Σ over levels of the certified integer-aware bound (:mod:`..step.solver`; ``C*`` where it did not run)."""
    return sum(lv.certified_bound_ms for lv in plan.levels)


def bound_kinds(plan: Plan) -> str:
    """How each level's bound was found, e.g. ``2 optimal, 3 area, 1 C*``."""
    kinds: dict[str, int] = {}
    for lv in plan.levels:
        kinds[lv.bound_kind] = kinds.get(lv.bound_kind, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))


def summary(plan: Plan, planning_s: float | None = None) -> str:
    mem = plan.device_memory_bytes
    ratio = plan.makespan_ms / plan.lower_bound_ms if plan.lower_bound_ms else float("nan")
    bound = certified_bound_ms(plan)
    gap = plan.makespan_ms / bound - 1 if bound else float("nan")
    chosen = plan.levels[0].variant if plan.levels else ""
    recomputed = sum(m.recompute != "none" for m in plan.metaops)
    lines = [
        f"model {plan.model}: {len(plan.tasks)} tasks, {len(plan.metaops)} MetaOps in {plan.num_levels} levels, "
        f"{plan.world_size} devices ({plan.gpus_per_node} per island), {len(plan.waves)} waves",
        f"execution   {plan.passes} pass{'es' if plan.passes != 1 else ''} per step, {len(plan.phases)} "
        f"phase{'s' if len(plan.phases) != 1 else ''}, {recomputed} MetaOp(s) recomputed, "
        f"{'distributed' if plan.distributed_optimizer else 'replicated'} optimizer state",
        f"makespan      {plan.makespan_ms:10.2f} ms   (predicted compute time of one step)",
        f"sum C*        {plan.lower_bound_ms:10.2f} ms   (relaxed lower bound: sum over levels of C*)",
        f"bound         {bound:10.2f} ms   (certified for level-by-level wave schedules, per level: "
        f"{bound_kinds(plan)})",
        f"ratio         {ratio:10.3f}   (makespan / sum C*); gap to the certified bound {gap:.1%}",
        *([f"schedule      the {chosen.split(' schedule')[0]} schedule: its simulated step is shorter than "
           f"Spindle's own waves"] if "whole step" in chosen else []),
        f"memory        max {max(mem) / 2**30:.2f} GiB, min {min(mem) / 2**30:.2f} GiB per device "
        f"(limit {plan.memory_limit_bytes / 2**30:.1f} GiB)",
        f"transfers     {sum(t.bytes - t.local_bytes for t in plan.transfers) / 2**20:.1f} MiB moved per "
        f"step forward, {sum(t.cross_island_bytes for t in plan.transfers) / 2**20:.1f} MiB across islands",
    ]
    frozen = [m for m in plan.metaops if not m.trainable and any(m.param_keys)]
    if frozen:
        fwd_only = sum(1 for m in frozen if not m.input_grad)
        params = sum({k: m.params_per_layer for m in frozen for k in m.param_keys if k}.values())
        lines.append(f"frozen        {len(frozen)} of {len(plan.metaops)} MetaOps ({fwd_only} forward only, "
                     f"{len(frozen) - fwd_only} input gradient only), {params / 1e6:.1f} M parameters: no "
                     f"gradient sync, no optimizer state")
    if planning_s is not None:
        lines.append(f"planning time {planning_s:10.3f} s")
    return "\n".join(lines)


def idle_devices(plan: Plan) -> list[int]:
    """Devices that run no slice in any wave of ``plan``."""
    used = {r for w in plan.waves for s in w.slices for r in s.ranks}
    return [d for d in range(plan.world_size) if d not in used]


def idle_warning(plan: Plan) -> str | None:
    """One line saying how many devices the plan leaves unused and why, or ``None`` when it uses them all.

    A level can use at most ``Σ_m max valid count of m`` devices (one slice per MetaOp per wave); when that
    is below the cluster size in every level, the rest of the devices cannot be used by any wave schedule.
    """
    idle = idle_devices(plan)
    if not idle:
        return None
    by_level: dict[int, int] = {}
    for m in plan.metaops:
        counts = m.valid_counts(plan.world_size)
        by_level[m.level] = by_level.get(m.level, 0) + (counts[-1] if counts else 0)
    usable = max(by_level.values(), default=0)
    batches = sorted({m.batch for m in plan.metaops})
    why = (f"no level can use more than {usable} devices (a MetaOp runs on its TP degree times a divisor of "
           f"its global batch, {'/'.join(map(str, batches[:4]))}{'...' if len(batches) > 4 else ''}); "
           f"a larger --batch or fewer --gpus would use them") if usable < plan.world_size else \
        "the schedule found no use for them"
    return f"warning: {len(idle)} of {plan.world_size} devices stay idle in every wave: {why}"


def _pyplot():
    try:
        import matplotlib  # optional: matplotlib (--gantt only)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: matplotlib (--gantt only)
    except ImportError:
        raise ValueError("--gantt needs matplotlib (pip install matplotlib)") from None
    return plt


def device_ticks(world_size: int, most: int = 32) -> list[int]:
    """The devices the Gantt's axis names: every one up to ``most``, else every 2nd, 4th, ... (a power of 2,
    so island boundaries of 8 stay on ticks), at most ``most`` of them."""
    step = 1
    while -(-world_size // step) > most:
        step *= 2
    return list(range(0, world_size, step))


def gantt_figure(plan: Plan, *, title: str | None = None):
    """The matplotlib figure of :func:`gantt` (the caller closes it: ``matplotlib.pyplot.close(fig)``)."""
    plt = _pyplot()
    c = codes(plan)
    palette = [plt.get_cmap(name)(k) for name in ("tab20", "tab20b", "tab20c") for k in range(20)]
    color = {m.name: palette[i % len(palette)] for i, m in enumerate(plan.metaops)}
    shown = plan.metaops[:60]
    legend_cols = 3
    legend_rows = -(-len(shown) // legend_cols)
    chart_h = max(2.5, min(14, 0.28 * plan.world_size + 1.5))
    legend_h = 0.16 * legend_rows + 0.3  # inches: the legend goes under the chart, in columns, all of it shown
    fig, ax = plt.subplots(figsize=(12, chart_h + legend_h))
    for w in plan.waves:
        for s in w.slices:
            for r in s.ranks:
                ax.broken_barh([(w.start_ms, s.time_ms)], (r - 0.4, 0.8), facecolors=color[s.metaop],
                               edgecolor="black", linewidth=0.3)
            if s.time_ms > 0.04 * plan.makespan_ms and plan.world_size <= 64:
                mid = sum(s.ranks) / len(s.ranks)
                ax.text(w.start_ms + s.time_ms / 2, mid, f"{c[s.metaop]}{s.layer_start}-{s.layer_stop - 1}",
                        ha="center", va="center", fontsize=6)
        ax.axvline(w.start_ms, color="grey", linewidth=0.4, linestyle=":")
    ax.set_ylim(plan.world_size - 0.5, -0.5)
    ticks = device_ticks(plan.world_size)
    ax.set_yticks(ticks, [f"d{d}" for d in ticks])
    ax.set_xlim(0, plan.makespan_ms)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("device")
    ax.set_title(title or f"{plan.model} on {plan.world_size} devices: {len(plan.waves)} waves, "
                          f"makespan {plan.makespan_ms:.1f} ms (lower bound {plan.lower_bound_ms:.1f} ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[m.name]) for m in shown]
    labels = [f"{c[m.name]} {m.name}" for m in shown]
    if len(plan.metaops) > len(shown):
        labels[-1] += f" (+{len(plan.metaops) - len(shown)} more)"
    fig.tight_layout(rect=(0, legend_h / (chart_h + legend_h), 1, 1))
    fig.legend(handles, labels, fontsize=6, loc="lower left", ncol=legend_cols, frameon=False,
               bbox_to_anchor=(0.01, 0.0), handlelength=1.2, columnspacing=1.5)
    return fig


def gantt(plan: Plan, path: str, *, title: str | None = None) -> str:
    """Draw the waves per device as a PNG at exactly ``path`` (one bar per slice and device, colour per
    MetaOp, devices named d0, d1, ...); returns the path written."""
    fig = gantt_figure(plan, title=title)
    plt = _pyplot()
    try:
        write_file(path, lambda fh: fig.savefig(fh, format="png", dpi=130, bbox_inches="tight"), "Gantt chart")
    finally:
        plt.close(fig)
    return path
