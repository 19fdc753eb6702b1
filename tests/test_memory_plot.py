"""plot_memory writes a PNG memory timeline of a plan (predicted against measured)."""

import pytest

pytest.importorskip("matplotlib")

from protrain_fx.errors import ProtrainError
from protrain_fx.plan.plan import Plan
from protrain_fx.report.memory_plot import plot_memory

GIB = 2**30
PNG = b"\x89PNG\r\n\x1a\n"


def _plan(measured=True):
    plan = Plan(chunk_size=64 * 2**20, n_persist=2, n_buffer=2, n_swap=1, n_checkpoint=3)
    plan.graph_name = "toy_gpt"
    timeline = [[0.0, 1 * GIB, "fwd block 0"]]
    timeline += [[0.01 * (i + 1), (1 + 0.5 * i) * GIB, f"fwd block {i}"] for i in range(4)]
    timeline += [[0.05, 3.2 * GIB, "head"]]
    timeline += [[0.06 + 0.01 * i, (3 - 0.5 * i) * GIB, f"bwd block {3 - i}"] for i in range(4)]
    timeline += [[0.1, 1.2 * GIB, "optimizer"]]
    plan.predicted = {
        "iter_s": 0.11,
        "peak_bytes": int(3.2 * GIB),
        "budget_bytes": 4 * GIB,
        "timeline": timeline,
    }
    if measured:
        plan.measured = {
            "iter_s": 0.13,
            "peak_bytes": int(3.5 * GIB),
            "timeline": [[t * 1.2, b * 1.1, label] for t, b, label in timeline],
        }
    return plan


def _check_png(path):
    import matplotlib.image

    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(PNG)
    assert len(data) > 5000
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (9 * 120, int(4.5 * 120))


def test_predicted_and_measured(tmp_path):
    path = tmp_path / "sub" / "dir" / "memory.png"  # parent created on demand
    assert plot_memory(_plan(), str(path)) == str(path)
    _check_png(path)


def test_predicted_only(tmp_path):
    plan = _plan(measured=False)
    assert plan.measured is None
    path = str(tmp_path / "pred.png")
    assert plot_memory(plan, path) == path
    _check_png(path)


def test_peaks_only(tmp_path):
    plan = Plan(chunk_size=64 * 2**20, n_persist=2, n_buffer=2, n_swap=1, n_checkpoint=3)
    plan.predicted = {"iter_s": 0.1, "peak_bytes": 3 * GIB}
    plan.measured = {"iter_s": 0.1, "peak_bytes": 2 * GIB}
    _check_png(plot_memory(plan, str(tmp_path / "peaks.png")))


def test_empty_plan_raises(tmp_path):
    plan = Plan(chunk_size=64 * 2**20, n_persist=2, n_buffer=2, n_swap=1, n_checkpoint=3)
    path = tmp_path / "empty.png"
    with pytest.raises(ProtrainError, match="no predicted or measured memory to plot"):
        plot_memory(plan, str(path))
    assert not path.exists()
