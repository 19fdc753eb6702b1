"""Model families nobody here wrote, as users build them: Hugging Face causal LMs of other shapes
than Llama's (mixture-of-experts routing, soft-capped logits and alternating sliding windows, ALiBi
with a fused QKV, parallel residuals, learned positions, partial rotary embeddings), random init
from tiny configs, trained with ``labels=`` (HF's loss, some labels -100), AdamW and clipping, with
chunks offloaded, against eager PyTorch on the CPU in fp32. The graph passes and the runtime run
as on a GPU; ``compiler="eager"`` runs the transformed graphs without Inductor's reordering, so
the match is exact.

Padded batches with an ``attention_mask`` (either side) train exactly too.

Checked the same way outside CI on 28 families of transformers 5.25 (Phi-3, Gemma 1-3, OPT,
GPT-NeoX, Falcon, StableLM, Qwen3 and Qwen3-MoE, Mixtral, OLMo 2 and 3, Cohere, Granite,
StarCoder2, GPT-J, BLOOM, Phi, GPTBigCode, Mistral, Qwen2-MoE, SmolLM3, GLM, EXAONE 4, Llama 4,
DeepSeek-V3, gpt-oss): every one exact with the eager compiler; with Inductor the first gradients
within 3e-6 relative of eager's, as plain ``torch.compile``'s."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

V = 512
# a decoder of three blocks, four heads, width 64 (families name these fields so)
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
FAMILIES = {
    # routed experts: a token's expert choice depends on the values, so a wrong gather shows
    "Mixtral": dict(DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    # soft-capped attention and logits, local and global layers alternating, tied embeddings
    "Gemma2": dict(DECODER, num_key_value_heads=2, head_dim=16, sliding_window=8),
    # ALiBi, fused QKV, an embedding layer norm outside the blocks
    "Bloom": dict(hidden_size=64, n_layer=3, n_head=4),
    # parallel attention and MLP residuals, untied head
    "GPTNeoX": DECODER,
    # learned positions, a projection around the decoder
    "OPT": dict(DECODER, intermediate_size=None, ffn_dim=128, word_embed_proj_dim=64),
    # partial rotary embeddings, dense biases, a final layer norm with a bias
    "Phi": dict(DECODER, partial_rotary_factor=0.5),
}


def build(family: str):
    torch.manual_seed(0)
    fields = {k: v for k, v in FAMILIES[family].items() if v is not None}
    config = getattr(transformers, family + "Config")(vocab_size=V, pad_token_id=0, **fields)
    return getattr(transformers, family + "ForCausalLM")(config).train()


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randint(1, V, (2, 16), generator=g)
        labels = x.clone()
        labels[:, :3] = -100
        yield x, labels


def train(model, call) -> list[float]:
    from hf_models import clipped_steps

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loss_of = lambda batch: call(input_ids=batch[0], labels=batch[1]).loss  # noqa: E731
    return clipped_steps(model, loss_of, opt, batches(), max_norm=1.0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_with_offloaded_chunks_trains_like_eager(family):
    import protrain_fx

    ref = build(family)
    expected = train(ref, ref)
    torch._dynamo.reset()
    model = build(family)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    call = torch.compile(
        model, backend="protrain", options={"memory_budget": 3 * nbytes, "compiler": "eager"}
    )
    losses = train(model, call)
    plan = protrain_fx.get_plan(call)
    assert plan.n_persist < plan.layout.n_chunks  # chunks were offloaded
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padded_batches_with_an_attention_mask_train_like_eager(padding_side):
    """Batches as a tokenizer's collator gives them: rows of different lengths padded on one side,
    ``attention_mask`` beside ``input_ids`` and the padding's labels -100; a Llama with Llama 3's
    rope scaling and SDPA attention, chunks offloaded."""
    from hf_models import llama_config

    import protrain_fx

    rope = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )

    def build_llama():
        torch.manual_seed(0)
        config = llama_config(attn_implementation="sdpa", rope_scaling=rope, vocab_size=V)
        return transformers.LlamaForCausalLM(config).train()

    def padded():
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randint(1, V, (3, 16), generator=g)
            mask = torch.ones_like(x)
            for row, length in enumerate((16, 11, 7)):
                if padding_side == "right":
                    mask[row, length:] = 0
                else:
                    mask[row, : 16 - length] = 0
            yield x, mask, x.masked_fill(mask == 0, -100)

    def train_padded(model, call):
        from hf_models import clipped_steps

        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

        def loss_of(batch):
            return call(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss

        return clipped_steps(model, loss_of, opt, padded(), max_norm=1.0)

    ref = build_llama()
    expected = train_padded(ref, ref)
    torch._dynamo.reset()
    model = build_llama()
    call = torch.compile(
        model, backend="protrain", options={"memory_budget": 3_000_000, "compiler": "eager"}
    )
    losses = train_padded(model, call)
    plan = protrain_fx.get_plan(call)
    assert plan.n_persist < plan.layout.n_chunks  # chunks were offloaded
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
