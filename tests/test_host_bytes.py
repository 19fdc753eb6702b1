"""The automatic plan's host memory against what the runtime allocates (issue 25: host memory
planned like device memory). After two steps every host buffer exists: the offloaded chunks' fp32
masters, their transfer copies (when the transfer dtype differs), gradient accumulators and Adam
moments, the staging of packed gradients where later ones are summed on the host worker (shared by
the stores of a model compiled in regions; none where they are summed on the compute device,
runtime/grad_add.py, the default with one rank) and of oversized ones. Their bytes, each storage
counted once, must be the plan's ``host_bytes`` (with ``PROTRAIN_DEVICE_GRAD_ADD=0`` too)."""

from __future__ import annotations

import gc

import pytest
import torch
from hf_models import hf_llama, hf_loss

import protrain_fx
from protrain_fx.machine import pinned
from protrain_fx.runtime.chunk_store import store_of
from protrain_fx.testing import random_batches


def allocated_host_bytes(model, opt) -> dict[str, int]:
    """The host buffers protrain holds for ``model`` and its optimizer, by kind, each storage
    once."""
    seen: dict[int, tuple[int, str]] = {}

    def add(t, kind):
        if t is not None:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (s.nbytes(), kind))

    stores = {id(s): s for p in model.parameters() if (s := store_of(p)) is not None}
    for s in stores.values():
        for t in s.master.values():
            add(t, "master")
        for t in s.transfer.values():
            add(t, "transfer")
        for t in s.grad.values():
            add(t, "gradient")
        for t in s._staging.free if s._staging is not None else []:
            add(t, "staging")
        for pool in s._oversized.values():
            for t in pool.free:
                add(t, "oversized staging")
    for st in opt._protrain_hybrid.states.values():
        add(st.exp_avg, "moments")
        add(st.exp_avg_sq, "moments")
    out: dict[str, int] = {}
    for nbytes, kind in seen.values():
        out[kind] = out.get(kind, 0) + nbytes
    return out


@pytest.mark.parametrize(
    "overrides, budget",
    [
        ({}, 3_000_000),  # tied embeddings, chunks packed by block
        ({"vocab_size": 8192, "tie_word_embeddings": False}, 12_000_000),  # oversized head
    ],
    ids=["tied", "untied_oversized"],
)
def test_predicted_host_bytes_are_the_allocated_ones(overrides, budget):
    """... and protrain's count of the host buffers it holds (``pinned.held_bytes``, what the plan
    summary shows as measured) is exactly those buffers, and drops back when the model goes."""
    gc.collect()
    before = pinned.held_bytes()[0]
    model = hf_llama(**overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "optimizer": opt, "memory_budget": budget},
    )
    for x, _ in random_batches(2, 2, 16, vocab=model.config.vocab_size):
        hf_loss(compiled, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    plan = protrain_fx.get_plan(compiled)
    assert any(c.placement == "host" for c in plan.chunks)
    got = allocated_host_bytes(model, opt)
    assert got.get("master") and got.get("moments") == 2 * got["master"], got
    if overrides:
        assert got.get("oversized staging"), got
    # the loop keeps gradients between steps (set_to_none=False): re-planned to count them, the
    # plan may swap blocks, whose pinned buffers live during the step only
    swapped = plan.predicted["breakdown"]["swapped_bytes"]
    assert sum(got.values()) == plan.predicted["host_bytes"] - swapped, (got, plan.predicted)
    assert pinned.held_bytes()[0] - before == sum(got.values())
    # where resident gradients were kept (the tied model's plan keeps chunks resident), told from
    # accumulation by their values (zeros): one micro-step a step
    held = plan.predicted.get("grads_held") or ""
    assert bool(held) == (not overrides), held
    assert not held or "zeroed, at a forward: zero_grad(set_to_none=False)" in held, held
    assert plan.predicted["breakdown"]["micro_steps"] == 1
    del compiled, model, opt, plan
    gc.collect()
    assert pinned.held_bytes()[0] == before


def train_under_autocast(model, **options):
    """Two steps of ``model`` under bf16 autocast with protrain (a 3 MB budget and ``options``):
    ``(plan, allocated_host_bytes)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = dict(compiler="eager", optimizer=opt, memory_budget=3_000_000, **options)
    compiled = torch.compile(model, backend="protrain", options=options)
    for x, _ in random_batches(2, 2, 16, vocab=model.config.vocab_size):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = hf_loss(compiled, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return protrain_fx.get_plan(compiled), allocated_host_bytes(model, opt)


def test_the_automatic_plan_drops_transfer_copies_the_host_cannot_hold(monkeypatch):
    """Under bf16 autocast a plan with host transfer copies needs 2 bytes more per offloaded
    parameter; with a host that holds the plan without them but not with them, the automatic plan
    keeps none (and says so), and predicts its host bytes exactly. Every chunk offloaded and no
    block swapped (given), so that no other plan needs less host memory."""
    from protrain_fx.machine import memory

    def run(host_budget, **given):
        if host_budget is not None:
            monkeypatch.setattr(memory, "pinnable_host", lambda *a, **k: host_budget)
        torch._dynamo.reset()
        return train_under_autocast(hf_llama(), n_persist=0, n_swap=0, **given)

    plan, got = run(None, transfer_copies=True)  # given: the copies' host bytes
    assert plan.transfer_copies and got.get("transfer"), got
    copies = plan.predicted["host_bytes"]
    assert sum(got.values()) == copies
    plan, got = run(copies - got["transfer"] // 2)  # room for half the copies
    assert not plan.transfer_copies and not got.get("transfer"), got
    assert any("no plan with host transfer copies" in n for n in plan.notes), plan.notes
    assert sum(got.values()) == plan.predicted["host_bytes"] < copies


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_oversized_gradient_staged_in_bf16_under_autocast_is_predicted_exactly(tied):
    """A chunk size under the embedding's makes it (and an untied head) an oversized chunk, whose
    gradient goes to the host as autograd made it: under bf16 autocast the head's in bf16, staged
    so; an untied embedding's as its rows (no staging). The plan prices the staging as the profiled
    step saw it, so its host bytes are the allocated ones (priced in the master dtype, the tied
    model's were 256 KiB over)."""
    plan, got = train_under_autocast(
        hf_llama(tie_word_embeddings=tied), n_persist=0, chunk_size=1 << 17
    )
    assert plan.chunk_size == 1 << 17 and got.get("oversized staging"), got
    assert sum(got.values()) == plan.predicted["host_bytes"], (got, plan.predicted["host_bytes"])


def test_a_low_precision_gradient_is_added_without_a_host_copy_of_its_size():
    """An oversized chunk's bf16 gradient added into its fp32 accumulator (a second micro-step):
    exact like ``add_``, and the process's peak resident memory grows by a slice, not by an fp32
    copy of the whole gradient (``add_`` of another dtype makes one on the CPU: 256 MiB here)."""
    import subprocess
    import sys

    from protrain_fx.runtime.chunk_grads import UPCAST_ADD_BLOCK, add_upcast

    n = 3 * UPCAST_ADD_BLOCK + 12345  # slices, and a last one that is short
    gen = torch.Generator().manual_seed(0)
    acc = torch.randn(n, generator=gen)
    src = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = acc + src.float()
    add_upcast(acc, src)
    assert torch.equal(acc, want)
    script = (
        "import resource, torch\n"
        "from protrain_fx.runtime.chunk_grads import add_upcast\n"
        "n = 64 * 2**20\n"
        "acc = torch.zeros(n); src = torch.ones(n, dtype=torch.bfloat16)\n"
        "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        # the kernels' first use (intra-op threads, their allocator arenas) before measuring
        "add_upcast(torch.zeros(2**22), torch.ones(2**22, dtype=torch.bfloat16))\n"
        "before = peak(); add_upcast(acc, src); after = peak()\n"
        "assert acc[0] == acc[-1] == 1\n"
        "print(after - before)\n"
    )
    cmd = [sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    # a slice is 16 MiB of fp32; add_ itself would have grown it by the whole 256 MiB
    assert grown < 64 * 2**20, grown
