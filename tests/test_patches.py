"""The Megatron-LM patches in ``patches/`` name modules that exist: every ``megatron_spindle`` import a patch adds
runs here (a module that moves must take the patches with it). Whether each patch applies to its tag is checked
with ``git apply --check`` on that tag's tree (``patches/README.md``)."""
from __future__ import annotations

import importlib
import pathlib
import re

import pytest

PATCHES = sorted((pathlib.Path(__file__).resolve().parent.parent / "patches").glob("*.patch"))
ADDED = re.compile(r"^\+\s*(from (megatron_spindle[\w.]*) import ([\w, ]+?)(?:\s+as \w+)?|import (megatron_spindle[\w.]*))\s*(#.*)?$")


def added_imports(patch: pathlib.Path) -> list[tuple[str, list[str]]]:
    out = []
    for line in patch.read_text().splitlines():
        m = ADDED.match(line)
        if m:
            module = m.group(2) or m.group(4)
            names = [n.strip() for n in (m.group(3) or "").split(",") if n.strip()]
            out.append((module, names))
    return out


def test_every_patch_adds_at_least_one_import_of_ours():
    assert PATCHES and all(added_imports(p) for p in PATCHES), [p.name for p in PATCHES if not added_imports(p)]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_the_modules_a_patch_imports_exist(patch):
    for module, names in added_imports(patch):
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), f"{patch.name}: {module}.{name}"
