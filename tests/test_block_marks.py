"""Block profiling marks (PROTRAIN_PROFILE_BLOCKS=1): every block's forward and backward are timed
between protrain::mark ops in the compiled graphs, and training is unchanged."""

import pytest
import torch
from models import build

from protrain_fx.runtime import block_timer
from protrain_fx.testing import compare_with_eager, random_batches


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_marks_time_every_block_and_keep_parity(monkeypatch, tmp_path, compiler):
    monkeypatch.setenv("PROTRAIN_PROFILE_BLOCKS", "1")
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
    fw = next(tmp_path.rglob("fw.py")).read_text()
    bw = next(tmp_path.rglob("bw.py")).read_text()
    assert "protrain.mark" in fw and "protrain.mark" in bw
    wheres = {(m.block, m.where) for m in block_timer.RECORDER.marks}
    assert wheres == {(b, w) for b in range(3) for w in range(4)}


def test_no_marks_unless_asked(monkeypatch):
    monkeypatch.delenv("PROTRAIN_PROFILE_BLOCKS", raising=False)
    block_timer.RECORDER.clear()
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    compare_with_eager(model, random_batches(1, 2, 16, vocab=64), {"compiler": "eager"})
    assert block_timer.RECORDER.marks == []
