"""Gradient sync of a Spindle model with megatron.core's ``DistributedDataParallel``, one per rank set.

A parameter device group (``plan.param_groups``) is the set of ranks holding one shard of one weight; its
gradient is summed over exactly those ranks. :class:`GradSync` wraps this rank's parameters in one megatron.core
``DistributedDataParallel`` (DDP) per distinct rank set (parameters whose groups have the same ranks share an
instance), each with a hand-built ``ProcessGroupCollection``: ``dp`` / ``dp_cp`` / ``intra_dp_cp`` /
``expt_dp`` / ``intra_expt_dp`` are the rank set's group from the executor's registry (a one-rank group for
a weight only this rank holds), ``tp`` / ``pp`` / ``cp`` / ``ep`` are one-rank groups (the layers do their own
tensor parallelism; DDP only reduces). What DDP then does for us:

* **buckets and overlap** (``overlap_grad_reduce=True``): each parameter's gradient is added into its
  contiguous ``main_grad`` buffer by a hook when autograd produces it, and a bucket's all-reduce is posted
  asynchronously as soon as every gradient of the bucket is complete, i.e. after the last backward wave on
  this rank that uses it, while later waves still run backward. :meth:`GradSync.finish` waits for all of them
  (before clipping). Parameters are listed latest-completed first (:func:`grad_done_positions`), so megatron's
  buckets (filled from the end of the list) follow the backward order;
* **sum, not mean**: the losses are already normalised by the global batch, so the DDP config sets
  ``calculate_per_token_loss`` (no ``1/dp`` pre-scaling) and ``average_in_collective=False``;
* **reduction dtype**: by default (``grad_reduce_in_fp32=False``, megatron.core's default) gradients are kept
  and reduced in the parameters' dtype: bf16 for a bf16 model, half the bytes of fp32. With
  ``grad_reduce_in_fp32=True`` (what Megatron-LM's ``--bf16`` turns on through
  ``--accumulate-allreduce-grads-in-fp32``) the buffers are fp32; fp32 master weights (:mod:`.mixed_precision`)
  and Megatron's optimizers step from ``main_grad``, so ``p.grad`` is then left None unless
  ``param_dtype_grads`` asks for a copy in the parameter's dtype (a torch optimizer stepping bf16
  parameters itself);
* **accumulation**: ``main_grad`` accumulates over passes; :meth:`no_sync` (Megatron's) keeps buckets from
  firing during the first K-1 passes, so K passes cost one sync.

**Order of reductions.** NCCL needs the collectives of one communicator issued in the same order on every
member, and, because a GPU may run the kernels of different communicators one after another, a rank's
collectives and point-to-point batches must follow one global order that every rank agrees with: two ranks
that issue two communicators' calls in opposite orders can wait on each other forever. megatron assumes
data-parallel replicas run the same model, so their buckets become ready in the same order and post as they
fill; here the members of a rank set run different slices, and a bucket can be ready early on one rank and
late on another. So the posting is driven by the plan, not by readiness: a bucket's key is the backward
position (:func:`backward_positions`) after which every member has completed its gradients, and every rank
posts its buckets, over all its instances, in order of (key, rank set, bucket index), each one right after
the executor finishes the backward of the wave at the bucket's key position and before that boundary's
point-to-point batch (:meth:`GradSync.reached`). Every rank walks the same waves, so every rank issues its
reductions and batches in one global order. A gradient is complete after the backward of its weight's last
use in execution order: a pass runs phase by phase, each phase's waves backward in reverse
(:mod:`.executor`), so that is the first use within the last phase that uses it. A bucket ready early on one
member loses nothing by waiting: its reduce cannot finish before its slowest member is ready anyway.

A weight held by one rank only is reduced over nobody: its instance keeps megatron's buffers (``main_grad``,
the distributed optimizer's blocks) but posts no collective (a one-rank group would still create an NCCL
communicator and launch a kernel for nothing).

**Shared weights with several local copies** (a rank serving one shard of a weight in two tensor-parallel
layouts holds one copy per layout): only the first copy is in DDP. Each other copy gets a hook that adds its
gradient into the first copy's ``main_grad`` and counts as one more use of that parameter for its bucket
(megatron's ``register_grad_ready``); megatron learns the number of uses per step in the first step, so the
bucket fires only after every copy has contributed, and overlap stays on. After the sync every copy's
``.grad`` is the first copy's ``main_grad``, so the optimizer moves the copies identically.

**What the optimizer sees.** After :meth:`finish`, ``p.main_grad`` is the reduced gradient and ``p.grad`` a
view of it (no copy) where the dtypes agree, for every local parameter (with the distributed optimizer, for
every block of :meth:`optimizer_parameters`: its ``main_grad`` is the block of the reduce-scattered buffer, so
fp32 masters step from the fp32 block, never from a bf16 round trip of it). The buffers are
zeroed by :meth:`zero_grad_buffer` (Megatron's ``train_step`` calls it on the model chunk; the executor also
calls it before the first forward after a sync, so a caller that only runs forward, backward, sync and an
optimizer step gets fresh gradients every step, as with plain ``.grad``).

**Distributed optimizer** (``distributed_optimizer=True``, ZeRO-1 over each rank set): DDP runs in megatron's
distributed-optimizer mode: parameters live in a contiguous buffer, each bucket's gradient is reduce-scattered
so each member of the rank set owns one block, and :meth:`optimizer_parameters` are those blocks (flat views of
the parameter buffer) for a torch optimizer; element-wise optimizers (SGD, Adam, AdamW) then do exactly what
they do on whole parameters, with 1/n of the state per rank. Before the next forward (or
:meth:`gather_params`) the updated blocks are all-gathered. megatron.core's own ``DistributedOptimizer`` is not
used: it is built for one data-parallel group over all model chunks (here: one group per rank set), keeps
fp32 master copies through megatron's optimizer wrappers, and reads CUDA tensor types. It is on when the plan
says so (``plan.distributed_optimizer``); the built-in trainer then refuses checkpoints and task-mix changes
(they keep optimizer state per parameter, not per bucket block), Megatron-LM's loop refuses the plan.

Trace: each bucket's reduce is a ``sync`` span ``reduce <ranks> bucket i`` from its post to its completion
(on the CPU a callback on the work, or the wait in :meth:`finish` when the backend offers no future; on a GPU,
CUDA events, :mod:`.trace`: the point where the stream, in :meth:`finish`, has waited for it), and
``gradient sync wait`` is the time :meth:`finish` takes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.process_groups_config import ProcessGroupCollection
from torch import nn

from .. import comm
from . import ddp
from ..models.layer_state import shard_spec
from ..planner.assembly.communicators import param_group_name
from ..planner.assembly.plan import Plan
from .groups import ProcessGroupRegistry
from .trace import StepTrace


class GradSyncTimeout(comm.PeerError):
    """A gradient reduction did not complete (a peer died or hung): names the rank set."""


@dataclass
class _Instance:
    """One DDP instance: a rank set, its parameters, and its buckets in posting order."""

    ranks: tuple[int, ...]
    ddp: DistributedDataParallel
    labels: dict = field(default_factory=dict)        # bucket group -> "reduce [ranks] bucket i"
    start: dict = field(default_factory=dict)         # bucket group -> original start_grad_sync
    times: dict = field(default_factory=dict)         # label -> [post time, completion time or None]
    hooks: list = field(default_factory=list)         # its hooks on the parameters' gradient accumulators

    @property
    def reduces(self) -> bool:
        """Whether its buckets are reduced at all (a rank set of one rank is not)."""
        return len(self.ranks) > 1


def backward_positions(plan) -> dict[int, int]:
    """``{wave: position of its backward in a pass}``: phase by phase, each phase's waves in reverse."""
    order = [w for waves in plan.phases for w in reversed(waves)]
    return {w: i for i, w in enumerate(order)}


def grad_done_positions(plan, rank: int) -> dict[str, int]:
    """``{param_key: backward position (:func:`backward_positions`) after which `rank` adds nothing more to
    its gradient}``: the latest backward among the waves where ``rank`` runs a slice using it (pure: any rank
    computes it for any other)."""
    metaops = {m.name: m for m in plan.metaops}
    pos = backward_positions(plan)
    out: dict[str, int] = {}
    for w, wave in enumerate(plan.waves):
        for s in wave.slices:
            if rank in s.ranks:
                for key in metaops[s.metaop].param_keys[s.layer_start:s.layer_stop]:
                    if key:
                        out[key] = max(out.get(key, -1), pos[w])
    return out


class GradSync:
    """megatron.core DDP over each rank set of this rank's parameter device groups (built on every rank, in one order).

    Args:
        plan: the plan (its parameter device groups, phases and world size); rank: this rank.
        copies: (param_key, TP shard) -> the local layers holding it, the first one's parameters in DDP (the
            executor's ``layer_copies``, :mod:`.rank_layers`).
        params: every local parameter, once: a trainable one in no parameter device group is refused.
        registry: the plan's process groups (each parameter device group's, the one-rank group); trace: where
            the reduces are recorded (:mod:`.trace`); device: where the gradient norm is summed.
        overlap: post each bucket's reduce as soon as it is complete (else all at :meth:`finish`).
        bucket_size: parameters per bucket (megatron's default, at least 40 M, when None).
        grad_reduce_in_fp32: fp32 gradient buffers and reduction for low-precision parameters.
        param_dtype_grads: with fp32 buffers and low-precision parameters, also a ``.grad`` copy in the
            parameter's dtype each step (None otherwise; ``main_grad`` is the gradient).
        distributed_optimizer: ZeRO-1 over each rank set (see the module docstring).
    """

    def __init__(self, plan: Plan, *, rank: int, copies: Mapping[tuple[str, int], Sequence[nn.Module]],
                 params: Iterable[nn.Parameter], registry: ProcessGroupRegistry, trace: StepTrace,
                 device: torch.device, overlap: bool = True, bucket_size: int | None = None,
                 grad_reduce_in_fp32: bool = False, distributed_optimizer: bool = False,
                 param_dtype_grads: bool = False) -> None:
        self.rank, self.trace, self.device, self.overlap = rank, trace, device, overlap
        self.distributed_optimizer, self.param_dtype_grads = distributed_optimizer, param_dtype_grads
        done_of = {r: grad_done_positions(plan, r) for r in range(plan.world_size)}
        by_ranks: dict[tuple[int, ...], list] = {}
        for g in plan.param_groups:
            if self.rank not in g.ranks:
                continue
            mods = copies.get((g.param_key, g.tp_rank), [])
            if not mods:
                raise RuntimeError(f"rank {self.rank} is in the group of {g.param_key} shard {g.tp_rank} "
                                   f"but holds no copy of it")
            # the gradient is complete once the last member has run the backward of its last use
            done = max(done_of[r].get(g.param_key, -1) for r in g.ranks)
            for name, p in sorted(mods[0].core.named_parameters()):
                if p.requires_grad:  # listed latest-completed first: megatron fills buckets from the end
                    by_ranks.setdefault(tuple(g.ranks), []).append((-done, g.param_key, g.tp_rank, name, p))
        self._skip: dict[int, bool] = {}      # id(param) -> left out of the norm (a replica of shard 0's)
        self._owner: dict[int, bool] = {}     # id(param) -> this rank counts it in the norm (not sharded)
        self.instances: list[_Instance] = []
        one = registry.one
        config = ddp.sum_config()
        self._positions = backward_positions(plan)
        keyed = []  # (complete at, ranks, bucket index, instance, bucket group): the global posting order
        for ranks in sorted(by_ranks, key=lambda k: (len(k), k)):
            rows = sorted(by_ranks[ranks], key=lambda r: r[:4])
            group = one if len(ranks) == 1 else registry.get(param_group_name(rows[0][1], rows[0][2]))
            pgc = ProcessGroupCollection(dp=group, dp_cp=group, intra_dp_cp=group, expt_dp=group,
                                         intra_expt_dp=group, tp=one, pp=one, cp=one, ep=one)
            members = [r[4] for r in rows]
            dp = DistributedDataParallel(config, ddp.ddp_config_for(overlap=overlap, bucket_size=bucket_size,
                                                                   grad_reduce_in_fp32=grad_reduce_in_fp32,
                                                                   distributed_optimizer=distributed_optimizer),
                                         ddp.Params(members), pg_collection=pgc)
            done_at = {id(r[4]): -r[0] for r in rows}
            inst = _Instance(ranks=ranks, ddp=dp, hooks=ddp.backward_hooks(dp))
            for i, bg in enumerate(dp.bucket_groups):
                keyed.append((max(done_at[id(p)] for p in bg.params), (len(ranks), ranks), i, inst, bg))
                inst.labels[bg] = f"reduce {list(ranks)} bucket {i}"
                inst.start[bg] = bg.start_grad_sync
                bg.start_grad_sync = ddp.driven_by_the_plan
            self.instances.append(inst)
            for r in rows:
                # the norm counts a replicated parameter of a tensor-parallel layer on shard 0 only
                self._skip[id(r[4])] = shard_spec(r[4]) is None and r[2] != 0
                self._owner[id(r[4])] = ranks[0] == self.rank
                if r[4].main_grad.device != r[4].device:
                    raise RuntimeError(f"rank {self.rank}: megatron put the gradient buffer of {r[1]} on "
                                       f"{r[4].main_grad.device}, the parameter is on {r[4].device}")
        keyed.sort(key=lambda k: k[:3])
        self._order = [(done, inst, bg) for done, _, _, inst, bg in keyed]
        """Every bucket of this rank, in the global posting order (complete at, rank set, bucket index)."""
        self._posted = 0  # self._order[:self._posted] are posted this step
        self._main_params = [p for inst in self.instances for p in inst.ddp.module.params]
        self._copy_hooks = []
        self._copy_of: list[tuple[nn.Parameter, nn.Parameter]] = []   # (extra copy, parameter in DDP)
        ddp_of = {id(p): inst.ddp for inst in self.instances for p in inst.ddp.module.params}
        for (key, shard), mods in sorted(copies.items()):
            if len(mods) < 2 or id(next(iter(mods[0].core.parameters()))) not in ddp_of:
                continue
            main = dict(mods[0].core.named_parameters())
            for mod in mods[1:]:
                for name, c in mod.core.named_parameters():
                    m = main[name]
                    if distributed_optimizer:  # the optimizer steps the shards of m only: c is a view of m
                        c.data = m.data
                    self._copy_of.append((c, m))
                    self._copy_hooks.append(c.register_post_accumulate_grad_hook(
                        self._copy_hook(m, ddp_of[id(m)])))
        self._shards: list[tuple[nn.Parameter, torch.Tensor, list, int, int]] = []
        if distributed_optimizer:
            for inst in self.instances:
                size, rank = inst.ddp.intra_dp_cp_group.size(), inst.ddp.intra_dp_cp_group.rank()
                for buf in inst.ddp.buffers:
                    for bucket in buf.buckets:
                        n = bucket.grad_data.numel() // size
                        lo, hi = rank * n, (rank + 1) * n  # megatron's shard_buffer: this rank's block
                        # where each parameter lies in the bucket (megatron pads parameter starts here)
                        where = [(p, buf.param_index_map[p][0] - bucket.offset, buf.param_index_map[p][1]
                                  - bucket.offset) for p in bucket.params_list]
                        self._shards.append((nn.Parameter(bucket.param_data[lo:hi]), bucket.grad_data[lo:hi],
                                             where, lo, hi))
        covered = {id(p) for p in self._main_params} | {id(c) for c, _ in self._copy_of}
        missing = [p for p in params if p.requires_grad and id(p) not in covered]
        if missing:
            raise RuntimeError(f"rank {self.rank}: {len(missing)} parameters belong to no parameter device group")
        olds = {}
        for p in self._main_params + [c for c, _ in self._copy_of]:  # a replanned model takes them over
            old = getattr(p, "_spindle_grad_sync", None)
            if old is not None and old is not self:
                olds[id(old)] = old
            p._spindle_grad_sync = self
        for old in olds.values():
            old.release()
        self._no_sync = 0
        self._grad_copies: list[torch.Tensor] = []
        self.synced = False
        """True from :meth:`finish` until :meth:`zero_grad_buffer`: the gradients are the reduced ones."""

    # -- hooks ------------------------------------------------------------------------------------------
    def reached(self, wave: int) -> None:
        """The executor finished this rank's backward of ``wave``: post, in the global order, every bucket
        whose gradients are complete on all its members by then (nothing inside :meth:`no_sync`, or without
        overlap: :meth:`finish` posts those)."""
        if self._no_sync or not self.overlap:
            return
        pos = self._positions[wave]
        while self._posted < len(self._order) and self._order[self._posted][0] <= pos:
            _, inst, bg = self._order[self._posted]
            self._posted += 1
            self._post(inst, bg)

    def _post(self, inst: _Instance, bg) -> None:
        if not inst.reduces:
            return
        label, trace = inst.labels[bg], self.trace
        times = inst.times[label] = [trace.now(), None]
        inst.start[bg]()
        handle = bg.grad_reduce_handle
        works = getattr(handle, "works", []) if handle is not None else []
        if handle is None:  # posted synchronously (overlap off): already complete
            times[1] = trace.now()
            return
        if not trace.clock.host:  # a GPU: NCCL completes a work's future when it is enqueued; the stream's
            return                # view of its completion is marked where finish() waits for it
        for work in works:
            try:
                fut = work.get_future()
            except RuntimeError:  # a backend without futures: completion is taken at the wait
                continue
            fut.add_done_callback(lambda _f, t=times, now=trace.now: t.__setitem__(1, now()))

    @staticmethod
    def _copy_hook(main: nn.Parameter, dp: DistributedDataParallel):
        """Add an extra copy's gradient into the DDP parameter's buffer; count it as one use of it."""

        def hook(c: nn.Parameter) -> None:
            if c.grad is None:
                return
            main.main_grad.add_(c.grad)
            c.grad = None
            bg = dp.param_to_bucket_group.get(main)
            if bg is not None and dp.ddp_config.overlap_grad_reduce:
                bg.register_grad_ready(main, dp.force_all_reduce)

        return hook

    # -- the step ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without posting any reduce (Megatron's ``no_sync``: every pass but the last)."""
        with contextlib.ExitStack() as stack:
            for inst in self.instances:
                stack.enter_context(inst.ddp.no_sync())
            self._no_sync += 1
            try:
                yield
            finally:
                self._no_sync -= 1

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and forget the last step's posts (start of a step)."""
        for inst in self.instances:
            inst.ddp.zero_grad_buffer()  # also marks every bucket "last microbatch" again
            if self._no_sync:  # zeroed inside no_sync (the first forward of a step): keep buckets quiet
                for bg in inst.ddp.bucket_groups:
                    bg.is_last_microbatch = False
            inst.times.clear()
        self._posted = 0
        for p in self._main_params:
            p.grad = None
        for c, _ in self._copy_of:
            c.grad = None
        self.synced = False

    def finish(self) -> None:
        """Post what is still unposted (in order), wait for every reduce, expose ``p.grad = p.main_grad``."""
        trace = self.trace
        t0 = trace.now()
        for _, inst, bg in self._order[self._posted:]:  # what is still unposted, in the global order
            self._post(inst, bg)
        self._posted = len(self._order)
        for _, inst, bg in self._order:  # waited in the order posted (under NCCL the host does not block)
            if not inst.reduces:
                continue
            try:
                bg.finish_grad_sync()  # megatron's: waits for the handle (start_grad_sync is the plan's no-op)
            except RuntimeError as e:
                raise GradSyncTimeout(f"rank {self.rank}: gradient reduce over ranks {list(inst.ranks)} failed: "
                                      f"{comm.first_line(e)}") from e
            times = inst.times.get(inst.labels[bg])
            if times is not None and times[1] is None and not trace.clock.host:
                times[1] = trace.now()  # the stream has waited for it here
        t1 = trace.now()
        for inst in self.instances:
            for label, (start, end) in inst.times.items():
                ended = end is not None and (not trace.clock.host or end <= t1)
                trace.span("sync", label, start, end if ended else t1)
        trace.span("sync", "gradient sync wait", t0, t1)
        self._grad_copies = []  # .grad tensors that are copies in another dtype, not buffer views
        if self.distributed_optimizer:  # only this rank's block of each bucket is reduced
            for sp, grad, *_ in self._shards:
                sp.main_grad, sp.grad = grad, self._expose(grad, sp.dtype)
        else:
            for p in self._main_params:
                p.grad = self._expose(p.main_grad, p.dtype)
            for c, m in self._copy_of:
                c.main_grad, c.grad = m.main_grad, m.grad
        self.synced = True

    def _expose(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        if grad.dtype == dtype:
            return grad
        if not self.param_dtype_grads:
            return None
        copy = grad.to(dtype)
        self._grad_copies.append(copy)
        return copy

    def next_step(self) -> None:
        """Start the next step: gather the updated parameters (distributed optimizer), zero the buffers."""
        self.gather_params()
        self.zero_grad_buffer()

    def gather_params(self) -> None:
        """Distributed optimizer: all-gather every bucket's parameter blocks after the optimizer stepped
        this rank's (megatron DDP's ``start_param_sync``); nothing to do otherwise."""
        if not self.distributed_optimizer:
            return
        t0 = self.trace.now()
        for inst in self.instances:
            if inst.reduces:  # one rank: its blocks are the whole buckets, already in place
                inst.ddp.start_param_sync(force_sync=True)
        self.trace.span("sync", "parameter all-gather", t0)

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """Distributed optimizer: this rank's block of every bucket (views of megatron's parameter buffer,
        flat; their ``.grad`` is the reduce-scattered gradient block after :meth:`finish`)."""
        return [sp for sp, *_ in self._shards]

    def grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (float64): the parameter groups it counts
        (the first rank of each rank set; with the distributed optimizer, its block of every bucket), a
        replicated parameter of a tensor-parallel layer on shard 0 only. Summed over all ranks: the norm²."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if not self.distributed_optimizer:
            for p in self._main_params:
                if self._owner[id(p)] and not self._skip[id(p)]:
                    sq += p.main_grad.double().pow(2).sum()
            return sq
        for _, grad, where, lo, hi in self._shards:
            for p, a, b in where:
                a, b = max(a, lo), min(b, hi)
                if a < b and not self._skip[id(p)]:
                    sq += grad[a - lo:b - lo].double().pow(2).sum()
        return sq

    def bucket_times(self) -> dict[str, tuple[float, float | None]]:
        """``{bucket label: (post, completion)}`` of the last step (marks of the trace's clock, :mod:`.trace`)."""
        return {label: tuple(t) for inst in self.instances for label, t in inst.times.items()}

    def scale(self, factor: float) -> None:
        """Multiply every reduced gradient by ``factor`` (each buffer once: copies share it)."""
        for inst in self.instances:
            inst.ddp.scale_gradients(factor)
        for g in self._grad_copies:
            g.mul_(factor)

    def release(self) -> None:
        """Stop acting on these parameters (a replanned model takes them over): megatron's hooks are removed
        from the parameters' gradient accumulators (:mod:`.ddp_hooks`) and the copy hooks too, so nothing
        keeps this object's DDP instances and buffers alive; parameters no new model took over (parked) drop
        their views of the buffers."""
        for inst in self.instances:
            inst.ddp.param_to_bucket_group.clear()
            ddp.remove(inst.hooks)
            inst.ddp.grad_accs.clear()
        for h in self._copy_hooks:
            h.remove()
        self._copy_hooks.clear()
        for p in self._main_params + [c for c, _ in self._copy_of]:
            if getattr(p, "_spindle_grad_sync", None) is self:
                del p._spindle_grad_sync
                p.grad = None
                if hasattr(p, "main_grad"):
                    del p.main_grad
