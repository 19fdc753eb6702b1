"""recompute on a hand-built joint graph of four blocks (policies recompute, keep, recompute, swap)
with two gathered chunks: every ``protrain::gather`` and everything that only views, casts or copies
out of it (slice, view, upcast, ``protrain::vectors`` and its getitems, a transpose in any block or
phase) is tagged MUST_RECOMPUTE with the shared ``AC_GRAPH_ID``, above every block id; every other
forward call_function node of a "recompute" block gets MUST_RECOMPUTE with its block's id; keep and
swap blocks, non-block nodes, placeholders and backward nodes stay untagged; a plan without
recompute blocks over a graph without gathers leaves the graph as it was; ``untag_blocks`` drops
the block tags and keeps the gathers'. The pass only tags: the graph still computes the same."""

from __future__ import annotations

import operator

import torch
from pass_graphs import GraphBuilder, aten, bwd, fwd, make_plan, snapshot
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.graph.annotation import NodeAnnotation
from protrain_fx.passes.recompute import (
    AC_GRAPH_ID,
    recompute,
    tag_blocks_for_recompute,
    untag_blocks,
)
from protrain_fx.runtime import ops

prims = torch.ops.prims
MUST = CheckpointPolicy.MUST_RECOMPUTE
POLICIES = ("recompute", "keep", "recompute", "swap")


def _joint():
    g = GraphBuilder()
    p = NodeAnnotation(
        "forward", "block", 0, "blocks.0", param="blocks.0.w", chunk=0, input_kind="param"
    )
    w0 = g.input("primals_1", (4, 4), ann=p)  # resident
    w1 = g.input("primals_2", (4, 4), ann=fwd(1, chunk=1))  # offloaded: chunk 1
    w2 = g.input("primals_3", (4, 4), ann=fwd(0, chunk=2))  # offloaded: chunk 2
    x = g.input("primals_4", (8, 4))
    tan = g.input("tangents_1", (8, 4), ann=bwd())
    n = {}
    # chunk 2, gathered inside recompute block 0 (annotated like its first user, with its chunk)
    n["g2"] = g.op(ops.GATHER, [], w2, 16, torch.float32, ann=fwd(0, chunk=2))
    n["v2"] = g.op(aten.view.default, n["g2"], [4, 4], ann=fwd(0, chunk=2))
    # block 0: recompute
    n["t0"] = g.op(aten.t.default, w0, ann=fwd(0))  # a view of a resident parameter: a block node
    n["mm0"] = g.op(aten.mm.default, x, n["t0"], ann=fwd(0))
    n["mm0b"] = g.op(aten.mm.default, n["mm0"], n["v2"], ann=fwd(0))
    n["r0"] = g.op(aten.relu.default, n["mm0b"], ann=fwd(0))
    # chunk 1 (w1 and a bias of 4): gather, slice, view, upcast; vectors, getitem, view
    n["g1"] = g.op(ops.GATHER, [], w1, 32, torch.bfloat16, ann=fwd(1, chunk=1))
    n["sl1"] = g.op(aten.slice.Tensor, n["g1"], 0, 0, 16, ann=fwd(1, chunk=1))
    n["v1"] = g.op(aten.view.default, n["sl1"], [4, 4], ann=fwd(1, chunk=1))
    n["up1"] = g.op(prims.convert_element_type.default, n["v1"], torch.float32, ann=fwd(1, chunk=1))
    n["vecs"] = g.op(ops.VECTORS, n["g1"], [16], [4], ann=fwd(1, chunk=1))
    n["item"] = g.op(operator.getitem, n["vecs"], 0, ann=fwd(1, chunk=1))
    n["bv"] = g.op(aten.view.default, n["item"], [4], ann=fwd(1, chunk=1))
    n["bup"] = g.op(prims.convert_element_type.default, n["bv"], torch.float32, ann=fwd(1, chunk=1))
    # block 1: keep (a transpose of the gathered weight, then compute)
    n["t1"] = g.op(aten.t.default, n["up1"], ann=fwd(1))
    n["mm1"] = g.op(aten.mm.default, n["r0"], n["t1"], ann=fwd(1))
    n["add1"] = g.op(aten.add.Tensor, n["mm1"], n["bup"], ann=fwd(1))
    # block 2: recompute, reading the same gathered weight
    n["t2"] = g.op(aten.t.default, n["up1"], ann=fwd(2))
    n["mm2"] = g.op(aten.mm.default, n["add1"], n["t2"], ann=fwd(2))
    n["r2"] = g.op(aten.relu.default, n["mm2"], ann=fwd(2))
    # block 3: swap
    n["r3"] = g.op(aten.relu.default, n["r2"], ann=fwd(3))
    n["loss"] = g.op(aten.sum.default, n["r3"], ann=fwd())
    # backward nodes of recompute blocks, and a backward transpose of the gathered weight
    n["d2"] = g.op(aten.mul.Tensor, tan, n["r2"], ann=bwd(2))
    n["bt"] = g.op(aten.t.default, n["up1"], ann=bwd(2))
    n["dx2"] = g.op(aten.mm.default, n["d2"], n["bt"], ann=bwd(2))
    n["d0"] = g.op(aten.mul.Tensor, n["dx2"], n["r0"], ann=bwd(0))
    gm = g.output(n["loss"], n["d0"])
    n.update(w0=w0, w1=w1, w2=w2, x=x, tan=tan)
    return gm, n


def _tag(node):
    return node.meta.get("recompute"), node.meta.get("ac_graph_id")


GATHERED = ("g2", "v2", "g1", "sl1", "v1", "up1", "vecs", "item", "bv", "bup", "t1", "t2", "bt")


def test_gathers_and_their_views_share_one_id_above_the_blocks():
    gm, n = _joint()
    structure = [(m.name, m.target, str(m.args)) for m in gm.graph.nodes]
    assert recompute(gm, make_plan(POLICIES)) is gm
    assert [(m.name, m.target, str(m.args)) for m in gm.graph.nodes] == structure  # tags only
    for name in GATHERED:  # whatever block or phase they sit in
        assert _tag(n[name]) == (MUST, AC_GRAPH_ID), name
    assert AC_GRAPH_ID > len(POLICIES)


def test_forward_nodes_of_recompute_blocks_get_their_block_id():
    gm, n = _joint()
    recompute(gm, make_plan(POLICIES))
    for name in ("t0", "mm0", "mm0b", "r0"):
        assert _tag(n[name]) == (MUST, 0), name
    for name in ("mm2", "r2"):
        assert _tag(n[name]) == (MUST, 2), name


def test_keep_and_swap_blocks_and_the_rest_stay_untagged():
    gm, n = _joint()
    recompute(gm, make_plan(POLICIES))
    # keep block 1, swap block 3, the non-block loss, backward nodes of recompute blocks, inputs
    for name in ("mm1", "add1", "r3", "loss", "d2", "dx2", "d0", "w0", "w1", "w2", "x", "tan"):
        assert _tag(n[name]) == (None, None), name
    tagged = {m.name for m in gm.graph.nodes if "recompute" in m.meta}
    assert tagged == {n[k].name for k in GATHERED + ("t0", "mm0", "mm0b", "r0", "mm2", "r2")}


def test_every_block_kept_tags_only_the_gathers():
    gm, n = _joint()
    recompute(gm, make_plan(("keep", "keep", "swap", "keep")))
    tagged = {m.name for m in gm.graph.nodes if "recompute" in m.meta}
    assert tagged == {n[k].name for k in GATHERED}


def test_nothing_to_tag_leaves_the_graph_unchanged():
    g = GraphBuilder()
    x = g.input("primals_1", (8, 4))
    w = g.input("primals_2", (4, 4), ann=fwd(0, chunk=0))
    t = g.op(aten.t.default, w, ann=fwd(0))
    mm = g.op(aten.mm.default, x, t, ann=fwd(0))
    r = g.op(aten.relu.default, mm, ann=fwd(1))
    gm = g.output(r)
    for plan in (make_plan(()), make_plan(("keep", "swap"))):
        before = snapshot(gm)
        assert recompute(gm, plan) is gm
        assert snapshot(gm) == before
        assert not any("recompute" in m.meta or "ac_graph_id" in m.meta for m in gm.graph.nodes)


def test_untag_blocks_keeps_the_gathers_tags():
    gm, n = _joint()
    recompute(gm, make_plan(POLICIES))
    untag_blocks(gm)
    tagged = {m.name for m in gm.graph.nodes if "recompute" in m.meta}
    assert tagged == {n[k].name for k in GATHERED}
    assert all(_tag(n[k]) == (MUST, AC_GRAPH_ID) for k in GATHERED)
    tag_blocks_for_recompute(gm, {2})  # and blocks can be tagged again, one by one
    assert _tag(n["mm2"]) == (MUST, 2) and _tag(n["mm0"]) == (None, None)
    # nodes chunk_gather made (annotated with their chunk) keep the gathers' id
    assert all(_tag(n[k]) == (MUST, AC_GRAPH_ID) for k in ("g1", "sl1", "v1", "up1", "vecs"))
