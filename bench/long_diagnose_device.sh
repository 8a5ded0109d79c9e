#!/usr/bin/env bash
# Where a long-context step's time goes, and the time model's two long-sequence constants refitted
# from it, in one device call (~6 min; run from the repository root on the GPU machine, the
# bitsandbytes/peft wheels carried in .whl/ as for acceptance_device.sh):
#   bash bench/long_diagnose_device.sh
# (in this order: the profile first, the most wanted)
# 1. one profiled step of four 8B QLoRA blocks at the acceptance row's plan shape (pack 1,
#    micro-batch 1, host stash), 1 x 64K tokens, in five settings (SEQ:MLP_CHUNK:TILE, tiles pinned
#    so that each pair differs in one thing): chunked / unchunked MLPs at 8K tiles; 8K tiles,
#    32K tiles and whole segments with chunked MLPs; 8K tokens -- kernel time by category per
#    1,000 tokens, idle time, the planner's price;
# 2. bench/archive/fit_long_overheads.py on that profile: CHUNK_CALL_S from the chunked/unchunked
#    pair, TILE_MERGE_S from the two tiled/whole pairs (8 tiles and 2: the (T - 1) / 2 merge count
#    checked across tile sizes), beside planner/work.py's values;
# 3. the attention kernels at 64K of the 8B heads: whole segments per backend, and tiles.
# Everything comes back as $OUT/diag.tgz; unpack it into bench/results/long_context/diagnose_SHA/.
set -u
. bench/device_env.sh
mkdir -p "$OUT/diag"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/diag/gpu.txt"
PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 330 python3 bench/archive/long_step_profile.py \
  --runs 65536:auto:8192,65536:0:8192,65536:auto:32768,65536:auto:0,8192:0:0 --out "$OUT/diag" \
  > "$OUT/diag/long_step_profile.txt" 2>&1
rc=$?
grep -v "^USDT" "$OUT/diag/long_step_profile.txt" | tail -75
python3 bench/archive/fit_long_overheads.py "$OUT/diag/long_step_profile.json" --json "$OUT/diag/fit.json" \
  2>&1 | tee "$OUT/diag/fit.txt"
timeout 60 python3 bench/archive/tile_speed_probe.py > "$OUT/diag/tile_speed_probe.txt" 2>&1
tail -12 "$OUT/diag/tile_speed_probe.txt"
(cd "$OUT" && tar czf diag.tgz diag && rm -rf diag)
exit $rc
