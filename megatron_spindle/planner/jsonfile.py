"""Reading a JSON input file with one clear error naming the file when it cannot be used.

Missing, a directory or another non-regular file, unreadable (permissions), not UTF-8 text, or not valid
JSON: each is a ``ValueError`` whose one line names the file and the cause.
"""
from __future__ import annotations

import json
import os


def read_json(path: str, what: str):
    """The parsed content of ``path``; ``what`` names the file in errors (``"plan file"``...)."""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory, not a JSON file")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{what} {path!r} does not exist") from None
    except PermissionError:
        raise ValueError(f"{what} {path!r} cannot be read (permission denied)") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {e.start}): not a JSON file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror or type(e).__name__}") from None
