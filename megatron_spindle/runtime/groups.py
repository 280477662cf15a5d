"""Creating the process groups of a plan, in one place, as Megatron does: once, in one order, warmed up.

A pure function elsewhere maps a plan to ``{group name: ranks}`` (tensor-parallel groups of slices,
parameter device groups; :mod:`...planner.assembly.communicators`, which also counts their communicators for
the plan's memory check). :class:`ProcessGroupRegistry` turns that mapping into ``torch.distributed`` groups:

* ``new_group`` is collective over the whole world: every rank must call it for every group, in the same
  order, even for groups it is not in. The registry creates the distinct rank sets in sorted order
  (by size, then by ranks), so every rank that gets the same mapping makes the same calls;
* every new group is **warmed** by one one-element all-reduce among its members, in the same sorted order,
  before the model's first step. Under NCCL a communicator is otherwise created by its first collective, a
  blocking step that every member must reach: in the middle of a backward, with point-to-point kernels in
  flight, that is a known hang pattern (Megatron creates and uses its groups at start-up for the same
  reason). Warming in one global order cannot deadlock: every member of a group reaches it after the same
  earlier groups;
* groups are cached by their sorted rank tuple: two names with the same ranks share one group;
* :meth:`update` takes a new plan's mapping (a replan): the groups both plans use are kept (not created
  again), new ones created and warmed; :meth:`retain` destroys the groups nobody needs any more, so
  communicators do not pile up with each task-mix change;
* ``get(name)`` is the group, or None on a rank outside it; :meth:`destroy` releases them all;
* :attr:`one` is this rank's one-rank group (megatron asks layers and DDP for pipeline, context and expert
  groups of size 1): every process's is created once, by the first registry of a world, on every rank at
  that same point. Under eager NCCL initialisation (``init_process_group(device_id=...)``) every
  ``new_group`` is a split of the world communicator (``ncclCommSplit``), which every rank of the world must
  join, even with ``use_local_synchronization=True`` (a rank outside the group then does nothing, and the
  members wait for it): the ranks' one-rank groups are one such split, each rank with its own colour, made by
  all ranks together. No other module creates a group (``runtime/comm_check.py`` models every
  ``new_group`` as that world collective, so one made anywhere else fails the check).

Works with gloo and nccl; ``backend`` (default: the world's) and ``timeout`` go to ``new_group``.
"""
from __future__ import annotations

import datetime
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import comm


#: rank -> its one-rank group, used while torch.distributed still has it registered: after
#: ``destroy_process_group`` and a new ``init_process_group`` a new one is made (a cache keyed by the default
#: group's ``id`` could hand back a destroyed group, since a freed group's ``id`` can be reused).
_ONE_RANK: dict = {}


def _one_rank_group():
    """This rank's one-rank group, created if this world has none yet (every rank calls it at the same point:
    the first registry's construction)."""
    rank = dist.get_rank()
    group = _ONE_RANK.get(rank)
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        group = _ONE_RANK[rank] = dist.new_group([rank], use_local_synchronization=True)
    return group


class ProcessGroupRegistry:
    """Every group of a ``{name: ranks}`` mapping, created in the same order on every rank, and warmed.

    Args:
        groups: group name -> ranks (any order; duplicates are an error).
        timeout: collective timeout of the new groups (default: the backend's).
        backend: backend of the new groups (default: the default group's).
    """

    def __init__(self, groups: Mapping[str, Sequence[int]], *,
                 timeout: datetime.timedelta | None = None, backend: str | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed must be initialised before creating process groups")
        self.rank = dist.get_rank()
        self._kwargs = {}
        if timeout is not None:
            self._kwargs["timeout"] = timeout
        if backend is not None:
            self._kwargs["backend"] = backend
        self._ranks: dict[str, tuple[int, ...]] = {}
        self._groups: dict[tuple[int, ...], object] = {}
        self.created = 0
        """Groups created over the registry's life (a replan's kept groups are not created again)."""
        self.one = _one_rank_group()
        """This rank's one-rank group (see the module docstring)."""
        self.update(groups)

    def update(self, groups: Mapping[str, Sequence[int]]) -> "ProcessGroupRegistry":
        """Serve ``groups`` from now on: create (sorted) and warm the rank sets not held yet; keep the others
        (:meth:`retain` destroys what is no longer needed). Every rank must call it with the same mapping."""
        world = dist.get_world_size()
        names: dict[str, tuple[int, ...]] = {}
        for name, ranks in groups.items():
            ranks = tuple(int(r) for r in ranks)
            key = tuple(sorted(ranks))
            if not key or len(set(key)) != len(key) or key[0] < 0 or key[-1] >= world:
                raise ValueError(f"group {name!r}: ranks {list(ranks)} must be distinct and in "
                                 f"[0, {world})")
            names[name] = key
        self._ranks = names
        new = sorted(set(names.values()) - set(self._groups), key=lambda k: (len(k), k))
        for key in new:
            group = dist.new_group(list(key), **self._kwargs)
            self._groups[key] = group if self.rank in key else None
            self.created += 1
        for key in new:  # one small collective per new group, members only, in the creation order
            if self._groups[key] is not None:
                comm.all_reduce(torch.zeros(1), group=self._groups[key])
        return self

    def retain(self, extra: Iterable[Sequence[int]] = ()) -> None:
        """Destroy every group that neither the current mapping nor ``extra`` (rank sets still referenced,
        e.g. by parked layers) needs. Every rank must call it with the same ``extra``."""
        keep = set(self._ranks.values()) | {tuple(sorted(int(r) for r in k)) for k in extra}
        for key in sorted(set(self._groups) - keep, key=lambda k: (len(k), k)):
            group = self._groups.pop(key)
            if group is not None:
                dist.destroy_process_group(group)

    def get(self, name: str):
        """The group called ``name``, or None when this rank is not a member."""
        if name not in self._ranks:
            raise ValueError(f"unknown process group {name!r}; known: {sorted(self._ranks)}")
        return self._groups[self._ranks[name]]

    def ranks(self, name: str) -> tuple[int, ...]:
        """The sorted global ranks of a group (known on every rank)."""
        if name not in self._ranks:
            raise ValueError(f"unknown process group {name!r}; known: {sorted(self._ranks)}")
        return self._ranks[name]

    def names(self) -> list[str]:
        return sorted(self._ranks)

    def __len__(self) -> int:
        """Distinct groups held (names with equal ranks count once)."""
        return len(self._groups)

    def mine(self) -> int:
        """Groups this rank is a member of (each holds a communicator under NCCL)."""
        return sum(g is not None for g in self._groups.values())

    def destroy(self) -> None:
        """Destroy this rank's groups; the registry is empty afterwards."""
        for group in self._groups.values():
            if group is not None:
                dist.destroy_process_group(group)
        self._groups.clear()
        self._ranks.clear()
