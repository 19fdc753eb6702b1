"""Plan schema, summary, get_plan; the annotate pass on a tiny graph; the pipeline declaration."""

import copy

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx import ProtrainError
from protrain_fx.graph.annotation import annotation_of
from protrain_fx.graph.blocks import detect_blocks
from protrain_fx.graph.build_plan import make_plan
from protrain_fx.graph.inputs import capture_graph_inputs
from protrain_fx.options import Options
from protrain_fx.passes.annotate import annotate
from protrain_fx.plan_cache import KNOBS
from protrain_fx.testing import random_batches, train_steps

# the plan's knobs (the ones a plan cache entry records, plus n_shard) and what it found
SCHEMA = set(KNOBS) | {"n_shard", "chunks", "blocks", "predicted", "measured"}


def _compiled(n_embd=32):
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=n_embd, n_head=2)
    compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
    train_steps(model, compiled, random_batches(1, 2, 8))
    return model, compiled


def test_plan_to_dict_schema_and_summary():
    model, compiled = _compiled()
    plan = protrain_fx.get_plan(compiled)
    d = plan.to_dict()
    assert set(d) == SCHEMA
    assert all(set(c) == {"id", "bytes", "params", "placement"} for c in d["chunks"])
    assert all(set(b) == {"name", "policy"} for b in d["blocks"])
    assert d["predicted"] is None and d["measured"] is None
    assert [c["id"] for c in d["chunks"]] == list(range(len(d["chunks"])))
    assert all(c["placement"] == "device" for c in d["chunks"]) and d["n_persist"] == len(
        d["chunks"]
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(c["bytes"] for c in d["chunks"]) == total
    # a chunk holds at most chunk_size bytes, or one parameter larger than that (its own chunk)
    assert all(c["bytes"] <= d["chunk_size"] or len(c["params"]) == 1 for c in d["chunks"])
    assert any(c["bytes"] > d["chunk_size"] for c in d["chunks"])  # the embedding, sized apart
    s = plan.summary()
    for needle in (
        "chunk_size=",
        "n_persist=",
        "resident on the device",
        "blocks.1",
        "keep",
        "predicted -",
        "measured -",
    ):
        assert needle in s, needle


def test_get_plan_finds_the_models_plan():
    model_a, compiled_a = _compiled()
    model_b, compiled_b = _compiled(n_embd=48)
    assert protrain_fx.get_plan(compiled_a) is protrain_fx.get_plan(model_a)
    assert protrain_fx.get_plan(compiled_a) is not protrain_fx.get_plan(compiled_b)
    assert protrain_fx.get_plan() is protrain_fx.get_plan(compiled_b)  # newest of all
    with pytest.raises(ProtrainError, match="call it once"):
        protrain_fx.get_plan(torch.compile(build("gpt", n_layer=1), backend="protrain"))


def test_pipeline_is_declared_in_one_place():
    from protrain_fx import pipeline

    assert set(pipeline.STAGES) == {"dynamo", "joint", "forward", "backward", "inference"}
    assert pipeline.PASSES[pipeline.STAGES["joint"][0]].run is annotate
    for names in pipeline.STAGES.values():
        for name in names:
            assert pipeline.PASSES[name].run.__doc__, name


def test_annotate_on_a_tiny_graph():
    """Trace a two-block model to a dynamo graph by hand and run annotate on its joint graph."""
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x).sum()

    seen = {}

    def capture(gm, example_inputs):
        inputs, _ = capture_graph_inputs(gm, example_inputs)
        structure = detect_blocks(gm)
        seen["plan"] = make_plan("t", inputs, structure, Options.from_dict({"chunk_size": 128}))
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def partition(joint, joint_inputs, **kw):
            seen["joint"] = annotate(joint, seen["plan"])
            from torch._functorch.partitioners import default_partition

            return default_partition(joint, joint_inputs, **kw)

        return aot_autograd(
            fw_compiler=lambda g, e: make_boxed_func(g.forward), partition_fn=partition
        )(gm, example_inputs)

    m = Tiny()
    torch.compile(m, backend=capture)(torch.randn(3, 4)).backward()
    plan, joint = seen["plan"], seen["joint"]
    assert [b.name for b in plan.blocks] == ["layers.0", "layers.1"]
    # 64-byte weights + 16-byte biases, each padded to 64 bytes, in 128-byte chunks: one layer per
    # chunk
    assert plan.param_chunk == {
        "layers.0.weight": 0,
        "layers.0.bias": 0,
        "layers.1.weight": 1,
        "layers.1.bias": 1,
        "head.weight": 2,
        "head.bias": 2,
    }
    anns = {n.name: annotation_of(n) for n in joint.graph.nodes if n.op != "output"}
    assert all(a is not None for a in anns.values())
    params = {a.param: (a.chunk, a.block_name) for a in anns.values() if a.input_kind == "param"}
    assert params["layers.1.weight"] == (1, "layers.1") and params["head.bias"] == (2, None)
    mms = [
        n
        for n in joint.graph.nodes
        if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
    ]
    fwd = [annotation_of(n).block_name for n in mms if annotation_of(n).phase == "forward"]
    assert fwd == ["layers.0", "layers.1", None]
    bwd = {annotation_of(n).block_name for n in mms if annotation_of(n).phase == "backward"}
    assert bwd == {"layers.0", "layers.1", None}
    assert any(
        annotation_of(n).input_kind == "tangent" for n in joint.graph.nodes if n.op == "placeholder"
    )


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_autocast_no_grad_forward_of_a_chunk_whose_first_reader_is_a_cast(compiler):
    """A chunk of two weights whose first reader is autocast's cast to the transfer dtype:
    chunk_gather once erased that cast while it still inserted the second weight's views before it,
    and the no-grad forward crashed ("Expected a proper Tensor but got None"). Now it matches eager.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={
            "compiler": compiler,
            "n_persist": 0,
            "chunk_size": 1024,
            "param_dtype": "bfloat16",
        },
    )
    x = torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), ref(x)
    assert torch.equal(got.float(), want.float())
