#!/usr/bin/env bash
# The main job: set up (once) and run the example training run. Arguments go to examples/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${PROTRAIN_VENV:-.venv}/bin/python" examples/train.py "$@"
