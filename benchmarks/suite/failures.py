"""How a child failed, read from what it left: the error a child records for an exception (an OOM
named as such), the error its parent makes from how it ended without a result (a timeout, a signal:
SIGKILL most likely the host's OOM killer, an exit code), whether an error is a memory failure and
whether PyTorch's own cap rather than a neighbour stopped it (the reasons a result obtained side by
side does not stand and runs again alone), the short word a table shows for an error, and which rows
were never run (a deadline, an interrupt) or must run again (their system could not be imported).
"""

from __future__ import annotations

import re
import signal
import traceback

import torch

OOM_WORDS = (
    "out of memory",
    "outofmemory",
    "alloc_failed",
    "cudaerrormemoryallocation",
    "killed by sigkill",
)
_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB|TiB)"


# -------------------------------------------------------------------- recording (child and parent)
def error_result(e: BaseException) -> dict:
    """A child's RESULT for an exception that stopped it: the error (OOM or the exception's type)
    and the end of its traceback."""
    msg = str(e) or repr(e)
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower()
    return {
        "error": f"{'OOM' if oom else type(e).__name__}: {msg}"[:2000],
        "traceback": traceback.format_exc()[-3000:],
    }


def tail(err: str | None, out: str | None, n: int = 1500) -> str:
    return (err or out or "")[-n:]


def exit_error(returncode: int, out: str | None, err: str | None, stopping: bool) -> dict:
    """The row's error for a child that ended without a RESULT line: stopped with the suite, killed
    by a signal, or exited with a code; each with the end of its output."""
    if stopping:
        return {"error": f"stopped: the suite was interrupted; last output: {tail(err, out)}"}
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the host's OOM killer?)" if returncode == -signal.SIGKILL else ""
        return {"error": f"killed by {name}{hint}; last output: {tail(err, out)}"}
    return {"error": f"exited with code {returncode} and no RESULT; last output: {tail(err, out)}"}


# --------------------------------------------------------------------------------- memory failures
def memory_failure(err: str | None) -> bool:
    low = (err or "").lower()
    return any(w in low for w in OOM_WORDS)


def _gib(num: str, unit: str) -> float:
    shift = {"bytes": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[unit]
    return float(num) * 2.0**shift / 2**30


def own_limit_hit(err: str) -> bool:
    """A PyTorch CUDA OOM raised while the device still had room for the allocation: the process's
    own cap (or fragmentation) stopped it, not what other processes held."""
    want = re.search(r"Tried to allocate " + _SIZE, err)
    free = re.search(r"of which " + _SIZE + " is free", err)
    return bool(want and free and _gib(*free.groups()) >= _gib(*want.groups()) + 1.0)


def rerun_reason(res: dict, soft_cap: float | None, shared: bool) -> str | None:
    """Why a result obtained next to other systems (or under a soft cap) does not stand, or None: a
    memory failure that may be theirs (or the soft cap's) doing, or steps slowed by the soft cap
    (allocator retries)."""
    where = ("capped at its claim of " + format(soft_cap, ".0f") + " GiB" if soft_cap else "") + (
        (", " if soft_cap else "") + "next to other systems" if shared else ""
    )
    err = res.get("error")
    if err:
        if memory_failure(err) and (soft_cap is not None or (shared and not own_limit_hit(err))):
            return f"{where}, it failed: {err[:600]}"
        return None
    if soft_cap is not None and res.get("alloc_retries"):
        return (
            f"{where}, its allocator freed its cache to retry {res['alloc_retries']} times in "
            "the timed steps"
        )
    return None


# ------------------------------------------------------------------------------------ rows' status
def short_error(err: str | None) -> str:
    if not err:
        return ""
    low = err.lower()
    if "(predicted, not run)" in low:
        return "host OOM*" if low.startswith("host") else "OOM*"
    if low.startswith("not run") and "deadline" in low:
        return "deadline"
    if low.startswith("stopped:"):
        return "stopped"
    if low.startswith("not run"):
        return "not run"
    if "out of memory" in low or low.startswith("oom"):
        return "OOM"
    for key, word in (
        ("needs cuda", "needs CUDA"),
        ("timed out", "timeout"),
        ("killed by", "killed"),
        ("no module named", "not installed"),
    ):
        if key in low:
            return word
    return "error"


def not_run(row: dict) -> bool:
    return (row.get("error") or "").startswith(("not run", "stopped:"))


def run_again(row: dict) -> bool:
    """A row --resume runs again: not run (deadline, interrupt), or its system could not even be
    imported."""
    return not_run(row) or "ModuleNotFoundError" in (row.get("error") or "")
