"""Model and optimizer features met outside (issues 19, 20): a param group that turns AMSGrad on
after the first step, a parameter that is not contiguous, one layer shared by two blocks. Each
trains an eager copy and a protrain copy with every chunk offloaded (or under an automatic plan
that offloads) and compares losses and parameters with eager PyTorch (CPU, fp32; test_habits's
Pair.check tolerances)."""

import copy
import re

import pytest
import torch
from hf_models import hf_llama, hf_loss_no_cache
from test_activations import BlockStack
from test_habits import hf_data, offload, parity

from protrain_fx.errors import ProtrainError

AUTO = {"memory_budget": 3_000_000, "compiler": "eager"}  # most chunks offloaded


def llama_untied():
    return hf_llama(tie_word_embeddings=False)


def hf_train_step(call, opt, x) -> float:
    """One step with HF's own loss (``use_cache=False``): backward, step, ``zero_grad()``."""
    loss = hf_loss_no_cache(call, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def doing_before(step: int, act):
    """A habit of plain steps, ``act(module, opts)`` run before step number ``step``."""

    def habit(call, module, opts, data):
        losses = []
        for i, (x, _) in enumerate(data):
            if i == step:
                act(module, opts)
            losses.append(hf_train_step(call, opts[0], x))
        return losses

    return habit


def _layer(model, k):
    return list(model.model.layers[k].parameters())


def _not_layer_1(model):
    skip = {id(p) for p in _layer(model, 1)}
    return [p for p in model.parameters() if id(p) not in skip]


@pytest.mark.parametrize("auto", [False, True], ids=["offloaded", "automatic"])
def test_a_param_group_with_amsgrad_added_after_the_first_step(auto):
    """The optimizer first holds every layer but one; after a step the loop adds that layer's
    parameters as a group of their own with amsgrad (its chunks were made without AMSGrad's
    maximum: before, torch's adam indexed a missing one)."""

    def add_group(module, opts):
        opts[0].add_param_group({"params": _layer(module, 1), "lr": 3e-2, "amsgrad": True})

    base = llama_untied()
    pair = parity(
        base,
        AUTO if auto else offload(base),
        habit=doing_before(1, add_group),
        data=hf_data(n=4),
        make_opts=lambda m: [torch.optim.AdamW(_not_layer_1(m), lr=1e-2)],
    )
    pair.check()
    ref_state = pair.ref_opts[0].state_dict()["state"]
    state = pair.opts[0].state_dict()["state"]
    maxima = [k for k, s in ref_state.items() if "max_exp_avg_sq" in s]
    assert maxima
    for k in maxima:
        torch.testing.assert_close(state[k]["max_exp_avg_sq"], ref_state[k]["max_exp_avg_sq"])


def test_an_amsgrad_checkpoint_loaded_after_a_step():
    """A run resumed after one step from an AdamW(amsgrad=True) checkpoint into an optimizer made
    without it: the loaded groups turn AMSGrad on and the loaded maxima are kept."""
    base = llama_untied()
    data = hf_data(n=4)
    src = copy.deepcopy(base)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2, amsgrad=True)
    for x, _ in data[:2]:
        hf_loss_no_cache(src, x).backward()
        src_opt.step()
        src_opt.zero_grad()
    saved = copy.deepcopy(src.state_dict()), copy.deepcopy(src_opt.state_dict())

    def resume(module, opts):
        module.load_state_dict(saved[0])
        opts[0].load_state_dict(copy.deepcopy(saved[1]))

    pair = parity(base, offload(base), habit=doing_before(1, resume), data=data)
    pair.check()
    ref_state = pair.ref_opts[0].state_dict()["state"]
    state = pair.opts[0].state_dict()["state"]
    for k, s in ref_state.items():
        torch.testing.assert_close(state[k]["max_exp_avg_sq"], s["max_exp_avg_sq"])


@pytest.mark.parametrize(
    "case", ["offloaded-eager", "offloaded-inductor", "automatic"], ids=lambda c: c
)
def test_a_parameter_that_is_not_contiguous(case, caplog):
    """The untied head's weight stored transposed (as ``load_state_dict(assign=True)`` of a
    converted checkpoint leaves it): before, placing it in a chunk inside the compile of the frame
    that traced it failed dynamo's check of its own stride guards (an AssertionError)."""
    base = llama_untied()
    with torch.no_grad():
        w = base.lm_head.weight
        base.lm_head.weight = torch.nn.Parameter(w.t().contiguous().t())
    assert not base.lm_head.weight.is_contiguous()
    options = {
        "offloaded-eager": lambda: offload(base),
        "offloaded-inductor": lambda: offload(base, compiler="inductor"),
        "automatic": lambda: AUTO,
    }[case]()
    loss_fn = lambda call, x, y: hf_loss_no_cache(call, x)  # noqa: E731
    with caplog.at_level("WARNING", logger="protrain_fx"):
        pair = parity(base, options, data=hf_data(n=3), loss_fn=loss_fn)
    tol = {} if case == "offloaded-eager" else {"param_abs": 2e-3}
    pair.check(**tol)
    assert pair.mine.lm_head.weight.is_contiguous()
    assert sum("not contiguous, lm_head.weight" in m for m in caplog.messages) == 1


@pytest.mark.parametrize("auto", [False, True], ids=["offloaded", "automatic"])
@pytest.mark.parametrize("sharing", ["two", "all", "pairs"])
def test_a_linear_shared_by_blocks(auto, sharing):
    """One ``nn.Linear`` used by several decoder layers (two of them, all four, or ALBERT-like
    pairs 0-1 and 2-3): compiled in regions, a later layer's region reused the code of a region
    whose chunks hold the shared weight, or of another region that found it placed ('protrain
    internal error: ... bound to parameters laid out otherwise'); a region that finds some of its
    parameters placed now gets a code of its own."""
    base = llama_untied()
    layers = base.model.layers
    groups = {"two": [(0, 1)], "all": [(0, 1, 2, 3)], "pairs": [(0, 1), (2, 3)]}[sharing]
    for group in groups:
        for k in group[1:]:
            layers[k].mlp.up_proj = layers[group[0]].mlp.up_proj
    loss_fn = lambda call, x, y: hf_loss_no_cache(call, x)  # noqa: E731
    pair = parity(base, AUTO if auto else offload(base), data=hf_data(n=3), loss_fn=loss_fn)
    pair.check()
    mine = pair.mine.model.layers
    assert all(mine[k].mlp.up_proj is mine[g[0]].mlp.up_proj for g in groups for k in g)


def _xy_steps(call, module, opts, data):
    """Plain steps of a model called ``(x, y)`` that returns its loss."""
    out = []
    for x, y in data:
        loss = call(x, y)
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        out.append(loss.item())
    return out


class _RenormedEmbedding(torch.nn.Module):
    """``nn.Embedding(max_norm=...)`` (renormalizes the rows it reads in place, in forward), two
    linear layers and a loss."""

    def __init__(self, vocab=256, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, max_norm=1.0)
        self.fc, self.head = torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        return torch.nn.functional.cross_entropy(
            self.head(h + self.fc(h)).flatten(0, 1), y.flatten()
        )


@pytest.mark.parametrize("plan", ["resident", "offloaded", "automatic"])
def test_a_parameter_written_in_place_in_forward(plan):
    """A parameter the forward writes in place: with its chunk on the device it trains as in eager;
    offloaded, the write landed in the gathered device copy and was lost (a weight halved in forward
    stayed whole: the next loss was the last one's), or ``nn.Embedding(max_norm=...)`` failed in
    backward with autograd's "modified by an inplace operation". Now a ProtrainError naming the
    parameter, before the first step, whose advice (the chunk kept on the device) trains."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _RenormedEmbedding()
    options = {
        "resident": {"compiler": "eager"},
        "offloaded": {"compiler": "eager", "n_persist": 0, "chunk_size": 70_000},
        "automatic": {"compiler": "eager", "memory_budget": 200_000},
    }[plan]
    data = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(3)]

    if plan != "resident":
        with pytest.raises(ProtrainError, match="writes parameter 'emb.weight' in place") as e:
            parity(base, options, habit=_xy_steps, data=data)
        if plan == "automatic":
            return
        # what the message says to do trains
        torch._dynamo.reset()
        options["n_persist"] = int(re.search(r"n_persist >= (\d+)", str(e.value)).group(1))
    pair = parity(base, options, habit=_xy_steps, data=data)
    pair.check()
    assert torch.equal(pair.mine.emb.weight, pair.ref.emb.weight)


class _ConvNet(torch.nn.Module):
    """A patch embedding (a ViT's ``Conv2d``) before a linear head."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Linear(16, 10)

    def forward(self, x, y):
        h = torch.nn.functional.relu(self.conv(x)).mean((2, 3))
        return torch.nn.functional.cross_entropy(self.fc(h), y)


def test_an_offloaded_conv_weight_under_inductor():
    """Inductor's layout optimization handed protrain's ops a channels-last copy of an offloaded
    ``Conv2d`` weight instead of the parameter ("protrain internal error: ... a parameter that
    belongs to no chunk store"); protrain's compiles turn it off."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(3)]

    pair = parity(_ConvNet(), {"n_persist": 0, "chunk_size": 2000}, habit=_xy_steps, data=data)
    pair.check()


class _SpectralBlock(torch.nn.Module):
    """A block with a spectral-normed layer: its power iteration updates the buffers ``_u``/``_v``
    in place in forward, and assigns ``_u`` back to the module (``self._u = F.normalize(...,
    out=self._u)``)."""

    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(d, d))
        self.fc2 = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def test_spectral_norm_under_an_automatic_plan():
    """Under an automatic plan the buffer ``_u`` that dynamo assigns back from the graph's output
    became an output of protrain's redoable call, requiring a gradient: dynamo compiled again and
    the next ``backward()`` raised "trying to backward through the graph a second time". It stays
    the buffer it was; losses, parameters and buffers as eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    data = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(3)]
    options = {"compiler": "eager", "memory_budget": 700_000}
    pair = parity(BlockStack(_SpectralBlock, vocab=256, d=64), options, habit=_xy_steps, data=data)
    pair.check()
    u = pair.mine.blocks[0].fc1.parametrizations.weight[0]._u
    assert not u.requires_grad
    torch.testing.assert_close(u, pair.ref.blocks[0].fc1.parametrizations.weight[0]._u)
