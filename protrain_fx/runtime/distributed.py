"""Data parallelism over ``torch.distributed`` (NCCL on CUDA, gloo on the CPU), ZeRO-3 style for
offloaded chunks: launched with ``torchrun``, each rank compiles the same graphs, and

* every offloaded chunk is split in ``world size`` equal shards (its element count is padded to a
  multiple of it); a rank keeps only its shard of the fp32 master, the transfer copy, the gradient
  accumulator and the Adam moments in pinned host memory, and its CPU optimizer steps only that
  shard;
* a gather copies the rank's shard into its place in a device chunk buffer and all-gathers the rest
  (``protrain::prefetch``, on the host-to-device stream); a chunk's gradient is reduce-scattered
  (averaged) before its shard goes to the host (``protrain::chunk_grad``);
* resident chunks are replicated: their gradients are all-reduced (averaged) in place from inside
  backward, one coalesced async all-reduce per chunk as soon as its gradients are complete, waited
  for at the end of the backward graph (passes/resident_grads.py), so it overlaps the rest of
  backward; gradients that reach autograd's hooks instead are all-reduced from there; the user's
  optimizer steps them identically on every rank;
* the automatic plan is made on rank 0 and broadcast, so every rank runs the same plan.

With one process (or none initialized) nothing here runs: :func:`world` has size 1 and every
function is a no-op. Collectives are called in program order on the thread that runs the graphs
(never from the optimizer's worker thread), so every rank issues them in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from protrain_fx._weakmap import IdentityWeakMap


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def sharded(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's rank and the world size of the default process group (size 1 when none)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def group_name() -> str:
    """The default process group's name, as functional collectives in a graph name it."""
    return dist.group.WORLD.group_name


def all_gather_into(full: torch.Tensor, shard: torch.Tensor) -> None:
    """``full`` (flat, world size x shard) gets every rank's ``shard``; ``shard`` may be this rank's
    slice of ``full`` (then on the CPU it is copied first: gloo does not gather in place)."""
    if (
        shard.device.type == "cpu"
        and shard.data_ptr() >= full.data_ptr()
        and shard.data_ptr() < full.data_ptr() + full.numel() * full.element_size()
    ):
        shard = shard.clone()
    dist.all_gather_into_tensor(full, shard)


def reduce_scatter_mean(shard: torch.Tensor, full: torch.Tensor, size: int) -> None:
    """``shard`` = this rank's slice of the mean over ranks of ``full``."""
    if _averages_in_place(full):
        dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
        return
    dist.reduce_scatter_tensor(shard, full)
    shard.div_(size)


def _averages_in_place(t: torch.Tensor) -> bool:
    """NCCL averages inside the collective (``ReduceOp.AVG``), which saves a pass over the tensor
    after it; gloo has no AVG: the sum is divided afterwards."""
    return t.is_cuda and dist.get_backend() == "nccl"


def all_reduce_mean(t: torch.Tensor, size: int, async_op: bool = False):
    """Average ``t`` over the ranks in place; with ``async_op`` returns ``(work, finish)``:
    ``finish()`` completes the average once the work is waited for."""
    if _averages_in_place(t):
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op)
        finish = lambda: None  # noqa: E731
    else:
        work = dist.all_reduce(t, async_op=async_op)
        finish = functools.partial(t.div_, size)
    if async_op:
        return work, finish
    finish()


def shard_norm(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type`` norm over every rank's tensors, from the norms of this rank's (a
    collective)."""
    local = torch.stack([n.to(device) for n in norms]) if norms else torch.zeros(1, device=device)
    if norm_type == float("inf"):
        t = local.max().reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t[0]
    t = local.pow(norm_type).sum().reshape(1)
    dist.all_reduce(t)
    return t[0].pow(1.0 / norm_type)


def gather_host(shard: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """Every rank's ``shard`` of a host tensor, concatenated on the host (through the device on
    CUDA: NCCL moves device memory only). A collective: every rank calls it, in the same order."""
    if device.type == "cuda":
        local = shard.to(device)
        full = torch.empty(local.numel() * size, dtype=local.dtype, device=device)
        dist.all_gather_into_tensor(full, local)
        return full.cpu()
    full = torch.empty(shard.numel() * size, dtype=shard.dtype)
    dist.all_gather_into_tensor(full, shard)
    return full


def collective_bytes_per_s(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """The all-gather bus rate between the ranks (bytes of the gathered tensor x (N-1)/N per
    second), the slowest rank's: a collective, every rank calls it. 256 MiB on CUDA, 8 MiB on the
    CPU by default."""
    import time

    w = world()
    nbytes = nbytes or (256 << 20 if device.type == "cuda" else 8 << 20)
    shard = torch.zeros(nbytes // 4 // w.size, dtype=torch.float32, device=device)
    full = torch.empty(shard.numel() * w.size, dtype=torch.float32, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(2):  # warm-up: communicator set-up, first-touch
        dist.all_gather_into_tensor(full, shard)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_gather_into_tensor(full, shard)
    sync()
    rate = torch.tensor(
        [full.numel() * 4 * (w.size - 1) / w.size / ((time.perf_counter() - t0) / reps)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate.item())


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank (identity with one process)."""
    if not world().sharded:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_HOOKED = IdentityWeakMap()
_HOOKED_OPTIMIZERS = IdentityWeakMap()
# resident gradients whose all-reduce is in flight: (work, finish); finish() runs once the work is
# waited for
_IN_FLIGHT: list = []
# parameters whose gradients the graphs average (not the hooks)
_AVERAGED_IN_GRAPH = IdentityWeakMap()


def all_reduce_mean_many(tensors: list[torch.Tensor], size: int):
    """Start averaging each of ``tensors`` (dense) over the ranks in place, as one coalesced
    collective (NCCL groups them: no flat copy); returns ``(work, finish)``: ``finish()`` completes
    the average once the work is waited for."""
    avg = _averages_in_place(tensors[0])
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    # private; in torch since 2.1
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(async_ops=True) as work:
        for t in tensors:
            dist.all_reduce(t, op=op)
    finish = (lambda: None) if avg else functools.partial(torch._foreach_div_, tensors, size)
    return work, finish


def start_resident_all_reduce(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Start averaging a resident chunk's gradients over the ranks in place (async, one coalesced
    collective). Called from inside backward (``protrain::resident_grads``) on gradients the graph
    still returns to autograd: ``protrain::resident_grads_wait`` at the end of that graph makes the
    compute stream wait for the collective before autograd reads them (passes/resident_grads.py);
    the optimizer's step, clipping and the next graph call also finish whatever is still in flight.
    """
    size = world().size
    for p in params:
        _AVERAGED_IN_GRAPH[p] = True
    # collectives need dense tensors
    dense = [g if g.is_contiguous() else g.contiguous() for g in grads]
    work, average = all_reduce_mean_many(dense, size)

    def finish():
        average()
        for g, d in zip(grads, dense):
            if d is not g:
                g.copy_(d)

    _IN_FLIGHT.append((work, finish))


def average_resident_grads(params, optimizer=None) -> None:
    """Average ``params``' gradients over the ranks as autograd accumulates them (hooks, once per
    parameter).

    With the ``optimizer`` known, each all-reduce is started asynchronously (it overlaps the rest of
    backward) and :func:`wait_resident_grads` finishes them before anything reads or adds to the
    gradients: the optimizer's step (a pre-step hook), clipping, and the next call of a compiled
    graph (whose backward accumulates into them). Without it each all-reduce completes inside its
    hook."""
    w = world()
    if not w.sharded:
        return
    if optimizer is not None and optimizer not in _HOOKED_OPTIMIZERS:
        _HOOKED_OPTIMIZERS[optimizer] = True
        optimizer.register_step_pre_hook(lambda o, args, kwargs: wait_resident_grads())
    for p in params:
        if p in _HOOKED or not p.requires_grad:
            continue
        _HOOKED[p] = True
        hook = functools.partial(_average_hook, size=w.size, wait=optimizer is None)
        hook.protrain_own = True  # not a user's hook (runtime/param_hooks.py)
        p.register_post_accumulate_grad_hook(hook)


def _average_hook(param: torch.Tensor, size: int, wait: bool) -> None:
    """A resident gradient reached autograd (not averaged in the graph, passes/resident_grads.py):
    average it now, or start averaging it (finished by wait_resident_grads)."""
    # the graph averages it itself and returned None (the hook still runs; .grad may hold earlier
    # micro-batches' averaged sum)
    if param.grad is None or param in _AVERAGED_IN_GRAPH:
        return
    if wait:
        all_reduce_mean(param.grad, size)
    else:
        _IN_FLIGHT.append(all_reduce_mean(param.grad, size, async_op=True))


def wait_resident_grads() -> None:
    """Finish the resident gradients' all-reduces (see :func:`average_resident_grads` and
    :func:`start_resident_all_reduce`); a no-op when none are in flight. On CUDA the wait orders the
    current stream after them (the host does not block)."""
    if not _IN_FLIGHT:
        return
    done = list(_IN_FLIGHT)
    _IN_FLIGHT.clear()
    for work, finish in done:
        work.wait()
        finish()


def after_resident_grads(compiled):
    """Data parallel: a graph's backward adds to resident gradients, so their all-reduces still in
    flight from the last backward finish first (:func:`wait_resident_grads`)."""

    @functools.wraps(compiled)
    def run(*args):
        wait_resident_grads()
        return compiled(*args)

    return run
