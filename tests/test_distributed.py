"""Data-parallel protrain with gloo and two processes: the same global batch split over the ranks trains
like single-process eager PyTorch on the whole batch (losses and parameters after several AdamW steps),
with offloaded chunks sharded over the ranks and resident chunks replicated."""
import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
STEPS = 4
LOSS_REL, PARAM_ABS = 1e-5, 1e-4


def batches(kind: str):
    from protrain_fx.testing import random_batches

    return random_batches(STEPS, 4, 16, vocab=64, seed=3)  # global batch 4: 2 rows per rank


def model_of(kind: str):
    from models import build

    torch.manual_seed(0)
    if kind == "gpt":
        return build("gpt", n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    return build("llama", n_layer=3, dim=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def _rank_main(rank: int, init_file: str, kind: str, options: dict, out_dir: str, clip, micro: int = 1) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch.distributed as dist

    import protrain_fx
    from protrain_fx import chunks
    from protrain_fx.testing import make_adamw

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = model_of(kind)
        opt = make_adamw(model)
        compiled = torch.compile(model, backend="protrain", options=dict(options, optimizer=opt))
        losses = []
        for x, y in batches(kind):
            rows = slice(rank * 2, rank * 2 + 2)
            xs, ys = x[rows].chunk(micro), y[rows].chunk(micro)  # gradient accumulation over micro-batches
            loss = 0
            for xm, ym in zip(xs, ys):
                part = compiled(xm, ym) / micro
                part.backward()
                loss = loss + part.detach()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / WORLD)
        sd = model.state_dict()  # a collective for sharded chunks: every rank calls it
        osd = opt.state_dict()  # so is this: the moments of offloaded chunks are gathered
        plan = protrain_fx.get_plan(compiled)
        store = chunks.store_of(next(model.parameters()))
        off = store.offloaded_chunks
        torch.save({"losses": losses, "state": sd, "opt_state": osd["state"], "n_persist": plan.n_persist, "n_chunks": len(plan.chunks),
                    "world": store.world.size, "host_share": [store.host_numel(c) / store.chunk_numel(c) for c in off],
                    "host_master": sum(store.master[c].numel() for c in off), "offloaded": len(off),
                    "predicted": {k: v for k, v in (plan.predicted or {}).items() if k not in ("timeline", "profiled")}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(kind: str, options: dict, clip=None, micro: int = 1) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(os.path.join(d, "init"), kind, options, d, clip, micro), nprocs=WORLD,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]


def eager_reference(kind: str, clip=None):
    from protrain_fx.testing import make_adamw, train_steps

    model = model_of(kind)
    opt = make_adamw(model)
    losses = train_steps(model, model, batches(kind), opt=opt, clip=clip)
    eager_reference.opt_state = opt.state_dict()["state"]
    return model, losses


@pytest.mark.parametrize("kind,options,clip,micro", [
    ("gpt", {"compiler": "eager", "n_persist": 2}, None, 1),  # chunks 0-1 replicated, the rest sharded
    ("llama", {"compiler": "eager", "n_persist": 0, "n_checkpoint": 2}, None, 1),
    ("gpt", {"compiler": "eager", "n_persist": 1, "n_swap": 1}, 1.0, 1),  # clipping: the norm spans the ranks
    ("gpt", {"compiler": "eager", "n_persist": 2}, None, 2),  # two micro-batches per step on each rank
])
def test_two_ranks_train_like_eager_on_the_whole_batch(kind, options, clip, micro):
    ranks = run_ranks(kind, options, clip, micro)
    ref, ref_losses = eager_reference(kind, clip)
    ref_sd = ref.state_dict()
    assert ranks[0]["n_persist"] == options["n_persist"] < ranks[0]["n_chunks"]
    for r in ranks:  # each rank holds half of every offloaded chunk on the host
        assert r["world"] == WORLD and r["offloaded"] >= 1 and r["host_share"] == [0.5] * r["offloaded"]
    for r in ranks:
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
        assert rel <= LOSS_REL, (r["losses"], ref_losses)
        for k, v in ref_sd.items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=PARAM_ABS, msg=k)
        ref_opt = eager_reference.opt_state  # torch's format, the whole moments on every rank
        assert sorted(r["opt_state"]) == sorted(ref_opt)
        for idx, st in ref_opt.items():
            assert float(r["opt_state"][idx]["step"]) == float(st["step"])
            torch.testing.assert_close(r["opt_state"][idx]["exp_avg"], st["exp_avg"], rtol=1e-3, atol=1e-6)
    moved = max((ref_sd[k] - model_of(kind).state_dict()[k]).abs().max().item() for k in ref_sd)
    assert moved > 10 * PARAM_ABS  # the steps did move the parameters


def test_two_ranks_share_one_automatic_plan():
    """The automatic plan profiles on both ranks (collectives included) and runs rank 0's choice on both."""
    budget = 3 * sum(p.numel() * 4 for p in model_of("gpt").parameters())
    ranks = run_ranks("gpt", {"compiler": "eager", "memory_budget": budget})
    ref, ref_losses = eager_reference("gpt")
    assert ranks[0]["n_persist"] == ranks[1]["n_persist"] < ranks[0]["n_chunks"]
    for r in ranks:  # the collectives were measured and priced, and both ranks hold rank 0's prediction
        assert r["predicted"]["world_size"] == WORLD and r["predicted"]["collective_gb_s"] > 0
        assert r["predicted"] == ranks[0]["predicted"]
    for r in ranks:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) <= LOSS_REL
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=PARAM_ABS, msg=k)


def test_dp_bench_cpu_smoke(tmp_path):
    """benchmarks/dp_bench.py (the 2-GPU benchmark) runs its protrain rows under torchrun with gloo."""
    import json
    import subprocess

    out = tmp_path / "dp"
    subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", "dp_bench.py"), "--device", "cpu", "--tiny",
                    "--gpus", "2", "--steps", "1", "--warmup", "1", "--batch", "2", "--systems", "protrain1,protrain",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "dp.json").read_text())["rows"]
    assert [(r["system"], r["gpus"]) for r in rows] == [("protrain", 1), ("protrain", 2)]
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in rows)
    assert (tmp_path / "dp.md").read_text().count("| protrain |") == 2
