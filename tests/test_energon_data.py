"""Real data through megatron-energon: a tiny per-task dataset written and prepared on the spot, read by
each rank only where the plan needs it, and 3 training steps of the tiny Multitask-CLIP on 4 gloo ranks.

The check (:func:`check_reads`), for every task and step: each rank read exactly the batch positions of the
slices it runs (nothing else, nothing twice); every slice's data-parallel replicas together hold each
position once; a position is the same sample for every stream, slice and rank; and no sample comes back in
a later step of the epoch.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

pytest.importorskip("megatron.energon")

from megatron_spindle.data.sharding import lanes_for, rank_reads, stream_reads  # noqa: E402
from megatron_spindle.planner.step.build import plan_system  # noqa: E402
from megatron_spindle.planner.step.build import make_plan  # noqa: E402
from megatron_spindle.planner.workload.cluster import load_cluster  # noqa: E402
from megatron_spindle.planner.assembly.manual import plan_from_waves  # noqa: E402
from megatron_spindle.planner.workload.workloads import build_graph  # noqa: E402
from mp_harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
SAMPLES = 96
STEPS = 3
BATCH = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_energon_dataset",
                                                  os.path.join(ROOT, "scripts", "make_energon_dataset.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = str(tmp_path_factory.mktemp("energon"))
    assert script.main(["--model", "multitask-clip", "--tasks", "4", "--size", "tiny", "--samples", str(SAMPLES),
                        "--shard-size", "32", "--out", out]) == 0
    return out


def check_reads(plan, graph, logs: dict[int, list], steps: int) -> int:
    """Assert the reading rules (module docstring) on every rank's ``read_log``; returns positions checked."""
    reads = stream_reads(plan, graph)
    checked = 0
    for task in plan.tasks:
        mine = {r: rank_reads(plan, graph, r)[task] for r in logs}
        batch, lanes = mine[0].batch, mine[0].lanes_total
        per = batch // lanes
        earlier: set[str] = set()
        for step in range(steps):
            at: dict[int, dict[int, str]] = {r: {} for r in logs}
            for r, log in logs.items():
                for s, t, lane, keys in log:
                    if (s, t) != (step, task):
                        continue
                    assert len(keys) == per
                    for i, k in enumerate(keys):
                        assert lane * per + i not in at[r], f"rank {r} read position {lane * per + i} twice"
                        at[r][lane * per + i] = k
                held = set()
                for a, b in mine[r].streams.values():
                    held.update(range(a, b))
                assert set(at[r]) == held, \
                    f"rank {r} task {task} step {step}: read {sorted(at[r])}, holds {sorted(held)}"
            sample_at: dict[int, str] = {}
            for read in (x for x in reads if x.task == task):
                replicas: dict[tuple[int, int], list[int]] = {}
                for r in read.ranks:
                    replicas.setdefault(read.samples(r), []).append(r)
                    for p in range(*read.samples(r)):
                        assert sample_at.setdefault(p, at[r][p]) == at[r][p], f"position {p} differs on rank {r}"
                covered = sorted(p for a, b in replicas for p in range(a, b))
                assert covered == list(range(batch)), f"{read.slice}: replicas cover {covered}"
                assert len(replicas) == read.dp
            keys = set(sample_at.values())
            assert len(keys) == batch, f"task {task} step {step}: {batch - len(keys)} samples read twice"
            assert not keys & earlier, f"task {task} step {step}: samples of an earlier step again"
            earlier |= keys
            checked += len(sample_at)
    return checked


def _read_in_process(root, graph, plan, steps=STEPS):
    from megatron_spindle.data.energon import EnergonData
    logs, batches = {}, {}
    for rank in range(WORLD):
        data = EnergonData(root, graph, plan, rank, seed=3)
        batches[rank] = [next(data) for _ in range(steps)]
        logs[rank] = data.read_log
    return logs, batches


def _mixed_plan(graph):
    """vision-text only: the vision embedding data-parallel over 4 ranks, the text embedding over 2
    replicas of tp 2 (lanes = lcm(4, 2) = 4); partial, for the data rules only."""
    g = graph.subset(["vision-text"])
    waves = [[("vision-text.vision.embed", 0, 1, (0, 1, 2, 3))], [("vision-text.text.embed", 0, 1, (3, 2, 1, 0))]]
    return g, plan_from_waves(g, WORLD, waves, tp={"vision-text.text.embed": 2}, partial=True)


def test_lanes_are_the_lcm_of_the_reading_layouts():
    assert lanes_for([1, 4, 2], batch=16) == 4 and lanes_for([], batch=8) == 1
    with pytest.raises(ValueError, match="does not split into 3 lanes"):
        lanes_for([3], batch=16)
    g, plan = _mixed_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=BATCH))
    r0, r3 = rank_reads(plan, g, 0)["vision-text"], rank_reads(plan, g, 3)["vision-text"]
    assert (r0.lanes_total, r0.lanes, r0.streams) == (4, (0, 2, 3), {"vision": (0, 4), "text": (8, 16)})
    assert (r3.lanes, r3.streams) == ((0, 1, 3), {"vision": (12, 16), "text": (0, 8)})


@pytest.mark.parametrize("which", ["sequential", "spindle", "mixed"])
def test_each_rank_reads_only_its_own_samples(dataset, which):
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=BATCH)
    cluster = load_cluster(None, num_devices=WORLD, gpus_per_node=WORLD)
    if which == "mixed":
        graph, plan = _mixed_plan(graph)
    else:
        plan = plan_system("sequential", graph, cluster) if which == "sequential" else make_plan(graph, cluster)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logs, batches = _read_in_process(dataset, graph, plan)
    assert check_reads(plan, graph, logs, STEPS) == STEPS * BATCH * len(plan.tasks)
    task = plan.tasks[0]
    for rank, steps in batches.items():
        for stream, rows in steps[0][task].items():
            a = rows.start
            b = a + rows.tensor.shape[0]
            assert rows[a:b].shape[0] == b - a and rows.shape[0] == BATCH
            if (a, b) != (0, BATCH):
                with pytest.raises(IndexError, match="this rank read samples"):
                    rows[0:BATCH]
            if rows.tensor.is_floating_point():
                assert -1.0 <= float(rows.tensor.min()) and float(rows.tensor.max()) <= 1.0


def test_missing_task_dataset_is_one_line(dataset, tmp_path):
    from megatron_spindle.data.energon import EnergonData
    graph = build_graph("multitask-clip", tasks=7, size="tiny", batch=BATCH)
    plan = make_plan(graph, load_cluster(None, num_devices=WORLD, gpus_per_node=WORLD))
    with pytest.raises(ValueError, match=r"no energon dataset for task\(s\) vision-imu, audio-vision, depth-text"):
        EnergonData(dataset, graph, plan, 0)


# -- 3 training steps on 4 gloo ranks from the dataset -------------------------------------------------------
def _train(rank, world, root):
    import io
    from contextlib import redirect_stdout

    from megatron_spindle.data import energon
    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.trainer.loop import pretrain

    made = []
    real_init = energon.EnergonData.__init__

    def recording_init(self, *a, **k):
        real_init(self, *a, **k)
        made.append((self, a[2]))
    energon.EnergonData.__init__ = recording_init
    args = build_parser().parse_args([
        "--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", str(BATCH // world),
        "--train-iters", str(STEPS), "--spindle-predict-interval", "0", "--spindle-data", root, "--seed", "5"])
    with redirect_stdout(io.StringIO()):
        result = pretrain(args)
    (data, plan), = made
    bad = build_parser().parse_args(["--spindle-size", "tiny", "--spindle-data", root, "--train-iters", "1",
                                     "--spindle-task-schedule", "0:vision-text;1:audio-text"])
    try:
        pretrain(bad)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"log": data.read_log, "plan": plan.to_json(), "result": result, "refused": refused}


def test_train_three_steps_on_four_ranks_from_energon(dataset):
    from megatron_spindle.planner.assembly.plan import Plan
    out = run_ranks(_train, WORLD, dataset, timeout_s=300)
    plan = Plan.from_json(out[0]["plan"])
    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=BATCH)
    assert check_reads(plan, graph, {r: o["log"] for r, o in enumerate(out)}, STEPS) == STEPS * BATCH * 4
    res = out[0]["result"]
    assert res["steps"] == STEPS and res["system"] == "spindle" and set(res["task_losses"]) == set(graph.tasks)
    assert all(0 < v < 20 for v in res["task_losses"].values())
    assert "--spindle-data cannot be combined with --spindle-task-schedule" in out[0]["refused"]
