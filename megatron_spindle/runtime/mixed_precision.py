"""fp32 master weights for a model held in bf16: what Megatron's mixed-precision optimizer does, for the
built-in loop (under ``megatron.training`` Megatron's own ``Float16OptimizerWithFloat16Params`` does it).

The model's parameters stay in bf16 (compute and communication); the optimizer owns an fp32 copy of each
and steps those from the fp32 gradient (:func:`fp32_grad`: ``main_grad``, megatron DDP's reduced buffer that
:meth:`SpindleModel.finalize_grads` leaves, in bf16 or fp32, the fp32 one read as is), then writes the
rounded result back into the bf16 parameter. fp32 parameters are stepped in place, so for an fp32 model this
is the inner optimizer unchanged.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import Tensor, nn


def fp32_grad(p: nn.Parameter) -> Tensor | None:
    """The reduced gradient of ``p`` in fp32, for its fp32 master: its ``main_grad`` (megatron DDP's buffer, or
    a distributed-optimizer block's, :mod:`.grad_sync`) when one is kept, itself when it is fp32 (no copy),
    else ``.grad``; None when ``p`` has no gradient."""
    main = getattr(p, "main_grad", None)
    g = main if main is not None else p.grad
    if g is None:
        return None
    return g if g.dtype == torch.float32 else g.float()


class MasterWeightsOptimizer:
    """An optimizer over fp32 masters of ``params``; ``make_inner(masters)`` builds the real one (AdamW).

    ``param_groups`` are the inner optimizer's (so learning-rate schedulers work on this object).
    """

    def __init__(self, params: Iterable[nn.Parameter], make_inner: Callable[[list], torch.optim.Optimizer]):
        self.params = list(params)
        self.masters = [p if p.dtype == torch.float32 else
                        nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.inner = make_inner(self.masters)
        self._index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def param_state(self, p: nn.Parameter) -> dict:
        """What this optimizer keeps for model parameter ``p``: the inner optimizer's state of its master, and
        the master itself (``"master"``, fp32) when ``p`` is not fp32 (what a task-mix change carries over,
        :mod:`.replan`)."""
        m = self.masters[self._index[id(p)]]
        st = dict(self.inner.state.get(m, {}))
        if m is not p:
            st["master"] = m
        return st

    def load_param_state(self, p: nn.Parameter, st: dict) -> None:
        """Take over ``st`` (from :meth:`param_state` of another instance) for ``p``."""
        m = self.masters[self._index[id(p)]]
        st = dict(st)
        master = st.pop("master", None)
        if master is not None and m is not p:
            with torch.no_grad():
                m.copy_(master)
        if st:
            self.inner.state[m] = st

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = fp32_grad(p)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            if m is not p:
                m.grad = None
