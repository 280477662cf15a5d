"""The runtime's own costs, as ``spindle profile`` measured them: host time the wave runtime spends beyond the
layers' compute and the link's transit, in the step simulator's terms. Pure Python.

A curves file from ``spindle profile`` with two or more processes carries them in ``measured.runtime``
(:mod:`megatron_spindle.profiler.runtime_costs` measures the runtime's own code paths with every profile process
at once and fits these forms); analytic curves have no such block, and without one the simulator charges none
of them (its behaviour before they were measured). The posts and deliveries are medians over repeats, the
per-slice costs medians over passes, the collectives and the norm means (why:
:mod:`megatron_spindle.profiler.runtime_costs`, :mod:`megatron_spindle.profiler.slice_costs`):

* **posting a boundary's batch** (the executor's ``Transfers.post``: one ``batch_isend_irecv`` and the
  executor's own bookkeeping): a rank that sends or receives ``k`` point-to-point messages and copies ``l``
  local ones at a posting point spends ``post_ms(k, l) = a + b·k + b_l·l`` of host time there before it runs
  its next slice (:mod:`.timeline`); copies alone ``a_l + b_l·l`` (``post_local``; older profiles: none);
* **delivery**: from the end of the post to the return of the last wait of the same batch (the receiving side
  woken included): ``delivery_ms(k) = a' + b'·k``. With the posts on the ranks' timelines a boundary's messages
  arrive after the later of their two ends has posted, ``delivery_ms(k)`` plus the boundary's link time less the
  link's latency (``t_boundary − λ``: the bytes over the bandwidth) later, ``k`` the most operations one rank
  posts in that batch. The link's exchange latency ``λ`` (:mod:`megatron_spindle.profiler.link`) holds a post
  and a delivery, timed in other repeats; the runtime's own measurement times both parts in the same ones;
* **a small collective** over all ranks (the gradient norm's and each task's loss all-reduce at the step's end,
  :mod:`megatron_spindle.megatron.trainer.prediction`): ``c + d·j`` for ``j`` all-reduces of a few bytes back to back;
  ``d`` is one collective's latency on this backend, ``c`` what the first one adds (the ranks meeting);
* **the gradient norm's host work** (the sum of squares over this rank's gradients before its all-reduce):
  ``e + f·tensors + g·elements/1e6``;
* **per slice** (``measured.runtime.slice``, :mod:`megatron_spindle.profiler.slice_costs`): what the executor
  spends on a slice beyond its layers' points: a fixed part (input assembly, entering its modules)
  ``per_slice_fwd_ms`` on each slice's forward and ``per_slice_bwd_ms`` on its backward, and a part that grows
  with the slice's layers (megatron.core DDP's hook per parameter, the layers run among the executor's other
  work rather than alone), a slice's points times ``per_slice_scale`` (:mod:`.timeline`). A curves file
  without it (older profiles, GPU profiles) charges none (scale 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class RuntimeCosts:
    """The fitted costs of ``measured.runtime`` (module docstring), milliseconds."""

    post_fixed_ms: float
    post_per_op_ms: float
    collective_first_ms: float
    """What the first of back-to-back small all-reduces adds."""
    collective_ms: float
    """One small all-reduce over all ranks."""
    delivery_fixed_ms: float = 0.0
    delivery_per_op_ms: float = 0.0
    norm_fixed_ms: float = 0.0
    norm_per_tensor_ms: float = 0.0
    norm_per_melement_ms: float = 0.0
    per_slice_fwd_ms: float = 0.0
    """The executor's own time on a slice's forward beyond its layers."""
    per_slice_bwd_ms: float = 0.0
    """The same on a slice's backward."""
    per_slice_scale: float = 1.0
    """A slice's layers in the executor over their points timed alone (at least 1)."""
    post_local_fixed_ms: float = 0.0
    """Host time of a posting point whose batch holds local copies alone."""
    post_local_per_op_ms: float = 0.0
    """Host time of each local copy at a posting point."""

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"runtime cost {k}={v!r} must be a non-negative number (a measured time)")
        if not self.per_slice_scale >= 1:
            raise ValueError(f"runtime cost per_slice_scale={self.per_slice_scale!r} must be at least 1 (the "
                             f"executor's layers over the same layers timed alone)")

    def post_ms(self, ops: int, local: int = 0) -> float:
        """Host time of posting a batch of ``ops`` point-to-point operations and ``local`` local copies (0 when
        there are none): a batch with operations pays their fixed cost, one of copies alone the copies'."""
        if ops > 0:
            return self.post_fixed_ms + self.post_per_op_ms * ops + self.post_local_per_op_ms * local
        return self.post_local_fixed_ms + self.post_local_per_op_ms * local if local > 0 else 0.0

    def transit_ms(self, boundary_ms: float, latency_ms: float, ops: int) -> float:
        """From the later post to the arrival of a boundary's messages (module docstring): its link time
        (:func:`.link_costs.boundary_time_ms`) less the link's latency ``latency_ms`` it holds, plus the measured
        delivery of ``ops`` operations (the most one rank posts in the batch); 0 for a batch with nothing to move."""
        if boundary_ms <= 0:
            return 0.0
        return max(0.0, boundary_ms - latency_ms) + self.delivery_fixed_ms + self.delivery_per_op_ms * ops

    def collectives_ms(self, count: int) -> float:
        """``count`` small all-reduces back to back."""
        return self.collective_first_ms + self.collective_ms * count if count > 0 else 0.0

    def norm_ms(self, *, tensors: int, elements: int) -> float:
        """Host work of the gradient norm over ``tensors`` tensors of ``elements`` elements in all."""
        return self.norm_fixed_ms + self.norm_per_tensor_ms * tensors + self.norm_per_melement_ms * elements / 1e6

    @classmethod
    def from_measured(cls, block: Mapping | None) -> "RuntimeCosts | None":
        """From a curves file's ``measured.runtime`` (:func:`megatron_spindle.profiler.runtime_costs.fit_runtime`),
        or ``None`` when there is none."""
        if not block:
            return None
        try:
            post, coll, dl = block["post"], block["collective"], block["delivery"]
            local = block.get("post_local") or {}
            norm = block.get("grad_norm") or {}
            sl = block.get("slice") or {}
            return cls(post_fixed_ms=float(post["fixed_ms"]), post_per_op_ms=float(post["per_op_ms"]),
                       delivery_fixed_ms=float(dl["fixed_ms"]), delivery_per_op_ms=float(dl["per_op_ms"]),
                       collective_first_ms=float(coll["first_ms"]), collective_ms=float(coll["per_collective_ms"]),
                       norm_fixed_ms=float(norm.get("fixed_ms", 0.0)),
                       norm_per_tensor_ms=float(norm.get("per_tensor_ms", 0.0)),
                       norm_per_melement_ms=float(norm.get("per_melement_ms", 0.0)),
                       per_slice_fwd_ms=float(sl.get("fwd_ms", 0.0)), per_slice_bwd_ms=float(sl.get("bwd_ms", 0.0)),
                       per_slice_scale=float(sl.get("scale", 1.0)),
                       post_local_fixed_ms=float(local.get("fixed_ms", 0.0)),
                       post_local_per_op_ms=float(local.get("per_op_ms", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"curves file: measured.runtime is malformed ({e}); run `spindle profile` again") from e
