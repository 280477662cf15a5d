"""A user's MIMO provider on the torch side, in one process: calling it, describing its model from the meta device,
the layers Spindle builds from its specs against the user's own ``MimoModel``, the synthetic data, the refusals.

* ``examples/mimo/tiny_avlm.py:tiny_avlm`` (CLIPViTModel and a Whisper-style megatron.core encoder, GPTModel) and
  ``tiny_vlm_opaque`` (a plain-torch image encoder: one MetaOp, data-parallel only);
* every operator's layer built by ``build_layer`` (tp 1) and run in graph order gives the losses of the user's
  ``MimoModel.forward`` with the same weights (:class:`MimoReference`) and gradients within 1e-5;
* each refusal is one line naming the provider, the module or the file key.
"""
import pathlib

import pytest
import torch

from megatron_spindle.compat.mimo import meta_device
from megatron_spindle.mimo.tasks import TasksError, parse_tasks
from megatron_spindle.models.data import SyntheticData, parse_data_input
from megatron_spindle.models.layers import build_layer
from megatron_spindle.models.mimo_build import call_provider, load_provider, single_process_groups
from megatron_spindle.models.mimo_extract import describe
from megatron_spindle.models.mimo_reference import MimoReference
from megatron_spindle.models.mimo_source import load_source
from megatron_spindle.planner.workload.graph import DATA_PREFIX

REPO = pathlib.Path(__file__).resolve().parent.parent
TASKS = str(REPO / "examples" / "mimo" / "tiny_tasks.toml")
AVLM, OPAQUE = "examples.mimo.tiny_avlm:tiny_avlm", "examples.mimo.tiny_avlm:tiny_vlm_opaque"
OPAQUE_TASKS = """
[[tasks]]
name = "caption"
modalities = ["images"]
batch = 4
seq_length = 12
[[tasks]]
name = "text"
modalities = []
batch = 4
[inputs.images.patch_mlp]
x = [3, 16, 16]
"""


def test_the_model_is_described_from_the_meta_device():
    src = load_source(AVLM, TASKS)
    assert all(p.is_meta for p in src.model.parameters())  # nothing allocated
    assert torch.cuda.current_device is not None and torch.Tensor.cuda.__name__ != "keep_meta"  # context undone
    d = src.description
    clip, whisper = (d.modality(m).encoder for m in ("images", "audio"))
    assert (clip.split, clip.tokens, clip.hidden, clip.num_layers, clip.inputs[0].shape) == (True, 5, 32, 2, (3, 16, 16))
    assert clip.post is None  # nothing with weights after CLIPViTModel's block
    assert (whisper.split, whisper.tokens, whisper.hidden, whisper.post is not None) == (True, 4, 24, True)
    lm = d.language
    assert (lm.vocab_size, lm.hidden, lm.num_layers, lm.position_embedding_type) == (128, 32, 2, "rope")
    assert (lm.layer.num_query_groups, lm.layer.swiglu, lm.layer.causal, lm.layer.normalization) == (2, True, True,
                                                                                                      "RMSNorm")
    assert lm.layer_params == sum(p.numel() for p in src.model.language_model.decoder.layers[0].parameters())
    assert dict(d.special_tokens) == {"images": 126, "audio": 127}


def test_an_encoder_that_is_not_megatron_core_is_one_data_parallel_metaop(tmp_path):
    (tmp_path / "t.toml").write_text(OPAQUE_TASKS)
    src = load_source(OPAQUE, str(tmp_path / "t.toml"))
    e = src.description.modality("images").encoder
    assert not e.split and e.module.fwd_flops > 0 and "not a megatron.core model" in e.note
    g = src.workload().graph(1)
    op = g["caption.images.patch_mlp"]
    assert op.op_type == "mimo_module" and not op.tp_splittable and op.batch_splittable
    assert any("one MetaOp, data-parallel only" in n for n in src.description.notes())


def _spindle_layers(g, data):
    """Every operator's layer (tp 1) in graph order: ``(losses, {param_key: layer})``."""
    layers, by_key = {}, {}
    for op in g.operators:
        layers[op.name] = build_layer(op, seed=1, graph=g, share_with=by_key.get(op.param_key))
        by_key.setdefault(op.param_key, layers[op.name])
    acts, losses = {}, {}
    for op in g.operators:
        ins = [data[op.task][parse_data_input(n)[1]] if n.startswith(DATA_PREFIX) else acts[n] for n in op.inputs]
        y = layers[op.name](ins)
        (losses.__setitem__(op.task, y) if y.dim() == 0 else acts.__setitem__(op.name, y))
    return losses, by_key


@pytest.mark.parametrize("provider", [AVLM, OPAQUE])
def test_spindles_layers_compute_the_users_mimo_model(provider, tmp_path):
    tasks = TASKS
    if provider == OPAQUE:
        (tmp_path / "t.toml").write_text(OPAQUE_TASKS)
        tasks = str(tmp_path / "t.toml")
    g = load_source(provider, tasks).workload().graph(1)
    data = SyntheticData(g, seed=3).batch(0)
    losses, by_key = _spindle_layers(g, data)
    ref = MimoReference(g, seed=1)
    want = ref(data)
    assert set(losses) == set(want) == set(g.tasks)
    for t in g.tasks:
        assert losses[t].item() == pytest.approx(want[t].item(), rel=1e-6), t
    sum(losses.values()).backward()
    sum(want.values()).backward()
    compared = 0
    for key, name, p in ref.keyed_parameters():
        mine = dict(by_key[key].core.named_parameters())[name]
        assert float((mine.grad - p.grad).abs().max()) <= 1e-5 * float(p.grad.abs().max()) + 1e-12, (key, name)
        compared += 1
    assert compared == len(list(ref.mimo.parameters()))  # every parameter of the user's model


def test_synthetic_batches_carry_the_special_tokens():
    g = load_source(AVLM, TASKS).workload().graph(1)
    data = SyntheticData(g, seed=0)
    b = data.batch(0)
    ids, labels, mask = (b["image-text"][k] for k in ("input_ids", "labels", "loss_mask"))
    assert (ids[:, :5] == 126).all() and not ((ids[:, 5:] == 126) | (ids[:, 5:] == 127)).any()
    assert (labels[:, 5:-1] == ids[:, 6:]).all() and (mask.sum(dim=1) == 10).all()
    assert b["image-text"]["images.clip.x"].shape == (8, 3, 16, 16)
    assert b["audio-text"]["audio.whisper.input_features"].shape == (8, 8, 8)
    assert torch.equal(data.batch(0)["text"]["input_ids"], b["text"]["input_ids"])
    assert not torch.equal(data.batch(1)["text"]["input_ids"], b["text"]["input_ids"])


def not_a_mimo_model(pre_process=True, post_process=True):
    return torch.nn.Linear(2, 2)


def failing_provider(pre_process=True, post_process=True):
    raise RuntimeError("no weights here")


@pytest.mark.parametrize("ref, line", [
    ("nodots", "model provider 'nodots': must be MODULE:FUNCTION"),
    ("no_such_module_xyz:f", "model provider 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz' "
                             "(ModuleNotFoundError"),
    ("test_mimo_model:missing", "has no function 'missing'"),
    ("test_mimo_model:not_a_mimo_model", "model provider 'test_mimo_model:not_a_mimo_model' returned Linear, not a "
                                         "MimoModel"),
    ("test_mimo_model:failing_provider", "model provider 'test_mimo_model:failing_provider' failed: RuntimeError: no "
                                         "weights here"),
])
def test_a_bad_provider_is_one_line(ref, line):
    with pytest.raises(ValueError) as e:
        with meta_device(), single_process_groups():
            call_provider(load_provider(ref), ref)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_an_encoder_without_its_inputs_names_the_tasks_key():
    with meta_device(), single_process_groups():
        mimo = call_provider(load_provider(AVLM), AVLM)
        tasks = parse_tasks('[[tasks]]\nname = "a"\nmodalities = ["audio"]\nbatch = 8\n', "t.toml")
        with pytest.raises(TasksError, match=r"t.toml: inputs.audio.whisper: missing: the forward keywords of "
                                             r"WhisperStyleEncoder"):
            describe(mimo, AVLM, tasks)


def test_energon_datasets_feed_a_mimo_model(tmp_path):
    """``--spindle-data``: one energon dataset per task, a part per stream (``images.clip.x.npy``, ``input_ids.npy``,
    ``labels.npy``, ``loss_mask.npy``): what a rank reads is what was written."""
    pytest.importorskip("megatron.energon")
    import importlib.util
    import io

    import numpy as np
    import webdataset as wds

    from megatron_spindle.data.energon import EnergonData
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster

    spec = importlib.util.spec_from_file_location("make_energon_dataset", REPO / "scripts" / "make_energon_dataset.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    g = load_source(AVLM, TASKS).workload().graph(1)
    batch = SyntheticData(g, seed=5).batch(0)
    for task, streams in batch.items():
        path = tmp_path / task
        path.mkdir()
        with wds.ShardWriter(str(path / "part-%04d.tar"), maxcount=8, verbose=0) as sink:
            for i in range(8):
                parts = {}
                for name, t in streams.items():
                    buf = io.BytesIO()
                    np.save(buf, t[i].numpy())
                    parts[f"{name}.npy"] = buf.getvalue()
                sink.write({"__key__": f"{i:06d}", **parts})
        script.energon_prepare(str(path))
    plan = make_plan(g, load_cluster(None, num_devices=1, gpus_per_node=1))
    got = next(EnergonData(str(tmp_path), g, plan, 0, seed=0))
    for task, streams in batch.items():
        for name, t in streams.items():
            rows = got[task][name][0:8]
            assert rows.dtype == t.dtype and torch.equal(rows, t), (task, name)


def test_spindle_plan_takes_a_provider_and_says_what_runs_whole(tmp_path, capsys):
    from megatron_spindle.cli import main

    (tmp_path / "t.toml").write_text(OPAQUE_TASKS)
    assert main(["plan", "--model-provider", OPAQUE, "--tasks-file", str(tmp_path / "t.toml"), "--gpus", "4",
                 "--progress-interval", "0"]) == 0
    out = capsys.readouterr()
    assert "model examples.mimo.tiny_avlm:tiny_vlm_opaque: 2 tasks" in out.out
    assert "note: images.patch_mlp (" in out.out + out.err and "one MetaOp, data-parallel only" in out.out + out.err
    assert main(["plan", "--model-provider", OPAQUE, "--gpus", "4"]) == 2
    assert capsys.readouterr().err.strip() == (f"spindle plan: error: --model-provider {OPAQUE} needs --tasks-file "
                                               f"TASKS.toml (docs/mimo.md)")


def test_spindle_plan_prints_the_best_static_grids_as_mimos_map(capsys):
    import json

    from megatron_spindle.cli import main

    tasks = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "mimo" / "tiny_tasks.toml")
    flags = ["plan", "--model-provider", "examples.mimo.tiny_avlm:tiny_avlm", "--tasks-file", tasks, "--gpus", "8",
             "--progress-interval", "0", "--mimo-grids"]
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    grids = out["mimo_grids"]
    assert set(grids["module_to_grid_map"]) == {"images", "audio", "language"}
    assert grids["spindle_step_ms"] == out["step_ms"]
    assert grids["spindle_speedup"] == pytest.approx(grids["step_ms"] / grids["spindle_step_ms"])
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert "module_to_grid_map = {" in text and '"language": HyperCommGrid(shape=[' in text
    assert main(["plan", "--model", "multitask-clip", "--gpus", "8", "--mimo-grids"]) == 2
    assert "--mimo-grids: MIMO's grids are of a MimoModel" in capsys.readouterr().err
