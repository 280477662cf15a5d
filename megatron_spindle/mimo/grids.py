"""The best static per-module layout of a MIMO model, written as the ``module_to_grid_map`` a MIMO user writes.

MIMO's non-colocated mode gives each module (a modality's key in ``modality_submodules_spec``, and ``language``,
MIMO's ``MIMO_LANGUAGE_MODULE_KEY``) a ``HyperCommGrid`` of its own for the whole step. The planner's static-grids
baseline (:mod:`..planner.systems.static_grids`, tuned by :func:`..planner.tuning.tune.tune_static_grids`: the
modules' device shares, micro-batches, recompute, the distributed optimizer, TP) is that layout at its best; here
it becomes each module's grid: ``shape=[tp, cp, dp, pp]`` with ``dim_names=["tp", "cp", "dp", "pp"]`` (the order of
Megatron-LM's ``examples/mimo/training/topology.py`` at ``core_v0.19.0``) and ``rank_offset`` its first rank. ``tp``
is the largest of the module's MetaOps' (a grid has one); ``cp`` and ``pp`` are 1 (the planner sets neither inside a
module); ``dp`` is the grid's ranks over ``tp``. Spindle's own plan and what its waves gain over this layout come
beside it.
"""
from __future__ import annotations

DIMS = ("tp", "cp", "dp", "pp")


def grid_map(grids: dict) -> dict[str, dict[str, int]]:
    """``{module: {tp, cp, dp, pp, rank_offset, idle}}`` of the tuned static grids' ``extra["grids"]``, by rank
    offset; ``idle``: the grid's ranks beyond ``tp x dp`` (none when its ranks divide by ``tp``)."""
    out = {}
    for module, g in sorted(grids.items(), key=lambda kv: (kv[1]["rank_offset"], kv[0])):
        tp = int(g["tp"])
        dp = int(g["ranks"]) // tp
        out[module] = {"tp": tp, "cp": 1, "dp": dp, "pp": 1, "rank_offset": int(g["rank_offset"]),
                       "idle": int(g["ranks"]) - tp * dp}
    return out


def grids_json(static, spindle_step_ms: float | None) -> dict:
    """What ``spindle plan --mimo-grids --json`` adds: the map, the static layout's step, Spindle's, and the gain."""
    step = static.step_ms
    return {"module_to_grid_map": grid_map(static.extra["grids"]) if static.extra.get("grids") else None,
            "dim_names": list(DIMS), "configuration": static.execution.label() if static.execution else None,
            "micro_batches": static.extra.get("micro_batches"), "step_ms": step,
            "spindle_step_ms": spindle_step_ms,
            "spindle_speedup": step / spindle_step_ms if step and spindle_step_ms else None,
            "error": static.error}


def grids_lines(static, spindle_step_ms: float | None) -> str:
    """The map as Python a MIMO user pastes, with the static layout's step against Spindle's."""
    if static.step_ms is None or not static.extra.get("grids"):
        return f"MIMO grids: no static per-module layout fits ({static.error})"
    gm = grid_map(static.extra["grids"])
    mb = static.extra.get("micro_batches")
    used = max(g["rank_offset"] + g["tp"] * g["dp"] + g["idle"] for g in gm.values())
    gain = f"; Spindle's plan {spindle_step_ms:.2f} ms, {static.step_ms / spindle_step_ms:.2f}x faster" \
        if spindle_step_ms else ""
    lines = [f"MIMO's module_to_grid_map, the best static per-module layout ({static.execution.label()}, "
             f"{mb} micro-batch{'' if mb == 1 else 'es'}, ranks 0-{used - 1}): step {static.step_ms:.2f} ms{gain}",
             "from megatron.core.hyper_comm_grid import HyperCommGrid", "module_to_grid_map = {"]
    for module, g in gm.items():
        shape = ", ".join(str(g[d]) for d in DIMS)
        idle = f"  # {g['idle']} rank(s) of its share left idle" if g["idle"] else ""
        lines.append(f'    "{module}": HyperCommGrid(shape=[{shape}], dim_names={list(DIMS)}, '
                     f'rank_offset={g["rank_offset"]}),{idle}')
    lines.append("}")
    return "\n".join(lines)
