#!/usr/bin/env bash
# Makes the project's virtual environment (.venv, or $PROTRAIN_VENV) with protrain-fx installed editable and
# its test/bench extras. The torch it uses: one that `python3` can already import (a CUDA build on a GPU
# machine, say), else the CPU build torch==2.13.0. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PROTRAIN_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  if "$PY" -c "import torch" 2>/dev/null; then
    # Reuse the torch that is already present: put that environment's packages on the venv's path.
    outer=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    inner=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$outer" > "$inner/_protrain_outer_site.pth"
    echo "bootstrap: using the torch already present in $outer" >&2
  fi
fi
VPY="$(cd "$VENV" && pwd)/bin/python"
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0 (CPU) into $VENV (first run only)" >&2
  "$VENV/bin/python" -m pip install -q torch==2.13.0
fi
# checked from / so the source folder on the path does not pass for an installed package (the entry point)
if ! (cd / && "$VPY" -c "import importlib.metadata as m; m.distribution('protrain-fx'); import pytest, xdist, hypothesis, ruff, pynvml, transformers, peft") 2>/dev/null; then
  echo "bootstrap: installing protrain-fx (editable) and its test extras into $VENV (first run only)" >&2
  if [ -f "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_protrain_outer_site.pth" ]; then
    # an existing environment (perhaps offline): build with what it has
    "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test,bench]"
  else
    "$VENV/bin/python" -m pip install -q -e ".[test,bench]"
  fi
fi
