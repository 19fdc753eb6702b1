"""Block detection (our models, Hugging Face models, models without blocks) and chunk packing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import build

import protrain_fx
from protrain_fx.errors import OptionsError
from protrain_fx.graph.inputs import fqn_from_source
from protrain_fx.plan.layout import ALIGN_BYTES, choose_chunk_size, pack
from protrain_fx.testing import compare_with_eager, random_batches


@pytest.mark.parametrize(
    "source, fqn",
    [
        (
            "L['self']._modules['blocks']._modules['0']._modules['ln1']._parameters['weight']",
            "blocks.0.ln1.weight",
        ),
        ("L['self'].blocks[0].ln1.weight", "blocks.0.ln1.weight"),
        ("L['self'].blocks.0", "blocks.0"),
        ("L['args'][0].model.layers.3", "model.layers.3"),
        ("L['self']", ""),
        ("L['self']._buffers['rope_cos']", "rope_cos"),
        ("not a source", None),
    ],
)
def test_fqn_from_source(source, fqn):
    assert fqn_from_source(source) == fqn


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_blocks_of_example_models(kind):
    torch.manual_seed(0)
    model = build(kind, n_layer=3)
    compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
    compiled(*random_batches(1, 1, 8)[0]).backward()
    plan = protrain_fx.get_plan(compiled)
    assert [b.name for b in plan.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert plan.block_container == "blocks"
    # every parameter is in exactly one chunk, in first-use order, tied embeddings once
    names = [p for c in plan.chunks for p in c.params]
    assert sorted(names) == sorted(dict(model.named_parameters()))  # named_parameters() dedups ties
    assert names[0] in ("wte.weight", "tok_embeddings.weight")
    assert (
        plan.param_block["blocks.1.ffn_norm.weight" if kind == "llama" else "blocks.1.ln2.bias"]
        == "blocks.1"
    )


transformers = pytest.importorskip("transformers")


def _hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    llama = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return {
        "gpt2": (GPT2LMHeadModel, gpt2, "transformer.h"),
        "llama": (LlamaForCausalLM, llama, "model.layers"),
    }


class LossOf(torch.nn.Module):
    """HF causal LMs return an output object; train on its .loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=y).loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models(name):
    cls, cfg, container = _hf_models()[name]
    cfg.loss_type = "ForCausalLM"
    torch.manual_seed(0)
    model = LossOf(cls(cfg))
    r = compare_with_eager(model, random_batches(3, 2, 8), {"compiler": "eager"})
    assert r.max_loss_rel <= 1e-5 and r.max_param_abs <= 1e-3
    assert [b.name for b in r.plan.blocks] == [f"lm.{container}.0", f"lm.{container}.1"]


def test_pack_first_use_order_and_alignment():
    params = [("a", 100), ("b", 300), ("c", 64), ("d", 500), ("e", 1)]

    def placed(layout):  # (fqn, chunk, offset) of every parameter
        return [(s.fqn, s.chunk, s.offset) for s in layout.slots]

    layout = pack(params, 512)
    assert placed(layout) == [("a", 0, 0), ("b", 0, 128), ("c", 0, 448), ("d", 1, 0), ("e", 2, 0)]
    assert all(s.offset % ALIGN_BYTES == 0 for s in layout.slots)
    assert layout.n_chunks == 3 and layout.waste_bytes == 3 * 512 - 965
    # parameters larger than the chunk size get chunks of their own, exactly their (aligned) size
    small = pack(params, 256)
    assert placed(small) == [("a", 0, 0), ("b", 1, 0), ("c", 2, 0), ("d", 3, 0), ("e", 4, 0)]
    assert [small.capacity(c) for c in range(5)] == [256, 320, 256, 512, 256]
    assert small.oversized == [1, 3]
    assert small.waste_bytes == 256 + 320 + 256 + 512 + 256 - 965
    with pytest.raises(OptionsError, match="smaller than the 64 B alignment"):
        pack(params, 32)


def test_chunks_are_sized_for_the_blocks_not_for_a_large_embedding():
    """Llama-3.2-3B's shape: the 128256 x 3072 embedding (1.47 GiB in fp32) no longer sets the
    chunk size; it gets a chunk of its own and the blocks' chunks are sized for their largest
    matrix (8192 x 3072)."""
    emb = ("embed", 128256 * 3072 * 4)
    layer = [
        (f"l{i}.{n}", rows * 3072 * 4)
        for i in range(4)
        for n, rows in (("q", 3072), ("k", 1024), ("v", 1024), ("o", 3072), ("up", 8192))
    ]
    params = [emb] + layer + [("norm", 3072 * 4)]
    size = choose_chunk_size(params, block_params=layer)
    assert 8192 * 3072 * 4 <= size <= 2 * 8192 * 3072 * 4
    layout = pack(params, size)
    assert layout.oversized == [0] and layout.params_of(0)[0].fqn == "embed"
    assert layout.capacity(0) == emb[1] and all(
        layout.capacity(c) == size for c in range(1, layout.n_chunks)
    )
    # without the blocks the embedding sets the size, as before
    assert choose_chunk_size(params) >= emb[1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40))
def test_choose_chunk_size_is_feasible_and_no_worse_than_the_tightest(sizes):
    params = [(f"p{i}", n) for i, n in enumerate(sizes)]
    size = choose_chunk_size(params)
    layout = pack(params, size)  # feasible: every parameter fits
    tightest = pack(params, max((n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES for n in sizes))
    assert layout.waste_bytes <= tightest.waste_bytes
    # greedy packing keeps first-use order and never splits a parameter
    assert [s.fqn for s in layout.slots] == [p for p, _ in params]
    assert all(s.offset + s.nbytes <= size for s in layout.slots)
