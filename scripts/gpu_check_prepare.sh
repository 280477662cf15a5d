#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh carries to the lent GPU machine (Python 3.12, torch with CUDA, no network,
# no megatron-core): the megatron-core wheel for Python 3.12 in .whl/ (ignored by git; name ".whl" in the
# device tool's `carry`, 64 MiB at most). Run here, where the package registry is reachable.
# Then, on the device: scripts/gpu_check.sh (it installs .whl/*.whl into a private folder first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MCORE=${MCORE_VERSION:-0.19.2}
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "megatron-core==$MCORE"
# megatron-core 0.19 needs torch, numpy and packaging (all on the device); einops and psutil are there too.
# TransformerEngine is not carried: transformer-engine-torch ships only as a source build against the local
# torch and CUDA (no binary wheel), so gpu_check.sh reports it as absent.
size=$(du -sm .whl | cut -f1)
if [ "$size" -ge 64 ]; then
  echo "error: .whl/ holds ${size} MiB; the carry limit is 64 MiB" >&2
  exit 2
fi
ls -1 .whl
echo "ready: run scripts/gpu_check.sh on the device with carry [\".whl\"] (${size} MiB)"
