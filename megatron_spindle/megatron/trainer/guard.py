"""The numeric guard: a step whose loss or gradient norm is not finite never reaches the optimizer.

After forward, backward and the gradient sync, and before ``optimizer.step()``, :meth:`NumericGuard.check`
looks at the step's task losses and its global gradient norm. Both are the same on every rank (the losses
are all-reduced by the schedule, the norm by ``clip_grads``), so every rank takes the same decision without
another collective. If either is NaN or infinite:

* the step is skipped (gradients dropped, parameters and optimizer state untouched) while fewer than
  ``--spindle-nonfinite-skips`` steps have been skipped in this run (default 0), with one line on rank 0;
* otherwise training stops with :class:`NonFiniteError`, one line that names the iteration, the tasks whose
  loss is not finite, and the MetaOp whose gradient went non-finite first. Nothing is saved: the last
  checkpoint on disk is the last finite state.

"First" is backward order: backward runs the MetaOps from the last level to the first, so among the MetaOps
whose parameter gradients hold a NaN or an infinity, the one at the highest level was reached first (the
others usually inherit its NaN through the chain). Finding it is a collective (each rank holds the
gradients of its own slices), paid only on a non-finite step.
"""
from __future__ import annotations

import math

import torch

from ... import comm
from ...log import get_logger

log = get_logger(__name__)


class NonFiniteError(ValueError):
    """Training stopped on a non-finite loss or gradient norm; the message names iteration, task and MetaOp."""


def _finite(x: float) -> bool:
    return math.isfinite(x)


def nonfinite_param_keys(model) -> list[str]:
    """Parameter keys whose gradient on this rank holds a NaN or an infinity."""
    bad = []
    for key, _shard, mod in model.local_cores():
        for p in mod.core.parameters():
            g = getattr(p, "main_grad", None)  # the reduced gradient (fp32 buffers leave a bf16 .grad unset)
            g = p.grad if g is None else g
            if g is not None and not bool(torch.isfinite(g).all()):
                bad.append(key)
                break
    return sorted(set(bad))


def first_nonfinite_metaop(plan, keys) -> tuple[str, str] | None:
    """(MetaOp, task) reached first in backward among the MetaOps that use one of ``keys``; ``None`` if none."""
    users = [m for m in plan.metaops if any(k in keys for k in m.param_keys)]
    if not users:
        return None
    order = {m.name: i for i, m in enumerate(plan.metaops)}
    m = max(users, key=lambda m: (m.level, order[m.name]))
    return m.name, m.task


class NumericGuard:
    """Decides, once per step on every rank alike, whether the optimizer may step (see module docstring)."""

    def __init__(self, max_skips: int = 0) -> None:
        if max_skips < 0:
            raise ValueError(f"--spindle-nonfinite-skips {max_skips} must not be negative")
        self.max_skips = max_skips
        self.skipped: list[int] = []

    def check(self, iteration: int, losses: dict[str, float], grad_norm: float, model) -> bool:
        """``True``: step the optimizer. ``False``: skip this step (gradients are zeroed here).
        Raises :class:`NonFiniteError` when the skips are used up."""
        if all(_finite(v) for v in losses.values()) and _finite(grad_norm):
            return True
        bad_tasks = [t for t, v in losses.items() if not _finite(v)]
        keys = sorted({k for ks in comm.all_gather_object(nonfinite_param_keys(model)) for k in ks})
        first = first_nonfinite_metaop(model.plan, keys)
        where = (f"first non-finite gradient (backward order) in MetaOp {first[0]} of task {first[1]}"
                 if first else "no parameter gradient is non-finite")
        what = (f"iteration {iteration + 1}: non-finite "
                + (f"loss in task {', '.join(bad_tasks)} ({', '.join(str(losses[t]) for t in bad_tasks)}), "
                   if bad_tasks else "")
                + f"gradient norm {grad_norm}; {where}")
        if len(self.skipped) < self.max_skips:
            self.skipped.append(iteration + 1)
            for p in model.unique_parameters():
                p.grad = None
            log.warning(f"{what}; step skipped ({len(self.skipped)} of --spindle-nonfinite-skips {self.max_skips})")
            return False
        raise NonFiniteError(f"{what}; stopped before the optimizer step, nothing saved (the last checkpoint "
                             f"holds the last finite state; lower --lr, or allow skips with "
                             f"--spindle-nonfinite-skips N)")
