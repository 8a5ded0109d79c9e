#!/usr/bin/env bash
# One device call: GPU tests, then the W1 benchmark in the given configurations.
# Usage (on the GPU machine, repo root): bash bench/archive/gpu_session.sh "<bench args>" ["<bench args>" ...]
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15
fi
i=0
for args in "$@"; do
  i=$((i+1))
  echo "=== run $i: $args"
  timeout ${RUN_TIMEOUT:-400} python3 bench/run.py $args --json "$OUT/run$i.json" 2>&1 | tail -${TAIL:-40}
done
