"""The layer rules, read from the source (every import counts, at module level or inside a function).

* the planner imports neither torch nor megatron (also proven by importing it with both blocked, in
  ``test_planner_core.py``);
* models never import the runtime (nor the Megatron layer), nor ``hf`` (the ``spindle hf`` commands sit above
  models: the checkpoint's name mapping lives in ``models/hf_mapping.py``, beside the loader that uses it);
* only ``megatron/adapter/hooks.py`` imports ``megatron.training`` (besides the compatibility modules that stand in for
  its CUDA-only start-up and bridge its versions, ``compat/megatron_lm.py`` and ``compat/mcore.py``);
* no import cycle between modules of ``megatron_spindle``; no module imports another's private (``_``) name;
* the planner's stages import only themselves and earlier stages; no planner folder holds over 15 modules;
* an import inside a function is for an optional dependency only, and says so on its line
  (``# optional: ...``): TransformerEngine, matplotlib, ``megatron.training``, the solver, or torch for a
  command that must also run without it.
"""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_spindle"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path):
    """``(imported module, line, inside a function, source line)`` for every import in ``path``."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    in_func: set[int] = set()
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(sub) for sub in ast.walk(node))  # annotations only, never imported at run time
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    in_func.add(id(sub))
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import submodule` imports the submodule
            names = [f"{mod}.{a.name}" if (PKG.parent / f"{mod}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                     or (PKG.parent / f"{mod}.{a.name}".replace(".", "/")).is_dir() else mod for a in node.names]
        else:
            continue
        for n in dict.fromkeys(names):
            out.append((n, node.lineno, id(node) in in_func, lines[node.lineno - 1]))
    return out


def _all():
    return {p: _imports(p) for p in sorted(PKG.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_planner_imports_no_torch_and_no_megatron():
    bad = [f"{p.relative_to(PKG)}:{line} {m}" for p, imps in _all().items() if _under(_module_name(p), "megatron_spindle.planner")
           for m, line, _, _ in imps if _under(m, "torch") or _under(m, "megatron")]
    assert not bad, bad


def test_models_import_neither_the_runtime_nor_the_megatron_layer_nor_hf():
    bad = [f"{p.relative_to(PKG)}:{line} {m}" for p, imps in _all().items() if _under(_module_name(p), "megatron_spindle.models")
           for m, line, _, _ in imps
           if any(_under(m, f"megatron_spindle.{layer}") for layer in ("runtime", "megatron", "hf"))]
    assert not bad, bad


def test_only_the_hooks_import_megatron_training():
    bad = [f"{p.relative_to(PKG)}:{line} {m}" for p, imps in _all().items()
           if _module_name(p) not in ("megatron_spindle.megatron.adapter.hooks", "megatron_spindle.compat.megatron_lm",
                                      "megatron_spindle.compat.mcore")
           for m, line, _, _ in imps if _under(m, "megatron.training")]
    assert not bad, bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_the_package_counting_function_level_imports():
    edges: dict[str, set[str]] = {}
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    for p, imps in _all().items():
        me = _module_name(p)
        for m, _, _, _ in imps:
            # importing a.b.c runs a/__init__ and a/b/__init__ too; count the module itself
            while m and m not in modules and "." in m:
                m = m.rsplit(".", 1)[0]
            if m in modules and m != me and _under(m, "megatron_spindle") and not me.startswith(m + "."):
                edges.setdefault(me, set()).add(m)
    assert not _cycles(edges), _cycles(edges)


def test_function_level_imports_are_optional_dependencies_and_say_so():
    bad = [f"{p.relative_to(PKG)}:{line}: {src.strip()}" for p, imps in _all().items()
           for m, line, inside, src in imps if inside and "# optional" not in src]
    assert not bad, "imports inside functions without '# optional: why':\n" + "\n".join(bad)


#: The planner's stages in pipeline order: a stage imports only itself and earlier stages (and the planner's
#: shared modules ``exact``, ``limits``, ``jsonfile``), so its folders read as the pipeline: the workload, one
#: level's schedule, the plan's assembly, the simulator that times a plan, the baselines' schedules, the
#: whole-step choice that weighs them all, and the tuners that set every system to its best configuration.
STAGES = ("megatron_spindle.planner.workload", "megatron_spindle.planner.level", "megatron_spindle.planner.assembly",
          "megatron_spindle.planner.simulation", "megatron_spindle.planner.systems", "megatron_spindle.planner.step",
          "megatron_spindle.planner.tuning")


def _stage(module: str) -> int | None:
    return next((i for i, folder in enumerate(STAGES) if _under(module, folder)), None)


def test_planner_stages_import_only_earlier_stages():
    assert {p.name for p in (PKG / "planner").iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == {f.rsplit(".", 1)[1] for f in STAGES}, "a planner folder outside STAGES"
    bad = []
    for p, imps in _all().items():
        me = _module_name(p)
        mine = _stage(me)
        if mine is None:
            continue
        for m, line, _, _ in imps:
            theirs = _stage(m)
            if theirs is not None and theirs > mine:
                bad.append(f"{p.relative_to(PKG)}:{line} imports the later stage {m}")
    assert not bad, "\n".join(bad)


def test_no_planner_folder_holds_more_than_15_modules():
    """A folder a reader takes in at once: the planner's folders split by concern."""
    big = {d.name: n for d in (PKG / "planner").iterdir() if d.is_dir()
           if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > 15}
    assert not big, big


def test_every_module_fits_in_a_head():
    """A few hundred lines per module, one idea each: none over 450."""
    long = [f"{p.relative_to(PKG)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, "\n".join(long)


def test_no_module_imports_another_modules_private_name():
    """A split file is a module boundary: what another module needs is public (no ``from .x import _name``;
    dunder names such as ``__version__`` are public)."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("megatron_spindle")):
                bad += [f"{p.relative_to(PKG)}:{node.lineno} {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)
