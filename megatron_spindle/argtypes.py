"""argparse value types shared by the ``spindle`` subcommands: bad values name themselves."""
from __future__ import annotations

import argparse


def _int(text: str, minimum: int, what: str = "") -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{what}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"{v} must be positive" if minimum == 1 else f"{v} must not be negative")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def positive_int_list(text: str) -> list[int]:
    """``8,16,32`` -> ``[8, 16, 32]``."""
    return [_int(part, 1, " (want e.g. 8,16,32)") for part in text.split(",")]
