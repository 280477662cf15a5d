"""A MIMO model and its tasks as the workload ``spindle compare`` and the tuners take (pure Python).

It answers what :class:`..planner.tuning.tune.Workload` answers for a spec file (one pass's graph at a pass count,
each task's batch per step, the valid pass counts), from a :class:`.describe.MimoDescription` and the tasks file.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..planner.limits import divisors
from ..planner.workload.graph import TaskGraph
from .describe import MimoDescription
from .graph import mimo_graph
from .tasks import MimoTasks


@dataclass
class MimoWorkload:
    description: MimoDescription
    tasks: MimoTasks
    task_count: int | None = None
    """Train the first K tasks of the file (None: all)."""
    batch: int | Mapping[str, int] | None = None
    """Global batch per task per step (None: the tasks file's)."""
    freeze: Sequence[str] = ()
    _graphs: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model(self) -> str:
        return self.description.name

    def graph(self, passes: int) -> TaskGraph:
        """One pass's graph at ``passes`` passes per step."""
        g = self._graphs.get(passes)
        if g is None:
            g = self._graphs[passes] = mimo_graph(self.description, self.tasks, task_count=self.task_count,
                                                  batch=self.batch, passes=passes, freeze=tuple(self.freeze))
        return g

    def step_batches(self) -> dict[str, int]:
        return {op.task: op.batch for op in self.graph(1).operators}

    def pass_options(self) -> tuple[int, ...]:
        return divisors(functools.reduce(math.gcd, self.step_batches().values()))
