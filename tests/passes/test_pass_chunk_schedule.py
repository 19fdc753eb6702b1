"""chunk_schedule on hand-built graphs whose ``protrain::gather`` nodes read chunks of a small real
CPU chunk store: ``prefetch`` for the first ``n_buffer`` gathers at the graph's start and for gather
``i + n_buffer`` right after gather ``i`` (with that gather as its token), for n_buffer 1, 2 and
more buffers than gathers; each gather's tokens are its own prefetch and every prefetch,
``chunk_grad`` and ``resident_grads`` placed since the previous gather; ``plan.chunks_in_use`` is
the most gathered chunks alive at once (and never decreases); a graph without gathers comes back
unchanged; and the scheduled graph runs with exactly ``n_buffer`` device chunk buffers, every
gather finding its chunk prefetched, computing what the unscheduled graph computes."""

from __future__ import annotations

import pytest
import torch
from pass_graphs import (
    GraphBuilder,
    assert_well_linked,
    aten,
    bwd,
    fwd,
    make_plan,
    make_store,
    names,
    nodes_of,
    position,
    snapshot,
)

from protrain_fx.errors import ProtrainError
from protrain_fx.graph.annotation import META_KEY, NodeAnnotation
from protrain_fx.passes.chunk_schedule import chunk_schedule, chunks_in_use
from protrain_fx.runtime import ops


def _store(n_chunks=4, shape=(4, 4)):
    """One parameter per chunk, every chunk offloaded."""
    numel = shape[0] * shape[1]
    shapes = {f"blocks.{i}.w": shape for i in range(n_chunks)}
    store, params, values = make_store(shapes, per_chunk=-(-numel * 4 // 64) * 64, n_persist=0)
    assert store.offloaded_chunks == list(range(n_chunks))
    return store, params, values


def _sequential(store, params, shape=(4, 4)):
    """h = x; per chunk i: gather it, view it, h = h + w_i (block i). Returns (gm, gathers,
    adds)."""
    g = GraphBuilder()
    anchors = [g.input(f"primals_{i + 1}", shape) for i in range(len(params))]
    h = g.input(f"primals_{len(params) + 1}", shape)
    gathers, adds = [], []
    for i, (a, p) in enumerate(zip(anchors, params.values())):
        c = store.entry(p).chunk
        gathers.append(
            g.op(ops.GATHER, [], a, store.chunk_numel(c), torch.float32, ann=fwd(i, chunk=c))
        )
        flat = g.op(aten.slice.Tensor, gathers[-1], 0, 0, shape[0] * shape[1], ann=fwd(i, chunk=c))
        view = g.op(aten.view.default, flat, list(shape), ann=fwd(i, chunk=c))
        h = g.op(aten.add.Tensor, h, view, ann=fwd(i))
        adds.append(h)
    return g.output(h), gathers, adds


def _prefetches(gm):
    return nodes_of(gm, ops.PREFETCH)


def test_one_buffer_prefetches_each_chunk_right_after_the_previous_gather():
    store, params, _ = _store()
    gm, gathers, adds = _sequential(store, params)
    plan = make_plan(n_buffer=1)
    assert chunk_schedule(gm, plan) is gm
    assert_well_linked(gm)
    pre = _prefetches(gm)
    assert len(pre) == 4
    anchors = [g.args[1] for g in gathers]
    # the first at the graph's start (before the first non-placeholder), without tokens
    first_compute = next(n for n in gm.graph.nodes if n.op != "placeholder")
    assert first_compute is pre[0] and pre[0].args == ([], anchors[0])
    assert pre[0].next is gathers[0]
    # gather i's buffer is refilled right after it, for gather i + 1, depending on gather i
    for i in range(3):
        assert gathers[i].next is pre[i + 1]
        assert pre[i + 1].args == ([gathers[i]], anchors[i + 1])
    # every gather waits for its own prefetch only
    for i, g in enumerate(gathers):
        assert g.args[0] == [pre[i]]
        assert g.args[1:] == (anchors[i], store.chunk_numel(i), torch.float32)
    for i, p in enumerate(pre):
        assert p.meta[META_KEY] == NodeAnnotation("forward", "non_block", chunk=i)
        assert p.meta["val"].shape == (0,)
    assert plan.chunks_in_use == 1  # each chunk's last reader runs before the next gather


def test_two_buffers_prefetch_two_ahead():
    store, params, _ = _store()
    gm, gathers, _ = _sequential(store, params)
    chunk_schedule(gm, make_plan(n_buffer=2))
    assert_well_linked(gm)
    pre = _prefetches(gm)
    anchors = [g.args[1] for g in gathers]
    pos = position(gm)
    # two at the start, in gather order, then one after each of the first two gathers
    assert [p.args for p in pre] == [
        ([], anchors[0]),
        ([], anchors[1]),
        ([gathers[0]], anchors[2]),
        ([gathers[1]], anchors[3]),
    ]
    assert pos[pre[1]] < pos[gathers[0]] and pre[1].next is gathers[0]
    assert gathers[0].next is pre[2] and gathers[1].next is pre[3]
    # tokens: every prefetch since the previous gather, and the gather's own prefetch
    assert gathers[0].args[0] == [pre[0], pre[1]]
    assert gathers[1].args[0] == [pre[2], pre[1]]
    assert gathers[2].args[0] == [pre[3], pre[2]]
    assert gathers[3].args[0] == [pre[3]]
    for g in gathers:  # a token comes before its gather
        assert all(pos[t] < pos[g] for t in g.args[0])


def test_more_buffers_than_gathers_prefetch_everything_up_front():
    store, params, _ = _store(n_chunks=2)
    gm, gathers, _ = _sequential(store, params)
    chunk_schedule(gm, make_plan(n_buffer=3))
    pre = _prefetches(gm)
    assert [p.args[0] for p in pre] == [[], []]
    assert pre[1].next is gathers[0]
    assert gathers[0].args[0] == pre and gathers[1].args[0] == [pre[1]]


def test_no_buffer_in_the_plan_schedules_as_one():
    store, params, _ = _store(n_chunks=3)
    gm, gathers, _ = _sequential(store, params)
    chunk_schedule(gm, make_plan(n_buffer=0))
    pre = _prefetches(gm)
    assert [p.args[0] for p in pre] == [[], [gathers[0]], [gathers[1]]]


def test_gradient_ops_since_the_previous_gather_become_tokens():
    """A backward-like graph: chunk 1 is gathered, its gradient leaves through chunk_grad, a
    resident chunk's through resident_grads, then chunk 0 is gathered: that gather must follow
    both."""
    store, params, _ = _store(n_chunks=2)
    g = GraphBuilder()
    a0 = g.input("primals_1", (4, 4))
    a1 = g.input("primals_2", (4, 4))
    tan = g.input("tangents_1", (4, 4))
    g1 = g.op(ops.GATHER, [], a1, 16, torch.float32, ann=fwd(1, chunk=1))
    v1 = g.op(aten.view.default, g1, [4, 4], ann=fwd(1, chunk=1))
    d1 = g.op(aten.mul.Tensor, tan, v1, ann=bwd(1))
    cg = g.op(ops.CHUNK_GRAD, [d1], [a1], [], ann=bwd())
    rg = g.op(ops.RESIDENT_GRADS, [d1], [], store.id, 1, [0], ann=bwd())
    g0 = g.op(ops.GATHER, [], a0, 16, torch.float32, ann=fwd(0, chunk=0))
    v0 = g.op(aten.view.default, g0, [4, 4], ann=fwd(0, chunk=0))
    d0 = g.op(aten.mul.Tensor, d1, v0, ann=bwd(0))
    gm = g.output(d0, cg, rg)
    chunk_schedule(gm, make_plan(n_buffer=1))
    assert_well_linked(gm)
    p1, p0 = _prefetches(gm)
    assert p1.args == ([], a1) and p0.args == ([g1], a0) and g1.next is p0
    assert g1.args[0] == [p1]
    assert g0.args[0] == [p0, cg, rg]  # in graph order: the prefetch, then the gradient ops
    assert chunks_in_use(gm) == 1


def test_chunks_in_use_counts_overlapping_gathers():
    store, params, _ = _store(n_chunks=3)
    g = GraphBuilder()
    a = [g.input(f"primals_{i + 1}", (4, 4)) for i in range(3)]
    gs = [g.op(ops.GATHER, [], a[i], 16, torch.float32, ann=fwd(0, chunk=i)) for i in range(3)]
    vs = [g.op(aten.view.default, gs[i], [4, 4], ann=fwd(0, chunk=i)) for i in range(3)]
    s01 = g.op(aten.add.Tensor, vs[0], vs[1], ann=fwd(0))  # chunks 0 and 1 (and 2) alive here
    out = g.op(aten.mul.Tensor, s01, vs[2], ann=fwd(0))
    gm = g.output(out)
    assert chunks_in_use(gm) == 3
    plan = make_plan(n_buffer=3, chunks_in_use=5)  # another stage of the graph needed more
    chunk_schedule(gm, plan)
    assert plan.chunks_in_use == 5
    plan = make_plan(n_buffer=3, chunks_in_use=2)
    gm2, _, _ = _sequential(store, params)
    chunk_schedule(gm2, plan)
    assert plan.chunks_in_use == 2


def test_graph_without_gathers_is_unchanged():
    g = GraphBuilder()
    x = g.input("primals_1", (4, 4))
    y = g.op(aten.relu.default, x, ann=fwd(0))
    gm = g.output(y)
    before = snapshot(gm)
    plan = make_plan(n_buffer=2, chunks_in_use=0)
    assert chunk_schedule(gm, plan) is gm
    assert snapshot(gm) == before and plan.chunks_in_use == 0 and plan.n_buffer == 2


@pytest.mark.parametrize("n_buffer,shape", [(1, (4, 12)), (2, (4, 20))])
def test_scheduled_graph_runs_with_n_buffer_buffers(n_buffer, shape):
    """Each chunk buffer size gets its own slots here (one shape per case), exactly ``n_buffer``:
    the schedule never prefetches into a buffer whose chunk is not gathered yet."""
    store, params, values = _store(shape=shape)
    gm, _, _ = _sequential(store, params, shape)
    chunk_schedule(gm, make_plan(n_buffer=n_buffer))
    gm.recompile()
    store.ensure_buffers(n_buffer)
    assert store.n_buffer == n_buffer
    x = torch.randn(shape)
    before = dict(store.buffers.stats)
    (out,) = gm(*params.values(), x)
    expected = x
    for v in values.values():
        expected = expected + v
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    stats = store.buffers.stats
    assert stats["unprefetched_gathers"] == before["unprefetched_gathers"]
    assert stats["h2d_copies"] - before["h2d_copies"] == 4
    assert store.buffers.reserved() == []


def test_schedule_for_two_buffers_needs_two():
    """The negative control of the run above: a two-buffer schedule on one buffer fails at the
    second prefetch (both would await their gathers)."""
    shape = (4, 28)
    store, params, _ = _store(shape=shape)
    gm, _, _ = _sequential(store, params, shape)
    chunk_schedule(gm, make_plan(n_buffer=2))
    gm.recompile()
    store.ensure_buffers(1)
    assert store.n_buffer == 1
    with pytest.raises(ProtrainError, match="awaiting their gathers"):
        gm(*params.values(), torch.randn(shape))
    store.reset_after_error()
    assert names(_prefetches(gm))[:2] == ["prefetch_default", "prefetch_default_1"]
