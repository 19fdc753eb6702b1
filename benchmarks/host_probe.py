"""Host memory of one benchmark child over time (the suite's run 5 diagnosis of protrain's host
memory).

    python benchmarks/host_probe.py SPEC_JSON TAG SECONDS [SYSTEM]     # from the repository root

SPEC_JSON is what run.py hands its children (``--spec``); SYSTEM defaults to protrain. Samples the
child's /proc status (RSS, anonymous, shmem: torch-pinned memory shows as shmem) and the machine's
MemAvailable every 0.5 s, prints the child's output with protrain's INFO log lines (its RESULT line
holds the plan's predicted host bytes), a sample every 5 s and the peak, and writes every sample to
/tmp/hp_TAG.json."""

import json
import subprocess
import sys
import threading
import time

spec = json.loads(sys.argv[1])
tag = sys.argv[2]
limit = float(sys.argv[3])
system = sys.argv[4] if len(sys.argv) > 4 else "protrain"
code = (
    "import logging,sys,json; logging.basicConfig(level=logging.INFO, "
    "format='%(relativeCreated)8.0f %(name)s %(message)s'); "
    "sys.path.insert(0,'benchmarks'); "
    "sys.argv=['run.py','--one',sys.argv[2],'--spec',sys.argv[1]]; import run; run.main()"
)
t0 = time.time()
p = subprocess.Popen(
    [sys.executable, "-c", code, json.dumps(spec), system],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
)
samples, lines = [], []


def status():
    out = {}
    try:
        for l in open(f"/proc/{p.pid}/status"):
            k, _, v = l.partition(":")
            if k in ("VmRSS", "RssAnon", "RssShmem", "RssFile", "VmLck", "VmPin"):
                out[k] = int(v.split()[0]) / 2**20
        for l in open("/proc/meminfo"):
            k, _, v = l.partition(":")
            if k in ("MemAvailable", "Shmem"):
                out["sys_" + k] = int(v.split()[0]) / 2**20
    except OSError:
        pass
    return out


def sample():
    while p.poll() is None:
        s = status()
        s["t"] = time.time() - t0
        samples.append(s)
        time.sleep(0.5)


threading.Thread(target=sample, daemon=True).start()


def read():
    for l in p.stdout:
        lines.append((time.time() - t0, l.rstrip()))


threading.Thread(target=read, daemon=True).start()
try:
    p.wait(timeout=limit)
except subprocess.TimeoutExpired:
    p.kill()
    print("killed at limit")
time.sleep(1)
for t, l in lines:
    print(f"{t:7.1f}  {l[:300]}")
print("--- samples every ~5 s (GiB): t rss anon shmem locked pinned | sys avail, sys shmem")
for s in samples[::10]:
    print(
        f"{s['t']:6.1f} "
        + " ".join(
            f"{s.get(k, 0):6.1f}"
            for k in (
                "VmRSS",
                "RssAnon",
                "RssShmem",
                "VmLck",
                "VmPin",
                "sys_MemAvailable",
                "sys_Shmem",
            )
        )
    )
peak = max(samples, key=lambda s: s.get("VmRSS", 0)) if samples else {}
print(tag, "PEAK", json.dumps({k: round(v, 2) for k, v in peak.items()}))
with open(f"/tmp/hp_{tag}.json", "w") as f:  # every sample and output line
    json.dump({"samples": samples, "lines": lines}, f)
