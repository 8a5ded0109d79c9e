#!/usr/bin/env bash
# Set up ./.venv (pinned) and run the demo: fine-tune SmolLM2-135M-Instruct on the bundled corpus.
# Extra arguments go to `tinypipe demo` (e.g. --steps 60 --device cuda:0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec tinypipe demo "$@"
