#!/usr/bin/env bash
# Set up ./.venv (pinned) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
python -m pytest -q -p no:cacheprovider "$@"
