"""user_checkpoints: protrain's per-block policies replace activation checkpointing the model does
itself.

Runs on the joint graph, after annotate. A model that checkpoints its own layers (Hugging Face's
``gradient_checkpointing_enable()``, ``torch.utils.checkpoint`` around each block) reaches the joint
graph with those layers' nodes tagged ``PREFER_RECOMPUTE`` / ``MUST_RECOMPUTE``: left in place, a
block the plan keeps (or swaps) would be recomputed anyway, and the plan's predicted time and memory
would be wrong. The pass drops those tags from the nodes of detected blocks, so the plan's own
choice (keep, swap, recompute, passes/recompute.py) decides; tags outside blocks, and ``MUST_SAVE``
policies anywhere, stay. It records how many nodes it freed in ``plan.notes``.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.graph.annotation import annotation_of
from protrain_fx.plan.plan import Plan

_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def user_checkpoints(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Drop the model's own recompute tags inside blocks (see module docstring)."""
    dropped = 0
    for node in gm.graph.nodes:
        ann = annotation_of(node)
        if ann is None or ann.block is None or node.meta.get("recompute") not in _RECOMPUTE:
            continue
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)
        dropped += 1
    if dropped:
        plan.notes.append(
            "the model checkpoints its own blocks (e.g. Hugging Face gradient "
            "checkpointing): "
            f"protrain's per-block policy replaces it ({dropped} nodes untagged)"
        )
    return gm
