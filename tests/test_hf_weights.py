"""Pretrained weights from Hugging Face directories, and the training logs.

Tiny models are made on the spot with ``transformers`` (random weights, ``save_pretrained``; no hub):
``scripts/make_tiny_hf.py`` builds them, so these are the README's models.

* our forward against ``transformers`` within 1e-5 (fp32): CLIPModel (both towers), CLIPVisionModel,
  CLIPTextModel, LlamaForCausalLM and Qwen2ForCausalLM (grouped-query attention, a tied head) at TP 1, and
  CLIP, Llama, Qwen2 at TP 2 on 2 gloo ranks, where each rank reads less than 60% of the Llama checkpoint
  (its shards of the embedding, head and every layer);
* ``spindle hf spec`` / ``hf check`` on the command line; exit status 1 above the tolerance;
* a checkpoint that does not match the spec is refused in one line naming the tensor (or config key), its
  shape (value) and the spec's expectation; a bad ``--spindle-init`` likewise;
* 3 training steps from the loaded CLIP and Llama on 2 ranks (the first step's gradients equal a single
  process's from the same checkpoint), and TensorBoard events of a 4-task run, read back with
  tensorboard's ``EventAccumulator``: every task's loss, Megatron's tag names, the predicted step.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers", reason="pip install .[hf]")
pytest.importorskip("safetensors", reason="pip install .[hf]")

from mp_harness import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import make_tiny_hf  # noqa: E402

from megatron_spindle import cli  # noqa: E402
from megatron_spindle.hf.check import compare  # noqa: E402
from megatron_spindle.models.hf_config import model_spec_toml, towers  # noqa: E402

KINDS = ("tiny-clip", "tiny-clip-vision", "tiny-clip-text", "tiny-llama", "tiny-qwen2")
TOL = 1e-5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {k: make_tiny_hf.make(k, str(root / k)) for k in KINDS}


def _spec(tmp_path, path: str, name: str, **kw) -> str:
    f = tmp_path / f"{name}.toml"
    f.write_text(model_spec_toml(path, towers(path), name=name, **kw))
    return str(f)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_transformers_at_tp1(hf, kind):
    rows = compare(0, 1, hf[kind], batch=2, seed=1)
    assert rows and all(d < TOL for _, _, d in rows), rows
    names = {r[0] for r in rows}
    if kind == "tiny-clip":
        assert {"image_embeds", "text_embeds", "vision last_hidden_state", "text last_hidden_state"} <= names
    if kind in ("tiny-llama", "tiny-qwen2"):
        assert names == {"logits"}


def _tp2(rank, world, dirs):
    from megatron_spindle.models import pretrained

    read = {"n": 0}
    orig = pretrained.Checkpoint.read

    def counting(self, name, index):
        t = orig(self, name, index)
        read["n"] += t.numel()
        return t

    pretrained.Checkpoint.read = counting
    out = {}
    for kind, path in dirs.items():
        read["n"] = 0
        rows = compare(rank, world, path, batch=2, seed=2)
        out[kind] = (rows, read["n"])
    return out


def test_forward_matches_transformers_at_tp2_each_rank_reading_its_shards(hf):
    from safetensors import safe_open

    dirs = {k: hf[k] for k in ("tiny-clip", "tiny-llama", "tiny-qwen2")}
    results = run_ranks(_tp2, 2, dirs, timeout_s=300)
    for kind, (rows, _) in results[0].items():
        assert rows and all(d < TOL for _, _, d in rows), (kind, rows)
    with safe_open(os.path.join(hf["tiny-llama"], "model.safetensors"), "pt") as f:
        total = sum(f.get_slice(n).get_shape()[0] * (f.get_slice(n).get_shape() + [1])[1] for n in f.keys())
    for rank in (0, 1):  # rank 0 also ran transformers, which reads the whole file itself (not counted)
        assert results[rank]["tiny-llama"][1] < 0.6 * total, (rank, results[rank]["tiny-llama"][1], total)


def test_spec_and_check_on_the_command_line(hf, capsys, monkeypatch):
    assert cli.main(["hf", "spec", hf["tiny-llama"]]) == 0
    out = capsys.readouterr().out
    assert "num_query_groups = 2" in out and 'position_embedding_type = "rope"' in out and "RMSNorm" in out
    assert cli.main(["hf", "spec", hf["tiny-clip"], "--module", "vision"]) == 0
    out = capsys.readouterr().out
    assert 'activation = "quick_gelu"' in out and "[modules.text" not in out
    assert cli.main(["hf", "check", hf["tiny-clip-text"], "--tolerance", "1e-3"]) == 0
    assert "max relative difference" in capsys.readouterr().out
    # the refusal, with weights that really differ (rounding alone may differ by exactly 0): our side reads
    # the final norm's scale 1% larger than transformers does, so the text outputs differ by about 1e-2
    from megatron_spindle.models import pretrained

    orig = pretrained.Checkpoint.read

    def scaled(self, name, index):
        t = orig(self, name, index)
        return t * 1.01 if name.endswith("final_layer_norm.weight") else t

    monkeypatch.setattr(pretrained.Checkpoint, "read", scaled)
    assert cli.main(["hf", "check", hf["tiny-clip-text"], "--tolerance", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert "above the tolerance 0.001" in out and "text last_hidden_state [2, " in out, out
    monkeypatch.undo()
    assert cli.main(["hf", "spec", hf["tiny-clip"], "--module", "audio"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "towers vision, text" in err[0], err


def test_check_accepts_a_difference_of_exactly_zero_and_refuses_one_above_the_tolerance(hf, capsys, monkeypatch):
    """The exit status reads the differences alone: 0 (both sides rounding alike) passes any tolerance."""
    from megatron_spindle.hf import check

    for diffs, tol, status in (([0.0, 0.0], "1e-12", 0), ([0.0, 2e-12], "1e-12", 1), ([1e-12, 0.0], "1e-12", 0)):
        monkeypatch.setattr(check, "compare", lambda *a, d=diffs: [(f"out{i}", [2], x) for i, x in enumerate(d)])
        assert cli.main(["hf", "check", hf["tiny-clip-text"], "--tolerance", tol]) == status, diffs
        out = capsys.readouterr().out
        assert f"max relative difference {max(diffs):.3e}" in out and ("above the tolerance" in out) == bool(status)


def _bad_copy(src: str, dst: str, name: str, shape) -> str:
    """A copy of the checkpoint in ``src`` with tensor ``name`` replaced by one of ``shape``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors[name] = torch.zeros(shape)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_checkpoint_that_does_not_match_is_refused_in_one_line(hf, tmp_path, capsys):
    from megatron_spindle.models.reference import ReferenceModel
    from megatron_spindle.planner.workload.workloads import build_graph

    bad = _bad_copy(hf["tiny-llama"], str(tmp_path / "bad-llama"), "model.layers.1.self_attn.k_proj.weight", (32, 64))
    spec = _spec(tmp_path, bad, "bad")
    with pytest.raises(ValueError) as e:
        ReferenceModel(build_graph(spec), init={"llm": bad})
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.layers.1.self_attn.k_proj.weight has shape [32, 64]" in msg, msg
    assert "expects [16, 64]" in msg and "num_query_groups 2" in msg, msg
    assert cli.main(["hf", "check", bad]) == 2  # the same line from the command line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "k_proj.weight has shape [32, 64]" in err[0], err

    # a spec whose hyper-parameters differ from config.json: the key and both values
    text = open(_spec(tmp_path, hf["tiny-llama"], "ok")).read().replace("ffn_hidden_size = 128", "ffn_hidden_size = 96")
    (tmp_path / "ffn.toml").write_text(text)
    with pytest.raises(ValueError, match=r"module llm.layers \(transformer_layer\): ffn_hidden_size = 96 in the "
                                         r"spec, 128 in .*config.json"):
        ReferenceModel(build_graph(str(tmp_path / "ffn.toml")), init={"llm": hf["tiny-llama"]})


def test_bad_init_names_and_spec_keys():
    from megatron_spindle.models.hf_mapping import init_targets
    from megatron_spindle.planner.workload.spec_layers import SpecError
    from megatron_spindle.planner.workload.spec import parse_spec
    from megatron_spindle.planner.workload.workloads import build_graph

    g = build_graph("multitask-clip", tasks=4, size="tiny")
    with pytest.raises(ValueError, match="no module 'visoin'"):
        init_targets(g, {"visoin": "/nonexistent"})
    with pytest.raises(ValueError, match="is not a directory"):
        init_targets(g, {"vision": "/nonexistent"})
    base = ('[model]\nname = "m"\nbatch = 4\n[modules.t.embed]\ntype = "token_embed"\nhidden_size = 32\n'
            'vocab_size = 64\n[modules.t.layers]\ntype = "transformer_layer"\nnum_layers = 1\nhidden_size = 32\n'
            'num_attention_heads = 4\n{extra}\n[modules.t.head]\ntype = "lm_head"\nvocab_size = 64\n'
            '[tasks.lm]\ntokens = {{ text = 8, labels = 8 }}\n'
            'flow = ["data:text -> t.embed -> t.layers", "t.layers + data:labels -> t.head"]\n')
    for extra, match in (('num_query_groups = 3', "num_query_groups = 3: does not divide num_attention_heads 4"),
                         ('activation = "relu"', "must be one of gelu, quick_gelu, silu"),
                         ('rotary_base = 5e5', "needs position_embedding_type = 'rope'"),
                         ('position_embedding_type = "learned_absolute"', "must be one of none, rope")):
        with pytest.raises(SpecError, match=match):
            parse_spec(base.format(extra=extra), "m.toml")
    with pytest.raises(SpecError, match="model.init.x = 'd': no module 'x'"):
        parse_spec(base.format(extra="").replace('batch = 4\n', 'batch = 4\ninit = { x = "d" }\n'), "m.toml")


def _train(rank, world, clip_spec, llama_spec, tb_dir):
    import torch

    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.trainer.loop import Trainer, pretrain
    from megatron_spindle.models.pretrained import Checkpoint

    from megatron_spindle.megatron.adapter.equivalence import check_first_step

    common = ["--spindle", "--train-iters", "3", "--micro-batch-size", "2", "--lr", "1e-4", "--log-interval", "1"]
    out = {}
    for name, spec in (("clip", clip_spec), ("llama", llama_spec)):
        t = Trainer(build_parser().parse_args(common + ["--spindle-model", spec]))
        try:
            start = {}
            for key, _, layer in t.model.local_cores():  # a loaded, unsharded weight equals the checkpoint's
                if layer.op.op_type == "pool_head" and key == "vision.head":
                    ckpt = Checkpoint(t.model.init["vision"])
                    start["vision.head"] = torch.equal(layer.core.norm.weight.detach(),
                                                       ckpt.read("vision_model.post_layernorm.weight", slice(None)))
            # the reference loads the same checkpoint in one process: equal gradients mean the same weights
            start["equivalence"] = check_first_step(t.model, t.graph, t.data.peek(), t.args.seed)
            s = t.train()
        finally:
            t.close()
        out[name] = (s["steps"], s["task_losses"], start)
    args = build_parser().parse_args(["--spindle", "--spindle-model", "multitask-clip", "--spindle-size", "tiny",
                                      "--spindle-tasks", "4", "--train-iters", "3", "--micro-batch-size", "2",
                                      "--tensorboard-dir", tb_dir, "--spindle-predict-interval", "2"])
    out["tb"] = pretrain(args)["task_losses"]
    return out


def test_three_steps_from_loaded_weights_on_two_ranks_and_tensorboard_events(hf, tmp_path):
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clip = _spec(tmp_path, hf["tiny-clip"], "clip", batch=4, seq_length=16)
    llama = _spec(tmp_path, hf["tiny-llama"], "llama", batch=4, seq_length=16)
    tb = str(tmp_path / "tb")
    results = run_ranks(_train, 2, clip, llama, tb, timeout_s=400)
    for name in ("clip", "llama"):
        steps, losses, start = results[0][name]
        assert steps == 3 and all(math.isfinite(v) for v in losses.values()), (name, losses)
        assert start["equivalence"] < 1e-4, (name, start)
    assert any(r["clip"][2].get("vision.head") for r in results), "no rank holds the vision head"
    assert all(r["clip"][2].get("vision.head", True) for r in results)
    ea = EventAccumulator(tb)
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    tasks = set(results[0]["tb"])
    assert len(tasks) == 4 and tasks <= tags, (tasks, tags)
    assert {"learning-rate", "grad-norm", "iteration-time", "batch-size", "samples-per-second",
            "spindle/predicted-step-ms", "spindle/measured-step-ms"} <= tags
    for task, final in results[0]["tb"].items():
        events = ea.Scalars(task)
        assert [e.step for e in events] == [1, 2, 3]
        assert math.isclose(events[-1].value, final, rel_tol=1e-6)
