"""The predicted device memory of a plan: its peak (the search's constraint, for every n_persist of
a layout at once) and its course over one step, for the plan's memory timeline plot
(protrain_fx/report/memory_plot.py) and its JSON.

Model states and buffers throughout; forward adds what each block keeps under its policy, backward
gives it back block by block while resident gradients appear; times are the blocks' compute scaled
to the predicted forward and backward. Bytes are scaled for the allocator (the profile's
fragmentation factor and fixed bytes).
"""

from __future__ import annotations

import math


def peaks(lc) -> list[int]:
    """The peak of every n_persist of the layout ``lc`` (a
    :class:`~protrain_fx.plan.cost_model.LayoutCosts`): model states and buffers, and the larger of
    the two ends of backward: at its start every saved activation (plus the cast copies of resident
    parameters) and the transient; at its end the resident gradients and what the code after the
    last block holds beside them (``tail_bytes``: the embedding's dense gradient, a tied head's
    gradient held since backward began; a resident tied table's dense gradient where the profiled
    step, its chunk offloaded, sent rows: ``table_grad``; activations are freed block by block as
    gradients appear, so in between the sum stays under the larger end). With several ranks the
    resident gradients are averaged in place (passes/resident_grads.py): no more memory."""
    prof, saved = lc.prof, lc.activation_bytes + lc.transient_bytes
    frag, extra, static, rb = lc.fragmentation, lc.fragmentation_bytes, lc.static, lc.resident_bytes
    out = []
    for p in range(len(prof.chunks) + 1):  # the search's hot path: peak_parts says it by part
        live = max(saved + _beside_saved(lc, p), rb[p] + prof.tail_bytes + lc.table_grad[p])
        out.append(int(math.ceil((static[p] + live) * frag + extra)))
    return out


def peak_parts(lc, p: int) -> dict[str, int]:
    """What :func:`peaks` adds up for ``p`` resident chunks, by part (bytes before the allocator's
    scaling, which ``allocator`` is): for an error that names the smallest budget and says what it
    is made of (tests/test_search.py checks that the parts add up to the peak)."""
    start = {
        "saved activations": lc.activation_bytes + _beside_saved(lc, p),
        "backward's largest working set (beyond what forward saved)": lc.transient_bytes,
    }
    end = {
        "resident gradients": lc.resident_bytes[p],
        "held at backward's end (embedding and head gradients)": lc.prof.tail_bytes
        + lc.table_grad[p],
    }
    ends = start if sum(start.values()) >= sum(end.values()) else end
    parts = {**lc.static_parts(p), **ends}
    total = sum(parts.values())
    parts["allocator"] = int(math.ceil(total * lc.fragmentation + lc.fragmentation_bytes)) - total
    return parts


def _beside_saved(lc, p: int) -> int:
    """What lives beside the saved activations with ``p`` resident chunks: the cast copies of
    resident parameters, and the last backward's resident gradients where the loop keeps them."""
    casts = int(lc.numel[p] * lc.prof.resident_cast_elem * lc.keep_fraction)
    return casts + (lc.resident_bytes[p] if lc.hw.grads_held else 0)


def output_dropped_peak(lc, knobs, step) -> int:
    """The peak of ``lc`` under ``knobs`` for a loop that drops the model's output before
    backward (the logits returned beside the loss, ``step.returned_logits_bytes``, which the
    profiled step ``step``, and so :func:`peaks`, held through backward): the peak less them, but
    never under the end of forward, where they exist in any loop beside every saved activation (on
    the H200 the 1B shape at 8 x 2048 peaked there once backward's head no longer built their
    gradient whole)."""
    frag, extra, p, n_shard = (
        lc.fragmentation,
        lc.fragmentation_bytes,
        knobs.n_persist,
        knobs.n_shard,
    )
    output_bytes = step.returned_logits_bytes
    shards = lc.shard_bytes(p, n_shard) if n_shard else 0
    peak = lc.peak_bytes(p, n_shard) if n_shard else lc.peak_bytes(p)
    live = lc.activation_bytes + _beside_saved(lc, p) + output_bytes
    forward_end = int(math.ceil((lc.static[p] + live) * frag + extra)) + shards
    return min(peak, max(peak - int(output_bytes * frag), forward_end))


def memory_timeline(lc, n_persist: int, n_shard: int = 0) -> list[list]:
    """``[t_s, bytes, label]`` at every block boundary of the plan ``lc``
    (a :class:`~protrain_fx.plan.cost_model.LayoutCosts`) with ``n_persist`` resident chunks and
    ``n_shard`` sharded on the devices."""
    from protrain_fx.plan.profiles import block_policy

    prof, frag, extra = lc.prof, lc.fragmentation, lc.fragmentation_bytes
    t_total, parts = lc.time_s(n_persist, detail=True, n_shard=n_shard)
    static = lc.static[n_persist] + (lc.shard_bytes(n_persist, n_shard) / frag if n_shard else 0)
    blocks, n = prof.blocks, len(prof.blocks)
    casts = int(lc.numel[n_persist] * prof.resident_cast_elem * lc.keep_fraction)
    kept = []
    for i, b in enumerate(blocks):
        policy = block_policy(i, lc.n_swap, lc.n_checkpoint)
        kept.append(
            b.swap_resident_bytes
            if policy == "swap"
            else b.input_bytes
            if policy == "recompute"
            else b.keep_bytes + (casts // max(1, n - lc.n_swap - lc.n_checkpoint))
        )
    fwd_total = sum(b.fwd_s for b in blocks) + prof.nonblock_fwd_s or 1.0
    bwd_total = sum(b.bwd_s for b in blocks) + prof.nonblock_bwd_s or 1.0
    last = t_total - parts["before_last_micro_step_s"]  # the last micro-step: its optimizers
    f_scale, b_scale = parts["fwd_s"] / fwd_total, (last - parts["fwd_s"]) / bwd_total
    grads_total = lc.resident_bytes[n_persist]
    if lc.hw.grads_held:  # kept from the last backward through this step
        static += grads_total
    t, act = prof.nonblock_fwd_s * f_scale / 2, 0
    points = [[0.0, static * frag + extra, "step start"]]
    for i, b in enumerate(blocks):
        t += b.fwd_s * f_scale
        act += kept[i]
        points.append([t, (static + act) * frag + extra, f"fwd block {i}"])
    act += prof.nonblock_saved_bytes
    t += prof.nonblock_fwd_s * f_scale / 2
    points.append([t, (static + act + lc.transient_bytes) * frag + extra, "head"])
    t += prof.nonblock_bwd_s * b_scale / 2
    for i in range(n - 1, -1, -1):
        t += blocks[i].bwd_s * b_scale
        act -= kept[i]
        grads = 0 if lc.hw.grads_held else grads_total * (n - i) // max(1, n)
        points.append([t, (static + max(act, 0) + grads) * frag + extra, f"bwd block {i}"])
    end = (0 if lc.hw.grads_held else grads_total) + prof.tail_bytes + lc.table_grad[n_persist]
    points.append([t_total, (static + end) * frag + extra, "step end"])
    return [[p[0], int(p[1]), p[2]] for p in points]
