"""The wave executor: this rank's slices of a plan, run phase by phase, each phase's waves forward in order and
backward in reverse.

A pass runs the plan's **phases** (``plan.phases``, consecutive waves; no transfer crosses one) one after the
other: the forward of the phase's waves, then their backward, then the next phase, so a phase's stashed
activations are freed before the next phase's exist. :meth:`SpindleModel.forward` takes the pass's batch and
runs the first phase's forward (every phase's forward when no gradient is recorded: evaluation);
:meth:`SpindleModel.backward` runs that phase's backward, then each later phase's forward and backward
(Megatron's forward-step / backward contract, one batch per pass; a plan with one phase runs as before).
Every slice's layers recompute their activations as its MetaOp says (``MetaOp.recompute``,
:mod:`..models.recompute`). Within a phase:

1. **forward**, for each wave ``w`` in order, each slice of ``w`` in the plan's order: if this rank runs it,
   wait for exactly its own inputs' receives and run it; then post this rank's messages of that point (a
   slice's received inputs are leaves that require grad, so each slice has its own autograd graph);
2. **backward**, for each wave in reverse, its slices in reverse: backpropagate this rank's part (a loss slice
   with gradient 1, any other slice with the accumulated gradient of its output, waiting for exactly the
   receives that feed it), then post this rank's messages of that point;

Where the messages are posted is the plan's ``transfer_posting`` (:func:`..planner.assembly.dataflow.rank_posts`):
``producer`` (the default), a slice's outputs right after it has run and its input gradients right after its
backward, in one batch per slice, so they travel while the rank and its peers compute later slices, and a
consumer starts as soon as its own inputs have arrived; ``boundary``, the paper's wave runtime, every message
into wave ``w`` in one batch before ``w`` (forward) and after ``w``'s backward. Local copies need no
communication. Transfers are asynchronous (:class:`.p2p.Transfers`, built with the rank, dtype, device, timeout
and trace): every point-to-point call goes through :func:`post_p2p`, in ONE batch per rank and point: NCCL runs a rank's
point-to-point calls in order on one stream, matches each pair's sends and receives in posting order (tags are
ignored) and returns one work for the whole batch; a send posted in a batch of its own could wait for the
peer's own send batch (both blocked until received). So every rank walks the same sequence of points (every
slice of every wave, in plan order, whether it runs the slice or not) and posts each point's batch there: all
ranks' batches follow one global order, and the earliest unfinished one can always finish; a work per message
(gloo) or per batch (NCCL). Tags number a whole pass's messages (gloo matches by tag; no two outstanding messages
of a pair share one). Sends are waited at the end of the phase's forward (or backward), their tensors kept. The
trace records, per message, a ``transfer`` span from post to wait-complete (``w3 fwd send a -> b to rank 1``,
named by the consumer's wave), its post on the sender and the wait for it on the receiver under one name on
both (``w3 fwd #12 0->1 posted`` / ``awaited``, :func:`.p2p.message_key`), and per wave the host's posting
and blocked waiting (``w3 fwd transfer``);
3. **gradient sync** (:mod:`.grad_sync`): every parameter shard is all-reduced (summed) over its parameter
   device group (``plan.param_groups``) by megatron.core's DDP, one instance per distinct rank set, each
   bucket posted as soon as the backward of the last wave that uses it (in execution order: phase by phase)
   is done (every member posts it at the same point: after the backward of the wave where the last member
   completes it, before that boundary's messages, so all ranks issue their collectives and batches in one
   global order); :meth:`finalize_grads` waits. Losses are already normalised by the global batch, so summing is
   exact data parallelism;
4. the optimizer steps every local parameter; replicas get identical gradients, so they stay identical.

Every rank builds only the layers of its slices (:func:`.rank_layers.build_rank_layers`: the core of a
``param_key`` once per tensor-parallel layout, a replaced model's parameters taken over), then its gradient sync
(:class:`.grad_sync.GradSync`), given the plan, the rank, those layers' copies and parameters, the process
groups, the trace and the device.
Waits are bounded by ``timeout_s``; a peer that dies or hangs raises :class:`SpindleTimeout` naming the wave,
the slice and the peer.
"""
from __future__ import annotations

import contextlib
import datetime
import math
from types import MappingProxyType
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import comm
from ..models.blocks import DEFAULT_SETTINGS, LayerSettings
from ..models.pretrained import load_pretrained
from ..models.shapes import output_shape
from ..planner.assembly.dataflow import needs_output_grad, rank_posts, slice_layout
from ..planner.workload.graph import DATA_PREFIX, TaskGraph
from ..planner.assembly.plan import Message, Plan, Slice, Transfer
from ..planner.assembly.communicators import plan_rank_sets
from ..planner.assembly.validate import check_plan
from .grad_sync import GradSync
from .p2p import Transfers
from .groups import ProcessGroupRegistry
from .rank_layers import build_rank_layers, module_key
from .stash import StashMeter
from .trace import StepTrace, clock_for


@dataclass
class StepState:
    """What one pass's forward leaves for its backward and for reporting; ``losses`` holds every task's loss
    once the pass has run every phase (after :meth:`SpindleModel.backward`, or a forward without gradients)."""

    batch: Mapping | None = None        # (task, stream, first, stop) -> this rank's inputs, until the last phase
    phase: int = 0                                                 # the phase whose backward is next
    outputs: dict[str, Tensor] = field(default_factory=dict)       # slice name -> local output
    inputs: dict[tuple[str, int], Tensor] = field(default_factory=dict)  # (slice, input index) -> leaf
    grads: dict[str, Tensor] = field(default_factory=dict)         # slice name -> grad of its output
    losses: dict[str, Tensor] = field(default_factory=dict)        # task -> local loss (counted once per TP)
    pieces: dict = field(default_factory=dict)                     # (slice, input) -> received [(start, part)]


class SpindleModel(nn.Module):
    """This rank's part of a multi-task model under a Spindle plan.

    Args:
        plan: the plan (its graph fingerprint and world size are checked against ``graph`` and the job).
        graph: the task graph the plan was made for.
        seed: model seed (same value on every rank, same as the reference model's).
        timeout_s: bound on every wait for a peer.
        dtype, device: parameter dtype and device (default: :func:`megatron_spindle.comm.comm_device`, where
            receive buffers are allocated; another device is refused).
    """

    def __init__(self, plan: Plan, graph: TaskGraph, *, seed: int = 0, timeout_s: float = 300.0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 backend: str = "local", layer_graph: TaskGraph | None = None,
                 reuse: Mapping[tuple[str, tuple[int, ...]], object] | None = None,
                 overlap_grad_reduce: bool = True, bucket_size: int | None = None,
                 grad_reduce_in_fp32: bool = False, param_dtype_grads: bool = False,
                 distributed_optimizer: bool | None = None,
                 init: Mapping[str, str] | None = None, registry: ProcessGroupRegistry | None = None,
                 settings: LayerSettings = DEFAULT_SETTINGS) -> None:
        """``layer_graph``: the full model graph when ``graph`` is a subset of its tasks (tables are sized
        and tasks weighted by the full model, so parameters keep their shapes when tasks come and go).
        ``reuse``: existing layers keyed by ``(param_key, tensor-parallel ranks)`` whose parameters this
        model takes over instead of building new ones (see :mod:`.replan`). ``overlap_grad_reduce``,
        ``bucket_size``, ``grad_reduce_in_fp32``: megatron.core DDP's, and ``param_dtype_grads``, see
        :mod:`.grad_sync`. The distributed
        optimizer (ZeRO-1) is the plan's ``distributed_optimizer``; a ``distributed_optimizer`` given here
        must say the same. ``init``: module name -> Hugging Face directory whose weights the layers built
        here (not reused) load, each rank reading only its shards (:mod:`..models.pretrained`). ``registry``:
        the process groups of a model this one replaces (:mod:`.replan`), updated to this plan's rank sets:
        the groups both plans use are kept, not created again. ``settings``: Megatron's init std and dropout
        (:class:`..models.blocks.LayerSettings`)."""
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("SpindleModel needs torch.distributed initialised (torchrun or init_process_group)")
        self.rank, world = dist.get_rank(), dist.get_world_size()
        check_plan(plan, graph_fingerprint=graph.fingerprint(), world_size=world)
        if distributed_optimizer is not None and bool(distributed_optimizer) != plan.distributed_optimizer:
            raise ValueError(f"distributed_optimizer={distributed_optimizer} contradicts the plan's "
                             f"distributed_optimizer={plan.distributed_optimizer}: the plan decides (its memory "
                             f"estimate assumes it); re-plan to change it")
        self.plan, self.graph = plan, graph
        self.options = dict(backend=backend, overlap_grad_reduce=overlap_grad_reduce, bucket_size=bucket_size,
                            grad_reduce_in_fp32=grad_reduce_in_fp32, param_dtype_grads=param_dtype_grads,
                            settings=settings)
        """How the layers and the gradient sync were built (a replanned model is built the same way)."""
        self.phases = plan.phases
        """Wave indices of each phase, in execution order (``plan.phases``)."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        here = comm.comm_device()  # where receive buffers and collectives live: the layers go there too
        self.device = torch.device(device) if device is not None else here
        if self.device.type != here.type or (self.device.index is not None and self.device != here):
            raise ValueError(f"device {self.device}, but this rank communicates on {here} (receive buffers and "
                             f"collectives live there): build the model on {here}, or leave device unset")
        self.dtype = dtype
        self.metaops = {m.name: m for m in plan.metaops}
        self._grad = {n: needs_output_grad(m) for n, m in self.metaops.items()}  # False: forward only (frozen)
        self.registry = registry.update(plan_rank_sets(plan)) if registry is not None else \
            ProcessGroupRegistry(plan_rank_sets(plan), timeout=self.timeout)
        self.slice_of = {s.name: s for s in plan.slices()}
        # this rank's (wire tag, transfer, message) by posting point (a slice's name, or a wave under boundary
        # posting), forward and backward, as stored
        self.posts = (rank_posts(plan, self.rank, backward=False), rank_posts(plan, self.rank, backward=True))
        self.my_slices: list[list[Slice]] = [[s for s in w.slices if self.rank in s.ranks] for w in plan.waves]
        built = build_rank_layers(plan, graph, self.rank, self.registry, seed=seed, dtype=dtype, device=self.device,
                                  layer_graph=layer_graph, reuse=reuse, backend=backend, settings=settings)
        self.layers = built.layers
        """:func:`.rank_layers.module_key` (MetaOp, layer) -> the layer (:mod:`.rank_layers`: the state dict's keys)."""
        self._copies = built.copies  # (param_key, shard) -> local layers holding it
        self._ranges: dict[str, tuple[int, int]] = {}
        self._data_blocks = sorted({(*name.split(":", 2)[1:], *self.local_range(s))
                                    for wave in self.my_slices for s in wave
                                    for op in self.metaops[s.metaop].operators[s.layer_start:s.layer_stop]
                                    for name in graph[op].inputs if name.startswith(DATA_PREFIX)})
        """(task, stream, first sample, stop) of every data input this rank's slices read."""
        self.init = dict(init or {})
        self.kept_init = load_pretrained(built.fresh, layer_graph or graph, self.init) if self.init else []
        """Parameters under ``init`` that the checkpoint has no tensor for (they keep their seeded values)."""
        self.cores_by_group = built.cores
        """(param_key, tensor-parallel ranks) -> the layer holding those parameters on this rank."""
        self.trace = StepTrace(self.rank, clock=clock_for(self.device))  # CUDA events on a GPU
        self.transfers = Transfers(rank=self.rank, dtype=dtype, device=self.device, timeout=self.timeout,
                                   trace=self.trace, shape_of=self.message_shape)
        self.stash: StashMeter | None = None
        """While measuring (:meth:`measure_stash`): the bytes each slice saves for backward."""
        self.grad_sync = GradSync(plan, rank=self.rank, copies=self.layer_copies, params=self.unique_parameters(),
                                  registry=self.registry, trace=self.trace, device=self.device,
                                  overlap=overlap_grad_reduce, bucket_size=bucket_size,
                                  grad_reduce_in_fp32=grad_reduce_in_fp32, param_dtype_grads=param_dtype_grads,
                                  distributed_optimizer=plan.distributed_optimizer)
        # the first forward after a sync starts a new step: gathered parameters, fresh gradient buffers
        self.register_forward_pre_hook(lambda mod, _: mod.grad_sync.next_step() if mod.grad_sync.synced else None)

    # -- parameters -----------------------------------------------------------------------------------
    def unique_parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The local parameters that train (frozen weights have ``requires_grad=False``)."""
        return [p for p in self.unique_parameters() if p.requires_grad]

    def message_shape(self, e: Transfer, msg: Message) -> tuple[int, ...]:
        """The tensor one message of edge ``e`` carries: its samples by the producer's last layer's output, or
        by the one token of it the edge moves (``e.token``)."""
        shape = self._output_shape(e.src)
        return (msg.stop - msg.start, *(shape if e.token is None else (1, *shape[1:])))

    def _output_shape(self, slice_name: str) -> tuple[int, ...]:
        """Per-sample shape of a slice's output (its last layer's)."""
        src = self.slice_of[slice_name]
        return output_shape(self.graph[self.metaops[src.metaop].operators[src.layer_stop - 1]])

    @property
    def layer_copies(self) -> Mapping[tuple[str, int], list[nn.Module]]:
        """(param_key, TP shard) -> the local layers holding that weight (read-only view)."""
        return MappingProxyType(self._copies)

    def held_param_keys(self) -> set[tuple[str, int]]:
        """(param_key, TP shard) this rank holds."""
        return set(self._copies)

    def local_cores(self) -> Iterable[tuple[str, int, nn.Module]]:
        """(param_key, shard, layer) for every distinct parameter holder on this rank."""
        for (key, shard), mods in sorted(self._copies.items()):
            for mod in mods:
                yield key, shard, mod

    def measure_stash(self, on: bool = True) -> StashMeter | None:
        """Measure, from the next pass on, the activation bytes each slice keeps for backward (:mod:`.stash`);
        ``on=False`` stops. Returns the meter."""
        self.stash = StashMeter(self.unique_parameters()) if on else None
        return self.stash

    def local_range(self, s: Slice) -> tuple[int, int]:
        """This rank's samples of a slice (computed once per slice, not per message and step)."""
        got = self._ranges.get(s.name)
        if got is None:
            got = self._ranges[s.name] = slice_layout(self.metaops[s.metaop], s.ranks).rank_samples(self.rank)
        return got

    # -- a pass, phase by phase -------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Mapping[str, Tensor]]) -> StepState:
        """Start a pass on ``batch``: the first phase's forward, or every phase's forward when no gradient is
        recorded (evaluation; each phase's activations dropped after it). Returns what :meth:`backward` needs."""
        # each input block this rank's slices read, copied to the device once per pass, the host not waiting
        st = StepState(batch={k: comm.host_to_device(batch[k[0]][k[1]][k[2]:k[3]], self.device)
                              for k in self._data_blocks})
        if torch.is_grad_enabled():
            self._forward_phase(st, 0)
            return st
        for i, waves in enumerate(self.phases):
            self._forward_phase(st, i)
            self._drop(st, waves)
        st.phase, st.batch = len(self.phases), None
        return st

    def _send_fwd(self, st: StepState, e: Transfer, msg: Message) -> Tensor:
        a, _ = self.local_range(self.slice_of[e.src])
        out = st.outputs[e.src][msg.start - a:msg.stop - a].detach()
        return out if e.token is None else out.narrow(1, e.token % out.shape[1], 1).contiguous()  # what it reads

    def _recv_fwd(self, st: StepState, e: Transfer, msg: Message, t: Tensor) -> None:
        st.pieces.setdefault((e.dst, e.input_index), []).append((msg.start, t))

    def _forward_phase(self, st: StepState, phase: int) -> None:
        """Run this rank's slices of phase ``phase``'s waves forward, posting the phase's messages."""
        waves = self.phases[phase]
        send_of = lambda e, msg: self._send_fwd(st, e, msg)  # noqa: E731
        recv_into = lambda e, msg, t: self._recv_fwd(st, e, msg, t)  # noqa: E731
        self.transfers.begin()
        posts = self.posts[0]
        for w in waves:
            self.transfers.post(w, False, posts.get(w, ()), send_of, recv_into)  # boundary posting: the wave's batch
            for s in self.plan.waves[w].slices:  # every rank walks the same points in one order
                if self.rank in s.ranks:
                    self.transfers.inputs_of(s.name, recv_into)  # exactly this slice's inputs
                    t1 = self.trace.now()
                    with torch.set_grad_enabled(torch.is_grad_enabled() and self._grad[s.metaop]), \
                            (self.stash.slice(s.name) if self.stash is not None else contextlib.nullcontext()):
                        self._run_slice(s, st.batch, st.pieces, st)
                    self.trace.span("forward", f"{s.name} fwd", t1)
                self.transfers.post(w, False, posts.get(s.name, ()), send_of, recv_into)  # producer posting
        self.transfers.pass_end(False, waves)
        if self.stash is not None:
            self.stash.phase_done(phase)

    def _run_slice(self, s: Slice, batch, pieces, st: StepState) -> None:
        m = self.metaops[s.metaop]
        a, b = self.local_range(s)
        x: Tensor | None = None
        for layer in range(s.layer_start, s.layer_stop):
            op = self.graph[m.operators[layer]]
            inputs = []
            first_act = True
            for i, name in enumerate(op.inputs):
                if name.startswith(DATA_PREFIX):
                    _, task, stream = name.split(":", 2)
                    inputs.append(batch[(task, stream, a, b)])
                    continue
                if layer > s.layer_start:
                    inputs.append(x)
                    continue
                idx = 0 if s.layer_start > 0 else i  # a continuation arrives as input 0
                if s.layer_start > 0 and not first_act:
                    raise ValueError(f"{s.name}: a mid-MetaOp layer with several operator inputs")
                first_act = False
                got = sorted(pieces.pop((s.name, idx), []), key=lambda p: p[0])
                if not got or got[0][0] != a or sum(t.shape[0] for _, t in got) != b - a:
                    raise RuntimeError(f"rank {self.rank}: {s.name} input {idx} assembled samples "
                                       f"{[(p, p + t.shape[0]) for p, t in got]}, wanted [{a}, {b})")
                leaf = torch.cat([t for _, t in got], 0) if len(got) > 1 else got[0][1]
                leaf = leaf.detach().requires_grad_(self._grad[m.name if s.layer_start else m.inputs[idx]])
                st.inputs[(s.name, idx)] = leaf
                inputs.append(leaf)
            x = self.layers[module_key(m.name, layer)](inputs)
        st.outputs[s.name] = x
        if x.dim() == 0:  # a loss: count it once per tensor-parallel group
            if s.ranks.index(self.rank) % m.tp == 0:
                st.losses[m.task] = st.losses.get(m.task, 0.0) + x.detach()

    def backward(self, st: StepState, *, loss_scale: float = 1.0) -> None:
        """Backpropagate the pass: the started phase's waves in reverse, then each later phase forward and
        backward; parameter gradients accumulate in ``.grad`` (megatron DDP's ``main_grad``).

        ``loss_scale`` multiplies every loss (``1/num_microbatches`` when passes are accumulated, so the
        gradient is that of the mean over the accumulated passes, as in Megatron).
        """
        phases = self.phases
        if st.phase >= len(phases):
            raise RuntimeError(f"rank {self.rank}: backward of a pass that has run every phase already (a second "
                               f"backward, or a forward without gradients)")
        for i in range(st.phase, len(phases)):
            if i > st.phase:
                self._forward_phase(st, i)
            self._backward_phase(st, phases[i], loss_scale)
            self._drop(st, phases[i])
        st.phase, st.batch = len(phases), None
        st.grads.clear()

    def _send_bwd(self, st: StepState, e: Transfer, msg: Message) -> Tensor:
        a, _ = self.local_range(self.slice_of[e.dst])
        return st.inputs[(e.dst, e.input_index)].grad[msg.start - a:msg.stop - a]

    def _recv_bwd(self, st: StepState, e: Transfer, msg: Message, t: Tensor) -> None:
        a, b = self.local_range(self.slice_of[e.src])
        if e.src not in st.grads:
            st.grads[e.src] = torch.zeros((b - a, *self._output_shape(e.src)), dtype=t.dtype, device=t.device)
        got = st.grads[e.src][msg.start - a:msg.stop - a]
        (got if e.token is None else got.narrow(1, e.token % got.shape[1], 1)).add_(t)  # other tokens': zero

    def _backward_phase(self, st: StepState, waves: Sequence[int], loss_scale: float) -> None:
        """Backpropagate this rank's slices of ``waves`` (one phase) in reverse, posting input gradients."""
        send_of = lambda e, msg: self._send_bwd(st, e, msg)  # noqa: E731
        recv_into = lambda e, msg, t: self._recv_bwd(st, e, msg, t)  # noqa: E731
        self.transfers.begin()
        posts = self.posts[1]
        for w in reversed(waves):
            for s in reversed(self.plan.waves[w].slices):
                if self.rank in s.ranks and self._grad[s.metaop]:  # frozen, nothing trainable before: no backward
                    self._backward_slice(st, s, loss_scale, recv_into)
                self.transfers.post(w, True, posts.get(s.name, ()), send_of, recv_into)  # producer posting: input grads
            self.grad_sync.reached(w)  # reduces complete at this wave, before the boundary's batch
            self.transfers.post(w, True, posts.get(w, ()), send_of, recv_into)  # boundary posting: the wave's batch
        self.transfers.pass_end(True, waves)

    def _backward_slice(self, st: StepState, s: Slice, loss_scale: float, recv_into) -> None:
        """Backpropagate this rank's part of slice ``s``, once the gradients it needs have arrived."""
        self.transfers.inputs_of(s.name, recv_into)  # exactly the gradients it needs
        t1 = self.trace.now()
        out = st.outputs[s.name]
        if out.dim() == 0:
            grad = torch.full_like(out, loss_scale)
        else:
            grad = st.grads.pop(s.name, None)
            if grad is None:
                raise RuntimeError(f"rank {self.rank}: no gradient reached the output of {s.name}")
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        for (name, idx), leaf in st.inputs.items():
            if name == s.name and leaf.grad is None and leaf.requires_grad:
                leaf.grad = torch.zeros_like(leaf)
        self.trace.span("backward", f"{s.name} bwd", t1)

    def _drop(self, st: StepState, waves: Sequence[int]) -> None:
        """Forget the outputs and input leaves of this rank's slices of a finished phase (its stash goes)."""
        for w in waves:
            for s in self.my_slices[w]:
                st.outputs.pop(s.name, None)
                for key in [k for k in st.inputs if k[0] == s.name]:
                    del st.inputs[key]

    # -- gradient sync, norm, losses ----------------------------------------------------------------------
    def finalize_grads(self) -> None:
        """Wait for every parameter device group's reduce (posted bucket by bucket during backward by
        megatron.core DDP, :mod:`.grad_sync`); afterwards ``p.main_grad`` is the summed gradient (``p.grad`` a
        view of it where the dtypes agree)."""
        self.grad_sync.finish()

    def zero_grad_buffer(self) -> None:
        """Fresh gradient buffers (Megatron's ``train_step`` calls it; the next forward after a sync does too)."""
        self.grad_sync.zero_grad_buffer()

    def no_sync(self):
        """Backward passes inside accumulate without reducing (every accumulated pass but the last)."""
        return self.grad_sync.no_sync()

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: every local trainable parameter, or with ``distributed_optimizer`` this
        rank's shards of the gradient buckets (:mod:`.grad_sync`)."""
        return self.grad_sync.optimizer_parameters() if self.grad_sync.distributed_optimizer \
            else self.trainable_parameters()

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient: each parameter shard counted once across all ranks."""
        sq, work = comm.all_reduce_async(self.grad_sync.grad_sq())
        self.transfers.wait([work], ["gradient-norm all-reduce over all ranks"])
        return math.sqrt(float(sq))

    def clip_grads(self, max_norm: float) -> float:
        norm = self.grad_norm()
        if max_norm > 0 and norm > max_norm:
            self.grad_sync.scale(max_norm / (norm + 1e-6))  # each buffer once: local copies share one
        return norm

    def reduce_losses(self, st: StepState) -> dict[str, float]:
        """Each task's loss summed over its data-parallel replicas (same on every rank)."""
        none = torch.zeros((), dtype=torch.float64, device=self.device)
        vec = torch.stack([st.losses[t].double() if t in st.losses else none for t in self.plan.tasks])
        vec, work = comm.all_reduce_async(vec)  # one collective, and one read of its result
        self.transfers.wait([work], ["loss all-reduce over all ranks"])
        return dict(zip(self.plan.tasks, vec.tolist()))

    def destroy(self) -> None:
        self.grad_sync.release()
        self.registry.destroy()

