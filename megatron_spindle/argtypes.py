"""argparse value types shared by the ``spindle`` subcommands: bad values name themselves."""
from __future__ import annotations

import argparse

from .planner.workload.spec import load_spec, shipped_models


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
    p.add_argument("--model", required=True, metavar="NAME|SPEC.toml",
                   help=f"a shipped model ({', '.join(specs)}) or a model spec file (docs/model_spec.md)")
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
