"""Device shares of MetaOps run one after another, at each MetaOp's best split: the pieces the baselines
(:mod:`.baselines`), the static grids (:mod:`.static_grids`) and module blocks (:mod:`.module_blocks`) share."""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Mapping, Sequence

from ..workload.curves import ScalingCurve
from ..workload.metaops import MetaOp

#: Largest number of share combinations tried exhaustively for the branches of one task (intra-task).
MAX_COMBINATIONS = 20000


def best_count(m: MetaOp, curve: ScalingCurve, limit: int, num_devices: int) -> int | None:
    """The valid count ``≤ limit`` with the shortest time (ties: the largest); ``None`` if none fits."""
    key = ("_best_prefix", num_devices, m.tp, m.batch, m.batch_splittable)
    table = curve.__dict__.get(key)
    if table is None:  # per valid count c: the answer for limit = c (computed once per curve and cluster)
        counts = m.valid_counts(num_devices)
        best, table = None, ([], [])
        for n in counts:
            if best is None or curve.time(n) <= curve.time(best) * (1 + 1e-12):
                best = n
            table[0].append(n)
            table[1].append(best)
        curve.__dict__[key] = table
    i = bisect.bisect_right(table[0], limit)
    return table[1][i - 1] if i else None


def metaop_time(m: MetaOp, curve: ScalingCurve, n: int) -> float:
    """All layers of ``m`` on ``n`` devices."""
    return m.num_layers * curve.time(n)


def group_time(ms: Sequence[MetaOp], curves: Mapping[str, ScalingCurve], share: int, num_devices: int) -> float:
    """MetaOps run one after another on ``share`` devices, each at its best split (``inf`` if one cannot run)."""
    total = 0.0
    for m in ms:
        n = best_count(m, curves[m.name], share, num_devices)
        if n is None:
            return math.inf
        total += metaop_time(m, curves[m.name], n)
    return total


def share_steps(ms: Sequence[MetaOp], num_devices: int) -> list[int]:
    """The shares at which :func:`group_time` of ``ms`` can change: every valid count of its MetaOps (between
    two of them each MetaOp keeps its best count, so the time stays), ascending."""
    return sorted({c for m in ms for c in m.valid_counts(num_devices)})


def min_share(ms: Sequence[MetaOp], num_devices: int) -> int:
    """Smallest device share on which every MetaOp of ``ms`` can run."""
    return max(min(m.valid_counts(num_devices)) for m in ms)


def task_metaops(metaops: Sequence[MetaOp], task: str) -> list[MetaOp]:
    """The task's MetaOps in level order (stable)."""
    return sorted((m for m in metaops if m.task == task), key=lambda m: m.level)


def marginal_gain_shares(groups: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve],
                         num_devices: int) -> list[int]:
    """Optimus's greedy: device shares per group (a group's MetaOps run one after another on its share)."""
    N, shares = num_devices, [min_share(g, num_devices) for g in groups]
    if sum(shares) > N:
        raise ValueError(f"the groups need at least {sum(shares)} devices together, the cluster has {N}")
    memo: dict[tuple[int, int], float] = {}  # a group's time on a share, computed once
    T = [lambda n, i=i, g=g: memo[(i, n)] if (i, n) in memo else memo.setdefault((i, n), group_time(g, curves, n, N))
         for i, g in enumerate(groups)]
    steps = [share_steps(g, N) for g in groups]
    while True:
        free = N - sum(shares)
        best = None
        for i, g in enumerate(groups):
            now = T[i](shares[i])
            # the first larger share that is faster is a step of the group (:func:`share_steps`)
            s = steps[i]
            for n2 in s[bisect.bisect_right(s, shares[i]):bisect.bisect_right(s, shares[i] + free)]:
                t2 = T[i](n2)
                if t2 < now * (1 - 1e-12):
                    gain = (now - t2) / (n2 - shares[i])
                    if best is None or gain > best[0]:
                        best = (gain, i, n2)
                    break
        if best is None:
            return shares
        shares[best[1]] = best[2]


def finish_together_shares(groups: Sequence[Sequence[MetaOp]], curves: Mapping[str, ScalingCurve],
                           num_devices: int) -> list[int]:
    """Shares (summing to at most ``N``) that minimize the slowest group, then use the fewest devices."""
    N = num_devices
    options = []
    for g in groups:
        lo = min_share(g, N)
        opts, last = [], math.inf
        # only shares at which the group gets faster: ``lo`` and the larger steps (:func:`share_steps`)
        for n in [lo] + [c for c in share_steps(g, N) if lo < c <= N]:
            t = group_time(g, curves, n, N)
            if t < last * (1 - 1e-12):
                opts.append((n, t))
                last = t
        options.append(opts)
    if math.prod(len(o) for o in options) <= MAX_COMBINATIONS:
        best = None
        for combo in itertools.product(*options):
            used = sum(n for n, _ in combo)
            if used > N:
                continue
            key = (max(t for _, t in combo), used)
            if best is None or key < best[0]:
                best = (key, [n for n, _ in combo])
        if best is None:
            raise ValueError(f"the branches need more than the cluster's {N} devices together")
        return best[1]
    # many branches: start small, upgrade the slowest while devices remain (min-max greedy)
    pick = [0] * len(groups)
    while True:
        used = sum(options[i][pick[i]][0] for i in range(len(groups)))
        slow = max(range(len(groups)), key=lambda i: options[i][pick[i]][1])
        if pick[slow] + 1 >= len(options[slow]):
            break
        extra = options[slow][pick[slow] + 1][0] - options[slow][pick[slow]][0]
        if used + extra > N:
            break
        pick[slow] += 1
    return [options[i][pick[i]][0] for i in range(len(groups))]
