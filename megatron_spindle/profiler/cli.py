"""``spindle profile``: the command line of :mod:`.run`.

``spindle profile --model NAME [--tasks K] [--size tiny|full] [--batch B] --nproc N [--out curves.json]``
measures every MetaOp on the live backend and writes the curves that ``spindle plan --curves`` and
``spindle compare --curves`` read. Run it as is (it starts ``N`` processes) or under
``torchrun --nproc-per-node N -m megatron_spindle.cli profile --model NAME ...`` (without ``--nproc``, which
torchrun's own parser would take for ``--nproc-per-node``).
"""
from __future__ import annotations

import argparse
import os

from ..argtypes import check_model_flags, non_negative_int, positive_int
from ..atomic import check_output
from ..planner.workload.spec import shipped_models
from .points import default_cache_path


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``spindle profile`` on the ``spindle`` command's subparsers."""
    p = subparsers.add_parser(
        "profile", help="measure every MetaOp on this machine's backend and write its scaling curves",
        description="Time forward+backward of one layer of every MetaOp at several device counts (data "
                    "parallel: one process at local batch B/n; tensor parallel: tp processes), fit the "
                    "piecewise curves and write them for `spindle plan/compare --curves`. Points already "
                    "in the cache (same backend, device type, dtype, threads, processes per machine) are not measured again.")
    p.add_argument("--model", default=None, metavar="NAME|SPEC.toml",
                   help=f"a shipped model ({', '.join(shipped_models())}) or a model spec file; or --model-provider")
    p.add_argument("--model-provider", default=None, metavar="MODULE:FUNCTION",
                   help="a Megatron model provider returning a MimoModel, importable from PYTHONPATH (docs/mimo.md)")
    p.add_argument("--tasks-file", default=None, metavar="TASKS.toml", help="the tasks of --model-provider's model")
    p.add_argument("--tasks", type=int, default=None, help="number of tasks (default: the most)")
    p.add_argument("--size", default="full", help="model size: full or tiny")
    p.add_argument("--batch", type=positive_int, default=None, help="global batch per task (default: the model's)")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="processes that measure (gloo on CPU, NCCL with one GPU each); required unless run under "
                        "torchrun, which sets the number (omit it there: torchrun reads --nproc as its own option)")
    p.add_argument("--out", default="curves.json", metavar="FILE", help="curves file to write (default curves.json)")
    p.add_argument("--cluster-out", default=None, metavar="FILE",
                   help="also write the measured link as cluster fields (for spindle compare --cluster FILE)")
    p.add_argument("--max-devices", type=positive_int, default=32,
                   help="largest device count to measure (default 32, as the paper)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="island size of the plans that will use the curves (caps TP, as in spindle plan; default 8)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory per device in GiB (default: measured; decides TP degrees as in spindle plan)")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed repeats per point (default 3)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed repeats per point; the median counts (default 10)")
    p.add_argument("--min-time", type=float, default=0.2, metavar="SECONDS",
                   help="time more repeats of a fast layer until they add up to this (default 0.2)")
    p.add_argument("--cache", default=default_cache_path(), metavar="FILE",
                   help="cache of measured points (default %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--fresh", action="store_true", help="measure every point again (replacing their cache entries)")
    p.add_argument("--no-link", action="store_true",
                   help="do not measure the backend's latency and bandwidth, nor the runtime's own costs")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--skip-unmeasurable", action="store_true",
                   help="leave out MetaOps that need more tensor-parallel processes than --nproc and points that "
                        "run out of device memory (listed in the curves file's not_measured with the reason; "
                        "the planner times them analytically) instead of failing")
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args) -> int:
    from .run import ProfileConfig, profile  # optional: torch (only this subcommand needs it; plan/compare don't)

    for path, what in ((args.out, "--out"), (args.cluster_out, "--cluster-out"),
                       (None if args.no_cache else args.cache, "--cache")):
        if path:
            check_output(path, what)  # before the measuring, not after it
    nproc = args.nproc
    if nproc is None:
        if "WORLD_SIZE" not in os.environ:
            raise ValueError("--nproc N is required (unless run under torchrun)")
        nproc = int(os.environ["WORLD_SIZE"])
    check_model_flags(args)
    cfg = ProfileConfig(model=args.model, model_provider=args.model_provider, tasks_file=args.tasks_file,
                        tasks=args.tasks, size=args.size, batch=args.batch, nproc=nproc,
                        max_devices=args.max_devices, gpus_per_node=args.gpus_per_node,
                        memory_gib=args.memory_gib, warmup=args.warmup, repeats=args.repeats,
                        min_seconds=args.min_time, out=args.out,
                        cluster_out=args.cluster_out, cache=None if args.no_cache else args.cache,
                        fresh=args.fresh, measure_link=not args.no_link, verbose=not args.quiet,
                        skip_unmeasurable=args.skip_unmeasurable)
    profile(cfg)
    return 0
