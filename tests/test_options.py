"""Options: parsed, validated, unknown keys listed, unlanded features refused loudly."""

import pytest
import torch
from models import build

import protrain_fx
from protrain_fx import Options, OptionsError, parse_bytes
from protrain_fx.testing import random_batches


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("64KiB", 65536),
        ("123", 123),
        (4096, 4096),
        ("2gb", 2 * 10**9),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 parsecs", "GiB", "-3MB", 0, -1, True, 1.5, "1e9"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(OptionsError):
        parse_bytes(bad)


def test_defaults_and_supported_keys(tmp_path):
    o = Options.from_dict({"chunk_size": "1MiB", "dump_dir": str(tmp_path), "compiler": "eager"})
    assert o.chunk_size == 2**20 and o.dump_dir == str(tmp_path) and o.compiler == "eager"
    d = Options.from_dict(None)
    assert d.compiler == "inductor" and d.chunk_size is None and d.n_persist is None


def test_unknown_key_lists_valid_ones():
    with pytest.raises(OptionsError) as e:
        Options.from_dict({"chunksize": 1})
    for key in Options.valid_keys():
        assert key in str(e.value)
    assert "chunksize" in str(e.value)


def test_an_optimizer_protrain_cannot_step_says_what_to_do():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(OptionsError) as e:
        Options.from_dict({"optimizer": torch.optim.SGD([w], lr=0.1)})
    said = str(e.value)
    assert "got SGD" in said and "Adam" in said and "leave 'optimizer' out" in said, said


@pytest.mark.parametrize(
    "key, value",
    [
        ("optimizer", "adam"),
        ("n_persist", -1),
        ("n_buffer", 1.5),
        ("n_swap", True),
        ("n_shard", -2),
        ("compiler", "tvm"),
        ("param_dtype", "int8"),
        ("memory_budget", "lots"),
        ("chunk_size", 0),
        ("dump_dir", 3),
    ],
)
def test_bad_values(key, value):
    with pytest.raises(OptionsError, match=key):
        Options.from_dict({key: value})


def test_chunk_options_parse():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    o = Options.from_dict(
        {
            "optimizer": opt,
            "memory_budget": "24GiB",
            "param_dtype": "bfloat16",
            "n_persist": 3,
            "n_buffer": 2,
            "n_swap": 1,
            "n_checkpoint": 2,
        }
    )
    assert o.optimizer is opt and o.memory_budget == 24 * 2**30 and o.param_dtype == torch.bfloat16
    assert (o.n_persist, o.n_buffer, o.n_swap, o.n_checkpoint) == (3, 2, 1, 2)


def test_n_shard_is_a_knob_like_the_others():
    """n_shard may be given alone (the automatic plan searches the rest: plan/ranks_cost.py prices
    chunks sharded on the devices) or with the other knobs; unset, the automatic plan chooses it."""
    assert Options.from_dict({"n_shard": 1, "memory_budget": "1GiB"}).n_shard == 1
    o = Options.from_dict({"n_shard": 2, "n_persist": 1, "n_swap": 0, "n_checkpoint": 1})
    assert (o.n_shard, o.n_persist) == (2, 1)
    assert Options.from_dict({}).n_shard is None


def test_env_dump_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PROTRAIN_DUMP_DIR", str(tmp_path))
    assert Options.from_dict({}).dump_dir == str(tmp_path)
    assert Options.from_dict({"dump_dir": str(tmp_path / "x")}).dump_dir == str(tmp_path / "x")


def test_bad_options_fail_the_compile_with_the_message():
    model = build("gpt", n_layer=1, n_embd=16, n_head=2)
    x, y = random_batches(1, 1, 4)[0]
    # the error's own class, not dynamo's BackendCompilerFailed around it (``except ValueError``)
    with pytest.raises(OptionsError, match="unknown protrain option") as e:
        torch.compile(model, backend="protrain", options={"budget": "1GiB"})(x, y)
    assert isinstance(e.value, ValueError)
    torch._dynamo.reset()
    with pytest.raises(OptionsError, match="n_swap: expected an int"):
        torch.compile(model, backend="protrain", options={"n_swap": "all"})(x, y)


def test_mode_is_rejected():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(OptionsError, match="takes no mode"):
        torch.compile(model, backend="protrain", mode="max-autotune")(torch.randn(1, 2))


def test_chunk_size_below_largest_parameter_gives_it_a_chunk_of_its_own():
    # largest: the 256 x 16 fp32 embedding, 16 KiB
    model = build("gpt", n_layer=1, n_embd=16, n_head=2)
    x, y = random_batches(1, 1, 4)[0]
    compiled = torch.compile(model, backend="protrain", options={"chunk_size": "4KiB"})
    assert torch.isfinite(compiled(x, y))
    plan = protrain_fx.get_plan(compiled)
    big = [c for c in plan.chunks if c.bytes > plan.chunk_size]
    # the token embedding (and the position embedding, 8 KiB) each in a chunk of its own
    assert big[0].params == ["wte.weight"] and big[0].bytes == 16384
    assert all(len(c.params) == 1 for c in big)
    with pytest.raises(Exception, match="smaller than the 64 B alignment"):
        torch._dynamo.reset()
        torch.compile(
            build("gpt", n_layer=1, n_embd=16, n_head=2),
            backend="protrain",
            options={"chunk_size": 32},
        )(x, y)
