"""Transformer-block detection from FX node metadata.

A block is a repeated child of a container (``nn.ModuleList`` / ``nn.Sequential``): a module whose
path ends in an integer index (``blocks.3``, ``transformer.h.0``, ``model.layers.11``) among
siblings that all share one class (a one-layer model has one block) or of which at least two share a
class (hybrid stacks). When several containers qualify (a ``Sequential`` inside each block, say),
the one whose children cover the most forward nodes wins, ties going to the outermost. Everything
else (embeddings, stems, heads, final norms, the loss) is a non-block region.

Dynamo records the module path of every forward node in ``meta["nn_module_stack"]``; AOTAutograd
copies it to the joint graph's forward nodes and puts the forward module's stack on backward nodes
as ``meta["fwd_nn_module_stack"]``.

The model's own per-layer checkpointing (Hugging Face's gradient checkpointing) can hide its layers
from dynamo altogether: :func:`refuse_untraced_checkpointing` says so instead of planning without
them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from protrain_fx.errors import ProtrainError
from protrain_fx.graph import regional
from protrain_fx.graph.inputs import module_path
from protrain_fx.runtime.chunk_store import store_of


@dataclass(frozen=True)
class Block:
    index: int  # execution order of the block's first forward node
    name: str  # module FQN, e.g. "blocks.3"
    module_class: str


@dataclass
class BlockStructure:
    container: str | None  # FQN of the container ("blocks"), None when no blocks were found
    blocks: list[Block] = field(default_factory=list)
    reason: str = ""  # why no blocks were found, for the plan summary

    def __post_init__(self):
        self._by_name = {b.name: b for b in self.blocks}

    def block_of_path(self, path: str) -> Block | None:
        """The block that module path ``path`` (FQN) lies in, if any."""
        if self.container is None:
            return None
        prefix = self.container + "." if self.container else ""
        if not path.startswith(prefix):
            return None
        head = path[len(prefix) :].split(".", 1)[0]
        return self._by_name.get(prefix + head)

    def block_of_param(self, fqn: str) -> Block | None:
        return self.block_of_path(fqn.rsplit(".", 1)[0] if "." in fqn else "")

    def block_of_node(self, node: fx.Node) -> Block | None:
        """Block of a node from its own module stack, or for backward nodes the forward module's
        stack."""
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            stack = node.meta.get(key)
            if stack:
                for path, _cls in stack.values():  # outermost first
                    b = self.block_of_path(module_path(path))
                    if b is not None:
                        return b
                return None
        return None


class WholeGraphBlock(BlockStructure):
    """The structure of a graph that is one block by itself: regional compilation
    (``block.compile(backend="protrain")`` for every block) traces each block alone, with no
    container around it, and every node of the graph belongs to that block."""

    def __init__(self, module_class: str):
        super().__init__("", [Block(0, "", module_class)])

    def block_of_path(self, path: str) -> Block | None:
        return self.blocks[0]

    def block_of_node(self, node: fx.Node) -> Block | None:
        return self.blocks[0]


def _class_name(cls) -> str:
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(cls)


def detect_blocks(gm: fx.GraphModule, root=None) -> BlockStructure:
    """Find the repeated blocks of the forward graph ``gm`` (a dynamo graph or a joint graph).
    ``root``: the module dynamo traced, when known; a module compiled on its own
    (``module.compile()``: regional compilation) whose graph holds no repeated children is one block
    (:class:`WholeGraphBlock`), and so is one of several blocks of one structure each compiled
    apart (``layers[i] = torch.compile(layers[i])``: the module inside torch.compile's wrapper)."""
    found = _detect(gm)
    if (
        not found.blocks
        and root is not None
        and (
            getattr(root, "_compiled_call_impl", None) is not None
            or len(regional.siblings(root)) > 1
        )
    ):
        return WholeGraphBlock(_class_name(type(root)))
    return found


def _detect(gm: fx.GraphModule) -> BlockStructure:
    # container -> child index -> class; container -> number of forward nodes under its children
    children: dict[str, dict[int, str]] = defaultdict(dict)
    coverage: dict[str, int] = defaultdict(int)
    first_seen: dict[str, int] = {}  # "container.idx" -> position of its first node
    n_with_stack = 0
    for pos, node in enumerate(gm.graph.nodes):
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        n_with_stack += 1
        counted: set[str] = set()
        for path, cls in stack.values():
            fqn = module_path(path)
            parent, _, last = fqn.rpartition(".")
            if not last.isdigit():
                continue
            children[parent][int(last)] = _class_name(cls)
            first_seen.setdefault(fqn, pos)
            if parent not in counted:  # a node counts once per container it lies in
                coverage[parent] += 1
                counted.add(parent)
    if n_with_stack == 0:
        return BlockStructure(
            None, [], reason="the graph carries no module metadata (nn_module_stack)"
        )

    def repeated(parent: str) -> bool:
        # all children of one class (a one-layer model has a single block), or at least two sharing
        # one
        classes = list(children[parent].values())
        return len(set(classes)) == 1 or len(set(classes)) < len(classes)

    candidates = [p for p in children if repeated(p)]
    if not candidates:
        return BlockStructure(None, [], reason="no ModuleList/Sequential holds repeated children")
    container = max(candidates, key=lambda p: (coverage[p], -p.count("."), -len(p)))
    prefix = container + "." if container else ""
    names = sorted((prefix + str(i) for i in children[container]), key=lambda n: first_seen[n])
    blocks = [
        Block(index=i, name=name, module_class=children[container][int(name.rsplit(".", 1)[-1])])
        for i, name in enumerate(names)
    ]
    return BlockStructure(container, blocks)


def refuse_untraced_checkpointing(root, live) -> None:
    """Refuse a model whose own checkpointed layers ran outside every compiled graph.

    Hugging Face's gradient checkpointing from transformers 5.25 on checkpoints each decoder layer's
    ``forward``, and dynamo cannot trace some layers inside that checkpoint (a graph break in the
    higher-order op): it skips the loop over the layers, which then run eagerly. Their parameters
    reach no protrain graph, so no plan places or offloads them, and the budget would not hold. A
    graph whose traced module holds such layers (checkpointing on, in training, none of their
    parameters in this graph or in an earlier graph's chunks; earlier graphs run first) says so;
    only when none of the checkpointed layers reached a graph (some that did not may be unused).
    """
    if not isinstance(root, torch.nn.Module) or not torch.is_grad_enabled():
        return
    in_graph = {id(p) for p in live}
    # the checkpointed layers themselves (HF also flags the model that holds them): those with no
    # flagged module below them
    flagged = [
        (name, m)
        for name, m in root.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True and m.training
    ]
    layers = [
        (name, m)
        for name, m in flagged
        if not any(
            o is not m and other.startswith(f"{name}." if name else "") for other, o in flagged
        )
        and any(True for _ in m.parameters())
    ]
    hidden = [
        name
        for name, m in layers
        if not any(id(p) in in_graph or store_of(p) is not None for p in m.parameters())
    ]
    if len(hidden) < len(layers):  # some of them are in graphs: the rest may just be unused
        hidden = []
    if hidden:
        raise ProtrainError(
            f"the model checkpoints its own layers ({len(hidden)} of them, e.g. "
            f"{hidden[0]!r}: Hugging Face gradient checkpointing) and torch.compile could not "
            f"trace them: they ran eagerly, outside every graph, so protrain cannot place or "
            f"offload their parameters and its memory budget would not hold. protrain's "
            f"per-block plan (keep, swap or recompute each block to fit the budget) replaces "
            f"that checkpointing: call model.gradient_checkpointing_disable() before the first "
            f"step (torch.compile skips the code it could not trace for the rest of the process)"
        )
