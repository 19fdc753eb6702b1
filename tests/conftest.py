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
