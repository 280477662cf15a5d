"""megatron_spindle: Spindle wavefront scheduling for multi-task, multi-modal training on Megatron-LM."""
from setuptools import find_packages, setup

setup(
    name="megatron_spindle",
    version="0.1.0",
    description="Wavefront scheduling (Spindle, ASPLOS 2025) for multi-task multi-modal models on megatron.core",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_spindle", "megatron_spindle.*"]),
    package_data={"megatron_spindle": ["specs/*.toml"]},  # the reference models as model specs
    install_requires=["numpy"],
    extras_require={
        "solver": ["highspy==1.15.1"],  # the planner's certified level bounds; without it: C* and heuristics
        "runtime": ["torch==2.13.0", "megatron-core==0.16.1", "einops"],
        "data": ["megatron-energon==7.4.1"],
        "plot": ["matplotlib"],
        "hf": ["transformers==5.23.0", "safetensors==0.8.0"],  # spindle hf, --spindle-init (pretrained weights)
        "logs": ["tensorboard==2.21.0"],  # --tensorboard-dir (wandb for --wandb-project is not pinned: optional)
        "test": ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": ["spindle=megatron_spindle.cli:main"]},
)
