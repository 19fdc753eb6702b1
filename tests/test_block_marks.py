"""Block profiling marks (PROTRAIN_PROFILE_BLOCKS=1): every block's forward and backward are timed
between protrain::mark ops in the compiled graphs, and training is unchanged."""

import pytest
import torch
from models import build

from protrain_fx.runtime import block_timer
from protrain_fx.testing import compare_with_eager, random_batches


@pytest.mark.parametrize("regions", [True, False])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_marks_time_every_block_and_keep_parity(monkeypatch, tmp_path, compiler, regions):
    """Whole graphs carry the marks in their code; a graph compiled in regions marks each block's
    region where it is called (protrain_fx/region_program.py), with the block's own index."""
    monkeypatch.setenv("PROTRAIN_PROFILE_BLOCKS", "1")
    monkeypatch.setenv("PROTRAIN_REGIONS", "1" if regions else "0")
    block_timer.RECORDER.clear()
    torch.manual_seed(0)
    model = build("gpt", n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    r = compare_with_eager(
        model, random_batches(2, 2, 16, vocab=64), {"compiler": compiler, "dump_dir": str(tmp_path)}
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3  # the marks are identities
    timings = block_timer.block_timings()
    assert sorted(timings) == [0, 1, 2]
    for row in timings.values():
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    if not regions:
        fw = next(tmp_path.rglob("fw.py")).read_text()
        bw = next(tmp_path.rglob("bw.py")).read_text()
        assert "protrain.mark" in fw and "protrain.mark" in bw
    wheres = {(m.block, m.where) for m in block_timer.RECORDER.marks}
    assert wheres == {(b, w) for b in range(3) for w in range(4)}


def test_the_step_records_the_peak_after_the_last_blocks_backward():
    """``tail_bytes``: the highest allocation between the last block's backward exit and the step's
    end (copies inside included), above the step's start; the cost model adds it to the resident
    gradients."""
    M = block_timer.Mark
    S = block_timer.STEP
    marks = [
        M(S, block_timer.STEP_START, 0.0, 100, 100),
        M(0, block_timer.FWD_ENTER, 0.1, 110, 120),
        M(0, block_timer.FWD_EXIT, 0.2, 150, 160),
        M(S, block_timer.FWD_END, 0.3, 160, 400),  # the head and loss: their own peak
        M(0, block_timer.BWD_ENTER, 0.4, 170, 300),
        M(0, block_timer.BWD_EXIT, 0.5, 140, 210),
        M(S, block_timer.COPY_START, 0.6, 150, 260),  # a chunk's gradient copied out
        M(S, block_timer.COPY_END, 0.7, 150, 330),
        M(S, block_timer.STEP_END, 0.8, 120, 250),
    ]
    step = block_timer.block_timings(marks)[S]
    assert step["peak_bytes"] == 400 and step["start_allocated"] == 100
    assert step["tail_bytes"] == 330 - 100
    no_blocks = [m for m in marks if m.block == S]
    assert block_timer.block_timings(no_blocks)[S]["tail_bytes"] == 0


def test_no_marks_unless_asked(monkeypatch):
    monkeypatch.delenv("PROTRAIN_PROFILE_BLOCKS", raising=False)
    block_timer.RECORDER.clear()
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    compare_with_eager(model, random_batches(1, 2, 16, vocab=64), {"compiler": "eager"})
    assert block_timer.RECORDER.marks == []
