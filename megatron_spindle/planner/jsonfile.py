"""Reading a JSON input file with one clear error naming the file when it is missing or malformed."""
from __future__ import annotations

import json


def read_json(path: str, what: str):
    """The parsed content of ``path``; ``what`` names the file in errors (``"plan file"``...)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{what} {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None
