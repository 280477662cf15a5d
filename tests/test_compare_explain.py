"""``spindle compare`` explains every row: the best baseline, the parts of the difference,
the candidate that won, Spindle's own best waves, the whole-step bound under every system's step, and each
plan's sync floor under its own step."""
import json

from megatron_spindle import cli
from megatron_spindle.compare.cli import compare, format_table
from megatron_spindle.compare.explain import PARTS, TUNED_BASELINES
from megatron_spindle.planner.tuning.tune import Workload


def test_a_row_is_explained_and_the_parts_add_up():
    (cmp,) = compare(Workload(model="multitask-clip", tasks=4, size="tiny", batch=8), [8])
    e = cmp.explanation
    steps = {k: r.sim.step_ms for k, r in cmp.results.items() if r.ok}
    assert e.baseline == min((steps[k], k) for k in TUNED_BASELINES if k in steps)[1]
    sp, b = cmp.results["spindle"].sim.breakdown, cmp.results[e.baseline].sim.breakdown
    assert abs(sum(e.diff[p] for p in PARTS) - (steps["spindle"] - steps[e.baseline])) < 1e-6 * steps["spindle"]
    assert abs(e.diff["sync"] - (sp.sync_ms - b.sync_ms)) < 1e-9
    assert e.winner in [c["name"] for c in e.candidates]
    assert min(c["step_ms"] for c in e.candidates if c["fits"]) == steps["spindle"]
    assert e.own_name is not None and e.own_ms >= steps["spindle"]
    for k, bound in e.bounds.items():  # each system's bound is under its step
        assert bound <= steps[k] * (1 + 1e-9)
    assert set(e.sync_floor) == {"spindle", e.baseline}
    for k, (f, floor) in e.sync_floor.items():  # each plan's sync floor is under its own step
        assert f.busy_ms > 0 and floor <= steps[k] * (1 + 1e-9)
    text = format_table(cmp)
    assert "sync floor" in text and "whole-step bound" in text and f"candidate '{e.winner}'" in text and "own waves" in text


def test_compare_json_carries_the_explanation(capsys):
    assert cli.main(["compare", "--model", "multitask-clip", "--tasks", "4", "--size", "tiny", "--batch", "8",
                     "--gpus", "8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    ex = row["explain"]
    assert ex["best_baseline"] in TUNED_BASELINES and ex["winner"]
    assert set(ex["spindle_minus_baseline_ms"]) == set(PARTS)
    assert ex["step_bound"]["bound_ms"] <= row["systems"]["spindle"]["step_ms"]
    assert ex["sync_floor"]["spindle"]["step_floor_ms"] <= row["systems"]["spindle"]["step_ms"] * (1 + 1e-9)
