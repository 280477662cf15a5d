"""Model specs (pure planner, no torch): the shipped specs equal the former built-in graphs, spec paths work
wherever a model name does, custom layer types, and bad specs fail with one line naming file, key and value."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_spindle import cli
from megatron_spindle.planner.workload.layer_types import LayerCost, custom_layer_type, register_layer_type
from megatron_spindle.planner.workload.spec_layers import SpecError
from megatron_spindle.planner.workload.spec import load_spec, parse_spec, shipped_models
from megatron_spindle.planner.workload.workloads import WORKLOADS, build_graph

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOLDEN = json.load(open(os.path.join(HERE, "data", "builtin_graph_fingerprints.json")))
LLAVA = os.path.join(ROOT, "examples", "models", "llava.toml")


# -- the reference models as specs ----------------------------------------------------------------------
def test_shipped_specs_give_the_graphs_of_the_former_python_definitions():
    assert set(shipped_models()) == {"multitask-clip", "ofasys", "qwen-val", "imagebind"}
    assert len(GOLDEN["graphs"]) == 43
    for g in GOLDEN["graphs"]:
        got = build_graph(g["model"], tasks=g["tasks"], size=g["size"], batch=g["batch"])
        assert (got.fingerprint(), len(got.operators), got.total_params()) == (
            g["fingerprint"], g["operators"], g["params"]), g


@pytest.mark.parametrize("key", sorted(GOLDEN["plans_16_gpus"]))
def test_spindle_plan_with_the_spec_path_gives_the_makespan_of_the_name(key, capsys):
    # the golden plans_16_gpus numbers are the planner of commit 1994ac5; the planner has changed since
    # (whole-step choice, solver), so the spec path is compared with the name under today's planner
    model, tasks = key.rsplit("-", 1)
    path = shipped_models()[model]
    got = {}
    passes = str(load_spec(model).default_passes())  # the spec's passes: one configuration, planned in a second
    for m in (path, model):
        assert cli.main(["plan", "--model", m, "--tasks", tasks, "--gpus", "16", "--passes", passes, "--json"]) == 0
        got[m] = json.loads(capsys.readouterr().out)
    assert (got[path]["step_ms"], got[path]["makespan_ms"], got[path]["num_waves"]) == (
        got[model]["step_ms"], got[model]["makespan_ms"], got[model]["num_waves"])
    assert got[model]["configuration"]["given"] is True
    floor = got[model]["sync_floor"]  # the plan's own sync floor is under its step, and the step bound under both
    assert floor["busy_ms"] > 0 and floor["step_floor_ms"] <= got[model]["step_ms"] * (1 + 1e-9)
    assert got[model]["step_bound_ms"] <= got[model]["step_ms"] * (1 + 1e-9)
    d = got[model]  # one figure per thing measured: the per-pass makespan with Σ C* only when level by level
    if d["level_by_level"]:
        assert 1 - 1e-9 <= d["makespan_ms"] / d["lower_bound_ms"] <= 1.10, d
    else:
        assert d["makespan_ms"] is None and d["lower_bound_ms"] is None and d["ratio"] is None, d


def test_workloads_table_and_spec_path_equal_the_name():
    assert WORKLOADS["multitask-clip"] == ((4, 7, 10), 512) and dict(WORKLOADS)["qwen-val"] == ((3,), 4096)
    for name, path in shipped_models().items():
        assert build_graph(path, size="tiny").fingerprint() == build_graph(name, size="tiny").fingerprint()


def test_package_data_names_the_spec_files():
    src = open(os.path.join(ROOT, "setup.py")).read()
    assert '"specs/*.toml"' in src


# -- the fourth model: only a spec file and a plugin ------------------------------------------------------
def test_llava_example_plans_without_torch():
    """The example's custom projector registers its cost without torch; spindle plan works on it."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_spindle import cli\n"
            f"sys.exit(cli.main(['plan', '--model', {LLAVA!r}, '--gpus', '16', '--json']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "llava" and out["tasks"] == 3 and out["step_ms"] >= out["step_bound_ms"] > 0


def test_llava_tasks_differ_in_sequence_length_and_share_the_llm():
    g = build_graph(LLAVA)
    seqs = {op.task: op.layer.seq_len for op in g.operators if op.name.endswith(".llm.0")}
    assert len(set(seqs.values())) == len(seqs) == 3, seqs
    keys = {op.param_key for op in g.operators if op.module == "llm"}
    assert {op.task for op in g.operators if op.param_key == "llm.layers.0"} == set(g.tasks)
    assert "llm.layers.31" in keys
    proj = [op for op in g.operators if op.op_type == "mlp_projector"]
    assert proj and proj[0].param_count == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    tiny = build_graph(LLAVA, size="tiny")
    assert tiny.total_params() < 2e6


# -- custom layer types -------------------------------------------------------------------------------------
SMALL = """
[model]
name = "small"
batch = 8

[modules.img.embed]
type = "patch_embed"
hidden_size = 32
seq_length = 5
input_dim = 12
[modules.img.layers]
type = "transformer_layer"
num_layers = 2
hidden_size = 32
num_attention_heads = 4
[modules.img.head]
type = "pool_head"
proj_dim = 8
pooling = "cls"
[modules.txt.embed]
type = "token_embed"
hidden_size = 32
vocab_size = 64
[modules.txt.layers]
type = "transformer_layer"
num_layers = 2
hidden_size = 32
num_attention_heads = 4
causal = true
[modules.txt.head]
type = "pool_head"
proj_dim = 8
pooling = "eos"
[modules.loss]
type = "contrastive_loss"
temperature = 0.07

[tasks.pair]
batch = 16
tokens = { text = 6 }
flow = ["data:image -> img.embed -> img.layers -> img.head",
        "data:text -> txt.embed -> txt.layers -> txt.head",
        "img.head + txt.head -> loss"]
"""


def test_small_spec_builds_with_task_batch_and_shared_weights():
    g = parse_spec(SMALL, "small.toml").build_graph()
    assert g.tasks == ("pair",) and {op.batch for op in g.operators} == {16}
    assert [op.name for op in g.operators][:4] == ["pair.img.embed", "pair.img.0", "pair.img.1", "pair.img.head"]
    assert g["pair.txt.embed"].layer.seq_len == 6 and g["pair.loss"].param_key == ""
    assert g["pair.img.1"].param_key == "img.layers.1" and g["pair.img.1"].inputs == ("pair.img.0",)


def test_weights_are_shared_across_tasks_unless_shared_is_false():
    text = SMALL.replace("[modules.loss]", "[modules.img.head2]\nshare = \"img.head\"\n[modules.loss]")
    text += """
[tasks.again]
weight = 0.5
tokens = { text = 3 }
flow = ["data:image -> img.embed -> img.layers -> img.head2",
        "data:text -> txt.embed -> txt.layers -> txt.head",
        "img.head2 + txt.head -> loss"]
"""
    g = parse_spec(text, "small.toml").build_graph()
    assert g.tasks == ("pair", "again") and g.task_weights == (1.0, 0.5)
    assert g["again.img.1"].param_key == g["pair.img.1"].param_key == "img.layers.1"
    assert g["again.img.head2"].param_key == "img.head" and g["again.txt.embed"].layer.seq_len == 3
    assert g["again.img.0"].batch == 8 and g["pair.img.0"].batch == 16
    own = parse_spec(text.replace('[modules.txt.layers]\ntype = "transformer_layer"',
                                  '[modules.txt.layers]\nshared = false\ntype = "transformer_layer"'), "s.toml")
    g2 = own.build_graph(batch={"again": 4})
    assert (g2["pair.txt.0"].param_key, g2["again.txt.0"].param_key) == ("pair.txt.layers.0", "again.txt.layers.0")
    assert g2["again.txt.0"].batch == 4 and g2["pair.txt.0"].batch == 16
    assert g2.total_params() > g.total_params()
    with pytest.raises(ValueError, match=r"batch given for unknown tasks \['nope'\]"):
        own.build_graph(batch={"nope": 4})


def test_custom_layer_type_is_costed_by_its_registered_function():
    register_layer_type("test_squeeze", cost=lambda c: LayerCost(
        params=c.input_dim * c.hidden, fwd_flops_per_sample=2.0 * c.seq_len * c.input_dim * c.hidden,
        act_bytes_per_sample=7.0))
    text = SMALL.replace('[modules.img.head]', '[modules.img.squeeze]\ntype = "test_squeeze"\nhidden_size = 32\n'
                                               'seq_length = 2\n[modules.img.head]')
    text = text.replace("img.layers -> img.head", "img.layers -> img.squeeze -> img.head")
    g = parse_spec(text, "small.toml").build_graph()
    op = g["pair.img.squeeze"]
    assert (op.param_count, op.fwd_flops, op.act_bytes_per_sample) == (32 * 32, 16 * 2.0 * 2 * 32 * 32, 7.0)
    assert (op.layer.seq_len, op.layer.input_seq_len, op.layer.input_dim) == (2, 5, 32)
    assert g["pair.img.head"].layer.seq_len == 2 and not op.tp_splittable
    assert custom_layer_type("test_squeeze").build is None


# -- bad specs: one line naming file, key and value ---------------------------------------------------------
BAD = [
    # (replace this, with this, key in the message, value in the message)
    ('type = "transformer_layer"\nnum_layers = 2\nhidden_size = 32\nnum_attention_heads = 4\ncausal',
     'type = "transfomer_layer"\nnum_layers = 2\nhidden_size = 32\nnum_attention_heads = 4\ncausal',
     "modules.txt.layers.type", "'transfomer_layer'"),
    ('"data:text -> txt.embed', '"data:text -> txt.embedding', "tasks.pair.flow[1]", "unknown module 'txt.embedding'"),
    ("img.head + txt.head -> loss", "img.head + txt.hed -> loss", "tasks.pair.flow[2]", "'txt.hed'"),
    ("batch = 16", "batch = 0", "tasks.pair.batch", "0"),
    ("batch = 8", "batch = -3", "model.batch", "-3"),
    ("[modules.img.head]\ntype = \"pool_head\"", "[modules.img.head]\nhidden_size = 48\ntype = \"pool_head\"",
     "tasks.pair.flow[0]", "hidden_size 48 does not match the width 32"),
    ("[modules.txt.layers]\ntype = \"transformer_layer\"\nnum_layers = 2\nhidden_size = 32",
     "[modules.txt.layers]\ntype = \"transformer_layer\"\nnum_layers = 2\nhidden_size = 64",
     "tasks.pair.flow[1]", "hidden_size 64 does not match the width 32 of input 'txt.embed'"),
    ("num_attention_heads = 4\ncausal", "num_attention_heads = 5\ncausal", "modules.txt.layers.num_attention_heads",
     "5"),
    ("proj_dim = 8\npooling = \"eos\"", "proj_dim = 8\npooling = \"last\"", "modules.txt.head.pooling", "'last'"),
    ("proj_dim = 8\npooling = \"eos\"", "proj_dim = 16\npooling = \"eos\"", "tasks.pair.flow[2]",
     "two pooled embeddings of one width"),
    ("tokens = { text = 6 }", "tokens = { }", "tasks.pair.tokens.text", "missing"),
    ("tokens = { text = 6 }", "tokens = { text = 6, audio = 3 }", "tasks.pair.tokens", "['audio']"),
    ("num_layers = 2\nhidden_size = 32\nnum_attention_heads = 4\ncausal", "num_layers = 2\nhiden_size = 32\n"
     "num_attention_heads = 4\ncausal", "modules.txt.layers.hiden_size", "32"),
    ("img.head + txt.head -> loss", "img.head -> loss", "tasks.pair.flow[2]", "takes 2 module input(s)"),
    ('"data:image -> img.embed', '"img.embed -> img.embed', "tasks.pair.flow[0]", "has not run yet"),
    ("[tasks.pair]", "[tasks.pair]\ncolour = 3", "tasks.pair.colour", "3"),
    ("temperature = 0.07", "temperature = 0.07\nshare = \"img.head\"", "modules.loss.type", "'contrastive_loss'"),
    ("name = \"small\"", "name = \"small\"\nlayer_plugins = [\"nowhere.py\"]", "model.layer_plugins[0]",
     "'nowhere.py'"),
    ("batch = 8", "batch = 8\ntask_counts = [2]", "model.task_counts", "[2]"),
    ("batch = 8", "batch = 8\npasses = 0", "model.passes", "0"),
    ("[model]", "[model\n", "(syntax)", "line 2"),
    ("causal = true", "causal = 1", "modules.txt.layers.causal", "1"),
    ("causal = true", "causal = true\ntrainable = \"no\"", "modules.txt.layers.trainable", "'no'"),
    ("temperature = 0.07", "temperature = 0.07\ntrainable = false", "modules.loss.trainable", "no weights"),
    ("[modules.loss]", "[modules.img.head2]\nshare = \"img.head\"\ntrainable = false\n[modules.loss]",
     "modules.img.head2.trainable", "one weight"),
    # finite values, the planner's limits, names that parse back
    ("temperature = 0.07", "temperature = nan", "modules.loss.temperature", "nan"),
    ("[tasks.pair]\nbatch = 16", "[tasks.pair]\nbatch = 16\nweight = inf", "tasks.pair.weight", "inf"),
    ("[modules.img.layers]\ntype = \"transformer_layer\"\nnum_layers = 2",
     "[modules.img.layers]\ntype = \"transformer_layer\"\nnum_layers = 1000000000", "modules.img.layers.num_layers",
     "1 to 512 layers per module"),
    ("vocab_size = 64", "vocab_size = 100000000", "modules.txt.embed.vocab_size", "1 to 16777216"),
    ("tokens = { text = 6 }", "tokens = { text = 10000000 }", "tasks.pair.tokens.text", "1 to 4194304 tokens"),
    ("[tasks.pair]", '[tasks."my pair"]', "tasks.my pair", "ASCII letters"),
    ("[tasks.pair]", '[tasks."pairé"]', "tasks.pairé", "ASCII letters"),
]


@pytest.mark.parametrize("old,new,key,value", BAD, ids=[b[2] for b in BAD])
def test_bad_spec_is_one_line_naming_file_key_and_value(tmp_path, old, new, key, value):
    assert old in SMALL
    path = tmp_path / "bad_model.toml"
    path.write_text(SMALL.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        load_spec(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {key}") and value in msg, msg


def test_a_graph_of_too_many_operators_is_refused_before_it_is_built(tmp_path):
    """512 layers per module pass, but not 4096 operators in the graph: the planner's memory is bounded."""
    many = SMALL.replace("[tasks.pair]", "[tasks.a]").replace("num_layers = 2", "num_layers = 512")
    many += "".join(f"\n[tasks.t{i}]\ntokens = {{ text = 6 }}\nflow = [\"data:image -> img.embed -> img.layers -> "
                    f"img.head\", \"data:text -> txt.embed -> txt.layers -> txt.head\", \"img.head + txt.head -> "
                    f"loss\"]\n" for i in range(4))
    (tmp_path / "many.toml").write_text(many)
    with pytest.raises(SpecError, match="more than 4096 operators"):
        load_spec(str(tmp_path / "many.toml"))


def test_a_module_no_task_uses_is_one_warning(tmp_path):
    import logging
    (tmp_path / "m.toml").write_text(SMALL + '\n[modules.spare]\ntype = "pool_head"\nproj_dim = 8\npooling = "cls"\n')
    got: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: got.append(record.getMessage())
    logger = logging.getLogger("megatron_spindle.planner.workload.spec_layers")
    logger.addHandler(handler)
    try:
        load_spec(str(tmp_path / "m.toml"))
    finally:
        logger.removeHandler(handler)
    assert got == [f"warning: {tmp_path / 'm.toml'}: module spare is used by no task's flow: never trained"]


def test_bad_spec_on_the_command_line_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text(SMALL.replace("batch = 16", "batch = 0"))
    assert cli.main(["plan", "--model", str(path), "--gpus", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"spindle plan: error: {path}: tasks.pair.batch = 0: must be a positive integer"


@pytest.mark.parametrize("model,match", [("nope", "unknown model 'nope'"),
                                         ("/no/such/model.toml", "does not exist")])
def test_unknown_model_name_or_missing_file(model, match):
    with pytest.raises(ValueError, match=match):
        build_graph(model)


def test_plugin_that_fails_to_import_is_one_line(tmp_path):
    (tmp_path / "broken_layers.py").write_text("import torch_that_does_not_exist\n")
    path = tmp_path / "m.toml"
    path.write_text(SMALL.replace('name = "small"', 'name = "small"\nlayer_plugins = ["broken_layers.py"]'))
    with pytest.raises(SpecError) as e:
        load_spec(str(path))
    assert str(e.value) == (f"{path}: model.layer_plugins[0] = 'broken_layers.py': cannot import: "
                            f"ModuleNotFoundError: No module named 'torch_that_does_not_exist'")


# -- global batch and passes per step (gradient accumulation) ------------------------------------------------
def test_default_batches_are_the_recipes_global_batch_split_over_the_passes():
    # Multitask-CLIP: ImageBind's 2048 (audio pairs) / 512 per step, 16 passes; Qwen-VAL: 4096 / 2048, 512 passes
    clip = build_graph("multitask-clip")
    per_pass = {op.task: op.batch for op in clip.operators}
    assert per_pass == {t: 128 if "audio" in t else 32 for t in clip.tasks}
    explicit = {t: 2048 if "audio" in t else 512 for t in clip.tasks}
    assert build_graph("multitask-clip", batch=explicit, passes=16).fingerprint() == clip.fingerprint()
    assert {op.task: op.batch for op in build_graph("qwen-val").operators} == {
        "vision-language": 8, "audio-language": 8, "language": 4}
    # OFASys: OFA's 2048 vision-language samples over 3 tasks (640), its 512 text-only over 2 (256), 4 passes
    ofa = build_graph("ofasys")
    assert {op.task: op.batch for op in ofa.operators} == {
        t: 64 if t in ("summary", "text2sql") else 160 for t in ofa.tasks}
    # an explicit batch without passes is one pass; tiny sizes keep one pass of their former batch
    assert {op.batch for op in build_graph("qwen-val", batch=8).operators} == {8}
    assert {op.batch for op in build_graph("multitask-clip", size="tiny").operators} == {128}
    assert load_spec("qwen-val").default_passes("tiny") == 1 and load_spec("qwen-val").default_passes() == 512


def test_passes_that_do_not_divide_the_batch_or_are_not_positive():
    with pytest.raises(ValueError, match="global batch 100 of task 'vision-language' is not a multiple of the "
                                         "passes per step 3"):
        build_graph("qwen-val", batch=100, passes=3)
    with pytest.raises(ValueError, match="passes per step must be a positive integer, got 0"):
        build_graph("qwen-val", batch=100, passes=0)


def test_size_overrides_model_batch_and_passes(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(SMALL.replace("batch = 8", "batch = 8\npasses = 2") + "\n[sizes.tiny.model]\nbatch = 4\n"
                    "passes = 1\n")
    spec = load_spec(str(path))
    assert {op.batch for op in spec.build_graph().operators} == {8}         # task batch 16 over 2 passes
    assert {op.batch for op in spec.build_graph(size="tiny").operators} == {4}  # the size's batch replaces it
    path.write_text(SMALL + "\n[sizes.tiny.model]\nlayers = 4\n")
    with pytest.raises(SpecError, match=r"sizes\.tiny\.model\.layers = 4: a size overrides model batch, passes"):
        load_spec(str(path))


def test_compare_cli_takes_batch_and_passes(capsys):
    assert cli.main(["compare", "--model", "qwen-val", "--gpus", "16", "--batch", "64", "--passes", "8",
                     "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"][0]
    one = res["systems"]["sequential"]
    assert not res["tuned"] and one["configuration"]["passes"] == 8  # --passes given: every system at 8
    assert cli.main(["compare", "--model", "qwen-val", "--gpus", "16", "--batch", "8", "--json"]) == 0
    single = json.loads(capsys.readouterr().out)["results"][0]
    assert single["systems"]["sequential"]["configuration"]["passes"] == 1
    # the same per-pass graph: 8 passes cost 8 passes of compute and one sync
    b1, b8 = single["systems"]["sequential"]["breakdown"], one["breakdown"]
    assert b8["compute_ms"] == pytest.approx(8 * b1["compute_ms"])
    assert b8["sync_ms"] == pytest.approx(b1["sync_ms"])
    assert cli.main(["compare", "--model", "qwen-val", "--gpus", "16", "--batch", "12", "--passes", "8"]) == 2
    assert "global batch 12 of task 'vision-language' is not a multiple of the passes per step 8" in \
        capsys.readouterr().err


def test_bad_size_override_names_the_key(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(SMALL + "\n[sizes.tiny.modules]\nimg.layers = { num_attention_heads = 0 }\n")
    with pytest.raises(SpecError, match=r"sizes\.tiny\.modules\.img\.layers\.num_attention_heads = 0"):
        load_spec(str(path))
    path.write_text(SMALL + "\n[sizes.tiny.modules]\nimg.layer = { hidden_size = 16 }\n")
    with pytest.raises(SpecError, match=r"sizes\.tiny\.modules\.img\.layer\.hidden_size = 16: "
                                        r"'img\.layer' is not a module"):
        load_spec(str(path))
    path.write_text(SMALL + "\n[sizes.tiny.modules]\nimg.layers = { hidden_size = 16 }\n")
    with pytest.raises(SpecError, match=r"tasks\.pair\.flow\[0\] = .*: at size 'tiny': module 'img\.layers' "
                                        r".*hidden_size 16 does not match the width 32"):
        load_spec(str(path))
