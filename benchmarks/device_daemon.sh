#!/usr/bin/env bash
# On the device machine: run one benchmark command as a setsid daemon that outlives this call, and
# wait for it at most SECONDS, then copy its outputs to $OUT. A later call with the same NAME and
# no command only waits and copies again (call back to back: the machine stays warm 30 s).
#
#   bash benchmarks/device_daemon.sh NAME SECONDS [-- python benchmarks/x.py --out /tmp/NAME/x ...]
#
# The daemon's virtual environment lives outside the working tree (every call re-sends the tree
# and removes what is not in it), in /tmp/venv, reusing the image's torch. Outputs are whatever the
# command writes under /tmp/NAME (copied flat into $OUT, at most 8 files come back).
set -uo pipefail
name=$1 seconds=$2
shift 2
dir=/tmp/$name
if [ "${1:-}" = "--" ]; then
  shift
  # one daemon at a time: a second would share the GPU and the host with the first's measurements
  for other in /tmp/*/pid; do
    if [ -f "$other" ] && kill -0 "$(cat "$other")" 2>/dev/null; then
      echo "a daemon is running ($other: pid $(cat "$other")); not starting another" && exit 1
    fi
  done
  if [ ! -x /tmp/venv/bin/python ]; then
    python3 -m venv /tmp/venv &&
      python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        >"$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/outer.pth" &&
      /tmp/venv/bin/python -m pip install -q --no-build-isolation --no-deps --no-index -e . &&
      /tmp/venv/bin/python -c "import torch, protrain_fx.passes" || exit 1
  fi
  mkdir -p "$dir"
  PATH=/tmp/venv/bin:$PATH PYTHONUNBUFFERED=1 setsid nohup "$@" >"$dir/log" 2>&1 </dev/null &
  echo $! >"$dir/pid"
fi
pid=$(cat "$dir/pid") || exit 1
end=$((SECONDS + seconds))
# outputs copied as they grow: a call cut short (the session's device time spent) still brings
# back what the daemon had written
while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do
  sleep 5
  cp "$dir"/*.json "$dir"/*.md "$dir"/*.log "$dir/log" "$OUT"/ 2>/dev/null
done
kill -0 "$pid" 2>/dev/null && echo "daemon $pid still running" || echo "daemon $pid done"
cp "$dir"/*.json "$dir"/*.md "$dir"/*.log "$dir/log" "$OUT"/ 2>/dev/null
grep -v '^step ' "$dir/log" | tail -c 6000
