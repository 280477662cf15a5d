"""``spindle profile``: measure every MetaOp of a model on the live backend, fit its curve, write a curves file.

How a run goes (every process runs :func:`profile_rank`; process 0 keeps the books and prints):

1. contract the model exactly as ``spindle plan`` will (same device memory and island size, so the same
   tensor-parallel degrees and signatures), and list the targets and points (:mod:`.points`);
2. drop the points the cache already holds for this backend, device type, dtype and thread count;
3. pack the rest into rounds (:func:`.points.schedule_rounds`): in a round every process measures a different
   point at once (a tensor-parallel point takes ``tp`` processes); after the round the results are gathered
   on process 0, written to the cache, and one progress line per point is printed (MetaOp, devices, time,
   elapsed, remaining);
4. with two or more processes, measure the link (:mod:`.link`) and the runtime's own costs (posting a
   boundary's batch, small all-reduces, the gradient norm: :mod:`.runtime_costs`; the executor's cost per
   slice: :mod:`.slice_costs`); every process times the
   optimizer step at once (:mod:`.step_costs`);
5. fit every target's curve and write the curves file (:mod:`.fit`) and, if asked, a cluster file.

Launching: under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) every process runs the profile;
otherwise :func:`profile` starts ``nproc`` processes itself (``spawn``, a free local port; also for one
process, so that the caller's process never holds a process group). Backend: NCCL with one GPU per process when CUDA is available, else gloo on CPU.
CPU processes run ``OMP_NUM_THREADS`` threads (default: cores / processes, as ``torchrun`` would set 1).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm
from ..atomic import write_json
from ..compat.cpu import apply_cpu_patches
from ..log import get_logger
from ..planner.assembly.assemble import make_metaops
from ..planner.workload.cluster import Cluster
from ..planner.workload.workloads import build_graph
from . import launch
from .fit import curves_document, summary_table
from .link import cluster_fields, fit_link, measure_link
from .runtime_costs import fit_runtime, measure_runtime
from .slice_costs import fit_slices, measure_slices
from .step_costs import fit_optimizer, measure_optimizer
from .points import ProfileCache, Where, default_cache_path, points_of, schedule_rounds, targets_of
from .timing import time_layer

_log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What to profile and how."""

    model: str | None
    """Built-in model name (``multitask-clip``, ``qwen-val``, ``ofasys``) or a spec file; None with ``model_provider``."""
    model_provider: str | None = None
    """A MIMO model provider (``MODULE:FUNCTION``, docs/mimo.md) instead of ``model``; its tasks from ``tasks_file``."""
    tasks_file: str | None = None
    tasks: int | None = None
    """Number of tasks (default: the model's largest)."""
    size: str = "full"
    """``full`` or ``tiny``."""
    batch: int | None = None
    """Global batch per task (default: the model's)."""
    nproc: int = 1
    """Processes that measure (a tensor-parallel point needs ``tp`` of them)."""
    max_devices: int = 32
    """Largest device count to measure and to fit (the paper profiles n = 1 … 32)."""
    gpus_per_node: int = 8
    """Island size of the plans that will use the curves (it caps tensor parallelism, as in ``spindle plan``)."""
    memory_gib: float | None = None
    """Memory of one device, GiB (default: measured: the GPU's, or the host's RAM / processes)."""
    warmup: int = 3
    """Untimed repeats before timing each point."""
    repeats: int = 10
    """Timed repeats per point (at least); the point is their median."""
    min_seconds: float = 0.2
    """Time more repeats of a fast layer until they add up to this (the median then spans a longer window)."""
    out: str | None = "curves.json"
    """Curves file to write (None: do not write)."""
    cluster_out: str | None = None
    """Also write the measured link as a cluster JSON file (``spindle compare --cluster FILE``)."""
    cache: str | None = dataclasses.field(default_factory=default_cache_path)
    """Cache of measured points (None: no cache)."""
    fresh: bool = False
    """Measure every point again (their cache entries are replaced; other entries are kept)."""
    seed: int = 0
    measure_link: bool = True
    """Measure the backend's latency and bandwidth (needs two or more processes)."""
    verbose: bool = True
    """Print progress lines and the summary (process 0)."""
    skip_unmeasurable: bool = False
    """Leave out what this machine cannot measure instead of failing: targets whose tensor parallelism exceeds
    ``nproc``, and one-process points that run out of device memory. The curves file lists them under
    ``not_measured`` with the reason; the planner times them with its analytic model."""

    def __post_init__(self) -> None:
        for f in ("nproc", "max_devices", "gpus_per_node", "repeats"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"profile {f}={v!r} must be a positive integer")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"profile warmup={self.warmup!r} must be a non-negative integer")
        if not self.min_seconds >= 0:
            raise ValueError(f"profile min_seconds={self.min_seconds!r} must not be negative")
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ValueError(f"profile memory_gib={self.memory_gib!r} must be positive")


def profiled_graph(cfg: ProfileConfig):
    """The graph the profile measures: a spec model's, or a MIMO provider's (built on the meta device; each process
    loads it, so its layers build from the user's specs)."""
    if cfg.model_provider:
        from ..models.mimo_source import load_source  # optional: a MIMO provider's model (torch is loaded already)
        return load_source(cfg.model_provider, cfg.tasks_file).workload(task_count=cfg.tasks, batch=cfg.batch).graph(1)
    return build_graph(cfg.model, tasks=cfg.tasks, size=cfg.size, batch=cfg.batch)


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def profile_rank(cfg: ProfileConfig, *, log: Callable[[str], None] | None = None) -> dict | None:
    """Run the profile on this process of an initialised world; the curves document on process 0, else None."""
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.nproc:
        raise ValueError(f"the profile was asked for --nproc {cfg.nproc} but runs on {world} processes")
    say = (log or _log.info) if rank == 0 and cfg.verbose else (lambda s: None)
    backend = dist.get_backend()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
        where = Where(backend=backend, device_type=torch.cuda.get_device_name(device), dtype="bfloat16")
        memory_gib = cfg.memory_gib or torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        apply_cpu_patches()
        device, dtype = torch.device("cpu"), torch.float32
        where = Where(backend=backend, device_type="cpu", dtype="float32", threads=torch.get_num_threads(),
                      procs=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        memory_gib = cfg.memory_gib or _host_memory_gib() / world

    graph = profiled_graph(cfg)
    cluster = Cluster(name="profile", num_devices=cfg.max_devices, gpus_per_node=cfg.gpus_per_node,
                      memory_gib=memory_gib)
    metaops = make_metaops(graph, cluster)
    targets = targets_of(metaops, cfg.max_devices)
    points = points_of(targets)

    not_measured = []
    if cfg.skip_unmeasurable:
        not_measured = [{"metaops": list(t.metaops), "signature": dict(t.signature),
                         "reason": f"planned at tensor parallelism {t.tp} on {memory_gib:.1f} GiB devices (the "
                                   f"MetaOp does not fit tp 1); {world} process(es) cannot run a {t.tp}-rank "
                                   f"group"} for t in targets if t.tp > world]
        points = [p for p in points if p.tp <= world]
    cache = None
    if rank == 0:
        cache = ProfileCache.load(cfg.cache, fresh=cfg.fresh)
        pending = [p for p in points if cfg.fresh or cache.get(targets[p.target], p.devices, where) is None]
    else:
        pending = None
    box = [pending]
    comm.broadcast_object_list(box, src=0)
    pending = box[0]
    rounds = schedule_rounds(pending, world)  # raises on every rank alike when tp > nproc

    say(f"profiling {graph.model} ({len(graph.tasks)} tasks, {cfg.size}): {len(metaops)} MetaOps, "
        f"{len(targets)} distinct, {len(points)} points up to {cfg.max_devices} devices "
        f"({len(points) - len(pending)} cached, {len(pending)} to measure) on {world} {backend} process(es), "
        f"{where.device_type}" + (f", {where.threads} thread(s) each, {where.procs} process(es) on this machine"
                                         if where.threads else ""))

    groups = {}
    for tp in sorted({p.tp for p in pending if p.tp > 1}):
        for k in range(world // tp):
            ranks = tuple(range(k * tp, (k + 1) * tp))
            groups[ranks] = dist.new_group(list(ranks))

    t_measure = time.perf_counter()
    done = 0
    for ri, rnd in enumerate(rounds):
        result = None
        for p, ranks in rnd:
            if rank not in ranks:
                continue
            t = targets[p.target]
            try:
                samples = time_layer(graph, t.operator, p.local_batch, warmup=cfg.warmup, repeats=cfg.repeats,
                                     min_seconds=cfg.min_seconds,
                                     tp_group=groups.get(ranks), tp_rank=ranks.index(rank), tp_size=p.tp,
                                     seed=cfg.seed, dtype=dtype, device=device)
            except torch.OutOfMemoryError:
                if not (cfg.skip_unmeasurable and p.tp == 1):  # a tensor-parallel peer would wait forever
                    raise
                samples = None
                torch.cuda.empty_cache()
            if rank == ranks[0]:
                result = (p, samples)
        gathered = comm.all_gather_object(result)
        if rank != 0:
            continue
        for item in gathered:
            if item is None:
                continue
            p, samples = item
            t = targets[p.target]
            if samples is None:
                not_measured.append({"metaops": list(t.metaops), "signature": dict(t.signature),
                                     "devices": p.devices, "local_batch": p.local_batch,
                                     "reason": f"out of memory at local batch {p.local_batch} on {where.device_type}"})
                say(f"{t.label} n={p.devices} (local batch {p.local_batch}): out of memory, not measured")
                continue
            e = cache.put(t, p.devices, where, samples_ms=samples, local_batch=p.local_batch,
                          warmup=cfg.warmup)
            done += 1
            elapsed = time.perf_counter() - t_measure
            left = elapsed / (ri + 1) * (len(rounds) - ri - 1)
            say(f"[{done:>{len(str(len(pending)))}}/{len(pending)}] {t.label:<34} n={p.devices:<3} "
                f"(local batch {p.local_batch}{f', tp {p.tp}' if p.tp > 1 else ''}) {e['ms']:8.3f} ms   "
                f"elapsed {_fmt_s(elapsed)}, remaining ~{_fmt_s(left)}")
        cache.save()

    link = None
    if cfg.measure_link and world >= 2:
        link_ms = measure_link(device=device)
        if rank == 0:
            link = {**fit_link(link_ms), "measurements": link_ms}
            kinds = "; ".join(f"{k}: {v['latency_us']:.0f} us + bytes / {v['bandwidth_gbps']:.2f} GB/s "
                              f"(fit error {v['fit_error']:.0%})" for k, v in link["by_kind"].items())
            say(f"link ({backend}): latency {link['latency_us']:.0f} us (exchange), bandwidth "
                f"{link['bandwidth_gbps']:.2f} GB/s (all-reduce); {kinds}")
    runtime = None
    if cfg.measure_link and world >= 2:  # every process at once, as the ranks of a run
        runtime = fit_runtime(measure_runtime(device=device))
        per_slice = measure_slices(graph, cluster, device=device)  # the executor on the profile's processes
        if per_slice:
            runtime["slice"] = fit_slices(per_slice)
            sl = runtime["slice"]
            say(f"runtime ({backend}): per slice {sl['fwd_ms']:.3f} ms forward + {sl['bwd_ms']:.3f} ms backward, "
                f"its layers x{sl['scale']:.2f} of their points ({sl['slices']} slices, residual {sl['rms_ms']:.3f} "
                f"ms rms, fit error {sl['fit_error']:.0%})")
        else:
            say(f"runtime ({backend}): the cost per slice not measured (on CUDA, or no plan of the model fits the "
                f"profile's processes): not charged")
        p, c, g = runtime["post"], runtime["collective"], runtime["grad_norm"]
        pl, d = runtime.get("post_local", {"fixed_ms": 0.0, "per_op_ms": 0.0}), runtime["delivery"]
        say(f"runtime ({backend}): posting a point's batch {p['fixed_ms']:.3f} ms + {p['per_op_ms'] * 1e3:.0f} us "
            f"per message (fit error {p['fit_error']:.0%}), local copies alone {pl['fixed_ms']:.3f} ms + "
            f"{pl['per_op_ms'] * 1e3:.1f} us each; delivery {d['fixed_ms']:.3f} ms + {d['per_op_ms'] * 1e3:.0f} us "
            f"per message (fit error {d['fit_error']:.0%}); small all-reduce {c['per_collective_ms']:.3f} ms each "
            f"+ {c['first_ms']:.3f} ms (fit error {c['fit_error']:.0%}); gradient norm {g['fixed_ms']:.3f} ms + "
            f"{g['per_tensor_ms'] * 1e3:.1f} us per tensor + {g['per_melement_ms']:.2f} ms per million elements")
    comm.barrier()  # every process times the optimizer at once, as the ranks of a run step together
    opt = fit_optimizer(measure_optimizer(device))
    if rank == 0:
        say(f"optimizer step (AdamW): {opt['fixed_ms']:.3f} ms + {opt['per_tensor_ms'] * 1e3:.1f} us per tensor "
            f"+ {opt['per_melement_ms']:.2f} ms per million elements (fit error {opt['fit_error']:.0%})")
    if rank != 0:
        comm.barrier()
        return None

    entries: dict[int, list] = {}
    for i, t in enumerate(targets):
        for n in t.counts:
            e = cache.get(t, n, where)
            if e is not None:
                entries.setdefault(i, []).append(e)
    cl = None
    if link is not None:
        cl = cluster_fields(link, name=f"{backend}-{where.device_type}-{world}proc",
                            gpus_per_node=cfg.gpus_per_node, memory_gib=memory_gib)
        if backend == "gloo":  # gloo ranks hold no NCCL communicator buffers on a device
            cl["communicator_mib"] = 0.0
    measured = {"model": graph.model, "tasks": len(graph.tasks), "size": cfg.size, "batch": cfg.batch,
                **where.to_json(), "nproc": world, "max_devices": cfg.max_devices,
                "gpus_per_node": cfg.gpus_per_node, "warmup": cfg.warmup, "repeats": cfg.repeats,
                "min_seconds": cfg.min_seconds,
                "points_measured": len(pending), "points_cached": len(points) - len(pending),
                "torch": torch.__version__, "profile_s": round(time.perf_counter() - t_start, 3)}
    if link is not None:
        measured["link"] = link
    measured["optimizer"] = opt
    if runtime is not None:
        measured["runtime"] = runtime
    doc = curves_document(targets, entries, measured=measured, cluster=cl, memory_gib=memory_gib)
    if cfg.skip_unmeasurable:
        doc["not_measured"] = not_measured
    if cfg.out:
        write_json(cfg.out, doc, "curves file")
    if cfg.cluster_out and cl is not None:
        write_json(cfg.cluster_out, cl, "cluster file")
    say("")
    say(summary_table(doc))
    say("")
    say(f"profiled in {_fmt_s(time.perf_counter() - t_start)} (measuring {_fmt_s(time.perf_counter() - t_measure)})"
        + (f"; curves written to {cfg.out}" if cfg.out else "")
        + (f"; cluster written to {cfg.cluster_out}" if cfg.cluster_out and cl is not None else ""))
    comm.barrier()
    return doc




# --------------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------------
def profile(cfg: ProfileConfig) -> dict:
    """Run the profile: in an initialised world, under torchrun, or on ``nproc`` spawned processes.

    Returns the curves document (on process 0; ``{}`` on the others).
    """
    profiled_graph(cfg)  # bad input: fail before starting
    if dist.is_initialized():
        return profile_rank(cfg) or {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(launch.backend(), device_id=comm.device_id(launch.backend()))
        try:
            torch.set_num_threads(launch.threads_per_process(dist.get_world_size()))
            return profile_rank(cfg) or {}
        finally:
            dist.destroy_process_group()
    return launch.spawn(_spawned, cfg.nproc, cfg)[0] or {}


def _spawned(rank: int, world: int, cfg: ProfileConfig) -> dict | None:
    return profile_rank(cfg)
