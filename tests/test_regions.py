"""A model compiled in regions (issue 23, deliverable 1): the dynamo graph cut at its block
boundaries (protrain_fx/graph/regions.py), each distinct region compiled once and its code run for
every block like it, each block on its own chunks and under its own policy
(protrain_fx/region_program.py); one plan for the whole model. Every plan trains like eager PyTorch;
a block that computes otherwise, or runs under another policy or placement, gets its own code."""

import copy

import pytest
import torch
import torch.nn as nn
from hf_models import hf_llama, hf_loss
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from models import build

import protrain_fx
from protrain_fx import backend
from protrain_fx.testing import compare_with_eager, random_batches, stores_of, train_steps

LOSS_REL, PARAM_ABS = 1e-5, 1e-3


def count_compiles(monkeypatch) -> list:
    """The graphs compiled through the pipeline (one per region code), recorded by name."""
    seen = []
    real = backend._compile_plan

    def counting(gm, example_inputs, graph_inputs, params, plan, opts):
        seen.append(plan.graph_name)
        return real(gm, example_inputs, graph_inputs, params, plan, opts)

    monkeypatch.setattr(backend, "_compile_plan", counting)
    return seen


def hf(layers=6, **kw):
    class LossOf(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, x, y):
            return hf_loss(self.lm, x)

    return LossOf(hf_llama(num_hidden_layers=layers, **kw))


def test_hf_llama_in_regions_trains_like_eager_with_each_distinct_block_compiled_once(monkeypatch):
    """Llama (tied 512 vocabulary, GQA) with 6 blocks: block 0 swapped, blocks 1-2 recomputed, the
    rest kept; the first chunks resident, a block partly resident, the rest offloaded. Blocks that
    share policy and placement share one compiled code."""
    compiled_names = count_compiles(monkeypatch)
    base = hf(6)
    emb = base.lm.model.embed_tokens.weight
    # the (tied) embedding fills a chunk; a block's attention, gate+up and down projections take
    # three
    chunk = emb.numel() * 4 + 8192
    r = compare_with_eager(
        base,
        random_batches(4, 2, 16, vocab=512),
        {
            "compiler": "eager",
            "chunk_size": chunk,
            "n_persist": 6,  # the embedding, block 0, two thirds of block 1
            "n_swap": 1,
            "n_checkpoint": 2,
            "n_buffer": 1,
        },
        give_optimizer=True,
        lr=1e-2,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (r.losses, r.ref_losses)
    assert r.max_param_update > 1e-3
    plan = r.plan
    assert [b.policy for b in plan.blocks] == ["swap"] + ["recompute"] * 2 + ["keep"] * 3
    # one store per region that owns parameters; chunks never span two of them
    stores = stores_of(r.model)
    assert [s.n_chunks for s in stores] == [1] + [3] * 6 + [1]  # pre, the blocks, post (norm)
    assert [s.n_persist for s in stores] == [1, 3, 2] + [0] * 5
    assert sum(s.n_chunks for s in stores) == len(plan.chunks)
    placements = [c.placement for c in plan.chunks]
    assert placements[:6] == ["device"] * 6 and set(placements[6:]) == {"host"}
    # pre, block 0 (swap, resident), block 1 (recompute, 2 of 3), block 2 (recompute, offloaded),
    # blocks 3-5 (keep, offloaded: one code), post
    assert len(compiled_names) == 6, compiled_names
    note = next(n for n in plan.notes if n.startswith("compiled in"))
    assert "8 regions with 6 distinct codes" in note and "x3" in note, note


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_regions_with_inductor_train_like_eager(kind, monkeypatch):
    """Inductor compiles each region's code; offloaded chunks, a swapped block and recomputed ones
    over the same code: eager's losses and parameters (a poisoned buffer shows a stale read)."""
    monkeypatch.setenv("PROTRAIN_DEBUG_POISON", "1")
    compiled_names = count_compiles(monkeypatch)
    torch.manual_seed(0)
    model = build(kind, n_layer=5, **({"n_embd": 32, "n_head": 2} if kind == "gpt" else {}))
    r = compare_with_eager(
        model,
        random_batches(3, 2, 16),
        {"compiler": "inductor", "n_persist": 3, "n_swap": 1, "n_checkpoint": 1},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (r.losses, r.ref_losses)
    assert len(compiled_names) < 7  # 7 regions, fewer codes
    assert r.plan.swapped  # block 0 swapped what it saved


def test_hf_llama_in_regions_with_inductor_under_an_offloading_budget_trains_like_eager():
    """Hugging Face's Llama (tied head, GQA, its own loss) under Inductor and an automatic plan
    whose budget forces offloading: profiled and compiled in regions, eager's losses and weights."""
    base = hf(6)
    states = sum(p.numel() * 4 for p in base.parameters())
    budget = 2 * states  # under weights + gradients + two moments: chunks must leave the device
    r = compare_with_eager(
        base,
        random_batches(3, 2, 16, vocab=512),
        {"compiler": "inductor", "memory_budget": budget},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (r.losses, r.ref_losses)
    assert r.max_param_update > 1e-4
    assert any(c.placement == "host" for c in r.plan.chunks)
    assert r.plan.predicted["peak_bytes"] <= budget
    assert any(n.startswith("compiled in") for n in r.plan.notes), r.plan.notes


@pytest.mark.parametrize("n_buffer", [1, 2])
def test_the_next_regions_first_chunks_are_prefetched_ahead(monkeypatch, n_buffer):
    """A region's graph prefetches its own chunks from its start on; the chunks the next region
    gathers first (forward, and in backward the region before) are prefetched as soon as a region's
    code is queued, into free buffers, from the order recorded at their first run. Exact under
    poisoned buffers, every gather finds its chunk prefetched."""
    monkeypatch.setenv("PROTRAIN_DEBUG_POISON", "1")
    base = hf(4)
    chunk = max(p.numel() * 4 for p in base.lm.model.layers[0].parameters()) + 4096
    r = compare_with_eager(
        base,
        random_batches(4, 2, 16, vocab=512),
        {
            "compiler": "eager",
            "chunk_size": chunk,
            "n_persist": 0,
            "n_checkpoint": 2,
            "n_buffer": n_buffer,
        },
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (r.losses, r.ref_losses)
    buffers = {id(s.buffers): s.buffers for s in stores_of(r.model) if s.buffers is not None}
    stats = [b.stats for b in buffers.values()]
    assert sum(s["ahead"] for s in stats) > 0
    assert sum(s["unprefetched_gathers"] for s in stats) == 0
    # the recorded orders were right: no buffer reserved ahead was needed for another chunk
    assert sum(s["ahead_taken_back"] for s in stats) == 0, stats


def hf_model(kind: str):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=512, max_position_embeddings=64)
    if kind == "gpt2":  # tied head, Conv1D layers, learned positions
        cfg = transformers.GPT2Config(
            n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            vocab_size=512, n_positions=64,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    llama_like = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        **common,
    )
    if kind == "qwen2":  # untied head, biased q/k/v
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(tie_word_embeddings=False, **llama_like)
        )
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(sliding_window=None, **llama_like)
    )


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "mistral"])
def test_hf_models_in_regions_train_like_eager(kind):
    """Hugging Face's GPT-2, Qwen2 and Mistral classes with their own loss, a swapped, two
    recomputed and a kept block, the first chunk resident: eager's losses and weights bit for bit
    (eager compiler)."""

    class LossOf(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, x, y):
            return self.lm(input_ids=x, labels=x, use_cache=False).loss

    r = compare_with_eager(
        LossOf(hf_model(kind).train()),
        random_batches(3, 2, 16, vocab=512),
        {"compiler": "eager", "n_persist": 1, "n_checkpoint": 2, "n_swap": 1},
        give_optimizer=True,
        lr=1e-2,
    )
    assert r.max_loss_rel == 0.0 and r.max_param_abs == 0.0, (r.losses, r.ref_losses)
    assert r.max_param_update > 1e-2
    note = next(n for n in r.plan.notes if n.startswith("compiled in"))
    assert "6 regions with 5 distinct codes" in note, note


class Mixed(nn.Module):
    """Blocks of one class in a ModuleList, block 2 with a wider MLP: it computes otherwise."""

    class Block(nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    def __init__(self, d=16, widths=(32, 32, 64, 32, 32)):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(self.Block(d, f) for f in widths)
        self.head = nn.Linear(d, 64)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_a_block_that_computes_otherwise_or_under_another_policy_gets_its_own_code(monkeypatch):
    compiled_names = count_compiles(monkeypatch)
    torch.manual_seed(0)
    r = compare_with_eager(
        Mixed(),
        random_batches(3, 2, 8, vocab=64),
        {"compiler": "eager", "n_checkpoint": 1},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS
    # pre; block 0 (recompute); blocks 1, 3, 4 (keep, width 32): one code; block 2 (width 64); post
    names = [n.rsplit(":", 1)[1] for n in compiled_names]
    assert names == ["pre", "blocks.0", "blocks.1", "blocks.2", "post"], names


class Shared(nn.Module):
    """Every block runs the same weights (ALBERT-style): the first block's region owns them, the
    others read them, and their chunk gets a gradient from every block's backward."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        block = Mixed.Block(d, 32)
        self.blocks = nn.ModuleList([block] * n)
        self.head = nn.Linear(d, 64)

    forward = Mixed.forward


@pytest.mark.parametrize("n_persist", [0, 1])
def test_blocks_that_share_their_weights_train_like_eager(n_persist):
    torch.manual_seed(0)
    r = compare_with_eager(
        Shared(),
        random_batches(4, 2, 8, vocab=64),
        {"compiler": "eager", "n_persist": n_persist, "n_checkpoint": 1},
        give_optimizer=True,
        lr=1e-2,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (r.losses, r.ref_losses)
    assert r.max_param_update > 1e-3


def test_whole_and_regions_agree_on_what_the_blocks_keep(monkeypatch):
    """The automatic plan's static profile, from each region's partitions, against the whole
    graph's: the same bytes kept per recomputed block (its input), the same total kept by the
    blocks and the code outside them under either policy."""
    profiles = {}
    for regions in (False, True):
        monkeypatch.setenv("PROTRAIN_REGIONS", "1" if regions else "0")
        monkeypatch.setenv("PROTRAIN_PROFILE_WHOLE", "1")
        torch._dynamo.reset()
        model = hf(4)  # blocks 1 and 2 are compared alone, 0 and 3 in the totals
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(
            model, backend="protrain", options={"compiler": "eager", "memory_budget": "64MiB"}
        )
        train_steps(model, compiled, random_batches(1, 2, 16, vocab=512), opt=opt)
        profiles[regions] = protrain_fx.get_plan(compiled).predicted["profiled"]
    whole, regions = profiles[False], profiles[True]
    # a recomputed block keeps its input; the whole graph counts the rotary tables for block 0 (the
    # first that reads them) and the last block's output for the last block (its producer): a
    # region's graph counts them outside the blocks
    assert regions["saved_recompute"][1:-1] == whole["saved_recompute"][1:-1]
    for policy in ("keep", "recompute"):
        total = sum(regions[f"saved_{policy}"]) + regions[f"saved_nonblock_{policy}"]
        assert total == sum(whole[f"saved_{policy}"]) + whole[f"saved_nonblock_{policy}"], policy
    assert len(regions["block_fwd_ms"]) == 4 and all(t > 0 for t in regions["block_fwd_ms"])


def test_an_automatic_plan_in_regions_profiles_with_the_code_it_reuses(monkeypatch, caplog):
    """The profiling plan compiles the code before the blocks, one block and the code after them,
    however many blocks there are; the chosen plan adds only the codes it needs."""
    compiled_names = count_compiles(monkeypatch)
    torch.manual_seed(0)
    model = build("gpt", n_layer=8, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    budget = 2 * sum(p.numel() * 4 for p in model.parameters())
    r = compare_with_eager(
        model,
        random_batches(3, 2, 16, vocab=64),
        {"compiler": "eager", "memory_budget": budget},
        give_optimizer=True,
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS
    profiling = [n for n in compiled_names[:3]]
    assert [n.rsplit(":", 1)[1] for n in profiling] == ["pre", "blocks.0", "post"], compiled_names
    assert len(compiled_names) - 3 < 8  # the chosen plan: fewer codes than regions
    assert r.plan.predicted["peak_bytes"] <= budget
    assert r.plan.n_persist < len(r.plan.chunks)


def test_dumps_of_a_model_in_regions(tmp_path):
    """dump_dir: the whole graph's folder holds its dynamo graph and the whole plan; each region
    code has a folder under regions/ with its stages (its chunk ops in fw.py and bw.py)."""
    import json
    import os

    torch.manual_seed(0)
    model = build("gpt", n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    r = compare_with_eager(
        model,
        random_batches(1, 2, 16, vocab=64),
        {"compiler": "eager", "n_persist": 2, "n_checkpoint": 1, "dump_dir": str(tmp_path)},
        give_optimizer=True,
    )
    (whole,) = [tmp_path / g for g in os.listdir(tmp_path)]
    assert sorted(os.listdir(whole)) == ["annotations.tsv", "dynamo.py", "plan.json", "regions"]
    assert json.loads((whole / "plan.json").read_text()) == r.plan.to_dict()
    codes = sorted(os.listdir(whole / "regions"))
    note = next(n for n in r.plan.notes if n.startswith("compiled in"))
    assert f"with {len(codes)} distinct codes" in note, (codes, note)
    for code in codes:
        files = set(os.listdir(whole / "regions" / code))
        assert {"dynamo.py", "joint.py", "fw.py", "bw.py", "plan.json"} <= files
    offloaded = [
        (whole / "regions" / c / "fw.py").read_text()
        for c in codes
        if "protrain.gather" in (whole / "regions" / c / "fw.py").read_text()
    ]
    assert offloaded  # the offloaded blocks' codes gather their chunks


# Each example compiles a new program (seconds): no shrinking, a failure prints the knobs.
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    layers=st.integers(2, 5),
    persist=st.integers(0, 12),
    n_swap=st.integers(0, 2),
    n_checkpoint=st.integers(0, 3),
    n_buffer=st.integers(1, 3),
    tied=st.booleans(),
)
def test_every_plan_in_regions_trains_like_eager(
    layers, persist, n_swap, n_checkpoint, n_buffer, tied
):
    """Any placement and policies over the shared codes, HF's own loss, tied or untied head."""
    torch._dynamo.reset()
    base = hf(layers, tie_word_embeddings=tied)
    chunk = max(p.numel() * 4 for p in base.lm.model.layers[0].parameters()) + 1024
    opts = {
        "compiler": "eager",
        "chunk_size": chunk,
        "n_persist": persist,
        "n_swap": n_swap,
        "n_checkpoint": n_checkpoint,
        "n_buffer": n_buffer,
    }
    r = compare_with_eager(
        copy.deepcopy(base), random_batches(3, 2, 8, vocab=512), opts, give_optimizer=True
    )
    assert r.max_loss_rel <= LOSS_REL and r.max_param_abs <= PARAM_ABS, (opts, r.losses)
    assert any(n.startswith("compiled in") for n in r.plan.notes), r.plan.notes
