#!/usr/bin/env bash
# Long-context rows in one device call (run from the repository root on the GPU machine, with the
# bitsandbytes and peft wheels carried in .whl/ as for acceptance_device.sh):
#   bash bench/long_context_device.sh SHA --rows 8b-qlora-256k-b1 --budget-s 560
# Rows go to $OUT/lc/ and come back as one file, $OUT/lc.tgz; unpack it into
# bench/results/long_context/SHA/. The table is printed last.
set -u
commit=$1; shift
. bench/device_env.sh
python3 bench/long_context.py --commit "$commit" --out "$OUT/lc" "$@"
rc=$?
(cd "$OUT" && tar czf lc.tgz lc && rm -rf lc)
exit $rc
