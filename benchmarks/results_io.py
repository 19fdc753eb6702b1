"""How the benchmark scripts write their results: ``OUT.json`` (the measurements, for merging and
for tests that replay them) and ``OUT.md`` (the table committed beside it under
``benchmarks/results/``), the table echoed to stdout so a device call's output shows it."""

from __future__ import annotations

import json
import time


def cuda_results(rows: list[dict]) -> dict:
    """A run's results: the CUDA device, torch's version and the date beside ``rows``."""
    import torch

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def title(what: str, out: dict) -> str:
    """The table's first line: ``what``, on the device and torch of ``out`` (:func:`cuda_results`),
    and its date."""
    return f"# {what} ({out['device']}, torch {out['torch']}, {out['date']})"


def write_json(out_path: str, out: dict) -> None:
    """``out`` as ``out_path + ".json"``."""
    with open(out_path + ".json", "w") as f:
        json.dump(out, f, indent=1)


def write_table(out_path: str, lines: list[str], echo: int | None = None) -> None:
    """``lines`` as ``out_path + ".md"``, and the first ``echo`` of them (all when None) on
    stdout."""
    with open(out_path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:echo]))


def row_processes(script: str, args, run_row) -> list[dict] | None:
    """Rows run one process each: in the child (``--row NAME --result FILE``) ``run_row(name,
    args)``'s row (an error row where it raised) goes to FILE and None is returned; in the parent
    each row of ``--only`` runs ``script`` with the parent's arguments in a child (one Inductor and
    protrain cache shared), its row read back (an error row where the child left none) and echoed,
    its whole stderr kept in ``<--out>.<row>.log``.
    The parent's rows are returned."""
    import os
    import subprocess
    import sys
    import tempfile

    if args.row:
        try:
            row = run_row(args.row, args)
        except Exception as e:
            row = {"row": args.row, "error": f"{type(e).__name__}: {str(e)[:800]}"}
        with open(args.result, "w") as f:
            json.dump(row, f)
        return None
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_"))
    env.setdefault("PROTRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="protrain_"))
    rows = []
    for name in args.only.split(","):
        result = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, script, *sys.argv[1:], "--row", name, "--result", result]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-3000:])
        if args.out:  # the child's whole log beside the results (TORCH_LOGS output included)
            with open(f"{args.out}.{name.replace('/', '_')}.log", "w") as f:
                f.write(proc.stderr)
        try:
            with open(result) as f:
                rows.append(json.load(f))
        except OSError:
            rows.append({"row": name, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"})
        print(json.dumps(rows[-1])[:1500], flush=True)
    return rows


def run_meta(script: str, **more) -> dict:
    """What a run's table names beside its rows: the device, torch, the date, the command."""
    import sys

    import torch

    return dict(
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command=f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        **more,
    )


def rows_main(script: str, ap, rows: list[str], run_row, evaluate, table, keys: tuple) -> None:
    """The main of a script whose rows run one process each: ``ap`` (the script's own options)
    gets ``--out``, ``--batch`` (2), ``--seq`` (1024), ``--only`` (default ``rows``) and the
    child's ``--row`` and ``--result``; the rows run (:func:`row_processes`), then
    ``evaluate(rows)``, and the run is written (:func:`write_run`) with the options ``keys``
    beside the run's metadata."""
    import os

    ap.add_argument("--out")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--only", default=",".join(rows))
    ap.add_argument("--row")
    ap.add_argument("--result")
    args = ap.parse_args()
    done = row_processes(script, args, run_row)
    if done is None:  # a child
        return
    evaluate(done)
    more = {k: getattr(args, k) for k in (*keys, "batch", "seq")}
    write_run(args.out, done, run_meta(os.path.basename(script), **more), table)


def write_run(out_path: str, rows: list[dict], meta: dict, table) -> None:
    """``meta`` and ``rows`` as ``out_path + ".json"``, ``table(rows, meta)`` as its ``.md`` and on
    stdout."""
    with open(out_path + ".json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(out_path + ".md", "w") as f:
        f.write(table(rows, meta))
    print(table(rows, meta))
