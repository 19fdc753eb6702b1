"""swap_offload / swap_reload: keep the saved activations of "swap" blocks in pinned host memory between
forward and backward.

``swap_offload`` (forward graph): every floating-point tensor the forward saves for backward that a swap
block produced (on the compute device, static shape; a host scalar saved beside CUDA work stays) gets ``protrain::offload`` right after its producer: a device-to-host
copy into its region of the graph's pinned pool, started as soon as the value exists. The forward returns
the host copy instead, so the device tensor's memory is released after its last forward use and the copy.

``swap_reload`` (backward graph): each of those inputs gets ``protrain::reload_take`` right before its
first use and ``protrain::reload_start`` one block earlier: before the backward of the next block (block
b+1 runs its backward before block b) begins, so the host-to-device copy overlaps that block's compute.
The token of the first ``reload_take`` of block b+1 includes block b's ``reload_start``s, so Inductor
cannot delay them past it.

The pool is sized once, when the forward graph is compiled, from the swapped tensors' shapes.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from protrain_fx.passes._fx import call, node_positions, output_node
from protrain_fx.passes.annotate import META_KEY, NodeAnnotation, annotation_of

from protrain_fx import _compat, ops, swap_pool
from protrain_fx.plan import Plan


def _swap_blocks(plan: Plan) -> set[int]:
    return {i for i, b in enumerate(plan.blocks) if b.policy == "swap"}


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
    # the compute device; host tensors that forward saves (CPU scalars next to CUDA work) stay where they are
    compute = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
    pool = None
    for k in range(first_saved, len(outputs)):
        x = outputs[k]
        if not isinstance(x, fx.Node) or x.op != "call_function":
            continue
        ann, val = annotation_of(x), x.meta.get("val")
        if ann is None or ann.block not in swap or not isinstance(val, torch.Tensor):
            continue
        if not val.is_floating_point() or not all(isinstance(s, int) for s in val.shape):
            continue  # masks and RNG states stay (small); symbolic shapes cannot be pooled ahead
        if val.device != compute:
            continue
        if pool is None:
            with _compat.real_tensor_mode():
                pool = swap_pool.SwapPool(val.device)
            plan.swap_pool = pool.id
        key = pool.add_region(val.shape, val.dtype)
        with gm.graph.inserting_after(x):
            host = call(gm, ops.OFFLOAD, (x, [], pool.id, key))
        host.meta[META_KEY] = NodeAnnotation("forward", "block", ann.block, ann.block_name)
        plan.swapped[x.name] = (key, ann.block)
        outputs[k] = host
    if pool is not None:
        with _compat.real_tensor_mode():
            pool.allocate()
        out.args = (tuple(outputs),)
    return gm


def swap_reload(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Reload offloaded activations one block ahead of their first backward use (see module docstring)."""
    if not plan.swapped:
        return gm
    graph = gm.graph
    pos = node_positions(graph)
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    # block -> its swapped placeholders
    by_block: dict[int, list[fx.Node]] = {}
    for ph in (n for n in graph.nodes if n.op == "placeholder" and n.name in plan.swapped):
        by_block.setdefault(plan.swapped[ph.name][1], []).append(ph)
    first_of_block: dict[int, fx.Node] = {}
    for n in graph.nodes:
        ann = annotation_of(n)
        if n.op == "call_function" and ann is not None and ann.phase == "backward" and ann.block is not None:
            first_of_block.setdefault(ann.block, n)
    takes: dict[int, list[fx.Node]] = {}
    starts: dict[int, list[fx.Node]] = {}
    for block in sorted(by_block, reverse=True):  # backward visits later blocks first
        pos = node_positions(graph)
        # before block+1's backward begins (its first node, or its own first reload)
        candidates = [n for n in [first_of_block.get(block + 1)] + takes.get(block + 1, []) if n is not None]
        block_anchor = min(candidates, key=pos.__getitem__) if candidates else first_compute
        for ph in by_block[block]:
            users = [u for u in ph.users]
            if not users:
                continue
            first_use = min(users, key=pos.__getitem__)
            anchor = block_anchor if pos[block_anchor] <= pos[first_use] else first_compute
            key = plan.swapped[ph.name][0]
            dev_val = ph.meta["val"]
            with dev_val.fake_mode:  # the input is now the host copy
                ph.meta["val"] = torch.empty(dev_val.shape, dtype=dev_val.dtype, device="cpu")
            with graph.inserting_before(anchor):
                start = call(gm, ops.RELOAD_START, (ph, [], plan.swap_pool, key))
            with graph.inserting_before(first_use):
                take = call(gm, ops.RELOAD_TAKE, (ph, [start], plan.swap_pool, key))
            for n in (start, take):
                n.meta[META_KEY] = NodeAnnotation("backward", "block", block, plan.blocks[block].name)
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
