"""Data-parallel protrain with gloo and two processes (three for the cases with chunks sharded on
the devices): the same global batch split over the ranks trains like single-process eager PyTorch
on the whole batch (losses and parameters after several AdamW steps), with offloaded chunks sharded
over the ranks, resident chunks replicated, and chunks sharded on the devices (``n_shard``: each
rank keeps its shard of master, gradient and moments in device memory)."""

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


def batches(kind: str, world: int = WORLD):
    from protrain_fx.testing import random_batches

    # 2 rows per rank: global batch 4 with two ranks
    return random_batches(STEPS, 2 * world, 16, vocab=64, seed=3)


def model_of(kind: str):
    from models import build

    torch.manual_seed(0)
    if kind == "gpt":
        return build("gpt", n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    return build(
        "llama", n_layer=3, dim=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=64, max_seq_len=16
    )


NO_ACT = {"n_swap": 0, "n_checkpoint": 0}
# (kind, options, clip, micro-batches per step) of the parity cases, all trained in one pair of
# processes
CASES = [
    # chunks 0-1 replicated, the rest sharded
    ("gpt", {"compiler": "eager", "n_persist": 2}, None, 1),
    ("llama", {"compiler": "eager", "n_persist": 0, "n_checkpoint": 2}, None, 1),
    # clipping: the norm spans the ranks
    ("gpt", {"compiler": "eager", "n_persist": 1, "n_swap": 1}, 1.0, 1),
    # two micro-batches per step on each rank
    ("gpt", {"compiler": "eager", "n_persist": 2}, None, 2),
    # Inductor: resident gradients averaged in place while the graph goes on (its buffers must stay
    # theirs); one chunk sharded on the devices
    ("gpt", {"compiler": "inductor", "n_persist": 3, "n_shard": 1, **NO_ACT}, None, 2),
    # chunks sharded on the devices beside offloaded ones, a swapped block, clipping
    (
        "gpt",
        {"compiler": "eager", "n_persist": 1, "n_shard": 2, "n_swap": 1, "n_checkpoint": 0},
        1.0,
        1,
    ),
    # every resident chunk sharded (ZeRO-3), recomputed blocks, two micro-batches
    (
        "llama",
        {"compiler": "eager", "n_persist": 0, "n_shard": 3, "n_swap": 0, "n_checkpoint": 1},
        None,
        2,
    ),
    # the automatic plan on both ranks, under 3x the fp32 parameter bytes (40,736 parameters): some
    # chunks must be offloaded; it prices chunks sharded on the devices and may choose some
    ("gpt", {"compiler": "eager", "memory_budget": 3 * 4 * 40_736}, None, 1),
    # the same with one chunk sharded on the devices given: the rest searched around it
    ("gpt", {"compiler": "eager", "memory_budget": 3 * 4 * 40_736, "n_shard": 1}, None, 1),
]
AUTOMATIC = 2  # the last cases: automatic plans


def _rank_main(rank: int, init_file: str, out_dir: str, world: int, cases: list) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    os.environ["PROTRAIN_PLAN_CACHE"] = "0"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from protrain_fx import pipeline

    try:
        for case, (kind, options, clip, micro) in enumerate(cases):
            torch._dynamo.reset()
            graphs = []  # the collectives and shard ops of each compiled graph, in order

            def record(stage):
                def probe(gm, plan):
                    graphs.append((stage, [_short(n) for n in gm.graph.nodes if _short(n)]))
                    return gm

                return probe

            with (
                pipeline.probe("forward", record("forward"), "record_forward"),
                pipeline.probe("backward", record("backward"), "record_backward"),
            ):
                result = _train_case(rank, world, kind, options, clip, micro)
            result["graphs"] = graphs
            torch.save(result, os.path.join(out_dir, f"case{case}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _short(node) -> str | None:
    """A collective or shard op of a graph, by a short name (None for any other node)."""
    name = str(node.target) if node.op == "call_function" else ""
    for short in ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
        if name.startswith("_c10d_functional." + short):
            return short
    for short in ("shard_values", "pack_grads", "shard_grad", "gather", "chunk_grad"):
        if name == f"protrain.{short}.default":
            return short
    return None


def _train_case(rank: int, world: int, kind: str, options: dict, clip, micro: int) -> dict:
    import torch.distributed as dist

    import protrain_fx
    from protrain_fx.testing import make_adamw, stores_of

    model = model_of(kind)
    opt = make_adamw(model)
    compiled = torch.compile(model, backend="protrain", options=dict(options, optimizer=opt))
    losses = []
    for x, y in batches(kind, world):
        rows = slice(rank * 2, rank * 2 + 2)
        # gradient accumulation over micro-batches
        xs, ys = x[rows].chunk(micro), y[rows].chunk(micro)
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
        losses.append(mean.item() / world)
    sd = model.state_dict()  # a collective for sharded chunks: every rank calls it
    osd = opt.state_dict()  # so is this: the moments of offloaded chunks are gathered
    plan = protrain_fx.get_plan(compiled)
    stores = stores_of(model)  # one per region of the compiled graph
    return {
        "losses": losses,
        "state": sd,
        "opt_state": osd["state"],
        "n_persist": plan.n_persist,
        "n_shard": plan.n_shard,
        "sharded_chunks": sum(c.placement == "sharded" for c in plan.chunks),
        "home_on_device": sum(s.home_on_device(c) for s in stores for c in s.offloaded_chunks),
        # the host bytes the stores report, and what their host-side tensors add up to
        "host_bytes": sum(s.host_bytes for s in stores),
        "host_tensor_bytes": sum(_host_tensor_bytes(s) for s in stores),
        "n_chunks": len(plan.chunks),
        "world": stores[0].world.size,
        "host_share": [
            s.host_numel(c) / s.chunk_numel(c) for s in stores for c in s.offloaded_chunks
        ],
        "offloaded": sum(len(s.offloaded_chunks) for s in stores),
        "resident_all_reduces": sum(s.stats.get("resident_all_reduces", 0) for s in stores),
        "predicted": {
            k: v for k, v in (plan.predicted or {}).items() if k not in ("timeline", "profiled")
        },
    }


def _host_tensor_bytes(store) -> int:
    """Masters and gradient accumulators of the chunks on the host, and the gradient staging: a
    chunk sharded on the device counts for nothing."""
    host = [c for c in store.offloaded_chunks if not store.home_on_device(c)]
    tensors = [store.master[c] for c in host] + [store.grad[c] for c in host if c in store.grad]
    tensors += store._staging.free if store._staging is not None else []
    return sum(t.numel() * t.element_size() for t in tensors)


def _train_all(world: int, cases: list) -> list:
    """Every case's per-rank results, from one group of ``world`` processes."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _rank_main,
            args=(os.path.join(d, "init"), d, world, cases),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [
            [torch.load(os.path.join(d, f"case{c}_rank{r}.pt")) for r in range(world)]
            for c in range(len(cases))
        ]


@pytest.fixture(scope="module")
def trained():
    return _train_all(WORLD, CASES)


# the cases with chunks sharded on the devices, over three ranks: chunk element counts padded to
# a multiple of 3, shards of a third
SHARDED_CASES = [c for c in CASES[:-AUTOMATIC] if c[1].get("n_shard")]


@pytest.fixture(scope="module")
def trained_by_three():
    return _train_all(3, SHARDED_CASES)


def eager_reference(kind: str, clip=None, world: int = WORLD):
    from protrain_fx.testing import make_adamw, train_steps

    model = model_of(kind)
    opt = make_adamw(model)
    losses = train_steps(model, model, batches(kind, world), opt=opt, clip=clip)
    eager_reference.opt_state = opt.state_dict()["state"]
    return model, losses


@pytest.mark.parametrize("case", range(len(CASES) - AUTOMATIC))
def test_two_ranks_train_like_eager_on_the_whole_batch(trained, case):
    check_case(CASES[case], trained[case], WORLD)


@pytest.mark.parametrize("case", range(len(SHARDED_CASES)))
def test_three_ranks_with_chunks_sharded_on_the_devices_train_like_eager(trained_by_three, case):
    check_case(SHARDED_CASES[case], trained_by_three[case], 3)


def check_case(case, ranks, world: int) -> None:
    kind, options, clip, micro = case
    assert ranks[0]["n_persist"] == options["n_persist"] < ranks[0]["n_chunks"]
    for r in ranks:  # each rank holds its share of every offloaded chunk on the host
        assert (
            r["world"] == world
            and r["offloaded"] >= 1
            and r["host_share"] == pytest.approx([1 / world] * r["offloaded"])
        )
        # resident chunks' gradients were all-reduced from inside backward: one per chunk and
        # backward pass (with several ranks graphs are compiled whole, not in regions)
        assert r["resident_all_reduces"] == options["n_persist"] * STEPS * micro
        # n_shard chunks keep their shards on the device; the host holds the others' master,
        # gradient and moments only (the moments are the optimizer's, not counted here)
        n_shard = options.get("n_shard", 0)
        assert r["n_shard"] == r["sharded_chunks"] == r["home_on_device"] == n_shard
        assert r["host_bytes"] == r["host_tensor_bytes"]
        check_sharded_graphs(r["graphs"], n_shard)
    check_like_eager(ranks, kind, clip, world)


def check_sharded_graphs(graphs, n_shard: int) -> None:
    """Chunks sharded on the devices are gathered and reduce-scattered by functional collectives in
    the graphs (passes/chunk_gather.py, optimizer_calls.py), each all-gather started before the
    previous one's wait (passes/shard_prefetch.py); offloaded chunks by protrain's own ops."""
    forward = [ops for stage, ops in graphs if stage == "forward"]
    backward = [ops for stage, ops in graphs if stage == "backward"]
    assert forward and backward
    for ops in forward + backward:
        gathers = [i for i, op in enumerate(ops) if op == "all_gather_into_tensor"]
        waits = [i for i, op in enumerate(ops) if op == "wait_tensor"]
        assert ops.count("shard_values") == len(gathers)
        if len(gathers) > 1:
            assert gathers[1] < waits[0]  # the next chunk's all-gather runs beside this chunk
    assert sum(ops.count("all_gather_into_tensor") for ops in forward) == n_shard
    assert sum(ops.count("reduce_scatter_tensor") for ops in backward) == n_shard
    assert sum(ops.count("shard_grad") for ops in backward) == n_shard


def check_like_eager(ranks, kind, clip=None, world: int = WORLD):
    ref, ref_losses = eager_reference(kind, clip, world)
    ref_sd = ref.state_dict()
    for r in ranks:
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
        assert rel <= LOSS_REL, (r["losses"], ref_losses)
        for k, v in ref_sd.items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=PARAM_ABS, msg=k)
        ref_opt = eager_reference.opt_state  # torch's format, the whole moments on every rank
        assert sorted(r["opt_state"]) == sorted(ref_opt)
        for idx, st in ref_opt.items():
            assert float(r["opt_state"][idx]["step"]) == float(st["step"])
            torch.testing.assert_close(
                r["opt_state"][idx]["exp_avg"], st["exp_avg"], rtol=1e-3, atol=1e-6
            )
    moved = max((ref_sd[k] - model_of(kind).state_dict()[k]).abs().max().item() for k in ref_sd)
    assert moved > 10 * PARAM_ABS  # the steps did move the parameters


@pytest.mark.parametrize("case", [-2, -1])
def test_two_ranks_share_one_automatic_plan(trained, case):
    """The automatic plan profiles on both ranks (collectives included) and runs rank 0's choice
    on both: its resident, sharded and offloaded chunks as it priced them (a given n_shard kept)."""
    ranks, options = trained[case], CASES[case][1]
    assert ranks[0]["n_persist"] == ranks[1]["n_persist"] < ranks[0]["n_chunks"]
    # the collectives were measured and priced, and both ranks hold rank 0's prediction
    for r in ranks:
        assert r["predicted"]["world_size"] == WORLD and r["predicted"]["collective_gb_s"] > 0
        assert r["predicted"] == ranks[0]["predicted"]
        # the plan runs the knobs it priced: its chunks sharded on the devices keep their shards
        # there, and the predicted peak counts them
        assert r["n_shard"] == r["sharded_chunks"] == r["home_on_device"]
        assert r["host_bytes"] == r["host_tensor_bytes"]
    if "n_shard" in options:
        assert ranks[0]["n_shard"] == options["n_shard"]
    check_like_eager(ranks, "gpt")


def test_dp_bench_cpu_smoke(tmp_path):
    """benchmarks/dp_bench.py (the 2-GPU benchmark) runs its two-rank protrain row under torchrun
    with gloo."""
    import json
    import subprocess

    out = tmp_path / "dp"
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "..", "benchmarks", "dp_bench.py"),
            "--device",
            "cpu",
            "--tiny",
            "--gpus",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--batch",
            "2",
            "--systems",
            "protrain",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    rows = json.loads((tmp_path / "dp.json").read_text())["rows"]
    assert [(r["system"], r["gpus"]) for r in rows] == [("protrain", 2)]
    assert rows[0]["tokens_per_s"] > 0 and "error" not in rows[0]
    assert (tmp_path / "dp.md").read_text().count("| 1 | protrain | 2 |") == 1
