"""Training-loop habits on CUDA against eager PyTorch (fp32): the paths that differ from the CPU
ones (offloaded parameters and gradients as device views of pinned host memory, copy streams, swap
copies).

    python benchmarks/cuda_habits.py --out benchmarks/results/cuda_habits_h200.json

Each case trains a copy of one model eagerly and one through backend="protrain" (Inductor, offloaded
chunks and a swapped block) with the same habit (a clip, a weight read and written between steps,
two forwards, an exception in backward, gradients edited by hand, the learning rate set between
backward and step, last step's gradients kept across zero_grad, two backwards through one graph,
the optimizer replaced or its state cleared mid-run), and reports the largest loss and parameter
differences. Then, clipping
every step, the 2-norms of offloaded gradients that backward computed and ``clip_grad_norm_`` is
served (protrain_fx/runtime/grad_scale.py), against the norm of each gradient's view read over the
link: how many equal bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
from torch.nn.utils import clip_grad_norm_  # bound before protrain is imported, as scripts do

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from models import build  # noqa: E402

LR = 1e-3
OPTIONS = {"n_persist": 1, "chunk_size": 8 << 20, "n_swap": 1}


def model():
    torch.manual_seed(0)
    return build("gpt", n_layer=4, n_embd=256, n_head=8, block_size=128, vocab_size=8192).cuda()


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 8192, (4, 128), generator=g).cuda(),
            torch.randint(0, 8192, (4, 128), generator=g).cuda(),
        )
        for _ in range(n)
    ]


def step(m, call, opt, data, i, between=None):
    """One training step on batch ``i``; ``between(m, opt)`` runs between backward and opt.step()
    and its numbers join the loss in what is compared."""
    loss = call(*data[i])
    loss.backward()
    extra = between(m, opt) if between is not None else []
    opt.step()
    opt.zero_grad()
    return [loss.item()] + extra


def plain(m, call, opt, data, i):
    return step(m, call, opt, data, i)


def clip(m, call, opt, data, i):
    return step(m, call, opt, data, i, lambda m, opt: [clip_grad_norm_(m.parameters(), 0.5).item()])


def touch(m, call, opt, data, i):
    out = plain(m, call, opt, data, i)
    with torch.no_grad():
        p = m.blocks[-1].mlp.fc.weight  # in an offloaded chunk
        out.append(p.norm().item())
        p.mul_(0.99)
        repr(p)
    return out


def accumulate(m, call, opt, data, i):
    """Two micro-steps, then a clip: from the second micro-step on, each offloaded chunk's gradient
    is added to its accumulator on the device (protrain_fx/runtime/grad_add.py)."""
    out = []
    for k in (i, (i + 1) % len(data)):
        loss = call(*data[k]) / 2
        loss.backward()
        out.append(loss.item())
    out.append(clip_grad_norm_(m.parameters(), 0.5).item())
    opt.step()
    opt.zero_grad()
    return out


def two_forwards(m, call, opt, data, i):
    loss = call(*data[i]) + call(*data[(i + 1) % len(data)])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return [loss.item()]


class Boom(Exception):
    pass


def exception(m, call, opt, data, i):
    loss = call(*data[i])
    if i == 1:
        h = loss.register_hook(lambda g: (_ for _ in ()).throw(Boom()))
        try:
            loss.backward()
        except Boom:
            opt.zero_grad()
            h.remove()
            return [loss.item()]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return [loss.item()]


def hyper_between(m, call, opt, data, i):
    def set_lr(m, opt):
        for g in opt.param_groups:
            g["lr"] = LR * (0.5 + 0.25 * i)
        return []

    return step(m, call, opt, data, i, set_lr)


def clip_after_a_write(m, call, opt, data, i):
    """A gradient written in place between backward and the clip (an unscale by hand): the norm
    backward computed no longer holds."""

    def write_then_clip(m, opt):
        with torch.no_grad():
            m.blocks[-1].mlp.fc.weight.grad.mul_(1.5)  # in an offloaded chunk
        return [clip_grad_norm_(m.parameters(), 0.5).item()]

    return step(m, call, opt, data, i, write_then_clip)


def kept(m, call, opt, data, i):
    """A gradient monitor: the last step's ``p.grad`` list, kept across ``zero_grad()``, against
    this step's (their dot product and the kept ones' squared norm), as eager gives them: the kept
    gradients keep last step's values (protrain_fx/runtime/kept_grads.py)."""
    loss = call(*data[i])
    loss.backward()
    now = [p.grad for p in m.parameters()]
    out = [loss.item()]
    before = getattr(m, "_kept_grads", None)
    if before is not None:
        out.append(sum((a * b).sum() for a, b in zip(before, now)).item())
        out.append(sum(a.square().sum() for a in before).item())
    opt.step()
    opt.zero_grad()
    m._kept_grads = now
    return out


def two_losses_retained(m, call, opt, data, i):
    """Two losses over one graph, a backward each: the first keeps the graph
    (``retain_graph=True``), the second runs the whole backward again (its swapped block's
    activations come back from the host a second time)."""
    x, y = data[i]
    logits = call(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    aux = logits.float().pow(2).mean() * 0.01
    loss.backward(retain_graph=True)
    aux.backward()
    opt.step()
    opt.zero_grad()
    return [loss.item(), aux.item()]


def grads_edited(m, call, opt, data, i):
    """Gradients changed by hand between backward and step, past ``p.grad`` itself: one block's
    set to None (not stepped), one's halved through ``.data``, a row of one's doubled through a
    slice, the head's scaled with ``out=``."""

    def edit(m, opt):
        with torch.no_grad():
            for p in m.blocks[0].parameters():
                p.grad = None
            for p in m.blocks[1].parameters():
                p.grad.data.mul_(0.5)
            for p in m.blocks[2].parameters():
                p.grad[:1].mul_(2.0)
            for p in m.blocks[3].parameters():
                torch.mul(p.grad, 0.9, out=p.grad)
        return []

    return step(m, call, opt, data, i, edit)


CASES = {
    "plain": plain,
    "clip": clip,
    "clip_after_a_write": clip_after_a_write,
    "touch": touch,
    "two_forwards": two_forwards,
    "accumulate_and_clip": accumulate,
    "exception": exception,
    "lr_between_backward_and_step": hyper_between,
    "kept_across_zero_grad": kept,
    "two_losses_retained": two_losses_retained,
    "grads_edited": grads_edited,
}


def run_case(name: str, steps: int, regional: bool = False) -> dict:
    fn = CASES[name]
    torch._dynamo.reset()
    base = model()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(mine.parameters(), lr=LR)
    if regional:
        for b in mine.blocks:
            b.compile(backend="protrain", options={**OPTIONS, "optimizer": opt})
        call = mine
    else:
        call = torch.compile(mine, backend="protrain", options={**OPTIONS, "optimizer": opt})
    data = batches(steps + 1)
    t0 = time.perf_counter()
    ours, theirs = [], []
    for i in range(steps):
        theirs += fn(ref, ref, ref_opt, data, i)
        ours += fn(mine, call, opt, data, i)
    rs, ms = ref.state_dict(), mine.state_dict()
    return {
        "elements_off_by_half_a_step": _off(rs, ms),
        "case": name + (" (regional)" if regional else ""),
        "steps": steps,
        "max_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs)),
        "max_param_abs": max((rs[k] - ms[k]).abs().max().item() for k in rs),
        "max_update": max((rs[k] - base.state_dict()[k]).abs().max().item() for k in rs),
        "seconds": time.perf_counter() - t0,
    }


def _off(rs: dict, ms: dict) -> int:
    return sum(int(((rs[k] - ms[k]).abs() > LR / 2).sum()) for k in rs)


def run_rebuilt(variant: str, steps: int) -> dict:
    """The optimizer replaced at step 2 (protrain_fx/runtime/foreign_steps.py): ``old_alive``
    keeps the old one referenced (its in-backward steps taken back, the new one steps the
    offloaded parameters through their views), ``old_dropped`` drops it (freed at once; the new
    one takes the chunks over after its first step, its device state moved to the host);
    ``state_clear`` calls ``opt.state.clear()`` instead (fresh moments and step counts)."""
    from protrain_fx.runtime.hybrid_optim import handle_of

    torch._dynamo.reset()
    base = model()
    got = {}
    t0 = time.perf_counter()
    for kind in ("eager", "protrain"):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        call = m if kind == "eager" else torch.compile(m, backend="protrain", options=OPTIONS)
        kept, losses = [], []
        for i, (x, y) in enumerate(batches(steps)):
            if i == 2 and variant == "state_clear":
                opt.state.clear()
            elif i == 2:
                kept += [opt] if variant == "old_alive" else []
                opt = torch.optim.AdamW(m.parameters(), lr=LR)
            loss = call(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        got[kind] = (m.state_dict(), losses, handle_of(opt) is not None)
    (rs, theirs, _), (ms, ours, owned) = got["eager"], got["protrain"]
    return {
        "case": f"optimizer {variant}",
        "steps": steps,
        "max_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs)),
        "max_param_abs": max((rs[k] - ms[k]).abs().max().item() for k in rs),
        "max_update": max((rs[k] - base.state_dict()[k]).abs().max().item() for k in rs),
        # a second update of a parameter is ~lr on nearly every element: Inductor's rounding
        # against eager moves a few (gradients that are rounding noise, Adam-normalised)
        "elements_off_by_half_a_step": _off(rs, ms),
        "elements": sum(v.numel() for v in rs.values()),
        "protrain_steps_the_chunks": owned,
        "seconds": time.perf_counter() - t0,
    }


def served_norms(steps: int, micro: int = 1) -> dict:
    """Clipping every step: each offloaded gradient's 2-norm as ``clip_grad_norm_`` gets it (from
    backward, from the second step on) against ``torch.linalg.vector_norm`` of its view with the
    norms from backward turned off (read over the link). With ``micro`` backward passes a step,
    the norms are those of the sums added on the device."""
    from protrain_fx.runtime import hybrid_optim, mapped

    torch._dynamo.reset()
    mine = model()
    opt = torch.optim.AdamW(mine.parameters(), lr=LR)
    call = torch.compile(mine, backend="protrain", options={**OPTIONS, "optimizer": opt})
    equal = differ = 0
    data = batches(steps * micro)
    for i in range(steps):
        for x, y in data[i * micro : (i + 1) * micro]:
            call(x, y).backward()
        for p in mine.parameters():
            if i and isinstance(p.grad, mapped.HostGrad):
                got = torch.linalg.vector_norm(p.grad, 2)
                hook, mapped.HostGrad.cached_norm = mapped.HostGrad.cached_norm, None
                try:
                    read = torch.linalg.vector_norm(p.grad, 2)
                finally:
                    mapped.HostGrad.cached_norm = hook
                equal, differ = (
                    equal + torch.equal(got, read),
                    differ + (not torch.equal(got, read)),
                )
        clip_grad_norm_(mine.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    stores = hybrid_optim.handle_of(opt).stores
    served = sum(s.stats["grad_norms_served"] for s in stores)
    return {
        "case": "norms from backward" + (f" ({micro} micro-steps)" if micro > 1 else ""),
        "steps": steps,
        "served": served,
        "added_on_device": sum(s.stats.get("grad_adds_on_device", 0) for s in stores),
        "equal": equal,
        "differ": differ,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", help="comma-separated: run only these (case names, 'rebuilt')")
    args = ap.parse_args()
    if args.only:
        only = args.only.split(",")
        variants = ("old_alive", "old_dropped", "state_clear") if "rebuilt" in only else ()
        rows = [run_rebuilt(v, args.steps) for v in variants]
        rows += [run_case(n, args.steps) for n in only if n in CASES]
        for r in rows:
            print(json.dumps(r), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        return
    rows = []
    for name in CASES:
        rows.append(run_case(name, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(run_case("plain", args.steps, regional=True))
    print(json.dumps(rows[-1]), flush=True)
    for variant in ("old_alive", "old_dropped", "state_clear"):
        rows.append(run_rebuilt(variant, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(served_norms(args.steps))
    print(json.dumps(rows[-1]), flush=True)
    rows.append(served_norms(args.steps, micro=2))
    print(json.dumps(rows[-1]), flush=True)
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "options": OPTIONS,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
