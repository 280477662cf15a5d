"""What the profiler measures, and the cache that remembers it. Pure Python (no torch).

A **target** is one distinct workload: the MetaOps of a model that share a signature
(:attr:`~megatron_spindle.planner.workload.metaops.MetaOp.signature`: op type, global batch, sequence, width, TP degree)
get one scaling curve, so they are measured once, on the layer of the first of them. The planner keys curves
by signature alone, so MetaOps whose layers differ in something the signature leaves out (an ``lm_head`` with
another number of loss tokens, a causal and a bidirectional layer of one width) share that curve. A **point** is the time (ms) of ONE
layer of the target, forward + backward, on ``n`` devices (the planner's curve value ``T(n)``).

How a point at ``n`` devices is measured (our choice; the paper profiles on the real devices):

1. ``n = tp · d`` with ``d`` data-parallel replicas; each device holds ``B / d`` samples (``B`` the global batch)
   of a ``tp``-way sharded layer. The devices of one replica run the layer together, the replicas run the same
   program on other samples. So ONE replica, ``tp`` processes at local batch ``B / d``, measures the point: a
   data-parallel point needs one process, a tensor-parallel point ``tp`` processes in one group.
2. The gradient all-reduce between replicas is not part of the point: the plan times parameter sync separately
   (the simulator's sync term), so counting it here would count it twice.
3. On a machine with fewer devices than ``n`` (a 2-core CPU) the point is still meaningful: what changes with
   ``n`` is the per-device work ``B / d``, and that is what the process runs. Only ``tp`` processes are needed at
   once; ``--nproc`` bounds the largest ``tp`` that can be measured.
4. The counts measured (:func:`measure_counts`): every valid count whose replica number ``d`` is a power of two
   (the paper's ``n = 1, 2, 4, …, 32``), plus the largest valid count; the fit interpolates between them.

The cache (:class:`ProfileCache`) is one JSON file of measured points keyed by the target's signature and layer
configuration, the device count, and where it was measured (backend, device type, dtype, CPU threads), so a
rerun measures only what is missing. Each entry keeps every repeat, the median is the point. Several
profiles may share one cache at once: each save takes ``FILE.lock`` (``flock``), reads what the file holds
then, adds this run's points and writes the union atomically.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ..atomic import write_json
from ..planner.workload.graph import LayerConfig
from ..planner.jsonfile import read_json
from ..planner.workload.metaops import MetaOp

CACHE_SCHEMA_VERSION = 1
CACHE_KIND = "spindle-profile-cache"


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/megatron_spindle/profile_cache.json`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megatron_spindle", "profile_cache.json")


@dataclass(frozen=True, kw_only=True)
class Target:
    """One distinct workload to measure: the MetaOps that share a signature."""

    signature: Mapping
    """``MetaOp.signature`` (the key of the curve in the curves file)."""
    layer: LayerConfig
    """The measured layer's hyper-parameters (part of the cache key: another model's layer with this signature
    may differ in what the signature leaves out)."""
    operator: str
    """The operator whose layer is built to measure (the first layer of the first MetaOp)."""
    metaops: tuple[str, ...]
    """Every MetaOp with this workload, in MetaOp order."""
    batch: int
    tp: int
    batch_splittable: bool
    counts: tuple[int, ...]
    """Device counts to measure (ascending)."""
    valid_counts: tuple[int, ...]
    """Every valid device count up to the profile's largest (the fit's relaxed curve uses them)."""

    @property
    def label(self) -> str:
        more = f" (+{len(self.metaops) - 1})" if len(self.metaops) > 1 else ""
        return f"{self.metaops[0]}{more}"

    def local_batch(self, devices: int) -> int:
        """Samples per device at ``devices`` devices (``B / d``; the whole batch when not splittable)."""
        if not self.batch_splittable:
            return self.batch
        d = devices // self.tp
        if d * self.tp != devices or self.batch % d:
            raise ValueError(f"{self.label}: {devices} devices is not a valid count (tp={self.tp}, "
                             f"batch={self.batch}); valid: {self.valid_counts}")
        return self.batch // d


@dataclass(frozen=True, kw_only=True)
class Point:
    """One measurement to make: ``target`` (index into the target list) on ``devices`` devices."""

    target: int
    devices: int
    tp: int
    local_batch: int


def measure_counts(m: MetaOp, max_devices: int) -> tuple[int, ...]:
    """The device counts to measure for ``m`` (see the module docstring, item 4)."""
    valid = m.valid_counts(max_devices)
    if not valid:
        return ()
    picked = {n for n in valid if (n // m.tp) & (n // m.tp - 1) == 0}
    picked.add(valid[-1])
    return tuple(sorted(picked))


def targets_of(metaops: Sequence[MetaOp], max_devices: int) -> list[Target]:
    """One :class:`Target` per distinct signature of ``metaops``, in MetaOp order.

    Raises ``ValueError`` naming the MetaOp when one cannot run on ``max_devices`` devices at all.
    """
    out: list[Target] = []
    index: dict[str, int] = {}
    for m in metaops:
        key = json.dumps(m.signature, sort_keys=True)
        if key in index:
            t = out[index[key]]
            out[index[key]] = dataclasses.replace(t, metaops=t.metaops + (m.name,))
            continue
        counts = measure_counts(m, max_devices)
        if not counts:
            raise ValueError(f"MetaOp {m.name!r} needs {m.tp} devices (tensor parallel) but the profile "
                             f"goes up to {max_devices} devices")
        index[key] = len(out)
        out.append(Target(signature=dict(m.signature), layer=m.layer, operator=m.operators[0],
                          metaops=(m.name,), batch=m.batch, tp=m.tp, batch_splittable=m.batch_splittable,
                          counts=counts, valid_counts=m.valid_counts(max_devices)))
    return out


def points_of(targets: Sequence[Target]) -> list[Point]:
    return [Point(target=i, devices=n, tp=t.tp, local_batch=t.local_batch(n))
            for i, t in enumerate(targets) for n in t.counts]


def schedule_rounds(points: Sequence[Point], nproc: int) -> list[list[tuple[Point, tuple[int, ...]]]]:
    """Pack points into rounds that run concurrently on ``nproc`` processes.

    A point with ``tp`` needs ``tp`` processes ``[k·tp, (k+1)·tp)`` (aligned blocks, so a round's tensor-parallel
    groups come from a fixed, small set of process groups). Largest ``tp`` first; within a round no process
    runs two points. Raises ``ValueError`` when a point needs more processes than there are.

    >>> [[(p.devices, r) for p, r in rnd] for rnd in schedule_rounds(
    ...     [Point(target=0, devices=n, tp=1, local_batch=8 // n) for n in (1, 2, 4)], 2)]
    [[(1, (0,)), (2, (1,))], [(4, (0,))]]
    """
    too_big = [p for p in points if p.tp > nproc]
    if too_big:
        raise ValueError(f"{len(too_big)} point(s) need tensor parallelism {max(p.tp for p in too_big)} but only "
                         f"{nproc} processes run the profile: use --nproc {max(p.tp for p in too_big)} or more")
    queue = sorted(points, key=lambda p: -p.tp)
    rounds = []
    while queue:
        used = 0
        this, rest = [], []
        for p in queue:
            start = -(-used // p.tp) * p.tp
            if start + p.tp <= nproc:
                this.append((p, tuple(range(start, start + p.tp))))
                used = start + p.tp
            else:
                rest.append(p)
        rounds.append(this)
        queue = rest
    return rounds


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Where:
    """Where points are measured: entries measured elsewhere are never reused."""

    backend: str
    """``gloo`` or ``nccl``."""
    device_type: str
    """``cpu`` or the GPU's name (``torch.cuda.get_device_name``)."""
    dtype: str = "float32"
    threads: int = 0
    """CPU threads per process (0 on GPUs)."""
    procs: int = 0
    """CPU processes measuring at once on this machine (0 on GPUs, where each has its own device): processes
    that share cores slow each other down, so a point measured beside 3 others is not reused for a run of
    2 (and the prediction of a training run compares its ranks per core with this)."""

    def to_json(self) -> dict:
        return {"backend": self.backend, "device_type": self.device_type, "dtype": self.dtype,
                "threads": self.threads, "procs": self.procs}


def _key(target: Target, devices: int, where: Where) -> str:
    """Canonical JSON of the cache key (used in memory only; the file keeps the fields)."""
    return json.dumps({"signature": dict(target.signature), "layer": target.layer.to_json(),
                       "batch_splittable": target.batch_splittable, "devices": devices,
                       **where.to_json()}, sort_keys=True)


def _entry_key(e: Mapping) -> str:
    return json.dumps({"signature": dict(e["signature"]), "layer": dict(e["layer"]),
                       "batch_splittable": e["batch_splittable"], "devices": e["devices"],
                       "backend": e["backend"], "device_type": e["device_type"], "dtype": e["dtype"],
                       "threads": e["threads"], "procs": e.get("procs", -1)}, sort_keys=True)


@dataclass
class ProfileCache:
    """Measured points on disk: ``{"schema_version", "kind", "entries": [...]}``, one entry per point.

    An entry holds the key fields (``signature``, ``layer``, ``batch_splittable``, ``devices``, ``backend``,
    ``device_type``, ``dtype``, ``threads``, ``procs``; an entry written before ``procs`` existed never matches)
    and the measurement (``local_batch``, ``tp``, ``ms`` the median,
    ``samples_ms`` every repeat, ``warmup``, ``measured_at``). Writes are atomic (temp file + rename), so an
    interrupted profile keeps every point measured before the interruption.
    """

    path: str | None
    entries: dict[str, dict] = field(default_factory=dict)
    mine: set[str] = field(default_factory=set)
    """Keys of the entries this process measured (they win over the file's when saving)."""

    @classmethod
    def load(cls, path: str | None, *, fresh: bool = False) -> "ProfileCache":
        """The cache at ``path`` (empty if the file does not exist; ``None``: in memory only).

        ``fresh``: every point is measured again, so an unreadable cache is not an error: it starts empty
        and is replaced on the first save.
        """
        try:
            return cls._load(path)
        except ValueError:
            if fresh:
                return cls(path)
            raise

    @classmethod
    def _load(cls, path: str | None) -> "ProfileCache":
        cache = cls(path)
        if path is None or not os.path.exists(path):
            return cache
        try:
            obj = read_json(path, "profile cache")
        except ValueError as e:
            raise ValueError(f"{e}; delete it or pass --fresh") from None
        if not isinstance(obj, dict) or obj.get("kind") != CACHE_KIND:
            raise ValueError(f"profile cache {path!r} is not a {CACHE_KIND} file")
        if obj.get("schema_version") != CACHE_SCHEMA_VERSION:
            raise ValueError(f"profile cache {path!r}: schema_version {obj.get('schema_version')!r} is not "
                             f"supported (expected {CACHE_SCHEMA_VERSION}); delete it or pass --fresh")
        for i, e in enumerate(obj.get("entries", [])):
            try:
                cache.entries[_entry_key(e)] = dict(e)
            except (KeyError, TypeError) as err:
                raise ValueError(f"profile cache {path!r}: entry {i} lacks {err}") from None
        return cache

    def get(self, target: Target, devices: int, where: Where) -> dict | None:
        return self.entries.get(_key(target, devices, where))

    def put(self, target: Target, devices: int, where: Where, *, samples_ms: Sequence[float],
            local_batch: int, warmup: int) -> dict:
        """Record one measured point (its median is the point's time) and return the entry."""
        if not samples_ms:
            raise ValueError("a point needs at least one timed repeat")
        e = {"signature": dict(target.signature), "layer": target.layer.to_json(),
             "batch_splittable": target.batch_splittable, "devices": devices, **where.to_json(),
             "tp": target.tp, "local_batch": local_batch, "ms": median(samples_ms),
             "samples_ms": [float(s) for s in samples_ms], "warmup": warmup,
             "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.entries[_key(target, devices, where)] = e
        self.mine.add(_key(target, devices, where))
        return e

    def save(self) -> None:
        """Write the cache: under ``FILE.lock``, the file's entries as they are now (another profile may
        have added some since this one read it) with this run's measured points over them, atomically."""
        if self.path is None:
            return
        with self._locked():
            try:
                on_disk = ProfileCache._load(self.path).entries
            except ValueError:  # unreadable (this run was started with --fresh): replaced
                on_disk = {}
            merged = {**on_disk, **{k: self.entries[k] for k in self.mine}}
            for k, e in self.entries.items():
                merged.setdefault(k, e)
            self.entries = merged
            write_json(self.path, {"schema_version": CACHE_SCHEMA_VERSION, "kind": CACHE_KIND,
                                   "entries": list(self.entries.values())}, "profile cache")

    @contextlib.contextmanager
    def _locked(self):
        lock = f"{self.path}.lock"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # no lock file possible here: the atomic write still keeps the file whole
            yield
            return
        try:
            with contextlib.suppress(OSError):  # a file system without flock: as before, atomic only
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def __len__(self) -> int:
        return len(self.entries)


def median(xs: Iterable[float]) -> float:
    s = sorted(float(x) for x in xs)
    if not s:
        raise ValueError("median of no values")
    k = len(s) // 2
    return s[k] if len(s) % 2 else 0.5 * (s[k - 1] + s[k])
