"""Frozen modules in the planner (pure, no torch): the spec key and the flag, what contraction derives, and what
a frozen MetaOp costs, keeps, sends back and synchronises.

A frozen weight (``trainable = false``, ``--freeze``/``--spindle-freeze``) has no gradient, no sync and no
optimizer state; a frozen MetaOp runs its forward only when nothing before it trains, else its forward and its
input's gradient. ``imagebind`` (Multitask-CLIP with the vision and text encoders frozen) is the shipped example.
"""
from __future__ import annotations

import json

import pytest

from megatron_spindle import cli
from megatron_spindle.planner.exact import GRID_MS
from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.assembly.dataflow import frozen_param_keys, needs_output_grad
from megatron_spindle.planner.assembly.plan import Plan
from megatron_spindle.planner.assembly.render import metaop_table, summary
from megatron_spindle.planner.simulation.simulate import GRAD_BYTES_PER_PARAM, simulate
from megatron_spindle.planner.assembly.validate import check_plan
from megatron_spindle.planner.workload.analytic import build_curves
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.workload.graph import Operator
from megatron_spindle.planner.workload.memory import layer_state_bytes, slice_activation_bytes
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.workload.recompute import FORWARD_SHARE
from megatron_spindle.planner.workload.spec import load_spec, parse_spec, shipped_models
from megatron_spindle.planner.workload.workloads import build_graph

FREEZE = ["vision", "text.layers"]  # forward only (vision), input gradient only (text.layers), and trained after


def _trained_copy(tmp_path) -> str:
    """The imagebind spec with every ``trainable = false`` removed: the all-trainable model to compare with."""
    text = open(shipped_models()["imagebind"]).read()
    path = tmp_path / "imagebind-trained.toml"
    path.write_text(text.replace("trainable = false\n", "").replace('name = "imagebind"',
                                                                   'name = "imagebind-trained"'))
    return str(path)


# -- the spec key and the flag ------------------------------------------------------------------------------
def test_nothing_frozen_keeps_the_graph_json_and_a_frozen_operator_says_so():
    g = build_graph("multitask-clip", tasks=4, size="tiny")
    assert all("trainable" not in op.to_json() for op in g.operators) and not g.frozen_param_keys()
    f = build_graph("multitask-clip", tasks=4, size="tiny", freeze=FREEZE)
    assert f.fingerprint() != g.fingerprint()
    op = f["vision-text.vision.0"]
    assert op.to_json()["trainable"] is False and Operator.from_json(op.to_json()) == op
    assert f.frozen_param_keys() == {"vision.embed", "vision.head", *(f"vision.layers.{i}" for i in range(4)),
                                     *(f"text.layers.{i}" for i in range(4))}
    with pytest.raises(ValueError, match="no weights to freeze"):
        Operator(**{**g["vision-text.loss"].__dict__, "trainable": False})


def test_spec_key_and_flag_give_the_same_graph(tmp_path):
    trained = _trained_copy(tmp_path)
    by_key = build_graph("imagebind", tasks=8, size="tiny")
    by_flag = build_graph(trained, tasks=8, size="tiny", freeze=["vision", "text"])
    assert [op.to_json() for op in by_key.operators] == [op.to_json() for op in by_flag.operators]
    assert not build_graph(trained, tasks=8, size="tiny").frozen_param_keys()


def test_freezing_a_module_that_shares_weights_freezes_the_weights():
    spec = load_spec("multitask-clip")
    assert spec.frozen_modules(["vision"]) == ("vision.embed", "vision.layers", "vision.head")
    text = open(shipped_models()["multitask-clip"]).read().replace(
        "[modules.loss]", '[modules.head2]\nshare = "vision.head"\n[modules.loss]')
    s = parse_spec(text, "m.toml")
    assert s.frozen_modules(["head2"]) == ("vision.head",)


@pytest.mark.parametrize("name,match", [("vison", r"not a module of model 'multitask-clip'; modules: "
                                                  r"vision\.embed, .*\(or a component: vision, text, "),
                                        ("loss", "a contrastive_loss module has no weights")])
def test_unknown_or_weightless_module_is_one_line(name, match):
    with pytest.raises(ValueError, match=match) as e:
        build_graph("multitask-clip", tasks=4, freeze=[name])
    assert "\n" not in str(e.value)


def test_cli_freeze_flag_checked(capsys):
    assert cli.main(["plan", "--model", "multitask-clip", "--tasks", "4", "--gpus", "4", "--size", "tiny",
                     "--freeze", "vison"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spindle plan: error: cannot freeze 'vison'") and "vision.layers" in err
    assert "\n" not in err


# -- contraction --------------------------------------------------------------------------------------------
def test_contract_derives_trainable_and_input_grad():
    ms = {m.name: m for m in contract(build_graph("multitask-clip", tasks=4, size="tiny", freeze=FREEZE))}
    got = {n: (m.trainable, m.input_grad) for n, m in ms.items() if n.startswith("vision-text.")}
    assert got == {
        "vision-text.vision.embed": (False, False), "vision-text.vision.layers": (False, False),
        "vision-text.vision.head": (False, False),                     # forward only
        "vision-text.text.embed": (True, False),                       # trains, nothing before it
        "vision-text.text.layers": (False, True),                      # frozen: input gradient only
        "vision-text.text.head": (True, True), "vision-text.loss": (True, True)}
    # a task with nothing trainable: even its loss runs forward only
    ms = {m.name: m for m in contract(build_graph("multitask-clip", tasks=4, size="tiny", freeze=["vision", "text"]))}
    assert (ms["vision-text.loss"].trainable, ms["vision-text.loss"].input_grad) == (False, False)
    assert not needs_output_grad(ms["vision-text.loss"]) and needs_output_grad(ms["audio-text.loss"])
    # nothing frozen: every MetaOp trains; only those without producers need no input gradient
    for m in contract(build_graph("multitask-clip", tasks=4, size="tiny")):
        assert m.trainable and m.input_grad == (m.level > 0)


PAIR = """
[model]
name = "pair"
batch = 8
[modules.a.embed]
type = "patch_embed"
hidden_size = 32
seq_length = 5
input_dim = 12
[modules.a.layers]
type = "transformer_layer"
num_layers = 2
hidden_size = 32
num_attention_heads = 4
[modules.a.more]
type = "transformer_layer"
num_layers = 2
hidden_size = 32
num_attention_heads = 4
[modules.a.head]
type = "pool_head"
proj_dim = 8
pooling = "cls"
[modules.b.embed]
type = "token_embed"
hidden_size = 32
vocab_size = 64
[modules.b.head]
type = "pool_head"
proj_dim = 8
pooling = "eos"
[modules.loss]
type = "contrastive_loss"
temperature = 0.07
[tasks.pair]
tokens = { text = 6 }
flow = ["data:image -> a.embed -> a.layers -> a.more -> a.head", "data:text -> b.embed -> b.head",
        "a.head + b.head -> loss"]
"""


def test_frozen_and_trained_layers_never_merge_into_one_metaop():
    spec = parse_spec(PAIR, "pair.toml")
    assert [m.num_layers for m in contract(spec.build_graph()) if m.op_type == "transformer_layer"] == [4]
    ms = [m for m in contract(spec.build_graph(freeze=["a.more"])) if m.op_type == "transformer_layer"]
    assert [(m.num_layers, m.trainable, m.input_grad) for m in ms] == [(2, True, True), (2, False, True)]


# -- costs, memory, messages, sync --------------------------------------------------------------------------
def test_frozen_curve_is_the_forward_or_input_gradient_share():
    g, f = build_graph("multitask-clip", tasks=4), build_graph("multitask-clip", tasks=4, freeze=FREEZE)
    cg, cf = build_curves(contract(g), 16), build_curves(contract(f), 16)
    for name, want in (("vision-text.vision.layers", FORWARD_SHARE), ("vision-text.text.layers", 2 / 3),
                       ("vision-text.text.head", 1.0), ("audio-text.text.layers", 2 / 3)):
        for n in (1, 4, 16):
            # both on the planner's time grid: each within half a grid step of its exact value
            assert cf[name].time(n) == pytest.approx(want * cg[name].time(n), rel=1e-9, abs=GRID_MS), (name, n)


def test_frozen_memory_keeps_the_weight_only_and_no_stash():
    ms = {m.name: m for m in contract(build_graph("multitask-clip", tasks=4, freeze=FREEZE))}
    trained = {m.name: m for m in contract(build_graph("multitask-clip", tasks=4))}
    v, t = ms["vision-text.vision.layers"], ms["vision-text.text.layers"]
    assert layer_state_bytes(v) == 2 * v.params_per_layer / v.tp
    assert layer_state_bytes(trained[v.name]) == 18 * v.params_per_layer / v.tp
    assert slice_activation_bytes(v, 8, 4) == 0.0  # forward only: nothing stashed
    assert slice_activation_bytes(t, 8, 4) == slice_activation_bytes(trained[t.name], 8, 4) > 0  # input grad


def test_plan_sends_no_gradient_to_forward_only_slices_and_syncs_no_frozen_weight():
    g = build_graph("multitask-clip", tasks=4, size="tiny", freeze=FREEZE)
    plan = make_plan(g, load_cluster(None, num_devices=8))
    check_plan(plan, graph_fingerprint=g.fingerprint(), world_size=8)  # rule 10: stored = derived messages
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    ms = {m.name: m for m in plan.metaops}
    src = {s.name: s.metaop for s in plan.slices()}
    assert any(t.forward for t in plan.transfers)
    for t in plan.transfers:
        assert bool(t.backward) == needs_output_grad(ms[src[t.src]]), t.src
    frozen = frozen_param_keys(plan.metaops)
    assert frozen == g.frozen_param_keys()
    assert {gr.param_key for gr in plan.param_groups} >= frozen  # held where used ...
    buckets = simulate(plan, load_cluster(None, num_devices=8)).collectives
    synced = sum(gr.params for gr in plan.param_groups if gr.param_key not in frozen)
    assert sum(b.bytes for b in buckets) == GRAD_BYTES_PER_PARAM * synced  # ... but never reduced
    assert synced < sum(gr.params for gr in plan.param_groups)


def test_plan_table_marks_frozen_metaops():
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", freeze=FREEZE),
                     load_cluster(None, num_devices=4))
    rows = {line.split()[1]: line for line in metaop_table(plan).splitlines()[2:]}
    assert metaop_table(plan).splitlines()[0].rstrip().endswith("backward")
    assert rows["vision-text.vision.layers"].endswith("none (frozen)")
    assert rows["vision-text.text.layers"].endswith("input grad (frozen)")
    assert rows["vision-text.text.head"].endswith("full")
    assert "frozen        11 of 28 MetaOps (9 forward only, 2 input gradient only)" in summary(plan)
    plain = make_plan(build_graph("multitask-clip", tasks=4, size="tiny"), load_cluster(None, num_devices=4))
    assert "backward" not in metaop_table(plain) and "frozen" not in summary(plain)


# -- the ImageBind-style spec -------------------------------------------------------------------------------
def test_imagebind_plans_and_compares_cheaper_than_all_trainable(tmp_path, capsys):
    trained = _trained_copy(tmp_path)
    got = {}
    for model in ("imagebind", trained):
        assert cli.main(["compare", "--model", model, "--tasks", "4", "--size", "tiny", "--gpus", "8",
                         "--json"]) == 0
        got[model] = json.loads(capsys.readouterr().out)["results"][0]["systems"]
    for system in ("spindle", "sequential"):
        a, b = got["imagebind"][system], got[trained][system]
        assert a["step_ms"] < b["step_ms"] and a["peak_memory_gib"] < b["peak_memory_gib"], system
        assert a["breakdown"]["compute_ms"] < b["breakdown"]["compute_ms"]
    assert cli.main(["plan", "--model", "imagebind", "--tasks", "4", "--size", "tiny", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "none (frozen)" in out and "frozen        12 of 28 MetaOps (12 forward only" in out


def test_imagebind_full_size_frozen_encoders_need_no_gradient_sync(tmp_path):
    cl = load_cluster("a800-8x8", num_devices=16)
    plans = {m: make_plan(build_graph(m, tasks=4), cl, passes=16) for m in ("imagebind", _trained_copy(tmp_path))}
    sims = {m: simulate(p, cl, passes=16) for m, p in plans.items()}
    frozen, trained = sims["imagebind"], sims[next(m for m in plans if m != "imagebind")]
    assert frozen.step_ms < trained.step_ms and frozen.max_memory_gib < trained.max_memory_gib
    assert sum(c.bytes for c in frozen.collectives) < 0.5 * sum(c.bytes for c in trained.collectives)
