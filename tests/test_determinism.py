"""A plan is a pure function of its inputs: the same bytes whatever numpy's BLAS kernel, vector unit or hash seed.

``spindle plan`` runs in subprocesses under different ``OPENBLAS_CORETYPE`` kernels (Prescott and Sandybridge
run on any x86-64, Haswell where the CPU has AVX2), with numpy's AVX2 paths switched off in one and other
``PYTHONHASHSEED`` values, and every plan's JSON must be byte-identical. A source scan keeps the planner off
the calls that made plans differ (:mod:`megatron_spindle.planner.exact`).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLANNER = ROOT / "megatron_spindle" / "planner"

#: Workloads whose plans differed between kernels before the planner's arithmetic was made exact, at the
#: specs' passes (``--passes``: one configuration each) and, for the two smallest, at ``spindle plan``'s default
#: (``tuned``: every baseline and Spindle tuned, the configuration chosen among them).
WORKLOADS = (("multitask-clip", 4, 8, "spec"), ("multitask-clip", 7, 16, "spec"), ("multitask-clip", 10, 32, "spec"),
             ("ofasys", 4, 8, "spec"), ("ofasys", 7, 16, "spec"), ("qwen-val", 3, 32, "spec"),
             ("multitask-clip", 4, 8, "tuned"), ("ofasys", 4, 8, "tuned"))

_RUN = """
import sys
from megatron_spindle.cli import main
from megatron_spindle.planner.workload.spec import load_spec
out = sys.argv[1]
for spec in sys.argv[2:]:
    model, tasks, gpus, how = spec.split(":")
    passes = [] if how == "tuned" else ["--passes", str(load_spec(model).default_passes())]
    rc = main(["plan", "--model", model, "--tasks", tasks, "--gpus", gpus, "--json", *passes,
               "--out", f"{out}/{model}-{tasks}-{gpus}-{how}.json"])
    assert rc == 0, spec
"""


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {pathlib.Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


def _variants() -> list[dict[str, str]]:
    out = [{"OPENBLAS_CORETYPE": "Prescott", "PYTHONHASHSEED": "0"},
           {"OPENBLAS_CORETYPE": "Sandybridge", "PYTHONHASHSEED": "1"},
           {"OPENBLAS_CORETYPE": "Sandybridge", "PYTHONHASHSEED": "2", "NPY_DISABLE_CPU_FEATURES": "X86_V3"}]
    if _has_avx2():
        out.append({"OPENBLAS_CORETYPE": "Haswell", "PYTHONHASHSEED": "3"})
    return out


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OPENBLAS_CORETYPE names x86-64 kernels")
def test_plans_are_the_same_bytes_under_every_blas_kernel(tmp_path):
    digests: dict[str, dict[str, str]] = {}
    for i, env_extra in enumerate(_variants()):
        out = tmp_path / str(i)
        out.mkdir()
        env = {**os.environ, **env_extra, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        env.pop("NPY_DISABLE_CPU_FEATURES", None) if "NPY_DISABLE_CPU_FEATURES" not in env_extra else None
        r = subprocess.run([sys.executable, "-c", _RUN, str(out), *(":".join(map(str, w)) for w in WORKLOADS)],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{env_extra}: {r.stderr[-2000:]}"
        name = " ".join(f"{k}={v}" for k, v in env_extra.items())
        digests[name] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(out.iterdir())}
        assert len(digests[name]) == len(WORKLOADS)
    first_name, first = next(iter(digests.items()))
    for name, got in digests.items():
        differ = [f"{k}: {first[k]} ({first_name}) vs {got[k]}" for k in first if got[k] != first[k]]
        assert not differ, f"plans differ under {name}:\n" + "\n".join(differ)


#: Calls whose float results depend on the machine (BLAS/LAPACK kernels, numpy's vectorised transcendentals),
#: and the clock, which makes a search's result depend on the machine's speed.
FORBIDDEN = {
    r"\bnp\.(dot|vdot|inner|matmul|einsum|tensordot|linalg)\b": "BLAS/LAPACK: use exact.dot or math.fsum",
    r"[\w\)\]] @ [\w\(\[]": "matrix product (BLAS): use exact.dot",
    r"\.dot\(": "BLAS dot: use exact.dot",
    r"\bnp\.(exp|exp2|expm1|log|log2|log10|log1p|power|float_power|sin|cos|tan|tanh|sinh|cosh|arctan|cbrt)\(":
        "numpy's vectorised transcendentals differ with the vector unit: use math",
    r"\btime\.(time|perf_counter|monotonic|process_time)\(": "a clock in the planner: bound searches by counts",
    r"\bnp\.(argsort|sort|partition|argpartition)\((?![^)]*kind=.stable.)":
        "numpy's default sort is unstable and vectorised: ties order differently by CPU; use kind='stable'",
    r"\.(argsort|argpartition)\((?![^)]*kind=.stable.)": "unstable sort: use kind='stable'",
}


def test_planner_source_avoids_machine_dependent_arithmetic():
    bad = []
    for path in sorted(PLANNER.rglob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if code.lstrip().startswith(("@", '"', "'", ">>>")):
                continue
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    bad.append(f"{path.relative_to(ROOT)}:{no}: {why}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_grid_makes_sums_exact():
    from megatron_spindle.planner.exact import GRID_MS, dot, on_grid

    ts = [on_grid(1 / k) for k in range(1, 400)]
    assert all((t / GRID_MS).is_integer() for t in ts)
    assert sum(ts) == sum(reversed(ts)) == sum(sorted(ts))  # exact: any order gives the same span
    assert dot([1e16, 1.0, -1e16], [1.0, 1.0, 1.0]) == 1.0  # correctly rounded, unlike a left-to-right sum
