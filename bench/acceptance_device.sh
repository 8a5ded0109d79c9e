#!/usr/bin/env bash
# The acceptance matrix in one device call (run from the repository root on the GPU machine, with
# bitsandbytes and peft carried as wheels in .whl/, git-ignored: `python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2
# peft==0.21.2` (the pins of requirements/lock.txt), then `run` with carry [".whl"]):
#   bash bench/acceptance_device.sh SHA --tier quick
#   bash bench/acceptance_device.sh SHA --tier full --part 2
# SHA: the commit under test, written on this side (`git rev-parse --short=12 HEAD` before the call):
# the device's copy of the repository may carry older git metadata than its files (it did on
# 2026-12-07: rows of f420d48 were labelled with the session's first commit).
# Rows go to $OUT/acc/ and come back as one file, $OUT/acc.tgz (a call returns at most 8 files);
# unpack it into bench/results/acceptance/SHA/ and check with --check.
set -u
commit=$1; shift
. bench/device_env.sh
python3 bench/acceptance.py --commit "$commit" --out "$OUT/acc" --deadline "${DEADLINE:-540}" "$@"
rc=$?
(cd "$OUT" && tar czf acc.tgz acc && rm -rf acc)
exit $rc
