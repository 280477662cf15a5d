"""From measured points to a curves file: fit each target's piecewise curve and write it. Pure Python.

The file is the planner's ``--curves`` format (:mod:`megatron_spindle.planner.workload.analytic`): one entry per target
with its ``signature`` and measured ``points`` ``[[devices, ms], ...]``; the planner refits the points with the
MetaOp's own valid counts. Keys the planner does not read are there for people:

* ``metaops``: the MetaOps the entry applies to; ``detail``: per point the local batch, the median and the
  range of the repeats; ``fit``: the fitted :class:`~megatron_spindle.planner.workload.curves.ScalingCurve` (segments,
  points, ``fit_error`` = largest relative error at a point); ``fit_error`` again at the top of the entry;
* top level: ``measured`` (model, backend, device type, processes, repeats, how long it took) and, when two or
  more processes ran, ``cluster``: the backend's measured link as :class:`~megatron_spindle.planner.workload.cluster.Cluster`
  fields (``spindle compare --cluster FILE`` reads such a file; see :mod:`.link`);
* ``device``: ``memory_gib`` of one device, the one device constant a measured profile replaces (the planner
  also uses it to choose tensor-parallel degrees, so the profile contracts the model with the same value).

Entries carry ``signature`` and never ``metaop`` or ``curve``, so the planner keys them by signature and refits
the points (a ``curve`` entry would be used as is, without the MetaOp's valid counts).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..planner.workload.analytic import CURVES_SCHEMA_VERSION, CurvesFile
from ..planner.workload.curves import ScalingCurve, fit_piecewise
from ..planner.workload.metaops import MetaOp
from .points import Target


def fit_target(target: Target, points: Sequence[tuple[float, float]]) -> ScalingCurve:
    """The positive, non-increasing piecewise curve through ``(devices, ms)`` points of ``target``."""
    return fit_piecewise(points, batch=target.batch, counts=target.valid_counts, source="measured")


def curves_document(targets: Sequence[Target], entries: Mapping[int, Sequence[Mapping]], *,
                    measured: Mapping, cluster: Mapping | None = None,
                    memory_gib: float | None = None) -> dict:
    """The curves file for ``targets``; ``entries[i]`` are target ``i``'s cache entries (one per count).

    Targets without entries are left out (the planner falls back to its analytic model for them).
    """
    curves = []
    for i, t in enumerate(targets):
        es = sorted(entries.get(i, ()), key=lambda e: e["devices"])
        if not es:
            continue
        pts = [(float(e["devices"]), float(e["ms"])) for e in es]
        curve = fit_target(t, pts)
        curves.append({
            "signature": dict(t.signature), "metaops": list(t.metaops),
            "points": [[int(n), ms] for n, ms in pts],
            "fit_error": curve.fit_error,
            "detail": [{"devices": e["devices"], "local_batch": e["local_batch"], "tp": e["tp"],
                        "ms": e["ms"], "min_ms": min(e["samples_ms"]), "max_ms": max(e["samples_ms"]),
                        "repeats": len(e["samples_ms"])} for e in es],
            "fit": curve.to_json()})
    doc: dict = {"schema_version": CURVES_SCHEMA_VERSION, "kind": "spindle-curves", "measured": dict(measured)}
    if memory_gib is not None:
        doc["device"] = {"memory_gib": float(memory_gib)}
    if cluster is not None:
        doc["cluster"] = dict(cluster)
    doc["curves"] = curves
    CurvesFile.parse(doc, origin="<profile>")  # what we write, the planner reads
    return doc


def uncovered(curves_file: CurvesFile, metaops: Sequence[MetaOp]) -> list[str]:
    """MetaOps of a plan that the curves file has no entry for (they get the analytic model)."""
    sigs = [s for s, _ in curves_file.by_signature]
    return [m.name for m in metaops if m.name not in curves_file.by_name and m.signature not in sigs]


def _g(v: float) -> str:
    return "0" if abs(v) < 1e-9 else f"{v:.3g}"


def summary_table(doc: Mapping) -> str:
    """One line per fitted curve: MetaOps, points (devices: ms), fit error, segments (x = batch / devices)."""
    rows = [("MetaOp", "batch", "tp", "points: devices=ms", "fit err", "segments (x=batch/devices ≥ start: α + β·x ms)")]
    for c in doc["curves"]:
        names = c["metaops"]
        label = names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")
        pts = " ".join(f"{n}={ms:.3g}" for n, ms in c["points"])
        segs = "; ".join(f"x≥{s['x_start']:g}: {s['alpha_ms']:.3g}+{_g(s['beta_ms'])}x"
                         for s in c["fit"]["segments"])
        rows.append((label, str(c["signature"]["batch"]), str(c["signature"]["tp"]), pts,
                     f"{c['fit_error']:.1%}", segs))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(width[i]) for i, v in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
