"""Small, randomly initialised Hugging Face models for the habit tests (built from configs: no
hub access)."""

from __future__ import annotations

import torch

HF_VOCAB = 512


def llama_config(**overrides):
    import transformers

    kw = dict(
        vocab_size=HF_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def hf_llama(seed: int = 0, **overrides):
    """``LlamaForCausalLM`` (4 layers, width 128, GQA 4/2 heads, tied embeddings, eager attention),
    in train mode, built under ``torch.manual_seed(seed)``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**overrides))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == model.config.tie_word_embeddings
    return model.train()


def hf_gpt2(seed: int = 0, **overrides):
    """``GPT2LMHeadModel`` (2 layers, width 64, tied embeddings, eager attention) with its default
    dropout (0.1 on the embeddings, attention and residuals), in train mode, built under
    ``torch.manual_seed(seed)``."""
    import transformers

    kw = dict(
        vocab_size=HF_VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        attn_implementation="eager",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw)).train()


def hf_loss(model, x, y=None):
    """Hugging Face's own loss: the labels are the inputs (shifted inside the model)."""
    return model(input_ids=x, labels=x).loss


def hf_loss_no_cache(model, x, y=None):
    """The same with ``use_cache=False``, as training scripts pass it: without a KV cache object the
    decoder layers no longer differ by ``layer_idx`` and dynamo traces one graph for all of them."""
    return model(input_ids=x, labels=x, use_cache=False).loss


class LossOnly(torch.nn.Module):
    """An HF causal LM called as ``(x, y) -> loss`` with its own loss (labels = inputs), returning
    the loss alone: its logits feed nothing else."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=x, use_cache=False).loss


# a vocabulary whose table (2048 x 64 fp32 = 512 KiB) is far larger than the blocks' largest matrix
# (32 KiB): it gets a chunk of its own (issue 24.1)
BIG_VOCAB = 2048


def big_vocab_llama(tied: bool) -> LossOnly:
    """A small HF Llama (width 64, GQA 4/2 heads) whose embedding (and untied head) is larger than
    any chunk its blocks make, called as ``(x, y) -> loss``."""
    return LossOnly(
        hf_llama(
            vocab_size=BIG_VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
    )


def clipped_steps(model, loss_of, opt, batches, max_norm: float = 0.5) -> list[float]:
    """Training steps as a loop that clips writes them: ``loss_of(batch)``, backward, the
    gradients clipped to ``max_norm``, ``opt.step()``, ``zero_grad()``; the losses."""
    losses = []
    for batch in batches:
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def largest_param_bytes(model) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def offloaded(model, lr: float = 1e-3, **options):
    """``model`` compiled with protrain's eager compiler, every chunk offloaded, and its AdamW (the
    optimizer the offloaded chunks need): (compiled, optimizer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "n_persist": 0, "optimizer": opt, **options},
    )
    return compiled, opt
