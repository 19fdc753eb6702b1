"""block_marks (dynamo graph, block profiling only): put every transformer block between
``protrain::mark`` ops, so that one real step records each block's forward and backward time and
transient peak as the compiled kernels run them (protrain_fx/runtime/block_timer.py).

Each value a block reads from outside it (its input, e.g. the residual stream; parameters and graph
inputs excepted) goes through ``mark(x, block, 0)`` before the block's first node, and each value it
hands to the rest of the graph through ``mark(y, block, 1)`` after its last node. The mark is a
copy, so the block's compute depends on the enter mark and everything after depends on the exit
mark: Inductor cannot move the block's kernels across them. Autograd gives each mark a backward twin
(where 2 and 3) at the block's gradient boundaries. Runs only when the plan asks for it
(``PROTRAIN_PROFILE_BLOCKS=1``); the copies cost a little time and memory, so the profiled step is
not the production step.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx.graph.fx import example_value
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import block_timer, ops


def _is_tensor(node) -> bool:
    val = example_value(node)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def block_marks(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Wrap each block between enter and exit marks (see module docstring)."""
    if not plan.profile_blocks or not plan.blocks or plan.block_structure is None:
        return gm
    structure = plan.block_structure
    nodes = list(gm.graph.nodes)
    index = {b.name: i for i, b in enumerate(structure.blocks)}
    block_of: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op in ("call_function", "call_method"):
            b = structure.block_of_node(n)
            if b is not None:
                block_of[n] = index[b.name]
    for i in range(len(structure.blocks)):
        members = [n for n in nodes if block_of.get(n) == i]
        if not members:
            continue
        order = {n: k for k, n in enumerate(gm.graph.nodes)}  # marks inserted so far included
        member_set = set(members)
        inputs = []
        for n in members:
            for a in n.all_input_nodes:
                if (
                    a not in member_set
                    and a.op != "placeholder"
                    and a not in inputs
                    and _is_tensor(a)
                ):
                    inputs.append(a)
        for x in inputs:
            # before the block's first node, or its first reader if x only exists later
            first = (
                members[0]
                if order[x] < order[members[0]]
                else min((u for u in x.users if u in member_set), key=order.__getitem__)
            )
            with gm.graph.inserting_before(first):
                m = gm.graph.call_function(ops.MARK, (x, i, block_timer.FWD_ENTER))
            m.meta.update({k: x.meta[k] for k in ("example_value", "val") if k in x.meta})
            x.replace_all_uses_with(m, delete_user_cb=lambda u: u in member_set)
        for y in members:
            outside = [u for u in y.users if u not in member_set]
            if not outside or not _is_tensor(y):
                continue
            # after the block's last node that comes before y's first reader outside it
            limit = min(order[u] for u in outside)
            anchor = max((n for n in members if order[n] < limit), key=order.__getitem__)
            with gm.graph.inserting_after(anchor):
                m = gm.graph.call_function(ops.MARK, (y, i, block_timer.FWD_EXIT))
            m.meta.update({k: y.meta[k] for k in ("example_value", "val") if k in y.meta})
            y.replace_all_uses_with(m, delete_user_cb=lambda u, _o=set(outside): u in _o)
    gm.graph.lint()
    gm.recompile()
    return gm
