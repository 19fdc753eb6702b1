"""The ``maxmodel`` scenario: the largest GPT (of width --search-width) a system trains on the whole
device, found by doubling its depth from --search-start until the first failure, then
--search-refine bisection steps. Each depth is one :func:`scheduler.run_job` row; the search's row
is that of the largest depth that trained, with every attempt under ``search``. A search a deadline
cut short keeps its attempts (:func:`earlier_attempts`), so that --resume goes on from them instead
of starting over.
"""

from __future__ import annotations

from .failures import not_run
from .scenarios import search_cfg
from .scheduler import Ctx, run_job


def search(
    system: str, sc: dict, ctx: Ctx, report, priority: float = 0, earlier: dict | None = None
) -> dict:
    """The largest depth (GPT of width --search-width) ``system`` trains: double from --search-start
    until the first failure, then --search-refine bisection steps. The row is that of the largest
    that trained (or of the first attempt when none did), with every attempt under ``search``.
    ``earlier``: the row of a search that a deadline cut short (--resume): its attempts are kept and
    the search goes on from them."""
    args = ctx.args
    attempts: dict[int, dict] = {
        k: r for k, r in earlier_attempts(earlier).items() if not not_run(r)
    }
    stopped = "first failure"

    def attempt(n_layer: int) -> str:
        if n_layer in attempts:  # measured by an earlier call (--resume)
            row = attempts[n_layer]
        else:
            sized = dict(sc, cfg=search_cfg(args, n_layer))
            row = run_job("maxmodel", system, sized, ctx, priority)
            attempts[n_layer] = row
            report(row, f"maxmodel L{n_layer}")
        if row["error"] is None:
            return "ok"
        return "not run" if not_run(row) else "failed"

    ok = bad = None
    n = args.search_start
    while True:
        if n > args.search_max_layers:
            stopped = f"--search-max-layers {args.search_max_layers}"
            break
        r = attempt(n)
        if r == "ok":
            ok, n = n, n * 2
            continue
        if r == "failed":
            bad = n
        else:
            stopped = "deadline or interrupt"
        break
    for _ in range(args.search_refine):
        if ok is None or bad is None or bad - ok <= 1:
            break
        mid = (ok + bad) // 2
        r = attempt(mid)
        if r == "ok":
            ok = mid
        elif r == "failed":
            bad = mid
        else:
            stopped = "deadline or interrupt"
            break
    row = dict(attempts[ok if ok is not None else min(attempts)])
    row["layers"] = ok if ok is not None else min(attempts)
    row["search"] = [
        {
            "layers": k,
            "params": r["params"],
            "tokens_per_s": r["tokens_per_s"],
            "peak_gib": r["peak_gib"],
            "error": (r["error"] or None) and r["error"][:300],
            "wall_s": r.get("wall_s"),
        }
        for k, r in sorted(attempts.items())
    ]
    row["first_failure"] = (
        None
        if bad is None
        else {
            "layers": bad,
            "params": attempts[bad]["params"],
            "error": attempts[bad]["error"][:500],
        }
    )
    row["search_stopped"] = stopped
    if earlier and earlier.get("replaced_attempts"):
        # what --rerun-attempt measured again, as it was before
        row["replaced_attempts"] = earlier["replaced_attempts"]
    row["search_wall_s"] = round(sum(r.get("wall_s") or 0 for r in attempts.values()), 1)
    return row


def earlier_attempts(row: dict | None) -> dict[int, dict]:
    """The attempts of an earlier search row by depth: the row itself for the depth it reports
    (every field), the others from its ``search`` list (what that keeps: params, tokens/s, peak,
    error)."""
    if not row:
        return {}
    best = row.get("layers")
    if best is None:  # rows written before it was recorded: the largest attempt that trained
        best = max(
            (a["layers"] for a in row.get("search") or [] if a["error"] is None), default=None
        )
    out = {}
    for a in row.get("search") or []:
        if a["layers"] == best:
            full = {
                k: v
                for k, v in row.items()
                if k
                not in ("search", "first_failure", "search_stopped", "search_wall_s", "resumed")
            }
            out[a["layers"]] = full
        else:
            out[a["layers"]] = dict(a, wall_s=a.get("wall_s") or 0, error=a["error"])
    return out


def cut_search(row: dict) -> bool:
    """A maxmodel search that a deadline or an interrupt stopped before its first failure."""
    return row.get("search_stopped") == "deadline or interrupt"
