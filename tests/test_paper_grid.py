"""Spindle against every tuned baseline on the paper's grid and beyond it.

``scripts/bench_paper.py`` tunes every system on the paper's Figure 8 grid and at 64, 256 and 1024 GPUs (an
hour of planning on two cores) and writes each system's configuration and step to
``docs/results/paper_grid.json``. This test reads that file: Spindle's step is at or below every tuned
baseline's in every row, and the rows cover the grid. It also re-plans two rows at their recorded
configurations and checks the steps are the ones recorded (plans are the same bytes on every machine), so the
file cannot silently fall behind the planner: when the planner changes, rerun the script.
"""
import json
import pathlib

import pytest

from megatron_spindle.compare.cli import compare
from megatron_spindle.planner.assembly.execution import Execution
from megatron_spindle.planner.tuning.tune import Workload

ROOT = pathlib.Path(__file__).resolve().parents[1]
GRID_FILE = ROOT / "docs" / "results" / "paper_grid.json"
PAPER = [(m, k, g) for m, ks, gs in (("multitask-clip", (4, 7, 10), (8, 16, 32)), ("ofasys", (4, 7), (8, 16, 32)),
                                     ("qwen-val", (3,), (32, 64))) for k in ks for g in gs]
BASELINES = ("sequential", "task-level", "intra-task", "static-grids")


#: The paper's other rows: Qwen-VAL with a 30B and a 70B language model, and single tasks.
OTHER = [("qwen-val", 3, g, size) for size in ("30b", "70b") for g in (256, 1024)] + \
    [(m, 1, g, "full") for m, gs in (("multitask-clip", (8, 16, 32)), ("ofasys", (8, 16, 32)), ("qwen-val", (32, 64)))
     for g in gs]


def rows():
    """``{(model, tasks, GPUs): row}`` at full size and ``{(model, tasks, GPUs, size): row}`` at the others."""
    out = {}
    for r in json.loads(GRID_FILE.read_text())["rows"]:
        size = r.get("size", "full")
        out[(r["model"], r["tasks"], r["gpus"]) + (() if size == "full" else (size,))] = r
    return out


#: Where a tuned baseline's step is shorter than Spindle's in the file: (model, tasks, GPUs, baseline) -> Spindle's
#: speedup over it, as docs/compare.md ("Where the lead is small or absent") states it. Listed so that the claim stays
#: exactly what was measured: a new miss, a moved one or one that went away fails the test.
KNOWN_MISSES: dict = {}


def test_spindle_is_at_or_below_every_tuned_baseline_on_the_grid_and_beyond():
    got = rows()
    assert set(PAPER) <= set(got), sorted(set(PAPER) - set(got))
    other = {k[:3] if k[3] == "full" else k for k in OTHER}
    assert other <= set(got), sorted(other - set(got))
    for key in other:  # every system of these rows fits memory at its best configuration
        assert all(got[key]["systems"][s]["step_ms"] is not None for s in ("spindle",) + BASELINES), \
            (key, {s: got[key]["systems"][s]["error"] for s in ("spindle",) + BASELINES})
    assert {key[2] for key in got} >= {64, 256, 1024}
    misses = {}
    for key, r in got.items():
        spindle = r["systems"]["spindle"]["step_ms"]
        assert spindle is not None, (key, r["systems"]["spindle"]["error"])
        for b in BASELINES:
            t = r["systems"][b]["step_ms"]
            if t is not None and spindle > t * (1 + 1e-9):
                misses[(*key, b)] = t / spindle
    assert misses.keys() == KNOWN_MISSES.keys(), misses
    for k, v in misses.items():
        assert v == pytest.approx(KNOWN_MISSES[k], abs=1e-4), (k, v)
    assert not [k for k in PAPER for b in BASELINES if (*k, b) in misses]  # none on the paper's own grid


@pytest.mark.parametrize("key", [("multitask-clip", 4, 8), ("qwen-val", 3, 32)])
def test_the_grid_file_is_what_the_planner_gives_now(key):
    model, k, gpus = key
    r = rows()[key]
    for system in ("spindle",) + BASELINES:
        rec = r["systems"][system]
        if rec["configuration"] is None:
            continue
        ex = Execution.from_json(rec["configuration"])
        again = compare(Workload(model=model, tasks=k), [gpus], systems=(system,), fixed=ex)[0].results[system]
        assert again.ok and again.sim.step_ms == pytest.approx(rec["step_ms"], rel=1e-9), \
            (key, system, rec["step_ms"], again.sim.step_ms if again.ok else again.error,
             "docs/results/paper_grid.json is stale: rerun python scripts/bench_paper.py")
