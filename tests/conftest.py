"""Test-process set-up: megatron.core's CPU stand-ins are applied here, at the entry point, as the launchers
do (building a model never applies them). ``mp_harness`` applies them in every spawned rank too."""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:  # property tests draw the same examples on every machine: a seed from each test's name, no example database
    from hypothesis import settings

    settings.register_profile("spindle", derandomize=True, database=None)
    settings.load_profile("spindle")
except ImportError:  # hypothesis is in the test extra; without it the property tests are not collected
    pass


def pytest_configure(config):
    from megatron_spindle.log import quiet_optional_package_warnings

    quiet_optional_package_warnings()  # also for spawned ranks (PYTHONWARNINGS is inherited)
    try:
        import torch  # noqa: F401
    except ImportError:  # the pure planner tests run without torch
        return
    from megatron_spindle.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
