"""Helpers of the synthetic pass tests: FX graphs built node by node on aten ops (each node's
``meta["val"]`` a FakeTensor, ``meta["protrain"]`` a NodeAnnotation given by hand), minimal plans,
small real chunk stores on the CPU, and ways to look at a rewritten graph."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.plan.layout import pack
from protrain_fx.plan.plan import BlockPlan, Plan
from protrain_fx.runtime.chunk_store import ChunkStore

aten = torch.ops.aten


def fwd(block: int | None = None, chunk: int | None = None) -> NodeAnnotation:
    """The annotation of a forward node of ``block`` (None: a non-block node)."""
    if block is None:
        return NodeAnnotation("forward", "non_block", chunk=chunk)
    return NodeAnnotation("forward", "block", block, f"blocks.{block}", chunk=chunk)


def bwd(block: int | None = None) -> NodeAnnotation:
    """The annotation of a backward node of ``block`` (None: a non-block node)."""
    if block is None:
        return NodeAnnotation("backward", "non_block")
    return NodeAnnotation("backward", "block", block, f"blocks.{block}")


class GraphBuilder:
    """An FX graph built by hand; every node gets a fake value computed under one FakeTensorMode."""

    def __init__(self):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, shape, dtype=torch.float32, device="cpu", ann=None, meta=None):
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        if ann is not None:
            node.meta[META_KEY] = ann
        node.meta.update(meta or {})
        return node

    def op(self, target, *args, ann=None, meta=None, name=None, **kwargs):
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)

        def val(a):
            if isinstance(a, fx.Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        with self.mode:
            node.meta["val"] = target(*val(list(args)), **val(kwargs))
        if ann is not None:
            node.meta[META_KEY] = ann
        node.meta.update(meta or {})
        return node

    def output(self, *values):
        self.graph.output(tuple(values))
        return self.module()

    def module(self) -> fx.GraphModule:
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.graph.lint()
        return gm


def make_plan(policies=(), n_buffer: int = 2, **fields) -> Plan:
    """A plan with one block per entry of ``policies`` ("keep" | "swap" | "recompute")."""
    plan = Plan(
        chunk_size=0,
        n_persist=0,
        n_buffer=n_buffer,
        n_swap=0,
        n_checkpoint=0,
        blocks=[BlockPlan(f"blocks.{i}", p) for i, p in enumerate(policies)],
    )
    for k, v in fields.items():
        setattr(plan, k, v)
    return plan


def make_store(
    shapes: dict[str, tuple],
    per_chunk: int,
    n_persist: int,
    param_dtype=torch.float32,
    seed: int = 0,
):
    """A real CPU chunk store of fresh parameters (``shapes``: fqn -> shape, in first-use order),
    ``per_chunk`` chunk bytes (fp32 master), the first ``n_persist`` chunks resident. Returns
    (store, params: fqn -> nn.Parameter, values: fqn -> a clone of its initial value). The caller
    keeps ``params`` alive (the store lives as long as its first parameter)."""
    gen = torch.Generator().manual_seed(seed)
    values = {f: torch.randn(s, generator=gen) for f, s in shapes.items()}
    params = {f: torch.nn.Parameter(v.clone()) for f, v in values.items()}
    layout = pack([(f, p.numel() * 4) for f, p in params.items()], per_chunk)
    store = ChunkStore(list(params.items()), layout, n_persist, param_dtype)
    return store, params, values


def nodes_of(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def names(nodes) -> list[str]:
    return [n.name for n in nodes]


def snapshot(gm: fx.GraphModule) -> list[tuple]:
    """What a graph is, node by node: op, target, arguments and the meta keys the passes write."""
    keys = ("val", META_KEY, "recompute", "ac_graph_id", "partitioner_tag")
    out = []
    for n in gm.graph.nodes:
        meta = tuple((k, id(n.meta[k]) if k == "val" else n.meta[k]) for k in keys if k in n.meta)
        out.append((n.name, n.op, n.target, str(n.args), str(n.kwargs), meta))
    return out


def assert_well_linked(gm: fx.GraphModule) -> None:
    """The node list reads the same forwards and backwards (FX's code generator frees values by a
    backward walk, so a broken ``_prev`` link frees them too early) and passes lint."""
    forward = list(gm.graph.nodes)
    assert list(reversed(gm.graph.nodes)) == forward[::-1], "the graph's node list is broken"
    gm.graph.lint()


def position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def output_values(gm: fx.GraphModule) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
