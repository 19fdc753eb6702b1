"""A model converted after its first compiled step (``model.to(dtype)``, ``.half()``): dynamo
compiles it again, but protrain's chunks hold the old dtype. Training it raised autograd's
"attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'" from
inside backward; now the compile refuses it with what to do (runtime/binding.py
``refuse_converted``), and evaluating the converted model gives eager's numbers."""

import copy

import pytest
import torch
from test_foreign_steps import adamw, gpt, offloaded

from protrain_fx.errors import ProtrainError
from protrain_fx.testing import random_batches


def test_a_model_converted_after_a_compiled_step_evaluates_as_eager_and_refuses_training():
    base = gpt()
    (x, y), (x2, y2) = random_batches(2, 2, 16, vocab=256, seed=0)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = offloaded(mine)
    for call, model in ((ref, ref), (compiled, mine)):
        opt = adamw(model.parameters())
        call(x, y).backward()
        opt.step()
        opt.zero_grad()
        model.to(torch.float64)
    with torch.no_grad():
        assert compiled(x2, y2).item() == ref(x2, y2).item()
    with pytest.raises(Exception) as caught:
        compiled(x2, y2)
    chain, e = [], caught.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(e, ProtrainError) for e in chain), chain
    assert "converted after its first compiled call" in str(caught.value)
    # the refusal changed nothing: the converted values are still there, evaluation still runs
    with torch.no_grad():
        assert compiled(x2, y2).item() == ref(x2, y2).item()
    assert all(
        torch.equal(a, b) for a, b in zip(ref.state_dict().values(), mine.state_dict().values())
    )
