"""Every private torch API protrain-fx touches, behind one function each, so a torch change breaks
one place.

Checked on torch 2.11 (GPU machine) and 2.13 (CI).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import torch
import torch._guards
import torch.fx as fx
import torch.utils._pytree as pytree


def eager_random():
    """Inductor set to draw random numbers (dropout) from eager PyTorch's generator, in eager's
    order, instead of its own Philox streams: a compiled step then gives the masks eager gives, so
    a model with dropout trains exactly like eager (torch.compile's default differs from eager
    there). Around every Inductor entry protrain makes: the decompositions, the joint-graph passes
    (replace_random) and the lowering."""
    from torch._inductor import config

    return config.patch(fallback_random=True)


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    with eager_random():
        return select_decomp_table()


def min_cut_partition(
    joint: fx.GraphModule, joint_inputs, **kwargs
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """aot_autograd's min-cut partition, with recomputed ops that draw no random numbers kept out
    of its RNG functionalization (:func:`unseeded_while`)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with unseeded_while(joint) as restore:
        fw, bw = min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", **kwargs
        )
        restore(fw)
        restore(bw)
    return fw, bw


class _Unseeded:
    """An ATen op as the partitioner sees it while it must not treat the op as random: calls and
    attributes go to the op, but it has no ``tags`` (the partitioner looks for
    ``nondeterministic_seeded`` there)."""

    __slots__ = ("op", "__name__", "__qualname__")

    def __init__(self, op):
        self.op = op
        self.__name__ = self.__qualname__ = "unseeded_" + op.__name__.replace(".", "_")

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __getattr__(self, name):
        if name == "tags":
            raise AttributeError(name)
        return getattr(self.op, name)

    def __eq__(self, other):
        return self.op == (other.op if isinstance(other, _Unseeded) else other)

    def __hash__(self):
        return hash(self.op)

    def __repr__(self):
        return repr(self.op)


def _draws_no_random_numbers(node: fx.Node) -> bool:
    """A ``nondeterministic_seeded`` attention kernel called with ``dropout_p`` 0 (what SDPA calls
    in training without dropout): the flash, memory-efficient, cuDNN and CPU kernels read the
    generator only when ``dropout_p > 0``. (A dropout of probability 0 still draws on CUDA.)"""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    if "dropout_p" in node.kwargs:
        value = node.kwargs["dropout_p"]
    elif i < len(node.args):
        value = node.args[i]
    else:
        value = op._schema.arguments[i].default_value
    return isinstance(value, (int, float)) and value == 0


@contextlib.contextmanager
def unseeded_while(joint: fx.GraphModule):
    """While partitioning ``joint``: its random-looking ops that draw nothing (:func:
    `_draws_no_random_numbers`) are :class:`_Unseeded`; yields ``restore(gm)``, which puts the
    ops back in a graph the partition made, and restores the joint on exit.

    Why: a block recomputed in backward (the recompute pass) whose attention is SDPA got its kernel
    wrapped in RNG-state functionalization by the partitioner (the op is tagged
    ``nondeterministic_seeded`` whatever its ``dropout_p``): on CUDA in
    ``graphsafe_run_with_rng_state``, a higher-order op Inductor's FX graph cache refuses
    ("Can't cache HigherOrderOperator"), so every recomputed block's code was compiled again in
    every run, and each forward saved an RNG state for backward. Such a call draws no random
    numbers (the kernels read the generator only when ``dropout_p > 0``), so recomputing it without
    the state gives the same values."""

    def restore(gm: fx.GraphModule) -> None:
        unseeded = [n for n in gm.graph.nodes if isinstance(n.target, _Unseeded)]
        for node in unseeded:
            node.target = node.target.op
        if unseeded:
            gm.recompile()

    swapped = [n for n in joint.graph.nodes if _draws_no_random_numbers(n)]
    for node in swapped:
        node.target = _Unseeded(node.target)
    try:
        yield restore
    finally:
        if swapped:
            restore(joint)


def inductor_joint_passes(joint: fx.GraphModule) -> fx.GraphModule:
    """Inductor's joint-graph passes: its pattern matcher and the user's ``joint_custom_pre_pass`` /
    ``joint_custom_post_pass`` (same signature on 2.11 and 2.13)."""
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V

    # Inductor runs them inside compile_fx's ``V.set_fake_mode``; its random-number passes
    # (replace_random: dropout) enter ``V.fake_mode`` and failed without it
    fake = torch._guards.detect_fake_mode(
        [n.meta.get("val") for n in joint.graph.nodes if n.op == "placeholder"]
    )
    with eager_random(), V.set_fake_mode(fake) if fake is not None else contextlib.nullcontext():
        return _recursive_joint_graph_passes(joint, skip_invoke_subgraph=True)


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs):
    """Inductor's inner compiler (keywords only: 2.13 added a positional parameter), with
    protrain's ops in its FX graph cache key: the key sees a graph's code, not what the custom ops
    it calls return (a cached graph asserting an older op's outputs failed on a newer one), so the
    key's ``cache_key_tag`` gets :func:`protrain_fx._version.ops_fingerprint`."""
    from torch._inductor.compile_fx import compile_fx_inner as inner
    from torch._inductor.utils import BoxedBool

    from protrain_fx._version import ops_fingerprint

    kwargs.setdefault("cudagraphs", BoxedBool(False))
    cfg = torch.compiler.config
    user_tag = getattr(cfg, "cache_key_tag", None)  # None: a torch without it
    # no channels-last copy of a conv weight: an offloaded one's placeholder names its chunk
    no_layouts = torch._inductor.config.patch(layout_optimization=False)
    if user_tag is None:
        with eager_random(), no_layouts:
            return inner(gm, example_inputs, **kwargs)
    tag = ";".join(t for t in (user_tag, ops_fingerprint()) if t)
    with cfg.patch(cache_key_tag=tag), eager_random(), no_layouts:
        return inner(gm, example_inputs, **kwargs)


def forward_static_input_idxs(num_dynamo_inputs: int, num_fw_inputs: int) -> list[int]:
    """Which forward-graph inputs have fixed addresses (parameters, buffers), as compile_fx
    decides it."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        return list(context.fw_metadata.static_input_indices)
    from torch._inductor.utils import num_fw_fixed_arguments

    return list(range(num_fw_fixed_arguments(num_dynamo_inputs, num_fw_inputs)))


def backward_static_input_idxs(bw: fx.GraphModule) -> list[int]:
    from torch._inductor.utils import count_tangents

    return list(range(count_tangents(bw)))


def mutated_input_output_count(is_inference: bool) -> int:
    """Number of leading forward outputs that are mutated inputs rather than user outputs."""
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fw_metadata is None or is_inference:
        return 0
    return context.fw_metadata.num_mutated_inp_runtime_indices


def current_compile_id() -> tuple[int, int] | None:
    """(frame_id, frame_compile_id) of the graph dynamo is compiling now."""
    cid = torch._guards.CompileContext.current_compile_id()
    if cid is None:
        return None
    return getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None)


def trace_artifact(name: str, encoding: str, payload_fn) -> None:
    """One artifact in torch's structured trace (read by tlparse); payload_fn runs only when
    tracing."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # pragma: no cover - very old torch
        return
    trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn
    )


def traced_root_object(source_root: str):
    """The object behind a dynamo source root like ``L['self']`` or ``L['args'][0]`` of the frame
    being compiled (dynamo's current instruction translator), or None when it cannot be found."""
    import ast
    import re

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return None
    if tx is None:
        return None
    m = re.match(r"^([LG])\[(.+?)\]((?:\[[^\]]+\])*)$", source_root)
    if m is None:
        return None
    scope = getattr(tx, "f_locals" if m.group(1) == "L" else "f_globals", None)
    if scope is None:
        return None
    try:
        obj = scope[ast.literal_eval(m.group(2))]  # a quoted name
        for key in re.findall(r"\[([^\]]+)\]", m.group(3)):
            obj = obj[ast.literal_eval(key)]
    except Exception:
        return None
    return obj


def real_tensor_mode():
    """A context where tensors are real even inside a partitioner or compiler callback (which run
    under aot_autograd's fake mode): for creating runtime state such as chunk stores."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def symint_hint(x, fallback: int = 1) -> int:
    """A SymInt's hint without adding a guard (graph/sizes.py reads every size through it)."""
    hint = getattr(getattr(x, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint  # torch 2.13

        return int(optimization_hint(x, fallback=fallback))
    except (ImportError, TypeError):
        pass
    try:
        from torch.fx.experimental.symbolic_shapes import hint_int  # older releases

        return int(hint_int(x, fallback=fallback))
    except (ImportError, TypeError):
        return fallback


def shape_env_hints(node) -> dict:
    """symbol -> value of the shape environment of a SymInt's node (``backed_var_to_val`` from
    torch 2.13, ``var_to_val`` before)."""
    env = getattr(node, "shape_env", None)
    return getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", None) or {}


def eager_backward_compile():
    """Compile the backward graph with the forward instead of at the first backward call (which,
    inside a dynamo compile, would record compile metrics twice). A no-op where torch has no such
    switch."""
    import contextlib

    from torch._functorch import config

    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def keep_saved_tensors() -> None:
    """The graph's backward donates none of its saved tensors (aot_autograd's donated buffers,
    cleared in place): compiled with the forward (eager_backward_compile), not at its first call
    as torch does, it could not run twice (``backward(retain_graph=True)``, then another)."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if getattr(meta, "bw_donated_idxs", None):
        meta.bw_donated_idxs.clear()


class SeveralGraphs:
    """Several aot_autograd graphs compiled under one tracing context (a graph compiled in regions,
    protrain_fx/region_program.py), as dynamo's DDPOptimizer compiles its buckets: where torch
    compiles a backward only at its first call (no ``force_non_lazy_backward_lowering``), that
    compile must see the forward metadata of its own graph, not of the last one compiled. Call
    :meth:`compiled` after each graph's compile, in order; the backwards then compile in reverse
    order, as backward runs them."""

    def __init__(self):
        self.ctx = torch._guards.TracingContext.try_get()
        self.buckets = None
        if self.ctx is not None and hasattr(self.ctx, "ddp_optimizer_ctx"):
            from torch._dynamo.backends.distributed import DDPOptimizerContext

            if self.ctx.ddp_optimizer_ctx is None:
                self.ctx.ddp_optimizer_ctx = DDPOptimizerContext()
            self.buckets = self.ctx.ddp_optimizer_ctx

    def compiled(self) -> None:
        if self.buckets is not None and getattr(self.ctx, "fw_metadata", None) is not None:
            self.buckets.curr_bucket += 1
            self.buckets.metadata_per_bucket.append(self.ctx.fw_metadata)


def num_outputs(gm: fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(pytree.arg_tree_leaves(*out.args))


def mark_user_visible_outputs(gm: fx.GraphModule, first: int, count: int) -> None:
    """What compile_fx does before Inductor: outputs the user sees keep eager strides."""
    from torch._inductor import config

    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = pytree.arg_tree_leaves(*out.args)
    if not config.keep_output_stride:
        out.meta["user_visible_output_idxs"] = []
        return
    out.meta["user_visible_output_idxs"] = [
        i for i in range(first, min(first + count, len(leaves))) if isinstance(leaves[i], fx.Node)
    ]


def dynamo_compile_started_s() -> float | None:
    """When dynamo began compiling the frame now being compiled (``time.time()`` seconds), from its
    metrics context (torch 2.6+); None where that is not available."""
    try:
        from torch._dynamo.utils import get_metrics_context

        mc = get_metrics_context()
        if mc.in_progress():
            return mc._start_time_ns / 1e9
    except (ImportError, AttributeError):
        pass
    return None


def traced_fakes(tracing, examples: list) -> dict:
    """Per real tensor of ``examples``, by position: the fake that the fake mode of dynamo's
    ``tracing`` context traced it as (symbolic sizes included), while that mode remembers it."""
    mode = getattr(tracing, "fake_mode", None)
    real = (i for i, x in enumerate(examples) if type(x) is torch.Tensor)
    return {i: mode.from_tensor(examples[i]) for i in real} if mode is not None else {}


def remember_fakes(tracing, examples: list, fakes: dict) -> None:
    """Make ``tracing``'s fake mode convert ``examples[i]`` to ``fakes[i]`` again (the converter's
    memo, which a compile's end clears, filled as torch fills it), so that a later compile of the
    graph sees the symbols dynamo traced it with."""
    mode = getattr(tracing, "fake_mode", None)
    remember = getattr(getattr(mode, "fake_tensor_converter", None), "set_tensor_memo", None)
    for i, fake in fakes.items() if remember is not None else ():
        remember(examples[i], fake)


def allow_non_fake_inputs(mode):
    """``mode`` (a FakeTensorMode) taking real tensors (parameters) beside fake ones for a while."""
    from unittest import mock

    return mock.patch.object(mode, "allow_non_fake_inputs", True)


@functools.cache
def backward_takes_gradient_edges() -> bool:
    """Whether ``torch.autograd.backward`` starts from ``GradientEdge``s (an output's grad_fn and
    output number, holding its autograd graph but not its memory), tried once on the CPU."""
    try:
        from torch.autograd.graph import get_gradient_edge

        x = torch.zeros(1, requires_grad=True)
        with torch.enable_grad():
            edge = get_gradient_edge(x * 2)
        torch.autograd.backward([edge], [torch.ones(1)])
        return bool(x.grad is not None and x.grad.item() == 2.0)
    except Exception:  # older torch: TypeError, or an assertion on the tensors' type
        return False


def gradient_handle(t: torch.Tensor):
    """What ``torch.autograd.backward`` can start from later in place of ``t``: its
    ``GradientEdge`` where this torch takes those (``t``'s memory is then freed with the caller's
    last reference to it, as in eager), else ``t`` itself."""
    if backward_takes_gradient_edges():
        from torch.autograd.graph import get_gradient_edge

        return get_gradient_edge(t)
    return t


# ----------------------------------------------------------- AOTAutograd's cache (code_cache.py)
_CACHE_ATTRS = (
    "_fx_graph_cache_key",
    "_fx_graph_cache_debug_lines",
    "guards_expr",
    "_time_taken_ns",
)


@functools.lru_cache(maxsize=None)
def aot_cache_supported() -> bool:
    """Whether this torch serves aot_autograd's cache to a custom compiler as code_cache.py needs:
    a ``SerializableAOTDispatchCompiler``, and a loaded entry whose ``wrap_post_compile(args,
    aot_config, fx_config)`` calls the ``post_compile`` protrain's guards go around (2.11, 2.13)."""
    try:
        from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler  # noqa
        from torch._inductor.output_code import OutputCode  # noqa: F401
    except ImportError:
        return False
    wrap = getattr(GenericAOTAutogradResult, "wrap_post_compile", None)
    if not callable(wrap):
        return False
    import inspect

    params = list(inspect.signature(wrap).parameters)
    return params == ["self", "args", "aot_config", "fx_config"] and "post_compile" in (
        inspect.getsource(wrap) + inspect.getsource(GenericAOTAutogradResult)
    )


def aot_cache_enabled() -> bool:
    """torch's own switches: the local AOTAutograd cache (and with it Inductor's FX graph cache)."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache
    except ImportError:
        return False
    return bool(should_use_local_autograd_cache())


def serializable_compiler(fn):
    """``fn`` (a forward compiler returning Inductor's compiled graph, perhaps wrapped) marked as
    one whose output aot_autograd may cache."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode

    return SerializableAOTDispatchCompiler(OutputCode, fn)


def keep_cache_attrs(wrapper, fn):
    """What aot_autograd reads off a compiled graph to save its cache entry (Inductor's FX graph
    key, guards, time), copied onto a wrapper of it."""
    for name in _CACHE_ATTRS:
        if hasattr(fn, name):
            setattr(wrapper, name, getattr(fn, name))
    return wrapper


@contextlib.contextmanager
def aot_cache_served(tag: str, wrap):
    """Within: aot_autograd's cache key carries ``tag`` (in ``cache_key_tag``, after the user's),
    and the forward and backward of an entry served from it go through ``wrap(stage, fn)`` (stage
    "forward" or "backward"; an inference graph's is its "forward"), as a compile's would through
    protrain's compilers: while the entry rebuilds its callable (``wrap_post_compile``), its
    forward's and backward's ``post_compile`` return the wrapped graphs."""
    from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult

    cfg = torch.compiler.config
    user_tag = getattr(cfg, "cache_key_tag", "") or ""
    real = GenericAOTAutogradResult.wrap_post_compile

    def rebuild(self, args, aot_config, fx_config):
        patched = []
        for stage, loadable in (("forward", self.compiled_fw), ("backward", self.compiled_bw)):
            if loadable is None:
                continue
            cls = type(loadable)
            inner, own = cls.post_compile, "post_compile" in vars(cls)

            def post_compile(obj, result, config, _inner=inner, _stage=stage, _target=loadable):
                out = _inner(obj, result, config)
                return wrap(_stage, out) if obj is _target else out

            cls.post_compile = post_compile
            patched.append((cls, inner, own))
        try:
            return real(self, args, aot_config, fx_config)
        finally:
            for cls, inner, own in reversed(patched):
                if own:
                    cls.post_compile = inner
                else:  # inherited: drop the patch
                    del cls.post_compile

    GenericAOTAutogradResult.wrap_post_compile = rebuild
    try:
        with cfg.patch(cache_key_tag=f"{user_tag}|{tag}"):
            yield
    finally:
        GenericAOTAutogradResult.wrap_post_compile = real


def aot_cache_off():
    """aot_autograd's cache neither read nor written (Inductor's FX graph cache still is)."""
    from torch._functorch import config

    return config.patch(enable_autograd_cache=False)
