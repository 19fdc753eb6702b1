"""Chunk-based model states: resident and offloaded chunks, in-graph gather/prefetch/release, the
CPU optimizer, and the training features around it, all against eager PyTorch on the CPU."""

import copy
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from models import build

import protrain_fx
from protrain_fx.errors import OptionsError
from protrain_fx.machine import cpu_adam
from protrain_fx.runtime import chunk_store, hybrid_optim
from protrain_fx.testing import (
    compare_with_eager,
    make_adamw,
    random_batches,
    stores_of,
    train_steps,
)

LOSS_REL, PARAM_ABS = 1e-5, 1e-3


def gpt(**kw):
    torch.manual_seed(0)
    return build("gpt", **{"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32, **kw})


def llama(**kw):
    torch.manual_seed(0)
    return build(
        "llama",
        **{
            "n_layer": 2,
            "dim": 32,
            "n_head": 2,
            "n_kv_head": 1,
            "ffn_dim": 64,
            "max_seq_len": 32,
            **kw,
        },
    )


def assert_parity(r):
    assert r.max_loss_rel <= LOSS_REL, (r.losses, r.ref_losses)
    assert r.max_param_abs <= PARAM_ABS, r.max_param_abs
    assert r.max_param_update > 1e-4


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("n_persist", [0, 2])
def test_offloaded_chunks_match_eager(compiler, n_persist):
    r = compare_with_eager(
        gpt(),
        random_batches(4, 2, 16),
        {"compiler": compiler, "n_persist": n_persist, "chunk_size": "40KB"},
        give_optimizer=True,
    )
    assert_parity(r)
    plan = r.plan.to_dict()
    assert plan["n_persist"] == n_persist
    assert [c["placement"] for c in plan["chunks"]] == ["device"] * n_persist + ["host"] * (
        len(plan["chunks"]) - n_persist
    )
    stores = stores_of(r.model)  # one per region of the compiled graph
    # every gather found its chunk prefetched
    assert sum(s.stats.get("unprefetched_gathers", 0) for s in stores) == 0
    # backward reused chunks forward left in the buffers
    assert sum(s.stats.get("slot_hits", 0) for s in stores) > 0
    # offloaded parameters are views of their host master copy (and their gradients of the
    # accumulator)
    last = r.model.ln_f.bias
    store = chunk_store.store_of(last)
    e = store.entry(last)
    master = store.master[e.chunk]
    assert (
        last.data_ptr() == master.data_ptr() + e.offset * 4 and last.shape == r.ref.ln_f.bias.shape
    )
    assert torch.equal(last.detach(), r.ref.ln_f.bias.detach()) or r.max_param_abs <= PARAM_ABS
    timers = hybrid_optim.handle_of(r.opt).timers
    assert timers.in_backward_steps > 0  # steps 2.. overlapped backward
    assert timers.undone_steps == 0  # ... and opt.step() committed them
    # one group: flat steps
    assert timers.whole_chunk_steps == timers.in_backward_steps + timers.deferred_steps
    # on a CPU compute device protrain steps like the user's optimizer (torch's default: the
    # for-loop), not with its one-pass kernel (the CUDA path), so that rounding matches eager's
    assert timers.one_pass_steps == 0


# Any n_buffer works: gathers copy their chunk out of the buffer, so two chunks in use at once (a
# Linear whose weight and bias sit in different chunks, or the tied embedding used at both ends)
# need no second buffer.
@pytest.mark.parametrize("regions", ["1", "0"])
def test_n_shard_with_one_process_is_resident(monkeypatch, regions):
    """n_shard chunks are sharded over the ranks; with one process that is being resident, in
    regions or compiled whole."""
    monkeypatch.setenv("PROTRAIN_REGIONS", regions)
    opts = {"compiler": "eager", "chunk_size": "40KB", "n_swap": 0, "n_checkpoint": 0}
    r = compare_with_eager(
        gpt(), random_batches(3, 2, 16), {**opts, "n_persist": 1, "n_shard": 2}, give_optimizer=True
    )
    assert_parity(r)
    placements = [c.placement for c in r.plan.chunks]
    assert placements[:3] == ["device"] * 3 and "host" in placements, placements
    assert r.plan.n_shard == 0 and all(s.n_shard == 0 for s in stores_of(r.model))


@settings(
    max_examples=14,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["gpt", "llama"]),
    persist=st.sampled_from(["none", "some", "all"]),
    n_buffer=st.integers(1, 3),
    chunk_kb=st.integers(33, 90),
)
def test_knob_combinations_match_eager(kind, persist, n_buffer, chunk_kb):
    torch._dynamo.reset()
    model = gpt() if kind == "gpt" else llama()
    n_chunks = protrain_fx.plan.layout.pack(
        [(n, p.numel() * 4) for n, p in model.named_parameters()], chunk_kb * 1000
    ).n_chunks
    n_persist = {"none": 0, "some": max(1, n_chunks // 2), "all": n_chunks}[persist]
    options = {
        "compiler": "eager",
        "n_persist": n_persist,
        "n_buffer": n_buffer,
        "chunk_size": chunk_kb * 1000,
    }
    data = random_batches(3, 2, 12)
    r = compare_with_eager(model, data, options, give_optimizer=True)
    assert_parity(r)


def test_two_param_groups_lr_scheduler_and_tied_embeddings():
    def schedule(opt):
        # changes lr every step
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)

    model = gpt()
    assert model.head.weight is model.wte.weight
    r = compare_with_eager(
        model,
        random_batches(5, 2, 16),
        {"compiler": "eager", "n_persist": 0},
        give_optimizer=True,
        groups="decay_split",
        scheduler=schedule,
        lr=3e-3,
    )
    assert_parity(r)
    assert [g["lr"] for g in r.opt.param_groups] == [g["lr"] for g in r.ref_opt.param_groups]
    assert math.isclose(r.opt.param_groups[0]["lr"], 3e-3 * 0.5**5)
    t = hybrid_optim.handle_of(r.opt).timers
    # chunks that mix groups: per-group steps
    assert t.whole_chunk_steps < t.in_backward_steps + t.deferred_steps
    # the tied weight is one parameter, stored once, in an offloaded chunk
    sd = r.model.state_dict()
    assert torch.equal(sd["wte.weight"], sd["head.weight"])


@pytest.mark.parametrize("declared", [False, True])
def test_gradient_accumulation(declared):
    """4 micro-steps per optimizer step: learned from the first step, or declared up front."""
    model = llama()
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = make_adamw(mine), make_adamw(ref)
    if declared:
        protrain_fx.set_grad_accumulation(opt, 4)
    compiled = torch.compile(
        mine,
        backend="protrain",
        options={"compiler": "eager", "n_persist": 1, "optimizer": opt, "chunk_size": "40KB"},
    )
    data = random_batches(12, 2, 8)
    ref_losses = train_steps(ref, ref, data, opt=ref_opt, micro_steps=4)
    losses = train_steps(mine, compiled, data, opt=opt, micro_steps=4)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= LOSS_REL
    assert (
        max((mine.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        <= PARAM_ABS
    )
    timers = hybrid_optim.handle_of(opt).timers
    n_offloaded = sum(len(s.offloaded_chunks) for s in stores_of(mine))
    # declared: all 3 steps overlap backward; learned: the first step is deferred, steps 2 and 3
    # overlap
    assert timers.in_backward_steps == (3 if declared else 2) * n_offloaded
    assert timers.deferred_steps == (0 if declared else 1) * n_offloaded


def test_more_micro_steps_than_learned_stays_exact():
    """protrain learns one backward per step, steps chunks inside the next backward, then sees a
    second backward before opt.step(): the provisional steps are taken back, the gradients add up,
    and opt.step() steps once with their sum, as eager does."""
    model = llama()
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = make_adamw(mine, lr=1e-2), make_adamw(ref, lr=1e-2)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    data = random_batches(6, 2, 8)
    for m, o in ((compiled, opt), (ref, ref_opt)):
        # learns 1 backward per step
        train_steps(mine if o is opt else ref, m, data[:2], opt=o, micro_steps=1)
        m(*data[2]).backward()
        m(*data[3]).backward()  # one more than learned
        o.step()
        o.zero_grad()
        train_steps(mine if o is opt else ref, m, data[4:], opt=o, micro_steps=1)
    assert (
        max((mine.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        <= PARAM_ABS
    )
    t = hybrid_optim.handle_of(opt).timers
    assert t.undone_steps > 0 and t.in_backward_steps > 0


def test_gradient_clipping_includes_host_gradients():
    r = compare_with_eager(
        gpt(),
        random_batches(4, 2, 16),
        {"compiler": "eager", "n_persist": 1},
        give_optimizer=True,
        clip=0.05,
        lr=3e-3,
    )
    assert_parity(r)
    # clipping must have been active: the unclipped norm is larger than 0.05
    h = hybrid_optim.handle_of(r.opt)
    assert h.overlap is False and h.timers.in_backward_steps == 0


def test_clipping_that_stops_changing_gradients_lets_chunks_step_in_backward_again():
    """Clipping active for the first steps (norms over max_norm), then a multiply by one (norms
    under it), then active once more, then not: the offloaded chunks step at opt.step() while the
    clipping changes gradients, inside backward again after FIRST_CALM calm steps, and after the
    second real clip only after twice as many. Every step is eager's bit for bit until the second
    clip catches steps taken inside backward; their take-back restores the values within rounding,
    so eager's within 1e-4 from then on (the CPU fp32 tolerance of the other take-backs)."""
    from protrain_fx.runtime import overlap

    # max_norm per step: 0.05 clips these gradients, 1e9 multiplies them by one
    calm = overlap.FIRST_CALM
    clips = [0.05] * 2 + [1e9] * (calm + 1) + [0.05] + [1e9] * (2 * calm + 2)
    model = gpt()
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = make_adamw(mine, lr=3e-3), make_adamw(ref, lr=3e-3)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    in_backward, undone, diffs = [], [], []
    for (x, y), max_norm in zip(random_batches(len(clips), 2, 16), clips):
        losses = []
        for m, o, params in ((compiled, opt, mine.parameters), (ref, ref_opt, ref.parameters)):
            loss = m(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params(), max_norm)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=LOSS_REL)
        ref_sd = ref.state_dict()
        diffs.append(max((v - ref_sd[k]).abs().max().item() for k, v in mine.state_dict().items()))
        h = hybrid_optim.handle_of(opt)
        in_backward.append(h.timers.in_backward_steps)
        undone.append(h.timers.undone_steps)
    new = [b - a for a, b in zip([0] + in_backward, in_backward)]
    first = 2 + calm  # back after `calm` calm steps
    second = first + 2 + 2 * calm  # after the clip that caught step first + 1, twice as many
    # inside backward: steps `first` and `first + 1` (caught by the clip, taken back), then from
    # `second` on; none while the clipping changed gradients
    assert [i for i, n in enumerate(new) if n] == [first, first + 1] + list(
        range(second, len(clips))
    ), new
    assert undone[first + 1] > undone[first] and undone[-1] == undone[first + 1], undone
    assert diffs[: first + 1] == [0.0] * (first + 1) and max(diffs) <= 1e-4, diffs
    assert h.overlap and h._overlap.returns == 2
    assert h._overlap.calm_needed == 2 * calm


def test_overlap_policy_backs_off_and_a_hyperparameter_change_is_for_good():
    """runtime/overlap.py alone: each return that a real write ends doubles the calm needed, up to
    MAX_CALM; a cycle without any identity write, or with a real one, is not calm; a late
    hyperparameter change keeps the chunks after backward for good, whatever clipping does."""
    from protrain_fx.runtime.overlap import FIRST_CALM, MAX_CALM, Overlap

    def clip_cycle(ov):  # a step whose clipping changed the gradients
        news = ov.turn_off("clip", lasting=False)
        assert not ov.cycle_ended() and not ov.on
        return news

    def calm_cycles(ov, n):
        back = []
        for _ in range(n):
            ov.identity_write()
            back.append(ov.cycle_ended())
        return back

    ov, needed = Overlap(), FIRST_CALM
    assert clip_cycle(ov)
    while needed < MAX_CALM:
        assert calm_cycles(ov, needed) == [False] * (needed - 1) + [True] and ov.on
        assert clip_cycle(ov)
        needed = min(MAX_CALM, 2 * needed)
        assert ov.calm_needed == needed
    assert calm_cycles(ov, MAX_CALM)[-1] and clip_cycle(ov)
    assert ov.calm_needed == MAX_CALM
    # not calm: a cycle with no identity write; one with a real write besides
    assert calm_cycles(ov, MAX_CALM - 1) == [False] * (MAX_CALM - 1)
    assert not ov.cycle_ended() and ov.calm == 0
    ov.identity_write()
    assert not ov.turn_off("clip", lasting=False)  # already off: not news
    assert not ov.cycle_ended() and ov.calm == 0
    # a hyperparameter change while off for clipping: for good
    assert not ov.turn_off("lr between backward and step", lasting=True)
    assert ov.lasting and not any(calm_cycles(ov, 2 * MAX_CALM)) and not ov.on
    assert ov.serial_why == "lr between backward and step"


def test_clip_total_norm_matches_eager():
    model = gpt()
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = make_adamw(mine)
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    x, y = random_batches(1, 2, 16)[0]
    compiled(x, y).backward()
    ref(x, y).backward()
    n_mine = torch.nn.utils.clip_grad_norm_(mine.parameters(), 1e9)
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert math.isclose(n_mine.item(), n_ref.item(), rel_tol=1e-5)


def test_state_dicts_round_trip_and_resume():
    """Save after 3 steps, keep training 3 more; a fresh model+optimizer loaded from the save must
    give the same 3 losses."""
    data = random_batches(6, 2, 16)
    model = gpt()
    opt = make_adamw(model)
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    train_steps(model, compiled, data[:3], opt=opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    cont = train_steps(model, compiled, data[3:], opt=opt)

    # a fresh copy each time: torch's optimizer loader may alias the tensors it is given
    def load():
        return torch.load(io.BytesIO(buf.getvalue()))

    ckpt = load()
    assert set(ckpt["model"]) == set(gpt().state_dict())  # plain keys, plain tensors
    assert all(
        isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > 0
        for v in ckpt["model"].values()
    )
    plain = gpt()
    plain.load_state_dict(ckpt["model"])
    plain_opt = make_adamw(plain)
    plain_opt.load_state_dict(ckpt["opt"])  # torch's own format: loads into a plain optimizer
    # resume under protrain: load before the first call, and again after it (into the live stores)
    torch._dynamo.reset()
    fresh = gpt()
    fresh_opt = make_adamw(fresh)
    ckpt = load()
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    fresh_c = torch.compile(
        fresh,
        backend="protrain",
        options={"compiler": "eager", "n_persist": 1, "optimizer": fresh_opt},
    )
    resumed = train_steps(fresh, fresh_c, data[3:], opt=fresh_opt)
    assert resumed == pytest.approx(cont, rel=1e-6)
    eager_cont = train_steps(plain, plain, data[3:], opt=plain_opt)
    assert resumed == pytest.approx(eager_cont, rel=LOSS_REL)
    # load into the live (already offloaded) model and optimizer: training repeats the same losses
    ckpt = load()
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    again = train_steps(fresh, fresh_c, data[3:], opt=fresh_opt)
    assert again == pytest.approx(cont, rel=1e-6)


def test_inference_and_new_shapes_share_the_store():
    model = gpt()
    opt = make_adamw(model)
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "n_persist": 1, "optimizer": opt}
    )
    ref = gpt()
    ref_opt = make_adamw(ref)
    data = random_batches(2, 2, 16) + random_batches(2, 2, 24, seed=1)
    losses = train_steps(model, compiled, data[:1], opt=opt)
    first = [id(s) for s in stores_of(model)]  # the first graph's (one per region)
    losses += train_steps(model, compiled, data[1:], opt=opt)
    assert losses == pytest.approx(train_steps(ref, ref, data, opt=ref_opt), rel=LOSS_REL)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    mine = {
        id(s)
        for s in chunk_store._STORES.values()
        if s.params[0] is not None and s.params[0] in set(model.parameters())
    }
    assert mine == set(first)


def test_bf16_transfer_copies():
    """Under bf16 autocast offloaded chunks travel as bf16 (like FSDP2's param_dtype); the tolerance
    is the bf16 one from test_parity.py."""
    r = compare_with_eager(
        gpt(),
        random_batches(3, 2, 16),
        {"compiler": "eager", "n_persist": 1},
        give_optimizer=True,
        autocast_dtype=torch.bfloat16,
        fused=True,
    )
    stores = stores_of(r.model)
    assert all(s.param_dtype == torch.bfloat16 for s in stores)
    # with fused=True the one-pass kernel steps them and writes the bf16 copies
    if cpu_adam.available():
        assert hybrid_optim.handle_of(r.opt).timers.one_pass_steps > 0
    assert sum(len(s.offloaded_chunks) for s in stores) > 0
    for store in stores:
        for c in store.offloaded_chunks:
            assert torch.equal(store.transfer[c], store.master[c].to(torch.bfloat16))
    assert r.max_loss_rel <= 2 * 2**-8, (r.losses, r.ref_losses)
    assert r.max_param_abs <= 2 * 1e-3 * 3


def test_without_transfer_copies_masters_go_up_and_are_cast_there():
    """transfer_copies=False: no bf16 host copy; a gather casts the fp32 master on its way into the
    chunk buffer, which rounds as the CPU step's copy does, so training is bit for bit the same as
    with copies (and within the bf16 tolerance of eager)."""
    runs = {}
    for copies in (True, False):
        runs[copies] = r = compare_with_eager(
            gpt(),
            random_batches(3, 2, 16),
            {"compiler": "eager", "n_persist": 1, "transfer_copies": copies},
            give_optimizer=True,
            autocast_dtype=torch.bfloat16,
            fused=True,
        )
        stores = stores_of(r.model)
        assert r.plan.transfer_copies is copies
        off = [(s, c) for s in stores for c in s.offloaded_chunks]
        assert off and all((s.transfer[c] is s.master[c]) is not copies for s, c in off)
        assert all(s.param_dtype == torch.bfloat16 for s in stores)
        assert r.max_loss_rel <= 2 * 2**-8, (r.losses, r.ref_losses)
    assert runs[False].losses == runs[True].losses
    mine, theirs = runs[False].model.state_dict(), runs[True].model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert any("keep no host copy" in n for n in runs[False].plan.notes), runs[False].plan.notes


def test_host_init_and_memory_budget():
    """A model built with host_init never had device values; with a budget the automatic plan places
    it (the profiling step runs on the host values and leaves them unchanged)."""
    ref = gpt()
    with protrain_fx.host_init("cpu"):
        torch.manual_seed(0)
        model = build("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    sd = model.state_dict()  # readable before any compile
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    opt, ref_opt = make_adamw(model), make_adamw(ref)
    total = sum(p.numel() * 4 for p in model.parameters())
    compiled = torch.compile(
        model,
        backend="protrain",
        options={
            "compiler": "eager",
            "optimizer": opt,
            "memory_budget": 5 * total,
            "chunk_size": "40KB",
        },
    )
    data = random_batches(3, 2, 16)
    assert train_steps(model, compiled, data, opt=opt) == pytest.approx(
        train_steps(ref, ref, data, opt=ref_opt), rel=LOSS_REL
    )
    plan = protrain_fx.get_plan(compiled)
    assert plan.predicted["peak_bytes"] <= 5 * total  # the automatic plan fits the budget


def test_budget_too_small_names_the_minimum():
    model = gpt()
    opt = make_adamw(model)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "optimizer": opt, "memory_budget": 1},
    )
    with pytest.raises(Exception, match=r"the smallest budget that would work is \d+ bytes"):
        compiled(*random_batches(1, 2, 16)[0])


def test_offloading_without_the_optimizer_is_exact():
    """With an optimizer protrain cannot run (SGD) and none given, the user's optimizer steps
    offloaded parameters itself, through their device views of host memory (exact; slow on a GPU,
    and the plan says so); SGD given by name is refused."""
    base = gpt()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, mine))
    compiled = torch.compile(
        mine, backend="protrain", options={"compiler": "eager", "n_persist": 0}
    )
    data = random_batches(3, 2, 16)
    ref_losses = train_steps(ref, ref, data, opt=ref_opt)
    losses = train_steps(mine, compiled, data, opt=opt)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= LOSS_REL
    sd, ref_sd = mine.state_dict(), ref.state_dict()
    assert max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd) <= PARAM_ABS
    assert max((ref_sd[k] - v).abs().max().item() for k, v in base.state_dict().items()) > 1e-4
    assert hybrid_optim.handle_of(opt) is None
    plan = protrain_fx.get_plan(compiled)
    assert set(c["placement"] for c in plan.to_dict()["chunks"]) == {"host"}
    assert any("stepped by your optimizer through device views" in n for n in plan.notes)
    assert any("cannot step offloaded chunks" in n and "SGD" in n for n in plan.notes), plan.notes
    with pytest.raises(OptionsError, match="torch.optim.Adam and torch.optim.AdamW"):
        protrain_fx.Options.from_dict({"optimizer": torch.optim.SGD(gpt().parameters(), lr=0.1)})


def test_a_budget_error_names_the_optimizer_found_that_cannot_offload():
    """The automatic plan under a budget that needs offloading, with only an SGD over the model:
    the error says which optimizer was found and that protrain steps Adam and AdamW."""
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "memory_budget": 1}
    )
    with pytest.raises(
        Exception, match=r"the optimizer\(s\) over this graph's parameters \(SGD\) cannot step"
    ):
        compiled(*random_batches(1, 2, 16)[0])
    del opt


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_an_adam_flag_protrain_cannot_honour_says_why_and_what_to_do(flag):
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{flag: True})
    compiled = torch.compile(
        model, backend="protrain", options={"compiler": "eager", "n_persist": 0}
    )
    with pytest.raises(Exception, match=rf"AdamW\({flag}=True\) is not supported: .*{flag}=False"):
        compiled(*random_batches(1, 2, 16)[0])
    del opt


@pytest.mark.usefixtures("whole_graph")
def test_dumps_show_chunk_ops(tmp_path):
    model = gpt()
    opt = make_adamw(model)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={"compiler": "eager", "n_persist": 1, "optimizer": opt, "dump_dir": str(tmp_path)},
    )
    train_steps(model, compiled, random_batches(1, 2, 8), opt=opt)
    (folder,) = tmp_path.iterdir()
    fw, bw = (folder / "fw.py").read_text(), (folder / "bw.py").read_text()
    for op in ("protrain.gather", "protrain.prefetch"):
        assert op in fw and op in bw, op
    assert "protrain.chunk_grad" in bw and "protrain.chunk_grad" not in fw


def test_state_read_right_after_a_step_is_current():
    """Offloaded chunks step inside backward on the host worker; once backward and opt.step()
    return, model.state_dict() (views of the masters) holds the stepped values."""
    torch.manual_seed(0)
    model = gpt()
    ref = copy.deepcopy(model)
    compiled = torch.compile(
        model,
        backend="protrain",
        options={
            "compiler": "eager",
            "n_persist": 0,
            "optimizer": (opt := make_adamw(model, lr=1e-2)),
        },
    )
    ref_opt = make_adamw(ref, lr=1e-2)
    for x, y in random_batches(3, 2, 16):
        for m, o in ((compiled, opt), (ref, ref_opt)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
        h = hybrid_optim.handle_of(opt)
        sd, ref_sd = model.state_dict(), ref.state_dict()  # right after the step
        for k in ref_sd:
            # a missed step: ~lr = 1e-2
            torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-4, atol=1e-4)
    assert h.timers.in_backward_steps >= 1


def _store_inputs(n_params=6, numel=1024):
    """Parameters as host_init leaves them (shells) with their values on the host, packed two per
    chunk."""
    torch.manual_seed(0)
    values = [torch.randn(numel) for _ in range(n_params)]
    params = [
        (
            f"w{i}",
            torch.nn.Parameter(
                chunk_store.device_shell((numel,), torch.float32, torch.device("cpu"))
            ),
        )
        for i in range(n_params)
    ]
    layout = protrain_fx.plan.layout.pack([(f, numel * 4) for f, _ in params], 2 * numel * 4)
    return values, params, layout


def test_store_frees_each_host_value_once_its_chunk_holds_it(monkeypatch):
    """Building a store from host values (host_init, a dissolved profiling store) never holds them
    all next to all of its chunks: each value is released before the next chunk is allocated."""
    import weakref

    values, params, layout = _store_inputs()
    events = []
    real = chunk_store.pinned.host_empty
    monkeypatch.setattr(
        chunk_store.pinned,
        "host_empty",
        lambda n, dtype, pin: events.append("alloc") or real(n, dtype, pin),
    )
    host_values = {}
    for (fqn, p), v in zip(params, values):
        host_values[id(p)] = v.clone()
        weakref.finalize(host_values[id(p)], events.append, f"freed {fqn}")
    store = chunk_store.ChunkStore(params, layout, 1, torch.float32, host_values)
    assert host_values == {}  # every value taken over
    # chunk 0 resident (its values moved to the "device"), chunks 1 and 2 offloaded: values of chunk
    # 1 are freed before chunk 2's master is allocated
    assert events == [
        "freed w0",
        "freed w1",
        "alloc",
        "freed w2",
        "freed w3",
        "alloc",
        "freed w4",
        "freed w5",
    ]
    for (fqn, p), v in zip(params, values):
        assert torch.equal(protrain_fx.runtime.param_values.value_of(p), v)
    assert store.n_persist == 1


def test_a_store_failing_half_built_gives_the_values_back(monkeypatch):
    """Out of host memory in the middle of building the store: the parameters keep their values (the
    chunks already built hand theirs back), and nothing is registered."""
    values, params, layout = _store_inputs()
    real, calls = chunk_store.pinned.host_empty, []

    def failing(n, dtype, pin):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("out of pinned memory")
        return real(n, dtype, pin)

    monkeypatch.setattr(chunk_store.pinned, "host_empty", failing)
    host_values = {id(p): v.clone() for (_, p), v in zip(params, values)}
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        chunk_store.ChunkStore(params, layout, 0, torch.float32, host_values)
    assert set(host_values) == {id(p) for _, p in params}
    for (_, p), v in zip(params, values):
        assert torch.equal(host_values[id(p)], v) and chunk_store.store_of(p) is None
