"""swap_offload and swap_reload on hand-built forward and backward graphs of four blocks (policies
swap, keep, swap, swap): ``protrain::offload`` right after the producer of every floating-point
value on the compute device that a swap block saves (masks, keep blocks' values, placeholders and
host scalars beside (fake) CUDA work stay), the forward returning the host copy, ``plan.swapped``
naming them, and ``offload_wait`` before block b+2's first node (or at the output); in backward
``reload_take`` right before the first use and ``reload_start`` before the backward of block b+1
begins (its first node or its first reload), at the start when nothing comes earlier, the first
take of block b+1 carrying block b's starts as tokens; graphs with nothing to swap come back
unchanged; and forward and backward, rewritten, compute on the CPU what they computed before."""

from __future__ import annotations

import torch
from pass_graphs import (
    GraphBuilder,
    assert_well_linked,
    aten,
    bwd,
    fwd,
    make_plan,
    names,
    nodes_of,
    output_values,
    position,
    snapshot,
)

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.passes.swap import swap_offload, swap_reload
from protrain_fx.runtime import ops

POLICIES = ("swap", "keep", "swap", "swap")
# forward's saved values (the outputs after the loss), in order
SAVED = ["relu", "gt", "mm", "mm_1", "relu_1", "relu_2", "mm_3", "primals_1", "primals_2"]


def _forward(device="cpu"):
    """x @ w through four blocks; block 0 also keeps a bool mask, and with a CUDA device a host
    scalar (``mul``, from the CPU placeholder primals_3). Returns (gm, nodes by name, saved)."""
    g = GraphBuilder()
    x = g.input("primals_1", (8, 4), device=device)
    w = g.input("primals_2", (4, 4), device=device)
    n = {"primals_1": x, "primals_2": w}
    if device != "cpu":
        n["primals_3"] = g.input("primals_3", (), device="cpu")
    h = x
    for b in range(4):
        suffix = f"_{b}" if b else ""
        mm = n["mm" + suffix] = g.op(aten.mm.default, h, w, ann=fwd(b), name="mm" + suffix)
        if b == 0:
            n["gt"] = g.op(aten.gt.Scalar, mm, 0.0, ann=fwd(0), name="gt")
        if b < 3:
            h = n["relu" + suffix] = g.op(aten.relu.default, mm, ann=fwd(b), name="relu" + suffix)
    saved = list(SAVED)
    if device != "cpu":
        n["mul"] = g.op(aten.mul.Tensor, n["primals_3"], 2.0, ann=fwd(0), name="mul")
        saved.append("mul")
    n["loss"] = g.op(aten.sum.default, n["mm_3"], ann=fwd(), name="loss")
    gm = g.output(n["loss"], *(n[s] for s in saved))
    assert names(output_values(gm)[1:]) == saved
    return gm, n, saved


def _backward():
    """The matching backward: placeholders are forward's saved values (by name) and tangents_1;
    block 3's backward first, block 0's last."""
    g = GraphBuilder()
    shapes = {"gt": ((8, 4), torch.bool), "primals_1": ((8, 4), torch.float32)}
    ph = {
        s: g.input(s, *shapes.get(s, ((8, 4) if s != "primals_2" else (4, 4), torch.float32)))
        for s in SAVED
    }
    tan = g.input("tangents_1", ())
    w = ph["primals_2"]
    n = dict(ph)
    n["d3"] = g.op(aten.mul.Tensor, ph["mm_3"], tan, ann=bwd(3))
    n["e3"] = g.op(aten.mm.default, n["d3"], w, ann=bwd(3))
    n["d2"] = g.op(aten.mul.Tensor, n["e3"], ph["relu_2"], ann=bwd(2))
    n["e2"] = g.op(aten.mm.default, n["d2"], w, ann=bwd(2))
    n["d1"] = g.op(aten.mul.Tensor, n["e2"], ph["relu_1"], ann=bwd(1))
    n["d1b"] = g.op(aten.mul.Tensor, n["d1"], ph["mm_1"], ann=bwd(1))
    n["e1"] = g.op(aten.mm.default, n["d1b"], w, ann=bwd(1))
    n["d0"] = g.op(aten.mul.Tensor, n["e1"], ph["relu"], ann=bwd(0))
    n["d0m"] = g.op(aten.mul.Tensor, n["d0"], ph["gt"], ann=bwd(0))
    n["e0"] = g.op(aten.mm.default, n["d0m"], w, ann=bwd(0))
    n["xt"] = g.op(aten.t.default, ph["primals_1"], ann=bwd())
    n["gw"] = g.op(aten.mm.default, n["xt"], n["e0"], ann=bwd())
    return g.output(n["gw"]), n


def _plan(saved=SAVED, swapped=None):
    return make_plan(POLICIES, saved_names=list(saved), swapped=dict(swapped or {}))


# ------------------------------------------------------------------------------------ offload
def test_offload_after_each_swapped_producer():
    gm, n, saved = _forward()
    plan = _plan(saved)
    assert swap_offload(gm, plan) is gm
    assert_well_linked(gm)
    offloads = nodes_of(gm, ops.OFFLOAD)
    # float values of swap blocks 0, 2, 3; not the mask, not keep block 1, not the placeholders
    assert [o.args for o in offloads] == [
        (n["mm"], []),
        (n["relu"], []),
        (n["relu_2"], []),
        (n["mm_3"], []),
    ]
    for o in offloads:
        src = o.args[0]
        assert src.next is o  # right after its producer
        b = src.meta[META_KEY].block
        assert o.meta[META_KEY] == NodeAnnotation("forward", "block", b, f"blocks.{b}")
        assert o.meta["val"].device.type == "cpu" and o.meta["val"].shape == src.meta["val"].shape
    assert plan.swapped == {"mm": 0, "relu": 0, "relu_2": 2, "mm_3": 3}
    # forward returns the host copies in the swapped values' places, the rest as they were
    outs = output_values(gm)
    host = {o.args[0].name: o for o in offloads}
    assert outs[0] is n["loss"]
    assert outs[1:] == [host.get(s, n[s]) for s in saved]
    # the producers still feed their compute users
    assert n["relu"] in n["mm_1"].args and n["mm_3"] in n["loss"].args


def test_offload_wait_before_block_b_plus_2_or_at_the_output():
    gm, n, saved = _forward()
    plan = _plan(saved)
    swap_offload(gm, plan)
    waits = nodes_of(gm, ops.OFFLOAD_WAIT)
    assert len(waits) == 3
    w0, w2, w3 = waits
    host = {o.args[0].name: o for o in nodes_of(gm, ops.OFFLOAD)}
    # block 0: its copies done before block 2's forward begins (mm_2 is block 2's first node)
    assert w0.args == ([host["relu"], host["mm"]], [], torch.device("cpu"))  # in saved order
    assert w0.next is n["mm_2"]
    assert w0.meta[META_KEY] == NodeAnnotation("forward", "block", 0, "blocks.0")
    # blocks 2 and 3: no block 4 or 5, so at the graph's end (after the loss), in block order
    assert w2.args[0] == [host["relu_2"]] and w3.args[0] == [host["mm_3"]]
    out = next(m for m in gm.graph.nodes if m.op == "output")
    assert w2.next is w3 and w3.next is out
    pos = position(gm)
    assert pos[n["loss"]] < pos[w2]
    assert not w0.users and not w2.users  # ordering ops: nothing reads them


def test_host_scalars_beside_cuda_work_stay():
    """Fake CUDA values: the compute device is CUDA, so a CPU scalar of a swap block stays."""
    gm, n, saved = _forward(device="cuda")
    plan = _plan(saved)
    swap_offload(gm, plan)
    assert_well_linked(gm)
    assert "mul" not in plan.swapped and output_values(gm)[-1] is n["mul"]
    assert sorted(plan.swapped) == ["mm", "mm_3", "relu", "relu_2"]
    for w in nodes_of(gm, ops.OFFLOAD_WAIT):
        assert w.args[2] == torch.device("cuda", 0) and w.meta["val"].device.type == "cuda"
    assert all(o.meta["val"].device.type == "cpu" for o in nodes_of(gm, ops.OFFLOAD))


def test_offload_has_nothing_to_do():
    # no swap block; no saved values (an inference-like forward); swap blocks saving none of theirs
    cases = [
        make_plan(("keep",) * 4, saved_names=list(SAVED)),
        _plan(saved=[]),
        make_plan(("keep", "swap", "keep", "keep"), saved_names=list(SAVED)),
    ]
    for plan in cases:
        gm, n, saved = _forward()
        if plan.blocks[1].policy == "swap":  # block 1 saves mm_1 and relu_1: drop them
            keep = [s for s in saved if s not in ("mm_1", "relu_1")]
            out = next(m for m in gm.graph.nodes if m.op == "output")
            out.args = ((n["loss"], *(n[s] for s in keep)),)
            plan.saved_names = keep
        before = snapshot(gm)
        assert swap_offload(gm, plan) is gm
        assert snapshot(gm) == before and plan.swapped == {}


# ------------------------------------------------------------------------------------- reload
SWAPPED = {"mm": 0, "relu": 0, "relu_2": 2, "mm_3": 3}


def _reload(device="cpu"):
    gm, n = _backward()
    if device != "cpu":
        mode = n["relu"].meta["val"].fake_mode
        for m in gm.graph.nodes:  # the same graph with fake CUDA values
            v = m.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                with mode:
                    m.meta["val"] = torch.empty(v.shape, dtype=v.dtype, device=device)
    plan = _plan(swapped=SWAPPED)
    assert swap_reload(gm, plan) is gm
    assert_well_linked(gm)
    starts = {s.args[0].name: s for s in nodes_of(gm, ops.RELOAD_START)}
    takes = {t.args[0].name: t for t in nodes_of(gm, ops.RELOAD_TAKE)}
    return gm, n, starts, takes


def test_reload_take_right_before_the_first_use():
    gm, n, starts, takes = _reload()
    # "mm" is swapped but backward does not read it: nothing to reload
    assert sorted(takes) == sorted(starts) == ["mm_3", "relu", "relu_2"]
    for name, first_use in (("mm_3", "d3"), ("relu_2", "d2"), ("relu", "d0")):
        take, ph = takes[name], n[name]
        assert take.next is n[first_use]
        assert take.args[0] is ph and take.args[1][0] is starts[name]
        assert take.args[2] == torch.device("cpu")
        assert set(ph.users) == {starts[name], take}  # every other use reads the reloaded value
        assert n[first_use].args[1 if name != "mm_3" else 0] is take
        b = SWAPPED[name]
        for op in (take, starts[name]):
            assert op.meta[META_KEY] == NodeAnnotation("backward", "block", b, f"blocks.{b}")
    # keep blocks' inputs are read as they come
    assert n["d1"].args[1] is n["relu_1"] and n["d1b"].args[1] is n["mm_1"]


def test_reload_start_one_block_ahead():
    gm, n, starts, takes = _reload()
    pos = position(gm)
    first_compute = next(m for m in gm.graph.nodes if m.op != "placeholder")
    # block 3 runs its backward first: nothing comes before it, so its reload starts the graph
    assert first_compute is starts["mm_3"]
    # block 2's: before block 3's backward begins, i.e. before block 3's own first reload_take
    assert starts["mm_3"].next is starts["relu_2"] and starts["relu_2"].next is takes["mm_3"]
    assert pos[starts["relu_2"]] < pos[n["d3"]]
    # block 0's: right before block 1's first backward node (block 1 keeps: no reloads of its own)
    assert starts["relu"].next is n["d1"]
    assert pos[n["e2"]] < pos[starts["relu"]] < pos[n["d1"]] < pos[takes["relu"]]
    # tokens: block 3's first take also waits for block 2's reload_start; block 1 has no takes
    assert takes["mm_3"].args[1] == [starts["mm_3"], starts["relu_2"]]
    assert takes["relu_2"].args[1] == [starts["relu_2"]]
    assert takes["relu"].args[1] == [starts["relu"]]
    for s in starts.values():
        assert s.args[1] == [] and set(s.users) <= set(takes.values())


def test_reload_makes_the_swapped_inputs_host_tensors():
    gm, n, starts, takes = _reload(device="cuda")
    cuda = torch.device("cuda", 0)
    for name in ("mm_3", "relu", "relu_2"):
        assert n[name].meta["val"].device.type == "cpu"  # the input is now the host copy
        assert takes[name].meta["val"].device == cuda and starts[name].args[2] == cuda
        assert takes[name].meta["val"].shape == n[name].meta["val"].shape
    assert n["relu_1"].meta["val"].device == cuda and n["mm"].meta["val"].device == cuda


def test_reload_starts_at_the_graph_start_when_the_first_use_comes_early():
    """A swapped value of block 0 read by a node before block 1's backward: its copy starts with the
    graph (before the first compute node), not after its use."""
    g = GraphBuilder()
    r = g.input("relu", (8, 4))
    tan = g.input("tangents_1", (8, 4))
    early = g.op(aten.mul.Tensor, tan, r, ann=bwd())  # a non-block node using it first
    d1 = g.op(aten.relu.default, early, ann=bwd(1))
    d0 = g.op(aten.mul.Tensor, d1, r, ann=bwd(0))
    gm = g.output(d0)
    swap_reload(gm, make_plan(("swap", "keep"), swapped={"relu": 0}))
    assert_well_linked(gm)
    (start,) = nodes_of(gm, ops.RELOAD_START)
    (take,) = nodes_of(gm, ops.RELOAD_TAKE)
    assert start.prev is tan and start.next is take and take.next is early
    assert early.args[1] is take and d0.args[1] is take


def test_reload_has_nothing_to_do():
    for swapped in ({}, {"not_an_input": 0}):
        gm, _ = _backward()
        before = snapshot(gm)
        assert swap_reload(gm, _plan(swapped=swapped)) is gm
        assert snapshot(gm) == before


# ---------------------------------------------------------------------------------- running
def test_forward_and_backward_compute_the_same_on_the_cpu():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    tan = torch.tensor(1.5)
    ref_fw, _, _ = _forward()
    ref_bw, _ = _backward()
    expected_fw = ref_fw(x, w)
    expected_bw = ref_bw(*expected_fw[1:], tan)

    fw, _, saved = _forward()
    plan = _plan(saved)
    swap_offload(fw, plan)
    fw.recompile()
    bw, _ = _backward()
    swap_reload(bw, plan)  # reads what swap_offload recorded
    bw.recompile()
    got_fw = fw(x, w)
    for e, o in zip(expected_fw, got_fw):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
    got_bw = bw(*got_fw[1:], tan)
    torch.testing.assert_close(got_bw, expected_bw, rtol=0, atol=0)
