"""swap_offload / swap_reload: keep the saved activations of "swap" blocks in host memory between
forward and backward.

``swap_offload`` (forward graph): every floating-point tensor the forward saves for backward that a
swap block produced (on the compute device; a host scalar saved beside CUDA work stays) gets
``protrain::offload`` right after its producer: a device-to-host copy into new host memory of its
own (each call of the graph its own), started as soon as the value exists, from a device copy that
the runtime owns (protrain_fx/runtime/swap_pool.py says why). The forward returns the host copy
instead. Before block b+2's forward begins (or at the graph's end), ``protrain::offload_wait`` makes
the compute stream wait for block b's copies, which bounds how far they lag behind the compute.

``swap_reload`` (backward graph): each of those inputs gets ``protrain::reload_take`` right before
its first use and ``protrain::reload_start`` one block earlier: before the backward of the next
block (block b+1 runs its backward before block b) begins, so the host-to-device copy overlaps that
block's compute. The token of the first ``reload_take`` of block b+1 includes block b's
``reload_start``s, so Inductor cannot delay them past it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation, annotation_of
from protrain_fx.graph.fx import call, node_positions, output_node
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import ops, swap_pool


def _swap_blocks(plan: Plan) -> set[int]:
    return {i for i, b in enumerate(plan.blocks) if b.policy == "swap"}


def _wait_point(gm: fx.GraphModule, block: int, after: fx.Node) -> fx.Node:
    """The first node after ``after`` of a block beyond ``block + 1`` (or the output): where the
    block's copies must be done."""
    n = after.next
    while n.op != "output":
        ann = annotation_of(n)
        if (
            n.op == "call_function"
            and ann is not None
            and ann.block is not None
            and ann.block >= block + 2
        ):
            return n
        n = n.next
    return n


def swap_offload(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Offload the swap blocks' saved activations after their producers (see module docstring)."""
    swap = _swap_blocks(plan)
    if not swap or not plan.saved_names:
        return gm
    out = output_node(gm)
    outputs = list(out.args[0])
    first_saved = len(outputs) - len(plan.saved_names)
    saved_vals = [x.meta.get("val") for x in outputs[first_saved:] if isinstance(x, fx.Node)]
    devices = {v.device for v in saved_vals if isinstance(v, torch.Tensor)}
    # the compute device; host tensors that forward saves (CPU scalars next to CUDA work) stay where
    # they are
    compute = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
    by_block: dict[int, list[tuple[fx.Node, fx.Node]]] = {}
    for k in range(first_saved, len(outputs)):
        x = outputs[k]
        if not isinstance(x, fx.Node) or x.op != "call_function":
            continue
        ann, val = annotation_of(x), x.meta.get("val")
        if ann is None or ann.block not in swap or not isinstance(val, torch.Tensor):
            continue
        if not val.is_floating_point():
            continue  # masks and RNG states stay (small)
        if val.device != compute:
            continue
        with gm.graph.inserting_after(x):
            host = call(gm, ops.OFFLOAD, (x, []))
        host.meta[META_KEY] = NodeAnnotation("forward", "block", ann.block, ann.block_name)
        plan.swapped[x.name] = ann.block
        outputs[k] = host
        by_block.setdefault(ann.block, []).append((x, host))
    out.args = (tuple(outputs),)
    pos = node_positions(gm.graph)
    for block, pairs in sorted(by_block.items()):
        where = _wait_point(gm, block, max((h for _, h in pairs), key=pos.__getitem__))
        with gm.graph.inserting_before(where):
            wait = call(gm, ops.OFFLOAD_WAIT, ([h for _, h in pairs], [], compute))
        wait.meta[META_KEY] = NodeAnnotation("forward", "block", block, plan.blocks[block].name)
    return gm


def swap_reload(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Reload offloaded activations one block ahead of their first backward use (see module
    docstring)."""
    if not plan.swapped:
        return gm
    graph = gm.graph
    pos = node_positions(graph)
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    # block -> its swapped placeholders
    by_block: dict[int, list[fx.Node]] = {}
    for ph in (n for n in graph.nodes if n.op == "placeholder" and n.name in plan.swapped):
        by_block.setdefault(plan.swapped[ph.name], []).append(ph)
    first_of_block: dict[int, fx.Node] = {}
    for n in graph.nodes:
        ann = annotation_of(n)
        if (
            n.op == "call_function"
            and ann is not None
            and ann.phase == "backward"
            and ann.block is not None
        ):
            first_of_block.setdefault(ann.block, n)
    takes: dict[int, list[fx.Node]] = {}
    starts: dict[int, list[fx.Node]] = {}
    for block in sorted(by_block, reverse=True):  # backward visits later blocks first
        pos = node_positions(graph)
        # before block+1's backward begins (its first node, or its own first reload)
        candidates = [
            n for n in [first_of_block.get(block + 1)] + takes.get(block + 1, []) if n is not None
        ]
        block_anchor = min(candidates, key=pos.__getitem__) if candidates else first_compute
        for ph in by_block[block]:
            users = [u for u in ph.users]
            if not users:
                continue
            first_use = min(users, key=pos.__getitem__)
            anchor = block_anchor if pos[block_anchor] <= pos[first_use] else first_compute
            dev_val = ph.meta["val"]
            device = dev_val.device
            with dev_val.fake_mode:  # the input is now the host copy
                ph.meta["val"] = torch.empty_strided(
                    dev_val.shape,
                    swap_pool.swapped_strides(dev_val),
                    dtype=dev_val.dtype,
                    device="cpu",
                )
            with graph.inserting_before(anchor):
                start = call(gm, ops.RELOAD_START, (ph, [], device))
            with graph.inserting_before(first_use):
                take = call(gm, ops.RELOAD_TAKE, (ph, [start], device))
            for n in (start, take):
                n.meta[META_KEY] = NodeAnnotation(
                    "backward", "block", block, plan.blocks[block].name
                )
            ph.replace_all_uses_with(take, delete_user_cb=lambda u: u not in (start, take))
            starts.setdefault(block, []).append(start)
            takes.setdefault(block, []).append(take)
    pos = node_positions(graph)
    for block, block_starts in starts.items():
        later = takes.get(block + 1)
        if later:
            first_take = min(later, key=pos.__getitem__)
            first_take.update_arg(1, list(first_take.args[1]) + block_starts)
    return gm
