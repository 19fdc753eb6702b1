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

* when the logits come from a bias-free ``linear`` and feed the loss alone:
  ``linear_cross_entropy(hidden, weight, ...)``; the logits and their gradient then exist one chunk
  at a time too (backward takes slices of the vocabulary);
* the same when the logits are also a graph output (Hugging Face returns them beside the loss):
  the output is then the same ``linear`` on detached inputs, so that aot_autograd gives it no
  gradient (it would otherwise make a zero gradient of the logits' full size in every backward
  and keep the logits for the loss's backward), and the graph returns the hidden states as one more
  output, which the backend hands to :func:`protrain_fx.runtime.loss_ops.reattach_logits`: the
  user gets the logits as eager's, with a gradient function of their own that, if a loss of the
  user's reaches them, back-propagates as eager's projection would
  (:class:`~protrain_fx.runtime.loss_ops.LogitsOfChunkedLoss`; ``plan.logits_outputs`` lists the
  outputs it rewrote: the logits' position, the hidden states' and the head weight's input);
* otherwise (the logits feed other computations too): ``cross_entropy(logits, ...)`` on the logits
  in their own dtype, so no fp32 copy is made.

Only what is exact is rewritten: no class weights, no label smoothing, ``reduction`` ``"mean"`` or
``"sum"``, an fp32 loss (as eager computes it after ``float()`` or under autocast), a vocabulary of
static size. The op from the logits runs eager's kernels a chunk at a time, so loss and gradients
are eager's bit for bit (a test checks it); the fused op's loss is eager's too (its logits come
from a matmul of the chunk's rows, which some BLAS, AMD EPYC's, rounds by an ulp otherwise than the
same rows of the whole matmul), its gradients eager's within fp32 rounding (backward sums the
hidden states' gradient over slices of the vocabulary). The fused op costs one more matmul of the
head's size in backward; the profiler measures the rewritten graph,
so the cost model prices it. The pass records each rewrite in ``plan.notes``.
``PROTRAIN_DISABLE_PASSES=chunked_loss`` keeps eager's loss.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from protrain_fx import config
from protrain_fx.graph.fx import example_value
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
    return example_value(node)


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


def _is_detach(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "detach") or (
        node.op == "call_function" and node.target in (torch.detach, torch.Tensor.detach)
    )


def _returned(logits: fx.Node) -> set:
    """The users of ``logits`` that return them from the graph: the output (the logits directly in
    its flat tuple) and ``detach`` nodes whose only user is the output."""
    out = set()
    for u in logits.users:
        if u.op == "output" and isinstance(u.args[0], (tuple, list)) and logits in u.args[0]:
            out.add(u)
        elif _is_detach(u) and u.users and all(w.op == "output" for w in u.users):
            out.add(u)
    return out


def _alone(logits: fx.Node, chain: list, loss: fx.Node, output_too: bool = False) -> bool:
    """The logits feed this loss and nothing else (through the chain); ``output_too``: they may
    also leave the graph (:func:`_returned`)."""
    allowed = {loss, *chain} | (_returned(logits) if output_too else set())
    return set(logits.users) <= allowed and all(set(n.users) <= {loss, *chain} for n in chain)


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


def _detach_output(graph: fx.Graph, logits: fx.Node, hidden: fx.Node, weight: fx.Node) -> list:
    """The logits, which also leave the graph, computed from detached inputs (no gradient from
    aot_autograd). Where the graph returns them themselves (not only a ``detach`` of them), the
    hidden states become one more output: [(the logits' output position, the hidden states')]."""
    with graph.inserting_before(logits):
        detached = []
        for x in (hidden, weight):
            d = graph.call_method("detach", (x,))
            d.meta["example_value"] = _fake(lambda t: t.detach(), x)
            detached.append(d)
    logits.args = (*detached, *logits.args[2:])  # the same value: its example value stays
    out = next(n for n in graph.nodes if n.op == "output")
    if out not in logits.users:
        return []
    flat = list(out.args[0])
    where = len(flat)
    flat.append(hidden)
    out.args = (type(out.args[0])(flat), *out.args[1:])
    # the weight's position among the graph's inputs, for the logits' own gradient (-1: none)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    w = inputs.index(weight) if weight in inputs else -1
    return [(k, where, w) for k, n in enumerate(flat[:where]) if n is logits]


def _rewrite(graph: fx.Graph, loss: fx.Node, args: dict, plan: Plan) -> str | None:
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
        and _alone(logits, chain, loss, output_too=True)
    )
    as_output = fused and bool(_returned(logits))
    with graph.inserting_before(loss):
        if fused:
            hidden, weight = logits.args[0], logits.args[1]
            width = _val(hidden).shape[-1]
            flat = graph.call_method("reshape", (hidden, -1, width))
            compute = _val(logits).dtype
            extra = (ignore_index, reduction, rows, compute)
            low = weight
            if _val(weight).dtype != compute:
                # the weight in the dtype the projection runs in (autocast's cast, as eager's):
                # the op's weight gradient then comes back in it, and its upcast is a node of the
                # graph (which passes/optimizer_calls.py leaves to the host for an oversized chunk)
                low = graph.call_method("to", (weight, compute))
                with _val(weight).fake_mode:
                    low.meta["example_value"] = torch.empty_like(_val(weight), dtype=compute)
            op, op_args = torch.ops.protrain.linear_cross_entropy.default, (flat, low, target)
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
    if as_output:
        plan.logits_outputs.extend(_detach_output(graph, logits, hidden, weight))
        what += ", the logits returned from detached inputs"
    elif fused:
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
        note = _rewrite(gm.graph, node, args, plan) if args is not None else None
        if note:
            notes.append(note)
    if notes:
        gm.graph.lint()
        gm.recompile()
        plan.notes.extend(notes)
    return gm
