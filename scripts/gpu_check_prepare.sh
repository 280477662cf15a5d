#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that lacks it and has no package registry (the lent
# machine: Python 3.12, torch 2.11 with CUDA, numpy, einops, psutil, triton, no megatron-core, no
# TransformerEngine, no apex): the megatron-core wheel for Python 3.12 in .whl/ (ignored by git; name ".whl"
# in the device tool's `carry`, 64 MiB in all). Run here, where the registry is reachable; then on the device:
# scripts/gpu_check.sh (it installs .whl/*.whl into a private folder first).
#
# megatron-core 0.19.2 needs torch, numpy and packaging (there); its wheel is about 2.3 MiB and ships
# megatron.training and the dataset helpers prebuilt (no Makefile: megatron_spindle.compat.megatron_lm stands
# in for Megatron's `make` of them). TransformerEngine is not carried: transformer-engine-torch ships only as a
# source build against the local torch and CUDA, so the check runs --transformer-impl local and reports TE absent.
# nvidia-ml-py (pynvml, islands from NVLink) is optional and, being pure Python, carried when WITH_NVML=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MCORE=${MCORE_VERSION:-0.19.2}
LIMIT_MIB=64
mkdir -p .whl
rm -f .whl/*.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl "megatron-core==$MCORE"
if [ "${WITH_NVML:-0}" = 1 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl nvidia-ml-py
fi
bytes=$(cat .whl/*.whl | wc -c)
if [ "$bytes" -ge $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "error: .whl/ holds $((bytes / 1024 / 1024)) MiB; the carry limit is $LIMIT_MIB MiB" >&2
  exit 2
fi
ls -1 .whl
echo "ready: $(awk "BEGIN {printf \"%.1f\", $bytes / 1048576}") MiB in .whl/; run scripts/gpu_check.sh on the device with carry [\".whl\"]"
