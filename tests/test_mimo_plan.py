"""MIMO workloads on the planner's side, pure Python: the tasks file, the graph of a described model, planning.

``data/mimo_tiny_avlm.json`` is the description of ``examples/mimo/tiny_avlm.py`` for its tasks
(``examples/mimo/tiny_tasks.toml``), as :mod:`megatron_spindle.models.mimo_extract` writes it (megatron-core 0.16.1;
0.19.2's ViT layer spec is not causal, the only difference): everything here runs without torch, and one test
proves it with torch blocked.
"""
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from megatron_spindle.mimo.describe import MimoDescription
from megatron_spindle.mimo.graph import freeze_names, mimo_graph
from megatron_spindle.mimo.tasks import TasksError, load_tasks, parse_tasks
from megatron_spindle.mimo.workload import MimoWorkload
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.metaops import contract

REPO = pathlib.Path(__file__).resolve().parent.parent
TASKS = REPO / "examples" / "mimo" / "tiny_tasks.toml"
DESCRIPTION = pathlib.Path(__file__).parent / "data" / "mimo_tiny_avlm.json"


@pytest.fixture(scope="module")
def desc():
    return MimoDescription.from_json(json.loads(DESCRIPTION.read_text()))


def test_the_description_round_trips(desc):
    assert MimoDescription.from_json(json.loads(json.dumps(desc.to_json()))) == desc


GOOD = """
[[tasks]]
name = "image-text"
modalities = ["images"]
batch = 8
[[tasks]]
name = "text"
modalities = []
batch = 4
seq_length = 16
weight = 0.5
[inputs.audio.whisper]
input_features = [8, 8]
"""


def test_a_tasks_file_reads():
    t = parse_tasks(GOOD, "t.toml")
    assert [(x.name, x.modalities, x.batch, x.seq_length, x.weight) for x in t.tasks] == [
        ("image-text", ("images",), 8, 0, 1.0), ("text", (), 4, 16, 0.5)]
    assert t.inputs == {"audio": {"whisper": {"input_features": (8, 8)}}}


@pytest.mark.parametrize("text, line", [
    ('[[tasks]]\nname = "a"\nmodalities = []\n', "t.toml: tasks[0].batch: missing: global samples per optimizer step"),
    ('[[tasks]]\nname = "a"\nmodalities = []\nbatch = 0\n', "t.toml: tasks[0].batch = 0: must be a positive integer"),
    ('[[tasks]]\nname = "a"\nmodalities = "images"\nbatch = 8\n', "t.toml: tasks[0].modalities = 'images': must be a list"),
    ('[[tasks]]\nname = "a b"\nmodalities = []\nbatch = 8\n', "t.toml: tasks[0].name = 'a b': a task name must be"),
    ('[[tasks]]\nname = "a"\nmodalities = []\nbatch = 8\nbatchsize = 8\n',
     "t.toml: tasks[0].batchsize = 8: unknown key; keys: name, modalities, batch, seq_length, weight"),
    ('[[tasks]]\nname = "a"\nmodalities = []\nbatch = 8\nweight = nan\n', "t.toml: tasks[0].weight = nan: must be a finite"),
    ('[[tasks]]\nname = "a"\nmodalities = []\nbatch = 8\n[[tasks]]\nname = "a"\nmodalities = []\nbatch = 8\n',
     "t.toml: tasks[1].name = 'a': another task has this name"),
    ('[[tasks]]\nname = "a"\nmodalities = []\nbatch = 8\n[inputs.audio.whisper]\ninput_features = [8, 0]\n',
     "t.toml: inputs.audio.whisper.input_features = 0: must be a positive integer"),
    ("tasks = 3\n", "t.toml: tasks = 3: missing: at least one [[tasks]] table"),
    ("[[tasks]\n", "t.toml: (syntax): invalid TOML"),
])
def test_a_bad_tasks_file_is_one_line_naming_key_and_value(text, line):
    with pytest.raises(TasksError) as e:
        parse_tasks(text, "t.toml")
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_a_missing_tasks_file_is_named(tmp_path):
    with pytest.raises(TasksError, match=r"nothing.toml: \(file\): no such file"):
        load_tasks(str(tmp_path / "nothing.toml"))


def test_the_graph_follows_the_model(desc):
    g = mimo_graph(desc, load_tasks(str(TASKS)))
    assert g.tasks == ("image-text", "audio-text", "text")
    names = [op.name for op in g.operators if op.task == "audio-text"]
    assert names == ["audio-text.audio.whisper.embed", "audio-text.audio.whisper.0", "audio-text.audio.whisper.1",
                     "audio-text.audio.whisper.post", "audio-text.audio.proj", "audio-text.language.embed",
                     "audio-text.language.0", "audio-text.language.1", "audio-text.language.head"]
    ops = {op.name: op for op in g.operators}
    # parameter keys are MimoModel.state_dict() prefixes; the language model is one weight in every task
    assert ops["image-text.images.clip.1"].param_key == "modality_submodules.images.encoders.clip.decoder.layers.1"
    assert {ops[f"{t}.language.0"].param_key for t in g.tasks} == {"language_model.decoder.layers.0"}
    assert ops["audio-text.audio.whisper.post"].param_key == ops["audio-text.audio.whisper.embed"].param_key
    # a sample: the modality's tokens first (5 image tokens), then text; the loss on every text token but the last
    head = ops["image-text.language.head"].layer
    assert (head.seq_len, head.loss_tokens) == (16, 10)
    assert ops["text.language.head"].layer.loss_tokens == 15
    assert ops["image-text.language.embed"].inputs == ("image-text.images.proj", "data:image-text:input_ids")
    assert ops["image-text.images.clip.embed"].inputs == ("data:image-text:images.clip.x",)
    kinds = {m.name: (m.op_type, m.tp_splittable, m.batch_splittable) for m in contract(g)}
    assert kinds["image-text.images.clip.layers"] == ("mimo_layer", True, True)
    assert kinds["image-text.images.clip.embed"] == ("mimo_encoder", False, True)
    assert kinds["text.language.layers"] == ("mimo_layer", True, True)


def test_batches_passes_and_frozen_modules(desc):
    tasks = load_tasks(str(TASKS))
    wl = MimoWorkload(desc, tasks, batch={"text": 4}, freeze=("images", "language.embed"))
    assert wl.step_batches() == {"image-text": 8, "audio-text": 8, "text": 4}
    assert wl.pass_options() == (1, 2, 4)
    g = wl.graph(2)
    assert {op.batch for op in g.operators if op.task == "image-text"} == {4}
    frozen = {op.name for op in g.operators if not op.trainable}
    assert "image-text.images.clip.0" in frozen and "image-text.images.proj" in frozen
    assert "text.language.embed" in frozen and "text.language.0" not in frozen
    assert "language.layers" in freeze_names(desc)
    with pytest.raises(ValueError, match="cannot freeze 'vision': not a module of model"):
        mimo_graph(desc, tasks, freeze=("vision",))
    with pytest.raises(ValueError, match="not a multiple of 3 passes"):
        wl.graph(3)


@pytest.mark.parametrize("task, line", [
    ('modalities = ["video"]\nbatch = 8\n', "t.toml: tasks[0].modalities = ['video']: 'video' is not a modality of the "
                                           "model (modalities: images, audio)"),
    ('modalities = ["images"]\nbatch = 8\nseq_length = 6\n',
     "t.toml: tasks[0].seq_length = 6: the modality tokens (images 5) leave 1 text tokens"),
])
def test_tasks_that_do_not_fit_the_model_are_refused(desc, task, line):
    with pytest.raises(TasksError) as e:
        mimo_graph(desc, parse_tasks(f'[[tasks]]\nname = "a"\n{task}', "t.toml"))
    assert str(e.value).startswith(line)


def test_a_mimo_graph_plans(desc):
    g = mimo_graph(desc, load_tasks(str(TASKS)))
    plan = make_plan(g, load_cluster(None, num_devices=4, gpus_per_node=4))
    assert plan.model == "examples.mimo.tiny_avlm:tiny_avlm" and plan.tasks == g.tasks
    held = {k for s in plan.slices() for k in plan.metaop(s.metaop).param_keys}
    assert "language_model.decoder.layers.1" in held


def test_the_planner_side_runs_without_torch():
    """The description, the graph and the plan with torch and megatron blocked (``spindle plan`` on a laptop)."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None
        sys.modules["megatron"] = None
        from megatron_spindle.mimo.describe import MimoDescription
        from megatron_spindle.mimo.graph import mimo_graph
        from megatron_spindle.mimo.tasks import load_tasks
        from megatron_spindle.planner.step.build import make_plan
        from megatron_spindle.planner.workload.cluster import load_cluster
        d = MimoDescription.from_json(json.load(open({str(DESCRIPTION)!r})))
        g = mimo_graph(d, load_tasks({str(TASKS)!r}))
        p = make_plan(g, load_cluster(None, num_devices=4, gpus_per_node=4))
        from megatron_spindle.cli import main
        assert main(["plan", "--model", "multitask-clip", "--tasks", "4", "--gpus", "8", "--json"]) == 0
        print("planned", len(p.waves))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "planned" in out.stdout


def test_the_best_static_grids_are_mimos_module_to_grid_map(desc):
    """``spindle plan --mimo-grids``: the tuned static grids as one ``HyperCommGrid`` per module of the model,
    contiguous disjoint rank ranges from 0 that hold each grid's share, printed as Python that builds that map."""
    from megatron_spindle.mimo.grids import DIMS, grid_map, grids_json, grids_lines
    from megatron_spindle.planner.tuning.tune import tune_static_grids

    static = tune_static_grids(MimoWorkload(desc, load_tasks(str(TASKS))), load_cluster(None, num_devices=8,
                                                                                          gpus_per_node=8))
    gm = grid_map(static.extra["grids"])
    assert set(gm) == {"images", "audio", "language"}
    spans = sorted((g["rank_offset"], g["rank_offset"] + g["tp"] * g["dp"] + g["idle"]) for g in gm.values())
    assert spans[0][0] == 0 and spans[-1][1] <= 8 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for module, g in gm.items():
        assert g["cp"] == g["pp"] == 1 and g["tp"] * g["dp"] + g["idle"] == static.extra["grids"][module]["ranks"]
    made = {}

    class HyperCommGrid:  # stands in for megatron.core's: records what the printed map passes
        def __init__(self, shape, dim_names, rank_offset):
            self.args = dict(zip(dim_names, shape), rank_offset=rank_offset)

    text = grids_lines(static, static.step_ms / 2)
    exec("\n".join(text.splitlines()[2:]), {"HyperCommGrid": HyperCommGrid}, made)
    assert {m: g.args for m, g in made["module_to_grid_map"].items()} == \
        {m: {**{d: g[d] for d in DIMS}, "rank_offset": g["rank_offset"]} for m, g in gm.items()}
    assert "2.00x faster" in text.splitlines()[0]
    out = grids_json(static, static.step_ms / 2)
    assert out["module_to_grid_map"] == gm and out["spindle_speedup"] == pytest.approx(2.0)
    assert out["dim_names"] == list(DIMS) and out["step_ms"] == static.step_ms
