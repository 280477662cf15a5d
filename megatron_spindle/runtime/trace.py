"""Per-rank timing spans of every wave (forward, backward, transfer, sync) as a Chrome/Perfetto trace.

Each rank records spans with :meth:`StepTrace.span` between two *marks* of the trace's clock
(:meth:`StepTrace.now`); :meth:`StepTrace.chrome_events` turns them into Chrome trace events (``ph: "X"``,
microseconds, ``pid`` = rank, one ``tid`` per category) and :func:`write_chrome_trace` writes one file that
``chrome://tracing`` or https://ui.perfetto.dev loads. The live prediction (:mod:`...megatron.trainer.
prediction`) reads the same spans.

**Clocks** (:func:`clock_for`, by the rank's device):

* on the CPU, :class:`HostClock`: a mark is ``time.perf_counter()``; what the host does is what the device does;
* on a GPU, :class:`EventClock`: a mark is a CUDA event recorded on the current stream. The host only queues
  work there: a wait for a message or a bucket is a stream wait and NCCL marks a work's future complete when
  it is enqueued, so host times would read near zero for transfers, blocking and reduces, and a compute span
  would measure its kernels' launches. An event's time is when the stream reached it; spans are resolved
  into seconds (``elapsed_time`` from the clock's first event, placed at that event's host time) once their
  events have completed, without waiting: the trainer resolves after the step's one sync
  (:meth:`StepTrace.resolve`), and what completes later is resolved with the next step; reading
  :attr:`StepTrace.spans` resolves everything, waiting for the device if it must.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm
from ..atomic import write_json

CATEGORIES = ("forward", "backward", "transfer", "sync", "optimizer", "step")


class HostClock:
    """Marks are ``perf_counter`` seconds (the CPU: the host's time is the device's)."""

    host = True

    def now(self) -> float:
        return time.perf_counter()

    def done(self, mark) -> bool:
        return True

    def seconds(self, mark) -> float:
        return mark

    def between(self, a, b) -> float:
        return b - a

    def wait(self, mark) -> None:
        return None


class EventClock:
    """Marks are CUDA events recorded on the current stream (``make_event``: a factory of events with
    ``record``, ``query``, ``elapsed_time`` in ms and ``synchronize``; ``torch.cuda.Event(enable_timing=True)``
    by default). A host time (a float) is accepted as a mark too and taken as is."""

    host = False

    def __init__(self, make_event=None) -> None:
        self._make = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._origin = None  # (first event, the host's perf_counter when it was recorded)

    def now(self):
        ev = self._make()
        ev.record()
        if self._origin is None:
            self._origin = (ev, time.perf_counter())
        return ev

    def done(self, mark) -> bool:
        return isinstance(mark, float) or mark.query()

    def seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        first, at = self._origin
        return at + first.elapsed_time(mark) / 1e3

    def between(self, a, b) -> float:
        if isinstance(a, float) or isinstance(b, float):
            return self.seconds(b) - self.seconds(a)
        return a.elapsed_time(b) / 1e3

    def wait(self, mark) -> None:
        if not isinstance(mark, float):
            mark.synchronize()


def clock_for(device) -> HostClock | EventClock:
    """:class:`EventClock` for a CUDA device, :class:`HostClock` otherwise."""
    return EventClock() if torch.device(device).type == "cuda" else HostClock()


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
    step: int = 0
    max_spans: int = 200_000
    clock: HostClock | EventClock = field(default_factory=HostClock)
    _spans: list[Span] = field(default_factory=list)
    _pending: list[tuple] = field(default_factory=list)  # (cat, name, start mark | [(a, b)], end mark, step)

    def now(self):
        """A mark of the trace's clock: now (on a GPU: where the current stream is)."""
        return self.clock.now()

    def span(self, cat: str, name: str, t0, t1=None) -> None:
        """Record ``[t0, t1]`` (marks of :meth:`now`; ``t1`` defaults to now)."""
        self._add(cat, name, t0, self.now() if t1 is None else t1)

    def exposed(self, cat: str, name: str, pairs, end) -> None:
        """Record a span ending at mark ``end`` that lasts the summed length of the ``(a, b)`` mark pairs
        (a boundary's time spent posting and waiting, its exposed transfer)."""
        self._add(cat, name, list(pairs), end)

    def _add(self, cat, name, start, end) -> None:
        if len(self) < self.max_spans:
            self._pending.append((cat, name, start, end, self.step))
            if self.clock.host or len(self._pending) % 1024 == 0:  # events: resolve what is done now and then
                self.resolve()

    def __len__(self) -> int:
        return len(self._spans) + len(self._pending)

    def resolve(self, wait: bool = False) -> None:
        """Turn the recorded spans whose marks the device has passed into seconds, in order (``wait``: all of
        them, waiting for the device if it must)."""
        if wait and self._pending:
            self.clock.wait(self._pending[-1][3])
        clock, done = self.clock, 0
        for cat, name, start, end, step in self._pending:
            if not clock.done(end):
                break
            if isinstance(start, list):
                dur = sum(clock.between(a, b) for a, b in start)
                t0 = clock.seconds(end) - dur
            else:
                dur, t0 = clock.between(start, end), clock.seconds(start)
            self._spans.append(Span(cat, name, t0 - self.origin, dur, step))
            done += 1
        del self._pending[:done]

    @property
    def spans(self) -> list[Span]:
        """Every span recorded so far, in seconds (resolving what is left, waiting for the device if needed)."""
        self.resolve(wait=True)
        return self._spans

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
