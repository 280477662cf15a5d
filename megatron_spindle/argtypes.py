"""argparse value types shared by the ``spindle`` subcommands: bad values name themselves; the workload the
shared flags name (:func:`workload_of`)."""
from __future__ import annotations

import argparse

from .planner.tuning.tune import Workload
from .planner.workload.spec import load_spec, shipped_models
from .planner.workload.workloads import resolve_passes


def _int(text: str, minimum: int, what: str = "") -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{what}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"{v} must be positive" if minimum == 1 else f"{v} must not be negative")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def passes_arg(text: str) -> int | str:
    """``auto`` (the planner chooses) or a positive integer."""
    return "auto" if text == "auto" else _int(text, 1, " or 'auto'")


def positive_int_list(text: str) -> list[int]:
    """``8,16,32`` -> ``[8, 16, 32]``."""
    return [_int(part, 1, " (want e.g. 8,16,32)") for part in text.split(",")]


def name_list(text: str) -> list[str]:
    """``vision,text.layers`` -> ``['vision', 'text.layers']`` (module names for ``--freeze``)."""
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name (want e.g. vision,text)")
    return names


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags ``spindle plan`` and ``spindle compare`` share."""
    specs = {name: load_spec(name) for name in shipped_models()}
    p.add_argument("--model", default=None, metavar="NAME|SPEC.toml",
                   help=f"a shipped model ({', '.join(specs)}) or a model spec file (docs/model_spec.md); or "
                        "--model-provider")
    p.add_argument("--model-provider", default=None, metavar="MODULE:FUNCTION",
                   help="a Megatron model provider returning a MimoModel (megatron.core.models.mimo), importable from "
                        "PYTHONPATH; built on the meta device (no weights), its tasks from --tasks-file (docs/mimo.md)")
    p.add_argument("--tasks-file", default=None, metavar="TASKS.toml",
                   help="the tasks of --model-provider's model: [[tasks]] name, modalities, batch (docs/mimo.md)")
    p.add_argument("--tasks", type=positive_int, default=None, metavar="K",
                   help="train the first K tasks, any K from 1 to the model's most ("
                        + "; ".join(f"{n}: {s.task_counts[-1]}, the paper's {', '.join(map(str, s.task_counts))}"
                                    for n, s in specs.items()) + "); default: the most")
    p.add_argument("--size", default="full",
                   help="model size: full (the paper's) or one of the spec's [sizes] ("
                        + "; ".join(f"{n}: {', '.join(s.sizes)}" for n, s in specs.items() if s.sizes)
                        + "; tiny: tests, CPU demo)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="global batch per task per optimizer step, Megatron's --global-batch-size (default: the "
                        "model's, from the published recipe it stands for)")
    p.add_argument("--passes", type=passes_arg, default=None,
                   help="passes per optimizer step (gradient accumulation; each pass plans --batch / --passes "
                        "samples per task): K holds Spindle (in compare, every system) to K passes, nothing "
                        "recomputed; default, or 'auto': the tuned configuration (passes, recompute, phases, the "
                        "distributed optimizer), the same in spindle plan and spindle compare")
    p.add_argument("--curves", default=None, metavar="FILE",
                   help="JSON scaling curves / device constants (default: the analytic model)")
    p.add_argument("--freeze", type=name_list, default=[], metavar="MODULE[,MODULE]",
                   help="modules (or components: vision = vision.*) whose weights do not train: forward only "
                        "(input gradient only after a trained module), no gradient sync, no optimizer state")


def check_model_flags(args) -> None:
    """Exactly one of ``--model`` and ``--model-provider`` (which needs ``--tasks-file``): one line otherwise."""
    if bool(args.model) == bool(args.model_provider):
        raise ValueError("give --model NAME|SPEC.toml or --model-provider MODULE:FUNCTION (with --tasks-file), one of them")
    if args.model_provider and not args.tasks_file:
        raise ValueError(f"--model-provider {args.model_provider} needs --tasks-file TASKS.toml (docs/mimo.md)")
    if args.tasks_file and not args.model_provider:
        raise ValueError(f"--tasks-file {args.tasks_file} goes with --model-provider; a spec's tasks are in the spec")
    if args.model_provider and args.size != "full":
        raise ValueError(f"--size {args.size}: a model provider's model has the size it builds; drop --size")


def workload_of(args):
    """The workload the shared flags name: a spec model (:class:`.planner.tuning.tune.Workload`), or a user's MIMO
    provider and its tasks (:class:`.mimo.workload.MimoWorkload`, the model built on the meta device)."""
    check_model_flags(args)
    if not args.model_provider:
        return Workload(model=args.model, tasks=args.tasks, size=args.size, batch=args.batch, freeze=args.freeze)
    from .models.mimo_source import load_source  # optional: torch, for --model-provider only (plan runs without it)
    source = load_source(args.model_provider, args.tasks_file, say=True)
    return source.workload(task_count=args.tasks, batch=args.batch, freeze=args.freeze)


def passes_of(args) -> int:
    """Passes per step the flags say (``--passes`` not ``auto``): a spec's default unless ``--batch`` is given; 1 for
    a MIMO provider unless ``--passes``."""
    if args.model_provider:
        return args.passes if isinstance(args.passes, int) else 1
    return resolve_passes(args.model, size=args.size, batch=args.batch,
                          passes=None if args.passes == "auto" else args.passes)
