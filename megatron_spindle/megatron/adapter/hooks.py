"""Megatron-LM's own ``pretrain`` loop running a Spindle model: the hooks, the providers, the entry point.

This is the only module that touches ``megatron.training``, and it imports it only inside functions (an
optional dependency: megatron-core 0.16.1 wheels ship only ``megatron.core``), so it imports without it. Target: Megatron-LM
tag ``core_v0.16.1`` (commit 55ac708; the findings are in ``docs/megatron_interfaces.md``).

A run (``pretrain_spindle.py`` from ``patches/``, or :func:`pretrain_spindle` from a user's script):

1. **Flags.** Before Megatron parses anything, the command line is checked against the flag contract
   (:func:`.flag_contract.check_megatron_command_line`: a refused flag is one line, exit 2, on every rank) and
   the mapped flags (``--tensor-model-parallel-size``, ``--recompute-granularity``) are taken off what Megatron
   parses and handed to the plan as constraints. :func:`.flags.chain_args` is the ``extra_args_provider``: it adds
   the ``--spindle*`` flags (:func:`.flags.add_spindle_args`), runs the user's provider and returns the parser.
2. **Hooks** (:func:`install`). Megatron has no hook for the schedule, so we replace module globals of
   ``megatron.training.training`` (``train`` and ``evaluate`` look them up there at call time):

   * ``get_model``: forced to ``wrap_with_ddp=False``. Megatron's DDP all-reduces every gradient over all
     ranks; Spindle all-reduces each parameter over its own parameter device group. Under ``--bf16``
     ``get_model`` also wraps the chunk in ``Float16Module``; we drop that wrapper (the executor already
     builds its layers in bf16) so :class:`.chunk.MegatronModelChunk` stays the outermost object, where DDP
     would be: ``train_step`` calls ``zero_grad_buffer()`` on it and the optimizer reads ``ddp_config``;
   * ``get_forward_backward_func``: returns :func:`.chunk.megatron_forward_backward` for Spindle chunks
     (Megatron's own schedule for any other model);
   * ``finalize_model_grads``: a no-op for Spindle chunks (``train`` installs it on the config
     unconditionally; our schedule has synchronised the gradients already);
   * ``get_megatron_optimizer_config``: ``clip_grad`` set to 0, and ``get_megatron_optimizer``: its
     ``get_grad_norm`` returns the chunk's norm. Under global TP = PP = 1 Megatron's gradient norm is local
     to each rank, so clipping by it would let replicas of a parameter diverge. The chunk clips by the
     global norm (each shard counted once, ``SpindleModel.clip_grads``) right after the gradient sync, and
     that norm is what Megatron logs as ``grad norm``.

   ``get_model`` and the optimizer config are patched only while the run is a Spindle run (``--spindle``,
   or any run started by :func:`pretrain_spindle`, whose models exist only as wave plans); the other hooks
   decide by the model object, so ``pretrain_gpt.py`` without ``--spindle`` is untouched.
3. **Model** (:func:`spindle_model_provider`): builds the task graph, plans (rank 0 plans and broadcasts,
   or every rank loads ``--spindle-plan``), creates the per-slice process groups (every rank, same order:
   Megatron's process groups exist by then) and returns this rank's :class:`MegatronModelChunk`.
4. **Data** (:func:`train_valid_test_datasets_provider`, ``--dataloader-type external``): multi-task
   batches (:func:`.data.data_iterators`), resumed at the consumed samples.
5. **Step** (:func:`.chunk.megatron_forward_backward`): ``num_microbatches`` passes of the plan, gradient sync,
   global-norm clip; reports ``{task: tensor([sum, count])}`` so ``train_step`` logs each task's loss.

"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.enums import ModelType

from ...compat.mcore import run_pretrain
from ...compat.megatron_lm import apply_cpu_standins, apply_wheel_standins, cuda_on_cpu
from ...log import get_logger, setup_logging
from ...runtime.trace import gather_chrome_trace
from ..trainer import loop as trainer
from .chunk import MegatronModelChunk, megatron_forward_backward, spindle_chunk
from .data import data_iterators, resume_counters
from .flag_contract import check_megatron_command_line, check_megatron_device, constraints, megatron_argv
from .train_flags import local_layers_default
from .flags import chain_args, check_megatron_args, fallback_args, spindle_args
from ..checkpoint.directory import latest_iteration
from ..job.lifeline import LIFE, signal_name
from ..job.preflight import agree_on_inputs, hold_save_lock
from ..trainer.session import run_entry
from .model import build_model, graph_for, layer_backend, log_plan, plan_for, step_passes
from .schedule import forward_step

__all__ = ["install", "uninstall", "pretrain_spindle", "spindle_model_provider", "forward_step",
           "train_valid_test_datasets_provider", "reject_spindle", "reject_spindle_args", "choose_backend", "chain_args", "main"]

log = get_logger(__name__)

#: ``args_defaults`` for ``pretrain``: Megatron requires a GPT geometry and a tokenizer even though a Spindle
#: model has neither; these dummies satisfy ``validate_args`` (a value given on the command line wins).
#: They only feed Megatron's FLOP estimate in its log line, which is therefore meaningless for Spindle runs.
MEGATRON_DEFAULTS = {
    "num_layers": 1, "hidden_size": 64, "num_attention_heads": 1, "max_position_embeddings": 1,
    "seq_length": 1, "tokenizer_type": "NullTokenizer", "vocab_size": 8, "dataloader_type": "external",
}

#: The ``megatron.training.training`` globals :func:`install` replaces.
HOOKED = ("get_model", "get_forward_backward_func", "finalize_model_grads", "get_megatron_optimizer_config",
          "get_megatron_optimizer")

SINGLE_TASK_MESSAGE = (
    "{script} trains a single task; --spindle schedules several tasks of a multi-task model in waves and has "
    "nothing to overlap here. Run pretrain_spindle.py --spindle --spindle-model {{multitask-clip,qwen-val,"
    "ofasys}} instead (the --spindle* flags are accepted here so that shared launch scripts parse).")



_ALWAYS = False  # set by pretrain_spindle: every model of that run is a Spindle model


def _spindle_run(args) -> bool:
    return _ALWAYS or bool(getattr(args, "spindle", False))


def install(args=None, *, always: bool = False, target=None) -> bool:
    """Install the hooks into ``megatron.training.training`` (or ``target``, a module-like object).

    ``args``: when given (parsed Megatron args) and it is not a Spindle run, nothing is installed.
    ``always``: treat every run as a Spindle run (:func:`pretrain_spindle`); otherwise ``--spindle`` decides
    at call time, so ``install()`` may run before Megatron parses its flags. Idempotent; returns whether
    the hooks are in place. :func:`uninstall` restores the originals.
    """
    global _ALWAYS
    if args is not None and not (always or _spindle_run(args)):
        return False
    if target is None:
        import megatron.training.training as target  # noqa: PLW0621  # optional: megatron.training (the real loop)
    _ALWAYS = _ALWAYS or always
    if getattr(target, "_spindle_originals", None) is not None:
        return True
    orig = {name: getattr(target, name) for name in HOOKED}

    def get_args():
        return target.get_args()

    @functools.wraps(orig["get_model"])
    def get_model(*a, **kw):
        if not _spindle_run(get_args()):
            return orig["get_model"](*a, **kw)
        if len(a) > 2:
            a = (*a[:2], False, *a[3:])
        else:
            kw["wrap_with_ddp"] = False
        chunks = orig["get_model"](*a, **kw)
        found = [spindle_chunk(c) for c in chunks]
        if any(c is None for c in found):
            raise TypeError("a --spindle run needs a model provider that returns a MegatronModelChunk "
                            "(megatron_spindle.megatron.adapter.hooks.spindle_model_provider); got "
                            f"{[type(c).__name__ for c in chunks]}")
        return found  # drops Float16Module: the chunk holds its layers in the run's dtype already

    @functools.wraps(orig["get_forward_backward_func"])
    def get_forward_backward_func(*a, **kw):
        theirs = orig["get_forward_backward_func"](*a, **kw)

        def forward_backward(**fkw):
            if spindle_chunk(fkw.get("model")) is not None:
                return megatron_forward_backward(**fkw)
            return theirs(**fkw)

        return forward_backward

    @functools.wraps(orig["finalize_model_grads"])
    def finalize_model_grads(model, *a, **kw):
        if spindle_chunk(model) is not None:
            return None  # megatron_forward_backward synchronised the gradients per parameter group
        return orig["finalize_model_grads"](model, *a, **kw)

    @functools.wraps(orig["get_megatron_optimizer_config"])
    def get_megatron_optimizer_config(args, *a, **kw):
        config, overrides = orig["get_megatron_optimizer_config"](args, *a, **kw)
        if _spindle_run(args):
            config.clip_grad = 0.0  # the chunk clips by the global norm; Megatron's norm is per rank here
        return config, overrides

    @functools.wraps(orig["get_megatron_optimizer"])
    def get_megatron_optimizer(config, model_chunks, *a, **kw):
        optimizer = orig["get_megatron_optimizer"](config, model_chunks, *a, **kw)
        chunk = spindle_chunk(model_chunks)
        if chunk is not None:
            norm = lambda: chunk.grad_norm  # noqa: E731
            for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
                opt.get_grad_norm = norm
        return optimizer

    for name, fn in (("get_model", get_model), ("get_forward_backward_func", get_forward_backward_func),
                     ("finalize_model_grads", finalize_model_grads),
                     ("get_megatron_optimizer_config", get_megatron_optimizer_config),
                     ("get_megatron_optimizer", get_megatron_optimizer)):
        setattr(target, name, fn)
    target._spindle_originals = orig
    return True


def uninstall(target=None) -> None:
    """Restore the globals :func:`install` replaced."""
    global _ALWAYS
    if target is None:
        import megatron.training.training as target  # noqa: PLW0621  # optional: megatron.training
    orig = getattr(target, "_spindle_originals", None)
    if orig:
        for name, fn in orig.items():
            setattr(target, name, fn)
    target._spindle_originals = None
    _ALWAYS = False


def build_chunk(args, *, config=None, pg_collection=None, device=None) -> MegatronModelChunk:
    """This rank's Spindle model for Megatron's loop; collective (every rank, after process groups exist).

    Plans as the built-in trainer does (:func:`.model.plan_for`: rank 0 plans and broadcasts, or
    ``--spindle-plan`` is loaded and checked), logs the plan on rank 0, builds the slices of this rank on
    ``device`` (default: :func:`.model.run_device`) in bf16 under ``--bf16``. The plan's passes must be Megatron's
    number of microbatches (``--global-batch-size`` over ``--micro-batch-size`` x ranks) and its optimizer state
    unsharded (Megatron's optimizer steps whole parameters): one line naming the values otherwise.
    """
    problems = check_megatron_args(args)
    if problems:
        raise ValueError("Megatron settings a Spindle run cannot use:\n  " + "\n  ".join(problems))
    layer_backend(args)  # Megatron's parsed --transformer-impl: one line where it cannot run here
    LIFE.stage = "comparing flags and input files with the other ranks; a rank stopped or is still starting"
    agree_on_inputs(args, [k for k in vars(args) if k.startswith("spindle") or k in AGREED])
    if getattr(args, "save", None):
        _LOCKS.append(hold_save_lock(args.save))
    world = dist.get_world_size()
    graph = graph_for(args, world)
    per_pass = (args.micro_batch_size or 1) * world
    glob = getattr(args, "global_batch_size", None)
    LIFE.stage = "planning (rank 0) and sharing the plan; a rank stopped or planning takes long"
    plan = plan_for(args, graph, world, passes=max(1, (glob or per_pass) // per_pass))  # Megatron's microbatches
    passes = step_passes(plan, glob, per_pass)  # Megatron's num_microbatches must be the plan's passes
    if plan.distributed_optimizer:
        raise ValueError("the plan shards the optimizer state (distributed_optimizer), but under Megatron-LM's "
                         "loop Megatron's optimizer steps whole parameters: use a plan without the distributed "
                         "optimizer, or the built-in trainer (SPINDLE_BACKEND=loop)")
    log_plan(args, plan, graph, world, passes=passes)
    LIFE.stage = "creating this rank's process groups and layers; a rank stopped"
    model = build_model(args, plan, graph, device=device)
    LIFE.disarm()
    _megatron_stops(args)
    return MegatronModelChunk(model, config=config, pg_collection=pg_collection,
                              clip_grad=getattr(args, "clip_grad", 0.0) or 0.0)


_BUILT: list[MegatronModelChunk] = []  # the chunk of the current run, for the trace written after training
_LOCKS: list = []  # the --save lock of the current run (rank 0), released when pretrain_spindle returns or exits

#: Megatron flags every rank must share besides the ``--spindle*`` ones (others, such as ``rank``, differ).
AGREED = ("micro_batch_size", "global_batch_size", "seed", "train_iters", "save", "load", "lr", "min_lr",
          "bf16", "exit_signal_handler", "init_method_std", "hidden_dropout", "attention_dropout")


def _megatron_stops(args) -> None:
    """Signals in Megatron-LM's loop. Its loop has no place for the built-in trainer's after-the-step check,
    so SIGINT and SIGTERM stop it at once (the last checkpoint is whole: saves are atomic) with the line;
    under ``--exit-signal-handler`` its own handler owns its exit signal (finish the step, save, exit 0)."""
    if getattr(args, "exit_signal_handler", False):
        LIFE.owned = {int(getattr(args, "exit_signal", signal.SIGTERM))}

    def stop_now(sig: int) -> None:
        it = getattr(args, "curr_iteration", None) or getattr(args, "iteration", 0)
        saved = latest_iteration(args.save) if getattr(args, "save", None) else None
        last = (f"last checkpoint: {args.save} at iteration {saved} (resume with --load {args.save})"
                if saved is not None else "no checkpoint saved")
        LIFE.stop_with(f"stopped by {signal_name(sig)} at iteration {it} of {args.train_iters} (Megatron-LM's "
                       f"loop stops at once); {last}", 128 + sig)

    LIFE.stop_now = stop_now
    LIFE.training()


def spindle_model_provider(pre_process: bool = True, post_process: bool = True, config=None,
                           pg_collection=None, vp_stage=None) -> MegatronModelChunk:
    """Megatron's ``model_provider`` (called by ``get_model`` with these keywords): this rank's chunk.

    ``pre_process``/``post_process`` are ignored: the plan decides which layers a rank holds.
    """
    from megatron.training import get_args  # optional: megatron.training

    if vp_stage is not None:
        raise ValueError("Spindle runs one model chunk per rank; drop the virtual-pipeline flags")
    args = get_args()
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args  # optional: megatron.training
        config = core_transformer_config_from_args(args)
    chunk = build_chunk(args, config=config, pg_collection=pg_collection)
    _BUILT[:] = [chunk]
    return chunk


@contextlib.contextmanager
def resumed_counters():
    """While Megatron-LM's ``pretrain`` runs: after it loads a checkpoint, its sample counters are this run's
    (:func:`.data.resume_counters`; a checkpoint of ``SPINDLE=0`` under ``--spindle`` and the reverse)."""
    import megatron.training.training as mt  # optional: megatron.training

    original = mt.setup_model_and_optimizer

    @functools.wraps(original)
    def setup_model_and_optimizer(*a, **kw):
        model, optimizer, scheduler = original(*a, **kw)
        if resume_counters(mt.get_args(), scheduler):
            log.info(f"checkpoint of iteration {mt.get_args().iteration}: its schedule and consumed samples "
                     f"counted in this run's units ({mt.get_args().global_batch_size} samples per step)")
        return model, optimizer, scheduler

    mt.setup_model_and_optimizer = setup_model_and_optimizer
    try:
        yield
    finally:
        mt.setup_model_and_optimizer = original


def megatron_args():
    """Megatron's parsed arguments (``megatron.training.get_args``), for the adapter's modules that must not import
    ``megatron.training`` themselves (the MIMO loop without Spindle, :mod:`.mimo_megatron`)."""
    from megatron.training import get_args  # optional: megatron.training

    return get_args()


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's dataset provider for ``--dataloader-type external``: see :func:`data_iterators`."""
    from megatron.training import get_args  # optional: megatron.training

    args = get_args()
    graph = graph_for(args, dist.get_world_size())
    tasks = _BUILT[0].plan.tasks if _BUILT else graph.tasks
    # resumed at the loaded checkpoint's iteration: its sample counts are its writer's (SPINDLE=0 adds up the tasks)
    consumed = (getattr(args, "iteration", 0) or 0) * args.global_batch_size
    return data_iterators(graph, args.seed, tasks, consumed_train=consumed,
                          consumed_valid=getattr(args, "consumed_valid_samples", 0) or 0)


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its iterators


def reject_spindle(model_provider: Callable, script: str = "pretrain_gpt.py") -> Callable:
    """Wrap a single-task script's model provider: with ``--spindle`` it stops with a clear message.

    Used by the ``pretrain_gpt.py`` patch: the flags parse there (shared launch scripts keep working), but a
    single task has one chain of MetaOps and nothing for wavefront scheduling to overlap.
    """

    @functools.wraps(model_provider)
    def provider(*a, **kw):
        from megatron.training import get_args  # optional: megatron.training
        if getattr(get_args(), "spindle", False):
            raise SystemExit("error: " + SINGLE_TASK_MESSAGE.format(script=script))
        return model_provider(*a, **kw)

    return provider


def reject_spindle_args(args, script: str = "pretrain_gpt.py") -> None:
    """The same check as :func:`reject_spindle` for scripts that parse the flags themselves and pass no model
    provider (``pretrain_gpt.py`` at Megatron-LM ``core_v0.19.0``: ``parse_and_validate_args``, then a config
    container): with ``--spindle`` it stops with the same message."""
    if getattr(args, "spindle", False):
        raise SystemExit("error: " + SINGLE_TASK_MESSAGE.format(script=script))


def choose_backend(*, has_training: bool | None = None, has_cuda: bool | None = None) -> tuple[str, str]:
    """``("megatron", "")`` when Megatron-LM's loop can run here, else ``("loop", reason)``.

    Megatron's ``initialize_megatron`` asserts CUDA, and ``megatron.training`` is not part of the
    megatron-core wheel; without either, :func:`pretrain_spindle` uses the built-in loop.
    """
    if has_training is None:
        try:
            import megatron.training.training  # noqa: F401  # optional: probing for megatron.training
            has_training, why = True, ""
        except Exception as e:  # noqa: BLE001 - any import failure means: no Megatron-LM loop here
            has_training, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    else:
        why = "not installed"
    if not has_training:
        return "loop", f"megatron.training is not importable ({why})"
    if has_cuda is None:
        has_cuda = torch.cuda.is_available()
    if not has_cuda:
        return "loop", "no CUDA device (SPINDLE_BACKEND=megatron runs Megatron-LM's loop on CPU ranks anyway)"
    return "megatron", ""


def pretrain_spindle(extra_args_provider: Callable | None = None, *, args_defaults: dict | None = None,
                     argv=None, backend: str | None = None):
    """Train a Spindle multi-task model with Megatron-LM's ``pretrain``, or the built-in loop where it can't run.

    For users who write their own script: ``extra_args_provider`` adds their flags (chained after the
    ``--spindle*`` ones); ``args_defaults`` override :data:`MEGATRON_DEFAULTS`. ``argv`` (default
    ``sys.argv[1:]``) is what Megatron parses, or the fallback, which prints one notice line and runs
    :func:`..trainer.loop.pretrain` (returning its summary dict). ``backend`` (default: the ``SPINDLE_BACKEND``
    environment variable): ``"megatron"`` or ``"loop"`` instead of :func:`choose_backend`'s choice; ``"megatron"`` without CUDA runs Megatron-LM's loop on gloo CPU ranks
    through :mod:`megatron_spindle.compat.megatron_lm`'s stand-ins (what ``make test-megatron-lm`` does).
    """
    why = "asked for"
    backend = backend or os.environ.get("SPINDLE_BACKEND") or None
    if backend is None:
        backend, why = choose_backend()
    if backend not in ("megatron", "loop"):
        raise ValueError(f"backend {backend!r}: must be 'megatron' or 'loop'")
    if backend == "loop":
        args, _ = fallback_args(argv, extra_args_provider)  # the contract's refusals first, one line
        log.info(f"spindle: {why}; training with the built-in megatron.core trainer instead")
        try:
            return trainer.pretrain(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    argv = list(sys.argv[1:] if argv is None else argv)
    check_megatron_command_line(argv, {**MEGATRON_DEFAULTS, **(args_defaults or {})})  # before Megatron parses
    check_megatron_device(argv, torch.cuda.is_available())
    limits = constraints(argv)  # the mapped flags, as the plan's constraints: Megatron sees its own flags only
    from megatron.training import get_args  # optional: megatron.training

    apply_wheel_standins()  # a megatron-core wheel: no Makefile for Megatron's `make` of the dataset helpers
    apply_cpu_standins()  # only without CUDA: Megatron-LM's CUDA-only start-up steps
    sys.argv = [sys.argv[0], *megatron_argv(argv)]  # Megatron parses sys.argv
    install(always=True)
    early = spindle_args(argv)  # the start-up deadline, before Megatron parses
    LIFE.arm(min(early.spindle_startup_timeout, early.spindle_timeout))
    LIFE.stage = "starting Megatron-LM (initialize_megatron: the rendezvous of every rank)"
    try:
        with cuda_on_cpu(), resumed_counters():
            run_pretrain(train_valid_test_datasets_provider, spindle_model_provider, ModelType.encoder_or_decoder,
                         forward_step, extra_args_provider=chain_args(local_layers_default, limits.provider,
                                                                      extra_args_provider),
                         args_defaults={**MEGATRON_DEFAULTS, **(args_defaults or {})})
    finally:
        LIFE.disarm()
        while _LOCKS:
            lock = _LOCKS.pop()
            if lock is not None:
                lock.release()
    args = get_args()
    if args.spindle_trace and _BUILT:
        path = gather_chrome_trace(_BUILT[0].module.trace, args.spindle_trace)
        if path:
            log.info(f"Chrome trace of every rank written to {path}")
    return None


def main(argv=None, backend: str | None = None) -> int:
    """``pretrain_spindle.py``: :func:`pretrain_spindle`; how it ends as :func:`..trainer.session.run_entry` says
    (one line: 2 bad input, 3 a failed peer, 128 + N a signal)."""
    LIFE.start()
    setup_logging()
    status = run_entry(lambda: pretrain_spindle(argv=argv, backend=backend))
    if status or LIFE.signal:  # a stop on a signal races the launcher's grace period: no interpreter teardown
        LIFE.exit(status)
    return status
