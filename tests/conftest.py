import os
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and leaves no dynamo state behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_plan_cache(monkeypatch):
    """Automatic plans are searched afresh in every test (tests/test_autoplan.py checks the cache
    itself)."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    """Every graph's code is compiled, its passes run (tests/test_code_cache.py checks the cache of
    compiled codes itself)."""
    monkeypatch.setenv("PROTRAIN_COMPILE_CACHE", "0")


@pytest.fixture
def whole_graph(monkeypatch):
    """The graph compiled whole (``PROTRAIN_REGIONS=0``), not in regions: for tests that read one
    graph's stages, dumps or passes (tests/test_regions.py covers regions)."""
    monkeypatch.setenv("PROTRAIN_REGIONS", "0")


SHARED = 6_000_000  # the shared device's budget, the reserve aside: 5.72 MiB


@pytest.fixture
def shared_cpu(monkeypatch):
    """The CPU taken for a CUDA device shared by the process's graphs (no ``memory_budget``), of
    ``RESERVE + SHARED`` bytes: what others have allocated there is what the chunk stores of other
    parameters hold resident (values, gradients, optimizer state, chunk buffers). Gives
    ``SHARED``."""
    import dataclasses
    import gc

    from protrain_fx import autoplan, budgets
    from protrain_fx import inference_placement as ip
    from protrain_fx.plan import plan as plans
    from protrain_fx.runtime import chunk_buffers, chunk_store
    from protrain_fx.runtime.chunk_store import live_stores
    from protrain_fx.runtime.optimizer_lookup import live_optimizers

    size = budgets.reserve_bytes(1 << 30) + SHARED
    gc.collect()  # the models of tests before: gone, as the device's allocations would be
    # models an earlier test left alive (kept by a cache outside protrain: a hook bound through a
    # default argument stays in dynamo's _spec_cache) are on no device of this test: their stores
    # and plans are hidden from it, and listed again after it where they are still alive
    stale_stores, stale_plans = dict(chunk_store._STORES), list(plans._ENTRIES)
    chunk_store._STORES.clear()
    plans._ENTRIES.clear()

    def usage(device, params, optimizer=None):
        mine = {id(p) for p in params if p is not None}
        own = [s for s in live_stores() if any(p is not None and id(p) in mine for p in s.params)]
        held = chunk_buffers.held_by(live_stores(), device) - chunk_buffers.held_by(own, device)
        states = [o.state for o in live_optimizers()]
        for s in live_stores():
            for p in s.params if s not in own else ():
                if p is not None and not s.param_is_offloaded(p):
                    state = [t for st in states for t in st.get(p, {}).values()]
                    tensors = [p, p.grad, *state]
                    held += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        return size, held, size

    real_wanted = autoplan.wanted
    monkeypatch.setattr(budgets, "device_usage", usage)
    monkeypatch.setattr(ip, "device_usage", usage)
    monkeypatch.setattr(ip, "shares_device", lambda o, d: d is not None and o.memory_budget is None)
    monkeypatch.setattr(
        autoplan,
        "wanted",
        lambda o, params, d: real_wanted(dataclasses.replace(o, memory_budget=1), params, d),
    )
    yield SHARED
    monkeypatch.undo()
    gc.collect()  # the stores of this test's models go before the next test starts
    for k, store in stale_stores.items():
        if any(p is not None for p in store.params):
            chunk_store._STORES.setdefault(k, store)
    plans._ENTRIES[:0] = [e for e in stale_plans if all(r() is not None for r in e.params)]
