#!/usr/bin/env bash
# The tests: set up (once) and run the whole CPU test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${PROTRAIN_VENV:-.venv}/bin/python" -m pytest -q tests "$@"
