#!/usr/bin/env bash
# Downloads the peer systems that the GPU image lacks into .whl/ (ignored by git), for benchmarks/run.py:
#   DeepSpeed 0.19.8 (an sdist: built on the GPU machine with --no-build-isolation, its ops JIT-compiled there)
#   and what it needs beyond the image (hjson, pydantic, pydantic-core, annotated-types, typing-inspection,
#   typing-extensions>=4.16); torchao 0.18 (one abi3 wheel).
# Wheels are for the GPU machine: CPython 3.12, manylinux x86_64. Run it here (where PyPI is reachable), then
# name .whl in the device run's carry; run.py installs them into /tmp/site at start-up when .whl/ exists.
#   bash benchmarks/fetch_peer_wheels.sh            # into .whl/ at the repository root
# Safe to run again: a distribution already in .whl/ is not fetched twice (two versions of one would stop
# the whole install there).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHL_DIR:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST"

PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

have() {  # have NAME: a file of that distribution is already in $DEST (wheel names use '_' for '-')
  local norm=${1//-/_}
  compgen -G "$DEST/${norm}-[0-9]*" >/dev/null || compgen -G "$DEST/${1}-[0-9]*" >/dev/null
}

wheel() {  # wheel NAME SPEC: a CPython 3.12 manylinux (or pure-Python) wheel
  if have "$1"; then echo "have $1"; return; fi
  echo "fetch $2"
  "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "$2"
}

if have deepspeed; then echo "have deepspeed"; else
  echo "fetch deepspeed==0.19.8 (sdist)"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DEST" deepspeed==0.19.8
fi
wheel torchao torchao==0.18.0
wheel hjson hjson
wheel annotated-types annotated-types
wheel typing-inspection typing-inspection
wheel typing-extensions "typing-extensions>=4.16"
wheel pydantic pydantic
# pydantic pins pydantic-core exactly: fetch the version the pydantic wheel asks for
core=$("$PY" - "$DEST" <<'EOF'
import glob, re, sys, zipfile
whl = sorted(glob.glob(f"{sys.argv[1]}/pydantic-[0-9]*.whl"))[-1]
with zipfile.ZipFile(whl) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
print(next(m.group(1) for m in re.finditer(r"^Requires-Dist: pydantic[-_]core\s*\(?==\s*([^\s;,)]+)", meta, re.M)))
EOF
)
wheel pydantic-core "pydantic-core==$core"
ls -l "$DEST"
du -sh "$DEST"
