"""Model specs: a multi-task model described in one TOML file, turned into the planner's task graph.

Read with the standard library's ``tomllib``; the schema is documented in ``docs/model_spec.md``. A spec has

* ``[model]``: ``name``, the default global ``batch`` per task (samples per task per optimizer step, Megatron's
  ``--global-batch-size``), optional ``passes`` (default 1: passes of the plan per optimizer step, gradient
  accumulation; the planner plans one pass of ``batch / passes`` samples per task), ``task_counts`` (the task
  counts of its reference workloads, the largest the default and the most ``--tasks K`` takes: any K from 1 to
  it trains the first K tasks) and ``layer_plugins`` (Python files or modules registering custom layer
  types, see :mod:`.layer_types`);
* ``[modules.<component>.<part>]``: one stack of layers of one ``type`` with megatron.core-style
  hyper-parameters (``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``, ``num_layers``,
  ``seq_length``, ``vocab_size``, ``swiglu``, ``causal``, ...). ``share = "<module>"`` makes a module use
  another module's weights; a module used by several tasks shares its weights across them unless
  ``shared = false``; ``trainable = false`` freezes its weights (as ``--spindle-freeze`` does);
* ``[tasks.<name>]``: optional ``batch`` and ``weight``, ``tokens`` (length of each token stream) and
  ``flow``: lines ``"data:image -> vision.embed -> vision.layers"`` / ``"a.head + b.head -> loss"`` saying
  which modules the task's data flows through, in order (``+`` concatenates inputs in the order written);
* ``[sizes.<size>]``: overrides of module and task keys for ``--size <size>`` (the shipped models have
  ``tiny``), and of ``[model]`` ``batch`` / ``passes`` (``[sizes.<size>.model]``; a size's model ``batch``
  replaces every full-size task ``batch``, its tasks may set their own).

Operators and parameter keys follow the graph's naming: a stack module ``vision.layers`` gives operators
``<task>.vision.0 ...`` with keys ``vision.layers.0 ...``; a single-layer module ``vision.head`` gives
``<task>.vision.head`` with key ``vision.head``; the operator's ``module`` is the first name part.
Operators are emitted in the order their modules first appear in the flow lines, so the shipped specs
give exactly the graphs (and fingerprints) the Python workloads gave.

Every error is one line ``<file>: <key> = <value>: <problem>`` (:class:`SpecError`, a ``ValueError``).
Values are finite and within the planner's limits (:mod:`..limits`: layers, widths, tokens, vocabularies,
batches, task and module counts), names of tasks and modules are ASCII letters, digits, ``_`` and ``-`` (a
module's parts joined by ``.``), and a module that no task's flow uses is named in one warning line.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ...log import get_logger
from ..limits import MAX_MODULES, MAX_OPERATORS, MAX_TASKS
from .graph import DATA_PREFIX, Operator, TaskGraph
from .layer_types import load_plugin
from .spec_layers import (NO_PARAMS, NO_VALUE, SpecError, check_int, check_module, check_name, check_task_values,
                          module_operators, warn_unused)
from .spec_tables import flatten_modules, flatten_overrides, init_table, as_table

log = get_logger(__name__)

__all__ = ["ModelSpec", "SpecError", "load_spec", "parse_spec", "resolve", "shipped_models", "SIZE_FULL"]

SPEC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")
SIZE_FULL = "full"


_MODEL_KEYS = {"name", "batch", "passes", "task_counts", "layer_plugins", "init"}
_SIZE_MODEL_KEYS = {"batch", "passes", "init"}
_TASK_KEYS = {"batch", "weight", "tokens", "flow"}


@dataclass
class ModelSpec:
    """A parsed, structurally checked spec; :meth:`build_graph` does the shape checks per size."""

    file: str
    name: str
    batch: int
    task_counts: tuple[int, ...]
    modules: dict[str, dict]
    tasks: dict[str, dict]
    sizes: dict[str, dict] = field(default_factory=dict)
    passes: int = 1
    """Default passes of the plan per optimizer step (gradient accumulation)."""
    init: dict[str, str] = field(default_factory=dict)
    """Pretrained weights: module (or component) name -> Hugging Face model directory (``[model] init``)."""

    def init_for(self, size: str = SIZE_FULL) -> dict[str, str]:
        """``init`` at ``size``: a size's ``[sizes.<size>.model] init`` replaces the model's."""
        return dict(self.sizes.get(size, {}).get("model", {}).get("init", self.init))

    # -- the graph ------------------------------------------------------------------------------------
    def task_names(self) -> tuple[str, ...]:
        return tuple(self.tasks)

    def default_passes(self, size: str = SIZE_FULL) -> int:
        """The spec's passes per optimizer step at ``size``."""
        return self.sizes.get(size, {}).get("model", {}).get("passes", self.passes)

    def resolve_passes(self, size: str = SIZE_FULL, batch=None, passes: int | None = None) -> int:
        """``passes`` when given; else the spec's default when ``batch`` is not given, else 1 (an explicit
        batch without passes is one pass: the callers that size a pass themselves)."""
        if passes is None:
            return self.default_passes(size) if batch is None else 1
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"passes per step must be a positive integer, got {passes!r}")
        return passes

    def build_graph(self, *, tasks: int | None = None, size: str = SIZE_FULL,
                    batch: int | Mapping[str, int] | None = None, passes: int | None = None,
                    freeze: Sequence[str] = ()) -> TaskGraph:
        """The task graph of one pass of the first ``tasks`` tasks at ``size``: ``batch`` overrides the
        global batch per task per optimizer step (one number for all, or a mapping task -> batch), each
        task's pass holds ``batch / passes`` samples (:meth:`resolve_passes`); ``freeze`` names modules (or
        components: ``vision`` is every ``vision.*`` module) whose weights do not train, as if their spec
        said ``trainable = false`` (:meth:`frozen_modules`)."""
        k = self.task_counts[-1] if tasks is None else tasks
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.task_counts[-1]:
            raise ValueError(f"model {self.name!r} trains 1 to {self.task_counts[-1]} tasks (the first K; its "
                             f"reference workloads: {', '.join(map(str, self.task_counts))}), not {k}")
        if size != SIZE_FULL and size not in self.sizes:
            raise ValueError(f"unknown size {size!r} for model {self.name!r}; choose one of "
                             f"{(SIZE_FULL, *self.sizes)}")
        modules, task_tables = self._sized(size, self.frozen_modules(freeze))
        names = list(task_tables)[:k]
        k = self.resolve_passes(size, batch, passes)
        per_task = self._batches(names, task_tables, batch, self.sizes.get(size, {}).get("model", {}))
        for t, v in per_task.items():
            if v % k:
                raise ValueError(f"global batch {v} of task {t!r} is not a multiple of the passes per step {k}")
        per_task = {t: v // k for t, v in per_task.items()}
        ops: list[Operator] = []
        for t in names:
            ops += self._task_operators(t, task_tables[t], per_task[t], modules, size)
            check_operators(self.file, size, len(ops))
        weights = tuple(float(task_tables[t].get("weight", 1.0)) for t in names)
        return TaskGraph(model=self.name, tasks=tuple(names), operators=tuple(ops), task_weights=weights)

    def frozen_modules(self, names: Sequence[str]) -> tuple[str, ...]:
        """The modules that own the weights ``names`` freeze: a module's own name, or a component (the first
        name part: ``vision`` is ``vision.embed``, ``vision.layers``, ...; modules without weights skipped);
        a module that uses another's weights (``share``) freezes that module's, shared by both. An unknown
        name or one without weights is a ``ValueError`` listing the modules."""
        out: list[str] = []
        owner = {m: v.get("share", m) for m, v in self.modules.items()}
        kind = {m: self.modules[owner[m]].get("type") for m in self.modules}
        for name in names:
            if name in self.modules:
                found = [name]
                if kind[name] in NO_PARAMS:
                    raise ValueError(f"cannot freeze {name!r} of model {self.name!r}: a {kind[name]} module "
                                     f"has no weights")
            else:
                found = [m for m in self.modules if m.startswith(name + ".") and kind[m] not in NO_PARAMS]
            if not found:
                raise ValueError(f"cannot freeze {name!r}: not a module of model {self.name!r}; modules: "
                                 f"{', '.join(self.modules)} (or a component: "
                                 f"{', '.join(dict.fromkeys(m.split('.')[0] for m in self.modules if kind[m] not in NO_PARAMS))})")
            out += [owner[m] for m in found]
        return tuple(dict.fromkeys(out))

    def _sized(self, size: str, frozen: Sequence[str] = ()) -> tuple[dict[str, dict], dict[str, dict]]:
        modules = {m: dict(v) for m, v in self.modules.items()}
        tasks = {t: dict(v) for t, v in self.tasks.items()}
        over = self.sizes.get(size, {})
        if "batch" in over.get("model", {}):
            for t in tasks:
                tasks[t].pop("batch", None)
        for m, keys in over.get("modules", {}).items():
            modules[m].update(keys)
        for t, keys in over.get("tasks", {}).items():
            for key, v in keys.items():
                if key == "tokens":
                    tasks[t]["tokens"] = {**tasks[t].get("tokens", {}), **v}
                else:
                    tasks[t][key] = v
        for m in frozen:
            modules[m]["trainable"] = False
        for m, mod in modules.items():  # a sharing module inherits the hyper-parameters it does not set
            if "share" in mod:
                owner = modules[mod["share"]]
                modules[m] = {**{k: v for k, v in owner.items() if k not in ("shared",)}, **mod}
                if not owner.get("trainable", True):  # one weight: frozen for both
                    modules[m]["trainable"] = False
        where = f"sizes.{size}." if size != SIZE_FULL else ""
        for m, mod in modules.items():
            check_module(self.file, f"{where}modules.{m}", mod)
        return modules, tasks

    def _batches(self, names, task_tables, batch, size_model=None) -> dict[str, int]:
        default = {t: task_tables[t].get("batch", (size_model or {}).get("batch", self.batch)) for t in names}
        if batch is None:
            per = default
        elif isinstance(batch, int) and not isinstance(batch, bool):
            per = {t: batch for t in names}
        elif isinstance(batch, Mapping):
            unknown = set(batch) - set(names)
            if unknown:
                raise ValueError(f"batch given for unknown tasks {sorted(unknown)} of model {self.name!r}")
            per = {t: batch.get(t, default[t]) for t in names}
        else:
            raise ValueError(f"batch must be an integer or a mapping task -> integer, got {batch!r}")
        for t, v in per.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"global batch of task {t!r} must be a positive integer, got {v!r}")
        return per

    def _task_operators(self, task: str, table: dict, batch: int, modules: dict[str, dict],
                        size: str) -> list[Operator]:
        try:
            return self._task_ops(task, table, batch, modules)
        except SpecError as e:
            if size == SIZE_FULL:
                raise
            raise SpecError(e.file, e.key, e.value, f"at size {size!r}: {e.problem}") from None

    def _task_ops(self, task: str, table: dict, batch: int, modules: dict[str, dict]) -> list[Operator]:
        where = f"tasks.{task}"
        tokens = table.get("tokens", {})
        outs: dict = {}  # module -> what it hands on (spec_layers._Out)
        last_op: dict[str, str] = {}
        ops: list[Operator] = []
        for li, line in enumerate(table["flow"]):
            key = f"{where}.flow[{li}]"
            steps = [[item.strip() for item in part.split("+")] for part in line.split("->")]
            if len(steps) < 2 or any(not item for part in steps for item in part):
                raise SpecError(self.file, key, line, "a flow line is 'source [+ source] -> module [-> module]'")
            prev: list[str] = steps[0]
            for item in prev:
                if not item.startswith(DATA_PREFIX) and item not in outs:
                    why = ("is not a module" if item not in modules else
                           f"has not run yet in task {task!r} (list the lines that produce it first)")
                    raise SpecError(self.file, key, line, f"input {item!r} {why}")
            for part in steps[1:]:
                if len(part) != 1 or part[0].startswith(DATA_PREFIX):
                    raise SpecError(self.file, key, line, f"after '->' comes one module, got {' + '.join(part)!r}")
                target = part[0]
                if target not in modules:
                    raise SpecError(self.file, key, line, f"unknown module {target!r}; modules: "
                                                          f"{', '.join(modules)}")
                if target in outs:
                    raise SpecError(self.file, key, line, f"module {target!r} is fed twice in task {task!r}")
                srcs = [(p, None if p.startswith(DATA_PREFIX) else outs[p]) for p in prev]
                new_ops, out = module_operators(self.file, task, target, modules[target], srcs, last_op, tokens,
                                                  batch, key, line)
                ops += new_ops
                outs[target] = out
                last_op[target] = new_ops[-1].name
                prev = [target]
        unused = sorted(set(tokens) - {p[len(DATA_PREFIX):] for line in table["flow"]
                                       for p in (s.strip() for s in line.replace("->", "+").split("+"))
                                       if p.startswith(DATA_PREFIX)})
        if unused:
            raise SpecError(self.file, f"{where}.tokens", unused, "streams that no flow line reads")
        if not any(o.loss for o in outs.values()):
            raise SpecError(self.file, f"{where}.flow", table["flow"], "the task reaches no loss "
                                                                       "(contrastive_loss or lm_head)")
        return ops

# -- structural checks ----------------------------------------------------------------------------------
def check_operators(file: str, size: str, n: int) -> None:
    """The graph's size is the planner's memory and time: at most MAX_OPERATORS operators."""
    if n > MAX_OPERATORS:
        where = "" if size == SIZE_FULL else f"sizes.{size}: "
        raise SpecError(file, "modules", NO_VALUE, f"{where}more than {MAX_OPERATORS} operators (layers summed over "
                                                   f"every task's flow): outside what the planner accepts")


def parse_spec(text: str, file: str) -> ModelSpec:
    """Parse and check a spec's structure (names, keys, types, references); shapes are checked by
    :meth:`ModelSpec.build_graph`, which also runs once here for every size."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(file, "(syntax)", NO_VALUE, f"invalid TOML: {e}") from None
    for k in doc:
        if k not in ("model", "modules", "tasks", "sizes"):
            raise SpecError(file, k, doc[k] if not isinstance(doc[k], dict) else NO_VALUE,
                            "unknown top-level key; keys: model, modules, tasks, sizes")
    model = as_table(file, "model", doc.get("model", {}))
    for k, v in model.items():
        if k not in _MODEL_KEYS:
            raise SpecError(file, f"model.{k}", v, f"unknown key; keys: {', '.join(sorted(_MODEL_KEYS))}")
    name = model.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(file, "model.name", name if name is not None else NO_VALUE,
                        "missing or not a string: the model's name")
    batch = model.get("batch")
    if type(batch) is not int or batch <= 0:
        raise SpecError(file, "model.batch", batch if batch is not None else NO_VALUE,
                        "must be a positive integer (the default global batch per task)")
    check_int(file, "model.batch", "batch", batch)
    passes = model.get("passes", 1)
    if type(passes) is not int or passes <= 0:
        raise SpecError(file, "model.passes", passes, "must be a positive integer (passes per optimizer step)")
    check_int(file, "model.passes", "passes", passes)
    plugins = model.get("layer_plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise SpecError(file, "model.layer_plugins", plugins, "must be a list of strings")
    for i, ref in enumerate(plugins):
        try:
            ran = load_plugin(ref, os.path.dirname(os.path.abspath(file)))
        except FileNotFoundError as e:
            raise SpecError(file, f"model.layer_plugins[{i}]", ref, f"no such file {e}") from None
        except SystemExit as e:  # a plugin must register layer types, not end the command (exit 0, no plan)
            raise SpecError(file, f"model.layer_plugins[{i}]", ref,
                            f"called sys.exit({e.code!r}) while being imported; a plugin may only define and "
                            f"register layer types") from None
        except Exception as e:  # noqa: BLE001 - a user's plugin: any failure becomes the spec's one-line error
            raise SpecError(file, f"model.layer_plugins[{i}]", ref,
                            f"cannot import: {type(e).__name__}: {' '.join(str(e).split())}") from None
        if ran:  # a spec with plugins is code: say which file ran, once per process
            log.info(f"layer plugin: ran {ran} (model.layer_plugins of {file}: a spec that names plugins runs "
                     f"their code; use only specs you trust)")

    modules = flatten_modules(file, doc.get("modules", {}))
    if not modules:
        raise SpecError(file, "modules", NO_VALUE, "missing: at least one module")
    if len(modules) > MAX_MODULES:
        raise SpecError(file, "modules", NO_VALUE, f"{len(modules)} modules: the planner accepts 1 to {MAX_MODULES}")
    for m in modules:
        check_name(file, f"modules.{m}", m, "a module name's parts")
    for m, mod in modules.items():
        if "share" in mod:
            target = mod["share"]
            if target not in modules or target == m:
                raise SpecError(file, f"modules.{m}.share", target, f"not another module; modules: "
                                                                    f"{', '.join(modules)}")
            if "share" in modules[target]:
                raise SpecError(file, f"modules.{m}.share", target, "shares another module's weights itself: "
                                                                    "name the module that owns them")
            if mod.get("trainable", modules[target].get("trainable", True)) != modules[target].get("trainable", True):
                raise SpecError(file, f"modules.{m}.trainable", mod["trainable"], f"differs from the shared "
                                f"module {target!r}: they use one weight; set trainable there")
            if mod.get("type", modules[target].get("type")) != modules[target].get("type"):
                raise SpecError(file, f"modules.{m}.type", mod["type"], f"differs from the type "
                                                                         f"{modules[target].get('type')!r} of "
                                                                         f"the shared module {target!r}")
        else:
            check_module(file, f"modules.{m}", mod)

    tasks = as_table(file, "tasks", doc.get("tasks", {}))
    if not tasks:
        raise SpecError(file, "tasks", NO_VALUE, "missing: at least one task")
    if len(tasks) > MAX_TASKS:
        raise SpecError(file, "tasks", NO_VALUE, f"{len(tasks)} tasks: the planner accepts 1 to {MAX_TASKS}")
    for t, table in tasks.items():
        check_name(file, f"tasks.{t}", t, "a task name")
        table = as_table(file, f"tasks.{t}", table)
        for k, v in table.items():
            if k not in _TASK_KEYS:
                raise SpecError(file, f"tasks.{t}.{k}", v, f"unknown key; keys: {', '.join(sorted(_TASK_KEYS))}")
        check_task_values(file, f"tasks.{t}", table)
        flow = table.get("flow")
        if not isinstance(flow, list) or not flow or not all(isinstance(x, str) for x in flow):
            raise SpecError(file, f"tasks.{t}.flow", flow if flow is not None else NO_VALUE,
                            "must be a non-empty list of strings like 'data:image -> vision.embed'")
    counts = model.get("task_counts", list(range(1, len(tasks) + 1)))
    if (not isinstance(counts, list) or not counts or any(type(c) is not int or not 1 <= c <= len(tasks)
                                                          for c in counts) or counts != sorted(set(counts))):
        raise SpecError(file, "model.task_counts", counts, f"must be increasing task counts between 1 and "
                                                           f"{len(tasks)} (the first K tasks are trained)")

    sizes = as_table(file, "sizes", doc.get("sizes", {}))
    for s, over in sizes.items():
        over = as_table(file, f"sizes.{s}", over)
        if s == SIZE_FULL:
            raise SpecError(file, f"sizes.{s}", NO_VALUE, "'full' is the spec itself; name the other sizes")
        for k in over:
            if k not in ("model", "modules", "tasks"):
                raise SpecError(file, f"sizes.{s}.{k}", NO_VALUE, "unknown key; keys: model, modules, tasks")
        size_model = as_table(file, f"sizes.{s}.model", over.get("model", {}))
        for k, v in size_model.items():
            if k not in _SIZE_MODEL_KEYS:
                raise SpecError(file, f"sizes.{s}.model.{k}", v, "a size overrides model batch, passes, init")
            if k == "init":
                size_model[k] = init_table(file, f"sizes.{s}.model.init", v, modules)
            else:
                check_int(file, f"sizes.{s}.model.{k}", k, v)
        flat = flatten_overrides(file, f"sizes.{s}.modules", over.get("modules", {}), modules)
        for t, keys in as_table(file, f"sizes.{s}.tasks", over.get("tasks", {})).items():
            if t not in tasks:
                raise SpecError(file, f"sizes.{s}.tasks.{t}", NO_VALUE, f"not a task; tasks: {', '.join(tasks)}")
            keys = as_table(file, f"sizes.{s}.tasks.{t}", keys)
            for k, v in keys.items():
                if k not in _TASK_KEYS - {"flow"}:
                    raise SpecError(file, f"sizes.{s}.tasks.{t}.{k}", v, "a size overrides batch, weight, tokens")
            check_task_values(file, f"sizes.{s}.tasks.{t}", keys)
        sizes[s] = {"modules": flat, "tasks": over.get("tasks", {}), "model": size_model}
    spec = ModelSpec(file=file, name=name, batch=batch, task_counts=tuple(counts), modules=modules,
                     tasks=tasks, sizes=sizes, passes=passes,
                     init=init_table(file, "model.init", model.get("init", {}), modules))
    warn_unused(file, modules, tasks)
    for s in (SIZE_FULL, *sizes):  # shapes must chain at every size, for every task
        mods, tables = spec._sized(s)
        ops = []
        for t in tasks:
            ops += spec._task_operators(t, tables[t], 1, mods, s)
            check_operators(file, s, len(ops))
        try:
            TaskGraph(model=name, tasks=tuple(tasks), operators=tuple(ops))
        except ValueError as e:
            raise SpecError(file, "modules", NO_VALUE, f"{e} (module names collide)") from None
    return spec




# -- finding specs ----------------------------------------------------------------------------------------
def shipped_models() -> dict[str, str]:
    """``{name: path}`` of the spec files shipped in the package (``megatron_spindle/specs``)."""
    out = {}
    if os.path.isdir(SPEC_DIR):
        for f in sorted(os.listdir(SPEC_DIR)):
            if f.endswith(".toml"):
                out[f[:-len(".toml")]] = os.path.join(SPEC_DIR, f)
    return out


def resolve(model: str) -> str:
    """The spec file of ``model``: a shipped model's name, or a path to a ``.toml`` file."""
    shipped = shipped_models()
    if model in shipped:
        return shipped[model]
    if os.path.isfile(model):
        return model
    if model.endswith(".toml") or os.sep in model:
        raise ValueError(f"model spec file {model!r} does not exist")
    raise ValueError(f"unknown model {model!r}; built-in models: {', '.join(shipped)} "
                     f"(or give the path of a .toml model spec)")


_CACHE: dict[tuple[str, float], ModelSpec] = {}


def load_spec(model: str) -> ModelSpec:
    """Load and check the spec of a shipped model name or a spec file path (cached by path and mtime)."""
    path = resolve(model)
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _CACHE:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(path, "(file)", NO_VALUE, f"not UTF-8 text: {e}") from None
        _CACHE[key] = parse_spec(text, path)
    return _CACHE[key]
