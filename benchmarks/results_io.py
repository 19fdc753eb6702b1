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
