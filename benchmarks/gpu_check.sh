#!/usr/bin/env bash
# The GPU check (issue 23): on a machine with one NVIDIA GPU, a preinstalled PyTorch and no network, profile
# OPT-350M, GPT-1.3B and GPT-Neo-2.7B (smallest first) on the GPU, simulate a 1-GPU plan of each, train it in
# bf16 with megatron_patch and with megatron-core's own path, and print per model predicted vs measured step
# time and peak memory, MFU and the step-rate ratio beside their targets, within --budget-s (default 480 s,
# counted from this script's start; what would not fit is skipped with a line saying so).
#
#   bash benchmarks/gpu_check.sh [--budget-s 480] [--model GPT-1.3B] [--steps 20] [--smoke]   (see gpu_check.py)
#
# Packages the machine lacks (megatron-core, submitit) come as wheels in .whl/ beside the checkout
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl megatron-core==0.16.1 submitit`
# on a machine with network); this project runs from the checkout, not installed. Figures go to
# $OUT/gpu_check.json (rewritten after every phase) when $OUT is set.
set -euo pipefail
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s.%N)}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HAS="import importlib.util as u, sys; sys.exit(not (u.find_spec('megatron.core') and u.find_spec('submitit')))"
# only what this interpreter lacks: a machine that has megatron-core already (CI, the dev venv) keeps its own
if compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "$HAS" 2> /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
