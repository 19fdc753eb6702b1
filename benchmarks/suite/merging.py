"""--merge: several runs' JSONs joined into one set of outputs. A later file's row replaces an
earlier one's, except that a row never run (a deadline, an interrupt) never replaces one that ran;
every row keeps the host it ran on (the offloading systems' limits are host memory, which differs
between machines); and every (scenario, system) of the merged scenarios gets a row, one that no run
reached saying so, or saying the OOM its lower bounds make certain.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from .admission import predicted_failure
from .failures import not_run, run_again
from .outputs import write_outputs
from .scenarios import base_row, scenarios, search_cfg


def merge(args, parse_args) -> None:
    """``args.merge`` (JSON paths, in order) into ``args.out``; ``parse_args``: run.py's, for the
    default options of the scenarios whose rows are missing (:func:`missing_rows`)."""
    rows, merged, out = {}, [], None
    for path in args.merge:
        with open(path) as f:
            data = json.load(f)
        merged.append(
            {"path": path, **{k: data.get(k) for k in ("date", "device", "torch", "argv", "host")}}
        )
        for r in data["rows"]:
            key = (r["scenario"], r["system"])
            # the machine each row ran on: runs on machines with different host memory are merged,
            # and the offloading systems' limits are host memory
            r.setdefault("host", data.get("host"))
            r.setdefault("host_gib", data.get("host_gib_for_checks"))
            if key in rows and not_run(r) and not run_again(rows[key]):
                continue  # a row that was not run (deadline, interrupt) never replaces one that ran
            rows[key] = r  # otherwise a later file's row replaces an earlier one's
        out = data
    for key, row in missing_rows(rows, out, parse_args).items():
        rows[key] = row
    out = dict(
        out,
        rows=list(rows.values()),
        merged_from=merged,
        argv=["--merge", *args.merge, "--out", args.out],
        run_notes=list(args.note),
    )
    write_outputs(out, args.out)
    print(f"wrote {args.out}.json, .md, .png ({len(rows)} rows)")


def missing_rows(rows: dict, last: dict, parse_args) -> dict:
    """Rows for the (scenario, system) pairs of the merged scenarios that none of the merged runs
    has (a run cut short before it wrote them, or one whose --systems left them out): a device OOM
    certain from lower bounds (on the merged runs' device) says so, as that run would have; any
    other says no run reached it. The table never silently lacks a system."""
    gpu = bool(last.get("device_gib")) and last.get("device") != "cpu"
    start = (last.get("search") or {}).get("start") or 8
    args = parse_args(["--search-start", str(start), "--device", "cuda" if gpu else "cpu"])
    ctx = SimpleNamespace(
        args=args, device_total_gib=last.get("device_gib") or 0.0, host_avail_gib=None
    )
    all_sc = scenarios(args)
    out = {}
    for name in dict.fromkeys(k[0] for k in rows):
        sc = all_sc.get(name)
        for system in (sc or {}).get("systems", ()):
            if (name, system) in rows:
                continue
            cfg = search_cfg(args, args.search_start) if name == "maxmodel" else sc["cfg"]
            row = base_row(name, system, dict(sc, cfg=cfg))
            row.update(
                error=predicted_failure(system, row, ctx)
                or "not run: none of the merged runs reached it",
                wall_s=0.0,
            )
            if name == "maxmodel":
                row.update(
                    layers=args.search_start, search=[], search_stopped="deadline or interrupt"
                )
            out[(name, system)] = row
    return out
