"""Multi-process (gloo, CPU) tests: tensor-parallel layers and the group registry.

Processes start once for the module (about 10 s on 2 cores, mostly importing megatron.core); every case
runs inside that one 4-rank job and the test functions check their part of its results. Inter-wave
messages are planned purely (``test_dataflow.py``) and moved by the executor (``test_runtime_exec.py``).
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch

from mp_harness import RanksFailed, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

WORLD = 4
BATCH = 8
SEED = 11
REL_TOL = 1e-5

#: A model only defined by a spec file, with a custom layer type (the projector) registered from Python.
LLAVA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "models", "llava.toml")
# (workload, operator name) run with tp=2 on ranks [0, 1] and on ranks [2, 3], and with tp=4 on all.
TP2_CASES = {
    (0, 1): [("multitask-clip", "vision-text.vision.0"), ("multitask-clip", "vision-text.text.1"),
             ("ofasys", "caption.decoder.0"), ("ofasys", "caption.decoder.head"), (LLAVA, "caption.projector")],
    (2, 3): [("qwen-val", "language.llm.0"), ("qwen-val", "vision-language.vision.adapter"),
             ("qwen-val", "audio-language.audio.adapter"), ("qwen-val", "language.llm.embed"),
             ("qwen-val", "vision-language.llm.head")],
}
TP4_CASES = [("qwen-val", "language.llm.1"), ("ofasys", "vqa.decoder.1")]

REGISTRY = {"a": (0, 1), "b": (2, 3), "a-again": (1, 0), "mid": (1, 2), "all": (0, 1, 2, 3),
            "odd": (1, 3), "solo": (2,)}


# --------------------------------------------------------------------------------------------------
# Code that runs on the ranks
# --------------------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _tp_case(model: str, name: str, group, tp_rank: int, tp_size: int) -> dict:
    from megatron_spindle.models.shapes import LOSS_OP_TYPES, example_inputs
    from megatron_spindle.models.layers import build_layer
    from megatron_spindle.models.layer_state import full_state_dict, load_full_state_dict, shard_spec, shard_tensor
    from megatron_spindle.planner.workload.workloads import build_graph

    graph = build_graph(model, size="tiny", batch=BATCH)
    op = graph[name]
    ref = build_layer(op, seed=SEED, graph=graph)
    sharded = build_layer(op, seed=SEED, graph=graph, tp_group=group, tp_rank=tp_rank, tp_size=tp_size)
    ref_params = dict(ref.core.named_parameters())

    def shard_of(full, p):
        spec = shard_spec(p)
        return full if spec is None else shard_tensor(full, dim=spec[0], stride=spec[1], rank=tp_rank,
                                                      size=tp_size)

    n_sharded = 0
    for pname, p in sharded.core.named_parameters():
        n_sharded += shard_spec(p) is not None
        if not torch.equal(shard_of(ref_params[pname].detach(), p), p.detach()):
            raise AssertionError(f"{name}: shard of {pname} differs from the slice of the unsharded weight")
    full = full_state_dict(sharded)
    if full.keys() != ref_params.keys() or any(not torch.equal(full[k], ref_params[k]) for k in full):
        raise AssertionError(f"{name}: full_state_dict of the shards differs from the unsharded layer")

    gen = torch.Generator().manual_seed(SEED)
    inputs = example_inputs(op, BATCH, graph=graph, generator=gen)
    ri = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    si = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ro, so = ref(ri), sharded(si)
    if op.op_type in LOSS_OP_TYPES:
        ro.backward()
        so.backward()
    else:
        grad_out = torch.randn(ro.shape, generator=gen)
        ro.backward(grad_out)
        so.backward(grad_out)
    errs = {"out": _rel(so.detach(), ro.detach())}
    for i, (a, b) in enumerate(zip(si, ri)):
        if b.grad is not None:
            errs[f"input{i}.grad"] = _rel(a.grad, b.grad)
    for pname, p in sharded.core.named_parameters():
        errs[f"{pname}.grad"] = _rel(p.grad, shard_of(ref_params[pname].grad, p))
    worst = max(errs, key=errs.get)
    if errs[worst] > REL_TOL:
        raise AssertionError(f"{name} tp{tp_size}: {worst} relative error {errs[worst]:.2e}")

    moved = {k: v * 2 + 1 for k, v in full.items()}  # load a full state, read it back
    load_full_state_dict(sharded, moved)
    back = full_state_dict(sharded)
    if any(not torch.equal(back[k], moved[k]) for k in moved):
        raise AssertionError(f"{name}: load_full_state_dict / full_state_dict round trip differs")
    return {"max_rel_err": errs[worst], "sharded_params": n_sharded}


def _registry_case(rank: int) -> dict:
    import torch.distributed as dist

    from megatron_spindle.runtime.groups import ProcessGroupRegistry

    reg = ProcessGroupRegistry(REGISTRY, timeout=datetime.timedelta(seconds=60))
    sums = {}
    for name in reg.names():
        group = reg.get(name)
        member = rank in REGISTRY[name]
        if (group is not None) != member:
            raise AssertionError(f"rank {rank}: group {name!r} membership wrong")
        if member:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            sums[name] = t.item()
    out = {"distinct": len(reg), "sums": sums, "shared": reg.get("a") is reg.get("a-again"),
           "ranks_mid": reg.ranks("mid")}
    reg.destroy()
    return out


def _all_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    pairs = {p: dist.new_group(list(p)) for p in sorted(TP2_CASES)}
    everyone = dist.new_group(list(range(world)))
    out = {"tp2": {}, "tp4": {}}
    for pair, cases in TP2_CASES.items():
        if rank in pair:
            for model, name in cases:
                out["tp2"][name] = _tp_case(model, name, pairs[pair], pair.index(rank), 2)
    for model, name in TP4_CASES:
        out["tp4"][name] = _tp_case(model, name, everyone, rank, world)
    out["registry"] = _registry_case(rank)
    return out


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, WORLD, timeout_s=240)


def test_tensor_parallel_layers_match_the_unsharded_layer(results):
    for pair, cases in TP2_CASES.items():
        for rank in pair:
            for _, name in cases:
                r = results[rank]["tp2"][name]
                assert r["max_rel_err"] <= REL_TOL and r["sharded_params"] > 0, (rank, name, r)
    for rank in range(WORLD):
        assert set(results[rank]["tp4"]) == {n for _, n in TP4_CASES}


def test_registry_creates_groups_consistently(results):
    for rank in range(WORLD):
        r = results[rank]["registry"]
        assert r["distinct"] == 6 and r["shared"] and r["ranks_mid"] == (1, 2)
        expected = {n: float(sum(rs)) for n, rs in REGISTRY.items() if rank in rs}
        assert r["sums"] == expected


def test_harness_reports_every_failing_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail_on_odd_ranks, 2, timeout_s=60)
    text = str(info.value)
    assert "rank 1" in text and "odd rank 1 failed" in text


def _fail_on_odd_ranks(rank: int, world: int) -> int:
    if rank % 2:
        raise RuntimeError(f"odd rank {rank} failed")
    return rank
