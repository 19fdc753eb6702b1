"""chunked_loss (dynamo graph): cross-entropy over the output projection's logits, computed over
token chunks, so that the fp32 logits and their gradient never exist whole.

A language model's head and loss are the largest transient of its step: for 4 x 1024 tokens of a
128k vocabulary, eager keeps the fp32 upcast of the logits and their log-softmax for backward (2 GiB
each) and builds the fp32 gradient in backward (2 GiB more), all outside any block. The pass finds
``F.cross_entropy(x, target)`` whose input ``x`` is the logits flattened to 2-D, through the
``float()`` / ``view`` / ``reshape`` / ``contiguous`` steps Hugging Face's ``ForCausalLMLoss`` and
hand-written models put between them (the shift of the labels happens on the target, and stays), and
replaces it with protrain's chunked op (protrain_fx/runtime/loss_ops.py), which computes the same
fp32 loss and gradient a chunk of rows at a time:

* when the logits come from a bias-free ``linear`` and feed the loss alone (not a graph output):
  ``linear_cross_entropy(hidden, weight, ...)``; the logits then exist one chunk at a time too, and
  only their gradient, in the projection's dtype, has their full size (in backward);
* otherwise (Hugging Face returns the logits as well): ``cross_entropy(logits, ...)`` on the logits
  in their own dtype, so no fp32 copy is made.

Only what is exact is rewritten: no class weights, no label smoothing, ``reduction`` ``"mean"`` or
``"sum"``, an fp32 loss (as eager computes it after ``float()`` or under autocast), a vocabulary of
static size. The op runs eager's kernels a chunk at a time, so loss and gradients are eager's
bit for bit (a test checks it); the fused op's logits come from a matmul of the chunk's rows, which
some BLAS (AMD EPYC's) rounds by an ulp otherwise than the same rows of the whole matmul. The fused
op costs one more matmul of the head's size in backward; the profiler measures the rewritten graph,
so the cost model prices it. The pass records each rewrite in ``plan.notes``.
``PROTRAIN_DISABLE_PASSES=chunked_loss`` keeps eager's loss.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from protrain_fx import config
from protrain_fx.plan.plan import Plan
from protrain_fx.runtime import loss_ops  # noqa: F401  (registers the ops)

_CE_TARGETS = (F.cross_entropy,)
_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
# steps between the logits and the loss's 2-D input that keep each row's values
_SAME_ROWS_METHODS = ("float", "view", "reshape", "contiguous", "to", "flatten")
_SAME_ROWS_FUNCTIONS = (torch.reshape, torch.flatten)
_CE_SIGNATURE = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)


def _val(node):
    return (
        node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    )


def _ce_arguments(node: fx.Node) -> dict | None:
    if len(node.args) > len(_CE_SIGNATURE):
        return None
    out = dict(zip(_CE_SIGNATURE, node.args))
    out.update(node.kwargs)
    if set(out) - set(_CE_SIGNATURE):
        return None
    return out


def _keeps_rows(node: fx.Node, vocab: int) -> bool:
    """``node`` (one step back from the loss) keeps the logits' rows: a dtype cast to fp32 or a view
    with the same last dimension."""
    if node.op == "call_method" and node.target in _SAME_ROWS_METHODS:
        if node.target == "to":
            dtypes = [
                a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)
            ]
            others = [
                a for a in (*node.args[1:], *node.kwargs.values()) if not isinstance(a, torch.dtype)
            ]
            if dtypes != [torch.float32] or others:
                return False
    elif not (node.op == "call_function" and node.target in _SAME_ROWS_FUNCTIONS):
        return False
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[-1] == vocab


def _logits_source(x: fx.Node, vocab: int):
    """Walk from the loss's input back through row-keeping steps: (the logits node, the steps)."""
    chain = []
    node = x
    while _keeps_rows(node, vocab) and isinstance(node.args[0], fx.Node):
        chain.append(node)
        node = node.args[0]
    val = _val(node)
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.shape[-1] == vocab):
        return None, []
    return node, chain


def _alone(logits: fx.Node, chain: list, loss: fx.Node) -> bool:
    """The logits feed this loss and nothing else (through the chain)."""
    allowed = {loss, *chain}
    return all(set(n.users) <= allowed for n in (logits, *chain))


def _chunk_rows(vocab: int) -> int:
    return max(1, config.settings().loss_chunk_bytes // (vocab * 4))


def _fake(fn, *args):
    """The op's example output, computed on the graph's fake tensors (for later passes' meta)."""
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    fake = next((v for v in vals if isinstance(v, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return fn(*vals)


def _rewrite(graph: fx.Graph, loss: fx.Node, args: dict) -> str | None:
    x, target = args["input"], args["target"]
    vx, vloss, vt = _val(x), _val(loss), _val(target)
    if not (isinstance(x, fx.Node) and isinstance(target, fx.Node)):
        return None
    if not all(isinstance(v, torch.Tensor) for v in (vx, vloss, vt)):
        return None
    if args.get("weight") is not None or args.get("size_average") is not None:
        return None
    if args.get("reduce") is not None or args.get("label_smoothing", 0.0) != 0.0:
        return None
    reduction, ignore_index = args.get("reduction", "mean"), args.get("ignore_index", -100)
    if reduction not in ("mean", "sum") or not isinstance(ignore_index, int):
        return None
    if vx.dim() != 2 or vt.dim() != 1 or vt.dtype != torch.int64 or vloss.dtype != torch.float32:
        return None
    vocab = vx.shape[1]
    if not isinstance(vocab, int):
        return None
    logits, chain = _logits_source(x, vocab)
    if logits is None:
        return None
    rows = _chunk_rows(vocab)
    fused = (
        logits.op == "call_function"
        and logits.target in _LINEAR_TARGETS
        and len(logits.args) >= 2
        and (len(logits.args) < 3 or logits.args[2] is None)
        and not logits.kwargs
        and _alone(logits, chain, loss)
    )
    with graph.inserting_before(loss):
        if fused:
            hidden, weight = logits.args[0], logits.args[1]
            width = _val(hidden).shape[-1]
            flat = graph.call_method("reshape", (hidden, -1, width))
            extra = (ignore_index, reduction, rows, _val(logits).dtype)
            op, op_args = torch.ops.protrain.linear_cross_entropy.default, (flat, weight, target)
            what = "head and loss fused"
        else:
            flat = graph.call_method("reshape", (logits, -1, vocab))
            extra = (ignore_index, reduction, rows)
            op, op_args = torch.ops.protrain.cross_entropy.default, (flat, target)
            what = "loss from the logits"
        flat.meta["example_value"] = _fake(lambda t, *s: t.reshape(*s), *flat.args)
        out = graph.call_function(op, (*op_args, *extra))
        out.meta["example_value"] = _fake(op, *out.args)
        new_loss = graph.call_function(operator.getitem, (out, 0))
        new_loss.meta["example_value"] = _val(loss)
    loss.replace_all_uses_with(new_loss)
    graph.erase_node(loss)
    for node in chain:
        if not node.users:
            graph.erase_node(node)
    if fused:
        graph.erase_node(logits)
    tokens = vx.shape[0]
    return (
        f"cross-entropy over {tokens} x {vocab} logits in chunks of {rows} rows ({what}): "
        "no fp32 tensor of their full size"
    )


def chunked_loss(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace each exact-to-replace cross-entropy over logits with the chunked op (see module
    docstring)."""
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CE_TARGETS:
            continue
        args = _ce_arguments(node)
        note = _rewrite(gm.graph, node, args) if args is not None else None
        if note:
            notes.append(note)
    if notes:
        gm.graph.lint()
        gm.recompile()
        plan.notes.extend(notes)
    return gm
