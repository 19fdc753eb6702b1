"""The ``protrain`` torch.compile backend.

Pipeline of one dynamo graph::

    dynamo graph ──capture parameter sources, detect blocks, make the Plan──▶ aot_autograd
      joint graph ──[Inductor joint passes: pattern matcher + user joint_custom_*_pass]──[stage
      "joint"] min-cut partition ──▶ forward graph  ──[stage "forward"]──▶ Inductor compile_fx_inner
                        └─▶ backward graph ──[stage "backward"]─▶ Inductor compile_fx_inner
      (no grad needed)  ──▶ inference graph ─[stage "inference"]─▶ Inductor compile_fx_inner

The dynamo graph itself goes through stage "dynamo" first (block profiling marks, when asked for).
Before any of it, a new training graph on CUDA (or with a ``memory_budget``) gets its knobs from the
automatic plan (autoplan.py: a copy of the graph compiled by this same pipeline under the profiling
plan, one profiled step, a search); the graph compiled with them is wrapped in a StepMeter (measured
time and peak). protrain_fx/pipeline.py is the one place that says which passes run on which stage,
in order, and what each reads and writes; after a stage's passes the runtime allocates what they
require (device chunk buffers, protrain_fx/placement.py). A graph compiled before (an earlier run)
is served from aot_autograd's cache with a replay of what its compile did (code_cache.py). This
module wires aot_autograd and decides no policy. With ``options={"compiler": "eager"}`` the
rewritten graphs run as they are, without decompositions or Inductor: bit-exact against eager
PyTorch, for debugging and fast property tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import weakref
from typing import Sequence

import torch
import torch._guards
import torch.fx as fx

from protrain_fx import (
    _compat,
    autoplan,
    code_cache,
    config,
    errors,
    inference_placement,
    pipeline,
    placement,
    progress,
    region_program,
    trained_peers,
)
from protrain_fx.compiled_graph import ProtrainGraph, StepOutOfMemory  # noqa: F401 (re-exported)
from protrain_fx.errors import NoPlanFits, OptionsError, ProtrainError, release_frames
from protrain_fx.graph import regions, strided_params
from protrain_fx.graph.blocks import detect_blocks, refuse_untraced_checkpointing
from protrain_fx.graph.build_plan import make_plan
from protrain_fx.graph.fx import copy_graph_module, saved_activation_bytes, saved_names
from protrain_fx.graph.inputs import capture_graph_inputs, has_symbolic_shape, traced_root
from protrain_fx.inference_mode import never_inference_tensors
from protrain_fx.machine import allocator
from protrain_fx.options import Options, forget_optimizer
from protrain_fx.placement import autocast_dtypes, bind_chunks
from protrain_fx.plan.plan import Plan, register_plan
from protrain_fx.profiling import loop_memory, static
from protrain_fx.report.dump import GraphDump
from protrain_fx.runtime import distributed, loss_ops, ops, replacement, step_redo  # noqa: F401  (ops: registers the protrain:: custom ops)
from protrain_fx.runtime.binding import on_error, refuse_converted, runtime_guard
from protrain_fx.runtime.optimizer_lookup import find_optimizer
from protrain_fx.runtime.param_values import placement_snapshot

log = logging.getLogger("protrain_fx")


class GraphCompiler:
    """The aot_autograd callbacks for one dynamo graph: partition, then per-stage passes, then the
    final compiler (Inductor or eager)."""

    def __init__(
        self,
        plan: Plan,
        options: Options,
        dump: GraphDump,
        num_dynamo_inputs: int,
        num_orig_outputs: int,
        params: list,
        root,
    ):
        self.plan = plan
        # what compiled code keeps lives as long as dynamo's cache (the class's forward): the model,
        # its parameters and the optimizer are held weakly, so a deleted model is freed
        self._optimizer = weakref.ref(options.optimizer) if options.optimizer is not None else None
        self.options = dataclasses.replace(options, optimizer=None)
        self.dump = dump
        self.num_dynamo_inputs = num_dynamo_inputs
        self.num_orig_outputs = num_orig_outputs
        # (placeholder index, fqn, parameter)
        self._params = [(i, fqn, weakref.ref(p)) for i, fqn, p in params]
        self._root = weakref.ref(root) if root is not None else None  # the module dynamo traced
        # read now: aot_autograd's callbacks run with autocast off
        self.autocast = autocast_dtypes()
        self.progress = progress.current()
        # what this compile did beyond its code, for protrain_fx/code_cache.py: the stages
        # compiled, the saved bytes the estimate counted, whether it gathers, the passes' notes
        self.stages: list[str] = []
        self.activation_bytes = 0
        self.gathers = False
        self.pass_notes: list[str] = []
        self.on_complete = None  # called once the graph's last stage is compiled (code_cache)

    @property
    def params(self) -> list:
        out = [(i, fqn, r()) for i, fqn, r in self._params]
        if any(p is None for _, _, p in out):
            raise ProtrainError("protrain: the model this graph was compiled for was freed")
        return out

    @property
    def root(self):
        return self._root() if self._root is not None else None

    def bound_options(self) -> Options:
        opt = self._optimizer() if self._optimizer is not None else None
        return dataclasses.replace(self.options, optimizer=opt)

    @property
    def use_inductor(self) -> bool:
        return self.options.compiler == "inductor"

    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        if self.use_inductor:
            joint = _compat.inductor_joint_passes(joint)
        self.activation_bytes = saved_activation_bytes(joint)
        self.bind(True)
        joint = self._run_stage("joint", joint)
        self.dump.stage("joint", joint)
        if self.plan.profiling:
            saved = static.saved_bytes_by_block(
                joint,
                len(self.plan.blocks),
                lambda g: _compat.min_cut_partition(g, joint_inputs, **kwargs),
            )
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, **kwargs)
        if self.plan.profiling:
            n_blocks = len(self.plan.blocks)
            self.plan.static_profile = static.StaticProfile(
                saved,
                static.recomputed_share(fw, bw, n_blocks),
                static.block_signatures(fw, bw, n_blocks),
            )
        self.plan.saved_names = saved_names(bw)
        return fw, bw

    def forward(self, gm: fx.GraphModule, example_inputs: Sequence):
        _compat.keep_saved_tensors()  # its backward may run twice: backward(retain_graph=True)
        return self._compile("forward", "fw", gm, example_inputs)

    def backward(self, gm: fx.GraphModule, example_inputs: Sequence):
        return self._compile("backward", "bw", gm, example_inputs)

    def inference(self, gm: fx.GraphModule, example_inputs: Sequence):
        return self._compile("inference", "inference", gm, example_inputs)

    def bind(self, training: bool) -> None:
        """The graph's parameters bound to chunk stores (placement.bind_chunks)."""
        bind_chunks(
            self.plan,
            self.bound_options(),
            self.params,
            self.root,
            self.activation_bytes,
            training,
            self.autocast,
        )

    def _run_stage(self, stage: str, gm: fx.GraphModule) -> fx.GraphModule:
        before = len(self.plan.notes)
        gm = pipeline.run_stage(stage, gm, self.plan, self.dump)
        self.pass_notes += self.plan.notes[before:]
        self.stages.append(stage)
        return gm

    def guard(self, stage: str, compiled):
        """A compiled graph of ``stage`` as it runs: protrain's state reset when it raises, and a
        backward's out-of-memory error handed to the graph's ProtrainGraph."""
        compiled = runtime_guard(compiled)
        return _backward_oom_guard(compiled, self.plan) if stage == "backward" else compiled

    def _compile(self, stage: str, dump_name: str, gm: fx.GraphModule, example_inputs: Sequence):
        if stage == "inference":
            if self.use_inductor:
                gm = _compat.inductor_joint_passes(gm)  # as compile_fx does for inference graphs
            self.bind(False)
        gm = self._run_stage(stage, gm)
        # what the passes require, allocated by the runtime
        self.gathers = self.gathers or placement.gathers_chunks(gm)
        placement.allocate_buffers(self.plan, gm)
        self.dump.stage(dump_name, gm)
        self.dump.write_plan()
        prog = progress.Silent() if self.plan.profiling else self.progress
        what = f"compiling the backward ({self.options.compiler})"
        with (
            prog.phase("backward compile", what)
            if stage == "backward"
            else contextlib.nullcontext()
        ):
            compiled = self.guard(stage, self._final_compile(stage, gm, example_inputs))
        if stage != "forward":
            prog.ready()
            if self.on_complete is not None:
                self.on_complete()
        return compiled

    def _final_compile(self, stage: str, gm: fx.GraphModule, example_inputs: Sequence):
        if not self.use_inductor:
            from functorch.compile import make_boxed_func

            return make_boxed_func(gm.forward)
        if stage == "backward":
            from torch._inductor import config

            visible = _compat.num_outputs(gm) if config.bw_outputs_user_visible else 0
            _compat.mark_user_visible_outputs(gm, 0, visible)
            return _compat.compile_fx_inner(
                gm,
                example_inputs,
                is_backward=True,
                static_input_idxs=_compat.backward_static_input_idxs(gm),
            )
        is_inference = stage == "inference"
        first = _compat.mutated_input_output_count(is_inference)
        _compat.mark_user_visible_outputs(gm, first, self.num_orig_outputs)
        return _compat.compile_fx_inner(
            gm,
            example_inputs,
            is_inference=is_inference,
            static_input_idxs=_compat.forward_static_input_idxs(
                self.num_dynamo_inputs, len(example_inputs)
            ),
        )


def _backward_oom_guard(fn, plan: Plan):
    """A compiled backward whose out-of-memory error goes to the graph's ProtrainGraph (set as
    ``plan.on_backward_oom``, a weak method), which marks the plan failed and says what to do."""

    def handle(e):
        hook = getattr(plan, "on_backward_oom", None)
        hook = hook() if hook is not None else None
        return hook(e) if hook is not None else e

    return on_error(fn, torch.OutOfMemoryError, handle)


def _graph_name() -> str:
    cid = _compat.current_compile_id()
    return "?" if cid is None else f"{cid[0]}/{cid[1]}"


def _compile_plan(
    gm: fx.GraphModule, example_inputs, graph_inputs, params, plan: Plan, opts: Options
):
    """Run the dynamo-stage passes and hand the graph to aot_autograd with this plan's callbacks."""
    dump = GraphDump(opts.dump_dir, plan)
    gm = pipeline.run_stage("dynamo", gm, plan, dump)
    dump.stage("dynamo", gm)
    dump.write_plan()

    from torch._dynamo.backends.common import aot_autograd

    bound = [
        (gi.index, gi.fqn or gi.node_name, p)
        for gi, p in zip(graph_inputs, params)
        if p is not None
    ]
    root = traced_root(graph_inputs)
    compiler = GraphCompiler(
        plan, opts, dump, len(example_inputs), _compat.num_outputs(gm), bound, root
    )

    def run(fw_compiler):
        return aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=compiler.backward,
            inference_compiler=compiler.inference,
            partition_fn=compiler.partition,
            decompositions=_compat.inductor_decompositions() if compiler.use_inductor else {},
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    compiled = code_cache.compile_graph(compiler, gm, example_inputs, run)
    if plan.logits_outputs:  # passes/chunked_loss.py returned logits without a gradient path
        compiled = loss_ops.reattach_logits(compiled, plan.logits_outputs)
    return compiled


@errors.raised_past_dynamo  # except protrain_fx.NoPlanFits: works around the first call
@never_inference_tensors
def protrain_backend(
    gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None
):
    """torch.compile backend "protrain" (its entry point: ``torch_dynamo_backends``)."""
    if mode not in (None, "default"):
        raise OptionsError(
            f"backend='protrain' takes no mode= (got {mode!r}); pass options={{...}} instead"
        )
    # protrain_fx.configure() and PROTRAIN_MEMORY_BUDGET under them
    merged = config.with_defaults(options)
    opts = Options.from_dict(merged)
    for d in (options, merged):  # dynamo keeps the options: not the optimizer (and the model)
        forget_optimizer(d)
    graph_inputs, params = capture_graph_inputs(gm, example_inputs)  # before dynamo drops grapharg
    live = [p for p in params if p is not None]
    if strided := strided_params.non_contiguous(graph_inputs, params):  # as traced, this once
        return strided_params.eager_once_then_contiguous(gm, strided)
    found_note = None
    if opts.optimizer is None and torch.is_grad_enabled():  # the user's Adam/AdamW, if not named
        found, found_note = find_optimizer(live)
        if found is not None:
            opts = dataclasses.replace(opts, optimizer=found)
            del found
    refuse_untraced_checkpointing(traced_root(graph_inputs), live)
    refuse_converted(live)  # model.to(dtype) after a compiled step, say
    progress.begin(_graph_name())
    # as dynamo traced it: what a call with other parameters runs
    eager_graph = copy_graph_module(gm)
    restore = placement_snapshot(live)
    try:
        compiled, plan, device, choice = _compile(
            gm, example_inputs, graph_inputs, params, opts, options
        )
        if found_note:
            plan.notes.insert(0, found_note)
    except BaseException as e:
        # the failed compile's frames (a profiled step that ran out of device memory, say) hold
        # its device tensors; drop them first, so that putting the parameters back fits
        release_frames(e)
        if isinstance(e, NoPlanFits) and found_note and opts.optimizer is None:  # found, why not
            e.args = (f"{e.args[0]}; {found_note}", *e.args[1:])
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        restore()  # a failed compile leaves the model as it was
        raise
    graph = ProtrainGraph(
        eager_graph,
        graph_inputs,
        params,
        options,
        merged,
        opts.optimizer,
        example_inputs,
        lambda *a, **k: _compile(*a, **k),  # looked up at each call (tests patch it)
        traced_root(graph_inputs),
    )
    graph.install(compiled, plan, device, choice, opts)
    progress.end()
    return graph


def _split(gm, structure, graph_inputs):
    """The graph's regions (protrain_fx/graph/regions.py), or None when it is compiled whole: with
    several ranks too, where a region's backward would wait for its resident gradients'
    all-reduces at its end (passes/resident_grads.py), which one graph overlaps with the rest of
    backward."""
    if (
        not config.settings().regions
        or not any(gi.is_param for gi in graph_inputs)
        or distributed.world().size > 1
    ):
        return None
    found, _why = regions.split(copy_graph_module(gm), structure)
    return found


def _compile_graph(gm, example_inputs, graph_inputs, params, plan: Plan, opts: Options, split):
    """The graph compiled whole, or in regions (protrain_fx/region_program.py) when ``split``."""
    if split is None:
        return _compile_plan(gm, example_inputs, graph_inputs, params, plan, opts)
    # the whole graph's folder: its dynamo graph and plan, each region code's folder in regions/
    dump = GraphDump(opts.dump_dir, plan)
    dump.stage("dynamo", gm)
    regions_dir = dump.folder and os.path.join(dump.folder, "regions")
    program = region_program.compile_program(
        gm,
        plan.block_structure,
        example_inputs,
        graph_inputs,
        dataclasses.replace(opts, dump_dir=regions_dir),
        plan,
        _compile_plan,
        traced_root(graph_inputs),
    )
    dump.write_plan()
    return program


def _no_swap_when_dynamic(opts: Options, example_inputs) -> tuple[Options, str | None]:
    """Swapped blocks under Inductor need static shapes: compiled with symbolic sizes, Inductor's
    backward of a swapped block asserted strides of the first shape for some saved activations
    (an HF Llama trained on two sequence lengths failed in its backward). The automatic plan then
    chooses among plans without swap; swap asked for by hand is an error that says what to do."""
    if opts.compiler != "inductor" or not any(
        isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and has_symbolic_shape(x))
        for x in example_inputs
    ):
        return opts, None
    if opts.n_swap:
        raise ProtrainError(
            f"n_swap={opts.n_swap} with dynamic shapes: dynamo compiled this graph with symbolic "
            "sizes (inputs of another shape came, or torch.compile(dynamic=True)), and swapped "
            "blocks are not supported there with Inductor yet. Pass dynamic=False to "
            "torch.compile (one graph per shape), or n_swap=0 (recompute with n_checkpoint "
            "instead), or compiler='eager'"
        )
    if opts.n_swap == 0:
        return opts, None
    return dataclasses.replace(opts, n_swap=0), (
        "no swapped blocks: this graph has dynamic shapes, where Inductor does not support them "
        "yet (torch.compile(dynamic=False) compiles one graph per shape, which may swap)"
    )


def _compile(
    gm,
    example_inputs,
    graph_inputs,
    params,
    opts: Options,
    options,
    failed_peaks: tuple = (),
    graph_name: str | None = None,
    grads_held: str | None = None,
    cache_path: str | None = None,
    loop_bytes: int | None = None,
):
    root = traced_root(graph_inputs)
    structure = detect_blocks(gm, root)
    split = _split(gm, structure, graph_inputs)
    live = [p for p in params if p is not None]
    device = live[0].device if live else None
    name = graph_name or _graph_name()
    prog = progress.current() if graph_name is None else progress.Silent()
    prog.arrived(len(gm.graph.nodes), live, len(structure.blocks), device)
    opts, swap_note = _no_swap_when_dynamic(opts, example_inputs)
    choice, inference_note, inference_peak = None, None, None
    training_plan = autoplan.wanted(opts, params, device)
    released = (
        inference_placement.release_for_training(live, opts, device) if training_plan else None
    )
    if inference_placement.wanted(opts, live, device, training_plan, example_inputs):
        opts, inference_peak, inference_note = inference_placement.choose(
            gm, graph_inputs, live, structure, opts, split, root
        )
    else:
        inference_note = inference_placement.unplanned_note(
            opts, live, training_plan, example_inputs
        )
    if training_plan:

        def compile_profiling(copy: fx.GraphModule, frugal: Options, profiled):
            plan = make_plan(name, graph_inputs, profiled, frugal, split)
            plan.profiling = plan.profile_blocks = True
            with _compat.eager_backward_compile():  # the profiler runs backward inside this compile
                compiled = _compile_graph(
                    copy, example_inputs, graph_inputs, params, plan, frugal, split
                )
            return compiled, plan

        def choose(loop=loop_bytes, prior_cap=None):
            return autoplan.choose(
                gm,
                example_inputs,
                graph_inputs,
                params,
                structure,
                opts,
                compile_profiling,
                failed_peaks,
                root=root,
                regions=split,
                grads_held=grads_held,
                cache_path=cache_path,
                loop_bytes=loop,
                prior_cap=prior_cap,
            )

        try:
            choice = loop_memory.choose_beside_prior(choose, loop_bytes)
        except NoPlanFits as e:  # another trained model took the device: it makes room
            if (made := trained_peers.make_room(live, opts, device, e, root)) is None:
                raise
            choice, released = choose(), "; ".join(n for n in (released, made) if n)
        searched_n_buffer = opts.n_buffer is None
        opts = choice.options
    plan = make_plan(name, graph_inputs, structure, opts, split)
    if choice is not None:  # what the plan cache keeps (plan_cache._knobs_of)
        plan.decided_knobs = {k: getattr(opts, k) for k in autoplan.KNOBS}
    for note in (swap_note, inference_note, released):
        if note:
            plan.notes.append(note)
    if inference_peak is not None:
        plan.predicted = {"peak_bytes": inference_peak}
    plan.inference = not (torch.is_grad_enabled() and any(p.requires_grad for p in live))
    if device is not None:  # knobs given by hand too: no fragmentation from protrain's buffers
        budgeted = (choice.predicted if choice is not None else {}).get("allocator")
        plan.notes.append(f"allocator: {budgeted or allocator.describe(allocator.prepare(device))}")
    # the automatic plan checked the host's memory; knobs given by hand are checked here
    if choice is None:
        placement.check_host_memory(plan, opts, params, device)
    plan.n_buffer_searched = choice is not None and searched_n_buffer
    if choice is not None and choice.offload_resident:  # a re-plan that keeps fewer resident
        replacement.offload_beyond(
            plan.layout, graph_inputs, params, opts.n_persist, opts.optimizer
        )
    register_plan(plan, live, options)
    how = "in regions, " if split is not None else ""
    with prog.phase("compile", f"compiling the plan ({how}aot_autograd, passes, {opts.compiler})"):
        compiled = _compile_graph(gm, example_inputs, graph_inputs, params, plan, opts, split)
    if split is not None:
        prog.ready()
    return compiled, plan, device, choice
