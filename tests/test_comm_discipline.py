"""Device discipline: only ``megatron_spindle/comm.py`` hands tensors to ``torch.distributed``.

A collective or P2P call elsewhere could pass a CPU tensor to an NCCL group, which fails only on a GPU
machine. This test reads the source of the package, ``scripts/`` and ``examples/`` (no imports, no torch)
and fails on any call of a ``torch.distributed`` communication function outside the communication module,
however it is spelt (``dist.all_reduce``, ``torch.distributed.all_reduce``, ``from torch.distributed import
all_reduce``, ``dist.P2POp``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMM_MODULE = ROOT / "megatron_spindle" / "comm.py"

#: torch.distributed functions that move tensors or objects between ranks.
COMMUNICATION = {
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "P2POp", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
}

#: Call sites still allowed outside the communication module while they are being routed through it:
#: ``(file, function)``. While its file exists, each entry must still be there, so the list shrinks as they are
#: routed and cannot hide new calls. Empty since the executor posts its P2P through ``comm``.
PENDING: set[tuple[str, str]] = set()


def _sources() -> list[Path]:
    files = []
    for folder in ("megatron_spindle", "scripts", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f != COMM_MODULE]


def _dist_aliases(tree: ast.AST) -> tuple[set[str], set[str], dict[str, str]]:
    """(names bound to torch.distributed, names bound to torch, {local name: communication function})."""
    dist_names, torch_names, direct = set(), set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    dist_names.add(a.asname)
                elif a.name in ("torch", "torch.distributed"):
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    dist_names.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COMMUNICATION:
                    direct[a.asname or a.name] = a.name
    return dist_names, torch_names, direct


def communication_calls(path: Path) -> list[tuple[int, str]]:
    """``(line, function)`` of every torch.distributed communication function used in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    dist_names, torch_names, direct = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COMMUNICATION:
            base = node.value
            if isinstance(base, ast.Name) and base.id in dist_names:
                found.append((node.lineno, node.attr))
            elif (isinstance(base, ast.Attribute) and base.attr == "distributed"
                  and isinstance(base.value, ast.Name) and base.value.id in torch_names):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in direct and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, direct[node.id]))
    return found


def test_only_the_comm_module_calls_collectives_and_p2p():
    seen_pending, bad = set(), []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, fn in communication_calls(path):
            if (rel, fn) in PENDING:
                seen_pending.add((rel, fn))
            else:
                bad.append(f"{rel}:{line}: torch.distributed.{fn} (use megatron_spindle.comm)")
    assert not bad, "communication outside megatron_spindle/comm.py:\n" + "\n".join(bad)
    stale = sorted(p for p in PENDING - seen_pending if (ROOT / p[0]).exists())
    assert not stale, f"routed through comm now, drop from PENDING: {stale}"


def test_the_scan_finds_every_spelling(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as d\nfrom torch.distributed import all_reduce as ar\n"
                   "from torch import distributed\n"
                   "def f(t):\n    d.all_reduce(t)\n    torch.distributed.broadcast(t, 0)\n    ar(t)\n"
                   "    distributed.barrier()\n    d.P2POp(d.isend, t, 1)\n    d.get_rank()\n")
    assert sorted(fn for _, fn in communication_calls(src)) == sorted(
        ["all_reduce", "broadcast", "all_reduce", "barrier", "P2POp", "isend"])


def test_comm_module_is_torch_only():
    """Every layer imports it (models included), so it must not import the runtime, models or megatron."""
    tree = ast.parse(COMM_MODULE.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert all(m.split(".")[0] == "torch" or m.split(".")[0] in sys.stdlib_module_names for m in mods), mods
