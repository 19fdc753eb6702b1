"""Ordinary training habits through backend="protrain" must train exactly like eager PyTorch (issues
19, 20).

Every test trains an eager copy and a protrain copy of one model (deepcopied before compiling) on
the same data with the same habit, CPU, fp32, AdamW lr 1e-2 (one wrong step is far above the
tolerances), and checks: per-step losses within 1e-5 relative, every state_dict() entry within 1e-3
absolute, and that training really moved the parameters (max update > 1e-4). What protrain cannot do
exactly must be a ProtrainError.
"""

# Bound before anything imports protrain_fx (issue 20.4: clipping however it is called).
from torch.nn.utils import clip_grad_norm_  # isort: skip

import copy
import functools
import gc
import math
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from hf_models import (
    HF_VOCAB,
    hf_gpt2,
    hf_llama,
    hf_loss,
    hf_loss_no_cache,
    largest_param_bytes,
)
from models import GPT, GPTBlock, GPTConfig, build

import protrain_fx
from protrain_fx.testing import random_batches, steps_with, stores_of

LR = 1e-2
LOSS_REL, PARAM_ABS, MIN_UPDATE = 1e-5, 1e-3, 1e-4
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)


# ------------------------------------------------------------------------------------------------
# helpers
def gpt(n_layer=2, **kw):
    torch.manual_seed(0)
    return build("gpt", n_layer=n_layer, n_embd=32, n_head=2, block_size=32, **kw)


def gpt_loss(model, x, y):
    return model(x, y)


def adamw(params, lr=LR, **kw):
    kw = {"weight_decay": 0.1, "betas": (0.9, 0.95), **kw}
    return torch.optim.AdamW(params, lr=lr, **kw)


def gpt_data(n=3, seq=16, seed=0):
    return random_batches(n, 2, seq, vocab=256, seed=seed)


def hf_data(n=3, seq=16, seed=0):
    return random_batches(n, 2, seq, vocab=HF_VOCAB, seed=seed)


def offload(model, compiler="eager", **extra):
    """Every chunk on the host (chunk_size: the largest parameter, rounded up)."""
    chunk = -(-largest_param_bytes(model) // 1000) * 1000
    return {"compiler": compiler, "n_persist": 0, "chunk_size": chunk, **extra}


def resident(compiler="eager", **extra):
    return {"compiler": compiler, **extra}


def whole(model, options):
    return torch.compile(model, backend="protrain", options=options)


def regional(container: str):
    """Regional compilation: each block of ``model.<container>`` compiled on its own, the rest
    eager."""

    def compile_blocks(model, options):
        blocks = model.get_submodule(container)
        for b in blocks:
            b.compile(backend="protrain", options=options)
        return model

    return compile_blocks


def plain_step(call, module, opts, data, loss_fn):
    return steps_with(call, opts, data, loss_fn)


def sd_diff(a, b):
    return max(
        (a[k].detach().double().cpu() - b[k].detach().double().cpu()).abs().max().item() for k in b
    )


def rel_err(xs, ys):
    assert len(xs) == len(ys), (xs, ys)
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(xs, ys)), default=0.0)


class Pair:
    """The outcome of training an eager copy (``ref``) and a protrain copy (``mine``) with one
    habit."""

    def __init__(self, base, ref, mine, compiled, ref_opts, opts, ref_trace, trace):
        self.base, self.ref, self.mine, self.compiled = base, ref, mine, compiled
        self.ref_opts, self.opts, self.ref_trace, self.trace = ref_opts, opts, ref_trace, trace

    def check(self, loss_rel=LOSS_REL, param_abs=PARAM_ABS, min_update=MIN_UPDATE):
        assert rel_err(self.trace, self.ref_trace) <= loss_rel, (self.trace, self.ref_trace)
        base_sd, ref_sd, mine_sd = (
            self.base.state_dict(),
            self.ref.state_dict(),
            self.mine.state_dict(),
        )
        assert set(mine_sd) == set(ref_sd)
        update = sd_diff(ref_sd, base_sd)
        assert update > min_update, f"eager training did not move the parameters ({update})"
        diff = sd_diff(mine_sd, ref_sd)
        worst = max(
            ref_sd, key=lambda k: (mine_sd[k].double() - ref_sd[k].double()).abs().max().item()
        )
        _report(loss_rel=rel_err(self.trace, self.ref_trace), param_abs=diff, update=update)
        assert diff <= param_abs, f"parameters differ from eager by {diff:.3g} (worst: {worst})"
        return self


def _report(**numbers):
    """With PARITY_REPORT=<file> (a harness variable, not protrain's), each check appends its
    numbers as one JSON line named by the test: the closing notes quote them."""
    path = os.environ.get("PARITY_REPORT")
    if path:
        import json

        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **numbers}) + "\n")


def parity(
    base,
    options,
    *,
    habit=None,
    data=None,
    loss_fn=gpt_loss,
    make_opts=None,
    compile_fn=whole,
    give_optimizer=True,
):
    """Train a deepcopy of ``base`` eagerly and another through protrain with the same ``habit(call,
    module, opts, data)`` (it returns the numbers to compare, usually the losses).
    ``make_opts(module)`` builds the optimizers (a list); the first is protrain's
    ``options["optimizer"]``."""
    habit = habit or (lambda c, m, o, d: plain_step(c, m, o, d, loss_fn))
    make_opts = make_opts or (lambda m: [adamw(m.parameters())])
    data = data if data is not None else gpt_data()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opts, opts = make_opts(ref), make_opts(mine)
    options = dict(options)
    if give_optimizer:
        options["optimizer"] = opts[0]
    compiled = compile_fn(mine, options)
    ref_trace = habit(ref, ref, ref_opts, data)
    trace = habit(compiled, mine, opts, data)
    return Pair(base, ref, mine, compiled, ref_opts, opts, ref_trace, trace)


def placements(compiled):
    return [c["placement"] for c in protrain_fx.get_plan(compiled).to_dict()["chunks"]]


CHILD_ENV = "PROTRAIN_HABITS_CHILD"


def isolated(test):
    """Run the test in a child pytest process: a crash of the interpreter (today: segfaults on
    offloaded shells) fails this one test instead of ending the session. The child runs the body
    itself. Under pytest-xdist (scripts/test.sh runs ``-n auto``) the worker process is already that
    isolation: a worker that crashes fails the test it was running (xdist reports "worker crashed
    while running" it) and is replaced, and the session goes on; so there the body runs in the
    worker, without the child's start-up (a new interpreter importing torch, transformers and
    protrain, and compiling from cold: 8-20 s per test)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(CHILD_ENV) == "1" or os.environ.get("PYTEST_XDIST_WORKER"):
            return test(*args, **kwargs)
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "--tb=short",
                nodeid,
            ],
            cwd=ROOT,
            env={**os.environ, CHILD_ENV: "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            crashed = proc.returncode < 0 or "Fatal Python error" in out
            pytest.fail(
                f"{nodeid} {'CRASHED' if crashed else 'failed'} in its child process (exit "
                f"{proc.returncode}):\n{_summarize(out)}",
                pytrace=False,
            )

    return run


def _summarize(out: str) -> str:
    """The interesting part of a child's output: the error lines, or a fatal error and its
    innermost frames."""
    if "Fatal Python error" in out:
        i = out.index("Fatal Python error")
        head = out[i:].splitlines()[0]
        threads = out[i:].split("\n\n")  # faulthandler: one block per thread
        mine = next((t for t in threads if "Current thread" in t), None) or next(
            (t for t in threads if "test_habits.py" in t), ""
        )
        frames = [f for f in mine.splitlines()[1:] if "_pytest" not in f and "pluggy" not in f][:10]
        return "\n".join([head, "innermost frames of the crashed thread:"] + frames)
    lines = [
        l
        for l in out.splitlines()
        if (
            l.startswith("E ")
            and re.search(r"Error|Exception|assert|Failed", l)
            and 'File "' not in l
        )
        or l.startswith("FAILED")
    ]
    return "\n".join(lines[:30]) or out[-4000:]


# ======================================================================================= issue 19
# ---------------------------------------------------------------- 19.1 regional compilation, graph
# breaks
class BreakingBlock(GPTBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.ln2(x))


class BreakingGPT(GPT):
    """Our GPT with a graph break inside every block's forward (and so inside the block loop)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        torch.manual_seed(1)
        self.blocks = torch.nn.ModuleList(BreakingBlock(cfg) for _ in range(cfg.n_layer))
        self.apply(self._init_weights)


def breaking_gpt(n_layer=2):
    torch.manual_seed(0)
    return BreakingGPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=32))


@pytest.mark.parametrize("placement", ["offloaded", "resident"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_19_1_regional_compilation_gpt(placement, kind):
    torch.manual_seed(0)
    base = (
        gpt(n_layer=3)
        if kind == "gpt"
        else build("llama", n_layer=3, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, max_seq_len=32)
    )
    opts = offload(base) if placement == "offloaded" else resident()
    p = parity(base, opts, compile_fn=regional("blocks")).check()
    if placement == "offloaded":
        assert "host" in placements(p.mine.blocks[0])


@pytest.mark.parametrize(
    "placement,use_cache", [("offloaded", False), ("resident", False), ("offloaded", True)]
)
def test_19_1_regional_compilation_hf_llama(placement, use_cache):
    """``use_cache=False`` (usual in training) lets dynamo reuse one graph for all decoder layers;
    with the default KV cache every layer guards on its own ``layer_idx`` and gets a graph of its
    own."""
    base = hf_llama()
    opts = offload(base) if placement == "offloaded" else resident()
    loss_fn = hf_loss if use_cache else hf_loss_no_cache
    parity(base, opts, compile_fn=regional("model.layers"), loss_fn=loss_fn, data=hf_data()).check()


def test_19_1_regional_compilation_under_a_budget_the_blocks_share():
    """Eight decoder layers compiled one by one under a 8 MiB budget (their fp32 weights alone are
    18 MiB): each layer's plan takes 1/8 of what is left once the eagerly trained embedding's
    gradient and moments are taken out, and counts 1/8 of what the layers share (the chunk and
    gradient buffers of one chunk size, the working set of the layer running). Before, each layer
    counted the shared buffers and working set whole: no plan fitted (the smallest needed 2.61 MiB
    a layer, 22 MiB in all). Losses and weights as eager's, the chunks on the host."""
    base = hf_llama(num_hidden_layers=8, hidden_size=256, intermediate_size=512)
    p = parity(
        base,
        {"compiler": "eager", "memory_budget": 8 << 20},
        compile_fn=regional("model.layers"),
        loss_fn=hf_loss_no_cache,
        data=hf_data(seq=32),
    ).check()
    plan = protrain_fx.get_plan(p.mine.model.layers[0])
    assert "divided by the 8 blocks" in plan.predicted["budget"], plan.predicted["budget"]
    assert plan.predicted["peak_bytes"] <= plan.predicted["budget_bytes"] < 1 << 20
    assert "(one of 8 blocks compiled alike: " in plan.summary(), plan.summary()
    assert "host" in placements(p.mine.model.layers[0])


def test_19_1_blocks_compiled_by_replacing_them_share_the_budget_as_compiled_in_place():
    """``layers[i] = torch.compile(layers[i], ...)`` puts each block inside torch.compile's
    wrapper, which sits in the list: each block's plan was chosen for the whole budget, as if it
    were the model (8 blocks, 8 budgets); now it takes its share, as ``layer.compile()`` does."""
    base = hf_llama(num_hidden_layers=8, hidden_size=256, intermediate_size=512)

    def replaced(model, options):
        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i], backend="protrain", options=options)
        return model

    budgets = {}
    for how, compile_fn in (("method", regional("model.layers")), ("replace", replaced)):
        p = parity(
            base,
            {"compiler": "eager", "memory_budget": 8 << 20},
            compile_fn=compile_fn,
            loss_fn=hf_loss_no_cache,
            data=hf_data(seq=32),
        )
        assert rel_err(p.trace, p.ref_trace) <= LOSS_REL, (p.trace, p.ref_trace)
        mine = {k.replace("._orig_mod", ""): v for k, v in p.mine.state_dict().items()}
        assert sd_diff(mine, p.ref.state_dict()) <= PARAM_ABS
        budgets[how] = protrain_fx.get_plan(p.mine.model.layers[0]).predicted
        assert "host" in placements(p.mine.model.layers[0])
    assert "divided by the 8 blocks" in budgets["replace"]["budget"], budgets["replace"]["budget"]
    assert budgets["replace"]["budget_bytes"] == budgets["method"]["budget_bytes"]


def test_19_1_regional_compilation_of_a_host_init_model(caplog):
    """Built under ``host_init`` (every parameter an empty shell, its value on the host), its
    decoder layers compiled one by one: the embedding, final norm and tied head run eagerly, where
    they read their shells (before: ``setStorage ... out of bounds for storage of size 0`` at the
    first forward, found on an H100 by benchmarks/distill.py's ``regional`` row). Their values go
    to the device at their first eager call (one line says so); losses and parameters as eager's,
    the layers' chunks offloaded."""
    import transformers
    from hf_models import llama_config

    from protrain_fx.runtime.param_values import HOST_VALUES

    ref = hf_llama(seed=0)
    with protrain_fx.host_init("cpu"):
        model = transformers.LlamaForCausalLM(llama_config()).train()
    model.load_state_dict(ref.state_dict())
    assert all(p in HOST_VALUES for p in model.parameters())
    for layer in model.model.layers:
        layer.compile(backend="protrain", options=offload(ref))
    o_ref, o_mine = adamw(ref.parameters()), adamw(model.parameters())
    expected, losses = [], []
    with caplog.at_level("WARNING", logger="protrain_fx"):
        for x, _ in hf_data():
            for m, o, out in ((ref, o_ref, expected), (model, o_mine, losses)):
                loss = hf_loss_no_cache(m, x)
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    said = [m for m in caplog.messages if "built under host_init" in m]
    assert len(said) == 1 and "Embedding" in said[0], caplog.messages
    assert model.model.embed_tokens.weight not in HOST_VALUES
    assert "host" in placements(model.model.layers[0])
    mine = {k: v for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(mine[k], v, rtol=0, atol=1e-5, msg=k)


def test_19_1_regional_compilation_offloaded_inductor():
    # Inductor's own caches as a user has them (on). A rare 3.46e-5 loss difference here was the
    # in-backward CPU step finishing while the chunk's slot was reserved (see
    # tests/test_runtime_hazards.py::test_regional_inductor_with_the_worker_ahead, which forces it).
    base = gpt(n_layer=2)
    parity(base, offload(base, compiler="inductor"), compile_fn=regional("blocks")).check()


class BreakBeforeHeadGPT(GPT):
    """Our GPT with a graph break between its blocks and its head (as transformers 5's output
    capture makes before an MoE model's head when ``output_router_logits=True``)."""

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        torch._dynamo.graph_break()
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def test_19_1_graph_break_before_the_head_plan_shown_is_the_bodys():
    """Two graphs, the body (blocks) and the head: both trained as eager does, and ``get_plan``
    gives the body's plan (the one holding most parameters, not the newest graph, the head's),
    whose summary names the other graph."""
    torch.manual_seed(0)
    base = BreakBeforeHeadGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=32))
    p = parity(base, offload(base)).check()
    plan = protrain_fx.get_plan(p.compiled)
    assert len(plan.blocks) == 3 and any(
        n.startswith("blocks.0.") for c in plan.chunks for n in c.params
    )
    assert len(plan.other_graphs) == 1 and "0 blocks" in plan.other_graphs[0], plan.other_graphs
    assert "this model runs 2 compiled graphs" in plan.summary()


@pytest.mark.parametrize("placement", ["offloaded", "resident"])
def test_19_1_graph_break_inside_block_loop(placement):
    base = breaking_gpt()
    opts = offload(base) if placement == "offloaded" else resident()
    parity(base, opts).check()


# ------------------------------------------------------- 19.2 a chunk buffer read after it was
# reused
def hf_step(call, opt, x) -> float:
    """One training step with HF's own loss (labels=): backward, ``opt.step()``, ``zero_grad()``;
    the loss."""
    loss = hf_loss(call, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_and_eval(call, module, opts, data):
    """HF's own loss (labels=); after every step an evaluation of ``data[-1]`` in eval mode under
    torch.no_grad(). Returns train and eval losses interleaved."""
    trace = []
    *train, (x_eval, _) = data
    for x, _ in train:
        trace.append(hf_step(call, opts[0], x))
        module.eval()
        with torch.no_grad():
            trace.append(hf_loss(call, x_eval).item())
        module.train()
    return trace


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_19_2_hf_llama_labels_and_no_grad_eval_offloaded(compiler):
    base = hf_llama()
    p = parity(base, offload(base, compiler=compiler), habit=train_and_eval, data=hf_data(4))
    assert set(placements(p.compiled)) == {"host"}
    train, ref_train = p.trace[0::2], p.ref_trace[0::2]
    evals, ref_evals = p.trace[1::2], p.ref_trace[1::2]
    assert rel_err(train[:1], ref_train[:1]) <= LOSS_REL, (
        "the first forward already differs",
        train,
        ref_train,
    )
    assert rel_err(train, ref_train) <= LOSS_REL, ("train losses", train, ref_train)
    assert rel_err(evals, ref_evals) <= LOSS_REL, ("no_grad eval losses", evals, ref_evals)
    p.check()


def auto_planned(model):
    """``model`` under the automatic plan at a 3 MB budget (the HF Llama's chunks mostly on the
    host), eager compiler, with its AdamW: (compiled, optimizer)."""
    opt = adamw(model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "optimizer": opt, "memory_budget": 3_000_000},
    )
    return compiled, opt


def test_19_2_plan_after_a_no_grad_eval_is_the_training_plan():
    """An evaluation under torch.no_grad() compiles one more graph (compiled in regions), which runs
    on the chunks the automatic plan placed for training. ``get_plan(model)`` still returns the
    training graph's plan, and the evaluation graph's own plan describes those chunks as they are
    (it reported every chunk resident, with the automatic plan's chunks on the host)."""
    from protrain_fx.runtime.chunk_store import store_of

    model = hf_llama()
    compiled, opt = auto_planned(model)
    (x, _), (x_eval, _) = hf_data(2)
    hf_loss(compiled, x).backward()
    opt.step()
    opt.zero_grad()
    trained = protrain_fx.get_plan(compiled)
    assert "host" in placements(compiled) and "device" in placements(compiled), placements(compiled)
    model.eval()
    with torch.no_grad():
        hf_loss(compiled, x_eval)
    assert protrain_fx.get_plan(compiled) is trained
    evaluation = protrain_fx.get_plan()  # the newest plan of all: the evaluation graph's
    assert evaluation is not trained and evaluation.inference and not trained.inference
    params = dict(model.named_parameters())
    for plan in (trained, evaluation):
        for chunk in plan.chunks:
            on_host = {store_of(params[n]).param_is_offloaded(params[n]) for n in chunk.params}
            assert on_host == {chunk.placement == "host"}, (plan.graph_name, chunk)
        assert plan.n_persist == sum(c.placement == "device" for c in plan.chunks)
    assert [c.placement for c in evaluation.chunks] == [c.placement for c in trained.chunks]


def eval_first(grad_mode):
    """HF's own loss; an evaluation in eval mode under ``grad_mode`` before every step, the first
    before the model ever trained (its graph is placed first, protrain_fx/inference_placement.py).
    Returns eval and train losses interleaved."""

    def habit(call, module, opts, data):
        trace = []
        for x, _ in data:
            module.eval()
            with grad_mode():
                trace.append(hf_loss(call, x).item())
            module.train()
            trace.append(hf_step(call, opts[0], x))
        return trace

    return habit


@pytest.mark.parametrize(
    "grad_mode, budget",
    [(torch.no_grad, 1.5e6), (torch.inference_mode, 1.5e6), (torch.inference_mode, 3e6)],
)
def test_19_2_an_evaluation_before_the_first_step_leaves_the_training_plan_what_it_needs(
    grad_mode, budget
):
    """Evaluated first under a budget that forces offloading, the HF Llama's chunks are placed for
    the evaluation (some resident), then its training graph is planned beside that placement.
    Under ``torch.inference_mode()`` the chunk buffers the evaluation made were inference tensors
    that training could not fill at 3 MB ("Inplace update to inference tensor outside
    InferenceMode"); and the training graph was profiled and planned beside the evaluation's
    resident chunks, its profile counting views of them as block activations, so at 1.5 MB, where
    training alone plans and trains, no plan fitted (NoPlanFits naming 1.53 MiB)."""
    base = hf_llama()
    options = {"compiler": "eager", "memory_budget": int(budget)}
    p = parity(base, options, habit=eval_first(grad_mode), data=hf_data(3))
    assert "host" in placements(p.compiled)
    p.check()
    # the evaluation's placement was released, so that the training plan placed the parameters
    # afresh (the optimizer was attached to the stores made for the evaluation's repeated blocks,
    # which kept them)
    notes = protrain_fx.get_plan(p.compiled).notes
    assert any("without gradients made" in n and "released" in n for n in notes), notes


def seeded_steps(call, module, opts, data):
    """HF's own loss, each step after ``torch.manual_seed(step)``: dropout draws the same masks in
    the eager and the protrain run when protrain draws them as eager does."""
    losses = []
    for step, (x, _) in enumerate(data):
        torch.manual_seed(100 + step)
        losses.append(hf_step(call, opts[0], x))
    return losses


@pytest.mark.parametrize("policy", [dict(n_checkpoint=2), dict(n_swap=2)])
def test_19_2_hf_gpt2_dropout_inductor_like_eager(policy):
    """GPT-2 as transformers builds it (dropout 0.1) through Inductor, every chunk offloaded and
    every block recomputed (or swapped): the same losses and parameters as eager. Inductor's own
    random streams (torch.compile's default) gave other masks: 6e-3 relative off eager's loss; and
    the recomputed blocks must redraw the masks their forward drew."""
    base = hf_gpt2()
    p = parity(
        base, offload(base, compiler="inductor", **policy), habit=seeded_steps, data=hf_data(3)
    )
    assert set(placements(p.compiled)) == {"host"}
    p.check()


def two_lengths(call, module, opts, data):
    """Gradient accumulation over micro-batches of two sequence lengths (the second makes dynamo
    compile a dynamic graph), clipped, then one step."""
    losses = []
    for x, _ in data:
        for seq in (16, 12):
            loss = hf_loss(call, x[:, :seq])
            (loss / 2).backward()
            losses.append(loss.item())
        clip_grad_norm_(module.parameters(), 1.0)
        opts[0].step()
        opts[0].zero_grad()
    return losses


def test_19_6_dynamic_shapes_inductor_plan_without_swap():
    """Two sequence lengths through Inductor: the automatic plan of the dynamic graph swaps no
    block (Inductor's backward of a swapped block asserted the first shape's strides there and
    failed), says so, and trains like eager; swap asked for by hand on a dynamic graph is a
    ProtrainError that says what to do, raised before the model is touched."""
    base = hf_llama()
    p = parity(
        base,
        {"compiler": "inductor", "memory_budget": 3_000_000},
        habit=two_lengths,
        data=hf_data(2),
    )
    plan = protrain_fx.get_plan(p.compiled)
    assert plan.n_swap == 0 and any("dynamic shapes" in n for n in plan.notes), plan.notes
    p.check()

    model = hf_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(
        model,
        dynamic=True,
        backend="protrain",
        options={"compiler": "inductor", "n_persist": 0, "n_swap": 2, "n_checkpoint": 0},
    )
    ((x, _),) = hf_data(1)
    with pytest.raises(Exception, match="n_swap=2 with dynamic shapes.*dynamic=False"):
        hf_loss(compiled, x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" and p.untyped_storage().size() for p in model.parameters())


# ------------------------------------------------------------- 19.3 touching an offloaded parameter
def trained_pair(n_steps=2, **extra):
    """An eager GPT and a protrain copy with every chunk on the host, each trained ``n_steps``."""
    p = parity(gpt(), offload(gpt(), **extra), data=gpt_data(n_steps))
    assert set(placements(p.compiled)) == {"host"}
    return p


def printed_numbers(text):
    return [float(v) for v in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", text)]


@isolated  # today: segfault
def test_19_3_reading_an_offloaded_parameter(capsys):
    p = trained_pair().check()
    for name in ("blocks.0.mlp.fc.weight", "ln_f.weight"):
        mine, ref = p.mine.get_parameter(name), p.ref.get_parameter(name)
        assert math.isclose(mine.norm().item(), ref.norm().item(), rel_tol=1e-5), name
        assert math.isclose(mine.sum().item(), ref.sum().item(), rel_tol=1e-4, abs_tol=1e-5), name
        assert math.isclose(
            mine.detach().abs().max().item(), ref.detach().abs().max().item(), rel_tol=1e-5
        ), name
        print(mine)
        printed = capsys.readouterr().out
        text, ref_text = repr(mine), repr(ref)
        assert printed.strip() == text.strip() and text.startswith("Parameter containing"), (
            printed,
            text,
        )
        a, b = printed_numbers(text), printed_numbers(ref_text)
        assert len(a) == len(b) > 0 and max(abs(u - v) for u, v in zip(a, b)) <= 2e-4, (
            text,
            ref_text,
        )  # 4 decimals
    assert p.ref.ln_f.weight.abs().max().item() != 1.0  # the step moved it away from its init


def loop_with(
    before_step=None,
    after_step=None,
    zero_grad=lambda o: o.zero_grad(),
    step=lambda o, c: o.step(),
    end=None,
):
    """A training loop with hooks: ``before_step(opt, i)`` between backward and opt.step(),
    ``step(opt, closure)`` instead of opt.step(), ``after_step(opt, i)`` after it, ``end(module,
    opt, i)`` after zero_grad."""

    def habit(call, module, opts, data):
        opt, losses = opts[0], []
        for i, (x, y) in enumerate(data):
            loss = call(x, y)
            loss.backward()
            losses.append(loss.item())
            if before_step:
                before_step(opt, i)
            step(opt, None)
            if after_step:
                after_step(opt, i)
            zero_grad(opt)
            if end:
                end(module, opt, i)
        return losses

    return habit


def write_in_place(module, opt, i):
    with torch.no_grad():
        if i == 0:
            for p in module.blocks[0].parameters():
                p.clamp_(-0.05, 0.05)
        if i == 1:
            for p in module.parameters():  # EMA-style shrink
                p.mul_(0.9)
            torch.nn.init.zeros_(module.blocks[1].mlp.out.weight)
        if i == 2:
            module.ln_f.weight.fill_(0.5)


in_place_writes = loop_with(end=write_in_place)


@isolated  # today: segfault
def test_19_3_in_place_writes_between_steps():
    base = gpt()
    p = parity(base, offload(base), habit=in_place_writes, data=gpt_data(4))
    assert set(placements(p.compiled)) == {"host"}
    p.check()


# ------------------------------------------------------ 19.4 two forwards before one backward,
# swapped
def two_forwards(call, module, opts, data):
    losses = []
    for (x1, y1), (x2, y2) in zip(data[0::2], data[1::2]):
        loss = call(x1, y1) + call(x2, y2)
        loss.backward()
        losses.append(loss.item())
        opts[0].step()
        opts[0].zero_grad()
    return losses


def contrastive_pair(call, module, opts, data):
    """Two views through the model, an InfoNCE loss between their mean logits."""
    losses = []
    for (x1, _), (x2, _) in zip(data[0::2], data[1::2]):
        a = torch.nn.functional.normalize(call(x1).mean(1), dim=-1)
        b = torch.nn.functional.normalize(call(x2).mean(1), dim=-1)
        logits = a @ b.T / 0.1
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        loss.backward()
        losses.append(loss.item())
        opts[0].step()
        opts[0].zero_grad()
    return losses


@pytest.mark.parametrize("n_swap", [1, 2])
def test_19_4_two_forwards_one_backward_swapped(n_swap):
    base = gpt()
    p = parity(base, offload(base, n_swap=n_swap), habit=two_forwards, data=gpt_data(6))
    assert [b["policy"] for b in protrain_fx.get_plan(p.compiled).to_dict()["blocks"]][:n_swap] == [
        "swap"
    ] * n_swap
    p.check()


def test_19_4_contrastive_pair_swapped():
    base = gpt()
    parity(
        base, offload(base, n_swap=1), habit=contrastive_pair, data=random_batches(6, 4, 16)
    ).check()


# ------------------------------------------------------------- 19.5 torch.distributed.checkpoint
def two_losses_retained(call, module, opts, data):
    """Two losses over one graph, each with its own backward: the first keeps the graph
    (``retain_graph=True``), the second runs the whole backward again (a multi-task loss, an
    auxiliary loss logged on its own)."""
    losses = []
    for x, y in data:
        out = call(input_ids=x, labels=y)
        aux = out.logits.float().pow(2).mean() * 0.01
        out.loss.backward(retain_graph=True)
        aux.backward()
        losses.append(out.loss.item())
        opts[0].step()
        opts[0].zero_grad()
    return losses


@pytest.mark.parametrize("policy", [dict(n_swap=2), dict(n_checkpoint=4), "automatic"])
def test_19_4_two_backwards_through_one_retained_graph_offloaded(policy):
    """Before: aot_autograd's donated-buffers RuntimeError at the first backward (protrain compiles
    the backward with the forward; torch.compile's own lazy compile sees ``retain_graph``); under
    an automatic plan (a redoable call, step_redo.py) a ProtrainError refused the second one."""
    base = hf_llama()
    if policy == "automatic":
        options = {"compiler": "eager", "memory_budget": 3_000_000}
    else:
        options = offload(base, **policy)
    p = parity(base, options, habit=two_losses_retained, data=hf_data(3))
    assert "host" in placements(p.compiled)
    p.check()


def assert_state_close(mine, ref, rtol=1e-4, atol=1e-9, path="state"):
    """Nested dicts/lists of tensors and numbers (an optimizer state dict) equal up to rounding."""
    if isinstance(ref, dict):
        assert set(mine) == set(ref), (path, sorted(map(str, mine)), sorted(map(str, ref)))
        for k in ref:
            assert_state_close(mine[k], ref[k], rtol, atol, f"{path}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(mine) == len(ref), path
        for i, (a, b) in enumerate(zip(mine, ref)):
            assert_state_close(a, b, rtol, atol, f"{path}[{i}]")
    elif isinstance(ref, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.shape == ref.shape, (path, mine)
        torch.testing.assert_close(
            mine.detach().cpu(),
            ref.detach().cpu(),
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"{path}: {m}",
        )
    else:
        assert mine == ref, (path, mine, ref)


@pytest.mark.parametrize("load_when", ["before_first_call", "after_a_step"])
@isolated  # today: segfault in get_optimizer_state_dict
def test_19_5_distributed_checkpoint_offloaded(tmp_path, load_when):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    assert not torch.distributed.is_initialized()  # torch 2.13's DCP runs without a process group
    more = gpt_data(3, seed=1)
    p = parity(gpt(), offload(gpt()))
    p.check()
    assert set(placements(p.compiled)) == {"host"}
    (opt,), (ref_opt,) = p.opts, p.ref_opts
    msd, ref_msd = get_model_state_dict(p.mine), get_model_state_dict(p.ref)
    assert set(msd) == set(ref_msd)
    assert sd_diff(msd, ref_msd) <= PARAM_ABS
    osd, ref_osd = get_optimizer_state_dict(p.mine, opt), get_optimizer_state_dict(p.ref, ref_opt)
    assert_state_close(osd, ref_osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))

    torch.manual_seed(1)  # different initial values: the load must overwrite all of them
    fresh = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)
    fresh_opt = adamw(fresh.parameters())
    fresh_c = torch.compile(
        fresh, backend="protrain", options={**offload(fresh), "optimizer": fresh_opt}
    )
    if load_when == "after_a_step":  # the chunks are offloaded and the optimizer has state already
        plain_step(fresh_c, fresh, [fresh_opt], gpt_data(1, seed=7), gpt_loss)
    target = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, fresh_opt),
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    set_model_state_dict(fresh, target["model"])
    set_optimizer_state_dict(fresh, fresh_opt, target["optim"])
    assert sd_diff(fresh.state_dict(), p.ref.state_dict()) <= PARAM_ABS
    assert_state_close(get_optimizer_state_dict(fresh, fresh_opt), ref_osd)

    ref_losses = plain_step(p.ref, p.ref, [ref_opt], more, gpt_loss)
    losses = plain_step(fresh_c, fresh, [fresh_opt], more, gpt_loss)
    assert rel_err(losses, ref_losses) <= LOSS_REL, (losses, ref_losses)
    assert sd_diff(fresh.state_dict(), p.ref.state_dict()) <= PARAM_ABS
    assert set(placements(fresh_c)) == {"host"}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch_save"])
def test_19_5_hf_save_pretrained_offloaded(tmp_path, safe):
    """``save_pretrained`` between steps, as HF users checkpoint: parameters that are views of
    offloaded chunks (one storage for many, a tied embedding) must not look shared to safetensors'
    checks, the files must hold the trained values (``from_pretrained`` into eager gives eager's
    weights), and training goes on exactly afterwards."""
    import transformers

    base = hf_llama()
    p = parity(base, offload(base), habit=seeded_steps, data=hf_data(2))
    assert set(placements(p.compiled)) == {"host"}
    for name, model in (("mine", p.mine), ("ref", p.ref)):
        model.save_pretrained(tmp_path / name, safe_serialization=safe)
    files = sorted(os.listdir(tmp_path / "mine"))
    assert files == sorted(os.listdir(tmp_path / "ref")), files
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "mine")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert sd_diff(loaded.state_dict(), p.ref.state_dict()) <= PARAM_ABS
    more = hf_data(2, seed=3)
    ref_losses = seeded_steps(p.ref, p.ref, p.ref_opts, more)
    losses = seeded_steps(p.compiled, p.mine, p.opts, more)
    assert rel_err(losses, ref_losses) <= LOSS_REL, (losses, ref_losses)
    p.check()


# ----------------------------------------------------------- 19.6 shapes past dynamo's recompile
# limit
def test_19_6_ten_sequence_lengths_offloaded():
    data = [random_batches(1, 2, seq, vocab=256, seed=seq)[0] for seq in range(4, 14)]
    base = gpt()
    p = parity(base, offload(base), data=data)
    assert len(p.trace) == 10
    p.check()


# ======================================================================================= issue 20
# ----------------------------------------------------- 20.1 an optimizer over the trainable
# parameters
def frozen_llama():
    model = hf_llama()
    model.model.embed_tokens.requires_grad_(False)  # tied: lm_head too
    model.model.layers[0].requires_grad_(False)
    return model


def trainable_adamw(model):
    return [adamw([p for p in model.parameters() if p.requires_grad])]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_20_1_optimizer_over_trainable_params_frozen_layers(compiler):
    base = frozen_llama()
    # the eager compiler through the automatic plan; Inductor with a fixed one (skips a profiling
    # compile)
    options = (
        {"compiler": "eager", "memory_budget": "6MiB"}
        if compiler == "eager"
        else offload(base, "inductor")
    )
    p = parity(base, options, make_opts=trainable_adamw, loss_fn=hf_loss, data=hf_data(4))
    assert "host" in placements(p.compiled)
    p.check()
    frozen = [k for k, v in base.named_parameters() if not v.requires_grad]
    assert (
        sd_diff(
            {k: p.mine.state_dict()[k] for k in frozen}, {k: base.state_dict()[k] for k in frozen}
        )
        == 0.0
    )


def lora_llama():
    import peft

    model = hf_llama()
    torch.manual_seed(1)
    return peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )


def test_20_1_peft_lora_adapters_only():
    base = lora_llama()
    # A and B of q_proj, v_proj in 4 layers
    assert sum(p.requires_grad for p in base.parameters()) == 16
    p = parity(base, offload(base), make_opts=trainable_adamw, loss_fn=hf_loss, data=hf_data(4))
    assert set(placements(p.compiled)) == {"host"}
    p.check()


# ----------------------------------------------------------------- 20.2 optimizers protrain was not
# given
def adamw_and_sgd(model):
    """AdamW (protrain's options["optimizer"]) over everything but the blocks' MLPs; SGD with
    momentum over those."""
    mlp = [p for b in model.blocks for p in b.mlp.parameters()]
    mlp_ids = {id(p) for p in mlp}
    return [
        adamw([p for p in model.parameters() if id(p) not in mlp_ids]),
        torch.optim.SGD(mlp, lr=0.1, momentum=0.9),
    ]


def test_20_2_second_optimizer_sgd_offloaded():
    base = gpt()
    p = parity(base, offload(base), make_opts=adamw_and_sgd, data=gpt_data(4))
    assert set(placements(p.compiled)) == {"host"}
    p.check()
    mlp = [k for k in base.state_dict() if ".mlp." in k]
    moved = max((p.mine.state_dict()[k] - base.state_dict()[k]).abs().max().item() for k in mlp)
    assert moved > 1e-3, "the SGD's parameters never moved"


def add_mlp_group(module, opt, i):
    """The optimizer starts without the blocks' MLPs; they join as a new param group after step
    1."""
    if i == 0:
        mlp = [p for b in module.blocks for p in b.mlp.parameters()]
        for p in mlp:
            p.grad = None  # the first backward gave them gradients nobody stepped
        opt.add_param_group({"params": mlp, "lr": 2e-2, "weight_decay": 0.0})


add_group_after_first_step = loop_with(end=add_mlp_group)


def without_mlps(model):
    mlp_ids = {id(p) for b in model.blocks for p in b.mlp.parameters()}
    return [adamw([p for p in model.parameters() if id(p) not in mlp_ids])]


def test_20_2_add_param_group_after_first_compiled_step():
    base = gpt()
    p = parity(
        base,
        offload(base),
        make_opts=without_mlps,
        habit=add_group_after_first_step,
        data=gpt_data(4),
    )
    assert set(placements(p.compiled)) == {"host"}
    p.check()
    assert len(p.opts[0].param_groups) == 2


# ------------------------------------------------- gradients changed between backward and step
GRAD_EDITS = {
    "set_to_none": lambda n, p: setattr(p, "grad", None) if "layers.1" in n else None,
    "replaced": lambda n, p: setattr(p, "grad", p.grad * 0.5),
    "data_mul": lambda n, p: p.grad.data.mul_(0.5),
    "detach_mul": lambda n, p: p.grad.detach().mul_(0.5),
    "slice_mul": lambda n, p: p.grad[:1].mul_(3.0),
    "out_mul": lambda n, p: torch.mul(p.grad, 0.5, out=p.grad),
    "data_set": lambda n, p: setattr(p.grad, "data", p.grad.data * 0.5),
    "decay_with_grad_mode_on": lambda n, p: p.grad.add_(p, alpha=1e-2),
    "old_zero_grad": lambda n, p: (p.grad.detach_(), p.grad.zero_()) if "layers.0" in n else None,
}


def edit_grads(edit):
    def habit(call, module, opts, data):
        losses = []
        for x, y in data:
            loss = hf_loss(call, x, y)
            loss.backward()
            for n, p in module.named_parameters():
                if p.grad is not None:
                    edit(n, p)
            opts[0].step()
            opts[0].zero_grad()
            losses.append(loss.item())
        return losses

    return habit


@pytest.mark.parametrize("edit", list(GRAD_EDITS))
def test_gradients_changed_between_backward_and_step_offloaded(edit):
    """Before: the chunks' in-backward steps (from the second step) were committed with the
    gradients backward made (0.01-0.07 off), except for writes through ``p.grad`` itself; a
    weight decay by hand with grad mode on and the old ``detach_(); zero_()`` raised torch's view
    errors."""
    base = hf_llama()
    p = parity(base, offload(base), habit=edit_grads(GRAD_EDITS[edit]), data=hf_data(4))
    assert set(placements(p.compiled)) == {"host"}
    p.check()


def nonfinite_batch(then_step: bool, factor: float):
    """The third batch's loss is made non-finite (a bad batch, an overflow) and back-propagated;
    the loop then skips the step (``zero_grad()``, as guards on the loss or the gradient norm do)
    or steps anyway (eager's parameters turn NaN); training goes on."""

    def habit(call, module, opts, data):
        losses = []
        for k, (x, y) in enumerate(data):
            loss = hf_loss(call, x, y)
            if k == 2:
                loss = loss * factor
            loss.backward()
            if k != 2 or then_step:
                opts[0].step()
            opts[0].zero_grad()
            losses.append(loss.item())
        return losses

    return habit


@pytest.mark.parametrize("factor", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_loss_back_propagated_then_skipped_offloaded(factor):
    """Before: the chunks' in-backward steps with NaN gradients could not be taken back: every
    offloaded parameter NaN after the skipped step, every later loss NaN."""
    base = hf_llama()
    data = hf_data(5)
    p = parity(base, offload(base), habit=nonfinite_batch(False, factor), data=data)
    assert set(placements(p.compiled)) == {"host"}
    p.trace, p.ref_trace = p.trace[:2] + p.trace[3:], p.ref_trace[:2] + p.ref_trace[3:]
    p.check()


def test_a_nan_loss_stepped_anyway_turns_parameters_nan_as_in_eager():
    base = hf_llama()
    p = parity(base, offload(base), habit=nonfinite_batch(True, float("nan")), data=hf_data(4))
    for (name, a), b in zip(p.mine.named_parameters(), p.ref.parameters()):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
    assert all(torch.isnan(a).all() for a in p.ref.parameters())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_steps_trains_on_as_eager():
    """Before: the child's first backward waited forever for the parent's host worker thread (a
    forked child has none)."""
    base = hf_llama()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, opt = adamw(ref.parameters()), adamw(mine.parameters())
    compiled = torch.compile(mine, backend="protrain", options=offload(mine))
    data = hf_data(3)
    steps_with(ref, [ref_opt], data[:2], hf_loss)
    steps_with(compiled, [opt], data[:2], hf_loss)
    expected = steps_with(ref, [ref_opt], data[2:], hf_loss)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one more step, its loss through the pipe
        import faulthandler

        faulthandler.dump_traceback_later(120, exit=True)
        torch.set_num_threads(1)  # as DataLoader's workers: the parent's OpenMP team is not here
        try:
            os.write(write, repr(steps_with(compiled, [opt], data[2:], hf_loss)).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.time() + 180
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.time() < deadline, "the forked child hangs"
        time.sleep(0.2)
    got = eval(os.read(read, 4096).decode() or "None")
    assert got is not None and rel_err(got, expected) <= LOSS_REL, (got, expected)


def rollback_after_backward(then_step: bool):
    """A checkpoint saved after the first step; the third step's backward is followed by a
    roll-back to it (the model's state dict, and the optimizer's), then the step is skipped or
    taken on the loaded state; training goes on."""

    def habit(call, module, opts, data):
        losses, saved = [], None
        for k, (x, y) in enumerate(data):
            loss = hf_loss(call, x, y)
            loss.backward()
            losses.append(loss.item())
            if k == 2:
                module.load_state_dict(saved[0])
                opts[0].load_state_dict(saved[1])
            if k != 2 or then_step:
                opts[0].step()
            opts[0].zero_grad()
            if k == 0:
                saved = copy.deepcopy((module.state_dict(), opts[0].state_dict()))
        return losses

    return habit


@pytest.mark.parametrize("then_step", [False, True], ids=["skipped", "stepped"])
def test_a_checkpoint_loaded_between_backward_and_step_offloaded(then_step):
    """Before: the in-backward step taken back on top of the loaded values (0.01 off the
    checkpoint, skipped), or dropped (stepped: the gradient never applied)."""
    base = hf_llama()
    p = parity(base, offload(base), habit=rollback_after_backward(then_step), data=hf_data(5))
    assert set(placements(p.compiled)) == {"host"}
    p.check()


# -------------------------------------------------------------- 20.3 hyperparameters and step
# variants
def change_hyperparameters(opt, i):
    if i in (1, 2):  # steps 2 and 3, between backward and opt.step()
        for g in opt.param_groups:
            g["lr"] = LR * (0.3 if i == 1 else 2.0)
            g["weight_decay"] = 0.5 if i == 1 else 0.0
            g["betas"] = (0.8, 0.99) if i == 1 else (0.95, 0.9)


def step_twice(opt, closure):
    opt.step()
    opt.step()  # no new backward in between: torch steps again with the same gradients


def closure_loop(call, module, opts, data):
    opt, losses = opts[0], []
    for x, y in data:

        def closure():
            opt.zero_grad()
            loss = call(x, y)
            loss.backward()
            return loss

        losses.append(opt.step(closure).item())
    return losses


def lambda_lr_loop(call, module, opts, data):
    sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda s: [1.0, 0.1, 3.0, 0.5, 1.0][s])
    return loop_with(after_step=lambda o, i: sched.step())(call, module, opts, data)


def one_cycle_loop(call, module, opts, data):
    sched = torch.optim.lr_scheduler.OneCycleLR(opts[0], max_lr=2 * LR, total_steps=len(data))
    return loop_with(after_step=lambda o, i: sched.step())(call, module, opts, data)


HABITS_20_3 = {
    "hyperparameters_changed_before_step": loop_with(before_step=change_hyperparameters),
    "step_with_closure": closure_loop,
    "step_twice_without_backward": loop_with(step=step_twice),
    "zero_grad_set_to_none_false": loop_with(zero_grad=lambda o: o.zero_grad(set_to_none=False)),
    "lambda_lr_scheduler": lambda_lr_loop,
    "one_cycle_lr_scheduler": one_cycle_loop,
}


@pytest.mark.parametrize("habit", list(HABITS_20_3))
def test_20_3_optimizer_habits_offloaded(habit):
    base = gpt()
    p = parity(base, offload(base), habit=HABITS_20_3[habit], data=gpt_data(4))
    assert set(placements(p.compiled)) == {"host"}
    p.check()
    assert [g["lr"] for g in p.opts[0].param_groups] == [
        g["lr"] for g in p.ref_opts[0].param_groups
    ]


# ------------------------------------------------------------------------ 20.4 clipping however
# called
MAX_NORM = 0.5  # the GPT's gradient norm is about 2: clipping scales every step


def torch_clip_grad_norm():
    """``clip_grad_norm_`` as bound at the top of this module. If protrain_fx was imported before
    this module (a whole-suite run), that name is already protrain's extension: then load torch's
    own function afresh, so the test always exercises a function protrain did not patch."""
    if clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad":
        return clip_grad_norm_
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_pristine_clip_grad", torch.nn.utils.clip_grad.__file__
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.clip_grad_norm_


def clip_early_bound(module):
    return torch_clip_grad_norm()(module.parameters(), MAX_NORM)


def clip_through_module(module):
    return torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)


def clip_total_norm_then_scale(module):
    params = list(module.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    return total


def clip_by_hand(module):
    params = [p for p in module.parameters() if p.grad is not None]
    assert params, "no parameter has a .grad after backward"
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


CLIPPERS = {
    "clip_grad_norm_bound_early": clip_early_bound,
    "torch_nn_utils_clip_grad_norm_": clip_through_module,
    "get_total_norm_and_clip_grads_with_norm_": clip_total_norm_then_scale,
    "hand_written": clip_by_hand,
}


@pytest.mark.parametrize("how", list(CLIPPERS))
def test_20_4_gradient_clipping_offloaded(how):
    clip = CLIPPERS[how]

    def habit(call, module, opts, data):
        trace, norms = [], []
        for x, y in data:
            loss = call(x, y)
            loss.backward()
            norm = clip(module)
            trace.append(loss.item())
            norms.append(float(norm))
            opts[0].step()
            opts[0].zero_grad()
        return trace + norms

    base = gpt()
    p = parity(base, offload(base), habit=habit, data=gpt_data(4))
    assert set(placements(p.compiled)) == {"host"}
    ref_norms, norms = p.ref_trace[4:], p.trace[4:]
    assert min(ref_norms) > 2 * MAX_NORM, ref_norms  # clipping really scaled every step
    assert rel_err(norms, ref_norms) <= 1e-5, ("gradient norms", norms, ref_norms)
    p.check()


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_and_clip", "scaler_step_only"])
def test_20_4_grad_scaler_skipped_steps_offloaded(unscale):
    """``torch.amp.GradScaler`` as mixed-precision loops use it: scaled backward, ``unscale_`` and
    clipping, ``scaler.step`` (which skips ``opt.step()`` when a gradient is not finite) and
    ``update``. Two steps overflow on purpose: their optimizer steps are skipped in eager, so they
    must be in protrain (an offloaded chunk's step taken beside backward is taken back), the
    scale halves, and training goes on as eager's."""
    overflow = {2, 4}

    def habit(call, module, opts, data):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        trace = []
        for k, (x, y) in enumerate(data):
            loss = call(x, y)
            scaler.scale(loss * (1e36 if k in overflow else 1.0)).backward()
            if unscale:
                scaler.unscale_(opts[0])
                clip_through_module(module)
            scaler.step(opts[0])
            scaler.update()
            opts[0].zero_grad()
            trace += [loss.item(), scaler.get_scale()]
        return trace

    base = gpt()
    p = parity(base, offload(base), habit=habit, data=gpt_data(6))
    assert set(placements(p.compiled)) == {"host"}
    scales = p.ref_trace[1::2]
    assert scales[2] < scales[1] and scales[4] < scales[3], scales  # the overflows were skipped
    p.check()


def test_20_4_norm_logged_with_an_infinite_max_norm_keeps_the_overlap():
    """Hugging Face's Trainer calls clip_grad_norm_(params, inf) every step to log the norm: torch
    multiplies the gradients by exactly 1, which writes nothing; the CPU steps inside backward are
    not taken back."""

    def habit(call, module, opts, data):
        trace = []
        for x, y in data:
            loss = call(x, y)
            loss.backward()
            trace.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), float("inf"))))
            opts[0].step()
            opts[0].zero_grad()
        return trace

    base = gpt()
    p = parity(base, offload(base), habit=habit, data=gpt_data(4))
    p.check()
    timers = protrain_fx.runtime.hybrid_optim.handle_of(p.opts[0]).timers
    assert timers.in_backward_steps > 0 and timers.undone_steps == 0, vars(timers)


# --------------------------------------------------------------------------- 20.5 exceptions
# mid-step
class EmbeddedGPT(GPT):
    """Our GPT fed with token embeddings computed outside the compiled model (so that something
    outside it can run in backward after the whole compiled backward)."""

    def forward(self, emb, targets):
        x = emb + self.wpe(torch.arange(emb.shape[1], device=emb.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), targets.reshape(-1)
        )


def embedded_gpt():
    torch.manual_seed(0)
    return EmbeddedGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32))


class Boom(Exception):
    pass


class RaiseInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if RaiseInBackward.armed:
            RaiseInBackward.armed = False
            raise Boom("backward failed once")
        return g


def skip_failed_steps(feed, fail_at=1):
    """The usual robust loop: a step whose forward or backward raises is skipped (opt.zero_grad(),
    next batch). ``feed(call, x, y, fail)`` runs forward+backward and returns the loss; with
    ``fail`` it must raise."""

    def habit(call, module, opts, data):
        trace = []
        for i, (x, y) in enumerate(data):
            try:
                loss = feed(call, x, y, i == fail_at)
            except Boom:
                trace.append(-1.0)
                opts[0].zero_grad()
                continue
            except (IndexError, RuntimeError) as e:
                assert "out of bounds" in str(e) or "out of range" in str(e), e
                trace.append(-1.0)
                opts[0].zero_grad()
                continue
            trace.append(loss)
            opts[0].step()
            opts[0].zero_grad()
        return trace

    return habit


FRONT = {}


def front_embeddings(x):
    """Frozen token embeddings, outside the compiled model; the result is a leaf that requires
    grad."""
    if "emb" not in FRONT:
        torch.manual_seed(5)
        FRONT["emb"] = torch.nn.Embedding(256, 32).requires_grad_(False)
    return FRONT["emb"](x).requires_grad_()


def feed_hook(call, x, y, fail):
    emb = front_embeddings(x)
    if fail:

        def hook(g):
            raise Boom("a tensor hook raised")

        emb.register_hook(hook)
    loss = call(emb, y)
    loss.backward()
    return loss.item()


def feed_function(call, x, y, fail):
    RaiseInBackward.armed = fail
    loss = call(RaiseInBackward.apply(front_embeddings(x)), y)
    loss.backward()
    return loss.item()


def feed_bad_target(call, x, y, fail):
    if fail:
        y = y.clone()
        y[0, -1] = 10_000  # cross_entropy raises in forward, after every block ran
    loss = call(front_embeddings(x), y)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize(
    "where", ["backward_tensor_hook", "backward_autograd_function", "forward_bad_target"]
)
def test_20_5_exception_mid_step_is_skipped(where):
    feed = {
        "backward_tensor_hook": feed_hook,
        "backward_autograd_function": feed_function,
        "forward_bad_target": feed_bad_target,
    }[where]
    base = embedded_gpt()
    p = parity(base, offload(base), habit=skip_failed_steps(feed), data=gpt_data(4))
    assert p.ref_trace[1] == -1.0 and p.trace[1] == -1.0  # both saw the failure at step 2
    p.check()


# ------------------------------------------------------------------------ 20.6 a failed compile
def protrain_error_of(exc):
    """The ProtrainError in ``exc``'s chain (dynamo wraps backend errors in
    BackendCompilerFailed)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, protrain_fx.ProtrainError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def test_20_6_failed_compile_leaves_the_model_as_it_was():
    model = gpt()
    ref = copy.deepcopy(model)
    x, y = gpt_data(1)[0]
    with torch.no_grad():
        before_out = model(x).clone()
    before_sd = {k: v.clone() for k, v in model.state_dict().items()}
    opt = adamw(model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "optimizer": opt, "memory_budget": "1KiB"},
    )
    with pytest.raises(Exception) as info:
        compiled(x, y)
    err = protrain_error_of(info.value)
    assert err is not None, f"not a ProtrainError: {info.value!r}"
    m = re.search(r"the smallest budget that would work is (\d+) bytes", str(err))
    assert m, str(err)
    minimum = int(m.group(1))
    # the original module still works eagerly and holds exactly its old values
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), before_out)
    after_sd = model.state_dict()
    assert set(after_sd) == set(before_sd) and all(
        torch.equal(after_sd[k], v) for k, v in before_sd.items()
    )
    assert not opt.state
    # retrying with the budget the error named trains like eager
    ref_opt = adamw(ref.parameters())
    retry = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "optimizer": opt, "memory_budget": minimum},
    )
    data = gpt_data(3)
    losses = plain_step(retry, model, [opt], data, gpt_loss)
    ref_losses = plain_step(ref, ref, [ref_opt], data, gpt_loss)
    assert "host" in placements(retry)
    assert rel_err(losses, ref_losses) <= LOSS_REL, (losses, ref_losses)
    assert sd_diff(model.state_dict(), ref.state_dict()) <= PARAM_ABS
    assert sd_diff(ref.state_dict(), before_sd) > MIN_UPDATE


# ---------------------------------------------------------------------------- 20.7 non-fp32
# parameters
def test_20_7_pure_bf16_parameters_offloaded():
    base = gpt().to(torch.bfloat16)
    p = parity(base, offload(base))
    assert set(placements(p.compiled)) == {"host"}
    assert all(v.dtype == torch.bfloat16 for v in p.mine.state_dict().values())
    p.check(loss_rel=1e-2, param_abs=2 * LR * 3)


def test_20_7_fp64_parameters_offloaded():
    base = gpt().double()
    p = parity(base, offload(base))
    assert set(placements(p.compiled)) == {"host"}
    assert all(v.dtype == torch.float64 for v in p.mine.state_dict().values())
    p.check(loss_rel=1e-10, param_abs=1e-10)


# ---------------------------------------------------------------- 20.8 HF gradient checkpointing
def _dynamo_traces_checkpointed_layers(model) -> bool:
    """Whether plain torch.compile puts the checkpointed decoder layers' parameters in a graph
    (transformers 5.25 checkpoints each layer's ``forward``, and dynamo skips the layer loop)."""
    names = set()

    def backend(gm, example_inputs):
        names.update(str(n.target) for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    x, _ = hf_data(1)[0]
    torch.compile(model, backend=backend)(input_ids=x, labels=x).loss.backward()
    torch._dynamo.reset()  # the frames it skipped stay skipped until a reset
    return any("layers" in n for n in names)


def test_20_8_checkpointed_layers_outside_every_graph_are_refused_only_when_none_reached_one():
    """The refusal looks at the checkpointed layers themselves (a flagged module with no flagged
    module below it, the root included): none of them in a graph or a store -> refused; some in
    one -> the others may be unused, no refusal; checkpointing off or no grad -> nothing to say."""
    from protrain_fx.graph.blocks import refuse_untraced_checkpointing

    class Layer(torch.nn.Linear):
        gradient_checkpointing = True

    model = torch.nn.Sequential(Layer(2, 2), Layer(2, 2), torch.nn.Linear(2, 2))
    model.gradient_checkpointing = True  # as HF flags the model that holds the layers
    head = list(model[2].parameters())
    for root in (model, model[0]):
        with pytest.raises(protrain_fx.ProtrainError, match="gradient_checkpointing_disable"):
            refuse_untraced_checkpointing(root, head)
    refuse_untraced_checkpointing(model, list(model[0].parameters()))  # layer 1 may be unused
    refuse_untraced_checkpointing(model[0], list(model[0].parameters()))
    with torch.no_grad():
        refuse_untraced_checkpointing(model, head)
    model[0].gradient_checkpointing = model[1].gradient_checkpointing = False
    refuse_untraced_checkpointing(model, head)  # the model's flag alone: no layer to refuse


@pytest.mark.parametrize("plan", ["memory_budget", "n_persist_0"])
@isolated  # today: the fixed plan segfaults reading model.state_dict()
def test_20_8_hf_gradient_checkpointing_offloaded(plan):
    """With checkpointing on, either dynamo traces the checkpointed layers and protrain's plan
    replaces the recompute (the blocks offload, parity with eager), or it cannot and protrain
    refuses, naming the fix; with the fix (checkpointing off) the blocks offload."""
    base = hf_llama(num_hidden_layers=2)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert base.is_gradient_checkpointing and base.training

    def options(model):
        if plan == "memory_budget":
            return {"compiler": "eager", "memory_budget": "4MiB"}
        return offload(model)

    if _dynamo_traces_checkpointed_layers(copy.deepcopy(base)):
        p = parity(base, options(base), loss_fn=hf_loss, data=hf_data())
        # HF's checkpointing breaks the graph: the last graph's plan is the head's; the blocks
        # offload
        assert any(s.offloaded_chunks for s in stores_of(p.compiled))
        p.check()
    else:
        mine = copy.deepcopy(base)
        opt = adamw(mine.parameters())
        compiled = torch.compile(
            mine, backend="protrain", options={**options(mine), "optimizer": opt}
        )
        x, _ = hf_data(1)[0]
        with pytest.raises(Exception) as info:
            compiled(input_ids=x, labels=x)
        err = protrain_error_of(info.value)
        assert err is not None and "gradient_checkpointing_disable()" in str(err), info.value
        assert "'model.layers.0'" in str(err)
        torch._dynamo.reset()
    base.gradient_checkpointing_disable()
    p = parity(base, options(base), loss_fn=hf_loss, data=hf_data())
    assert any(
        "layers" in e.fqn and e.chunk in s.offloaded_chunks
        for s in stores_of(p.compiled)
        for e in s.entries
    )
    p.check()


# ----------------------------------------------------------------- 20.9 a deleted model frees its
# memory
def test_20_9_deleted_model_frees_memory():
    # torch starts a thread of its own the first time anything compiles (tqdm's monitor): start it
    # now
    torch.compile(lambda a: (a * 2).sin(), backend="aot_eager")(
        torch.randn(2, requires_grad=True)
    ).sum().backward()
    gc.collect()
    threads_before = threading.active_count()

    model = gpt()
    opt = adamw(model.parameters())
    compiled = torch.compile(
        model, backend="protrain", options={**offload(model), "optimizer": opt}
    )
    plain_step(compiled, model, [opt], gpt_data(2), gpt_loss)
    assert set(placements(compiled)) == {"host"}
    refs = {
        "model": weakref.ref(model),
        "optimizer": weakref.ref(opt),
        "parameter": weakref.ref(model.blocks[0].mlp.fc.weight),
    }
    del compiled, model, opt
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, f"still alive after del + gc.collect(): {alive}"
    for _ in range(20):  # worker threads notice that their executor is gone within a moment
        if threading.active_count() <= threads_before:
            break
        time.sleep(0.1)
    extra = [t.name for t in threading.enumerate()][threads_before:]
    assert threading.active_count() <= threads_before, f"threads left behind: {extra}"


# --------------------------------------------------------------------------------- 20.10 small ones
@pytest.mark.parametrize("options", ["abc", ["n_persist", 0]])
def test_20_10_options_must_be_a_dict(options):
    model = gpt()
    compiled = torch.compile(model, backend="protrain", options=options)
    with pytest.raises(Exception) as info:
        compiled(*gpt_data(1)[0])
    err = info.value
    while err is not None and not isinstance(err, protrain_fx.OptionsError):
        err = err.__cause__ or err.__context__
    assert err is not None, f"not an OptionsError: {info.value!r}"
    assert re.search(r"options must be a dict", str(err)), str(err)


def test_20_10_host_memory_error_never_negative(monkeypatch):
    """PROTRAIN_HOST_MEMORY (hardware.host_memory) states the host's total: 1 MiB is less than this
    process already uses, and every chunk offloaded (n_persist=0) needs pinned host buffers: a clear
    error whose sizes are not negative and whose needed size exceeds the available one."""
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "1MiB")
    model = gpt()
    opt = adamw(model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options={
            "compiler": "eager",
            "optimizer": opt,
            "n_persist": 0,
            # fits the device
            "memory_budget": "2MiB",
        },
    )
    with pytest.raises(Exception) as info:
        compiled(*gpt_data(1)[0])
    err = protrain_error_of(info.value)
    assert err is not None, f"not a ProtrainError: {info.value!r}"
    text = str(err)
    assert "host memory" in text, text
    assert not re.search(r"(?<![\w.])-\s*\d", text), f"a negative size in: {text}"
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    sizes = [float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?) ([KMGT]iB|B)\b", text)]
    assert len(sizes) >= 2 and sizes[1] > sizes[0], f"needs no more than it has? {text}"


@pytest.mark.parametrize("policy", ["n_swap", "n_checkpoint"])
def test_19_1_regional_compilation_with_block_policies(policy):
    """A block compiled on its own is one block: swap or recompute apply to it (every block's
    graph), with offloaded chunks, exactly."""
    base = gpt()
    p = parity(base, offload(base, **{policy: 1}), compile_fn=regional("blocks"))
    p.check()
    plan = protrain_fx.get_plan(p.mine.blocks[0])
    assert [b.policy for b in plan.blocks] == ["swap" if policy == "n_swap" else "recompute"]


def test_20_10_manual_knobs_that_cannot_fit_the_host_fail_before_allocating(monkeypatch):
    """n_persist given by hand (no automatic plan runs on the CPU without a budget): the host-memory
    check runs anyway, and the model is left as it was."""
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", "64MiB")
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model, backend="protrain", options=offload(model))
    with pytest.raises(Exception) as err:
        compiled(*gpt_data(1)[0])
    pe = protrain_error_of(err.value)
    assert pe is not None and "need" in str(pe) and "of host memory" in str(pe), err.value
    assert not re.search(r"(?<![\w.])-\s*\d", str(pe))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_20_10_automatic_plan_that_cannot_fit_the_host_fails_before_profiling(
    monkeypatch, tmp_path, caplog
):
    """The automatic plan under a device budget that forces offloading, on a host too small for the
    masters, gradients and moments of what must be offloaded: NoPlanFits names the host memory and
    the device budget below which nothing fits, before the profiling compile and step (the
    Llama-3.1-8B shape at 24 GiB on the H200 was refused only after 90-107 s of profiling); the
    model is left as it was."""
    import logging

    from protrain_fx.errors import NoPlanFits

    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    model = hf_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from protrain_fx.machine import memory

    used = memory.host_memory()[1] - memory.host_memory()[0]
    # what this process uses plus less than the reserve: nothing may be pinned
    monkeypatch.setenv("PROTRAIN_HOST_MEMORY", f"{used + 2**20}B")
    compiled, _ = auto_planned(model)
    ((x, _),) = hf_data(1)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        with pytest.raises(Exception) as info:
            hf_loss(compiled, x)
    err = protrain_error_of(info.value)
    assert isinstance(err, NoPlanFits), info.value
    assert "before profiling" in str(err) and "host memory" in str(err), str(err)
    assert err.min_device_bytes > 3_000_000
    assert not any("profiling" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_20_11_first_call_leaves_the_random_numbers_as_eager(tmp_path, monkeypatch):
    """The first compiled call measures the machine, profiles and searches a plan (new caches
    here), all inside the user's step: torch's global generator must come out of the step where
    eager's does (the step draws nothing: the model has no dropout), so the data order and masks
    drawn after it are eager's."""
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    model = hf_llama()
    compiled, opt = auto_planned(model)
    ((x, _),) = hf_data(1)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    hf_loss(compiled, x).backward()
    opt.step()
    assert "host" in placements(compiled)  # the automatic plan profiled and offloaded
    assert torch.equal(torch.get_rng_state(), before)
