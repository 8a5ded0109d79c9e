#!/usr/bin/env bash
# One device call of a measurement session: GPU tests and benchmarks, chosen by phase, each
# writing its raw JSON under $OUT. Usage (on the GPU machine, repo root):
#   bash bench/archive/gpu_calls.sh w1-qlora8b   # W1 auto plan + QLoRA/bf16-LoRA GPU tests + the 8B QLoRA pair
#   bash bench/archive/gpu_calls.sh qlora70b     # the 70B-shape QLoRA run (a call of its own: ~6 min)
#   bash bench/archive/gpu_calls.sh ssd-w3       # W3 with the SSD tier (bench/ssd_w3.py)
#   bash bench/archive/gpu_calls.sh gpu-tests    # every GPU-marked test (QLoRA 1/2 entries, int8, bf16, dropout)
#   bash bench/archive/gpu_calls.sh clip-dp      # W1 with/without clipping (auto plans) + 2 replicas sharing the GPU
#   bash bench/archive/gpu_calls.sh clip-w1      # W1 clipped: the unclipped plan, 4 resident packs, the planner's own
#   bash bench/archive/gpu_calls.sh keep         # W1 auto at 24 / 48 GiB (kept packs), 48 GiB without keeping, W3 auto;
#                                        # traced: the step decomposition and the bound with forced recompute
#   bash bench/archive/gpu_calls.sh clip7 [tag]  # host AdamW one pass vs split (weights, then moments); W1 and W3
#                                        # auto with and without clipping, warm-up 2, traced (raw: *_<tag>.json)
#   bash bench/archive/gpu_calls.sh dp-w3        # W3 as 2 replicas sharing the GPU (planner's plan, host pre-flight)
#   bash bench/archive/gpu_calls.sh assist8 W1|W3 [tag]  # clipped with / without assisted updates + unclipped (#16)
#   bash bench/archive/gpu_calls.sh roundtrip9 [tag]    # one assisted round trip vs the link; W1 clipped assisted, traced
#   bash bench/archive/gpu_calls.sh final9 [tag]        # round trip vs host pass; W1/W3 clipped and W3 unclipped, auto
#   bash bench/archive/gpu_calls.sh final9b [tag]       # CUDA assist tests; W3 unclipped traced / assisted; W1 unclipped
#   bash bench/archive/gpu_calls.sh final9c [tag]       # blocking CUDA events: W3 clipped, W1 unclipped and clipped
#   bash bench/archive/gpu_calls.sh assist8b [tag]      # W3 unclipped traced, then every 3rd / 2nd block assisted
#   bash bench/archive/gpu_calls.sh host10 [tag] [W3|traced]  # CUDA host-kept tests; W1 auto, then W3 auto or W1 traced
#   bash bench/archive/gpu_calls.sh host10c [tag]       # W1 with two packs' graphs in host memory, traced, 32 GiB cap
#   bash bench/archive/gpu_calls.sh keep10 [tag] W1|W3  # CUDA kept-graph tests (W1); the planner's plan (kept packs) vs
#                                               # --keep-activations off, same call (#16)
#   bash bench/archive/gpu_calls.sh turn11 [tag] W1|W3 [traced]  # CUDA turn test (W1); the planner's plan (a
#                                               # micro-batch-wise turn) vs --turn-packs 0, same call (#16)
#   bash bench/archive/gpu_calls.sh turn11b [tag]  # W1: planner's turn plan, turn + 9 assisted, no turn (#16)
#   bash bench/archive/gpu_calls.sh defer12 [tag]  # W1/W3 turn plans with and without deferred updates (#16)
#   bash bench/archive/gpu_calls.sh front12 [tag]  # single-block front packs vs session 11's turn plans (#16)
#   bash bench/archive/gpu_calls.sh front12b [tag] # the same, W1 traced (#16)
#   bash bench/archive/gpu_calls.sh defer12b [tag] # the same, traced: W1 6 / 9 / 0 turn layers deferred, W3 4 (#16)
#   bash bench/archive/gpu_calls.sh threads13 [tag] # W1/W3 host AdamW threads 14/12/10, W1 resident first pack (#16)
#   bash bench/archive/gpu_calls.sh pages13 [tag]   # huge-page host buffers on/off: AdamW alone, W1, W3 (#16)
#   bash bench/archive/gpu_calls.sh resident13 [tag] # W1 lowest blocks assisted / first pack resident, W3 front assisted (#16)
#   bash bench/archive/gpu_calls.sh resident13w3 [tag] # W3 front split with its single blocks assisted (#16)
#   bash bench/archive/gpu_calls.sh resident14 [tag]   # resident13's W1 plans in a balanced order A B C A C B A (#16)
#   bash bench/archive/gpu_calls.sh resident14w3 [tag] # W3 front split: assisted / plain / resident / plain / assisted
#   bash bench/archive/gpu_calls.sh lane14 [tag]       # the host-lane planner's W1/W3 plans vs the resident-first-pack ones
#   bash bench/archive/gpu_calls.sh front15 [tag]  # W1: --auto vs the resident-first-pack plan C vs the search with
#                                        # front packings (s15_w1_front_auto), C A F F A C (#16)
#   bash bench/archive/gpu_calls.sh front15w3 [tag] # the same for W3: C3 A F F A C3 (#16)
#   bash bench/archive/gpu_calls.sh clip15 [tag]   # clipping every step vs not, --auto both: W1 U K K U, W3 U K (#16)
#   bash bench/archive/gpu_calls.sh int8cuda15     # int8 QLoRA on CUDA step by step (can the refusal go?) +
#                                        # the streamed kept-pack CUDA tests
#   bash bench/archive/gpu_calls.sh two-gpu      # needs nvidia-h200-x2: W1, W3 as 1 GPU / 2 replicas (NCCL) /
#                                        # 1 pipeline over 2 GPUs (#15)
#   bash bench/archive/gpu_calls.sh two-gpu-speed  # needs nvidia-h200-x2: W1, W3 auto over cuda:0,cuda:1 (#16)
# bitsandbytes is carried as a wheel in .whl/ (the GPU image lacks it; .whl/ is git-ignored, so a
# fresh checkout has none): `pip download bitsandbytes==0.50.2 --no-deps -d .whl` here (43 MB), then
# `run` with carry [".whl"]. Phases that test int8/nf4 on CUDA stop when it is missing.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# report DIR OUT PATTERN NAME...: every DIR/NAME.log into OUT, one after another, then the lines
# of each that match PATTERN (the summary the call's output shows); absent logs are skipped
report() {
  local dir=$1 out=$2 pat=$3; shift 3
  for f in "$@"; do [ -f "$dir/$f.log" ] && { echo "===== $f"; cat "$dir/$f.log"; }; done > "$out"
  for f in "$@"; do [ -f "$dir/$f.log" ] && { echo "== $f"; grep -E "$pat" "$dir/$f.log" | head -14; }; done
  return 0
}
SUMMARY="^step [0-9]|Error|\\| tail|peak_res|measured/pred"
case "${1:-}" in
  w1-qlora8b)
    timeout 120 python3 bench/run.py W1 --auto --json "$OUT/w1_auto_after.json" 2>&1 | tail -8
    timeout 180 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_bf16.py tests/test_gpu.py \
      -k "(bf16_matches and 1dev and llama) or (1dev_host_stash and llama) or (qlora and (nf4 or 1dev_packs2))" 2>&1 | grep -E "update error|passed|failed|Error" | tail -12
    timeout 280 python3 bench/qlora_bench.py --runs 8b-shape-nf4,8b-shape-bf16-lora --json "$OUT/qlora_8b.json" 2>&1 \
      | tail -12 ;;
  qlora70b)
    timeout 560 python3 bench/qlora_bench.py --runs 70b-shape-nf4 --dequant --steps 2 --json "$OUT/qlora_70b.json" \
      2>&1 | tail -20 ;;
  ssd-w3)
    # one engine per batch, each a raw JSON (s5_ssd_w3_b<N>.json) written as it finishes; table last
    timeout 580 python3 bench/ssd_w3.py --offload-dir /tmp/tp-ssd --batches ${SSD_BATCHES:-16,128} \
      --ssd-read-gbps 1.6 --ssd-write-gbps 2.4 --time-limit 560 --json-dir "$OUT" ${SSD_ARGS:-} 2>&1 | tail -30 ;;
  gpu-tests)
    # int8 in a process of its own: a failed bitsandbytes kernel can leave the CUDA context broken
    timeout ${GPU_TESTS_S:-420} python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_gpu.py \
      tests/test_gpu_bf16.py tests/test_dropout.py tests/test_storage.py -s -k "${GPU_TESTS_K:-not int8}" \
      > "$OUT/gpu_tests.log" 2>&1
    timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_gpu.py -k int8 \
      > "$OUT/gpu_tests_int8.log" 2>&1
    grep -hE "update error|^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" "$OUT/gpu_tests_int8.log" | tail -30 ;;
  clip-dp)
    timeout 270 python3 bench/run.py W1 --devices cuda:0 --cap-gib 24 --auto --clip-compare --max-grad-norm 1.0 \
      --json "$OUT/w1_clip_compare.json" 2>&1 | tail -8
    timeout 290 python3 bench/dp_bench.py --mode share --workloads W1 --sharding shard --steps 3 --warmup 1 \
      --cap-gib 24 --node-memory-gib 128 --out "$OUT/dp" --json "$OUT/dp_share_w1.json" 2>&1 | tail -8 ;;
  clip-w1)
    W1="python3 bench/run.py W1 --devices cuda:0 --cap-gib 24 --max-grad-norm 1.0 --steps 4 --warmup 1"
    timeout 110 $W1 --pack-size 1,3,3,3,3,3,3,3,3,3 --micro-batch 4 --window 3 --stash host \
      --device-optimizer embed --json "$OUT/w1_clip_unclipped_plan.json" > "$OUT/w1_clip_a.log" 2>&1
    timeout 110 $W1 --pack-size 1 --micro-batch 4 --window 1 --stash host --device-optimizer embed \
      --resident-packs 4 --json "$OUT/w1_clip_resident4.json" > "$OUT/w1_clip_b.log" 2>&1
    timeout 120 $W1 --auto --json "$OUT/w1_clip_auto.json" > "$OUT/w1_clip_c.log" 2>&1
    for f in a b c; do echo "== $f"; tail -4 "$OUT/w1_clip_$f.log"; done ;;
  keep)
    R="python3 bench/run.py --devices cuda:0 --auto --steps 4 --warmup 2"
    timeout 130 $R W1 --cap-gib 24 --trace /tmp/w1_24.trace.json --json "$OUT/w1_auto_24.json" > "$OUT/w1_24.log" 2>&1
    timeout 130 $R W1 --cap-gib 48 --trace /tmp/w1_48.trace.json --json "$OUT/w1_auto_48_keep.json" \
      > "$OUT/w1_48_keep.log" 2>&1
    timeout 130 $R W1 --cap-gib 48 --keep-activations off --trace /tmp/w1_48n.trace.json \
      --json "$OUT/w1_auto_48_nokeep.json" > "$OUT/w1_48_nokeep.log" 2>&1
    timeout 170 $R W3 --cap-gib 24 --trace /tmp/w3_24.trace.json --json "$OUT/w3_auto_24.json" > "$OUT/w3_24.log" 2>&1
    for f in w1_24 w1_48_keep w1_48_nokeep w3_24; do echo "== $f"; grep -E "^plan|^step [0-9]" "$OUT/$f.log"; \
      tail -3 "$OUT/$f.log"; done ;;
  clip7)
    # 8 files back at most: 5 JSON, 2 traces, one log of everything
    T=${2:-base}; L=/tmp/clip7; mkdir -p $L
    timeout 120 python3 bench/archive/adamw_split_bench.py --params 400 --threads 16,12,8 --chunks 1048576,4194304 \
      --repeat 3 --json "$OUT/adamw_split_$T.json" > $L/adamw.log 2>&1
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 110 $R W1 --steps 3 --trace "$OUT/w1_$T.trace.json" --json "$OUT/w1_$T.json" > $L/w1.log 2>&1
    timeout 110 $R W1 --steps 3 --max-grad-norm 1.0 --trace "$OUT/w1_clip_$T.trace.json" \
      --json "$OUT/w1_clip_$T.json" > $L/w1_clip.log 2>&1
    timeout 120 $R W3 --steps 2 --json "$OUT/w3_$T.json" > $L/w3.log 2>&1
    timeout 130 $R W3 --steps 2 --max-grad-norm 1.0 --json "$OUT/w3_clip_$T.json" > $L/w3_clip.log 2>&1
    for f in adamw w1 w1_clip w3 w3_clip; do echo "===== $f"; cat $L/$f.log; done > "$OUT/clip7_$T.log"
    tail -8 $L/adamw.log
    for f in w1 w1_clip w3 w3_clip; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  clip7b)
    # after: one fused call per clipped layer; untraced, warm-up 2, then W3 with and without clipping
    T=${2:-after}; L=/tmp/clip7b; mkdir -p $L
    timeout 100 python3 bench/archive/adamw_split_bench.py --params 400 --threads 16 --chunks 4194304,400000000 \
      --repeat 3 --json "$OUT/adamw_whole_$T.json" > $L/adamw.log 2>&1
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 100 $R W1 --steps 5 --json "$OUT/w1_$T.json" > $L/w1.log 2>&1
    timeout 100 $R W1 --steps 5 --max-grad-norm 1.0 --json "$OUT/w1_clip_$T.json" > $L/w1_clip.log 2>&1
    timeout 130 $R W3 --steps 3 --json "$OUT/w3_$T.json" > $L/w3.log 2>&1
    timeout 150 $R W3 --steps 3 --max-grad-norm 1.0 --json "$OUT/w3_clip_$T.json" > $L/w3_clip.log 2>&1
    for f in adamw w1 w1_clip w3 w3_clip; do echo "===== $f"; cat $L/$f.log; done > "$OUT/clip7b_$T.log"
    tail -4 $L/adamw.log
    for f in w1 w1_clip w3 w3_clip; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  dp-w3)
    # W3, 2 replicas sharing the H200, each the planner's per-replica plan (the 1-process W3 row is
    # s6_w3_auto_24.json). The driver plans and checks host memory before starting: the VM's MemTotal
    # grows as used, so the node is its 128 GiB minus what is in use; 6 GiB kept free (the launcher,
    # the VM's own share of the 128, prediction error); refused with one line if it does not fit.
    # Time: ~2 min start (2 x W3 build + engine), warm-up ~40 s, ~60 s a step (27 GB of fp32 gradients
    # through gloo at ~1 GB/s): warm-up 1 + 2 steps ~5 min; the driver stops the row at 500 s and
    # still writes its JSON (the steps done are in the progress records).
    timeout 560 python3 bench/dp_bench.py --mode share --workloads W3 --sharding shard --configs replicas \
      --auto --steps 2 --warmup 1 --cap-gib 24 --hardware h200-pcie5 --node-memory-gib 128 \
      --host-reserve-gib 6 --timeout 500 --out "$OUT/dpw3" --json "$OUT/dp_share_w3.json" 2>&1 | tail -20 ;;
  final7)
    # head on CUDA (compiled loss: exactness, then speed), then W1/W3 with the gradient-slot and head
    # changes; 7 files back: 5 JSON, the W1 trace, one log of everything
    T=${2:-final}; L=/tmp/final7; mkdir -p $L
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_head_loss.py tests/test_gpu_bf16.py \
      -k "head or (bf16_matches and 1dev and llama)" > $L/tests.log 2>&1
    timeout 90 python3 bench/head_bench.py --reps 3 --json "$OUT/head_bench_$T.json" > $L/head.log 2>&1
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 95 $R W1 --steps 4 --trace "$OUT/w1_$T.trace.json" --json "$OUT/w1_$T.json" > $L/w1.log 2>&1
    timeout 110 $R W3 --steps 2 --json "$OUT/w3_$T.json" > $L/w3.log 2>&1
    timeout 90 $R W1 --steps 4 --max-grad-norm 1.0 --json "$OUT/w1_clip_$T.json" > $L/w1_clip.log 2>&1
    timeout 100 $R W3 --steps 2 --max-grad-norm 1.0 --json "$OUT/w3_clip_$T.json" > $L/w3_clip.log 2>&1
    for f in tests head w1 w3 w1_clip w3_clip; do echo "===== $f"; cat $L/$f.log; done > "$OUT/final7_$T.log"
    grep -E "passed|failed|error" $L/tests.log | tail -3; tail -16 $L/head.log
    for f in w1 w3 w1_clip w3_clip; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  assist8)
    # assisted clipped updates (#16): W1 or W3 ($2) with clipping, the planner's plan with and without
    # assist, and unclipped for the ratio; W1 also runs the CUDA assist tests and traces the assisted
    # run. 5 files back at most: 3 JSON, the trace, one log of everything
    W=${2:-W1}; T=${3:-s8}; L=/tmp/assist8_$W; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    if [ "$W" = W1 ]; then S=4; TL=100; else S=2; TL=150; fi
    if [ "$W" = W1 ]; then
      timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_assist_runtime.py \
        > $L/tests.log 2>&1
      TR="--trace $OUT/${W,,}_clip_assist_$T.trace.json"
    else
      echo "(no tests: see the W1 call)" > $L/tests.log; TR=""
    fi
    timeout $TL $R $W --steps $S --max-grad-norm 1.0 $TR --json "$OUT/${W,,}_clip_assist_$T.json" \
      > $L/assist.log 2>&1
    timeout $TL $R $W --steps $S --max-grad-norm 1.0 --no-assist --json "$OUT/${W,,}_clip_host_$T.json" \
      > $L/host.log 2>&1
    timeout $TL $R $W --steps $S --json "$OUT/${W,,}_$T.json" > $L/unclipped.log 2>&1
    for f in tests assist host unclipped; do echo "===== $f"; cat $L/$f.log; done > "$OUT/assist8_${W}_$T.log"
    grep -E "passed|failed|error" $L/tests.log | tail -3
    for f in assist host unclipped; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  assist8b)
    # assisted updates without clipping (#16: W3's backward waits on the host AdamW): W3 unclipped,
    # traced (device times: is the backward compute- or optimizer-bound?), then with every 3rd and
    # every 2nd block assisted after its backward. 6 files back: 3 JSON, 2 traces, one log
    T=${2:-s8}; L=/tmp/assist8b; mkdir -p $L
    R="python3 bench/run.py W3 --devices cuda:0 --auto --cap-gib 24 --warmup 2 --steps 2"
    timeout 150 $R --trace "$OUT/w3_$T.trace.json" --json "$OUT/w3_traced_$T.json" > $L/base.log 2>&1
    timeout 150 $R --assist-every 3 --trace "$OUT/w3_assist3_$T.trace.json" \
      --json "$OUT/w3_assist3_$T.json" > $L/assist3.log 2>&1
    timeout 150 $R --assist-every 2 --json "$OUT/w3_assist2_$T.json" > $L/assist2.log 2>&1
    for f in base assist3 assist2; do echo "===== $f"; cat $L/$f.log; done > "$OUT/assist8b_$T.log"
    for f in base assist3 assist2; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  roundtrip9)
    # one assisted round trip alone vs the link (#16), then session 8's assisted clipped plans for W1
    # (traced) and W3 again, exactly (--plan): does the step count made without a blocking copy bring
    # the assisted uploads to the link's rate? 7 files back: 3 JSON, 2 traces, 2 logs
    T=${2:-s9}; L=/tmp/roundtrip9; mkdir -p $L
    timeout 120 python3 bench/archive/assist_roundtrip.py --json "$OUT/assist_roundtrip_$T.json" > "$OUT/assist_roundtrip_$T.log" 2>&1
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --max-grad-norm 1.0"
    timeout 150 $R W1 --steps 4 --plan bench/results/s8_w1_clip_assist_s8.json \
      --trace "$OUT/w1_clip_assist_$T.trace.json" --json "$OUT/w1_clip_assist_$T.json" > $L/w1.log 2>&1
    timeout 220 $R W3 --steps 2 --plan bench/results/s8_w3_clip_assist_s8.json \
      --trace "$OUT/w3_clip_assist_$T.trace.json" --json "$OUT/w3_clip_assist_$T.json" > $L/w3.log 2>&1
    for f in w1 w3; do echo "===== $f"; cat $L/$f.log; done > "$OUT/roundtrip9_$T.log"
    for f in w1 w3; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done
    cat "$OUT/assist_roundtrip_$T.log" ;;
  host10c)
    # W1 at a 32 GiB cap (its speed, not its fit) with two packs' graphs in host memory (the planner's
    # packing, packs 0 and 9 kept on the GPU, 1 and 2 in host memory: s10_w1_host12.plan.json), traced
    T=${2:-s10c}
    timeout 200 python3 bench/run.py W1 --devices cuda:0 --cap-gib 32 --warmup 2 --steps 3 \
      --plan bench/results/s10_w1_host12.plan.json --trace "$OUT/w1_host12_$T.trace.json" \
      --json "$OUT/w1_host12_$T.json" > "$OUT/host10c_$T.log" 2>&1
    grep -E "^plan|^step [0-9]|^\| [a-z]|peak_res|Error|error" "$OUT/host10c_$T.log" | head -50 ;;
  host10)
    # kept graphs in host memory (session 10): their CUDA equivalence, then W1 with the planner's
    # plan (kept packs on the GPU and in host memory) and, by $3, W3 (default) or W1 again traced
    # (the step decomposition). 5-6 files back: 2 JSON (+1 trace), 3 logs
    T=${2:-s10}; SECOND=${3:-W3}; L=/tmp/host10; mkdir -p $L
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_keep_on_host.py -k cuda \
      > "$OUT/gpu_host_kept_tests_$T.log" 2>&1; tail -3 "$OUT/gpu_host_kept_tests_$T.log"
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 130 $R W1 --steps 4 --json "$OUT/w1_host_$T.json" > $L/w1.log 2>&1
    if [ "$SECOND" = traced ]; then
      timeout 130 $R W1 --steps 2 --trace "$OUT/w1_host_$T.trace.json" --json "$OUT/w1_host_traced_$T.json" \
        > $L/second.log 2>&1
    else
      timeout 200 $R W3 --steps 2 --json "$OUT/w3_host_$T.json" > $L/second.log 2>&1
    fi
    for f in w1 second; do echo "===== $f"; cat $L/$f.log; done > "$OUT/host10_$T.log"
    for f in w1 second; do echo "== $f"; grep -E "^plan|^step [0-9]|^\| [a-z]|peak|Error|error" $L/$f.log | head -40; done ;;
  keep10)
    # compact kept graphs of streamed packs (session 10): the CUDA equivalence of the new path,
    # then $3 (W1 or W3) with the planner's plan (it keeps packs now) and with --keep-activations
    # off (session 9's plan) in the same call. 5 files back: 2 JSON, 3 logs
    T=${2:-s10}; W=${3:-W1}; L=/tmp/keep10; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    if [ "$W" = W1 ]; then
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_keep_on_host.py \
        -k "streamed_kept or 1dev_host or cuda_host_kept" \
        > "$OUT/gpu_keep_tests_$T.log" 2>&1; tail -3 "$OUT/gpu_keep_tests_$T.log"
      S=4; B=130
    else
      S=2; B=170
    fi
    timeout $B $R $W --steps $S --json "$OUT/${W,,}_keep_$T.json" > $L/keep.log 2>&1
    timeout $B $R $W --steps $S --keep-activations off --json "$OUT/${W,,}_nokeep_$T.json" > $L/off.log 2>&1
    for f in keep off; do echo "===== $f"; cat $L/$f.log; done > "$OUT/keep10_${W}_$T.log"
    for f in keep off; do echo "== $f"; grep -E "^plan|^step [0-9]|tokens/s|peak" $L/$f.log | head -12; done ;;
  turn11)
    # the micro-batch-wise turn (session 11): the CUDA equivalence of the turn (llama, compiled), then
    # $3 (W1 or W3) with the planner's plan (a turn now) and with --turn-packs 0 (session 10's plan),
    # same call; $4 = traced: the turn plan traced instead of the A/B. Files: 2 JSON (+trace), logs
    T=${2:-s11}; W=${3:-W1}; L=/tmp/turn11; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    if [ "$W" = W1 ]; then S=4; B=140; else S=2; B=180; fi
    if [ "${4:-}" = traced ]; then
      timeout $B $R $W --steps $S --trace "$OUT/${W,,}_turn_traced_$T.trace.json" \
        --json "$OUT/${W,,}_turn_traced_$T.json" > $L/traced.log 2>&1
      cp $L/traced.log "$OUT/turn11_${W}_traced_$T.log"; grep -E "^plan|^step [0-9]|tokens/s|peak" $L/traced.log | head -12
      tail -25 $L/traced.log
    else
      if [ "$W" = W1 ]; then
        timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "turn_compiled and llama" \
          > "$OUT/gpu_turn_tests_$T.log" 2>&1; tail -3 "$OUT/gpu_turn_tests_$T.log"
      fi
      timeout $B $R $W --steps $S --json "$OUT/${W,,}_turn_$T.json" > $L/turn.log 2>&1
      timeout $B $R $W --steps $S --turn-packs 0 --json "$OUT/${W,,}_noturn_$T.json" > $L/off.log 2>&1
      for f in turn off; do echo "===== $f"; cat $L/$f.log; done > "$OUT/turn11_${W}_$T.log"
      for f in turn off; do echo "== $f"; grep -E "^plan|^step [0-9]|tokens/s|peak|Error" $L/$f.log | head -12; done
    fi ;;
  turn11b)
    # W1 three ways in one call: the planner's plan (turn + the assisted layers it chooses), the same
    # with all 9 turn layers assisted (bench/plans/s11_w1_turn_assist9.json), --turn-packs 0. 3 JSON, 1 log
    T=${2:-s11b}; L=/tmp/turn11b; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    timeout 150 $R W1 --auto --json "$OUT/w1_turn_$T.json" > $L/auto.log 2>&1
    timeout 110 $R W1 --plan bench/plans/s11_w1_turn_assist9.json --json "$OUT/w1_turn_assist9_$T.json" \
      > $L/assist9.log 2>&1
    timeout 110 $R W1 --auto --turn-packs 0 --json "$OUT/w1_noturn_$T.json" > $L/off.log 2>&1
    for f in auto assist9 off; do echo "===== $f"; cat $L/$f.log; done > "$OUT/turn11b_W1_$T.log"
    for f in auto assist9 off; do echo "== $f"; grep -E "^plan|^step [0-9]|Error" $L/$f.log | head -9; done ;;
  defer12)
    # deferred updates (session 11, not measured yet): the turn plans of session 11 with the turn's
    # layers' host AdamW deferred to the next forward (W3 also the last 10 layers), against the same
    # plans without, same call. 7 JSON, 1 log
    T=${2:-s12}; L=/tmp/defer12; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    timeout 110 $R W1 --plan bench/results/s11_w1_turn_traced_s11.json --json "$OUT/w1_turn_$T.json" > $L/w1.log 2>&1
    timeout 80 $R W1 --plan bench/plans/s11_w1_turn_defer9.json --json "$OUT/w1_turn_defer9_$T.json" \
      > $L/w1d.log 2>&1
    timeout 80 $R W1 --auto --turn-packs 0 --json "$OUT/w1_noturn_$T.json" > $L/w1n.log 2>&1
    timeout 120 $R W3 --plan bench/results/s11_w3_turn_traced_s11c.json --json "$OUT/w3_turn_$T.json" \
      > $L/w3.log 2>&1
    for d in 4 10; do
      timeout 90 $R W3 --plan bench/plans/s11_w3_turn_defer$d.json --json "$OUT/w3_turn_defer${d}_$T.json" \
        > $L/w3d$d.log 2>&1
    done
    for f in w1 w1d w1n w3 w3d4 w3d10; do echo "===== $f"; cat $L/$f.log; done > "$OUT/defer12_$T.log"
    for f in w1 w1d w1n w3 w3d4 w3d10; do echo "== $f"; grep -E "^plan|^step [0-9]|Error" $L/$f.log | head -8; done ;;
  defer12b)
    # traced: where the deferred updates go in the next forward (W1 the turn's last 6 or all 9
    # layers deferred, against none; W3 its turn's 4), same call. 8 files: 4 JSON, 4 traces
    T=${2:-s12b}; L=/tmp/defer12b; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    for p in s11_w1_turn_defer9 s12_w1_turn_defer6; do
      timeout 90 $R W1 --plan bench/plans/$p.json --trace "$OUT/${p#s1?_}_$T.trace.json" \
        --json "$OUT/${p#s1?_}_$T.json" > $L/$p.log 2>&1
    done
    timeout 90 $R W1 --plan bench/results/s11_w1_turn_traced_s11.json --trace "$OUT/w1_turn_$T.trace.json" \
      --json "$OUT/w1_turn_$T.json" > $L/w1.log 2>&1
    timeout 120 $R W3 --plan bench/plans/s11_w3_turn_defer4.json --trace "$OUT/w3_turn_defer4_$T.trace.json" \
      --json "$OUT/w3_turn_defer4_$T.json" > $L/w3d4.log 2>&1
    for f in s11_w1_turn_defer9 s12_w1_turn_defer6 w1 w3d4; do echo "== $f"; grep -E "^plan|^step [0-9]|Error" \
      $L/$f.log | head -8; done ;;
  front12)
    # single-block front packs ([1,1,1,1,3,...]: the tail chain, planner/cost.py _tail_chain_excess)
    # against session 11's turn plans ([1,3,...]), same call: W1 and W3 the planner's own plan, the
    # old plan, and W3 the old plan with only its front split. 5 JSON, 1 log
    T=${2:-s12c}; L=/tmp/front12; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 6"
    timeout 80 $R W1 --auto --json "$OUT/w1_auto_$T.json" > $L/w1a.log 2>&1
    timeout 80 $R W1 --plan bench/results/s11_w1_turn_traced_s11.json --json "$OUT/w1_old_$T.json" > $L/w1o.log 2>&1
    timeout 100 $R W3 --auto --json "$OUT/w3_auto_$T.json" > $L/w3a.log 2>&1
    timeout 100 $R W3 --plan bench/results/s11_w3_turn_traced_s11c.json --json "$OUT/w3_old_$T.json" \
      > $L/w3o.log 2>&1
    timeout 100 $R W3 --plan bench/plans/s12_w3_front_turn.json --json "$OUT/w3_front_$T.json" > $L/w3f.log 2>&1
    for f in w1a w1o w3a w3o w3f; do echo "===== $f"; cat $L/$f.log; done > "$OUT/front12_$T.log"
    for f in w1a w1o w3a w3o w3f; do echo "== $f"; grep -E "^plan|^step [0-9]|Error" $L/$f.log | head -10; done ;;
  front12b)
    # traced: W1 with the single-block front (the planner's plan of front12) against session 11's
    # turn plan, same call. 4 files: 2 JSON, 2 traces
    T=${2:-s12d}; L=/tmp/front12b; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    timeout 80 $R W1 --plan bench/results/s12_w1_auto_s12c.json --trace "$OUT/w1_front_$T.trace.json" \
      --json "$OUT/w1_front_$T.json" > $L/w1f.log 2>&1
    timeout 80 $R W1 --plan bench/results/s11_w1_turn_traced_s11.json --trace "$OUT/w1_old_$T.trace.json" \
      --json "$OUT/w1_old_$T.json" > $L/w1o.log 2>&1
    for f in w1f w1o; do echo "== $f"; grep -E "^plan|^step [0-9]|Error" $L/$f.log | head -8; done ;;
  final9)
    # the round trip beside the host pass at two thread counts; then the planner's own plans with the
    # refitted chunk overhead: W1 clipped, W3 clipped (traced: the race's forward out of sample) and
    # W3 unclipped for the ratio. 7 files back: 4 JSON, 1 trace, 2 logs
    T=${2:-s9}; L=/tmp/final9; mkdir -p $L
    timeout 150 python3 bench/archive/assist_roundtrip.py --json "$OUT/assist_roundtrip_$T.json" > "$OUT/assist_roundtrip_$T.log" 2>&1
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 120 $R W1 --steps 4 --max-grad-norm 1.0 --json "$OUT/w1_clip_$T.json" > $L/w1c.log 2>&1
    timeout 170 $R W3 --steps 2 --max-grad-norm 1.0 --trace "$OUT/w3_clip_$T.trace.json" \
      --json "$OUT/w3_clip_$T.json" > $L/w3c.log 2>&1
    timeout 150 $R W3 --steps 2 --json "$OUT/w3_$T.json" > $L/w3.log 2>&1
    for f in w1c w3c w3; do echo "===== $f"; cat $L/$f.log; done > "$OUT/final9_$T.log"
    for f in w1c w3c w3; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done
    cat "$OUT/assist_roundtrip_$T.log" ;;
  final9b)
    # the CUDA assist tests after the step-count change; W3 unclipped traced (device times: is its
    # backward bound by the host AdamW?) and with every 3rd block assisted after its backward; W1
    # unclipped for the clipped/unclipped ratio of this session. 6 files back: 3 JSON, 1 trace, 2 logs
    T=${2:-s9}; L=/tmp/final9b; mkdir -p $L
    timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_assist_runtime.py > "$OUT/gpu_assist_tests_$T.log" 2>&1
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 150 $R W3 --steps 2 --trace "$OUT/w3_traced_$T.trace.json" --json "$OUT/w3_traced_$T.json" > $L/w3t.log 2>&1
    timeout 150 $R W3 --steps 2 --assist-every 3 --json "$OUT/w3_assist3_$T.json" > $L/w3a.log 2>&1
    timeout 110 $R W1 --steps 4 --json "$OUT/w1_$T.json" > $L/w1.log 2>&1
    for f in w3t w3a w1; do echo "===== $f"; cat $L/$f.log; done > "$OUT/final9b_$T.log"
    for f in w3t w3a w1; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done
    tail -3 "$OUT/gpu_assist_tests_$T.log" ;;
  final9c)
    # blocking CUDA events (waiting lanes sleep, not spin): W3 clipped, W1 unclipped, W1 clipped,
    # the planner's plans. 4 files back: 3 JSON, one log
    T=${2:-s9c}; L=/tmp/final9c; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --auto --cap-gib 24 --warmup 2"
    timeout 130 $R W3 --steps 2 --max-grad-norm 1.0 --json "$OUT/w3_clip_$T.json" > $L/w3c.log 2>&1
    timeout 70 $R W1 --steps 3 --json "$OUT/w1_$T.json" > $L/w1.log 2>&1
    timeout 80 $R W1 --steps 3 --max-grad-norm 1.0 --json "$OUT/w1_clip_$T.json" > $L/w1c.log 2>&1
    for f in w3c w1 w1c; do echo "===== $f"; cat $L/$f.log; done > "$OUT/final9c_$T.log"
    for f in w3c w1 w1c; do echo "== $f"; grep -E "^plan|^step [0-9]" $L/$f.log; tail -3 $L/$f.log; done ;;
  two-gpu)
    nvidia-smi -L
    timeout 560 python3 bench/dp_bench.py --workloads W1,W3 --auto --sharding shard --steps 3 --warmup 2 \
      --cap-gib 24 --hardware h200-pcie5 --out "$OUT/dp2" --json "$OUT/dp_2gpu.json" 2>&1 | tail -12 ;;
  threads13)
    # the host AdamW's OpenMP threads (default: cores - 1 - GPUs = 14 here; the CUDA lanes spin on
    # their events beside it) and a resident first pack (its AdamW on the GPU), W1 and W3, one call.
    # 6 JSON, 1 log
    T=${2:-s13}; L=/tmp/threads13; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2"
    W1P=bench/results/s11_w1_turn_traced_s11.json; W3P=bench/plans/s12_w3_front_turn.json
    timeout 90 $R W1 --steps 6 --plan $W1P --json "$OUT/w1_t14_$T.json" > $L/w1_t14.log 2>&1
    timeout 90 $R W1 --steps 6 --plan $W1P --optimizer-threads 12 --json "$OUT/w1_t12_$T.json" > $L/w1_t12.log 2>&1
    timeout 90 $R W1 --steps 6 --plan $W1P --optimizer-threads 10 --json "$OUT/w1_t10_$T.json" > $L/w1_t10.log 2>&1
    timeout 90 $R W1 --steps 6 --plan bench/plans/s13_w1_turn_res1.json --optimizer-threads 12 \
      --json "$OUT/w1_res1_t12_$T.json" > $L/w1_res1.log 2>&1
    timeout 95 $R W3 --steps 4 --plan $W3P --json "$OUT/w3_t14_$T.json" > $L/w3_t14.log 2>&1
    timeout 95 $R W3 --steps 4 --plan $W3P --optimizer-threads 12 --json "$OUT/w3_t12_$T.json" > $L/w3_t12.log 2>&1
    report $L "$OUT/threads13_$T.log" "^machine|$SUMMARY" w1_t14 w1_t12 w1_t10 w1_res1 w3_t14 w3_t12 ;;
  pages13)
    # host buffers advised onto huge pages against torch's allocator (TINYPIPE_HUGE_PAGES=off): the
    # AdamW rate alone (bench/archive/host_pages.py), then W1 and W3 with the engine's own plans, on / off /
    # on in one call; W1 also with 16 AdamW threads. 7 JSON, 1 log. Ran at commit 6e5c3c0; the
    # advice measured slower on the H200 box and was reverted, so the variable is gone now
    T=${2:-s13b}; L=/tmp/pages13; mkdir -p $L
    timeout 60 python3 bench/archive/host_pages.py --threads 14,16 --json "$OUT/host_pages_$T.json" > $L/pages.log 2>&1
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --auto"
    timeout 90 $R W1 --steps 6 --json "$OUT/w1_huge_$T.json" > $L/w1_huge.log 2>&1
    TINYPIPE_HUGE_PAGES=off timeout 80 $R W1 --steps 6 --json "$OUT/w1_small_$T.json" > $L/w1_small.log 2>&1
    timeout 80 $R W1 --steps 6 --optimizer-threads 16 --json "$OUT/w1_huge_t16_$T.json" > $L/w1_t16.log 2>&1
    timeout 130 $R W3 --steps 4 --json "$OUT/w3_huge_$T.json" > $L/w3_huge.log 2>&1
    TINYPIPE_HUGE_PAGES=off timeout 100 $R W3 --steps 4 --json "$OUT/w3_small_$T.json" > $L/w3_small.log 2>&1
    timeout 80 $R W1 --steps 6 --json "$OUT/w1_huge2_$T.json" > $L/w1_huge2.log 2>&1
    tail -6 $L/pages.log
    report $L "$OUT/pages13_$T.log" "RSS \\(peak|$SUMMARY" pages w1_huge w1_small w1_t16 w3_huge w3_small w1_huge2 ;;
  resident13)
    # the host AdamW lane that W1's tail waits for, relieved at its end: the lowest four blocks
    # (the lane's last work) assisted right after their backward, or the first pack resident (its
    # AdamW on the GPU, only with RES1=1), between two runs of the engine's plan. 3-4 JSON, 1 log
    # (~170 s; ~220 with RES1)
    T=${2:-s13c}; L=/tmp/resident13; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 6"
    timeout 80 $R W1 --auto --json "$OUT/w1_auto_$T.json" > $L/w1_auto.log 2>&1
    timeout 55 $R W1 --plan bench/plans/s13_w1_turn_assist4low.json --json "$OUT/w1_assist4low_$T.json" \
      > $L/w1_assist.log 2>&1
    [ -n "${RES1:-}" ] && timeout 55 $R W1 --plan bench/plans/s13_w1_turn_res1.json --json "$OUT/w1_res1_$T.json" \
      > $L/w1_res1.log 2>&1
    timeout 55 $R W1 --auto --json "$OUT/w1_auto2_$T.json" > $L/w1_auto2.log 2>&1
    report $L "$OUT/resident13_$T.log" "$SUMMARY" w1_auto w1_assist w1_res1 w1_auto2 ;;
  resident13w3)
    # W3's front split with its four single blocks assisted after their backward, against the
    # split alone. 2 JSON, 1 log
    T=${2:-s13d}; L=/tmp/resident13w3; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    timeout 110 $R W3 --plan bench/plans/s13_w3_front_assist4low.json --json "$OUT/w3_front_assist4low_$T.json" \
      > $L/w3_assist.log 2>&1
    timeout 80 $R W3 --plan bench/plans/s12_w3_front_turn.json --json "$OUT/w3_front_$T.json" > $L/w3_front.log 2>&1
    report $L "$OUT/resident13w3_$T.log" "$SUMMARY" w3_assist w3_front ;;
  resident14)
    # resident13's three W1 plans in the order A B C A C B A (A: the engine's own, B: the lowest
    # four blocks assisted after their backward, C: the first pack resident), so a drift of the
    # host's CPU share within the call falls on each plan alike. 7 JSON, 1 log (~380 s)
    T=${2:-s14}; L=/tmp/resident14; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 6"
    A="--auto"; B="--plan bench/plans/s13_w1_turn_assist4low.json"; C="--plan bench/plans/s13_w1_turn_res1.json"
    n=0
    for k in A B C A C B A; do
      n=$((n+1)); name=w1_${n}${k}
      timeout 80 $R W1 ${!k} --json "$OUT/${name}_$T.json" > $L/$name.log 2>&1
    done
    report $L "$OUT/resident14_$T.log" "$SUMMARY" w1_1A w1_2B w1_3C w1_4A w1_5C w1_6B w1_7A ;;
  resident14w3)
    # W3's front split (P) against it with its four single blocks assisted (S) and with its first
    # pack resident (C), in the order S P C P S. 5 JSON, 1 log (~420 s)
    T=${2:-s14}; L=/tmp/resident14w3; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --steps 4"
    P="--plan bench/plans/s12_w3_front_turn.json"; S="--plan bench/plans/s13_w3_front_assist4low.json"
    C="--plan bench/plans/s13_w3_front_res1.json"
    n=0
    for k in S P C P S; do
      n=$((n+1)); name=w3_${n}${k}; lim=85; [ $n = 1 ] && lim=125
      timeout $lim $R W3 ${!k} --json "$OUT/${name}_$T.json" > $L/$name.log 2>&1
    done
    report $L "$OUT/resident14w3_$T.log" "$SUMMARY" w3_1S w3_2P w3_3C w3_4P w3_5S ;;
  resident14b)
    # the resident first pack (C) against the engine's plan (A) again, W1 C A C A C, then W3's
    # resident first pack (C) against the front split (P), C P C. 8 JSON, 1 log (~480 s)
    T=${2:-s14b}; L=/tmp/resident14b; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2"
    A="--auto"; C="--plan bench/plans/s13_w1_turn_res1.json"
    n=0
    for k in C A C A C; do
      n=$((n+1)); timeout 80 $R W1 --steps 6 ${!k} --json "$OUT/w1_${n}${k}_$T.json" > $L/w1_${n}${k}.log 2>&1
    done
    P="--plan bench/plans/s12_w3_front_turn.json"; C="--plan bench/plans/s13_w3_front_res1.json"
    for k in C P C; do
      n=$((n+1)); timeout 110 $R W3 --steps 4 ${!k} --json "$OUT/w3_${n}${k}_$T.json" > $L/w3_${n}${k}.log 2>&1
    done
    report $L "$OUT/resident14b_$T.log" "$SUMMARY" w1_1C w1_2A w1_3C w1_4A w1_5C w3_6C w3_7P w3_8C ;;
  lane14)
    # the planner with the host-lane queue (planner/host_lane.py): its own W1 and W3 plans against
    # the resident-first-pack plans measured in resident14 / resident14b. 4 JSON, 1 log (~300 s)
    T=${2:-s14c}; L=/tmp/lane14; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2"
    timeout 85 $R W1 --steps 6 --auto --json "$OUT/w1_auto_$T.json" > $L/w1_auto.log 2>&1
    timeout 60 $R W1 --steps 6 --plan bench/plans/s13_w1_turn_res1.json --json "$OUT/w1_res1_$T.json" > $L/w1_res1.log 2>&1
    timeout 120 $R W3 --steps 4 --auto --json "$OUT/w3_auto_$T.json" > $L/w3_auto.log 2>&1
    timeout 80 $R W3 --steps 4 --plan bench/plans/s13_w3_front_res1.json --json "$OUT/w3_res1_$T.json" > $L/w3_res1.log 2>&1
    report $L "$OUT/lane14_$T.log" "^plan|$SUMMARY" w1_auto w1_res1 w3_auto w3_res1 ;;
  front15|front15w3)
    # the planner's plan (A, --auto, FORWARD_RATE_FACTOR refit) against the best measured saved plan
    # (C) and the search's choice with single-block front packings (F), balanced: C A F F A C.
    # 6 JSON, 1 log (W1 ~360 s, W3 ~480 s)
    T=${2:-s15}; L=/tmp/$1; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2"
    if [ "$1" = front15 ]; then
      W=W1; S="--steps 6"; LIM=85; C="--plan bench/plans/s13_w1_turn_res1.json"
      F="--plan bench/plans/s15_w1_front_auto.json"
    else
      W=W3; S="--steps 4"; LIM=115; C="--plan bench/plans/s13_w3_front_res1.json"
      F="--plan bench/plans/s15_w3_front_auto.json"
    fi
    A="--auto"; w=${W,,}; n=0; names=()
    for k in C A F F A C; do
      n=$((n+1)); names+=("${w}_${n}${k}")
      timeout $LIM $R $W $S ${!k} --json "$OUT/${w}_${n}${k}_$T.json" > $L/${w}_${n}${k}.log 2>&1
    done
    report $L "$OUT/$1_$T.log" "^plan|$SUMMARY" "${names[@]}" ;;
  clip15)
    # clipping on every step (max_grad_norm 1.0 on random-init models) against none, the planner's
    # own plan for each. 6 JSON, 1 log (~520 s)
    T=${2:-s15}; L=/tmp/clip15; mkdir -p $L
    R="python3 bench/run.py --devices cuda:0 --cap-gib 24 --warmup 2 --auto"
    U=""; K="--max-grad-norm 1.0"; n=0; names=()
    for k in U K K U; do
      n=$((n+1)); names+=("w1_${n}${k}")
      timeout 85 $R W1 --steps 6 ${!k} --json "$OUT/w1_${n}${k}_$T.json" > $L/w1_${n}${k}.log 2>&1
    done
    for k in U K; do
      n=$((n+1)); names+=("w3_${n}${k}")
      timeout 120 $R W3 --steps 4 ${!k} --json "$OUT/w3_${n}${k}_$T.json" > $L/w3_${n}${k}.log 2>&1
    done
    report $L "$OUT/clip15_$T.log" "^plan|clipped|$SUMMARY" "${names[@]}" ;;
  int8cuda15)
    python3 -c "import bitsandbytes" 2>/dev/null || { echo "bitsandbytes missing: carry .whl (see the top)"; exit 3; }
    timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_gpu.py -s \
      -k "int8 or streamed_kept" > "$OUT/int8cuda15.log" 2>&1
    tail -15 "$OUT/int8cuda15.log" ;;
  two-gpu-speed)
    R="python3 bench/run.py --auto --cap-gib 24 --warmup 2 --steps 4"
    timeout 150 $R W1 --devices cuda:0,cuda:1 --json "$OUT/w1_2gpu.json" 2>&1 | tail -4
    timeout 200 $R W3 --devices cuda:0,cuda:1 --json "$OUT/w3_2gpu.json" 2>&1 | tail -4 ;;
  *) echo "unknown phase ${1:-}"; exit 2 ;;
esac
