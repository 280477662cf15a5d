"""Bounded input. Divisors by factorization, a one-line limit on devices and batch, and a
warning when devices stay idle."""
import subprocess
import sys

import pytest

from megatron_spindle.planner.step.build import make_plan
from megatron_spindle.planner.workload.cluster import load_cluster
from megatron_spindle.planner.limits import MAX_BATCH, MAX_DEVICES, divisors, factorize
from megatron_spindle.planner.workload.metaops import contract
from megatron_spindle.planner.assembly.render import idle_devices, idle_warning
from megatron_spindle.planner.workload.workloads import build_graph


def spindle(*args):
    return subprocess.run([sys.executable, "-m", "megatron_spindle.cli", *args], capture_output=True, text=True)


def test_divisors_match_brute_force():
    for n in range(1, 1500):
        assert divisors(n) == tuple(d for d in range(1, n + 1) if n % d == 0)
    for n in (720720, 1 << 20, 999983, 2 * 999983, 1048575):
        d = divisors(n)
        assert all(n % x == 0 for x in d) and d[0] == 1 and d[-1] == n and list(d) == sorted(set(d))
        prod = 1
        for p, e in factorize(n):
            prod *= p ** e
        assert prod == n
    assert len(divisors(720720)) == 240


def test_valid_counts_are_tp_times_divisors():
    g = build_graph("multitask-clip", tasks=4, batch=96)
    for m in contract(g):
        for N in (1, 7, 64, 5000):
            want = tuple(m.tp * d for d in range(1, m.batch + 1) if m.batch % d == 0 and m.tp * d <= N) \
                if m.batch_splittable else ((m.tp,) if m.tp <= N else ())
            assert m.valid_counts(N) == want


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "1000000000"], f"1000000000 devices is outside what the planner accepts (1 to {MAX_DEVICES})"),
    (["--gpus", "64", "--batch", "100000000"], f"100000000 is outside what the planner accepts (1 to {MAX_BATCH})"),
    (["--gpus", str(MAX_DEVICES + 1)], f"{MAX_DEVICES + 1} devices"),
])
def test_cli_refuses_unbounded_input_in_one_line(args, needle):
    r = spindle("plan", "--model", "multitask-clip", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_compare_refuses_too_many_devices():
    r = spindle("compare", "--model", "multitask-clip", "--gpus", f"8,{MAX_DEVICES * 2}")
    assert r.returncode == 2 and f"{MAX_DEVICES * 2} devices is outside" in r.stderr
    assert "Traceback" not in r.stderr


def test_library_refuses_too_many_devices():
    g = build_graph("multitask-clip", tasks=4)
    with pytest.raises(ValueError, match=f"{MAX_DEVICES + 8} devices"):
        make_plan(g, load_cluster(None, num_devices=MAX_DEVICES + 8))


def test_large_batch_with_many_divisors_plans():
    # 720720 has 240 divisors: every one is a valid count; planning must not enumerate 720720 numbers
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=720720),
                     load_cluster(None, num_devices=32))
    assert plan.makespan_ms > 0 and not idle_devices(plan)


def test_idle_devices_are_reported():
    # batch 2: a MetaOp runs on at most 2 devices; 4 tasks have 8 MetaOps in their widest level -> 16 of 64
    plan = make_plan(build_graph("multitask-clip", tasks=4, size="tiny", batch=2), load_cluster(None, num_devices=64))
    idle = idle_devices(plan)
    assert len(idle) == 64 - 16
    w = idle_warning(plan)
    assert w.startswith(f"warning: {len(idle)} of 64 devices stay idle") and "no level can use more than 16" in w
    r = spindle("plan", "--model", "multitask-clip", "--tasks", "4", "--size", "tiny", "--batch", "2",
                "--passes", "1", "--gpus", "64", "--json")
    assert r.returncode == 0 and f"warning: {len(idle)} of 64 devices stay idle" in r.stderr
    full = make_plan(build_graph("multitask-clip", tasks=4, size="tiny"), load_cluster(None, num_devices=8))
    assert idle_warning(full) is None
