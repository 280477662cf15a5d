"""Creating the process groups of a plan, in one place.

A pure function elsewhere maps a plan to ``{group name: ranks}`` (tensor-parallel groups of slices,
parameter device groups, ...). :class:`ProcessGroupRegistry` turns that mapping into
``torch.distributed`` groups:

* ``new_group`` is collective over the whole world: every rank must call it for every group, in the same
  order, even for groups it is not in. The registry creates the distinct rank sets in sorted order
  (by size, then by ranks), so every rank that gets the same mapping makes the same calls;
* groups are cached by their sorted rank tuple: two names with the same ranks share one group;
* ``get(name)`` is the group, or None on a rank outside it; :meth:`destroy` releases them.

Works with gloo and nccl; ``backend`` (default: the world's) and ``timeout`` go to ``new_group``.
"""
from __future__ import annotations

import datetime
from typing import Mapping, Sequence

import torch.distributed as dist


class ProcessGroupRegistry:
    """Every group of a ``{name: ranks}`` mapping, created in the same order on every rank.

    Args:
        groups: group name -> ranks (any order; duplicates are an error).
        timeout: collective timeout of the new groups (default: the backend's).
        backend: backend of the new groups (default: the default group's).
    """

    def __init__(self, groups: Mapping[str, Sequence[int]], *,
                 timeout: datetime.timedelta | None = None, backend: str | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed must be initialised before creating process groups")
        world = dist.get_world_size()
        self._ranks: dict[str, tuple[int, ...]] = {}
        for name, ranks in groups.items():
            ranks = tuple(int(r) for r in ranks)
            key = tuple(sorted(ranks))
            if not key or len(set(key)) != len(key) or key[0] < 0 or key[-1] >= world:
                raise ValueError(f"group {name!r}: ranks {list(ranks)} must be distinct and in "
                                 f"[0, {world})")
            self._ranks[name] = key
        self.rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], object] = {}
        kwargs = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if backend is not None:
            kwargs["backend"] = backend
        for key in sorted(set(self._ranks.values()), key=lambda k: (len(k), k)):
            group = dist.new_group(list(key), **kwargs)
            self._groups[key] = group if self.rank in key else None

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
        """Distinct groups created (names with equal ranks count once)."""
        return len(self._groups)

    def destroy(self) -> None:
        """Destroy this rank's groups; the registry is empty afterwards."""
        for group in self._groups.values():
            if group is not None:
                dist.destroy_process_group(group)
        self._groups.clear()
        self._ranks.clear()
