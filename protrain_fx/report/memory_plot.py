"""Memory timeline of one protrain plan: predicted against measured.

:func:`plot_memory` writes a PNG with time (ms) on the x axis and device memory (GiB) on the y axis:

* the predicted timeline (``plan.predicted["timeline"]``) as a step line,
* the measured timeline (``plan.measured["timeline"]``), if there is one, as a second step line,
* dashed horizontal lines at the predicted peak, the measured peak and the budget (each if known),
* a dotted vertical line where the predicted (else measured) timeline enters the backward pass.

The title names the graph and the plan's knobs. matplotlib is imported only when plotting
(``pip install matplotlib``, or the ``[bench]`` extra).
"""

from __future__ import annotations

import os

from protrain_fx.errors import ProtrainError

_GIB = 2**30
_MIB = 2**20


def _timeline(stats) -> list[tuple[float, float, str]]:
    """``[(t_ms, GiB, label)]`` from a predicted/measured dict, empty when it has none."""
    points = (stats or {}).get("timeline") or []
    return [(float(t) * 1e3, float(b) / _GIB, str(label)) for t, b, label in points]


def _bwd_start(points) -> float | None:
    return next((t for t, _, label in points if label.startswith("bwd")), None)


def plot_memory(plan, path: str) -> str:
    """Write a PNG memory timeline of ``plan`` (predicted against measured) to ``path``; return
    ``path``.

    Reads only ``plan.predicted``, ``plan.measured`` (dicts with ``iter_s``, ``peak_bytes``,
    optional ``budget_bytes`` and ``timeline`` of ``[t_s, bytes, label]`` triples),
    ``plan.graph_name`` and the knobs. Raises :class:`ProtrainError` if there is nothing to plot or
    matplotlib is missing.
    """
    predicted = getattr(plan, "predicted", None) or {}
    measured = getattr(plan, "measured", None) or {}
    pred_points, meas_points = _timeline(predicted), _timeline(measured)
    lines = [  # (label, bytes, colour) of the horizontal lines
        (name, stats.get(key), colour)
        for name, stats, key, colour in (
            ("predicted peak", predicted, "peak_bytes", "tab:blue"),
            ("measured peak", measured, "peak_bytes", "tab:orange"),
            ("budget", predicted, "budget_bytes", "tab:red"),
        )
        if stats.get(key) is not None
    ]
    if not pred_points and not meas_points and not lines:
        raise ProtrainError(
            "plan has no predicted or measured memory to plot (plan.predicted and plan.measured "
            "have "
            "no timeline, peak_bytes or budget_bytes); run the planner / a profiled step first"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ProtrainError(
            "plot_memory needs matplotlib: pip install matplotlib (or protrain-fx[bench])"
        ) from e

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    try:
        for name, points, stats, colour in (
            ("predicted", pred_points, predicted, "tab:blue"),
            ("measured", meas_points, measured, "tab:orange"),
        ):
            if points:
                iter_s = stats.get("iter_s")
                label = name if iter_s is None else f"{name} ({float(iter_s) * 1e3:.1f} ms/iter)"
                ts, gib, _ = zip(*points)
                ax.plot(ts, gib, drawstyle="steps-post", color=colour, linewidth=1.5, label=label)
        for name, nbytes, colour in lines:
            ax.axhline(
                nbytes / _GIB,
                linestyle="--",
                linewidth=1,
                color=colour,
                label=f"{name} {nbytes / _GIB:.2f} GiB",
            )
        bwd = _bwd_start(pred_points) if pred_points else _bwd_start(meas_points)
        if bwd is not None:
            ax.axvline(bwd, linestyle=":", color="grey", linewidth=1, label="fwd | bwd")

        knobs = ", ".join(
            f"{k}={getattr(plan, 'n_' + k, None)}"
            for k in ("persist", "buffer", "swap", "checkpoint")
        )
        chunk = getattr(plan, "chunk_size", None)
        chunk_s = f"chunk {chunk / _MIB:g} MiB" if chunk else "chunk ?"
        ax.set_title(
            f"{getattr(plan, 'graph_name', '') or 'graph'}: {chunk_s}, {knobs}", fontsize=10
        )
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("device memory (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()

        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path
