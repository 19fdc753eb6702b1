"""A graph compiled in regions (protrain_fx/graph/regions.py): each distinct region compiled once,
its code run for every region like it, one plan for the whole graph.

:func:`compile_program` takes the dynamo graph's :class:`~protrain_fx.graph.regions.RegionSplit`
and the whole graph's :class:`~protrain_fx.plan.plan.Plan` (its knobs, and a chunk layout whose
chunks never span two regions) and compiles the regions in forward order through the same pipeline
as a whole graph (``compile_region``: backend.py's dynamo stage, aot_autograd, the passes,
Inductor), each under its share of the plan:

* its chunks: the whole plan's first ``n_persist`` chunks are resident, so a region whose chunks are
  ``c0 .. c1`` keeps ``n_persist - c0`` of them (clamped), in a chunk store of its own;
* its activation policy: the block's (keep / swap / recompute), from the interleaved layout.

Regions with the same computation (signature), the same inputs needing gradients, the same policy
and the same placement of their chunks are one *variant*: compiled for the first such region, and
bound to the others' parameters (protrain_fx/runtime/binding.py makes their stores like the first
one's, here, before the first step). A 28-layer model under a plan with resident, partly resident
and offloaded blocks, some recomputed, compiles about five blocks' code instead of 28.

:class:`RegionProgram` is what runs: the top graph of the split (plain Python calling the regions
in order), each region a :class:`RegionCall` of its variant. When the plan profiles blocks
(the automatic plan's profiling step, ``PROTRAIN_PROFILE_BLOCKS=1``), a block's call wraps what it
reads and returns in ``protrain::mark`` with the block's index in the whole graph, so one step
times every block (protrain_fx/runtime/block_timer.py). Example values for each region's inputs
are the fake values dynamo traced (symbolic sizes included: one compile serves every sequence
length); a re-plan in a fake mode of its own runs the top graph on fake tensors (the regions'
uncompiled code) for them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from protrain_fx import _compat, code_cache, progress
from protrain_fx.errors import ProtrainError
from protrain_fx.graph import regions
from protrain_fx.graph.build_plan import make_plan
from protrain_fx.graph.fx import copy_graph_module, example_value
from protrain_fx.graph.regions import Region, RegionSplit
from protrain_fx.machine import pinned
from protrain_fx.options import Options, format_bytes
from protrain_fx.plan.plan import Plan
from protrain_fx.plan.profiles import block_policy
from protrain_fx.profiling.static import SavedBytes, StaticProfile
from protrain_fx.runtime import block_timer, chunk_buffers, chunk_store, swap_pool
from protrain_fx.runtime.binding import GraphBinding, placement_signature


@dataclass
class Variant:
    """One compiled region's code and the regions it runs for."""

    key: tuple
    description: str
    compiled: Callable
    binding: GraphBinding
    plan: Plan
    regions: list[int] = field(default_factory=list)


class RegionCall(torch.nn.Module):
    """One region of a :class:`RegionProgram`: its variant's code on its own parameters."""

    def __init__(self, region: Region, variant: Variant, marks: bool, swaps: bool):
        super().__init__()
        self.region_name = region.name
        self.index = region.index
        self.block = region.block
        self.swaps = swaps
        self.returns_tuple = region.returns_tuple
        self.variant = variant
        self.marks = marks and region.block is not None
        # which inputs carry a value another region computed (marked when profiling)
        self._activation = [t is None for t in region.top_inputs]
        # the chunks its forward and its backward gather first, as recorded at their first run
        # (the region before it prefetches them ahead), and the neighbours in forward order
        self.fw_keys: list | None = None
        self.bw_keys: list | None = None
        self._bw_start: int | None = None
        self.before: RegionCall | None = None
        self.after: RegionCall | None = None

    def forward(self, *args):
        if self.swaps:  # swapped blocks' copies are waited for two regions on
            swap_pool.region_begins(self.index)
        if self.marks:
            args = tuple(
                torch.ops.protrain.mark(a, self.block, block_timer.FWD_ENTER)
                if act and _differentiable(a)
                else a
                for a, act in zip(args, self._activation)
            )
        start = chunk_buffers.trace_begin() if self.fw_keys is None else None
        try:
            out = self.variant.binding(self.variant.compiled, list(args))
        finally:
            keys = chunk_buffers.trace_end(start) if start is not None else None
        if keys is not None:
            self.fw_keys = keys
        if self.after is not None and self.after.fw_keys:
            _prefetch_ahead(self.after.fw_keys)  # while this region's kernels still run
        if torch.is_grad_enabled():
            for o in out:
                if _differentiable(o):
                    o.register_hook(self._backward_begins)
            # the first of its inputs' gradients marks the end of its backward (an input that a
            # later region reads too gets its whole gradient only after that region's backward)
            once = [False]
            for a, act in zip(args, self._activation):
                if act and _differentiable(a):
                    a.register_hook(functools.partial(self._backward_ends, once))
        if self.marks:
            out = [
                torch.ops.protrain.mark(o, self.block, block_timer.FWD_EXIT)
                if _differentiable(o)
                else o
                for o in out
            ]
        return tuple(out) if self.returns_tuple else out[0]

    def _backward_begins(self, grad) -> None:
        """A gradient of its output is there: its backward runs next (recorded the first time)."""
        if self.bw_keys is None and self._bw_start is None:
            self._bw_start = chunk_buffers.trace_begin()

    def _backward_ends(self, once: list, grad) -> None:
        """A gradient of its inputs is computed: its backward is done, the region before it runs
        its backward next, whose first chunks are prefetched now (at the first input's, ``once``
        per forward)."""
        if once[0]:
            return
        once[0] = True
        if self._bw_start is not None:
            self.bw_keys = chunk_buffers.trace_end(self._bw_start)
            self._bw_start = None
        if self.before is not None and self.before.bw_keys:
            _prefetch_ahead(self.before.bw_keys)


def _prefetch_ahead(keys: list) -> None:
    """Prefetch the first chunks a region gathers (as many as their buffers hold) into free
    buffers: the copies overlap the end of the region before it (chunk_buffers, ``ahead``)."""
    done: set = set()
    limit = None
    for sid, chunk in keys:
        store = chunk_store.live_store(sid)
        if store is None or store.buffers is None or (sid, chunk) in done:
            continue
        limit = len(store.buffers.slots) if limit is None else limit
        if len(done) >= limit:
            return
        done.add((sid, chunk))
        store.prefetch(chunk, ahead=True)


def _differentiable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()


class RegionProgram:
    """The compiled graph: the split's top graph with every region replaced by its call."""

    def __init__(self, top: fx.GraphModule, calls: list[RegionCall], variants: list[Variant]):
        self.top = top
        self.calls = calls
        self.variants = variants
        self.swaps = any(c.swaps for c in calls)
        for a, b in zip(calls, calls[1:]):
            a.after, b.before = b, a

    def __call__(self, *args):
        if not self.swaps:
            return self.top(*args)
        try:
            return self.top(*args)
        finally:  # the last blocks' copies, before anything can reload them
            swap_pool.region_begins(None)

    def static_profile(self, n_blocks: int) -> StaticProfile:
        """The whole graph's static profile, from its variants' (profiling plan only): every block
        takes its variant's, the code outside blocks adds up over the regions."""
        keep, recompute, share = [0] * n_blocks, [0] * n_blocks, [1.0] * n_blocks
        sigs: list = [None] * n_blocks
        nonblock_keep = nonblock_recompute = shared_keep = shared_recompute = 0
        for call in self.calls:
            static = call.variant.plan.static_profile
            if static is None:
                continue
            saved = static.saved
            nonblock_keep += saved.nonblock_keep
            nonblock_recompute += saved.nonblock_recompute
            # inputs the regions share are the same tensors in each: counted once
            shared_keep = max(shared_keep, saved.shared_keep)
            shared_recompute = max(shared_recompute, saved.shared_recompute)
            b = call.block
            if b is None or not saved.keep:
                continue
            keep[b], recompute[b] = saved.keep[0], saved.recompute[0]
            share[b] = static.recomputed_share[0]
            sigs[b] = (call.variant.key[0], static.signatures[0] if static.signatures else None)
        return StaticProfile(
            SavedBytes(
                keep, recompute, nonblock_keep + shared_keep, nonblock_recompute + shared_recompute
            ),
            share,
            sigs if all(s is not None for s in sigs) else [],
        )

    def describe(self) -> str:
        served = sum(code_cache.SERVED_NOTE in v.plan.notes for v in self.variants)
        return (
            f"compiled in {len(self.calls)} regions with {len(self.variants)} distinct codes"
            + (f" ({served} served from aot_autograd's cache)" if served else "")
            + ": "
            + "; ".join(f"{v.description} x{len(v.regions)}" for v in self.variants)
        )


def _fake_examples(split: RegionSplit, example_inputs: list) -> list[list]:
    """Each region's example inputs: the graph's own inputs as they are, the values regions pass
    each other as the compile's fake mode traced them (module docstring)."""
    mode = torch._guards.detect_fake_mode(example_inputs)
    traced = mode and _traced_examples(split, example_inputs, mode)
    return traced or _propagated_examples(split, example_inputs, mode)


def _traced_examples(split: RegionSplit, example_inputs: list, mode) -> list[list] | None:
    """The values dynamo traced (its placeholders' example values, symbolic sizes included) as fakes
    of ``mode``, when every one is of ``mode``'s shape environment (dynamo hands its backend a fake
    mode of its own over the tracer's shape environment): running the regions again on fakes
    would be a second trace, and ops that read a symbolic size as an int there (on CUDA, in the
    pre-block region of an HF Llama) turned it into a constant, one graph per sequence length
    (benchmarks/dynamic_lengths_probe.py)."""
    shape_env = mode.shape_env
    out = []
    for r in split.regions:
        args = []
        for p, t in zip(r.gm.graph.find_nodes(op="placeholder"), r.top_inputs):
            val = example_inputs[t] if t is not None else example_value(p)
            if t is None:
                if isinstance(val, torch.Tensor):
                    if getattr(getattr(val, "fake_mode", None), "shape_env", None) is not shape_env:
                        return None
                    val = mode.from_tensor(val)  # the same symbolic sizes, the same shape env
                elif isinstance(val, torch.SymInt):
                    if val.node.shape_env is not shape_env:
                        return None
                elif not isinstance(val, (int, float, bool)):
                    return None
            args.append(val)
        out.append(args)
    return out


def _propagated_examples(split: RegionSplit, example_inputs: list, mode) -> list[list]:
    """The values regions pass each other from running the uncompiled regions in ``mode`` (a
    re-plan's own fake mode, whose values dynamo's trace does not hold)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    vals: dict[str, Any] = {}

    class Prop(FakeTensorProp):
        def run_node(self, n):
            out = super().run_node(n)
            vals[n.name] = out
            return out

    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    # under the python dispatcher, as dynamo and aot_autograd trace: outside it, C++ kernels that
    # read sizes as ints specialize symbolic ones (_traced_examples)
    with _compat.allow_non_fake_inputs(mode), enable_python_dispatcher():
        Prop(split.top, mode).propagate_dont_convert_inputs(*fakes)
    out = []
    for r in split.regions:
        call = next(
            n for n in split.top.graph.nodes if n.op == "call_module" and n.target == r.submod
        )
        args = []
        for a, t in zip(call.args, r.top_inputs):
            args.append(example_inputs[t] if t is not None else vals[a.name])
        out.append(args)
    return out


def _region_options(opts: Options, plan: Plan, region: Region, n_local: int):
    """The block's policy and the region's options: the whole plan's knobs for its share."""
    policy = (
        block_policy(region.block, plan.n_swap, plan.n_checkpoint)
        if region.block is not None
        else None
    )
    return policy, dataclasses.replace(
        opts,
        chunk_size=plan.chunk_size,
        n_persist=n_local,
        n_shard=0,
        n_swap=1 if policy == "swap" else 0,
        n_checkpoint=1 if policy == "recompute" else 0,
    )


def _region_chunks(plan: Plan, split: RegionSplit, inputs) -> dict[int, list[int]]:
    """Region -> the whole plan's chunks its store holds."""
    chunk_of = {s.fqn: s.chunk for s in plan.layout.slots}
    out: dict[int, list[int]] = {}
    ordered, groups = split.ordered_params(inputs)
    for gi, r in zip(ordered, groups):
        c = chunk_of[gi.fqn or gi.node_name]
        if c not in out.setdefault(r, []):
            out[r].append(c)
    return out


def compile_program(
    gm: fx.GraphModule,
    structure,
    example_inputs: list,
    graph_inputs: list,
    opts: Options,
    plan: Plan,
    compile_region: Callable,
    root=None,
) -> RegionProgram:
    """Compile the dynamo graph ``gm`` (blocks ``structure``) in regions under ``plan`` (module
    docstring). ``compile_region(gm, examples, graph_inputs, params, plan, opts) -> compiled``
    compiles one region's graph; ``root``: the module dynamo traced (state-dict hooks of stores
    made for other regions' parameters). ``gm``'s own nodes are not changed."""
    split, why = regions.split(copy_graph_module(gm), structure)
    if split is None:
        raise ProtrainError(f"protrain internal error: the graph no longer splits ({why})")
    prog = progress.current()
    # regions run in one process, where chunks "sharded" over one rank are resident
    n_persist = plan.layout.n_chunks if opts.n_persist is None else opts.n_persist
    n_persist += opts.n_shard or 0
    chunks = _region_chunks(plan, split, graph_inputs)
    examples = _fake_examples(split, list(example_inputs))
    variants: dict[tuple, Variant] = {}
    calls: list[RegionCall] = []
    t0 = time.perf_counter()
    # regions bound to an earlier region's code: how many, in how many seconds, from what host bytes
    n_bound, bound_s, host_before = 0, 0.0, pinned.allocated_bytes()
    graphs = _compat.SeveralGraphs()
    with _compat.eager_backward_compile(), progress.silenced():
        for r, ex in zip(split.regions, examples):
            owned = chunks.get(r.index, [])
            n_local = max(0, min(len(owned), n_persist - owned[0])) if owned else 0
            policy, ropts = _region_options(opts, plan, r, n_local)
            params = [
                ex[k] if t is not None and graph_inputs[t].is_param else None
                for k, t in enumerate(r.top_inputs)
            ]
            live = [p for p in params if p is not None]
            # some of them placed by an earlier region (a tied head, a layer shared by blocks):
            # a code of its own, so the unplaced ones are not bound to another region's code (a
            # binding places them only where none is placed)
            placed = (
                (placement_signature(live, unplaced=True), r.index)
                if any(chunk_store.store_of(p) for p in live)
                else None
            )
            grads = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in ex)
            key = (r.signature, grads, policy, n_local if placed is None else None, placed)
            v = variants.get(key)
            if v is None:
                # parameters an earlier graph placed (evaluation, a re-plan) keep their chunks
                on_device, held = (n_local, len(owned)) if placed is None else _held(live)
                what = (
                    f"{r.name}"
                    + (f" ({policy}" if policy else " (")
                    + f"{', ' if policy else ''}{on_device} of {held} chunks resident)"
                )
                prog.line(f"compiling region code {len(variants) + 1}: {what}")
                v = _compile_variant(r, ex, graph_inputs, params, ropts, plan, compile_region, root)
                graphs.compiled()
                v.key, v.description = key, what
                variants[key] = v
            else:
                if not n_bound:  # stores made and host memory pinned: seconds on a large model
                    prog.line(
                        "binding the regions that reuse a compiled code to chunk stores of "
                        "their own (host memory for their offloaded chunks)"
                    )
                t1 = time.perf_counter()
                v.binding.bind(live)
                n_bound, bound_s = n_bound + 1, bound_s + time.perf_counter() - t1
            v.regions.append(r.index)
            calls.append(RegionCall(r, v, plan.profile_blocks, plan.n_swap > 0))
    top = split.top
    for r, call in zip(split.regions, calls):
        delattr(top, r.submod)
        top.add_submodule(r.submod, call)
    top.recompile()
    program = RegionProgram(top, calls, list(variants.values()))
    if n_bound:
        said = (
            f"bound {n_bound} regions to chunk stores in {bound_s:.1f} s "
            f"({format_bytes(pinned.allocated_bytes() - host_before)} of host memory)"
        )
        prog.line(said)
        plan.notes.append(said)
    _describe(plan, program, graph_inputs, example_inputs)
    plan.notes.append(program.describe() + f" in {time.perf_counter() - t0:.1f} s")
    if plan.profiling:
        plan.static_profile = program.static_profile(len(structure.blocks))
    return program


def _held(params: list) -> tuple[int, int]:
    """Of the store chunks that hold ``params``: how many are resident, and how many there are."""
    held = {(store, store.entry(p).chunk) for p in params if (store := chunk_store.store_of(p))}
    return sum(not store.is_offloaded(c) for store, c in held), len(held)


def _describe(plan: Plan, program: RegionProgram, graph_inputs, examples) -> None:
    """The whole plan's chunk table, knobs and transfer dtype, as the regions' stores hold them: a
    chunk is on the host when its parameters' store chunk is, which an earlier graph may have
    decided (an inference graph runs on the training plan's chunks)."""
    param_of = {
        gi.fqn or gi.node_name: x
        for gi, x in zip(graph_inputs, examples)
        if gi.is_param and isinstance(x, torch.Tensor)
    }

    def offloaded(name: str) -> bool:
        p = param_of.get(name)
        store = chunk_store.store_of(p) if p is not None else None
        return store is not None and store.param_is_offloaded(p)

    for c in plan.chunks:
        on_host = any(offloaded(name) for name in c.params)
        c.placement = "host" if on_host else "device"
    plan.n_persist = sum(c.placement == "device" for c in plan.chunks)
    plans = [v.plan for v in program.variants]
    # what each block's code swaps, by the block's name in the whole graph
    plan.swapped = {
        f"{call.region_name}:{name}": call.block
        for call in program.calls
        for name in call.variant.plan.swapped
    }
    plan.n_buffer = max((p.n_buffer for p in plans), default=0)
    plan.device_steps = max((p.device_steps for p in plans), default=0.0)
    plan.transfer_copies = all(p.transfer_copies for p in plans)
    plan.n_buffer_given = any(p.n_buffer_given for p in plans)
    dtypes = [p.param_dtype for p in plans if p.param_dtype is not None]
    plan.param_dtype = dtypes[0] if dtypes else None
    said = set(plan.notes)
    travel = False
    for n in (n for p in plans for n in p.notes):
        if n in said or n.startswith(_REGION_NOTES):
            continue
        if n.startswith("offloaded chunks travel"):  # one store's line stands for all
            if travel:
                continue
            travel = True
        said.add(n)
        plan.notes.append(n)


# what a region's plan says of itself, not of the whole graph
_REGION_NOTES = (
    "no transformer blocks detected",
    "this graph uses no parameters",
    "this graph's parameters span",
)


def _compile_variant(
    region: Region, examples, graph_inputs, params, opts: Options, whole: Plan, compile_region, root
) -> Variant:
    rgi = region.graph_inputs(graph_inputs)
    plan = make_plan(f"{whole.graph_name}:{region.name}", rgi, region.structure, opts)
    plan.profiling = whole.profiling
    plan.profile_blocks = False  # the program marks blocks at the region's boundary
    gm = regions.tuple_output(region.gm)
    eager = copy_graph_module(gm)
    compiled = compile_region(gm, examples, rgi, params, plan, opts)
    live = [p for p in params if p is not None]
    positions = [k for k, p in enumerate(params) if p is not None]
    optimizer = None if whole.profiling else opts.optimizer
    binding = GraphBinding(plan.graph_name, positions, live, optimizer, eager, root)
    return Variant((), "", compiled, binding, plan)
