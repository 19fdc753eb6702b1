"""The training systems benchmarks/run.py compares, one function each: build the model and
optimizer, return one training step. Every system runs in a process of its own (``run.py --one
SYSTEM``), so no system sees another's allocator state, compile caches in memory or process group.

A system function takes the run's ``spec`` (model kind and config, batch, seq, device, cap, ...) and
the token batch ``x, y``; it returns ``(step, params, extra)``: ``step()`` runs forward, backward
and the optimizer step and returns the loss; ``extra()`` gives system-specific columns, read after
the timed steps.

Precision everywhere: fp32 master weights and AdamW (lr 1e-4, weight decay 0.1); bf16 compute
through ``torch.autocast`` (protrain, eager, torch.compile, torchao), ``MixedPrecisionPolicy``
(FSDP2) or DeepSpeed's ``bf16`` section, as each system is normally used
(../shared/reference/gpu_peers.py, which produced ../shared/ANCHORS.md on the H200).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Callable, NamedTuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from models import build  # noqa: E402

LR, WEIGHT_DECAY = 1e-4, 0.1

# ---- protrain's options, in one place. Every protrain run gets {"optimizer": opt} updated with
# PROTRAIN_OPTIONS, then with run.py --protrain-options '{...}'; a key set to None is dropped.
# Everything else is the automatic plan: the budget is the memory the process may use (the cap) less
# protrain's own reserve.
PROTRAIN_OPTIONS: dict = {}

# ---- memory each system needs per parameter, for run.py's guards and admission
# (benchmarks/suite/admission.py; GiB = bytes * params / 2**30)
# Host bytes per *offloaded* parameter (model states only; admission adds HOST_OVERHEAD_GIB per
# process):
#   protrain: fp32 master + 2 Adam moments + fp32 gradient accumulator = 16 (+ a bf16 transfer copy,
#   2, which the automatic plan drops where the host needs it: transfer_copies=False; so 16 is its
#   lower bound, the one predicted_failure may use)
#   FSDP2 CPUOffloadPolicy: fp32 sharded parameter + fp32 gradient + 2 moments = 16
#   ZeRO-2 + offload_optimizer: fp32 master + 2 moments + fp32 gradient partition = 16
#   ZeRO-3 + offload_param + offload_optimizer: the same + the bf16 parameter partition = 18
# torchao CPUOffloadOptimizer: fp32 host copy of the parameter + pinned fp32 gradient + 2 moments =
# 16
HOST_BYTES_PER_PARAM = {
    "protrain": 16,
    "fsdp2_offload": 16,
    "ds_zero2_offload": 16,
    "ds_zero3_offload": 18,
    "torchao_offload": 16,
}
HOST_OVERHEAD_GIB = 4.0  # one process: torch and CUDA libraries, compile workers, pinned staging
# Device bytes per parameter that are certainly alive at once, activations aside (a lower bound: a
# model whose parameters need more than the limit is an OOM without running it):
# on-device AdamW (eager, compile, compile_ac): fp32 weights + fp32 gradients + 2 fp32 moments = 16
#   torchao CPUOffloadOptimizer: fp32 weights + fp32 gradients (moments on the host) = 8
#   ZeRO-2 + offload_optimizer: bf16 weights = 2; FSDP2 / ZeRO-3 offload, protrain: 0 (streamed)
DEVICE_BYTES_LOWER_BOUND = {
    "eager": 16,
    "compile": 16,
    "compile_ac": 16,
    "torchao_offload": 8,
    "ds_zero2_offload": 2,
}
# Rough device need when uncapped, for admission only (a wrong guess costs time, never a wrong row):
# bytes per parameter on the device, plus activations (suite/admission.py's activation_gib)
DEVICE_BYTES_ESTIMATE = {
    "eager": 16,
    "compile": 16,
    "compile_ac": 16,
    "protrain": 16,
    "torchao_offload": 8,
    "ds_zero2_offload": 4,
    "ds_zero3_offload": 0,
    "fsdp2_offload": 0,
}


def _adamw(params):
    # fused: CUDA and CPU kernels
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def _autocast(spec):
    return torch.autocast(spec["device"], dtype=torch.bfloat16, enabled=spec["device"] == "cuda")


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def _own_init_only(fill=None):
    """Skip torch's default init of Linear and Embedding weights: examples/models.py re-initializes
    every one of them (normal, std 0.02; biases zero), and the default (``kaiming_uniform_``, serial
    on the CPU) costs about 25 s per 6 B parameters built on the host. Only the random stream
    differs, not the distribution. ``fill`` (tests): a value to leave instead, to show that the
    models' own init overwrites everything."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters

    def reset(self):
        if fill is not None:
            with torch.no_grad():
                for p in self.parameters(recurse=False):
                    p.fill_(fill)

    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = reset
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _build(spec, device=None):
    """The model, its parameters created on ``device`` (None: the current default, i.e. the CPU)."""
    torch.manual_seed(0)
    with _own_init_only(), torch.device(device or "cpu"):
        return build(spec["kind"], **spec["cfg"])


def _plain_step(model, opt, spec, x, y):
    """One training step. With ``spec["phase_times"]`` on CUDA, ``step.phases`` collects each step's
    CUDA events at its start and after forward, backward and the optimizer (:func:`phase_ms` reads
    them)."""
    timed = bool(spec.get("phase_times")) and spec["device"] == "cuda"

    def mark(events):
        if timed:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)

    def step():
        events = []
        mark(events)
        with _autocast(spec):
            loss = model(x, y)
        mark(events)
        loss.backward()
        mark(events)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(events)
        if timed:
            step.phases.append(events)
        return loss

    step.phases = []
    return step


def phase_ms(step) -> dict | None:
    """Median device milliseconds of forward, backward (what the device ran between the end of
    forward and the return of ``loss.backward()``'s queued work) and optimizer over ``step.phases``.
    """
    import statistics

    rows = getattr(step, "phases", None)
    if not rows:
        return None
    torch.cuda.synchronize()
    names = ("forward", "backward", "optimizer")
    return {
        n: statistics.median(ev[i].elapsed_time(ev[i + 1]) for ev in rows)
        for i, n in enumerate(names)
    }


def _single_process_group_env() -> None:
    """Rank 0 of 1 on a free local port (FSDP2 and DeepSpeed need a process group even on one
    GPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def _no_extra() -> dict:
    return {}


# ------------------------------------------------------------------------------------------------
# systems
def protrain_options(spec) -> dict:
    """protrain's options for this run, the optimizer aside (see PROTRAIN_OPTIONS)."""
    options = dict(PROTRAIN_OPTIONS)
    options.update(spec.get("protrain_options") or {})
    return {k: v for k, v in options.items() if v is not None}


def _profile_alone() -> None:
    """protrain's profiling step times kernels: like the timed steps, it runs with nothing else
    measuring or compiling next to it (benchmarks/timeshare.py)."""
    import timeshare

    from protrain_fx.profiling import frugal

    if getattr(frugal.profile_step, "_alone", False):
        return
    inner = frugal.profile_step

    def alone(*args, **kwargs):
        with timeshare.measuring(then_busy=True):  # then the plan's compile and warm-up, shared
            return inner(*args, **kwargs)

    alone._alone = True
    frugal.profile_step = alone


def protrain(spec, x, y):
    """torch.compile(backend="protrain"), the automatic plan (options: the optimizer,
    PROTRAIN_OPTIONS), the model built under ``protrain_fx.host_init`` on CUDA so that it never has
    to fit on the device."""
    import protrain_fx

    if spec["device"] == "cuda":
        with protrain_fx.host_init("cuda"):
            model = _build(spec)
    else:
        model = _build(spec)
    opt = _adamw(model.parameters())
    options = protrain_options(spec)
    _profile_alone()
    compiled = torch.compile(model, backend="protrain", options={"optimizer": opt, **options})

    def extra():
        out = {"protrain_options": options}
        try:
            plan = protrain_fx.get_plan(compiled)
        except Exception as e:  # noqa: BLE001 - informational column only
            return dict(out, plan_error=repr(e)[:300])
        host = [c for c in plan.chunks if c.placement == "host"]
        out.update(
            n_persist=plan.n_persist,
            n_chunks=len(plan.chunks),
            chunk_size=plan.chunk_size,
            n_buffer=plan.n_buffer,
            n_swap=plan.n_swap,
            n_checkpoint=plan.n_checkpoint,
            offloaded_chunks=len(host),
            offloaded_gib=sum(c.bytes for c in host) / 2**30,
        )
        pred = plan.predicted or {}
        out["plan_predicted"] = {k: v for k, v in pred.items() if k not in ("timeline", "profiled")}
        out["plan_profiled"] = {
            k: v for k, v in (pred.get("profiled") or {}).items() if k != "timeline"
        }
        out["plan_measured"] = plan.measured
        from protrain_fx.runtime import chunk_store, hybrid_optim

        handle = hybrid_optim.handle_of(opt)
        # where the step's time went (host-side seconds, cumulative over the run)
        if handle is not None:
            out["optimizer_timers"] = dict(handle.timers.__dict__)
        store = next(
            (
                chunk_store.store_of(p)
                for p in model.parameters()
                if chunk_store.store_of(p) is not None
            ),
            None,
        )
        if store is not None:
            out["chunk_stats"] = dict(store.stats)
        return out

    return _plain_step(compiled, opt, spec, x, y), _n_params(model), extra


def eager(spec, x, y):
    """Plain eager PyTorch, everything on the device, bf16 autocast, fused AdamW."""
    model = _build(spec, spec["device"])
    opt = _adamw(model.parameters())
    return _plain_step(model, opt, spec, x, y), _n_params(model), _no_extra


def compile(spec, x, y):  # noqa: A001 - the system's name
    """torch.compile (Inductor, default mode), everything on the device: the ceiling."""
    model = _build(spec, spec["device"])
    opt = _adamw(model.parameters())
    return _plain_step(torch.compile(model), opt, spec, x, y), _n_params(model), _no_extra


def compile_ac(spec, x, y):
    """torch.compile with ``torch._functorch.config.activation_memory_budget`` (the min-cut
    partitioner recomputes activations so as to save only that fraction of what it would save
    otherwise)."""
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = spec["ac_budget"]
    model = _build(spec, spec["device"])
    opt = _adamw(model.parameters())
    step = _plain_step(torch.compile(model), opt, spec, x, y)
    return step, _n_params(model), lambda: {"activation_memory_budget": spec["ac_budget"]}


def fsdp2_shard_offloaded(model, blocks):
    """``fully_shard`` each of ``blocks`` and then ``model`` with
    ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the optimizer on the host) and
    bf16 ``MixedPrecisionPolicy`` with fp32 reduction, in a process group of one rank unless one
    exists (torchrun)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():  # alone; under torchrun (benchmarks/dp_bench.py) the group exists
        _single_process_group_env()
        dist.init_process_group("nccl", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=True)
    for blk in blocks:
        fully_shard(blk, offload_policy=policy, mp_policy=mp)
    fully_shard(model, offload_policy=policy, mp_policy=mp)
    return model


def fsdp2_offload(spec, x, y):
    """FSDP2 ``fully_shard`` per block and at the root with ``CPUOffloadPolicy(pin_memory=True)``,
    bf16 ``MixedPrecisionPolicy`` (fp32 reduce), fused CPU AdamW (the fastest torch offers:
    ../shared/ANCHORS.md)."""
    model = _build(spec)  # on the CPU: FSDP2 keeps the sharded parameters there
    fsdp2_shard_offloaded(model, model.blocks)
    opt = _adamw(model.parameters())

    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, _n_params(model), _no_extra


def _deepspeed(spec, x, y, stage: int):
    import deepspeed

    _single_process_group_env()
    zero = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    conf = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 10**9,
    }
    model = _build(spec)  # on the CPU; DeepSpeed casts it to bf16 and places it
    n = _n_params(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=conf
    )

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step, n, lambda: {"deepspeed": deepspeed.__version__, "zero_config": zero}


def ds_zero2_offload(spec, x, y):
    """DeepSpeed ZeRO-2 with ``offload_optimizer`` to the CPU (ZeRO-Offload; DeepSpeedCPUAdam),
    bf16."""
    return _deepspeed(spec, x, y, 2)


def ds_zero3_offload(spec, x, y):
    """DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` to the CPU, bf16."""
    return _deepspeed(spec, x, y, 3)


def torchao_offload(spec, x, y):
    """torchao ``CPUOffloadOptimizer`` (fused CPU AdamW; parameters and gradients on the device,
    optimizer states and the step on the host), eager model with bf16 autocast."""
    import torchao
    from torchao.optim import CPUOffloadOptimizer

    model = _build(spec, "cuda")
    opt = CPUOffloadOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        offload_gradients=False,
        fused=True,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
    )
    return (
        _plain_step(model, opt, spec, x, y),
        _n_params(model),
        lambda: {"torchao": torchao.__version__},
    )


class System(NamedTuple):
    fn: Callable
    cuda_only: bool  # runs on a GPU only (a CPU run is an error row)
    # imports a package from .whl/ (installed into suite/machine.py's PEER_SITE on the GPU machine)
    wheels: bool
    describe: str


SYSTEMS = {
    "protrain": System(protrain, False, False, "protrain, automatic plan"),
    "compile": System(compile, False, False, "torch.compile Inductor, all on device (the ceiling)"),
    "eager": System(eager, False, False, "eager PyTorch, all on device"),
    "fsdp2_offload": System(fsdp2_offload, True, False, "FSDP2 CPUOffloadPolicy + fused CPU AdamW"),
    "ds_zero2_offload": System(
        ds_zero2_offload, True, True, "DeepSpeed ZeRO-2 + offload_optimizer"
    ),
    "ds_zero3_offload": System(
        ds_zero3_offload, True, True, "DeepSpeed ZeRO-3 + offload_param + offload_optimizer"
    ),
    "torchao_offload": System(
        torchao_offload, True, True, "torchao CPUOffloadOptimizer (fused CPU AdamW)"
    ),
    "compile_ac": System(compile_ac, False, False, "torch.compile + activation_memory_budget"),
}
