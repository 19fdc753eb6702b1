"""Compiled code never touches protrain memory after protrain has let it go.

* Chunk buffers: with ``PROTRAIN_DEBUG_POISON`` a device chunk buffer is filled with NaN as soon as its
  gather has copied it out (and never served again without a fresh copy), so any kernel that still read it
  (Inductor fuses and reorders reads) would compute NaN. The parity suite below runs under it, with Inductor
  and the eager compiler; a control shows that a gather returning a view of the buffer (the old design)
  is caught.
* Swapped activations: with ``PROTRAIN_DEBUG_DEFER_OFFLOAD`` the CPU copies a swapped activation to the host
  only at its ``offload_wait``, as late as a GPU copy stream could: if the graph let Inductor reuse the
  source's memory before that, the copy would read another kernel's output.
"""
import copy

import pytest
import torch
from models import build

from protrain_fx import chunk_buffers, swap_pool
from protrain_fx.testing import compare_with_eager, random_batches

LOSS_REL, PARAM_ABS = 1e-5, 1e-3


def gpt():
    torch.manual_seed(0)
    return build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)


def llama():
    torch.manual_seed(0)
    return build("llama", n_layer=3, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, max_seq_len=32)


def hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class HFLoss(torch.nn.Module):
    """``model(x, y) -> loss`` around a Hugging Face causal LM trained with its own loss (``labels=``)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=y).loss


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(chunk_buffers, "POISON", True)


def assert_parity(r):
    assert r.max_loss_rel <= LOSS_REL, (r.losses, r.ref_losses)
    assert r.max_param_abs <= PARAM_ABS
    assert r.max_param_update > 1e-4


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_poisoned_chunk_buffers_keep_parity(poison, compiler):
    r = compare_with_eager(llama(), random_batches(3, 2, 16), {"compiler": compiler, "n_persist": 0,
                                                              "chunk_size": "40KB", "n_swap": 1},
                           give_optimizer=True, lr=1e-2)
    assert_parity(r)


def test_poisoned_chunk_buffers_hf_llama_inductor(poison):
    """A Hugging Face Llama with a tied embedding (read at both ends of forward), its own loss, every chunk
    offloaded, Inductor: the reuse the outside review found (the embedding lookup read after release)."""
    model = HFLoss(hf_llama())
    r = compare_with_eager(model, random_batches(3, 2, 16), {"n_persist": 0, "chunk_size": "128KB"},
                           give_optimizer=True, lr=1e-2)
    assert_parity(r)


def test_poison_catches_a_gather_that_returns_the_buffer(poison, monkeypatch):
    """The control: had gather handed compiled code a view of its buffer (which the next prefetch refills),
    the poisoned run would read NaN."""
    real = chunk_buffers.ChunkBuffers.gather

    def view_gather(self, key, numel, fill, on_compute=False):
        if self._find(key) is None:
            self.prefetch(key, fill, on_compute)
        slot = self._find(key)
        real(self, key, numel, fill, on_compute)  # copies the slot out, then poisons it
        return slot.buffer[:numel]  # what compiled code would read had it kept a view of the slot

    monkeypatch.setattr(chunk_buffers.ChunkBuffers, "gather", view_gather)
    model = gpt()
    compiled = torch.compile(copy.deepcopy(model), backend="protrain",
                             options={"compiler": "eager", "n_persist": 0, "chunk_size": "40KB",
                                      "optimizer": None})
    x, y = random_batches(1, 2, 16)[0]
    assert not torch.isfinite(compiled(x, y)).all()


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_deferred_offload_copies_keep_parity(monkeypatch, compiler):
    monkeypatch.setattr(swap_pool, "DEFER", True)
    r = compare_with_eager(llama(), random_batches(3, 2, 16), {"compiler": compiler, "n_swap": 3},
                           lr=1e-2)
    assert_parity(r)
    assert swap_pool.swapper(torch.device("cpu")).stats["offloaded_bytes"] > 0
