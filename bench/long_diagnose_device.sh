#!/usr/bin/env bash
# Where a long-context step's time goes, in one device call (~5 min; run from the repository root on
# the GPU machine, the bitsandbytes/peft wheels carried in .whl/ as for acceptance_device.sh):
#   bash bench/long_diagnose_device.sh
# (in this order: the profile first, the most wanted)
# 1. the attention kernels at 64K of the 8B heads: whole segments per backend, and tiles (the rate
#    the time model's attention part rests on);
# 2. the CUDA tests of the transient embedding/head weights (their freed blocks back in the compute
#    stream's pool);
# 3. one profiled step of four 8B QLoRA blocks at the acceptance row's plan shape, in four settings
#    (SEQ:MLP_CHUNK:TILE): 64K as the row runs it, 64K with whole MLPs, 64K with whole-segment
#    attention, 8K -- kernel time by category per 1,000 tokens, idle time, the planner's price.
#    Which of chunking, tiling or the length itself costs what the time model misses at 64K
#    (bench/results/acceptance/cee9907aabd5/long-qlora-8b-64k.json: 3,452 tok/s, predicted 4,136).
# Everything comes back as $OUT/diag.tgz; unpack it into bench/results/long_context/diagnose_SHA/.
set -u
. bench/device_env.sh
mkdir -p "$OUT/diag"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/diag/gpu.txt"
PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 300 python3 bench/archive/long_step_profile.py \
  --runs 65536:auto:auto,65536:0:auto,65536:auto:0,8192:0:0 --out "$OUT/diag" \
  > "$OUT/diag/long_step_profile.txt" 2>&1
rc=$?
grep -v "^USDT" "$OUT/diag/long_step_profile.txt" | tail -75
timeout 60 python3 bench/archive/tile_speed_probe.py > "$OUT/diag/tile_speed_probe.txt" 2>&1
tail -12 "$OUT/diag/tile_speed_probe.txt"
timeout 120 python3 -m pytest -q -s -m gpu tests/test_transient_weights.py > "$OUT/diag/transient_gpu_tests.txt" 2>&1
tail -3 "$OUT/diag/transient_gpu_tests.txt"
(cd "$OUT" && tar czf diag.tgz diag && rm -rf diag)
exit $rc
