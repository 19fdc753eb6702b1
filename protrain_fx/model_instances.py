"""Another model of the same structure behind one dynamo graph: a graph of its own for it.

Dynamo keeps one compiled graph per code object and guards; two instances of one model class built
alike (two seeds kept side by side, a GAN or an ensemble of twins, a model trained while the last
run's is still referenced) pass the same guards, and the second instance's call reaches the first's
:class:`~protrain_fx.compiled_graph.ProtrainGraph` with its own parameters. The graph's code is laid
out for the first instance's chunk stores (binding.py). For the blocks of one model that dynamo runs
through one graph (regional compilation, a graph break in the block loop) the binding makes their
stores like the graph's own: same plan, one optimizer, the budget shared by the blocks. A whole
model's parameters are another matter: before, they ran the traced graph eagerly (exact, but
nothing placed: on a GPU the second model's whole state on the device, and a ``host_init`` model's
empty shells read). Now :func:`other_model` gives the call a graph of its own, compiled and planned
for the second instance's parameters (its own chunk stores, its own optimizer as found for them,
the first instance's memory counted as others'), once per instance; the first graph routes the
instance's calls to it by its first parameter (one identity compare per call otherwise).
"""

from __future__ import annotations

import logging
import weakref

from protrain_fx.runtime import optimizer_lookup
from protrain_fx.runtime.chunk_store import store_of

log = logging.getLogger("protrain_fx")


def other_model(graph, args):
    """The graph to run ``args`` on instead of ``graph``: ``graph``'s own (None) unless its first
    parameter input is another model's, in no chunk store yet (or already routed), and the graph
    makes no stores like its own for such parameters (a whole model's graph, not a block's)."""
    k = graph.anchor
    if k is None or graph.binding is None:
        return None
    gi, ref = graph._graph_inputs[k], graph._params[k]
    p = args[gi.index]
    if ref() is p:
        return None  # its own parameters
    found = graph.instances.get(id(p))
    if found is not None:
        if found[0]() is p:
            return found[1]
        del graph.instances[id(p)]  # a parameter gone, its id reused
    if store_of(p) is not None or graph.binding.makes_like_its_own:
        return None  # placed by the graph's own stores' likeness, or to be: binding.py
    graph.instances_made = getattr(graph, "instances_made", 0) + 1
    child = _compile_for(graph, args, f"{graph.plan.graph_name}.{graph.instances_made}")
    graph.instances[id(p)] = (weakref.ref(p, _forget(graph, id(p))), child)
    return child


def _forget(graph, key: int):
    """The callback that drops an instance's graph (its code, its stores' bookkeeping) once the
    instance's parameter is freed: before, every deleted twin's graph stayed (4 MiB a model)."""
    owner = weakref.ref(graph)

    def forget(ref) -> None:
        g = owner()
        if g is not None and g.instances.get(key, (None,))[0] is ref:
            del g.instances[key]

    return forget


def _compile_for(graph, args, name: str):
    params = [
        None if r is None else args[gi.index] for gi, r in zip(graph._graph_inputs, graph._params)
    ]
    optimizer, _ = optimizer_lookup.find_optimizer(params)
    log.warning(
        "protrain: graph %s was called with the parameters of another model of the same "
        "structure (dynamo runs one graph for both); planning and compiling graph %s for them",
        graph.plan.graph_name,
        name,
    )
    child = type(graph)(
        graph._eager_graph,
        graph._graph_inputs,
        params,
        graph._options,
        graph._merged,
        optimizer,
        list(args),
        graph._compile,
    )
    note = "compiled for another model of the same structure, which dynamo runs through one graph"
    child.recompile(args, (), note, graph_name=name)
    return child
