"""What each placeholder of a dynamo graph is: a parameter (with its FQN), a buffer, or a user
input.

Dynamo deletes ``node.meta["grapharg"]`` once the backend returns, so :func:`capture_graph_inputs`
must run on entry to the backend. Placeholders come in first-use order, which is the order chunks
are packed in. :func:`traced_root` finds the module dynamo traced from the parameters' sources
(during dynamo's compile), or the one a re-plan names (:func:`replanning`: after it, dynamo's frame
is gone).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from protrain_fx import _compat

# a re-plan's root module (compiled_graph.ProtrainGraph.recompile: dynamo's frame is gone then)
_REPLAN_ROOT: contextvars.ContextVar = contextvars.ContextVar("protrain_replan_root", default=None)
# "L['self']", "L['args'][0]", "G['model']": the root of a dynamo source name.
_ROOT_RE = re.compile(r"^[LG]\[[^\]]*\](?:\[[^\]]*\])*")
# "._modules['blocks']", "._parameters['weight']", ".blocks", "[0]", "['key']"
_PART_RE = re.compile(
    r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*|\d+)|\[(\d+)\]|\['([^']+)'\]"
)


def fqn_from_source(name: str) -> str | None:
    """``L['self']._modules['blocks']._modules['0']._parameters['weight']`` -> ``blocks.0.weight``.

    Also takes the attribute style (``L['self'].blocks[0].weight``) that other torch versions print
    and the module paths of ``nn_module_stack`` (``L['self'].blocks.0``). Returns None for anything
    unparseable.
    """
    m = _ROOT_RE.match(name)
    if m is None:
        return None
    rest, parts, pos = name[m.end() :], [], 0
    while pos < len(rest):
        pm = _PART_RE.match(rest, pos)
        if pm is None:
            return None
        parts.append(next(g for g in pm.groups() if g is not None))
        pos = pm.end()
    return ".".join(parts)


def module_path(stack_entry_path: str) -> str:
    """A module path from ``nn_module_stack`` (``L['self'].blocks.0``) as a plain FQN
    (``blocks.0``)."""
    fqn = fqn_from_source(stack_entry_path)
    return fqn if fqn is not None else stack_entry_path


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the dynamo graph."""

    index: int  # position among the dynamo graph's placeholders (== joint-graph desc idx)
    node_name: str
    # "param" | "buffer" | "input", or in a region's graph a value another region computed
    # (protrain_fx/graph/regions.py): "activation" (needing gradients) or "shared"
    kind: str
    fqn: str | None  # parameter/buffer FQN relative to the compiled module, when known
    source: str | None
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int

    @property
    def is_param(self) -> bool:
        return self.kind == "param"


def capture_graph_inputs(
    gm: fx.GraphModule, example_inputs
) -> tuple[list[GraphInput], list[torch.Tensor | None]]:
    """Describe every placeholder of ``gm`` and return the real parameter objects beside (None
    elsewhere)."""
    infos, params = [], []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        ex = example_inputs[i] if i < len(example_inputs) else None
        ga = node.meta.get("grapharg")
        src = None
        if ga is not None and getattr(ga, "source", None) is not None:
            name = ga.source.name
            src = name if isinstance(name, str) else name()
        fqn = fqn_from_source(src) if src else None
        if isinstance(ex, torch.nn.Parameter):
            kind = "param"
        elif src is not None and "_buffers[" in src:
            kind = "buffer"
        else:
            kind = "input"
        is_tensor = isinstance(ex, torch.Tensor)
        infos.append(
            GraphInput(
                index=i,
                node_name=node.name,
                kind=kind,
                fqn=fqn if kind != "input" else None,
                source=src,
                shape=tuple(ex.shape) if is_tensor and not has_symbolic_shape(ex) else None,
                dtype=ex.dtype if is_tensor else None,
                nbytes=ex.numel() * ex.element_size()
                if is_tensor and not has_symbolic_shape(ex)
                else 0,
            )
        )
        params.append(ex if kind == "param" else None)
    return infos, params


def has_symbolic_shape(t: torch.Tensor) -> bool:
    """Whether dynamo traced ``t`` with a symbolic size (a dynamic graph)."""
    return any(not isinstance(s, int) for s in t.shape)


def joint_input_index(node: fx.Node, position: int) -> int | None:
    """Index into the dynamo placeholders of a joint/fw graph placeholder (``meta["desc"]``),
    falling back to its position for primals when the torch version has no descriptors. Tangents
    give None."""
    desc = node.meta.get("desc")
    if desc is not None:
        idx = getattr(desc, "idx", None)
        return idx if type(desc).__name__ == "PlainAOTInput" else None
    return position if node.name.startswith("primals") else None


def written_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The placeholders of a joint or forward graph that the call writes in place: aot_autograd
    keeps a buffer's update as an ``aten.copy_`` into it, and returns a parameter's new value as an
    output that its runtime copies in (the output's ``desc``: an ``InputMutationAOTOutput``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {
        n.args[0]
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
        if isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
    }
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {
        getattr(d.mutated_input, "idx", None)
        for d in output.meta.get("desc") or ()
        if type(d).__name__ == "InputMutationAOTOutput"
        and type(d.mutated_input).__name__ == "PlainAOTInput"
    }
    returned.discard(None)
    for position, node in enumerate(placeholders):
        if returned and joint_input_index(node, position) in returned:
            written.add(node)
    return written


def traced_root(graph_inputs):
    """The module dynamo is tracing (the root of the parameters' sources): for state_dict hooks, the
    blocks' structure and, compiled in regions, the block's siblings (a re-plan that lost it
    planned one of ``N`` blocks for the whole budget). Outside dynamo's compile, a re-plan's."""
    for gi in graph_inputs:
        if gi.is_param and gi.source:
            m = _ROOT_RE.match(gi.source)
            if m and (root := _compat.traced_root_object(m.group(0))) is not None:
                return root
    return _REPLAN_ROOT.get()


@contextlib.contextmanager
def replanning(root):
    """:func:`traced_root` gives ``root`` inside (a re-plan of a graph dynamo traced from it)."""
    token = _REPLAN_ROOT.set(root)
    try:
        yield
    finally:
        _REPLAN_ROOT.reset(token)
