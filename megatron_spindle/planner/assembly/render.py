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


def summary(plan: Plan, planning_s: float | None = None, *, configuration: str | None = None,
            schedule: str | None = None) -> str:
    """The plan in a few lines. The per-pass compute makespan is shown with Σ C* and the certified bound only
    when the waves run level by level (:attr:`.plan.Plan.level_by_level`), the only plans those bounds bound;
    ``configuration`` and ``schedule`` (the whole-step candidate that won), when given, say how it was chosen."""
    mem = plan.device_memory_bytes
    chosen = plan.levels[0].variant if plan.levels else ""
    recomputed = sum(m.recompute != "none" for m in plan.metaops)
    lines = [
        f"model {plan.model}: {len(plan.tasks)} tasks, {len(plan.metaops)} MetaOps in {plan.num_levels} levels, "
        f"{plan.world_size} devices ({plan.gpus_per_node} per island), {len(plan.waves)} waves",
        *([f"configuration {configuration}"] if configuration else []),
        f"execution     {plan.passes} pass{'es' if plan.passes != 1 else ''} per step, {len(plan.phases)} "
        f"phase{'s' if len(plan.phases) != 1 else ''}, {recomputed} MetaOp(s) recomputed, "
        f"{'distributed' if plan.distributed_optimizer else 'replicated'} optimizer state",
    ]
    if schedule and schedule != "spindle":
        lines.append(f"schedule      {schedule.removeprefix('spindle, ')} (the whole-step candidate with the "
                     f"shortest simulated step, docs/planning.md#whole-step-choice)")
    elif schedule is None and "whole step" in chosen:
        lines.append(f"schedule      the {chosen.split(' schedule')[0]} schedule: its simulated step is shorter "
                     f"than Spindle's own waves")
    lines += _makespan_lines(plan)
    lines += [
        f"memory        max {max(mem) / 2**30:.2f} GiB, min {min(mem) / 2**30:.2f} GiB per device "
        f"(limit {plan.memory_limit_bytes / 2**30:.1f} GiB)",
        f"transfers     {sum(t.bytes - t.local_bytes for t in plan.transfers) / 2**20:.1f} MiB moved per "
        f"pass forward, {sum(t.cross_island_bytes for t in plan.transfers) / 2**20:.1f} MiB across islands, "
        + ("posted as each producer ends" if plan.transfer_posting == "producer" else
           "posted at each consumer's wave (the shorter step for this plan)"),
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


def _makespan_lines(plan: Plan) -> list[str]:
    """The per-pass compute makespan and its bounds, for a level-by-level plan; else one line saying why not."""
    if not plan.level_by_level:
        return ["makespan      -            (not level by level: the waves run side by side or across levels, "
                "so sum C* bounds none of this plan's figures; the step and the step bound measure it)"]
    bound = certified_bound_ms(plan)
    ratio = plan.makespan_ms / plan.lower_bound_ms if plan.lower_bound_ms else float("nan")
    gap = plan.makespan_ms / bound - 1 if bound else float("nan")
    return [f"makespan      {plan.makespan_ms:10.2f} ms   (compute of one pass, the waves one after another; "
            f"transfers and sync not included)",
            f"sum C*        {plan.lower_bound_ms:10.2f} ms   (relaxed lower bound of level-by-level schedules: sum "
            f"over levels of C*); makespan / sum C* {ratio:.3f}",
            f"bound         {bound:10.2f} ms   (certified for level-by-level wave schedules, per level: "
            f"{bound_kinds(plan)}); gap to the certified bound {gap:.1%}"]


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


PLOT_HINT = "pip install -e '.[plot]' (matplotlib)"


def check_plotting(what: str) -> None:
    """A ``ValueError`` in one line when matplotlib is missing: ``what`` (``--gantt``) needs it."""
    try:
        import matplotlib  # noqa: F401  # optional: matplotlib (--gantt only)
    except ImportError:
        raise ValueError(f"{what} needs matplotlib: {PLOT_HINT}") from None


def _pyplot():
    check_plotting("--gantt")
    import matplotlib  # optional: matplotlib (--gantt only)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (--gantt only)
    return plt


def grid_key(plan: Plan, width: int = 116) -> str:
    """The grid's key: every MetaOp's code and name, wrapped to ``width`` columns."""
    c = codes(plan)
    entries = [f"{c[m.name]} {m.name}" for m in plan.metaops]
    lines, line = [], []
    for e in entries:
        if line and 5 + sum(len(x) + 2 for x in line) + len(e) > width:
            lines.append(line)
            line = []
        line.append(e)
    lines.append(line)
    return "\n".join(("key: " if i == 0 else "     ") + "  ".join(x) for i, x in enumerate(lines))


def device_ticks(world_size: int, most: int = 32) -> list[int]:
    """The devices the Gantt's axis names: every one up to ``most``, else every 2nd, 4th, ... (a power of 2,
    so island boundaries of 8 stay on ticks), at most ``most`` of them."""
    step = 1
    while -(-world_size // step) > most:
        step *= 2
    return list(range(0, world_size, step))


#: Gantt geometry, inches: chart width, height per device (within limits), legend row height.
_WIDTH_IN, _ROW_IN, _KEY_ROW_IN = 12.0, 0.26, 0.125
_LABEL_PT = 6.0


def _runs(ranks) -> list[tuple[int, int]]:
    """Contiguous runs ``(first, last)`` of sorted ``ranks``."""
    out: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def _bars(plan: Plan, timeline) -> list[tuple[object, float, float, bool]]:
    """``(slice, start, end, backward)`` of every bar: the pass's forward and backward spans from ``timeline``
    (:func:`megatron_spindle.plan_output.pass_timeline`), else each slice at its wave's start (the compute
    schedule of the waves one after another)."""
    out = []
    for w in plan.waves:
        for s in w.slices:
            if timeline is None:
                out.append((s, w.start_ms, w.start_ms + s.time_ms, False))
            else:
                for kind in ("fwd", "bwd"):
                    a, b = timeline[(s.name, kind)]
                    out.append((s, a, b, kind == "bwd"))
    return out


def gantt_figure(plan: Plan, *, title: str | None = None, timeline=None, step: str | None = None):
    """The matplotlib figure of :func:`gantt` (the caller closes it: ``matplotlib.pyplot.close(fig)``).

    One bar per slice and device, a colour per MetaOp, a code on a bar wide enough for it (``C8-15``: layers
    8-15 of MetaOp C), every MetaOp in the key under the chart; the title gives the step (``step``) when the
    caller has simulated it, else the makespan (with Σ C* only for a level-by-level plan)."""
    plt = _pyplot()
    c = codes(plan)
    palette = [plt.get_cmap(name)(k) for name in ("tab20", "tab20b", "tab20c") for k in range(20)]
    color = {m.name: palette[i % len(palette)] for i, m in enumerate(plan.metaops)}
    bars = _bars(plan, timeline)
    end = max([b for _, _, b, _ in bars] + [plan.makespan_ms if timeline is None else 0.0, 1e-9])
    key_cols = 4 if len(plan.metaops) > 24 else 3
    key_rows = -(-len(plan.metaops) // key_cols)
    chart_h = max(2.5, min(16.0, _ROW_IN * plan.world_size + 1.0))
    key_h = _KEY_ROW_IN * key_rows + 0.05
    gap_h = 0.6  # inches between the chart and the key: the time axis's ticks and label
    total_h = chart_h + gap_h + key_h + 0.55
    fig, (ax, kx) = plt.subplots(2, 1, figsize=(_WIDTH_IN, total_h), gridspec_kw={
        "height_ratios": [chart_h, key_h], "hspace": gap_h / ((chart_h + key_h) / 2)})
    fig.subplots_adjust(left=0.06, right=0.99, top=1 - 0.45 / total_h, bottom=0.01)
    for s, a, b, backward in bars:
        for r in s.ranks:
            ax.broken_barh([(a, b - a)], (r - 0.4, 0.8), facecolors=color[s.metaop], edgecolor="black",
                           linewidth=0.3, hatch="////" if backward else None, alpha=0.75 if backward else 1.0)
    axis_pt = _WIDTH_IN * 0.93 * 72
    for s, a, b, backward in bars:
        if backward or plan.world_size > 64:
            continue
        label = f"{c[s.metaop]}{s.layer_start}" + (f"-{s.layer_stop - 1}" if s.num_layers > 1 else "")
        if (b - a) / end * axis_pt < (len(label) * 0.62 + 0.8) * _LABEL_PT:
            continue  # a label wider than its bar would overlap its neighbours
        lo, hi = max(_runs(s.ranks), key=lambda run: run[1] - run[0])
        ax.text((a + b) / 2, (lo + hi) // 2, label, ha="center", va="center", fontsize=_LABEL_PT)  # on a bar
    if timeline is None:
        for w in plan.waves:
            ax.axvline(w.start_ms, color="grey", linewidth=0.4, linestyle=":")
    for d in range(plan.gpus_per_node, plan.world_size, plan.gpus_per_node):
        ax.axhline(d - 0.5, color="black", linewidth=0.6)  # island boundaries
    ax.set_ylim(plan.world_size - 0.5, -0.5)
    ticks = device_ticks(plan.world_size)
    ax.set_yticks(ticks, [f"d{d}" for d in ticks])
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ms)" + (": one pass, forward then backward (hatched), as the simulator runs it"
                                 if timeline is not None else ": the waves one after another (compute only)"))
    ax.set_ylabel("device")
    ax.set_title(title or _gantt_title(plan, step), fontsize=10)
    kx.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[m.name]) for m in plan.metaops]
    kx.legend(handles, [f"{c[m.name]} {m.name}" for m in plan.metaops], fontsize=_LABEL_PT, loc="upper left",
              ncol=key_cols, frameon=False, handlelength=1.2, columnspacing=1.5, borderaxespad=0.0,
              mode="expand", bbox_to_anchor=(0.0, 1.0, 1.0, 0.0))
    return fig


def _gantt_title(plan: Plan, step: str | None) -> str:
    head = f"{plan.model}, {len(plan.tasks)} tasks on {plan.world_size} devices, {len(plan.waves)} waves"
    if step:
        return f"{head}: {step}"
    if plan.level_by_level:
        return (f"{head}: makespan {plan.makespan_ms:.1f} ms per pass, compute only (sum C* "
                f"{plan.lower_bound_ms:.1f} ms)")
    return f"{head}: compute {plan.makespan_ms:.1f} ms per pass with the waves one after another"


def gantt(plan: Plan, path: str, *, title: str | None = None, timeline=None, step: str | None = None) -> str:
    """Draw the plan per device as a PNG at exactly ``path`` (:func:`gantt_figure`); returns the path written."""
    fig = gantt_figure(plan, title=title, timeline=timeline, step=step)
    plt = _pyplot()
    try:
        write_file(path, lambda fh: fig.savefig(fh, format="png", dpi=130, bbox_inches="tight"), "Gantt chart")
    finally:
        plt.close(fig)
    return path
