"""--resume: the same command repeated over several device calls completes the suite. An earlier
call's JSON gives the rows to keep (every one that ran, measured or failed) and the maxmodel
searches to go on with (cut by a deadline, or with fewer bisection steps than --search-refine now
asks); rows never run (a deadline, an interrupt) or whose system could not be imported run again,
and --rerun-attempt takes chosen attempts out of their searches so that they are measured again.
"""

from __future__ import annotations

import json
import os

from .failures import run_again
from .size_search import cut_search


def resumed_rows(
    path: str,
    todo: list[tuple[str, str]],
    refine: int = 0,
    rerun: dict[str, set[int]] | None = None,
) -> dict[int, dict]:
    """The rows of an earlier run (``path``) to keep, by index in ``todo``: every (scenario, system)
    that ran, whether it measured or failed, and is still asked for; not those the deadline or an
    interrupt left unrun, those that failed to import their system (ModuleNotFoundError: the peers'
    wheels were not there), nor maxmodel searches to go on with (:func:`search_to_go_on`,
    ``rerun``). A missing file keeps nothing (the first call of a resumed suite)."""
    earlier = {
        key: r
        for key, r in _earlier_rows(path, rerun).items()
        if not run_again(r) and not search_to_go_on(r, refine)
    }
    return {i: dict(earlier[key], resumed=True) for i, key in enumerate(todo) if key in earlier}


def _earlier_rows(path: str, rerun: dict[str, set[int]] | None) -> dict[tuple[str, str], dict]:
    """An earlier run's rows by (scenario, system), with the maxmodel attempts named in ``rerun``
    (system -> depths; --rerun-attempt) taken out of their searches, which makes those searches go
    on (:func:`forget_attempts`)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = {(r["scenario"], r["system"]): r for r in json.load(f)["rows"]}
    for system, depths in (rerun or {}).items():
        if ("maxmodel", system) in rows:
            kept = forget_attempts(rows["maxmodel", system], depths)
            if kept is None:
                del rows["maxmodel", system]
            else:
                rows["maxmodel", system] = kept
    return rows


def forget_attempts(row: dict, depths: set[int]) -> dict | None:
    """A maxmodel search row without its attempts at ``depths``, marked to go on
    (:func:`size_search.cut_search`), so that --resume measures them again: for an attempt whose
    failure a later fix of the system may have removed (protrain's 96-layer attempt, stopped by the
    host's OOM killer before 02e323c). The row's other attempts stay as measured. None (the search
    starts over) if the depth the row reports is among them: only that attempt's fields are whole in
    the row."""
    tried = [a for a in row.get("search") or [] if a["layers"] not in depths]
    if len(tried) == len(row.get("search") or []):
        return row
    if row.get("layers") in depths:
        return None
    replaced = [a for a in row["search"] if a["layers"] in depths]
    return dict(
        row,
        search=tried,
        search_stopped="deadline or interrupt",
        replaced_attempts=(row.get("replaced_attempts") or []) + replaced,
    )


def search_to_go_on(row: dict, refine: int = 0) -> bool:
    """A maxmodel search cut short (:func:`size_search.cut_search`), or one that found its first
    failure but took fewer bisection steps towards it than ``refine`` asks for while a gap is left
    (the search replays what it measured and runs only the new steps)."""
    if cut_search(row):
        return True
    fail, ok, tried = row.get("first_failure"), row.get("layers"), row.get("search") or []
    if not refine or not fail or ok is None or fail["layers"] - ok <= 1 or not tried:
        return False
    start = min(a["layers"] for a in tried)
    doubling = {start << k for k in range(32)}
    return sum(a["layers"] not in doubling for a in tried) < refine


def searches_to_continue(
    path: str,
    todo: list[tuple[str, str]],
    refine: int = 0,
    rerun: dict[str, set[int]] | None = None,
) -> dict[int, dict]:
    """The maxmodel rows of an earlier run (``path``) to go on with (:func:`search_to_go_on`;
    ``rerun``: :func:`forget_attempts`), by index in ``todo``."""
    earlier = {
        key: r for key, r in _earlier_rows(path, rerun).items() if search_to_go_on(r, refine)
    }
    return {i: earlier[key] for i, key in enumerate(todo) if key in earlier}
