"""Gradients a loop keeps across ``zero_grad()`` keep their values, as eager's do
(protrain_fx/runtime/kept_grads.py): an offloaded parameter's gradient is a view of host memory the
next backward writes again, so a kept one is moved to memory of its own first. Bit for bit against
eager on the CPU, with clipping's pending multiply on the kept gradients."""

import copy

import torch
from models import build

from protrain_fx.runtime import hybrid_optim, mapped
from protrain_fx.testing import make_adamw, random_batches


def pair():
    torch.manual_seed(0)
    model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = make_adamw(mine, lr=3e-3), make_adamw(ref, lr=3e-3)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    return (compiled, mine, opt), (ref, ref, ref_opt)


def test_gradients_kept_across_zero_grad_keep_their_values():
    """A list of last step's gradients (``p.grad`` itself, clipped, its multiply pending when the
    step zeroes it), ``detach()``-ed copies and a view, compared after later steps: eager's values;
    the training too."""
    (m, model, opt), (r, ref, ref_opt) = pair()
    kept = {}
    for k, (x, y) in enumerate(random_batches(4, 2, 16)):
        for f, mod, o in ((m, model, opt), (r, ref, ref_opt)):
            f(x, y).backward()
            ps = list(mod.parameters())
            if k == 0:
                kept[mod is model, "views"] = [p.grad for p in ps]
            if k == 1:
                kept[mod is model, "plain"] = [p.grad.detach() for p in ps] + [ps[-1].grad[1:3]]
            torch.nn.utils.clip_grad_norm_(ps, 0.05)
            o.step()
            o.zero_grad()
    assert any(isinstance(g, mapped.HostGrad) for g in kept[True, "views"])  # offloaded ones
    for how in ("views", "plain"):
        mine, theirs = kept[True, how], kept[False, how]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), how
    assert all(g is not p.grad for g, p in zip(kept[True, "views"], model.parameters()))
    sd = ref.state_dict()
    assert max((v - sd[k]).abs().max().item() for k, v in model.state_dict().items()) == 0.0


def test_nothing_kept_nothing_moved():
    """A loop that keeps no gradient: every offloaded parameter keeps its one view of its
    accumulator from step to step (no copy, no new view)."""
    (m, model, opt), _ = pair()
    seen = []
    for x, y in random_batches(3, 2, 16):
        m(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        stores = hybrid_optim.handle_of(opt).stores
        seen.append({(s.id, i): id(v) for s in stores for i, v in s._grad_alias.items()})
    assert seen[0] and seen[0] == seen[1] == seen[2]
