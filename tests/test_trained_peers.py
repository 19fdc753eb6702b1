"""Two trained models on one device shared by the process's graphs (protrain_fx/trained_peers.py):
a GAN's alternating loop, each model with its optimizer, compiled with protrain and no
``memory_budget``. The CPU is taken for a shared CUDA device (the ``shared_cpu`` fixture). The
model trained first took the device; the second's smallest plan did not fit in what was left and
its compile raised NoPlanFits. Now the first model's resident chunks move to the host and it plans
again. CPU, fp32, against eager PyTorch."""

import copy
import gc

import pytest
import torch
from hf_models import HF_VOCAB, hf_llama

import protrain_fx
from protrain_fx.errors import NoPlanFits
from protrain_fx.testing import random_batches


def data(n=4, seed=1):
    return [x for x, _ in random_batches(n, 2, 16, vocab=HF_VOCAB, seed=seed)]


def step(model, opt, x) -> float:
    """One training step with HF's own loss (``labels=``)."""
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_second_trained_model_makes_room_on_the_device_the_first_took(
    shared_cpu, monkeypatch, caplog
):
    """The generator's steps first (its plan takes the shared device: resident chunks with their
    Adam moments), then the discriminator's first call: its plan moves the generator's last
    resident chunks to the host, which plans again at its next call. Every loss as eager's; the
    two plans' resident states fit the device together. Without the room made, the second compile
    raises NoPlanFits (checked with make_room turned off)."""
    from protrain_fx import trained_peers

    def run(make_room: bool):
        if not make_room:
            monkeypatch.setattr(trained_peers, "make_room", lambda *a: None)
        # two architectures (one graph each; see the closing note on two of one shape)
        g_ref, d_ref = (
            hf_llama(seed=0),
            hf_llama(seed=1, num_hidden_layers=2, intermediate_size=1024),
        )
        g, d = copy.deepcopy(g_ref), copy.deepcopy(d_ref)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (g_ref, d_ref, g, d)]
        cg = torch.compile(g, backend="protrain", options={"compiler": "eager"})
        cd = torch.compile(d, backend="protrain", options={"compiler": "eager"})

        for x in data():
            for ref, mine in ((g_ref, cg), (d_ref, cd)):
                o_ref, o_mine = opts[0 if ref is g_ref else 1], opts[2 if ref is g_ref else 3]
                a, b = step(ref, o_ref, x), step(mine, o_mine, x)
                assert abs(a - b) <= 1e-5 * abs(a), (a, b)
        return cg, cd

    with caplog.at_level("WARNING", logger="protrain_fx"):
        cg, cd = run(True)
    g_plan, d_plan = protrain_fx.get_plan(cg), protrain_fx.get_plan(cd)
    made = [n for n in d_plan.notes if "of another trained model on this device moved" in n]
    assert len(made) == 1, d_plan.notes
    assert any("planning it again" in m for m in caplog.messages), caplog.messages

    # the generator planned again beside what the discriminator holds
    again = "re-planned: resident chunks moved to the host" in g_plan.notes
    assert again and "less 0 B allocated" not in g_plan.predicted["budget"], g_plan.predicted

    del cg, cd, g_plan, d_plan
    torch._dynamo.reset()
    gc.collect()  # the first run's models and stores go, as a new process's would
    with pytest.raises(Exception) as e:  # dynamo's BackendCompilerFailed around it
        run(False)
    cause = e.value
    while cause is not None and not isinstance(cause, NoPlanFits):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, e.value


def test_twins_of_one_shape_get_a_graph_each(shared_cpu, caplog):
    """Two HF Llamas of one configuration (seeds 0 and 1), each with its AdamW (other learning rates
    and betas): dynamo runs the first's graph for the second (one code object, the same guards).
    Before, the second ran that graph eagerly, none of its parameters placed (on a GPU its whole
    state on the device). Now the second gets a graph of its own, planned beside the first (its
    chunk stores, its optimizer); one line says so. Losses and parameters as eager's."""
    refs = [hf_llama(seed=0), hf_llama(seed=1)]
    mine = [copy.deepcopy(m) for m in refs]
    hyper = [dict(lr=1e-3), dict(lr=3e-3, betas=(0.8, 0.95))]
    o_refs = [torch.optim.AdamW(m.parameters(), **h) for m, h in zip(refs, hyper)]
    o_mine = [torch.optim.AdamW(m.parameters(), **h) for m, h in zip(mine, hyper)]
    compiled = [torch.compile(m, backend="protrain", options={"compiler": "eager"}) for m in mine]

    with caplog.at_level("WARNING", logger="protrain_fx"):
        for x in data():
            for k in (0, 1):
                a, b = step(refs[k], o_refs[k], x), step(compiled[k], o_mine[k], x)
                assert abs(a - b) <= 1e-5 * abs(a), (k, a, b)
    said = [m for m in caplog.messages if "another model of the same structure" in m]
    assert len(said) == 1, caplog.messages
    assert not [m for m in caplog.messages if "runs eagerly" in m], caplog.messages
    for k in (0, 1):
        assert protrain_fx.testing.stores_of(mine[k]), k
        for (name, p), q in zip(mine[k].named_parameters(), refs[k].parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5, msg=name)


def test_models_made_trained_and_deleted_in_turn_leave_no_graph_behind(shared_cpu):
    """A sweep's loop (a model of one configuration built, compiled, trained two steps and deleted,
    again and again): dynamo routes each new model through the first one's graph, which compiles a
    graph for it. Before, those graphs stayed when their models were freed (4 MiB of process
    memory a model); now the graph's entry goes with its model's parameters."""
    from protrain_fx.compiled_graph import ProtrainGraph

    def live_graphs():
        gc.collect()
        return [g for g in gc.get_objects() if isinstance(g, ProtrainGraph)]

    seen = []
    for seed in range(5):
        model = hf_llama(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend="protrain", options={"compiler": "eager"})
        for x in data(2):
            step(compiled, opt, x)
        del model, opt, compiled
        graphs = live_graphs()
        seen.append((len(graphs), sum(len(getattr(g, "instances", {})) for g in graphs)))
    assert seen[-1] == seen[1] and seen[-1][1] == 0, seen
