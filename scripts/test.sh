#!/usr/bin/env bash
# The tests: set up (once) and run the whole CPU test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# -n auto: one pytest worker per core (pytest-xdist), each test file whole on one worker; the 25
# slowest tests listed at the end (where to cut when the suite nears CI's 30 minutes)
exec "${PROTRAIN_VENV:-.venv}/bin/python" -m pytest -q -n auto --dist loadfile --durations=25 tests "$@"
