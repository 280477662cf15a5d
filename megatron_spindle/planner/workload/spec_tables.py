"""The structure of a model spec's tables: nested module tables flattened to dotted names, size overrides
matched to modules, ``init`` tables resolved (:mod:`.spec` parses the rest)."""
from __future__ import annotations

import os
from typing import Any

from .spec_layers import NO_VALUE, SpecError, check_value


def as_table(file: str, key: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise SpecError(file, key, v, "must be a table")
    return v


def init_table(file: str, key: str, v: Any, modules: dict) -> dict[str, str]:
    """``init = { vision = "hf/clip" }``: module or component names -> model directories, relative paths taken
    from the spec's folder. The directories are read when a run starts (planning does not need them)."""
    out = {}
    for name, path in as_table(file, key, v).items():
        if not any(m == name or m.startswith(name + ".") for m in modules):
            raise SpecError(file, f"{key}.{name}", path, f"no module {name!r}; modules: {', '.join(modules)}")
        if not isinstance(path, str) or not path:
            raise SpecError(file, f"{key}.{name}", path, "must be the path of a Hugging Face model directory")
        out[name] = path if os.path.isabs(path) else os.path.normpath(
            os.path.join(os.path.dirname(os.path.abspath(file)), path))
    return out


def flatten_modules(file: str, tree: dict, prefix: str = "modules") -> dict[str, dict]:
    """``[modules.vision.layers]`` -> ``{"vision.layers": {...}}``: a table with a ``type`` (or ``share``)
    is a module, any other table groups modules."""
    out = {}
    for k, v in as_table(file, prefix, tree).items():
        path = f"{prefix}.{k}"
        v = as_table(file, path, v)
        if "type" in v or "share" in v:
            out[path[len("modules."):]] = v
        else:
            if not v:
                raise SpecError(file, path, v, "an empty table: a module needs a type")
            out.update(flatten_modules(file, v, path))
    return out


def flatten_overrides(file: str, key: str, tree: dict, modules: dict[str, dict]) -> dict[str, dict]:
    """``[sizes.tiny.modules.vision.layers] hidden_size = 48`` -> ``{"vision.layers": {...}}``."""
    out: dict[str, dict] = {}

    def walk(node: dict, path: list[str]) -> None:
        here = ".".join(path)
        if here in modules:
            for k, v in node.items():
                if isinstance(v, dict):
                    raise SpecError(file, f"{key}.{here}.{k}", NO_VALUE, f"module {here!r} has no sub-modules")
                if k in ("type", "share"):
                    raise SpecError(file, f"{key}.{here}.{k}", v, "a size cannot change a module's type or sharing")
                check_value(file, f"{key}.{here}.{k}", k, v)
            out[here] = dict(node)
            return
        for k, v in node.items():
            if not isinstance(v, dict):
                raise SpecError(file, f"{key}.{here + '.' if here else ''}{k}", v,
                                f"{here or k!r} is not a module; modules: {', '.join(modules)}")
            walk(v, path + [k])

    walk(as_table(file, key, tree), [])
    return out
