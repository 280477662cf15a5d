"""Single-process tests of the torch model: every operator layer, the reference model, synthetic data."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_spindle.models import data as mdata
from megatron_spindle.models.shapes import LOSS_OP_TYPES, example_inputs, output_shape
from megatron_spindle.models.layers import build_layer, layer_seed, table_rows
from megatron_spindle.models.layer_state import (full_state_dict, load_full_state_dict, num_parameters, shard_tensor,
                                                 unshard_tensors)
from megatron_spindle.models.reference import ReferenceModel, split_parameter_name
from megatron_spindle.planner.workload.layer_types import OP_TYPES
from megatron_spindle.planner.workload.workloads import build_graph

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

MODELS = ("multitask-clip", "qwen-val", "ofasys")
#: A model defined only by a spec file, with a custom layer type (its MLP projector) registered from Python.
LLAVA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "models", "llava.toml")
ALL_MODELS = MODELS + ("llava",)
BATCH = 8


@pytest.fixture(scope="module")
def graphs():
    return {m: build_graph({"llava": LLAVA}.get(m, m), size="tiny", batch=BATCH) for m in ALL_MODELS}


def _one_op_per_type(graph):
    seen = {}
    for op in graph.operators:
        seen.setdefault(op.op_type, op)
    return list(seen.values())


def test_workloads_cover_every_op_type(graphs):
    covered = {op.op_type for m in MODELS for op in graphs[m].operators}
    assert covered == set(OP_TYPES)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_every_op_type_runs_forward_and_backward(graphs, model):
    g = graphs[model]
    gen = torch.Generator().manual_seed(0)
    for op in _one_op_per_type(g):
        layer = build_layer(op, seed=0, graph=g)
        inputs = example_inputs(op, BATCH, graph=g, generator=gen, requires_grad=True)
        out = layer(inputs)
        assert tuple(out.shape) == ((BATCH, *output_shape(op)) if output_shape(op) else ()), op.name
        loss = out if op.op_type in LOSS_OP_TYPES else (out * torch.randn(out.shape, generator=gen)).sum()
        loss.backward()
        assert torch.isfinite(loss)
        for name, p in layer.core.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{op.name}: {name}"
        for x in inputs:
            if x.is_floating_point():
                assert x.grad is not None and x.grad.abs().sum() > 0, op.name


@pytest.mark.parametrize("model", ALL_MODELS)
def test_parameter_counts_match_the_cost_model(graphs, model):
    """Counts equal ``costs.layer_params`` except one documented deviation: learned tables are sized
    for every operator sharing the key."""
    g = graphs[model]
    for op in g.operators:
        layer = build_layer(op, seed=0, graph=g)
        expected = op.param_count
        if op.op_type in ("patch_embed", "token_embed", "cross_attn_adapter"):
            expected += (table_rows(op, g) - op.layer.seq_len) * op.layer.hidden
        assert num_parameters(layer) == expected, op.name


def test_initialisation_depends_only_on_seed_and_param_key(graphs):
    g = graphs["qwen-val"]
    op = next(o for o in g.operators if o.op_type == "transformer_layer" and o.module == "llm")
    other = next(o for o in g.operators if o.param_key == op.param_key and o.task != op.task)
    a = full_state_dict(build_layer(op, seed=3, graph=g))
    b = full_state_dict(build_layer(other, seed=3, graph=g))
    c = full_state_dict(build_layer(op, seed=4, graph=g))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["self_attention.linear_qkv.weight"], c["self_attention.linear_qkv.weight"])
    assert layer_seed(0, "llm.layers.0") == layer_seed(0, "llm.layers.0") != layer_seed(0, "llm.layers.1")


def test_full_state_round_trip_and_errors(graphs):
    g = graphs["ofasys"]
    op = next(o for o in g.operators if o.op_type == "decoder_layer")
    layer = build_layer(op, seed=0, graph=g)
    state = {k: v + 1 for k, v in full_state_dict(layer).items()}
    load_full_state_dict(layer, state)
    assert all(torch.equal(v, state[k]) for k, v in full_state_dict(layer).items())
    with pytest.raises(ValueError, match="missing"):
        load_full_state_dict(layer, {})


@pytest.mark.parametrize("stride", [1, 2])
def test_shard_and_unshard_are_inverse(stride):
    full = torch.arange(48.0).reshape(12, 4)
    shards = [shard_tensor(full, dim=0, stride=stride, rank=r, size=3) for r in range(3)]
    assert torch.equal(unshard_tensors(shards, dim=0, stride=stride), full)
    if stride == 2:  # rank 0 holds rows 0-1 (gate) and 6-7 (up)
        assert torch.equal(shards[0], full[[0, 1, 6, 7]])


def test_build_layer_rejects_bad_tensor_parallel_requests(graphs):
    g = graphs["multitask-clip"]
    patch = next(o for o in g.operators if o.op_type == "patch_embed")
    with pytest.raises(ValueError, match="cannot run with tp_size=2"):
        build_layer(patch, seed=0, tp_size=2, tp_rank=0)
    layer_op = next(o for o in g.operators if o.op_type == "transformer_layer")
    with pytest.raises(ValueError, match="tp_group"):
        build_layer(layer_op, seed=0, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match="takes 1 inputs"):
        build_layer(layer_op, seed=0, graph=g)([])


def test_loss_and_gradient_of_split_batches_sum_to_the_whole(graphs):
    """Data-parallel contract: local losses (sum / global count) add up to the global one."""
    g = graphs["qwen-val"]
    head = next(o for o in g.operators if o.op_type == "lm_head")
    layer = build_layer(head, seed=0, graph=g)
    inputs = example_inputs(head, BATCH, graph=g, generator=torch.Generator().manual_seed(1))
    whole = layer(inputs)
    whole.backward()
    grads = {n: p.grad.clone() for n, p in layer.core.named_parameters()}
    layer.zero_grad()
    halves = [layer([x[:4] for x in inputs]), layer([x[4:] for x in inputs])]
    (halves[0] + halves[1]).backward()
    # the halves run the head on 4 rows, the whole on 8: kernels may block (and round) them differently
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=0)
    for n, p in layer.core.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_reference_model_learns_synthetic_data(graphs, model):
    g = graphs[model]
    ref = ReferenceModel(g, seed=0)
    data = mdata.SyntheticData(g, seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    history = []
    for step in range(20):
        losses = ref(data.batch(step))
        assert set(losses) == set(g.tasks)
        total = sum(losses.values())
        opt.zero_grad()
        total.backward()
        opt.step()
        history.append(total.item())
    assert sum(history[-3:]) / 3 < 0.9 * history[0], history


def test_reference_model_shares_parameters_by_key(graphs):
    g = graphs["qwen-val"]
    ref = ReferenceModel(g, seed=0)
    keys = {op.param_key for op in g.operators if op.param_key}
    assert len(ref.cores) == len(keys)
    llm0 = [op.name for op in g.operators if op.param_key == "llm.layers.0"]
    assert len(llm0) == 3 and len({id(ref.layer(n).core) for n in llm0}) == 1
    names = {(k, n) for k, n, _ in ref.keyed_parameters()}
    assert ("llm.layers.0", "self_attention.linear_qkv.weight") in names
    assert split_parameter_name("cores.llm/layers/0.mlp.linear_fc1.weight") == ("llm.layers.0",
                                                                                "mlp.linear_fc1.weight")
    one = ref({"language": mdata.SyntheticData(g).task_batch("language", 0)})
    assert set(one) == {"language"}
    with pytest.raises(ValueError, match="unknown tasks"):
        ref({"nope": {}})


def test_synthetic_data_is_deterministic_and_well_formed(graphs):
    for g in graphs.values():
        data = mdata.SyntheticData(g, seed=5)
        a, b = data.batch(3), mdata.SyntheticData(g, seed=5).batch(3)
        mdata.check_batch(g, a)
        assert all(torch.equal(a[t][s], b[t][s]) for t in a for s in a[t])
        assert not torch.equal(*(next(iter(x.values())) for x in (a[g.tasks[0]], data.batch(4)[g.tasks[0]])))
    g = graphs["qwen-val"]
    text = mdata.SyntheticData(g).task_batch("language", 0)
    assert torch.equal(text["labels"][:, :-1], text["text"][:, 1:])  # labels are the next tokens
    bad = mdata.SyntheticData(g).batch(0)
    bad["language"]["text"] = bad["language"]["text"][:, :-1]
    with pytest.raises(ValueError, match="stream 'text'"):
        mdata.check_batch(g, bad)


def test_task_iterators_zip_into_batches(graphs):
    g = graphs["ofasys"]
    data = mdata.SyntheticData(g, seed=1)
    batches = mdata.batches_from_iterators(g, data.task_iterators())
    first = next(batches)
    assert all(torch.equal(first[t][s], data.batch(0)[t][s]) for t in first for s in first[t])
    specs = mdata.stream_specs(g)
    assert specs["caption"]["image"].shape == (5, 24) and specs["caption"]["labels"].dtype == torch.int64


def test_a_cls_or_eos_pool_head_given_its_one_token_gives_the_same_output_and_gradient(graphs):
    """What an edge into a ``cls``/``eos`` pool head carries (``planner.workload.graph.read_token``): that token
    alone gives the head's output and that token's gradient as the whole sequence does (the others get none);
    a ``mean`` head takes no single token, and any other length is refused."""
    from megatron_spindle.planner.workload.graph import read_token
    g = graphs["multitask-clip"]
    heads = {op.layer.pooling: op for op in g.operators if op.op_type == "pool_head"}
    assert set(heads) == {"cls", "eos"}
    gen = torch.Generator().manual_seed(0)
    for pooling, op in heads.items():
        layer = build_layer(op, seed=0, graph=g)
        (x,) = example_inputs(op, BATCH, graph=g, generator=gen, requires_grad=True)
        w = torch.randn((BATCH, *output_shape(op)), generator=gen)
        (layer([x]) * w).sum().backward()
        i = read_token(op.op_type, op.layer) % x.shape[1]
        one = x.detach()[:, i:i + 1].clone().requires_grad_(True)
        out = layer([one])
        (out * w).sum().backward()
        torch.testing.assert_close(out, layer([x]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(one.grad[:, 0], x.grad[:, i], rtol=1e-6, atol=1e-6)
        assert x.grad[:, [j for j in range(x.shape[1]) if j != i]].abs().sum() == 0, pooling
        with pytest.raises(ValueError, match="input must be"):
            layer([x.detach()[:, :2]])
    mean = dataclasses.replace(heads["cls"].layer, pooling="mean")
    assert read_token("pool_head", mean) is None and read_token("transformer_layer", heads["cls"].layer) is None
