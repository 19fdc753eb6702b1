"""Chunks sized for the blocks (issue 24.1): a parameter larger than the chunk size (a large
vocabulary's embedding or untied head) gets a chunk of its own, and every placement of it
(resident, offloaded) trains exactly like eager PyTorch."""

import math

import pytest
import torch
from hf_models import BIG_VOCAB, big_vocab_llama, offloaded

from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.testing import compare_with_eager, random_batches

VOCAB = BIG_VOCAB


def oversized(plan) -> list:
    return [c for c in plan.chunks if c.bytes > plan.chunk_size]


@pytest.mark.parametrize(
    "tied,n_persist,compiler",
    [
        (True, 0, "eager"),  # the embedding's chunk offloaded
        (True, 1, "eager"),  # resident, the blocks' chunks offloaded
        (False, 0, "eager"),  # embedding and head offloaded, each in its own chunk
        (False, 0, "inductor"),
    ],
)
def test_an_oversized_parameter_gets_its_own_chunk_and_trains_like_eager(tied, n_persist, compiler):
    r = compare_with_eager(
        big_vocab_llama(tied),
        random_batches(3, 2, 16, vocab=VOCAB),
        {"compiler": compiler, "n_persist": n_persist},
        give_optimizer=True,
    )
    # Inductor's kernels are not bit-exact against eager's (1e-8 per op, grown by Adam)
    param_tol = 1e-5 if compiler == "eager" else 1e-4
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= param_tol and r.max_param_update > 1e-3
    plan = r.plan
    big = oversized(plan)
    names = ["lm.model.embed_tokens.weight"] + ([] if tied else ["lm.lm_head.weight"])
    assert [c.params for c in big] == [[n] for n in names]
    assert big[0].id == 0 and (tied or big[1].id == len(plan.chunks) - 1)
    assert plan.chunk_size < VOCAB * 64 * 4 // 4  # sized for the blocks
    assert len(plan.chunks) > 8
    assert plan.chunks[0].placement == ("device" if n_persist else "host")
    assert "100%" in plan.summary()  # the oversized chunk is full: its own size
    # an offloaded oversized chunk's gradient goes to the host as it is: no device gradient buffer
    # of its size
    stores = {id(s): s for s in (store_of(p) for p in r.model.parameters()) if s is not None}
    for s in stores.values():
        as_is = [c for c in s.offloaded_chunks if s.grad_goes_as_is(c)]
        assert s.grad_buffers is None or s.grad_buffers.numel <= s.chunk_capacity
        assert bool(as_is) == any(s.chunk_numel(c) > s.chunk_capacity for c in s.offloaded_chunks)
    assert any(s.grad_goes_as_is(c) for s in stores.values() for c in s.offloaded_chunks) == (
        n_persist == 0
    )


@pytest.mark.parametrize("tied", [False, True])
def test_offloaded_oversized_gradients_with_accumulation_clipping_and_a_schedule(tied):
    """The gradients of offloaded oversized chunks go to the host without device buffers of their
    size: an untied head's as autograd made it, an embedding's as its lookup's rows
    (passes/sparse_embedding_grads.py; tied: the head's part arrives first). With two micro-steps
    per step (the second added to the first on the host), clipping (which reads every gradient
    before any update) and a learning-rate schedule, training still equals eager's."""
    r = compare_with_eager(
        big_vocab_llama(tied),
        random_batches(6, 2, 16, vocab=VOCAB),
        {"compiler": "eager", "n_persist": 0},
        give_optimizer=True,
        micro_steps=2,
        clip=0.05,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
    )
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-5 and r.max_param_update > 1e-3
    stores = {id(s): s for s in (store_of(p) for p in r.model.parameters()) if s is not None}
    big = sum(s.grad_goes_as_is(c) for s in stores.values() for c in s.offloaded_chunks)
    assert big == (1 if tied else 2)


def test_an_oversized_gradient_goes_to_the_host_in_its_own_dtype(monkeypatch):
    """Under autocast an untied head's weight gradient is the upcast of a bf16 matmul's: its
    oversized chunk's gradient goes down in bf16 (passes/optimizer_calls.py hands the op the
    gradient before the graph's upcast) and the host upcasts it into the fp32 accumulator (exact),
    so no fp32 table of the vocabulary's size is made on the device; the host stages it in two bf16
    buffers of its own, and the packed gradients' fp32 staging is no longer sized for it."""
    from protrain_fx.runtime.chunk_store import ChunkStore

    seen = []
    real = ChunkStore.copy_to_host

    def spy(self, flat, dst, on_compute_stream=False):
        if on_compute_stream:  # an oversized chunk's gradient
            seen.append((flat.dtype, dst.dtype, flat.numel()))
        return real(self, flat, dst, on_compute_stream)

    monkeypatch.setattr(ChunkStore, "copy_to_host", spy)
    model = big_vocab_llama(False)
    compiled, opt = offloaded(model)
    data = random_batches(4, 2, 16, vocab=VOCAB)
    losses = []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(x, y) / 2
        loss.backward()
        losses.append(loss.item())
        if i % 2:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    table = VOCAB * 64
    assert seen and all(s == (torch.bfloat16, torch.bfloat16, table) for s in seen), seen
    # the head's, every backward (the embedding's goes as its lookup's rows)
    assert len(seen) == len(data)
    assert all(math.isfinite(x) for x in losses)
    stores = {id(s): s for s in (store_of(p) for p in model.parameters()) if s is not None}
    oversized = [t for s in stores.values() for pool in s._oversized.values() for t in pool.free]
    # one pool: two bf16 tables
    assert len(oversized) == 2 and all(
        t.dtype == torch.bfloat16 and t.numel() == table for t in oversized
    )
    packed = [s._staging for s in stores.values() if s._staging is not None]
    assert all(t.numel() < table for p in packed for t in p.free)
