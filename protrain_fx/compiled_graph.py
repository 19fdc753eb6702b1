"""A compiled dynamo graph as protrain runs it (:class:`ProtrainGraph`), and what a CUDA
out-of-memory error inside one of its calls does: a forward is re-planned and redone; a backward is
re-planned and redone inside ``loss.backward()`` by replaying the forward (``RedoableCall``,
protrain_fx/runtime/step_redo.py), or, where the call cannot be replayed, raises
:class:`StepOutOfMemory`; a call without gradients (an evaluation) moves resident chunks to the
host and is redone. The compile itself is protrain_fx/backend.py's, handed in."""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref

import torch
import torch._guards

from protrain_fx import _compat, autoplan, budgets, inference_placement, plan_cache
from protrain_fx.errors import NoPlanFits, ProtrainError, release_frames
from protrain_fx.graph import sizes
from protrain_fx.graph.fx import copy_graph_module, fake_mode_for
from protrain_fx.graph.inputs import replanning
from protrain_fx.inference_mode import never_inference_tensors
from protrain_fx.machine import allocator
from protrain_fx.model_instances import other_model
from protrain_fx.options import Options, format_bytes
from protrain_fx.plan.plan import Plan
from protrain_fx.profiling import kept_grads, loop_memory
from protrain_fx.profiling.frugal import oom_request_bytes
from protrain_fx.profiling.longer_inputs import LongerInputs
from protrain_fx.profiling.step_meter import StepMeter
from protrain_fx.runtime import distributed, replacement, step_redo
from protrain_fx.runtime.binding import GraphBinding
from protrain_fx.runtime.chunk_store import store_of

log = logging.getLogger("protrain_fx")


class ProtrainGraph:
    """One dynamo graph as protrain runs it: the compiled code, bound at each call to the parameters
    it is called with (binding.py), measured by its StepMeter, and what a CUDA out-of-memory error
    inside it does.

    A forward that runs out of memory under an automatic plan has changed nothing yet (runtime_guard
    has reset the buffers): the plan is marked failed in the plan cache (never served again), the
    graph is planned anew with its predictions kept under 90% of the failed plan's predicted peak
    (with no more resident chunks than before: those it offloads move to the host with their
    gradients and optimizer state, protrain_fx/runtime/replacement.py, where the store allows it,
    else the placement stays), and the forward is redone on the same inputs; one line says so.

    A backward is redone the same way. A training call of a graph whose inputs other than parameters
    need no gradient (a whole model's: token ids, labels, masks) runs as one
    ``step_redo.RedoableCall``: it keeps the call's inputs, random-number state and autocast state,
    and its backward runs the compiled backward itself, recording which chunks' gradients it hands
    over. Out of memory there, the plan is marked failed, the graph is re-planned, the forward
    replayed on the same inputs with the same random numbers, and the backward run again, handing
    over only the chunks not handed over before; resident parameters' gradients reach ``.grad`` only
    when a backward completes. The user's ``loss.backward()`` returns as if nothing happened, one
    line says what did; nothing is lost or applied twice. A graph fed activations that need
    gradients (regional compilation, a graph break) cannot be replayed without keeping them: there,
    and after ``MAX_REPLANS`` re-plans, :class:`StepOutOfMemory` (a ``torch.OutOfMemoryError``) says
    that the step's gradients are incomplete and the batch can be redone after ``opt.zero_grad()``,
    and the next forward re-plans first.

    Every call is seen by profiling/loop_memory.py (what the loop holds of its own between forward
    and backward, budgeted by a re-plan where the plan lacks room: ``loop_seen``), and a dynamic
    graph's by profiling/longer_inputs.py (inputs larger than its plan's: planned again at their
    sizes where the plan lacks room for them)."""

    MAX_REPLANS = 3

    def __init__(
        self,
        eager_graph,
        graph_inputs,
        params: list,
        options,
        merged,
        optimizer,
        example_inputs,
        compile_graph,
        root=None,
    ):
        # backend._compile: (gm, examples, graph inputs, params, opts, options, **) -> (compiled,
        # plan, device, choice)
        self._compile = compile_graph
        self.plan = self.choice = self.device = self.binding = None  # install() sets them
        # the module dynamo traced (weakly), for the state-dict hooks of stores the binding makes
        self._root = weakref.ref(root) if isinstance(root, torch.nn.Module) else None
        self._eager_graph = eager_graph  # as dynamo traced it: for re-planning
        self._graph_inputs = graph_inputs
        self._params = [None if p is None else weakref.ref(p) for p in params]
        self.anchor = next((k for k, p in enumerate(params) if p is not None), None)  # 1st param
        self.instances: dict = {}  # other models' graphs, by their first parameter's id
        # a graph with symbolic sizes (dynamic shapes) is re-planned as it was compiled: under
        # dynamo's tracing context (its fake mode knows the example inputs' symbolic sizes) on its
        # example inputs (parameters held weakly); a call's concrete inputs would specialize it
        self._symbolic = any(isinstance(e, torch.SymInt) for e in example_inputs)
        param_positions = {gi.index for gi, p in zip(graph_inputs, params) if p is not None}
        self._examples = [None if i in param_positions else e for i, e in enumerate(example_inputs)]
        self._tracing = torch._guards.TracingContext.try_get() if self._symbolic else None
        # and the fakes dynamo traced its other tensor inputs as (its fake mode forgets them; made
        # anew they had new symbols, Inductor: "expected [s52] to have been codegen-ed")
        self._fakes = _compat.traced_fakes(self._tracing, self._examples)
        self._longer = self._symbolic and LongerInputs(self._examples, self._fakes, param_positions)
        # the user's dict (get_plan finds it), it over the defaults; the optimizer (weakly)
        self._options, self._merged = options, merged
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self.replans = 0
        self._pending: str | None = None  # a backward ran out of memory: re-plan before a forward
        # why the loop keeps gradients between steps, once a forward saw it (_kept_grads), and
        # whether no re-plan could count them (the plan then goes on as it was)
        self._grads_held, self._held_unpriced = None, False
        # the graph's resident parameters that need gradients (weakly), found at its second call
        self._resident, self._called = None, False
        # the most the loop held of its own between this graph's forward and backward (None: no
        # window closed yet; profiling/loop_memory.py), and why the next call re-plans for it
        self.loop_bytes, self._loop_pending = None, None

    def install(self, compiled, plan: Plan, device, choice, opts: Options) -> None:
        self._resident, self._called = None, False  # placed anew: found again (_kept_grads)
        self.loop_looks = 0  # windows measured under this plan (loop_memory.LOOKS)
        live = [r() for r in self._params if r is not None]
        positions = [gi.index for gi, r in zip(self._graph_inputs, self._params) if r is not None]
        self.binding = GraphBinding(
            plan.graph_name,
            positions,
            live,
            opts.optimizer,
            self._eager_graph,
            self._root() if self._root is not None else None,
        )
        if distributed.world().sharded:
            compiled = distributed.after_resident_grads(compiled)
        self.plan, self.device = plan, device
        # of an automatic plan (nothing that holds the optimizer): where it is cached, what failed
        # before
        self.choice = None if choice is None else dataclasses.replace(choice, options=None)
        if choice is not None:
            plan.predicted = choice.predicted
            plan.notes += choice.notes
            path = choice.cache_path
            compiled = StepMeter(
                plan,
                device,
                lambda p, outcome=None: plan_cache.save_plan(path, p, outcome),
                self._optimizer,
            ).wrap(compiled)
            compiled = allocator.trimmed(compiled, plan, device)
        self.compiled = compiled
        plan.on_backward_oom = weakref.WeakMethod(self._backward_ran_out)
        self._shared_seen = budgets.shared_version

    @never_inference_tensors
    def __call__(self, *args):
        if (other := other_model(self, args)) is not None:
            return other(*args)
        loop_memory.call_started(self, args)
        try:
            out = self._call(args)
        except BaseException:
            loop_memory.abandon()
            raise
        loop_memory.call_returned(self, out, args)
        return out

    def loop_seen(self, nbytes: int) -> None:
        """The loop held up to ``nbytes`` of its own between this graph's forward and backward
        (profiling/loop_memory.py): kept; where the plan lacks room for it, or budgeted far more
        before it was measured, the next call re-plans."""
        self.loop_bytes = max(self.loop_bytes or 0, nbytes)
        why = loop_memory.replan_why(self.plan, self.loop_bytes)
        if why and self.replans < self.MAX_REPLANS:
            self._loop_pending = why
        if self.choice.cache_path:
            plan_cache.save_plan(self.choice.cache_path, self.plan)

    def _call(self, args):
        if self._longer and torch.is_grad_enabled():
            self._longer.seen(self, args)
        if self._loop_pending:
            log.warning(self._loop_pending)
            self._loop_pending, self.replans = None, self.replans + 1
            try:  # the failed plans' peaks stay out of reach
                note = "re-planned: the loop's own memory budgeted"
                self.recompile(args, tuple(self.choice.failed_peaks), note)
            except NoPlanFits as e:  # the plan that ran goes on, measured no more (or raises)
                self.loop_looks = loop_memory.LOOKS
                loop_memory.no_room(self.plan, e)
        if self._shared_seen != budgets.shared_version:
            self._shared_beside(args)
        if self.binding.placement_moved():
            msg = "protrain: graph %s: resident chunks of its parameters moved to the host "
            log.warning(msg + "(another graph's re-plan); planning it again", self.plan.graph_name)
            failed = tuple(self.choice.failed_peaks) if self.choice is not None else ()
            self.recompile(args, failed, "re-planned: resident chunks moved to the host")
        if self._pending is not None:
            detail, self._pending = self._pending, None
            try:
                self._replan(args, detail, "backward")
            except NoPlanFits as e:  # no smaller plan (one of N blocks keeps its chunks): as it is
                msg = "protrain: graph %s: no smaller plan (%s); going on under the plan as it is"
                log.warning(msg, self.plan.graph_name, str(e).splitlines()[0][:300])
        elif torch.is_grad_enabled() and (held := self._kept_grads(args)) is not None:
            self._plan_for_kept_grads(args, held)
        if self.choice is not None and torch.is_grad_enabled() and self._replayable(args):
            out = step_redo.redoable_call(self, args)
            return list(out) if self._returns_list else out
        return self._forward(args)

    def _shared_beside(self, args) -> None:
        """A frozen model was placed since in less than it needs beside this graph's step on the
        device they share (inference_placement.py): an automatic plan is made again, leaving it
        room."""
        self._shared_seen = budgets.shared_version
        if self.choice is None or self.replans >= self.MAX_REPLANS:
            return
        if inference_placement.shares_device(Options.from_dict(self._merged), self.device):
            self.replans += 1
            msg = (
                "protrain: graph %s: a frozen model placed beside it needs room; planning it again"
            )
            log.warning(msg, self.plan.graph_name)
            note = "re-planned: leaving room for a frozen model on the device"
            self.recompile(args, tuple(self.choice.failed_peaks), note)

    def _forward(self, args):
        # a call without gradients (an evaluation, a frozen model's forward) outside any training
        # plan's budget: see _make_room
        no_plan = self.choice is None and (not torch.is_grad_enabled() or self.plan.inference)
        record = step_redo.CallRecord(args) if no_plan else None
        while True:
            try:
                out = self.binding(self.compiled, args)
                break
            except torch.OutOfMemoryError as e:
                if record is not None and self.replans < self.MAX_REPLANS:
                    detail = str(e).splitlines()[0]
                    release_frames(e)
                    self._make_room(args, detail)
                    torch.set_rng_state(record.cpu_rng)  # the redone call draws the same numbers
                    if record.cuda_rng is not None:
                        torch.cuda.set_rng_state_all(record.cuda_rng)
                    continue
                if (
                    self.choice is None
                    or self.replans >= self.MAX_REPLANS
                    or isinstance(e, StepOutOfMemory)
                ):
                    raise
                detail = str(e).splitlines()[0]
                # the failed forward's frames hold what it had computed (on the H200 9 GiB of a
                # 16 GiB cap, and the re-planned forward ran out again): freed before re-planning
                release_frames(e)
            self._replan(args, detail, "forward")
        self._returns_list = isinstance(out, list)
        return out

    _returns_list = False

    def _make_room(self, args, detail: str) -> None:
        """A call without gradients ran out of memory (``detail``) beside the resident state of the
        training plan whose chunks it runs on (no plan budgets an evaluation's batch): resident
        chunks move to the host with their optimizer state (replacement.make_room: at least twice
        the failed request, doubling with each retry), this graph is compiled for the new placement,
        the call is redone on the same inputs (the training graph re-plans at its next call);
        one line says so. With nothing left to move, a StepOutOfMemory says what to do."""
        self.replans += 1
        want = oom_request_bytes(detail)
        opt = self._optimizer() if self._optimizer is not None else None
        params = [r() for r in self._params if r is not None]
        given = Options.from_dict(self._merged).n_persist is not None  # a placement by hand stays
        chunks, nbytes = (
            (0, 0) if given else replacement.make_room(params, want << self.replans, opt)
        )
        if not chunks:
            raise StepOutOfMemory(
                f"protrain: out of device memory in graph {self.plan.graph_name}, a call without "
                f"gradients ({detail}), and no resident chunk of its parameters can move to the "
                "host to make room ("
                + ("n_persist is given" if given else "none is resident, or the store forbids it")
                + "). Evaluate on a smaller batch, or give training a smaller memory_budget so "
                "that it leaves the room"
            )
        log.warning(
            "protrain: out of device memory in graph %s, a call without gradients (%s): %d "
            "resident chunks (%s) moved to the host with their optimizer state; compiling it for "
            "that placement and redoing the call on the same inputs",
            self.plan.graph_name,
            detail,
            chunks,
            format_bytes(nbytes),
        )
        self.recompile(args, (), f"compiled again after running out of device memory ({detail})")

    def _replayable(self, args) -> bool:
        """Whether a backward of this call can be redone: some parameter needs a gradient and no
        other input does (those are activations of code outside the graph, which a replay would
        have to keep)."""
        params = {gi.index for gi, r in zip(self._graph_inputs, self._params) if r is not None}
        wants = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        return bool(wants) and all(i in params for i in wants)

    def _backward(self, call: "step_redo.CallRecord", grads) -> None:
        """The backward of one ``step_redo.RedoableCall``: see the class docstring."""
        while True:
            pairs = [(h, g) for h, g in zip(call.outputs, grads) if g is not None and h is not None]
            if not pairs:
                return
            try:
                self._redoing = True
                with step_redo.handing_over(call.handed_over):
                    step_redo.run_backward(call, pairs)
                return
            except torch.OutOfMemoryError as e:
                if self.replans >= self.MAX_REPLANS or isinstance(e, StepOutOfMemory):
                    raise self._backward_gave_up(str(e).splitlines()[0]) from e
                detail = str(e).splitlines()[0]
                release_frames(e)  # what the failed backward's frames hold, before the re-plan
            finally:
                self._redoing = False
            del pairs
            call.outputs = None  # the failed backward's saved activations go
            self._mark_failed(detail)
            try:
                with call.ambient():
                    self._replan(call.args, detail, "backward", len(call.handed_over))
                    call.outputs = call.replay(self._forward)
            except NoPlanFits as e:  # no plan below the failed one: the batch cannot be redone
                raise self._backward_gave_up(detail, str(e)) from e

    def _backward_ran_out(self, e: BaseException) -> BaseException:
        """From the backward's guard: what to raise instead of ``e``."""
        if self._redoing or self.choice is None:  # _backward handles it; a fixed plan: as it is
            return e
        return self._backward_gave_up(str(e).splitlines()[0])

    _redoing = False

    def _backward_gave_up(self, detail: str, no_plan: str | None = None) -> BaseException:
        """What a backward that ran out of memory (``detail``) and is not redone raises;
        ``no_plan``: why no smaller plan exists."""
        self._mark_failed(detail)
        if self.replans < self.MAX_REPLANS and no_plan is None:
            self._pending = detail
        return StepOutOfMemory(
            f"protrain: out of device memory in the backward of graph {self.plan.graph_name} "
            f"({detail}); the plan (predicted peak "
            + format_bytes((self.plan.predicted or {}).get("peak_bytes"))
            + ") is marked failed"
            + (
                " and the next forward re-plans with a margin"
                if self._pending
                else f" after {self.replans} re-plans"
                if no_plan is None
                else f"; no smaller plan exists ({no_plan})"
            )
            + ". The step's gradients are incomplete and nothing of it was applied: call "
            "opt.zero_grad() and redo the batch (or skip it)"
        )

    def _mark_failed(self, detail: str) -> None:
        if self.choice is not None and self.choice.cache_path:
            plan_cache.save_plan(
                self.choice.cache_path, self.plan, {"status": "oom", "detail": detail}
            )

    def _kept_grads(self, args) -> str | None:
        """Why this forward's plan must count resident gradients through the step, when a resident
        parameter of the graph still has the last backward's gradient and the plan priced none."""
        if (
            self.choice is None
            or self._held_unpriced
            or (self.plan.predicted or {}).get("grads_held")
        ):
            return None
        if self._resident is None:  # found once, after the first call has placed every parameter
            if not self._called:
                self._called = True  # no backward before it either
                return None
            self._resident = []
            for gi, r in zip(self._graph_inputs, self._params):
                p = args[gi.index] if r is not None else None
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    store = store_of(p)
                    if store is None or not store.param_is_offloaded(p):
                        self._resident.append(weakref.ref(p))
        held = [g for r in self._resident if (p := r()) is not None and (g := p.grad) is not None]
        if not held:
            return None
        return kept_grads.why_kept(held, self._optimizer() if self._optimizer is not None else None)

    def _plan_for_kept_grads(self, args, why: str) -> None:
        """Not out of memory: the loop keeps gradients between steps (``why``), which the plan
        did not count. Re-planned once with them counted through the whole step (nothing marked
        failed; resident chunks may move to the host, as in an out-of-memory re-plan); where no
        plan fits that, the plan goes on as it was and its measured side keeps ``why`` for the next
        run's plan."""
        self._grads_held = why
        log.warning(
            "protrain: graph %s: %s, which its plan did not count; re-planning once with resident "
            "gradients counted through the whole step",
            self.plan.graph_name,
            why,
        )
        try:
            self.recompile(args, tuple(self.choice.failed_peaks), why)
        except NoPlanFits as e:  # nothing fits beside the kept gradients
            self._held_unpriced = True
            self.plan.measured = dict(self.plan.measured or {}, grads_held=why)
            if self.choice.cache_path:
                plan_cache.save_plan(self.choice.cache_path, self.plan)
            log.warning(
                "protrain: graph %s: no plan counts them (%s); going on "
                "under the plan as it is (running out of memory is survived; the next run plans "
                "for them from the start)",
                self.plan.graph_name,
                str(e).splitlines()[0],
            )

    def _replan(self, args, detail: str, where: str, handed_over: int | None = None) -> None:
        """``handed_over``: a backward to be redone, which had handed over that many chunks'
        gradients."""
        self.replans += 1
        failed = (self.plan.predicted or {}).get("peak_bytes")
        if where == "forward":
            self._mark_failed(detail)
            then = "redoing the forward on the same inputs"
        elif handed_over is not None:
            then = (
                "redoing the step's forward and backward on the same inputs (the "
                f"{handed_over} chunk gradients handed over before are kept, not added again)"
            )
        else:
            then = "going on"
        log.warning(
            "protrain: out of device memory in the %s of graph %s (%s) under a plan "
            "predicted to peak at "
            "%s; re-planning with its predictions under %.0f%% of that and %s",
            where,
            self.plan.graph_name,
            detail,
            format_bytes(failed),
            100 * autoplan.FAILED_PEAK_MARGIN,
            then,
        )
        peaks = tuple(self.choice.failed_peaks) + ((failed,) if failed else ())
        try:
            self.recompile(
                args,
                peaks,
                f"re-planned after running out of device memory in the {where} ({detail})",
            )
        except NoPlanFits as e:
            opt = self._optimizer() if self._optimizer is not None else None
            params = [r() for r in self._params if r is not None]
            if not self._grads_held or replacement.may_offload(params, opt):  # the true minimum
                raise
            raise NoPlanFits(
                f"{e} -- {self._grads_held}, which the plan chosen at the first step did not "
                "count, and a re-plan keeps that plan's chunk placement (resident chunks cannot "
                "move to the host yet), so this minimum is that placement's. Declare the "
                "micro-steps before the first step, protrain_fx.set_grad_accumulation(optimizer, "
                "micro_steps), so that the first plan counts the kept gradients; a new run plans "
                "for them from the start too (the plan cache kept that this loop keeps them)",
                e.min_device_bytes,
                e.min_host_bytes,
            ) from None

    def recompile(self, args, peaks: tuple, note: str, graph_name: str | None = None) -> None:
        """Plan and compile the graph again for ``args`` (``peaks``: predicted peaks of plans that
        ran out of memory) and install it; ``note`` goes into the new plan's notes."""
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        params = [
            None if r is None else args[gi.index] for gi, r in zip(self._graph_inputs, self._params)
        ]
        self._params = [None if p is None else weakref.ref(p) for p in params]
        opts = Options.from_dict(self._merged)
        if opts.optimizer is None and self._optimizer is not None and self._optimizer() is not None:
            # the one found at compile time
            opts = dataclasses.replace(opts, optimizer=self._optimizer())
        gm = copy_graph_module(self._eager_graph)
        examples = list(args)
        if self._symbolic and self._tracing is not None:
            examples = [a if e is None else e for a, e in zip(args, self._examples)]
            _compat.remember_fakes(self._tracing, examples, self._fakes)
        # a tracing context of its own otherwise: Inductor records there the strides its forward
        # gives the saved activations, and compiles the backward for them (without one, a
        # re-planned HF Llama's backward asserted a transposed attention tensor it got contiguous)
        tracing = torch._guards.tracing(
            self._tracing
            if self._tracing is not None
            else torch._guards.TracingContext(fake_mode_for(examples))
        )
        # dynamo's frame is gone: the module it traced, for the blocks' structure and siblings
        with tracing, replanning(self._root() if self._root is not None else None):
            compiled, plan, device, choice = self._compile(
                gm,
                examples,
                self._graph_inputs,
                params,
                opts,
                self._options,
                failed_peaks=peaks,
                graph_name=graph_name or self.plan.graph_name,
                grads_held=self._grads_held,
                loop_bytes=self.loop_bytes,
                # the entry its next run's first plan reads (autoplan.choose); a size's own there
                cache_path=None
                if sizes.planned_key() or not self.choice
                else self.choice.cache_path,
            )
        plan.notes.append(note)
        self.install(compiled, plan, device, choice, opts)


class StepOutOfMemory(ProtrainError, torch.OutOfMemoryError):
    """A backward under an automatic plan ran out of device memory (see :class:`ProtrainGraph`)."""
