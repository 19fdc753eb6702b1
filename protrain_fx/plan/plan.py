"""The Plan of one compiled graph: chunk layout and placement, block policies, knobs, predicted and
measured cost; its JSON form (:meth:`Plan.to_dict`), its readable table (:meth:`Plan.summary`), and
:func:`get_plan`, which finds the plan of a compiled model's most recent graph.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from protrain_fx.errors import ProtrainError
from protrain_fx.options import format_bytes

PLACEMENTS = ("device", "host")
POLICIES = ("keep", "swap", "recompute")


@dataclass
class ChunkPlan:
    id: int
    bytes: int  # bytes of the parameters it holds (fp32 master size)
    params: list[str]
    placement: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "bytes": self.bytes,
            "params": list(self.params),
            "placement": self.placement,
        }


@dataclass
class BlockPlan:
    name: str
    policy: str = "keep"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "policy": self.policy}


@dataclass
class Plan:
    """What protrain decided for one graph. :meth:`to_dict` is the stable, documented schema; the
    other fields (graph name, notes, where things were found) only feed :meth:`summary` and the
    dumps."""

    chunk_size: int
    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    # data parallel: chunks after the first n_persist whose shards stay on the devices
    n_shard: int = 0
    # offloaded chunks keep a host copy in the transfer dtype (False: masters go up, cast there)
    transfer_copies: bool = True
    # the share of offloaded chunks stepped on the compute device (runtime/device_steps.py)
    device_steps: float = 0.0
    chunks: list[ChunkPlan] = field(default_factory=list)
    blocks: list[BlockPlan] = field(default_factory=list)
    predicted: dict[str, float] | None = None
    measured: dict[str, float] | None = None
    # ---- not part of to_dict()
    graph_name: str = ""
    block_container: str | None = None
    notes: list[str] = field(default_factory=list)
    # fqn -> chunk id, fqn -> block name (None: non-block)
    param_chunk: dict[str, int] = field(default_factory=dict)
    param_block: dict[str, str | None] = field(default_factory=dict)
    # what the passes read (by index, so the display names above may be re-rooted freely): the
    # dynamo graph's placeholders, placeholder index -> (chunk id, block index or None), the blocks,
    # the layout
    input_param: dict[int, tuple[int, int | None]] = field(default_factory=dict, repr=False)
    graph_inputs: list = field(default_factory=list, repr=False)
    block_structure: Any = field(default=None, repr=False)
    layout: Any = field(default=None, repr=False)
    # set by get_plan(module): what was prepended to the traced frame's names to make them module
    # FQNs
    root_prefix: str | None = None
    # runtime binding, set when the chunks are placed: placeholder index -> (store id, store entry
    # index)
    input_entry: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    param_dtype: Any = None  # transfer dtype of offloaded chunks
    # the automatic plan's knobs as decided (searched or from the plan cache), before the
    # placement's normalization (n_buffer 0 where no chunk is offloaded...): what the plan cache
    # keeps, so that a later run compiles from the same options (and its code cache's keys match)
    decided_knobs: dict[str, Any] | None = field(default=None, repr=False)
    # n_buffer came from the options (too small is an error, not raised)
    n_buffer_given: bool = False
    # n_buffer came from the plan search (too small: raised, like unset)
    n_buffer_searched: bool = False
    # set by chunk_gather: (store id, chunk) -> [(primal ordinal, store entry index, placeholder)]
    # of its parameters (read by optimizer_calls on the joint graph)
    grad_slots: dict[tuple[int, int], list] = field(default_factory=dict, repr=False)
    # data parallel (world_size > 1, set by the backend): the same for resident chunks, whose
    # gradients the resident_grads pass all-reduces from inside backward
    world_size: int = 1
    resident_grad_slots: dict[tuple[int, int], list[tuple[int, int]]] = field(
        default_factory=dict, repr=False
    )
    estimate: dict[str, int] = field(default_factory=dict, repr=False)  # device bytes by component
    # set at partition: names of the forward values saved for backward (in order); set by
    # swap_offload: saved value name -> its block
    saved_names: list[str] = field(default_factory=list, repr=False)
    swapped: dict[str, int] = field(default_factory=dict, repr=False)
    # set by chunked_loss: graph outputs it made logits without a gradient path, and the extra
    # output it added for each (the hidden states): [(logits position, hidden position, the head
    # weight's input position or -1)]; the backend gives them their gradient function
    # (runtime/loss_ops.py: reattach_logits)
    logits_outputs: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    # set by chunk_schedule: the most gathered chunks alive at once in any of the graph's stages
    chunks_in_use: int = 0
    # passes/block_marks.py wraps blocks in timing marks (PROTRAIN_PROFILE_BLOCKS=1)
    profile_blocks: bool = False
    # the profiler's plan (protrain_fx/profiling/profiler.py): its step's gradients are dropped
    profiling: bool = False
    # a graph that computes no gradients (evaluation under torch.no_grad()): it runs on the chunks
    # its parameters already have; get_plan prefers the training graph's plan
    inference: bool = False
    # set at partition when profiling: what the profiler reads of the partitioned graphs
    # (profiler.StaticProfile)
    static_profile: Any = field(default=None, repr=False)
    # set by machine/allocator.trimmed: step boundaries that gave the allocator's free pages back,
    # and why it stopped doing so ("" while it goes on)
    trims: int = 0
    trims_stopped: str = ""
    # set by get_plan for a model run as several graphs (graph breaks, regional compilation): the
    # model's other graphs, one line each
    other_graphs: list[str] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_size": self.chunk_size,
            "n_persist": self.n_persist,
            "n_buffer": self.n_buffer,
            "n_swap": self.n_swap,
            "n_checkpoint": self.n_checkpoint,
            "n_shard": self.n_shard,
            "transfer_copies": self.transfer_copies,
            "device_steps": self.device_steps,
            "chunks": [c.to_dict() for c in self.chunks],
            "blocks": [b.to_dict() for b in self.blocks],
            "predicted": None if self.predicted is None else dict(self.predicted),
            "measured": None if self.measured is None else dict(self.measured),
        }

    # ------------------------------------------------------------------------------------- summary
    def _dropped(self) -> str:
        """The predicted peak of a loop that drops the model's output before backward, where the
        graph returns logits beside its loss (the plan's own peak keeps them through backward)."""
        pred = self.predicted or {}
        dropped, peak = pred.get("peak_bytes_output_dropped"), pred.get("peak_bytes")
        n = pred.get("budget_shares") or 1
        if n > 1 and peak is not None:  # blocks compiled one by one (regional compilation)
            return (
                f" (one of {n} blocks compiled alike: {format_bytes(peak * n)} for the {n}, the "
                "code outside them not included)"
            )
        if dropped is None or peak is None or dropped >= peak:
            return ""
        return f" ({format_bytes(dropped)} if the loop drops the model's output before backward)"

    def summary(self) -> str:
        n_params = sum(len(c.params) for c in self.chunks)
        total = sum(c.bytes for c in self.chunks)
        resident = sum(c.bytes for c in self.chunks if c.placement == "device")
        lines = [
            f"protrain plan for graph {self.graph_name or '?'}: {n_params} parameters "
            f"({format_bytes(total)}) in {len(self.chunks)} chunks, {len(self.blocks)} blocks",
            f"  knobs: chunk_size={format_bytes(self.chunk_size)}  n_persist={self.n_persist}  "
            f"n_buffer={self.n_buffer}  n_swap={self.n_swap}  n_checkpoint={self.n_checkpoint}"
            + (f"  device_steps={self.device_steps:.2f}" if self.device_steps else "")
            + (f"  n_shard={self.n_shard}" if self.n_shard else "")
            + ("" if self.transfer_copies else "  transfer_copies=False"),
            f"  chunks: {sum(c.placement == 'device' for c in self.chunks)} resident on the device "
            f"({format_bytes(resident)}), "
            + (
                f"{self.n_shard} sharded on the devices "
                f"({format_bytes(sum(c.bytes for c in self.chunks if c.placement == 'sharded'))}), "
                if self.n_shard
                else ""
            )
            + f"{sum(c.placement == 'host' for c in self.chunks)} offloaded to the host "
            f"({format_bytes(sum(c.bytes for c in self.chunks if c.placement == 'host'))})",
        ]
        if self.chunks:
            rows = [("chunk", "placement", "bytes", "fill", "params", "first .. last parameter")]
            for c in self.chunks:
                span = c.params[0] if len(c.params) == 1 else f"{c.params[0]} .. {c.params[-1]}"
                # an oversized parameter's chunk is its own size
                size = max(self.chunk_size, c.bytes)
                fill = f"{100 * c.bytes / size:.0f}%" if size else "-"
                rows.append(
                    (str(c.id), c.placement, format_bytes(c.bytes), fill, str(len(c.params)), span)
                )
            lines += _table(rows)
        if self.blocks:
            lines.append(
                f"  blocks (children of {self.block_container!r}), activation policy in order:"
            )
            lines += _table(
                [("block", "name", "policy")]
                + [(str(i), b.name, b.policy) for i, b in enumerate(self.blocks)]
            )
        else:
            lines.append(
                "  blocks: none detected; the whole graph is one non-block region "
                "(activations kept)"
            )
        non_block = [p for p, b in self.param_block.items() if b is None]
        if non_block and self.blocks:
            shown = ", ".join(non_block[:6]) + (
                f", ... ({len(non_block)} in all)" if len(non_block) > 6 else ""
            )
            lines.append(
                f"  parameters outside blocks (their regions always keep activations): {shown}"
            )
        lines += self._auto_lines()
        lines.append(
            f"  iteration time: predicted {_fmt_s(self.predicted, 'iter_s')}, measured "
            f"{_fmt_s(self.measured, 'iter_s')}"
            "; peak memory reserved: predicted "
            f"{format_bytes((self.predicted or {}).get('peak_bytes'))}{self._dropped()}, "
            f"measured {format_bytes((self.measured or {}).get('peak_bytes'))}"
        )
        k_run = (self.measured or {}).get("micro_steps") or 1
        k_plan = ((self.predicted or {}).get("breakdown") or {}).get("micro_steps") or 1
        if self.measured and self.measured.get("iter_s") is not None and k_run != k_plan:
            lines.append(
                f"  an optimizer step ran {k_run} micro-steps (measured over them), where the plan "
                f"priced {k_plan}: the next plan of this graph prices {k_run}"
            )
        at_step = (self.measured or {}).get("cpu_steps_at_opt_step")
        if at_step and not (self.predicted or {}).get("cpu_steps_at_opt_step"):
            lines.append(
                f"  the offloaded chunks' CPU steps ran at opt.step(), after backward ({at_step}), "
                "where the plan priced them beside it: the next plan of this graph prices them so"
            )
        alloc_pred = (self.predicted or {}).get("peak_allocated_bytes")
        alloc_meas = (self.measured or {}).get("peak_allocated_bytes")
        if alloc_pred is not None or alloc_meas is not None:
            lines.append(
                f"  peak memory allocated: predicted {format_bytes(alloc_pred)}, measured "
                f"{format_bytes(alloc_meas)}"
                + (
                    f" (allocator: {self.predicted['allocator']})"
                    if (self.predicted or {}).get("allocator")
                    else ""
                )
            )
        if self.other_graphs:
            lines.append(
                f"  this model runs {len(self.other_graphs) + 1} compiled graphs (graph breaks, "
                "or blocks compiled one by one), each with a plan of its own (under an explicit "
                "memory_budget, the whole of it each, or its share for one of N blocks of one "
                "structure); the others: " + "; ".join(self.other_graphs)
            )
        if self.trims or self.trims_stopped:
            lines.append(
                f"  the allocator's free pages given back at {self.trims} step boundaries"
                + (f"; stopped: {self.trims_stopped}" if self.trims_stopped else "")
            )
        m = self.measured or {}
        if "host_bytes" in m:
            rss = (
                f"; the process's resident memory {format_bytes(m['rss_bytes'])} (peak "
                f"{format_bytes(m['peak_rss_bytes'])})"
                if m.get("rss_bytes") is not None
                else ""
            )
            lines.append(
                f"  host memory: predicted {format_bytes((self.predicted or {}).get('host_bytes'))}"
                f" of protrain's buffers, measured {format_bytes(m['host_bytes'])} (peak "
                f"{format_bytes(m['host_peak_bytes'])}; all of this process's plans){rss}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _auto_lines(self) -> list[str]:
        p = self.predicted or {}
        if "budget_bytes" not in p:
            return []
        if p.get("from_cache"):
            how = "from the plan cache (no profiling)"
        else:
            how = (
                f"profiled in {p['profile_s']:.1f} s (+{p['profile_compile_s']:.1f} s to "
                "compile the profiling "
                f"plan), {p['plans_evaluated']} plans searched in {1e3 * p['search_s']:.0f} ms"
            )
        lines = [
            f"  automatic plan: {how}; budget {format_bytes(p['budget_bytes'])} "
            f"({p.get('budget', '')})"
        ]
        b = p.get("breakdown") or {}
        rate = p.get("cpu_optim_rate", "-")
        where = "after backward" if "at opt.step()" in rate else "beside backward"
        if b:
            k = b.get("micro_steps") or 1
            lines.append(
                (
                    f"  {k} micro-steps per optimizer step: those before the last "
                    f"{1e3 * b['before_last_micro_step_s']:.1f} ms; the last one's "
                    if k > 1
                    else "  predicted: "
                )
                + f"forward {1e3 * b['fwd_s']:.1f} ms, backward "
                f"{1e3 * b['bwd_s']:.1f} ms, "
                f"device optimizer {1e3 * b['gpu_optim_s']:.1f} ms, CPU optimizer "
                f"{1e3 * b['cpu_optim_s']:.1f} ms "
                f"({where}; {rate}); activations "
                f"{format_bytes(b['activation_bytes'])}, "
                "transient "
                f"{format_bytes(b['transient_bytes'])}, after the blocks "
                f"{format_bytes(b.get('tail_bytes', 0))}, swapped to the host "
                f"{format_bytes(b['swapped_bytes'])}; "
                + (
                    f"offloaded chunks up at {b['upload_bytes_per_s'] / 1e9:.1f} GB/s; "
                    if b.get("upload_bytes_per_s") and self.n_persist < self.layout.n_chunks
                    else ""
                )
                + f"pinned host memory {format_bytes(p.get('host_bytes'))}"
            )
        offloads = self.n_persist < self.layout.n_chunks
        return lines + (_host_bound_lines(p.get("profiled") or {}) if offloads else [])

    def __str__(self) -> str:
        return self.summary()


def _host_bound_lines(prof: dict) -> list[str]:
    """A line where the profiled step's host (every chunk offloaded) took longer to queue the
    blocks' forward than their kernels ran: offloaded chunks are priced at the host's time
    (profiling/profiler.py, plan/cost_model.py)."""
    host, kernels = sum(prof.get("block_fwd_host_ms") or []), sum(prof.get("block_fwd_ms") or [])
    if not host > kernels:
        return []
    return [
        f"  host-bound: the profiled step's host queued the blocks' forward in {host:.1f} ms "
        f"(every chunk offloaded), their kernels ran {kernels:.1f} ms; an offloaded chunk's "
        "forward is priced at the longer of the two"
    ]


def _fmt_s(d: dict | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# ------------------------------------------------------------------------------------ registry
@dataclass
class _Entry:
    seq: int
    plan: Plan
    param_ids: frozenset[int]
    options_id: int | None
    params: list[weakref.ref] = field(default_factory=list)


_ENTRIES: list[_Entry] = []
_MAX_ENTRIES = 256
_SEQ = itertools.count()


def register_plan(plan: Plan, params: list[torch.Tensor], options: dict | None) -> None:
    """Remember ``plan`` as the newest plan of the graph that uses ``params`` (called by the
    backend)."""
    # drop the plans of models that died; keep a bounded history
    _ENTRIES[:] = [e for e in _ENTRIES if all(r() is not None for r in e.params)][
        -(_MAX_ENTRIES - 1) :
    ]
    _ENTRIES.append(
        _Entry(
            seq=next(_SEQ),
            plan=plan,
            param_ids=frozenset(id(p) for p in params),
            options_id=None if options is None else id(options),
            params=[weakref.ref(p) for p in params],
        )
    )


def training_plans() -> list[tuple[Plan, list[torch.Tensor]]]:
    """The newest plan of every live training graph, with its parameters (an inference placement
    leaves room for their steps: protrain_fx/inference_placement.py)."""
    newest = {}
    for e in _ENTRIES:
        params = [r() for r in e.params]
        if not e.plan.inference and params and all(p is not None for p in params):
            newest[(e.plan.graph_name or e.seq, e.param_ids)] = (e.plan, params)
    return list(newest.values())


def _options_of(compiled) -> dict | None:
    """The options dict a ``torch.compile`` wrapper was made with (walks dynamo's backend
    wrappers)."""
    fn = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    if fn is None:
        fn = getattr(compiled, "_torchdynamo_inline", None)
    seen = 0
    while fn is not None and seen < 16:
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and "options" in kwargs:
            return kwargs["options"]
        fn = getattr(fn, "_torchdynamo_orig_backend", None)
        seen += 1
    return None


def _name_from_root(entry: _Entry, module: torch.nn.Module) -> None:
    """Names in a plan are relative to the module whose forward dynamo traced; after a graph break
    that can be a submodule (``transformer.h.0`` inside ``lm``). Prefix them so they match
    ``module``'s names."""
    plan = entry.plan
    if plan.root_prefix is not None:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    prefixes = set()
    for fqn, ref in zip(plan.param_chunk, entry.params):
        full = names.get(id(ref()))
        if full is None or not full.endswith(fqn):
            return
        prefixes.add(full[: len(full) - len(fqn)])
    if len(prefixes) != 1:
        return
    (prefix,) = prefixes
    plan.root_prefix = prefix
    if not prefix:
        return
    for c in plan.chunks:
        c.params = [prefix + p for p in c.params]
    for b in plan.blocks:
        b.name = prefix + b.name
    plan.param_chunk = {prefix + k: v for k, v in plan.param_chunk.items()}
    plan.param_block = {
        prefix + k: (None if v is None else prefix + v) for k, v in plan.param_block.items()
    }
    if plan.block_container is not None:
        plan.block_container = prefix + plan.block_container


def _training_first(entries: list[_Entry]) -> list[_Entry]:
    """The training graphs' entries, or all of them when there are none."""
    return [e for e in entries if not e.plan.inference] or entries


def _main_graph(entries: list[_Entry]) -> _Entry:
    """Of a model's entries, the newest plan of each graph, and of those the one with the most
    parameters (the newest among equals); the others are named in its summary."""
    newest = {}
    for e in entries:
        newest[e.plan.graph_name or e.seq] = e
    graphs = sorted(newest.values(), key=lambda e: e.seq)
    main = max(reversed(graphs), key=lambda e: len(e.param_ids))
    main.plan.other_graphs = [
        f"graph {e.plan.graph_name} ({len(e.param_ids)} parameters, {len(e.plan.chunks)} chunks, "
        f"{len(e.plan.blocks)} blocks)"
        for e in graphs
        if e is not main and not e.plan.inference
    ]
    return main


def get_plan(compiled=None) -> Plan:
    """The plan of the graph compiled by backend="protrain" for ``compiled`` (the module returned by
    ``torch.compile`` or the original module): its newest plan (a re-plan replaces the one before).
    Without an argument: the newest plan of all.

    A model whose forward was split by graph breaks has one plan per graph; the graph that holds the
    most of the model's parameters is the one returned (the newest among equals: a model compiled
    block by block), and its summary names the others. A training graph's plan comes before an
    inference graph's (an evaluation under ``torch.no_grad()`` compiles one more graph, which runs
    on the training plan's chunks): the latter only for a model never trained.
    """
    live = [e for e in _ENTRIES if all(r() is not None for r in e.params)]
    if compiled is None:
        if not live:
            raise ProtrainError("no graph has been compiled with backend='protrain' yet")
        return live[-1].plan
    module = getattr(compiled, "_orig_mod", compiled)
    if isinstance(module, torch.nn.Module):
        ids = {id(p) for p in module.parameters()}
        mine = _training_first([e for e in live if e.param_ids and e.param_ids <= ids])
        if mine:
            main = _main_graph(mine)
            _name_from_root(main, module)
            return main.plan
    opts = _options_of(compiled)
    if opts is not None:
        mine = _training_first([e for e in live if e.options_id == id(opts)])
        if mine:
            return _main_graph(mine).plan
    raise ProtrainError(
        "no protrain plan found for this model: compile it with torch.compile(model, "
        "backend='protrain') "
        "and call it once (plans are made when the first call compiles the graph)"
    )
