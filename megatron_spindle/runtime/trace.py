"""Per-rank timing spans of every wave (forward, backward, transfer, sync) as a Chrome/Perfetto trace.

Each rank records spans with :meth:`StepTrace.span`; :meth:`StepTrace.chrome_events` turns them into
Chrome trace events (``ph: "X"``, microseconds, ``pid`` = rank, one ``tid`` per category) and
:func:`write_chrome_trace` writes one file that ``chrome://tracing`` or https://ui.perfetto.dev loads.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from .. import comm
from ..atomic import write_json

CATEGORIES = ("forward", "backward", "transfer", "sync", "optimizer", "step")


@dataclass
class Span:
    cat: str
    name: str
    start_s: float
    dur_s: float
    step: int


@dataclass
class StepTrace:
    rank: int
    origin: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    step: int = 0
    max_spans: int = 200_000

    def span(self, cat: str, name: str, t0: float, t1: float | None = None) -> None:
        """Record ``[t0, t1]`` (``perf_counter`` seconds; ``t1`` defaults to now)."""
        t1 = time.perf_counter() if t1 is None else t1
        if len(self.spans) < self.max_spans:
            self.spans.append(Span(cat, name, t0 - self.origin, t1 - t0, self.step))

    def totals(self, step: int | None = None) -> dict[str, float]:
        """Seconds per category (of one step, or all)."""
        out = {c: 0.0 for c in CATEGORIES}
        for s in self.spans:
            if step is None or s.step == step:
                out[s.cat] = out.get(s.cat, 0.0) + s.dur_s
        return out

    def wave_times(self, step: int | None = None) -> dict[str, float]:
        """Seconds per span name (``w3 fwd transfer``, ``<slice> fwd``, ...), for prediction checks."""
        out: dict[str, float] = {}
        for s in self.spans:
            if step is None or s.step == step:
                out[s.name] = out.get(s.name, 0.0) + s.dur_s
        return out

    def chrome_events(self) -> list[dict]:
        tids = {c: i for i, c in enumerate(CATEGORIES)}
        ev = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        for c, i in tids.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": i, "args": {"name": c}})
        for s in self.spans:
            ev.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": self.rank, "tid": tids.get(s.cat, 0),
                       "ts": round(s.start_s * 1e6, 3), "dur": round(s.dur_s * 1e6, 3), "args": {"step": s.step}})
        return ev


def write_chrome_trace(path: str, events: list[dict]) -> None:
    """Write events (from one or many ranks) atomically as ``{"traceEvents": [...]}``."""
    write_json(path, {"traceEvents": events, "displayTimeUnit": "ms"}, "Chrome trace", indent=None)


def gather_chrome_trace(trace: StepTrace, directory: str) -> str | None:
    """Gather every rank's spans and write ``<directory>/trace.json`` on rank 0 (collective; every rank calls).

    Returns the path on rank 0, None elsewhere.
    """
    events = comm.all_gather_object(trace.chrome_events())
    if dist.get_rank() != 0:
        return None
    path = os.path.join(directory, "trace.json")
    write_chrome_trace(path, [e for ev in events for e in ev])
    return path
