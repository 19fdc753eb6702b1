"""What a forward-only run of a dynamo graph holds in device memory at once, read from the graph.

An inference graph (``torch.no_grad()``, or a model with no trainable parameter: a frozen teacher, a
reference model) keeps nothing for backward: each tensor lives from the op that makes it to the
last op that reads it (or any view of it), and the graph's outputs to the end. Walking the graph in
order with the storages of the fake values dynamo traced gives the most bytes alive at once, views
counted once with their base. The parameters are left out (the placement counts them as chunks);
the graph's other inputs (the batch, buffers) count from the start to the end (the caller holds
them). This is the eager schedule's peak: a compiler that fuses ops never materializes some of
these tensors, and an op's own workspace (a matmul's, attention's) is not a node, so the caller
keeps a margin for it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from protrain_fx.graph import sizes
from protrain_fx.graph.fx import example_value


def _tensors(node: fx.Node) -> list[torch.Tensor]:
    val = example_value(node)
    return [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def _storage_bytes(t: torch.Tensor) -> int:
    """At the hint where the size is symbolic (``int()`` would specialize the graph to it)."""
    try:
        return sizes.size_hint(t.untyped_storage().nbytes())
    except Exception:  # no storage to ask
        return sizes.numel_hint(t) * t.element_size()


def forward_peak_bytes(gm: fx.GraphModule, skip: set[str]) -> int:
    """The most bytes of tensors alive at once in a forward-only run of ``gm`` (see the module
    docstring), leaving out the storages of the placeholders named in ``skip`` (the parameters)."""
    nodes = list(gm.graph.nodes)
    storage_of: dict[fx.Node, list] = {}
    size: dict = {}
    skipped: set = set()
    for node in nodes:
        keys = []
        for t in _tensors(node):
            try:
                key = StorageWeakRef(t.untyped_storage())
            except Exception:  # no storage (a sparse or nested tensor): its own entry
                key = ("node", node.name, len(keys))
            keys.append(key)
            size.setdefault(key, _storage_bytes(t))
            if node.op == "placeholder" and node.name in skip:
                skipped.add(key)
        storage_of[node] = keys
    last = {}
    for i, node in enumerate(nodes):
        for key in storage_of[node]:
            last[key] = i
        for inp in node.all_input_nodes:
            for key in storage_of.get(inp, ()):
                last[key] = i
    # the graph's outputs, and its inputs (the caller holds them), live to the end
    kept = {k for n in nodes if n.op == "output" for i in n.all_input_nodes for k in storage_of[i]}
    kept |= {k for n in nodes if n.op == "placeholder" for k in storage_of[n]}
    dies: dict[int, list] = {}  # node index -> storages its run is the last reader of
    for key, i in last.items():
        if key not in kept and key not in skipped:
            dies.setdefault(i, []).append(key)
    live, peak, alive = 0, 0, set()
    for i, node in enumerate(nodes):
        for key in storage_of[node]:
            if key not in alive and key not in skipped:
                alive.add(key)
                live += size[key]
        peak = max(peak, live)
        for key in dies.get(i, ()):
            live -= size[key]
    return peak
