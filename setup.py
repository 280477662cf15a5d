"""megatron_spindle: Spindle wavefront scheduling for multi-task, multi-modal training on Megatron-LM."""
from setuptools import find_packages, setup

setup(
    name="megatron_spindle",
    version="0.1.0",
    description="Wavefront scheduling (Spindle, ASPLOS 2025) for multi-task multi-modal models on megatron.core",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_spindle", "megatron_spindle.*"]),
    package_data={"megatron_spindle": ["specs/*.toml"]},  # the reference models as model specs
    # HiGHS is in the default install: without it the planner still runs (numpy alone) but drops its LP
    # searches and bounds, and `spindle plan` says so. Pinned: another version may pick another optimal LP
    # vertex and so other (valid) plans, and the bench plans' sha256 hold for this one.
    install_requires=["numpy", "highspy==1.15.1"],
    # Ranges, not pins: the plugin installs into the user's Megatron environment and must keep its torch and
    # megatron-core. megatron-core: 0.16.1 (Python 3.11, `make test`) to 0.19.2 (Python 3.12, `make
    # test-megatron-lm`), the next line excluded until tested; torch: 2.13 runs the suites, 2.11 is the GPU
    # machines' torch (scripts/gpu_check.sh). tests/test_packaging.py checks that installing beside torch 2.11
    # and megatron-core 0.19.2 keeps both. requirements*.txt hold the exact sets `make` installs.
    extras_require={
        "solver": ["highspy==1.15.1"],  # in install_requires; kept so that `.[solver]` installs still resolve
        "runtime": ["torch>=2.11,<2.14", "megatron-core>=0.16.1,<0.20", "einops", "psutil"],
        "data": ["megatron-energon>=7.4.1,<8"],
        "plot": ["matplotlib"],
        "hf": ["transformers>=5.23,<6", "safetensors>=0.8,<1"],  # spindle hf, --spindle-init (pretrained weights)
        "logs": ["tensorboard>=2.21,<3"],  # --tensorboard-dir (wandb for --wandb-project is optional, not listed)
        "test": ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": ["spindle=megatron_spindle.cli:main"]},
)
