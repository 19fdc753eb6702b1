"""Clipping's multiply of offloaded gradients kept pending (protrain_fx/runtime/grad_scale.py),
against eager PyTorch on the CPU, bit for bit: the multiply applied by the CPU kernel's pass (a
fused AdamW) or before the step, when a gradient is read, added to by another backward, multiplied
again, zeroed, or when a step is skipped."""

import copy

import pytest
import torch
from models import build

from protrain_fx.machine import cpu_adam
from protrain_fx.runtime import grad_scale, hybrid_optim, mapped
from protrain_fx.testing import make_adamw, random_batches


def gpt():
    torch.manual_seed(0)
    return build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)


def pair(fused):
    model = gpt()
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = make_adamw(mine, lr=3e-3, fused=fused), make_adamw(ref, lr=3e-3, fused=fused)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    return (compiled, mine, opt), (ref, ref, ref_opt)


def max_diff(a, b):
    sb = b.state_dict()
    return max((v - sb[k]).abs().max().item() for k, v in a.state_dict().items())


def pending(opt) -> int:
    return sum(len(s._grad_scale) for s in hybrid_optim.handle_of(opt).stores)


def offloaded_grads(model):
    """The parameters whose ``.grad`` is a view of host memory."""
    return [p for p in model.parameters() if type(p.grad).__name__ == "HostGrad"]


def clipped_run(fused, steps=5):
    """protrain's model after ``steps`` clipped steps, and how many multiplies were pending at each
    step's opt.step()."""
    (m, model, opt), _ = pair(fused)
    seen = []
    for x, y in random_batches(steps, 2, 16):
        m(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        seen.append(pending(opt))
        opt.step()
        opt.zero_grad()
    return model, opt, seen


def test_clipping_every_step_matches_eager_bit_for_bit():
    """Clipping that changes the gradients every step: the multiply is kept pending and applied
    before torch's step (on the CPU compute device, the user's optimizer's implementation)."""
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    seen = []
    for x, y in random_batches(5, 2, 16):
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.05)
            if o is opt:
                seen.append(pending(opt))
            o.step()
            o.zero_grad()
        assert max_diff(model, ref) == 0.0
    assert all(seen[1:]), seen  # from the second step on (the first learns the arrivals)


@pytest.mark.skipif(not cpu_adam.available(), reason="the CPU kernel is not built")
def test_the_kernel_applies_the_pending_multiply_as_the_multiply_would(monkeypatch):
    """With a fused AdamW the CPU compute device steps offloaded chunks with cpu_adam's kernel,
    which takes the pending multiply as it reads the gradients: the same model, bit for bit, as the
    multiply run through the gradients' views first (deferral off)."""
    deferred, opt, seen = clipped_run(True)
    assert all(seen[1:]) and hybrid_optim.handle_of(opt).timers.one_pass_steps > 0
    monkeypatch.setattr(grad_scale, "install", lambda: None)
    monkeypatch.setattr(mapped.HostGrad, "defer_scale", None)
    monkeypatch.setattr(mapped.HostGrad, "settle", None)
    direct, _, seen = clipped_run(True)
    assert not any(seen)
    assert max_diff(deferred, direct) == 0.0


@pytest.mark.parametrize("foreach", [False, True])
def test_reads_and_habits_see_the_multiplied_gradients(foreach):
    """Between the clip and the step: reading ``.grad`` (a norm, a copy), a second multiply, a
    hand-written foreach multiply; then another backward adding to the clipped gradients; a skipped
    step (zero_grad without step, set_to_none=False). Every value as eager's, bit for bit."""
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    data = random_batches(6, 2, 16)
    for k, (x, y) in enumerate(data):
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.05, foreach=foreach)
            if k == 1 and o is opt:
                assert pending(opt) > 0
            if k in (1, 3):  # read between clip and step
                got = [p.grad.detach().clone() for p in mod.parameters()]
                if o is opt:
                    mine_reads = got
                else:
                    assert all(torch.equal(a, b) for a, b in zip(mine_reads, got))
            if k == 2:  # a second multiply, by hand, of every gradient
                torch._foreach_mul_([p.grad for p in mod.parameters()], 0.7)
            if k == 4:  # one more backward before the step: adds to the clipped gradients
                f(*data[0]).backward()
            if k == 5:  # a skipped step
                o.zero_grad(set_to_none=False)
                continue
            o.step()
            o.zero_grad()
        assert max_diff(model, ref) == 0.0, k
    assert pending(opt) == 0


def test_a_gradient_multiplied_alone_and_logged():
    """``p.grad.mul_(c)`` of one offloaded parameter (a hand-written scale), then every gradient's
    norm logged, then the step: as eager."""
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    for x, y in random_batches(4, 2, 16):
        m(x, y).backward()
        r(x, y).backward()
        ids = {id(q) for q in offloaded_grads(model)}
        name = next(n for n, p in model.named_parameters() if id(p) in ids)
        norms = []
        for mod, o in ((model, opt), (ref, ref_opt)):
            dict(mod.named_parameters())[name].grad.mul_(0.5)
            norms.append(torch.stack([p.grad.norm() for p in mod.parameters()]))
            o.step()
            o.zero_grad()
        assert torch.equal(norms[0], norms[1])
        assert max_diff(model, ref) == 0.0


def test_a_tensor_sharing_a_gradient_sees_the_clip():
    """``g = p.grad.detach()`` (or ``.data``) taken before clipping shares the gradient's memory,
    as in eager: clipping must reach it, so that gradient's multiply is not kept pending (the
    others' are); the next gradient, after zero_grad, is free of it again."""
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    for k, (x, y) in enumerate(random_batches(4, 2, 16)):
        held = []
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            ps = list(mod.parameters())
            if k == 2:  # taken before the clip, read after it
                shared = [ps[-1].grad.detach(), ps[-2].grad.data]
            torch.nn.utils.clip_grad_norm_(ps, 0.05)
            if k == 2:
                held.append([t.clone() for t in shared])
            if o is opt:
                owners = [getattr(p.grad, "_protrain_owner", None) for p in ps[-2:]]
                assert None not in owners, "the last two parameters are offloaded"
                stores = {s.id: s for s in hybrid_optim.handle_of(opt).stores}
                kept = [i in stores[sid]._grad_scale for sid, i in owners]
                assert pending(opt) > 0
                assert kept == [k != 2] * 2, (k, kept)
            o.step()
            o.zero_grad()
        if held:
            assert all(torch.equal(a, b) for a, b in zip(*held))
        assert max_diff(model, ref) == 0.0


def served(opt) -> int:
    return sum(s.stats["grad_norms_served"] for s in hybrid_optim.handle_of(opt).stores)


@pytest.mark.parametrize("device_add", [True, False])
def test_clipping_norms_come_from_backward_while_the_gradients_are_unchanged(
    monkeypatch, device_add
):
    """Once a loop has clipped, backward computes each offloaded gradient's 2-norm as it leaves
    the device, and ``clip_grad_norm_`` takes it from there instead of reading host memory; a
    gradient written between backward and the clip (by hand, through a tensor sharing it, zeroed
    and accumulated into, multiplied and pending) is read again. Norms and the model as eager's,
    bit for bit, and the norms served in the steps where nothing wrote the gradients. A gradient
    accumulated over two backwards is summed on the compute device (grad_add.py) and its norm
    served too; with ``PROTRAIN_DEVICE_GRAD_ADD=0`` the host worker sums it and it is read."""
    monkeypatch.setenv("PROTRAIN_DEVICE_GRAD_ADD", "1" if device_add else "0")
    monkeypatch.setattr(grad_scale._Norms, "wanted", False)
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    data = random_batches(7, 2, 16)
    counts = []
    for k, (x, y) in enumerate(data):
        norms = []
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            ps = list(mod.parameters())
            if k == 2:  # written by hand, in place
                ps[-1].grad.add_(0.25)
            if k == 3:  # written through a tensor that shares it (no version of the view moves)
                ps[-2].grad.data.mul_(3.0)
            if k == 4:  # accumulated: a second backward adds to the first
                f(*data[0]).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(ps, 0.05))
            # logged again after the clip: its multiply is pending, so read through the view
            norms.append(torch.nn.utils.clip_grad_norm_(ps, float("inf")))
            o.step()
            o.zero_grad(set_to_none=k != 5)
        counts.append(served(opt))
        assert torch.equal(norms[0], norms[2]) and torch.equal(norms[1], norms[3]), k
        assert max_diff(model, ref) == 0.0, k
    per_step = [b - a for a, b in zip([0] + counts, counts)]
    assert per_step[0] == 0, per_step  # the first clip only learns that norms are wanted
    assert per_step[1] >= 6 and per_step[5] >= 6, per_step
    # k=2, 3: one gradient read again; k=4: a second backward added to the first; k=6 comes after
    # zero_grad(set_to_none=False): added to zeros. Summed on the device: all served; on the host
    # worker: none (read again)
    assert per_step[2] == per_step[1] - 1 and per_step[3] == per_step[1] - 1, per_step
    summed = per_step[1] if device_add else 0
    assert per_step[4] == summed and per_step[6] == summed, per_step
    adds = sum(s.stats["grad_adds_on_device"] for s in hybrid_optim.handle_of(opt).stores)
    assert (adds > 0) == device_add, adds


def test_a_multiply_by_one_leaves_host_memory_alone(monkeypatch):
    """``clip_grad_norm_`` under ``max_norm`` (or with ``inf``, to log the norm, as Hugging Face's
    Trainer does) multiplies every gradient by exactly one: nothing changes, so protrain runs no
    kernel over an offloaded gradient's memory (on a GPU a read and a write of every offloaded
    gradient over the link), while versions move as eager's do and training stays eager's, bit for
    bit. From the second step on the norm is backward's too, so clipping touches none of it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Touches(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.ops = ptrs, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]]
            if any(isinstance(t, torch.Tensor) and t.data_ptr() in self.ptrs for t in flat):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(grad_scale._Norms, "wanted", False)
    (m, model, opt), (r, ref, ref_opt) = pair(None)
    touched = []
    for k, (x, y) in enumerate(random_batches(4, 2, 16)):
        norms = []
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            grads = [p.grad for p in mod.parameters()]
            before = [g._version for g in grads]
            if o is opt:
                ptrs = {g.data_ptr() for g in offloaded_grads(mod) for g in [g.grad]}
                offloaded = offloaded_grads(mod)
                with Touches(ptrs) as mode:
                    norms.append(torch.nn.utils.clip_grad_norm_(mod.parameters(), float("inf")))
                touched.append(mode.ops)
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(mod.parameters(), float("inf")))
            assert all(g._version > v for g, v in zip(grads, before))
            o.step()
            o.zero_grad()
        assert torch.equal(norms[0], norms[1]), k
        assert max_diff(model, ref) == 0.0, k
    assert all(
        not any(op.endswith("_.default") or "_foreach_mul_" in op for op in ops) for ops in touched
    ), touched
    # the first step's norm reads them all; later ones only an embedding's, whose gradient leaves
    # the device as its lookup's rows (passes/sparse_embedding_grads.py), not whole
    embeddings = {id(mod.weight) for mod in model.modules() if isinstance(mod, torch.nn.Embedding)}
    rows = sum(id(p) in embeddings for p in offloaded)
    assert len(touched[0]) >= len(offloaded) > rows, (touched[0], rows)
    assert all(len(ops) == rows for ops in touched[1:]), (touched, rows)
