"""The pass pipeline: which graph passes run on which stage, in order, and what each reads and
writes.

A pass is ``(gm, plan) -> gm``: it rewrites or annotates one FX graph, reads fields of the graph's
:class:`~protrain_fx.plan.plan.Plan` and may write only the fields it declares (:class:`PassSpec`).
The decision itself (chunk size, placement, buffers, block policies) is made before any pass runs
and no pass may change it; passes write only what they produce for later passes (``grad_slots``,
``swapped``, ...). :func:`check_contracts` checks, for the stage order, that every field a pass
reads is set before the passes run or written by an earlier pass; :func:`run_stage` checks at run
time that a pass changed no field it did not declare, logs and times each pass (``logging.DEBUG`` on
``protrain_fx.pipeline``), dumps the graph after each pass when the compile's dump directory is set,
and skips the passes that ``PROTRAIN_DISABLE_PASSES`` names (a debugging aid; the passes without
which results would not be exact cannot be disabled). Passes allocate nothing: what they require
(device chunk buffers) the runtime allocates after them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from protrain_fx import config
from protrain_fx.errors import ProtrainError
from protrain_fx.passes.annotate import annotate
from protrain_fx.passes.block_marks import block_marks
from protrain_fx.passes.chunk_gather import chunk_gather
from protrain_fx.passes.chunk_schedule import chunk_schedule
from protrain_fx.passes.chunked_loss import chunked_loss
from protrain_fx.passes.optimizer_calls import optimizer_calls
from protrain_fx.passes.recompute import recompute
from protrain_fx.passes.resident_grads import resident_grads
from protrain_fx.passes.shard_prefetch import shard_prefetch
from protrain_fx.passes.sparse_embedding_grads import sparse_embedding_grads
from protrain_fx.passes.swap import swap_offload, swap_reload
from protrain_fx.passes.user_checkpoints import user_checkpoints
from protrain_fx.plan.plan import Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassSpec:
    name: str
    run: Callable[[fx.GraphModule, Plan], fx.GraphModule]
    reads: frozenset[str]
    writes: frozenset[str] = frozenset()
    exact_without: bool = True  # results stay exact when it is disabled (only slower or larger)
    why: str = ""


def _spec(name, run, reads=(), writes=(), exact_without=True, why=""):
    return PassSpec(name, run, frozenset(reads), frozenset(writes), exact_without, why)


# The decision: set when the plan is made and its chunks placed, before any pass; no pass writes it.
DECISION = frozenset(
    {"chunk_size", "n_persist", "n_shard", "n_buffer", "n_swap", "n_checkpoint", "chunks", "blocks"}
)
# Set before the passes of a stage run (make_plan, placement, the backend).
INPUTS = DECISION | frozenset(
    {
        "graph_inputs",
        "input_entry",
        "input_param",
        "world_size",
        "profile_blocks",
        "profiling",
        "block_structure",
        "saved_names",
        "param_dtype",
        "notes",
    }
)

PASSES: dict[str, PassSpec] = {
    s.name: s
    for s in (
        _spec("chunked_loss", chunked_loss, writes={"notes", "logits_outputs"}),
        _spec("block_marks", block_marks, reads={"profile_blocks", "blocks", "block_structure"}),
        _spec(
            "annotate",
            annotate,
            reads={"graph_inputs", "input_param", "block_structure"},
            exact_without=False,
            why="every later pass selects nodes by its annotations",
        ),
        _spec("user_checkpoints", user_checkpoints, writes={"notes"}),
        _spec(
            "chunk_gather",
            chunk_gather,
            reads={"input_entry", "world_size"},
            writes={"grad_slots", "resident_grad_slots"},
            exact_without=False,
            why="offloaded parameters would be read from their empty shells",
        ),
        _spec(
            "optimizer_calls",
            optimizer_calls,
            reads={"grad_slots", "chunk_size", "world_size"},
            exact_without=False,
            why="offloaded chunks' gradients would never reach their host accumulators",
        ),
        _spec(
            "sparse_embedding_grads",
            sparse_embedding_grads,
            reads={"world_size"},
            writes={"notes"},
        ),
        _spec("recompute", recompute, reads={"blocks"}),
        _spec("swap_offload", swap_offload, reads={"blocks", "saved_names"}, writes={"swapped"}),
        _spec(
            "swap_reload",
            swap_reload,
            reads={"swapped", "blocks"},
            exact_without=False,
            why="backward would read the host copies swap_offload made (disable swap_offload with "
            "it)",
        ),
        _spec(
            "resident_grads",
            resident_grads,
            reads={"world_size", "resident_grad_slots"},
            exact_without=False,
            why="resident gradients would not be averaged over the ranks",
        ),
        _spec("shard_prefetch", shard_prefetch, reads={"world_size"}),
        # chunks_in_use: the most over the graph's stages (forward, then backward), so read and
        # written
        _spec(
            "chunk_schedule",
            chunk_schedule,
            reads={"n_buffer", "chunks_in_use"},
            writes={"chunks_in_use"},
        ),
    )
}

# The passes of each stage, in the order they run; a training graph's stages run in this order too.
STAGES: dict[str, tuple[str, ...]] = {
    "dynamo": ("chunked_loss", "block_marks"),
    "joint": (
        "annotate",
        "user_checkpoints",
        "chunk_gather",
        "optimizer_calls",
        "sparse_embedding_grads",
        "recompute",
    ),
    "forward": ("swap_offload", "shard_prefetch", "chunk_schedule"),
    "backward": ("swap_reload", "resident_grads", "shard_prefetch", "chunk_schedule"),
    "inference": ("annotate", "chunk_gather", "shard_prefetch", "chunk_schedule"),
}
TRAINING_ORDER = ("dynamo", "joint", "forward", "backward")
INFERENCE_ORDER = ("dynamo", "inference")


def check_contracts() -> list[str]:
    """What is wrong with the pass list's declarations (empty: consistent)."""
    problems = []
    for order in (TRAINING_ORDER, INFERENCE_ORDER):
        known = set(INPUTS)
        for stage in order:
            for name in STAGES[stage]:
                spec = PASSES[name]
                missing = spec.reads - known - spec.writes  # an accumulator reads its own writes
                if missing:
                    problems.append(
                        f"{stage}/{name} reads {sorted(missing)}, which nothing sets before it"
                    )
                if spec.writes & DECISION:
                    problems.append(
                        f"{stage}/{name} writes the decision: {sorted(spec.writes & DECISION)}"
                    )
                known |= spec.writes
    return problems


def disabled_passes() -> set[str]:
    names = set(config.settings().disable_passes)
    unknown = names - set(PASSES)
    if unknown:
        raise ProtrainError(
            f"PROTRAIN_DISABLE_PASSES names unknown passes {sorted(unknown)}; the "
            "passes are "
            f"{', '.join(PASSES)}"
        )
    required = {n: PASSES[n].why for n in names if not PASSES[n].exact_without}
    if "swap_offload" in names:
        required.pop("swap_reload", None)  # the pair goes together
        names.add("swap_reload")
    if required:
        raise ProtrainError(
            "PROTRAIN_DISABLE_PASSES: "
            + "; ".join(f"{n} cannot be disabled ({why})" for n, why in sorted(required.items()))
        )
    return names


def _fields(plan: Plan) -> dict:
    """The plan's fields now (containers copied, so that a change inside one shows)."""
    out = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        out[f.name] = copy.copy(v) if isinstance(v, (list, dict, set)) else v
    return out


def _changed(before: dict, after: dict) -> set[str]:
    out = set()
    for k in before.keys() | after.keys():
        a, b = before.get(k, _MISSING), after.get(k, _MISSING)
        try:
            same = a is b or bool(a == b)
        except Exception:  # values without a usable ==
            same = a is b
        if not same:
            out.add(k)
    return out


_MISSING = object()


def run_stage(stage: str, gm: fx.GraphModule, plan: Plan, dump=None) -> fx.GraphModule:
    """Run ``stage``'s passes on ``gm`` in order (see the module docstring)."""
    skip = disabled_passes()
    for i, name in enumerate(STAGES[stage]):
        spec = PASSES[name]
        if name in skip:
            log.info(
                "protrain: pass %s skipped on the %s graph (PROTRAIN_DISABLE_PASSES)", name, stage
            )
            continue
        before, n_before = _fields(plan), len(gm.graph.nodes)
        t0 = time.perf_counter()
        gm = spec.run(gm, plan)
        elapsed = time.perf_counter() - t0
        undeclared = _changed(before, _fields(plan)) - spec.writes
        if undeclared:
            raise ProtrainError(
                f"protrain internal error: pass {name} changed plan fields it does "
                "not declare: "
                f"{sorted(undeclared)}"
            )
        log.debug(
            "pass %s (%s graph): %.3f s, %d -> %d nodes",
            name,
            stage,
            elapsed,
            n_before,
            len(gm.graph.nodes),
        )
        if dump is not None:
            dump.pass_step(stage, i, name, gm)
    gm.graph.lint()
    gm.recompile()
    return gm


@contextlib.contextmanager
def probe(stage: str, fn: Callable[[fx.GraphModule, Plan], fx.GraphModule], name: str = "probe"):
    """Within the ``with`` block, run ``fn(gm, plan) -> gm`` after ``stage``'s passes, as a pass
    that writes nothing (tests and benchmarks read the rewritten graphs this way)."""
    saved_passes, saved_stage = dict(PASSES), STAGES[stage]
    PASSES[name] = _spec(name, fn)
    STAGES[stage] = saved_stage + (name,)
    try:
        yield
    finally:
        PASSES.clear()
        PASSES.update(saved_passes)
        STAGES[stage] = saved_stage
