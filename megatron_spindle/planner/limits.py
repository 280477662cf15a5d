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

A model spec's sizes are bounded too (:data:`SPEC_LIMITS`, checked when the spec loads, naming the key):
the graph holds one operator per layer and task, so an unbounded ``num_layers`` (10^9 took minutes and
grew by 80 MB/s) is the planner's memory; widths, token counts and vocabularies enter every cost formula.
The caps are far above any model trained today (the largest dense models have ~128 layers of width
~16-25k, vocabularies of ~256k, contexts of ~1M tokens): :data:`MAX_LAYERS` = 512 layers per module,
:data:`MAX_OPERATORS` = 4096 operators in the graph (layers summed over every task's flow; the largest shipped
model has 432: 10-task Multitask-CLIP),
:data:`MAX_WIDTH` = 2^18 for hidden, FFN, projection and input widths and heads, :data:`MAX_TOKENS` = 2^22
tokens per sequence, :data:`MAX_VOCAB` = 2^24, :data:`MAX_TASKS` = 256 tasks and :data:`MAX_MODULES` = 1024
modules. A curves file's times are at most :data:`MAX_LAYER_MS` per layer, its device counts at most
:data:`MAX_DEVICES`. Names of tasks and modules are ASCII letters, digits, ``_`` and ``-`` (a module's
parts joined by ``.``), at most :data:`MAX_NAME` characters: they become slice names that parse back.

>>> divisors(12)
(1, 2, 3, 4, 6, 12)
"""
from __future__ import annotations

import functools

#: Largest cluster the planner accepts.
MAX_DEVICES = 8192
#: Largest global batch per task.
MAX_BATCH = 1 << 20
#: Largest number of layers of one module (a stack).
MAX_LAYERS = 512
#: Most operators (layers summed over every task's flow) in one graph. Measured on 2 busy cores with
#: 10-task Multitask-CLIP at 200 layers per encoder (4050 operators): 19 s to plan 64 devices, 65 s for 1024.
MAX_OPERATORS = 4096
#: Largest width (hidden, FFN, projection, input) and head count.
MAX_WIDTH = 1 << 18
#: Largest sequence length (tokens of one stream or module).
MAX_TOKENS = 1 << 22
#: Largest vocabulary.
MAX_VOCAB = 1 << 24
#: Most tasks and modules in one spec.
MAX_TASKS = 256
MAX_MODULES = 1024
#: Longest task or module name part.
MAX_NAME = 64
#: Longest forward + backward time of one layer a curves file may give, ms (about 17 minutes).
MAX_LAYER_MS = 1e6

#: The cap of each integer key of a model spec, and what it counts (named in the error).
SPEC_LIMITS = {
    "num_layers": (MAX_LAYERS, "layers per module"),
    "hidden_size": (MAX_WIDTH, "width"), "ffn_hidden_size": (MAX_WIDTH, "width"),
    "proj_dim": (MAX_WIDTH, "width"), "input_dim": (MAX_WIDTH, "width"),
    "num_attention_heads": (MAX_WIDTH, "heads"),
    "seq_length": (MAX_TOKENS, "tokens"), "pool_factor": (MAX_TOKENS, "tokens"),
    "vocab_size": (MAX_VOCAB, "vocabulary entries"),
    "tokens": (MAX_TOKENS, "tokens"), "batch": (MAX_BATCH, "samples"), "passes": (MAX_BATCH, "passes"),
}


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
