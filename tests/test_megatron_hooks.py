"""The Megatron-LM hooks on CPU, without ``megatron.training`` (which needs Megatron-LM and a GPU).

* flags: registered the way Megatron's ``parse_args`` calls ``extra_args_provider`` (milliseconds);
* the forward-backward contract ``train_step`` relies on: the keywords it passes, one report dict per
  microbatch that its reduction turns into each task's loss, no gradients under ``forward_only``;
* the chunk Megatron's optimizer, ``train_step`` and checkpointing use, with megatron.core's real
  optimizer builder and ``dist_checkpointing`` (save, perturb, load);
* the hooks, installed into a stand-in for ``megatron.training.training`` whose originals record calls
  (the fallback decision of ``pretrain_spindle``: ``test_megatron_backend.py``).

The multi-process cases run once, in one 2-rank gloo job (about 10 s, mostly imports); the test functions
check their part of its results. Megatron's own ``pretrain``/``train_step`` need CUDA and are left to the
GPU check described in ``patches/README.md``.
"""
from __future__ import annotations

import argparse
import inspect

import pytest

from megatron_spindle.megatron.adapter import flags
from megatron_spindle.megatron.adapter.chunk import megatron_forward_backward
from megatron_spindle.megatron.adapter.flags import add_spindle_args
from megatron_spindle.megatron.adapter.schedule import spindle_forward_backward
from mp_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

WORLD = 2
MICRO = 2  # per rank, Megatron's meaning: a pass carries MICRO * WORLD samples of every task
SEED = 7
REL_TOL = 1e-9

SPINDLE_ARGV = ["--spindle", "--spindle-plan", "p.json", "--spindle-curves", "c.json", "--spindle-tasks", "4",
                "--spindle-gpus-per-node", "8", "--spindle-trace", "d", "--spindle-check-equivalence"]

# What core_v0.16.1's train_step passes (training.py L1652), and what newer Megatron-LM adds.
TRAIN_STEP_KEYWORDS = dict(seq_length=1, micro_batch_size=MICRO, decoder_seq_length=None, forward_only=False,
                           adjust_tensor_shapes_fn=None, force_all_reduce=False)
HEAD_KEYWORDS = dict(p2p_communicator=None, pg_collection=None)


def megatron_like_parser() -> argparse.ArgumentParser:
    """A few of Megatron-LM's own flags, with its parser settings (``allow_abbrev=False``)."""
    p = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    return p


def spindle_group(parser: argparse.ArgumentParser):
    return next(g for g in parser._action_groups if g.title == "spindle")


# --------------------------------------------------------------------------------------------------
# Flags (pure)
# --------------------------------------------------------------------------------------------------
def test_flags_parse_the_way_megatron_calls_extra_args_provider():
    parser = megatron_like_parser()
    returned = add_spindle_args(parser)  # Megatron: parser = extra_args_provider(parser)
    assert returned is parser
    args = parser.parse_args(["--micro-batch-size", "2", "--seed", "3", *SPINDLE_ARGV])
    assert args.spindle is True and args.spindle_check_equivalence is True
    assert (args.spindle_plan, args.spindle_curves, args.spindle_trace) == ("p.json", "c.json", "d")
    assert (args.spindle_tasks, args.spindle_gpus_per_node) == (4, 8)
    assert (args.micro_batch_size, args.seed) == (2, 3)  # Megatron's own flags are untouched
    defaults = parser.parse_args([])
    assert defaults.spindle is False and defaults.spindle_plan is None


def test_every_flag_has_help_and_help_renders(capsys):
    parser = add_spindle_args(megatron_like_parser())
    actions = spindle_group(parser)._group_actions
    assert {a.dest for a in actions} >= {"spindle", "spindle_plan", "spindle_curves", "spindle_tasks",
                                         "spindle_gpus_per_node", "spindle_trace", "spindle_check_equivalence"}
    for a in actions:
        assert a.help and a.help != argparse.SUPPRESS and len(a.help) > 15, a.option_strings
    text = parser.format_help()
    for a in actions:
        assert a.option_strings[0] in text
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    assert "--spindle-check-equivalence" in capsys.readouterr().out


def test_unknown_or_abbreviated_flags_stop_like_megatron(capsys):
    parser = add_spindle_args(megatron_like_parser())  # Megatron never ignores unknown flags
    for argv in (["--spindle-plna", "x"], ["--spindle-pl", "x"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_chain_args_adds_spindle_flags_then_runs_theirs():
    def theirs(parser):
        parser.add_argument("--my-flag", type=int, default=0, help="a user's flag")
        return parser

    parser = megatron_like_parser()
    assert flags.chain_args(None, theirs)(parser) is parser
    args = parser.parse_args(["--spindle", "--my-flag", "5"])
    assert args.spindle and args.my_flag == 5
    with pytest.raises(TypeError, match="return the parser"):
        flags.chain_args(lambda p: None)(megatron_like_parser())


def test_megatron_settings_spindle_cannot_honour_are_named():
    ok = argparse.Namespace(micro_batch_size=2, tensor_model_parallel_size=1, dataloader_type="external")
    assert flags.check_megatron_args(ok) == []
    bad = argparse.Namespace(micro_batch_size=None, tensor_model_parallel_size=2, fp16=True,
                             use_distributed_optimizer=True, dataloader_type="single", save="ckpt",
                             ckpt_format="torch", spindle_task_schedule="0:a", spindle_data="data")
    text = "\n".join(flags.check_megatron_args(bad))
    for flag in ("--tensor-model-parallel-size 2", "--fp16", "--use-distributed-optimizer",
                 "--dataloader-type single", "--ckpt-format torch", "--spindle-task-schedule",
                 "--spindle-data", "--micro-batch-size"):
        assert flag in text


def test_passes_per_step_are_the_plans():
    """The plan's passes decide; --global-batch-size must agree (one line naming the values), and a training
    call of Megatron's schedule for another number of microbatches is refused the same way."""
    from megatron_spindle.megatron.adapter.model import step_passes
    plan = argparse.Namespace(passes=2)
    assert step_passes(plan, None, 8) == 2 and step_passes(plan, 16, 8) == 2
    with pytest.raises(ValueError) as e:
        step_passes(plan, 8, 8)
    assert str(e.value) == ("--global-batch-size 8 is not the plan's 2 passes per step x 8 samples per pass "
                            "(--micro-batch-size x ranks) = 16: give --global-batch-size 16 or a plan made for 1 passes")
    model = argparse.Namespace(plan=plan)
    with pytest.raises(ValueError, match=r"^num_microbatches 3 per step, but the plan runs 2 passes per step"):
        spindle_forward_backward(forward_step_func=None, data_iterator=None, model=[model], num_microbatches=3)


# --------------------------------------------------------------------------------------------------
# The forward-backward signature (pure)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [megatron_forward_backward, spindle_forward_backward])
def test_forward_backward_accepts_train_step_keywords(fn):
    sig = inspect.signature(fn)
    common = dict(forward_step_func=None, data_iterator=None, model=None, num_microbatches=2)
    sig.bind(**common, **TRAIN_STEP_KEYWORDS)                   # core_v0.16.1 train_step
    sig.bind(**common, **TRAIN_STEP_KEYWORDS, **HEAD_KEYWORDS)  # Megatron-LM main
    sig.bind(**common, seq_length=1, micro_batch_size=MICRO, decoder_seq_length=None, forward_only=True)  # evaluate
    with pytest.raises(TypeError):
        sig.bind(None, None)  # keyword-only, as Megatron calls it


# --------------------------------------------------------------------------------------------------
# Multi-process: one 2-rank job
# --------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for ``megatron.training.training``: Megatron's originals, recording how they are called."""

    def __init__(self, args, real_optimizer_builder):
        self.args, self.calls = args, []
        self.get_args = lambda: self.args
        self.get_megatron_optimizer = real_optimizer_builder

    def get_model(self, model_provider_func, model_type=None, wrap_with_ddp=True, config=None, pg_collection=None):
        self.calls.append(("get_model", wrap_with_ddp))

        class Float16Module:  # what get_model adds under --bf16
            def __init__(self, module):
                self.module = module

        return [Float16Module(model_provider_func())]

    def get_forward_backward_func(self, *a, **kw):
        def theirs(**fkw):
            self.calls.append(("their_forward_backward",))
            return []
        return theirs

    def finalize_model_grads(self, model, *a, **kw):
        self.calls.append(("their_finalize",))

    def get_megatron_optimizer_config(self, args):
        from megatron.core.optimizer import OptimizerConfig
        return OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=args.clip_grad), None


def _optimizer_on_cpu(build):
    """megatron.core's FP32Optimizer keeps a scale tensor on ``device='cuda'``; give it the CPU instead."""
    import torch

    def builder(*a, **kw):
        real = torch.tensor

        def cpu_tensor(*ta, **tk):
            if tk.get("device") == "cuda":
                tk["device"] = "cpu"
            return real(*ta, **tk)

        torch.tensor = cpu_tensor
        try:
            return build(*a, **kw)
        finally:
            torch.tensor = real

    return builder


def _stop_checkpoint_writer_manager() -> None:
    """megatron.core's file writer keeps one multiprocessing Manager per process; stop it, so that no process
    outlives the test (the harness kills each rank as soon as it reports, before its exit handlers run)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is not None:
        queue._manager.shutdown()
        filesystem_async._results_queue = None


def _rank_main(rank: int, world: int, plan_path: str, ckpt_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_spindle.megatron.adapter import hooks as ad
    from megatron_spindle.megatron.adapter.data import data_iterators
    from megatron_spindle.megatron.checkpoint.save_load import sharded_state_dict as loop_sharded_state_dict
    from megatron_spindle.models.data import SyntheticData

    out: dict = {}
    parallel_state.initialize_model_parallel(1, 1)  # what initialize_megatron does; the optimizer reads it
    parser = add_spindle_args(megatron_like_parser())
    args = parser.parse_args(["--spindle", "--spindle-plan", plan_path, "--spindle-tasks", "4", "--spindle-size",
                              "tiny", "--micro-batch-size", str(MICRO), "--global-batch-size", str(2 * MICRO * WORLD),
                              "--seed", str(SEED), "--clip-grad", "1e9"])
    args.data_parallel_size = world
    config = argparse.Namespace(name="TransformerConfig stand-in")
    chunk = ad.build_chunk(args, config=config, pg_collection=None)
    model = chunk.module
    tasks = model.plan.tasks

    # The executor's own reduced task losses over the two passes train_step will run.
    data = SyntheticData(model.graph, seed=SEED)
    expected = {t: 0.0 for t in tasks}
    with torch.no_grad():
        for k in range(2):
            for t, v in model.reduce_losses(model(data.batch(k))).items():
                expected[t] += v / 2

    # Hooks into a stand-in module; the forward-backward function is what train() would get.
    target = _Recorder(args, _optimizer_on_cpu(get_megatron_optimizer))
    assert ad.install(args, target=target)
    fb = target.get_forward_backward_func()
    train, valid, _ = data_iterators(model.graph, SEED, tasks)
    for c in [chunk]:  # train_step: zero grads, then the schedule
        c.zero_grad_buffer()
        c.force_all_reduce = False
    reports = fb(forward_step_func=ad.forward_step, data_iterator=train, model=[chunk], num_microbatches=2,
                 **TRAIN_STEP_KEYWORDS)
    out["report_keys"] = [list(r) for r in reports]
    out["report_shapes"] = sorted({tuple(v.shape) for r in reports for v in r.values()})
    reduced = {}
    for key in reports[0]:  # train_step's reduction (training.py L1739-1750)
        val = torch.vstack([r[key].view(-1) for r in reports]).sum(dim=0)
        dist.all_reduce(val)
        reduced[key] = float(val[0] / val[1])
    out["reduced"], out["expected"] = reduced, expected
    out["data_position"] = train.position
    grads = [p.grad for p in model.unique_parameters()]
    out["grads_after_training_call"] = sum(g is not None for g in grads), len(grads)
    out["grad_norm"], out["recomputed_norm"] = chunk.grad_norm, model.grad_norm()

    # Clipping by the global norm (the chunk does it; Megatron's optimizer must not).
    chunk.clip_grad = out["grad_norm"] / 4
    chunk.clip_grads()
    out["norm_after_clip"] = model.grad_norm()
    cfg, _ = target.get_megatron_optimizer_config(args)
    out["optimizer_clip_grad"] = cfg.clip_grad
    optimizer = target.get_megatron_optimizer(cfg, [chunk])
    out["optimizer_norm"] = optimizer.get_grad_norm()  # the chunk's last norm, taken before clipping
    success, logged_norm, _ = optimizer.step()
    out["step"] = bool(success), logged_norm

    # forward_only (evaluate): reports, no gradients.
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    steps = chunk.steps
    eval_reports = fb(forward_step_func=ad.forward_step, data_iterator=valid, model=[chunk], num_microbatches=1,
                      seq_length=1, micro_batch_size=MICRO, decoder_seq_length=None, forward_only=True)
    out["eval_keys"] = [list(r) for r in eval_reports]
    out["grads_after_forward_only"] = sum(p.grad is not None for p in model.unique_parameters())
    out["steps_unchanged"] = chunk.steps == steps

    # What the optimizer builder and train_step read.
    out["ddp_config"] = (chunk.ddp_config.use_distributed_optimizer, chunk.ddp_config.use_megatron_fsdp)
    out["config_is_given"] = chunk.config is config
    out["has_pg_collection"] = hasattr(chunk, "pg_collection")

    # sharded_state_dict: prefixed keys, the loop's plan-independent keys, data = the parameter objects.
    sd = chunk.sharded_state_dict(prefix="chunk0.", metadata={"dp_cp_group": None})
    out["prefixed"] = all(k.startswith("chunk0.") and v.key == k for k, v in sd.items())
    plain = chunk.sharded_state_dict()
    out["loop_keys_covered"] = set(loop_sharded_state_dict(model)) <= set(plain)
    params = {id(p) for p in model.unique_parameters()}
    out["data_is_param"] = all(id(v.data) in params for v in plain.values())
    out["factories"] = sum(type(v).__name__ == "ShardedTensorFactory" for v in plain.values())

    # Save the model and megatron.core optimizer through dist_checkpointing, scramble, load, compare.
    state = {"model": plain}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, ckpt_dir)
    dist.barrier()
    inner = optimizer.chained_optimizers[0].optimizer
    before = {id(p): (p.detach().clone(), inner.state[p]["exp_avg"].clone()) for p in model.unique_parameters()
              if p in inner.state}
    with torch.no_grad():
        for p in model.unique_parameters():
            p.add_(1.0)
            if p in inner.state:
                inner.state[p]["exp_avg"].zero_()
    want = {"model": chunk.sharded_state_dict()}
    want["optimizer"] = optimizer.sharded_state_dict(want["model"], is_loading=True)
    loaded = dist_checkpointing.load(want, ckpt_dir)
    result = chunk.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    out["load_result"] = (list(result.missing_keys), list(result.unexpected_keys))
    inner = optimizer.chained_optimizers[0].optimizer
    out["restored_params"] = all(torch.equal(p, before[id(p)][0]) for p in model.unique_parameters()
                                 if id(p) in before)
    out["restored_exp_avg"] = all(torch.equal(inner.state[p]["exp_avg"], before[id(p)][1])
                                  for p in model.unique_parameters() if id(p) in before)
    out["params_with_state"] = len(before)

    # The get_model and finalize hooks; a non-Spindle model goes to Megatron's originals.
    got = target.get_model(lambda: chunk, None, wrap_with_ddp=True)
    out["get_model"] = (got == [chunk], target.calls[-1])
    out["finalize_is_noop"] = target.finalize_model_grads([chunk]) is None and target.calls[-1] != ("their_finalize",)
    target.finalize_model_grads([torch.nn.Linear(1, 1)])
    fb(forward_step_func=ad.forward_step, data_iterator=None, model=[torch.nn.Linear(1, 1)], num_microbatches=1)
    out["others_use_megatron"] = target.calls[-2:] == [("their_finalize",), ("their_forward_backward",)]
    args.spindle = False
    target.get_model(lambda: chunk, None, wrap_with_ddp=True)
    out["no_spindle_keeps_ddp"] = target.calls[-1] == ("get_model", True)
    out["no_spindle_keeps_clip"] = target.get_megatron_optimizer_config(args)[0].clip_grad == args.clip_grad
    ad.uninstall(target)
    out["uninstalled"] = target.get_model.__func__ is _Recorder.get_model
    model.destroy()
    parallel_state.destroy_model_parallel()
    _stop_checkpoint_writer_manager()
    return out


def _tp_plan(path: str) -> None:
    """Every MetaOp on both ranks in level order, the text encoder with tensor parallelism 2; 2 passes per step."""
    from megatron_spindle.planner.assembly.manual import plan_from_waves
    from megatron_spindle.planner.workload.metaops import contract
    from megatron_spindle.planner.workload.workloads import build_graph

    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=MICRO * WORLD)
    waves = [[(m.name, 0, m.num_layers, tuple(range(WORLD if m.batch_splittable else 1)))]
             for m in sorted(contract(graph), key=lambda m: m.level)]
    text = {"vision-text.text.layers": 2, "audio-text.text.layers": 2}
    plan_from_waves(graph, WORLD, waves, tp=text, passes=2).save(path)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("hooks")
    plan = str(d / "plan.json")
    _tp_plan(plan)
    (d / "ckpt").mkdir()
    return run_ranks(_rank_main, WORLD, plan, str(d / "ckpt"), timeout_s=180)


def test_forward_backward_reports_reduce_to_the_executor_losses(ranks):
    for r in ranks:
        assert r["report_keys"] == [list(r["expected"])] * 2  # every task on every rank, in plan order
        assert r["report_shapes"] == [(2,)]                    # [sum, count]: train_step's 2-element form
        for task, want in r["expected"].items():
            assert r["reduced"][task] == pytest.approx(want, rel=REL_TOL), task
    assert ranks[0]["reduced"] == ranks[1]["reduced"]
    assert all(r["data_position"] == 2 for r in ranks)  # one batch per microbatch


def test_training_call_syncs_and_clips_by_the_global_norm(ranks):
    for r in ranks:
        with_grad, total = r["grads_after_training_call"]
        assert with_grad == total > 0
        assert r["grad_norm"] > 0 and r["grad_norm"] == pytest.approx(r["recomputed_norm"], rel=1e-9)
        assert r["norm_after_clip"] == pytest.approx(r["grad_norm"] / 4, rel=1e-4)
    assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"]  # global: the same on every rank


def test_megatron_optimizer_does_not_clip_and_logs_the_global_norm(ranks):
    for r in ranks:
        assert r["optimizer_clip_grad"] == 0.0
        assert r["optimizer_norm"] == r["grad_norm"]
        assert r["step"] == (True, r["grad_norm"])


def test_forward_only_leaves_no_gradients(ranks):
    for r in ranks:
        assert r["eval_keys"] == [list(r["expected"])]
        assert r["grads_after_forward_only"] == 0
        assert r["steps_unchanged"]


def test_chunk_exposes_what_megatron_reads(ranks):
    for r in ranks:
        assert r["ddp_config"] == (False, False)
        assert r["config_is_given"] and r["has_pg_collection"]
        assert r["prefixed"] and r["loop_keys_covered"] and r["data_is_param"]
    assert any(r["factories"] > 0 for r in ranks)  # the tensor-parallel text layers are stored as blocks


def test_checkpoint_round_trip_with_megatron_optimizer(ranks):
    for r in ranks:
        assert r["load_result"] == ([], [])
        assert r["params_with_state"] > 0
        assert r["restored_params"] and r["restored_exp_avg"]


def test_hooks_route_spindle_chunks_and_leave_other_models_alone(ranks):
    for r in ranks:
        assert r["get_model"] == (True, ("get_model", False))  # no DDP, Float16Module dropped
        assert r["finalize_is_noop"] and r["others_use_megatron"]
        assert r["no_spindle_keeps_ddp"] and r["no_spindle_keeps_clip"]
        assert r["uninstalled"]
