"""The flag contract (``megatron_spindle/megatron/adapter/flag_contract.py``): every Megatron-LM flag has a
treatment in each loop, a refused one is refused first and alike on every rank, the mapped ones reach the plan.

* under ``.venv-mlm`` (``megatron.training`` importable): the installed parser is walked, and every option
  string must be in the contract, every contract flag in the parser (or one of the example scripts' flags);
* everywhere: the built-in loop's own parser, the refusals, the constraints, the command line Megatron sees,
  the loaded plan's check, and ``docs/megatron.md``'s table against the contract;
* whole runs on 2 CPU ranks started by hand (no torchrun: each rank's output is read alone): a refused flag is
  each rank's first line with exit status 2 and no Megatron argument dump, in the built-in loop and in
  Megatron-LM's loop; a mapped one (``--tensor-model-parallel-size 2 --recompute-granularity full``) trains in
  Megatron-LM's loop with the plan keeping it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spindle.megatron.adapter import flag_contract as fc
from mp_harness import communicate_all
from megatron_spindle.megatron.adapter.flags import build_parser, fallback_args

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_multitask_clip.py"
HAS_MLM = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.training") is not None
#: Flags of Megatron-LM's example scripts (not of its parser) the contract classifies because users bring them.
EXAMPLE_FLAGS = {"--freeze-ViT", "--freeze-LM"}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments  # optional: megatron.training (.venv-mlm)

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


@pytest.mark.skipif(not HAS_MLM, reason="megatron.training not importable: run under .venv-mlm")
def test_every_flag_of_megatron_lm_parser_is_in_the_contract():
    parser = _megatron_parser()
    options = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    table = fc.entries()
    missing = sorted(options - set(table))
    assert not missing, f"{len(missing)} Megatron-LM flags not in flag_table.py: {missing[:20]}"
    stale = sorted(set(table) - options - EXAMPLE_FLAGS)
    assert not stale, f"flag_table.py lists flags Megatron-LM's parser does not have: {stale}"


@pytest.mark.skipif(not HAS_MLM, reason="megatron.training not importable: run under .venv-mlm")
def test_accepted_values_are_megatron_defaults_or_choices():
    """A refused flag's accepted value is its default given explicitly; a mapped one's values are its choices."""
    actions = {o: a for a in _megatron_parser()._actions for o in a.option_strings}
    for flag, e in fc.entries().items():
        if not e.values or flag in EXAMPLE_FLAGS:
            continue
        a = actions[flag]
        allowed = {str(a.default)} | {str(c) for c in (a.choices or ())}
        if a.nargs == "+" and isinstance(a.default, list):
            allowed |= {str(v) for v in a.default}
        if flag == "--recompute-num-layers":  # Spindle's full recompute: one layer per checkpoint
            allowed.add("1")
        if flag == "--recompute-modules":  # no choices in the parser: TransformerConfig's module names
            allowed |= {"layernorm", "mlp"}
        assert set(e.values) <= allowed, (flag, e.values, allowed)


def test_the_built_in_loop_parses_what_it_honours():
    table = fc.entries()
    own = {o for a in build_parser()._actions for o in a.option_strings
           if not o.startswith("--spindle") and o not in ("-h", "--help")}
    assert own <= set(table), sorted(own - set(table))
    wrong = sorted(f for f in own if table[f].treatment("loop") not in (fc.HONORED, fc.MAPPED))
    assert not wrong, f"the built-in loop parses flags the contract does not say it honours: {wrong}"
    honoured = {f for f, e in table.items() if e.treatment("loop") in (fc.HONORED, fc.MAPPED)}
    assert honoured <= own, f"honoured in the built-in loop but not parsed there: {sorted(honoured - own)}"


def test_every_rule_is_used_and_every_treatment_known():
    used = {e.rule for e in fc.entries().values()}
    assert used == set(fc.RULES)
    for rule, (mlm, loop, text) in fc.RULES.items():
        assert {mlm, loop} <= {fc.HONORED, fc.MAPPED, fc.REFUSED, fc.NO_EFFECT} and text, rule


def test_docs_table_is_the_contract():
    text = (ROOT / "docs" / "megatron.md").read_text()
    table = text.split(fc.DOC_BEGIN, 1)[1].split(fc.DOC_END, 1)[0]
    assert table.strip() == fc.doc_table().strip(), ("docs/megatron.md's flag table is out of date: run python -m "
                                                     "megatron_spindle.megatron.adapter.flag_contract --write "
                                                     "docs/megatron.md")


@pytest.mark.parametrize("argv, loop, words", [
    (["--pipeline-model-parallel-size", "2"], "megatron", ["--pipeline-model-parallel-size 2", "inside a slice"]),
    (["--context-parallel-size=2"], "loop", ["--context-parallel-size 2", "inside a slice"]),
    (["--expert-model-parallel-size", "2", "--num-experts", "2"], "loop", ["--expert-model-parallel-size 2",
                                                                           "also refused: --num-experts 2"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "megatron", ["--num-layers-per-virtual-pipeline-stage 1"]),
    (["--sequence-parallel"], "loop", ["--sequence-parallel", "whole sequence"]),
    (["--overlap-param-gather"], "megatron", ["--overlap-param-gather"]),
    (["--use-distributed-optimizer"], "megatron", ["SPINDLE_BACKEND=loop"]),
    (["--data-path", "/nonexistent/x", "--split", "949,50,1"], "megatron", ["--data-path /nonexistent/x",
                                                                            "--spindle-data", "--split 949,50,1"]),
    (["--tokenizer-type", "GPT2BPETokenizer"], "loop", ["--tokenizer-type GPT2BPETokenizer"]),
    (["--rampup-batch-size", "8", "8", "16"], "loop", ["--rampup-batch-size 8 8 16", "--global-batch-size"]),
    (["--ckpt-format", "torch"], "megatron", ["--ckpt-format torch", "torch_dist"]),
    (["--dataloader-type", "cyclic"], "loop", ["--dataloader-type cyclic", "external"]),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "loop", ["--recompute-method block"]),
    (["--freeze-ViT"], "megatron", ["--spindle-freeze"]),
    (["--num-layers", "24"], "megatron", ["--num-layers 24", "--spindle-model"]),
    (["--log-throughput"], "megatron", ["--log-throughput"]),
    (["--exit-duration-in-mins", "5"], "loop", ["SPINDLE_BACKEND=megatron"]),
])
def test_refused_in_one_line_naming_the_flag(argv, loop, words):
    with pytest.raises(ValueError) as e:
        fc.check_flags(argv, loop)
    line = str(e.value)
    assert "\n" not in line and "docs/megatron.md" in line
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("argv, loop", [
    (["--pipeline-model-parallel-size", "1", "--context-parallel-size", "1", "--ckpt-format", "torch_dist"], "loop"),
    (["--dataloader-type", "external", "--num-workers", "8", "--local-rank", "0"], "megatron"),
    (["--tensor-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "megatron"),
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000"], "loop"),
    (["--log-throughput-not-a-flag", "--spindle"], "megatron"),  # outside the contract: Megatron's parser judges
    (["--exit-duration-in-mins", "5", "--log-timers-to-tensorboard"], "megatron"),
])
def test_accepted(argv, loop):
    fc.check_flags(argv, loop)


def test_megatron_lms_loop_needs_its_required_flags_and_refuses_built_in_only_ones():
    with pytest.raises(ValueError, match="needs --micro-batch-size, --lr and --eval-interval"):
        fc.check_megatron_command_line(["--spindle"], {})
    with pytest.raises(ValueError, match="needs --eval-interval \\(it has no default for it"):
        fc.check_megatron_command_line(["--micro-batch-size", "2"], {"lr": 1e-3})
    with pytest.raises(ValueError, match="--spindle-data is refused in Megatron-LM's loop.*SPINDLE_BACKEND=loop"):
        fc.check_megatron_command_line(["--spindle-data", "d", "--micro-batch-size", "2", "--lr", "1",
                                        "--eval-interval", "9"], {})
    fc.check_megatron_command_line(["--micro-batch-size", "2", "--lr", "1", "--eval-interval", "9"], {})
    fc.check_megatron_command_line(["--help", "--pipeline-model-parallel-size", "2"], {})  # Megatron's help


def test_megatron_lms_batch_and_te_asserts_become_one_line(monkeypatch):
    ok = ["--micro-batch-size", "4", "--lr", "1", "--eval-interval", "9"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--global-batch-size 12 is not a multiple of one pass's 8 samples"):
        fc.check_megatron_command_line(ok + ["--global-batch-size", "12"], {})
    fc.check_megatron_command_line(ok + ["--global-batch-size", "16"], {})
    monkeypatch.setattr(fc, "te_installed", lambda: False)
    with pytest.raises(ValueError, match="TransformerEngine is not installed here"):
        fc.check_megatron_command_line(ok + ["--transformer-impl", "transformer_engine"], {})


def test_mapped_flags_become_constraints_and_leave_megatrons_command_line():
    argv = ["--spindle", "--tensor-model-parallel-size", "2", "--recompute-granularity=full", "--recompute-method",
            "uniform", "--use-distributed-optimizer", "--lr", "1e-4"]
    assert fc.constraints(argv) == fc.Constraints(tp=2, distributed_optimizer=True, recompute="full")
    assert fc.megatron_argv(argv) == ["--spindle", "--use-distributed-optimizer", "--lr", "1e-4"]
    assert fc.constraints(["--recompute-activations"]).recompute == "selective"
    assert fc.constraints(["--tensor-model-parallel-size", "1"]) == fc.Constraints()
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 0: must be at least 1"):
        fc.constraints(["--tensor-model-parallel-size", "0"])
    parser = fc.Constraints(tp=4).provider(argparse.ArgumentParser())
    assert fc.Constraints.of(parser.parse_args([])) == fc.Constraints(tp=4)
    parsed = build_parser().parse_args(["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"])
    assert fc.Constraints.of(parsed) == fc.Constraints(tp=2, distributed_optimizer=True)  # the loop's own parser


def test_fallback_args_judges_every_megatron_flag():
    args, at_default = fallback_args(["--spindle", "--tensor-model-parallel-size", "2", "--recompute-activations",
                                      "--pipeline-model-parallel-size", "1", "--num-workers", "2"])
    assert fc.Constraints.of(args) == fc.Constraints(tp=2, recompute="selective")
    assert at_default == ["--pipeline-model-parallel-size", "--num-workers"]
    with pytest.raises(ValueError, match="--data-path a is refused in the built-in loop.*--spindle-data"):
        fallback_args(["--spindle", "--data-path", "a"])
    with pytest.raises(SystemExit):  # neither Megatron-LM's nor Spindle's: argparse's one line
        fallback_args(["--spindle", "--not-a-megatron-flag", "1"])


def test_a_loaded_plan_must_keep_the_mapped_flags():
    from megatron_spindle.megatron.adapter.model import check_constraints
    from megatron_spindle.planner.assembly.execution import Execution
    from megatron_spindle.planner.step.build import plan_system
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph

    graph = build_graph("multitask-clip", tasks=4, size="tiny", batch=8)
    cluster = load_cluster("a800-8x8", num_devices=2, gpus_per_node=2)
    plain = plan_system("spindle", graph, cluster)
    for limits, words in ((fc.Constraints(tp=2), "at tensor-parallel 1, but --tensor-model-parallel-size 2"),
                          (fc.Constraints(distributed_optimizer=True), "--use-distributed-optimizer"),
                          (fc.Constraints(recompute="full"), "with recompute none, but --recompute-granularity")):
        with pytest.raises(ValueError, match=words):
            check_constraints(plain, limits, "p.json")
        kept = plan_system("spindle", graph, cluster, execution=Execution(
            tp=limits.tp, distributed_optimizer=limits.distributed_optimizer, recompute=limits.recompute))
        check_constraints(kept, limits, "p.json")  # a plan made with the flag passes
    check_constraints(plain, fc.Constraints(), "p.json")


def _two_ranks(python: str, backend: str, argv: list[str], port: int, timeout_s: float = 600):
    """Both ranks of ``examples/pretrain_multitask_clip.py`` started by hand; ``[(status, output lines)]``."""
    procs = []
    for r in range(2):
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "SPINDLE_BACKEND": backend, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([python, str(EXAMPLE), *argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    return [(rc, [line for line in text.splitlines() if line.strip()])
            for rc, text, _ in communicate_all(procs, timeout_s)]


TINY = ["--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--eval-interval", "10", "--eval-iters", "0", "--log-interval", "1",
        "--spindle-predict-interval", "0"]
#: Lines that may precede the refusal: torch's warning when it finds no CUDA runtime (at its import), and the one
#: line naming the optional packages megatron.core did not find (megatron_spindle.log, at megatron.core's import).
FOREIGN = ("No CUDA runtime is found", "TransformerEngine not importable")


def _refused_first(results, flag: str) -> None:
    for status, lines in results:
        ours = [line for line in lines if not any(f in line for f in FOREIGN)]
        assert status == 2, lines[-10:]
        assert ours and ours[0].startswith(f"error: {flag} is refused"), lines[:5]
        assert not any("arguments ---" in line for line in lines), "Megatron's argument dump came first"
    firsts = {next(line for line in lines if line.startswith("error:")) for _, lines in results}
    assert len(firsts) == 1, firsts  # every rank the same line


def test_refused_first_in_the_built_in_loop():
    from launch_path import free_port

    _refused_first(_two_ranks(sys.executable, "loop", TINY + ["--pipeline-model-parallel-size", "2"], free_port()),
                   "--pipeline-model-parallel-size 2")


@pytest.mark.skipif(not HAS_MLM, reason="megatron.training not importable: run under .venv-mlm")
def test_refused_first_in_megatron_lms_loop():
    from launch_path import free_port

    results = _two_ranks(sys.executable, "megatron", TINY + ["--context-parallel-size", "2"], free_port())
    _refused_first(results, "--context-parallel-size 2")
    missing = _two_ranks(sys.executable, "megatron", [a for a in TINY if a not in ("--lr", "1e-3")], free_port())
    for status, lines in missing:
        assert status == 2 and any(line.startswith("error: Megatron-LM's loop needs --lr") for line in lines[:3]), lines


@pytest.mark.skipif(not HAS_MLM, reason="megatron.training not importable: run under .venv-mlm")
def test_mapped_flags_train_in_megatron_lms_loop():
    from launch_path import free_port

    results = _two_ranks(sys.executable, "megatron", TINY + ["--tensor-model-parallel-size", "2",
                                                             "--recompute-granularity", "full"], free_port())
    assert all(status == 0 for status, _ in results), [r[1][-10:] for r in results]
    text = "\n".join(results[0][1])
    assert "the plan keeps --tensor-model-parallel-size 2 --recompute-granularity full" in text
    assert re.search(r"^\s*tensor_model_parallel_size \.+ 1$", text, re.M)  # Megatron's global TP stays 1
    recomputed = re.search(r"(\d+) MetaOp\(s\) recomputed", text)
    assert recomputed and int(recomputed.group(1)) > 0, "--recompute-granularity full recomputed nothing"
    assert text.count("training on synthetic data") == 1


def test_bf16_in_megatron_lms_loop_without_a_gpu_is_one_line():
    """Megatron's mixed-precision optimizer takes CUDA tensors only: on CPU ranks --bf16 there is refused up front,
    naming the built-in loop, instead of a TypeError on every rank."""
    with pytest.raises(ValueError, match="--bf16 in Megatron-LM's loop needs a GPU.*SPINDLE_BACKEND=loop"):
        fc.check_megatron_device(["--lr", "1", "--bf16"], cuda=False)
    fc.check_megatron_device(["--lr", "1", "--bf16"], cuda=True)
    fc.check_megatron_device(["--lr", "1"], cuda=False)
