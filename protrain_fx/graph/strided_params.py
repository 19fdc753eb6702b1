"""Parameters that are not contiguous: a checkpoint stored transposed and loaded with
``load_state_dict(..., assign=True)``, or ``nn.Parameter(w.t())``.

A chunk holds each parameter as a contiguous slice, and a parameter placed in one becomes a
contiguous view of it. Dynamo guards the strides it traced and checks those guards against the
frame right after the backend returns, so placing such a parameter while compiling the frame that
traced it fails dynamo's own check. The backend therefore runs that first graph as traced (plain
PyTorch ops, exact: no chunks, the user's optimizer steps as it would eagerly) after making the
parameters contiguous at the start of its call (same values, one copy each, said once). The next
call no longer matches the traced strides, dynamo traces the frame again, and protrain compiles
that one with every parameter contiguous.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

log = logging.getLogger("protrain_fx")


def non_contiguous(graph_inputs, params) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the graph's parameters that are not contiguous."""
    return [
        (gi.fqn or gi.node_name, p)
        for gi, p in zip(graph_inputs, params)
        if p is not None and not p.is_contiguous()
    ]


def eager_once_then_contiguous(gm: fx.GraphModule, strided: list[tuple[str, torch.Tensor]]):
    """What the backend returns for a graph with non-contiguous parameters: the traced graph, run
    as it is, the parameters made contiguous when it is first called (after dynamo's check)."""
    pending, said = list(strided), []

    def first_call(*args):
        if not pending and not said:  # dynamo guards no strides here (guards filtered, say)
            said.append(True)
            log.warning(
                "protrain: dynamo did not trace the graph again after its parameters were made "
                "contiguous (it does not guard their strides here): this graph runs eagerly, "
                "nothing offloaded. Make parameters contiguous before compiling the model"
            )
        if pending:
            names = ", ".join(f"{n} (strides {tuple(p.stride())})" for n, p in pending[:4])
            more = f" and {len(pending) - 4} more" if len(pending) > 4 else ""
            with torch.no_grad():
                for _, p in pending:
                    p.data = p.data.contiguous()
            pending.clear()
            log.warning(
                "protrain: parameters that are not contiguous, %s%s, are made contiguous (same "
                "values): chunks hold parameters contiguously. This call runs as traced (eagerly); "
                "dynamo, which guards their strides, traces the next one again for protrain",
                names,
                more,
            )
        return gm(*args)

    return first_call
