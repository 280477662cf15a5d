"""A cheap look at an energon dataset's shards before the first step (pure Python, no torch).

``energon prepare`` records every shard of a dataset in ``.nv-meta/.info.json`` (``shard_counts``: samples per
tar file) and writes beside each shard a ``.tar.idx`` index: little-endian uint64 byte offsets, one per
sample and one past the last. A shard that was truncated, replaced or deleted after preparing is found here
from sizes alone (no tar is read), named with the one line a user can act on; otherwise it would surface
steps later as a ``tarfile.ReadError`` traceback from inside the loader.
"""
from __future__ import annotations

import json
import os
import struct


def check_dataset_shards(root: str, task: str, batch: int | None = None) -> None:
    """Raise one ``ValueError`` line naming the first shard of ``root/task`` that is missing, unreadable or
    shorter than its index says, or (with ``batch``, the samples of the task in one pass) a dataset too
    small to fill one batch without repeating samples (a repeat in a contrastive batch is a false negative);
    datasets without ``.info.json`` (older energon) are left to the loader."""
    d = os.path.join(root, task)
    info = os.path.join(d, ".nv-meta", ".info.json")
    if not os.path.isfile(info):
        return
    try:
        with open(info, encoding="utf-8") as fh:
            counts = json.load(fh).get("shard_counts", {})
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"--spindle-data {root}: {info} is unreadable ({type(e).__name__}); prepare the dataset "
                         f"of task {task!r} again (`energon prepare {d}`)") from None
    total = sum(int(v) for v in counts.values() if isinstance(v, int))
    if batch is not None and total < batch:
        raise ValueError(f"--spindle-data {root}: task {task!r} has {total} samples, one pass takes {batch} "
                         f"(--micro-batch-size x ranks): every batch would repeat samples (false negatives in a "
                         f"contrastive loss); give the task at least {batch} samples or a smaller --micro-batch-size")
    for name, samples in sorted(counts.items()):
        shard = os.path.join(d, name)
        if not os.path.isfile(shard):
            raise ValueError(f"--spindle-data {root}: shard {shard} of task {task!r} is missing (the dataset's "
                             f".nv-meta/.info.json lists it); restore it or run `energon prepare {d}` again")
        end = _indexed_end(shard + ".idx", samples)
        size = os.path.getsize(shard)
        if end is not None and size < end:
            raise ValueError(f"--spindle-data {root}: shard {shard} of task {task!r} is {size} bytes, but its "
                             f"{samples} samples end at byte {end} (its .tar.idx): truncated after `energon "
                             f"prepare`; restore it or prepare the dataset again")


def _indexed_end(idx: str, samples: int) -> int | None:
    """The byte where a shard's last sample ends, by its ``.tar.idx`` (``None`` without a usable index)."""
    try:
        size = os.path.getsize(idx)
        if size < 8 or size % 8:
            return None
        with open(idx, "rb") as fh:
            fh.seek(size - 8)
            (end,) = struct.unpack("<Q", fh.read(8))
    except OSError:
        return None
    return end if size // 8 == samples + 1 else None
