"""protrain_fx.machine.cpu_adam: the one-pass CPU AdamW (+ bf16 transfer copy) against torch's
fused CPU Adam."""

import math

import pytest
import torch
from torch.optim.adam import adam

from protrain_fx.machine import cpu_adam

pytestmark = pytest.mark.skipif(
    not cpu_adam.available(), reason=f"kernel not built: {cpu_adam.build_error()}"
)


@pytest.mark.parametrize(
    "decoupled,wd,maximize", [(True, 0.1, False), (False, 0.05, False), (True, 0.0, True)]
)
def test_matches_torch_fused_adam_over_steps(decoupled, wd, maximize):
    torch.manual_seed(0)
    n = 100_003  # not a multiple of any vector width
    p = torch.randn(n)
    p_ref, m_ref, v_ref = p.clone(), torch.zeros(n), torch.zeros(n)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    step_ref = torch.tensor(0.0)
    for k in range(1, 7):
        g = torch.randn(n) * 10.0 ** (-k)
        lr = 1e-3 / k  # a schedule: hyperparameters are read per call
        adam(
            [p_ref],
            [g],
            [m_ref],
            [v_ref],
            [],
            [step_ref],
            foreach=False,
            fused=True,
            decoupled_weight_decay=decoupled,
            amsgrad=False,
            beta1=0.9,
            beta2=0.95,
            lr=lr,
            weight_decay=wd,
            eps=1e-8,
            maximize=maximize,
        )
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            out,
            float(k),
            lr=lr,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=wd,
            decoupled=decoupled,
            maximize=maximize,
        )
        # the transfer copy is exactly Tensor.to's rounding
        assert torch.equal(out, p.to(torch.bfloat16))
    assert float(step_ref) == 6.0
    # same operations in the same order as torch; a last-bit difference from vectorized vs scalar
    # fma contraction is allowed
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-12)
    assert (p != p_ref).float().mean() < 0.01


def test_bf16_copy_rounds_like_torch_including_specials():
    x = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            3.4e38,
            -0.0,
            1.00390625,
            1.01171875,
            3e-40,
            -2.5e-3,
            65504.0,
        ]
    )
    n = x.numel()
    out = torch.empty(n, dtype=torch.bfloat16)
    zeros = [torch.zeros(n) for _ in range(3)]
    # lr 0 and no decay: the parameter is unchanged and only copied
    cpu_adam.adam_step(
        x,
        *zeros,
        out,
        1.0,
        lr=0.0,
        beta1=0.9,
        beta2=0.95,
        eps=1.0,
        weight_decay=0.0,
        decoupled=True,
        maximize=False,
    )
    ref = x.to(torch.bfloat16)
    assert torch.isnan(out[0])
    assert torch.equal(out[1:].view(torch.int16), ref[1:].view(torch.int16))


def test_without_copy_and_bad_inputs():
    n = 1000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    p0 = p.clone()
    cpu_adam.adam_step(
        p,
        g,
        m,
        v,
        None,
        1.0,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        decoupled=True,
        maximize=False,
    )
    assert not torch.equal(p, p0)
    with pytest.raises(ValueError):
        cpu_adam.adam_step(
            p[::2],
            g[::2],
            m[::2],
            v[::2],
            None,
            1.0,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            decoupled=True,
            maximize=False,
        )
    with pytest.raises(ValueError):
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            torch.empty(n, dtype=torch.float16),
            1.0,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            decoupled=True,
            maximize=False,
        )


@pytest.mark.parametrize(
    "decoupled,wd,maximize",
    [(True, 0.1, False), (True, 0.0, True), (False, 0.05, False), (False, 0.0, True)],
)
def test_inverse_matches_the_float64_tensor_inverse(monkeypatch, decoupled, wd, maximize):
    """The kernel's take-back of a step (hybrid_optim's provisional steps) gives the values
    chunk_adam's float64 tensor code gives, bit for bit, moments at the clamp included; and it
    takes a kernel step back close to where it started (not exactly: rounding loses bits that no
    inverse recovers, most visibly in second moments near zero), moments that were zero exactly."""
    from protrain_fx.runtime import chunk_adam

    torch.manual_seed(0)
    n = 100_003
    p, m, v = torch.randn(n), torch.randn(n) * 1e-2, torch.rand(n) * 1e-4
    v[:100] = 0.0  # the clamp at zero
    m[100:300], v[100:300] = 0.0, 0.0  # elements first stepped now: their moments come back 0
    g = torch.randn(n) * 1e-2
    group = dict(
        betas=(0.9, 0.95),
        lr=3e-3,
        weight_decay=wd,
        eps=1e-8,
        maximize=maximize,
        decoupled_weight_decay=decoupled,
    )
    before = [x.clone() for x in (p, m, v)]
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    cpu_adam.adam_step(p, g, m, v, None, 7.0, decoupled=decoupled, maximize=maximize, **hp)
    with_kernel = [x.clone() for x in (p, m, v)]
    chunk_adam._adam_inverse(group, 7.0, with_kernel[0], g, with_kernel[1], with_kernel[2])
    monkeypatch.setattr(cpu_adam, "available", lambda: False)
    with_tensors = [x.clone() for x in (p, m, v)]
    chunk_adam._adam_inverse(group, 7.0, with_tensors[0], g, with_tensors[1], with_tensors[2])
    for a, b, orig in zip(with_kernel, with_tensors, before):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, orig, rtol=1e-5, atol=1e-8)
    # exactly: a rounding residue left there would grow into full updates at later steps
    assert not with_kernel[1][100:300].any() and not with_kernel[2][100:300].any()


def test_grad_scale_is_a_multiply_before_the_step():
    """``grad_scale`` (a clip's pending multiply, runtime/grad_scale.py): the same values as
    multiplying the gradient in float32 first, bit for bit, and the gradient left as it was."""
    torch.manual_seed(0)
    n = 100_003
    g = torch.randn(n) * 1e-2
    g[:3] = torch.tensor([float("inf"), -0.0, 3e-39])  # specials and a subnormal
    scale = torch.tensor(0.3183, dtype=torch.float32).item()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    p = torch.randn(n)
    states = [[p.clone(), torch.zeros(n), torch.zeros(n)] for _ in range(2)]
    outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    g0 = g.clone()
    cpu_adam.adam_step(
        *states[0][:1], g, *states[0][1:], outs[0], 1.0, grad_scale=scale, maximize=True, **hp
    )
    assert torch.equal(g, g0)
    cpu_adam.adam_step(*states[1][:1], g * scale, *states[1][1:], outs[1], 1.0, maximize=True, **hp)
    for a, b in zip(states[0] + outs[:1], states[1] + outs[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_guarded_step_leaves_elements_of_a_nonfinite_gradient_and_the_inverse_skips_them():
    """A provisional step (``guard``) meeting a NaN, inf or huge gradient leaves those elements as
    they were and counts them; the others are the unguarded step's bit for bit (which gives eager
    Adam's NaN there); the inverse takes the others back and leaves those (hybrid_optim's
    take-back of a step the loop then skips)."""
    torch.manual_seed(0)
    n = 5 * 16384 + 77
    p0, m0, v0 = torch.randn(n), torch.randn(n) * 1e-2, torch.rand(n) * 1e-4
    g = torch.randn(n)
    bad = torch.zeros(n, dtype=torch.bool)
    for i, x in ((16384 + 5, float("nan")), (4 * 16384 + 3, float("inf")), (n - 1, -3e19)):
        g[i], bad[i] = x, True
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    kw["maximize"] = False
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    assert cpu_adam.adam_step(p, g, m, v, out, 3.0, guard=True, **kw) == 3
    assert torch.equal(p[bad], p0[bad]) and torch.equal(m[bad], m0[bad])
    assert torch.equal(v[bad], v0[bad]) and torch.equal(out, p.to(torch.bfloat16))
    assert (p[~bad] != p0[~bad]).all()
    ref = [t.clone() for t in (p0, m0, v0)]
    assert cpu_adam.adam_step(ref[0], g, ref[1], ref[2], None, 3.0, **kw) == 0
    assert torch.equal(p[~bad], ref[0][~bad]) and torch.equal(m[~bad], ref[1][~bad])
    assert torch.isnan(ref[0][16384 + 5]) and torch.isnan(ref[0][4 * 16384 + 3])
    group = dict(betas=(0.9, 0.95), lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False)
    group["decoupled_weight_decay"] = True
    cpu_adam.adam_inverse(p, g, m, v, 3.0, group)
    assert torch.equal(p[bad], p0[bad]) and torch.isfinite(p).all() and torch.isfinite(m).all()
    torch.testing.assert_close(p, p0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m, m0, rtol=1e-4, atol=1e-7)


def _torch_adam_step(group, t, p, grad, m, v):
    """torch's single-tensor Adam step in float32 (L2 weight decay: not decoupled)."""
    b1, b2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    grad = grad.add(p, alpha=wd)
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def test_inverse_keeps_real_moments_at_an_l2_equilibrium():
    """Where the loss gradient balances L2 weight decay (their sum small against its terms), the
    take-back must not take real moments for rounding: none zeroed, and the next step as if the
    taken-back one never ran (a first rule zeroed 25-91% of the second moments here)."""
    from protrain_fx.runtime import chunk_adam

    torch.manual_seed(0)
    group = dict(
        betas=(0.9, 0.999),
        lr=1e-4,
        weight_decay=0.1,
        eps=1e-8,
        maximize=False,
        decoupled_weight_decay=False,
    )
    n = 100_000
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)

    def gradient(p):
        return -0.1 * p + torch.randn(n) * 1e-5

    for t in range(1, 301):
        _torch_adam_step(group, float(t), p, gradient(p), m, v)
    kept = [x.clone() for x in (p, m, v)]
    g = gradient(p)
    _torch_adam_step(group, 301.0, p, g, m, v)
    chunk_adam._adam_inverse(group, 301.0, p, g, m, v)
    assert not ((v == 0) & (kept[2] != 0)).any() and not ((m == 0) & (kept[1] != 0)).any()
    g2 = gradient(kept[0])
    _torch_adam_step(group, 301.0, *kept[:1], g2, *kept[1:])
    _torch_adam_step(group, 301.0, p, g2, m, v)
    assert (p - kept[0]).abs().max().item() < 1e-5  # lr 1e-4: a tenth of a step
