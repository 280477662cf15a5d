"""The placement search's memory state (:mod:`.placement`): what each device holds and stashes, kept ready for
the candidates' numpy ranking."""
from __future__ import annotations

import numpy as np


class PlacementState:
    """The search's memory state: per device its stashed activations per phase and the weight shards it
    holds, with what every candidate reads of them kept ready: per device ``Σ`` held bytes and its largest
    phase's activations (recomputed from the dicts, in their order, after a device changes, so every value is
    the same float as summing the dicts on the spot), and which ``(weight, shard)`` it holds (a boolean
    matrix, so a slice's candidates rank all free devices at once in numpy: elementwise additions and maxima
    only, the same IEEE operations as Python's)."""

    def __init__(self, N: int, cols: dict[tuple[str, int], int]) -> None:
        self.mem_act: list[dict[int, float]] = [{} for _ in range(N)]  # device -> {phase: activation bytes}
        self.held: list[dict[tuple[str, int], float]] = [{} for _ in range(N)]  # device -> {(key, shard): bytes}
        self.placed: dict[tuple[int, int], tuple[int, ...]] = {}  # (wave, slot) -> ranks
        self.cols = cols
        self.has = np.zeros((N, len(cols)), dtype=bool)
        self._h: list[float] = [0.0] * N
        self._a: list[float] = [0.0] * N
        self._dirty: set[int] = set()
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._phase_act: dict[int, np.ndarray] = {}  # phase -> mem_act[d].get(phase, 0.0) of every device

    def add_act(self, d: int, phase: int, b: float) -> None:
        """``b`` more (or, negative, less) stashed on ``d`` in ``phase``: the same float as in the dict."""
        self.touch(d)
        v = self.mem_act[d][phase] = self.mem_act[d].get(phase, 0.0) + b
        self.phase_act(phase)[d] = v

    def phase_act(self, phase: int) -> np.ndarray:
        got = self._phase_act.get(phase)
        if got is None:
            got = self._phase_act[phase] = np.array([a.get(phase, 0.0) for a in self.mem_act], dtype=float)
        return got

    def touch(self, d: int) -> None:
        """``d``'s activations or states are about to change."""
        self._dirty.add(d)
        self._arrays = None

    def hold(self, d: int, key: tuple[str, int], b: float) -> None:
        self.held[d][key] = b
        self.has[d, self.cols[key]] = True

    def drop(self, d: int, key: tuple[str, int]) -> None:
        del self.held[d][key]
        self.has[d, self.cols[key]] = False

    def _refresh(self) -> None:
        for d in self._dirty:
            self._h[d] = sum(self.held[d].values())
            self._a[d] = max(self.mem_act[d].values(), default=0.0)
        self._dirty.clear()

    def sums(self, d: int) -> tuple[float, float]:
        """``(Σ held bytes, largest phase's activations)`` of device ``d``."""
        if self._dirty:
            self._refresh()
        return self._h[d], self._a[d]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`sums` of every device, as two arrays."""
        if self._dirty:
            self._refresh()
        if self._arrays is None:
            self._arrays = (np.array(self._h, dtype=float), np.array(self._a, dtype=float))
        return self._arrays

    def mem(self, d: int) -> float:
        h, a = self.sums(d)
        return a + h
