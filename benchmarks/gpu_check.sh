#!/usr/bin/env bash
# The GPU check (issue: megatron_patch at Megatron speed): on a machine with one NVIDIA GPU, a preinstalled
# PyTorch and no network, profile GPT-1.3B on the GPU, simulate a 1-GPU plan, train it 30 steps in bf16 with
# megatron_patch and print measured vs predicted step time, MFU and megatron-core's own MFU.
#
#   bash benchmarks/gpu_check.sh [--steps 30] [--dtype bf16] [--smoke]     (options of benchmarks/gpu_check.py)
#
# Packages the machine lacks (megatron-core, submitit, ...) come as wheels in .whl/ beside the checkout
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl megatron-core==0.16.1 submitit`
# on a machine with network); this project runs from the checkout, not installed. Figures go to $OUT/gpu_check.json
# when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
