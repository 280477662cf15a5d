"""Input limits of the planner, and divisors by factorization.

Planning time grows with the device count (placement and the simulator walk every device of every wave)
and with the number of valid device counts of a MetaOp (the divisors of its global batch). Both are bounded
here so that any input is planned in bounded time and memory, or refused with one line naming the value:

* :data:`MAX_DEVICES` devices: 1024 nodes of 8, 128 times the paper's largest cluster. ``spindle plan``
  takes about 5 s of CPU at 4096 devices and 9 s at the limit (13 s with a batch of 720720, 240 divisors).
* :data:`MAX_BATCH` samples of global batch per task and step. Valid counts are divisors of the batch; a
  number below 2^20 has at most 240 divisors, so the allocator and the scheduler see at most that many counts
  per MetaOp.

Divisors come from the prime factorization (trial division up to ``√b``: at most 1024 steps at the limit),
never from testing every number up to ``b``.

>>> divisors(12)
(1, 2, 3, 4, 6, 12)
"""
from __future__ import annotations

import functools

#: Largest cluster the planner accepts.
MAX_DEVICES = 8192
#: Largest global batch per task.
MAX_BATCH = 1 << 20


def check_devices(num_devices: int) -> None:
    """Raise ``ValueError`` naming ``num_devices`` unless ``1 ≤ num_devices ≤ MAX_DEVICES``."""
    if not 1 <= num_devices <= MAX_DEVICES:
        raise ValueError(f"{num_devices} devices is outside what the planner accepts (1 to {MAX_DEVICES})")


def check_batch(batch: int, what: str = "global batch") -> None:
    """Raise ``ValueError`` naming ``batch`` unless ``1 ≤ batch ≤ MAX_BATCH``."""
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"{what} {batch} is outside what the planner accepts (1 to {MAX_BATCH})")


def factorize(n: int) -> tuple[tuple[int, int], ...]:
    """Prime factorization of ``n ≥ 1`` as ``((prime, exponent), ...)``, primes ascending."""
    if n < 1:
        raise ValueError(f"cannot factorize {n}: need a positive integer")
    out = []
    p = 2
    while p * p <= n:
        if n % p == 0:
            e = 0
            while n % p == 0:
                n //= p
                e += 1
            out.append((p, e))
        p += 1 if p == 2 else 2
    if n > 1:
        out.append((n, 1))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """All divisors of ``n ≥ 1``, ascending, built from :func:`factorize`."""
    divs = [1]
    for p, e in factorize(n):
        divs = [d * p ** k for d in divs for k in range(e + 1)]
    return tuple(sorted(divs))


def check_inputs(batches, num_devices: int) -> None:
    """Check a cluster size and every task's global batch (``batches``: iterable of ``(task, batch)``)."""
    check_devices(num_devices)
    for task, b in batches:
        check_batch(b, f"global batch of task {task!r}")
