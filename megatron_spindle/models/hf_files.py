"""A cheap look at a Hugging Face directory's weight files before anything loads them (pure Python).

A ``.safetensors`` file starts with an 8-byte little-endian header length and a JSON header giving every
tensor's ``data_offsets`` in the data that follows, so a truncated download is found from the file size
alone; ``model.safetensors.index.json`` names the shard of every tensor, so a deleted shard is found from a
listing. Each problem is one ``ValueError`` line naming the file, instead of a safetensors or
``FileNotFoundError`` traceback from the first rank that reads it.
"""
from __future__ import annotations

import json
import os
import struct

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20
"""safetensors' own limit on the JSON header (100 MB)."""


def check_weight_files(path: str) -> None:
    """Refuse ``path`` (a model directory) when its index names a missing shard or a ``.safetensors`` file is
    truncated or has no readable header. A directory without weight files is left to the loader's message."""
    if not os.path.isdir(path):
        return
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                names = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is unreadable ({type(e).__name__}: no weight_map); download the model "
                             f"again") from None
        for name in names:
            if not os.path.isfile(os.path.join(path, name)):
                raise ValueError(f"{index} names the shard {name}, which is not in {path}; download the model "
                                 f"again (or restore {name})")
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    for name in names:
        check_safetensors(os.path.join(path, name))


def check_safetensors(fn: str) -> None:
    """One ``.safetensors`` file: a header that parses, tensors that end within the file."""
    size = os.path.getsize(fn)
    try:
        with open(fn, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 0 or n > MAX_HEADER or 8 + n > size:
                raise ValueError("short")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ValueError(f"{fn} is damaged or truncated ({size} bytes, no complete safetensors header); "
                         f"download it again") from None
    if 8 + n + end > size:
        raise ValueError(f"{fn} is truncated: {size} bytes, its header says its tensors end at byte {8 + n + end}; "
                         f"download it again")
