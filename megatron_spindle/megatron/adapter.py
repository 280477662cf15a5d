"""Megatron-LM's own ``pretrain`` loop running a Spindle model: the hooks, the providers, the entry point.

This is the only module that touches ``megatron.training``, and it imports it only inside functions, so
the module itself imports without it (megatron-core wheels ship only ``megatron.core``). Target: Megatron-LM
tag ``core_v0.16.1`` (commit 55ac708; the findings are in ``docs/megatron_interfaces.md``).

A run (``pretrain_spindle.py`` from ``patches/``, or :func:`pretrain_spindle` from a user's script):

1. **Flags.** :func:`chain_args` is the ``extra_args_provider``: it adds the ``--spindle*`` flags
   (:func:`.args.add_spindle_args`), runs the user's provider and returns the parser.
2. **Hooks** (:func:`install`). Megatron has no hook for the schedule, so we replace module globals of
   ``megatron.training.training`` (``train`` and ``evaluate`` look them up there at call time):

   * ``get_model``: forced to ``wrap_with_ddp=False``. Megatron's DDP all-reduces every gradient over all
     ranks; Spindle all-reduces each parameter over its own parameter device group. Under ``--bf16``
     ``get_model`` also wraps the chunk in ``Float16Module``; we drop that wrapper (the executor already
     builds its layers in bf16) so :class:`MegatronModelChunk` stays the outermost object, where DDP
     would be: ``train_step`` calls ``zero_grad_buffer()`` on it and the optimizer reads ``ddp_config``;
   * ``get_forward_backward_func``: returns :func:`megatron_forward_backward` for Spindle chunks
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
   synthetic batches (:class:`~megatron_spindle.models.data.SyntheticData`), resumed at the consumed samples.
5. **Step** (:func:`megatron_forward_backward`): ``num_microbatches`` passes of the plan, gradient sync,
   global-norm clip; reports ``{task: tensor([sum, count])}`` so ``train_step`` logs each task's loss.

Batch sizes keep Megatron's meaning: ``--micro-batch-size`` is per rank, so one pass of the plan carries
``micro_batch_size x world`` samples of every task; ``--global-batch-size`` is samples of every task per
step, and Megatron's ``num_microbatches = global / (micro x world)`` is the number of passes.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm

from .args import add_spindle_args

#: ``args_defaults`` for ``pretrain``: Megatron requires a GPT geometry and a tokenizer even though a Spindle
#: model has neither; these dummies satisfy ``validate_args`` (a value given on the command line wins).
#: They only feed Megatron's FLOP estimate in its log line, which is therefore meaningless for Spindle runs.
MEGATRON_DEFAULTS = {
    "num_layers": 1, "hidden_size": 64, "num_attention_heads": 1, "max_position_embeddings": 1,
    "seq_length": 1, "tokenizer_type": "NullTokenizer", "vocab_size": 8, "dataloader_type": "external",
}

#: Where the validation and test iterators start in the synthetic stream, so they never meet training data.
VALID_OFFSET, TEST_OFFSET = 10 ** 9, 2 * 10 ** 9

#: The ``megatron.training.training`` globals :func:`install` replaces.
HOOKED = ("get_model", "get_forward_backward_func", "finalize_model_grads", "get_megatron_optimizer_config",
          "get_megatron_optimizer")

SINGLE_TASK_MESSAGE = (
    "{script} trains a single task; --spindle schedules several tasks of a multi-task model in waves and has "
    "nothing to overlap here. Run pretrain_spindle.py --spindle --spindle-model {{multitask-clip,qwen-val,"
    "ofasys}} instead (the --spindle* flags are accepted here so that shared launch scripts parse).")


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------
def chain_args(*providers: Callable | None) -> Callable:
    """An ``extra_args_provider`` that adds the ``--spindle*`` flags, then runs ``providers`` in order.

    ``None`` entries are skipped, so ``chain_args(add_modelopt_args if has_modelopt else None)`` works.
    Like Megatron's hook, every provider takes the parser and must return it.
    """

    def spindle_extra_args_provider(parser):
        parser = add_spindle_args(parser)
        for provider in providers:
            if provider is None:
                continue
            out = provider(parser)
            if out is None:
                raise TypeError(f"extra_args_provider {getattr(provider, '__name__', provider)!r} returned None; "
                                f"Megatron's contract is to return the parser")
            parser = out
        return parser

    return spindle_extra_args_provider


def check_megatron_args(args) -> list[str]:
    """Megatron settings a Spindle run cannot honour, one sentence each (empty: all fine).

    The wave plan sets each slice's tensor- and data-parallel degree, so Megatron's global parallel sizes
    must stay 1 (then its data-parallel size is the world size). The executor owns the gradients, so the
    DDP-based features (distributed optimizer, FSDP, overlapped reduction) and fp16 loss scaling, which the
    schedule would have to apply, are out.
    """
    get = functools.partial(getattr, args)
    bad = []
    for name, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size"),
                       ("expert_model_parallel_size", "--expert-model-parallel-size")):
        if (get(name, 1) or 1) != 1:
            bad.append(f"{flag} {get(name)}: must be 1; the Spindle plan sets every slice's parallel degrees")
    if get("virtual_pipeline_model_parallel_size", None) is not None:
        bad.append("virtual pipeline stages: Spindle runs one model chunk per rank")
    if get("fp16", False) or get("loss_scale", None) is not None:
        bad.append("--fp16 / --loss-scale: the wave executor applies no loss scaling; use --bf16")
    for name, flag in (("use_distributed_optimizer", "--use-distributed-optimizer"),
                       ("use_torch_fsdp2", "--use-torch-fsdp2"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
                       ("overlap_grad_reduce", "--overlap-grad-reduce"),
                       ("overlap_param_gather", "--overlap-param-gather"),
                       ("init_model_with_meta_device", "--init-model-with-meta-device")):
        if get(name, False):
            bad.append(f"{flag}: needs Megatron's DDP buffers; Spindle synchronises gradients per parameter group")
    if get("dataloader_type", "external") != "external":
        bad.append(f"--dataloader-type {get('dataloader_type')}: Spindle feeds multi-task batches through "
                   f"--dataloader-type external")
    if (get("save", None) or get("load", None)) and get("ckpt_format", "torch_dist") != "torch_dist":
        bad.append(f"--ckpt-format {get('ckpt_format')}: Spindle checkpoints are torch_dist (sharded) only")
    if get("spindle_task_schedule", None):
        bad.append("--spindle-task-schedule: replanning mid-run needs the built-in loop (spindle train)")
    if get("micro_batch_size", None) is None:
        bad.append("--micro-batch-size is required (samples of every task per rank per pass)")
    return bad


# --------------------------------------------------------------------------------------------------
# The model chunk Megatron sees
# --------------------------------------------------------------------------------------------------
class MegatronModelChunk(torch.nn.Module):
    """A :class:`~megatron_spindle.runtime.executor.SpindleModel` dressed as the model chunk Megatron expects.

    It stands where Megatron's DDP wrapper would stand (outermost), and provides what ``train_step``, the
    optimizer builder and checkpointing read: ``zero_grad_buffer()``, ``force_all_reduce``, ``config``
    (a ``TransformerConfig``: the hook attributes ``train`` sets live there), ``ddp_config`` (a default
    ``DistributedDataParallelConfig``: no distributed optimizer, no FSDP), ``pg_collection``,
    ``sharded_state_dict`` / ``load_state_dict``, ``no_sync`` / ``finish_grad_sync`` (no-ops). Forward,
    backward, gradient sync and clipping delegate to the Spindle model.

    Args:
        model: this rank's Spindle model.
        config: the ``TransformerConfig`` Megatron's loop reads (from ``core_transformer_config_from_args``).
        pg_collection: the ``ProcessGroupCollection`` ``get_model`` passed (Megatron's global groups).
        clip_grad: global gradient-norm clip applied after each synchronised step (0: off).
    """

    def __init__(self, model, *, config=None, pg_collection=None, clip_grad: float = 0.0) -> None:
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = model
        self.config = config
        self.ddp_config = DistributedDataParallelConfig()
        self.pg_collection = pg_collection
        self.force_all_reduce = False
        self.clip_grad = float(clip_grad)
        self.grad_norm: float | None = None
        """Global gradient norm of the last training step (before clipping); what Megatron logs."""
        self.steps = 0

    # -- what the schedule uses -----------------------------------------------------------------------
    @property
    def plan(self):
        return self.module.plan

    @property
    def graph(self):
        return self.module.graph

    def forward(self, batch):
        return self.module(batch)

    def backward(self, state, *, loss_scale: float = 1.0) -> None:
        self.module.backward(state, loss_scale=loss_scale)

    def finalize_grads(self) -> None:
        self.module.finalize_grads()

    def clip_grads(self) -> float:
        """Clip by the global norm (``clip_grad``; 0 only measures); records and returns the norm."""
        self.grad_norm = self.module.clip_grads(self.clip_grad)
        return self.grad_norm

    def report_device(self) -> torch.device:
        """Where loss reports go: Megatron's ``train_step`` all-reduces them with NCCL on GPUs."""
        return self.module.device

    # -- what Megatron's train_step / optimizer read ----------------------------------------------------
    def zero_grad_buffer(self) -> None:
        for p in self.module.unique_parameters():
            p.grad = None

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: :func:`megatron_forward_backward` synchronises gradients before returning."""

    # -- checkpointing ----------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[str, torch.nn.Parameter, object]]:
        """``(dict key, parameter, ShardedTensor template)`` for every local parameter, prefix-free.

        The templates are :func:`.checkpoint.sharded_state_dict`'s (plan-independent keys
        ``model/<param_key>/<name>``, the right offsets and replica ids), so a checkpoint written through
        Megatron holds the model under the same keys as the built-in loop's. A second local copy of a shard
        (one per tensor-parallel group it serves) gets its own entry with the same key and a non-main
        replica id: Megatron's optimizer needs every parameter it steps to appear in the model's dict.
        """
        from dataclasses import replace

        from .checkpoint import sharded_state_dict

        base = sharded_state_dict(self.module)
        by_storage = {(p.data_ptr(), p.numel()): p for p in self.module.unique_parameters()}
        out, main_of = [], {}
        for key, sh in base.items():
            p = by_storage[(sh.data.data_ptr(), sh.data.numel())]
            out.append((key, p, sh))
            main_of[id(p)] = sh
        copies: dict[tuple[str, int], int] = {}
        for param_key, shard, mod in self.module.local_cores():
            n = copies[(param_key, shard)] = copies.get((param_key, shard), -1) + 1
            if n == 0:
                continue  # the main copy, already in ``base``
            for name, p in sorted(mod.core.named_parameters()):
                sh = base[f"model/{param_key}/{name}"]
                rid = tuple(sh.replica_id) if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
                out.append((f"model/{param_key}/{name}#copy{n}", p,
                            replace(sh, data=p.data.view(sh.local_shape), replica_id=(*rid, n))))
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's ``MegatronModule.sharded_state_dict`` contract, keys prefixed with ``prefix``.

        Each value's data is the parameter object itself (Megatron's optimizer finds its state by
        ``id(param)``): a ``ShardedTensor`` when the stored layout is the parameter's shape, else a
        ``ShardedTensorFactory`` that views the parameter (or an optimizer state of its shape) as the stored
        block. ``metadata`` (Megatron's global DP group) is not used: replica ids come from the plan.
        """
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        if sharded_offsets:
            raise ValueError(f"Spindle chunks take no pipeline offsets, got sharded_offsets={sharded_offsets!r}")
        out = {}
        for key, p, sh in self._entries():
            if tuple(sh.local_shape) == tuple(p.shape):
                out[prefix + key] = replace(sh, key=prefix + sh.key, data=p)
                continue

            def build(k, data, replica_id, flattened_range, _sh=sh):
                return replace(_sh, key=k, data=data.view(_sh.local_shape), replica_id=replica_id,
                               dtype=data.dtype)

            def merge(loaded, _shape=tuple(p.shape)):
                return loaded.reshape(_shape)

            out[prefix + key] = ShardedTensorFactory(prefix + sh.key, p, build, merge, replica_id=sh.replica_id)
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy loaded tensors (keys as :meth:`sharded_state_dict` with no prefix) into the parameters."""
        from torch.nn.modules.module import _IncompatibleKeys

        entries = {key: p for key, p, _ in self._entries()}
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict if k not in entries]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Spindle chunk state dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                               f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        with torch.no_grad():
            for k, p in entries.items():
                v = state_dict.get(k)
                if v is not None and v is not p and v.data_ptr() != p.data_ptr():
                    p.copy_(v.reshape(p.shape))
        return _IncompatibleKeys(missing, unexpected)


def spindle_chunk(model) -> MegatronModelChunk | None:
    """The :class:`MegatronModelChunk` in ``model`` (a list of chunks, or a chunk under wrappers), else None."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            return None
        model = model[0]
    seen = 0
    while not isinstance(model, MegatronModelChunk) and hasattr(model, "module") and seen < 8:
        model, seen = model.module, seen + 1
    return model if isinstance(model, MegatronModelChunk) else None


# --------------------------------------------------------------------------------------------------
# The forward-backward function train_step and evaluate call
# --------------------------------------------------------------------------------------------------
def megatron_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                              forward_only: bool = False, **kwargs) -> list[dict]:
    """:func:`.schedule.spindle_forward_backward` for Megatron's loop, plus what the loop expects around it.

    Accepts every keyword ``train_step``/``evaluate`` pass (core_v0.16.1: ``seq_length, micro_batch_size,
    decoder_seq_length, adjust_tensor_shapes_fn, force_all_reduce``; newer: ``p2p_communicator,
    pg_collection``). After a training call the gradients are synchronised and clipped by the global norm;
    the reports are moved to the model's device (NCCL all-reduces them) with every task on every rank.
    """
    from .schedule import spindle_forward_backward

    chunk = spindle_chunk(model)
    if chunk is None:
        raise TypeError(f"the Spindle schedule needs one MegatronModelChunk per rank, got {type(model).__name__}")
    if not forward_only:
        chunk.module.trace.step = chunk.steps
        chunk.steps += 1
    reports = spindle_forward_backward(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                       model=[chunk], num_microbatches=num_microbatches,
                                       forward_only=forward_only, **kwargs)
    if not forward_only:
        chunk.clip_grads()
    device = chunk.report_device()
    return [{k: v.to(device) for k, v in r.items()} for r in reports]


# --------------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------------
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
        import megatron.training.training as target  # noqa: PLW0621 - the real loop
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
                            "(megatron_spindle.megatron.adapter.spindle_model_provider); got "
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
        import megatron.training.training as target  # noqa: PLW0621
    orig = getattr(target, "_spindle_originals", None)
    if orig:
        for name, fn in orig.items():
            setattr(target, name, fn)
    target._spindle_originals = None
    _ALWAYS = False


# --------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------
def _log0(*parts) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def graph_for(args, world: int):
    """The task graph of this run: one pass carries ``micro_batch_size x data-parallel size`` samples per task."""
    from ..planner.workloads import build_graph

    if not args.micro_batch_size:
        raise ValueError("--micro-batch-size is required (samples of every task per rank per pass)")
    dp = getattr(args, "data_parallel_size", None) or world
    return build_graph(args.spindle_model, tasks=args.spindle_tasks, size=args.spindle_size,
                       batch=args.micro_batch_size * dp)


def build_chunk(args, *, config=None, pg_collection=None, device=None) -> MegatronModelChunk:
    """This rank's Spindle model for Megatron's loop; collective (every rank, after process groups exist).

    Plans like the built-in loop (:func:`.loop.plan_for`: rank 0 plans and broadcasts, or ``--spindle-plan``
    is loaded and checked), logs the plan on rank 0, builds the slices of this rank on ``device`` (default:
    the current CUDA device, else the CPU) in bf16 under ``--bf16``.
    """
    from ..planner.render import gantt, grid, summary
    from ..runtime.cpu_compat import apply_cpu_patches
    from ..runtime.executor import SpindleModel
    from .loop import plan_for

    problems = check_megatron_args(args)
    if problems:
        raise ValueError("Megatron settings a Spindle run cannot use:\n  " + "\n  ".join(problems))
    world = dist.get_world_size()
    graph = graph_for(args, world)
    plan = plan_for(args, graph, world)
    _log0(f"spindle: {'wave plan' if getattr(args, 'spindle', False) else 'sequential (Megatron-style) plan'} "
          f"for {graph.model} ({len(graph.tasks)} tasks, {args.spindle_size}) on {world} ranks, "
          f"{graph.operators[0].batch} samples per task per pass")
    _log0(grid(plan))
    _log0(summary(plan))
    if args.spindle_gantt and dist.get_rank() == 0:
        gantt(plan, args.spindle_gantt)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or torch.device(device).type == "cpu":
        apply_cpu_patches()
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float32
    model = SpindleModel(plan, graph, seed=args.seed, timeout_s=args.spindle_timeout, dtype=dtype, device=device)
    if args.spindle_check_equivalence:
        from ..models.data import SyntheticData
        from .equivalence import check_first_step
        diff = check_first_step(model, graph, SyntheticData(graph, seed=args.seed).batch(0), args.seed)
        _log0(f"equivalence: max relative difference {diff:.3e}")
    return MegatronModelChunk(model, config=config, pg_collection=pg_collection,
                              clip_grad=getattr(args, "clip_grad", 0.0) or 0.0)


_BUILT: list[MegatronModelChunk] = []  # the chunk of the current run, for the trace written after training


def spindle_model_provider(pre_process: bool = True, post_process: bool = True, config=None,
                           pg_collection=None, vp_stage=None) -> MegatronModelChunk:
    """Megatron's ``model_provider`` (called by ``get_model`` with these keywords): this rank's chunk.

    ``pre_process``/``post_process`` are ignored: the plan decides which layers a rank holds.
    """
    from megatron.training import get_args

    if vp_stage is not None:
        raise ValueError("Spindle runs one model chunk per rank; drop the virtual-pipeline flags")
    args = get_args()
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args
        config = core_transformer_config_from_args(args)
    chunk = build_chunk(args, config=config, pg_collection=pg_collection)
    _BUILT[:] = [chunk]
    return chunk


def data_iterators(args, world: int, *, tasks=None):
    """``(train, valid, test)`` multi-task iterators for ``--dataloader-type external``.

    Synthetic and deterministic in ``(seed, pass)``; training resumes at ``consumed_train_samples`` (one
    pass consumes ``micro_batch_size x world`` samples per task); validation and test read disjoint stretches
    of the same stream (:data:`VALID_OFFSET`, :data:`TEST_OFFSET`).
    """
    from .loop import _Batches

    graph = graph_for(args, world)
    per_pass = graph.operators[0].batch
    tasks = tuple(tasks or graph.tasks)
    train = _Batches(graph, args.seed, tasks, position=(getattr(args, "consumed_train_samples", 0) or 0) // per_pass)
    valid = _Batches(graph, args.seed, tasks,
                     position=VALID_OFFSET + (getattr(args, "consumed_valid_samples", 0) or 0) // per_pass)
    test = _Batches(graph, args.seed, tasks, position=TEST_OFFSET)
    return train, valid, test


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's dataset provider for ``--dataloader-type external``: see :func:`data_iterators`."""
    from megatron.training import get_args

    args = get_args()
    tasks = _BUILT[0].plan.tasks if _BUILT else None
    return data_iterators(args, dist.get_world_size(), tasks=tasks)


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its iterators


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for Spindle models (:func:`.schedule.forward_step`)."""
    from .schedule import forward_step as spindle_forward_step
    return spindle_forward_step(data_iterator, model)


def reject_spindle(model_provider: Callable, script: str = "pretrain_gpt.py") -> Callable:
    """Wrap a single-task script's model provider: with ``--spindle`` it stops with a clear message.

    Used by the ``pretrain_gpt.py`` patch: the flags parse there (shared launch scripts keep working), but a
    single task has one chain of MetaOps and nothing for wavefront scheduling to overlap.
    """

    @functools.wraps(model_provider)
    def provider(*a, **kw):
        from megatron.training import get_args
        if getattr(get_args(), "spindle", False):
            raise SystemExit("error: " + SINGLE_TASK_MESSAGE.format(script=script))
        return model_provider(*a, **kw)

    return provider


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------
def choose_backend(*, has_training: bool | None = None, has_cuda: bool | None = None) -> tuple[str, str]:
    """``("megatron", "")`` when Megatron-LM's loop can run here, else ``("loop", reason)``.

    Megatron's ``initialize_megatron`` asserts CUDA, and ``megatron.training`` is not part of the
    megatron-core wheel; without either, :func:`pretrain_spindle` uses the built-in loop.
    """
    if has_training is None:
        try:
            import megatron.training.training  # noqa: F401
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
        return "loop", "no CUDA device (Megatron-LM's loop requires one)"
    return "megatron", ""


def fallback_args(argv=None, extra_args_provider: Callable | None = None):
    """Parse ``argv`` for the built-in loop, keeping Megatron's meaning of the batch flags.

    Returns ``(args, ignored)``: flags the loop does not know (Megatron-only ones such as ``--num-layers``)
    are ignored and listed, except misspelt ``--spindle*`` flags, which are errors. ``--micro-batch-size``
    is per rank in both, so a pass carries ``micro_batch_size x world`` samples per task.
    """
    from .args import build_parser

    parser = build_parser("Spindle pretraining (built-in megatron.core loop)")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args, unknown = parser.parse_known_args(argv)
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    bad = [f for f in flags if f.startswith("--spindle")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, flags  # --micro-batch-size is per rank in the loop too (loop.make_graph)


def pretrain_spindle(extra_args_provider: Callable | None = None, *, args_defaults: dict | None = None,
                     argv=None, backend: str | None = None):
    """Train a Spindle multi-task model with Megatron-LM's ``pretrain``, or the built-in loop where it can't run.

    For users who write their own script: ``extra_args_provider`` adds their flags (chained after the
    ``--spindle*`` ones); ``args_defaults`` override :data:`MEGATRON_DEFAULTS`. Megatron parses
    ``sys.argv``; ``argv`` is used only by the fallback, which prints one notice line and runs
    :func:`.loop.pretrain` (returning its summary dict).
    """
    why = ""
    if backend is None:
        backend, why = choose_backend()
    if backend not in ("megatron", "loop"):
        raise ValueError(f"backend {backend!r}: must be 'megatron' or 'loop'")
    if backend == "loop":
        args, ignored = fallback_args(argv, extra_args_provider)
        if os.environ.get("RANK", "0") == "0":
            print(f"spindle: {why}; training with the built-in megatron.core loop instead"
                  + (f" (ignoring Megatron-only flags {' '.join(ignored)})" if ignored else ""), flush=True)
        from .loop import pretrain as loop_pretrain
        try:
            return loop_pretrain(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    from megatron.core.enums import ModelType
    from megatron.training import get_args

    from ..compat.mcore import run_pretrain
    from ..compat.megatron_lm import apply_cpu_standins, cuda_on_cpu

    apply_cpu_standins()  # only without CUDA: Megatron-LM's CUDA-only start-up steps
    install(always=True)
    with cuda_on_cpu():
        run_pretrain(train_valid_test_datasets_provider, spindle_model_provider, ModelType.encoder_or_decoder,
                     forward_step, extra_args_provider=chain_args(extra_args_provider),
                     args_defaults={**MEGATRON_DEFAULTS, **(args_defaults or {})})
    args = get_args()
    if args.spindle_trace and _BUILT:
        write_trace(_BUILT[0], args.spindle_trace)
    return None


def write_trace(chunk: MegatronModelChunk, directory: str) -> str | None:
    """Gather every rank's wave spans and write ``<directory>/trace.json`` on rank 0 (collective)."""
    from ..runtime.trace import write_chrome_trace

    events = comm.all_gather_object(chunk.module.trace.chrome_events())
    if dist.get_rank() != 0:
        return None
    path = os.path.join(directory, "trace.json")
    write_chrome_trace(path, [e for ev in events for e in ev])
    _log0(f"Chrome trace of every rank written to {path}")
    return path


def main(argv=None) -> int:
    """``pretrain_spindle.py``: :func:`pretrain_spindle`; a configuration error prints one line, exit code 2."""
    try:
        pretrain_spindle(argv=argv)
    except ValueError as e:
        lines = str(e).splitlines() or [type(e).__name__]
        print(f"error: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(line, file=sys.stderr)
        return 2
    return 0
