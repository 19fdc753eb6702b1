"""protrain-fx: ProTrain (arXiv 2406.08334) as a torch.compile backend.

    model = torch.compile(model, backend="protrain", options={...})
    print(protrain_fx.get_plan(model).summary())

Importing this package is optional: the ``torch_dynamo_backends`` entry point registers the backend.
"""
from ._version import __version__
from .config import configure
from .memory_plot import plot_memory
from .optim import set_grad_accumulation
from .options import Options, OptionsError, ProtrainError, parse_bytes
from .param_values import host_init
from .plan import BlockPlan, ChunkPlan, Plan, get_plan

__all__ = [
    "BlockPlan",
    "ChunkPlan",
    "Options",
    "OptionsError",
    "Plan",
    "configure",
    "ProtrainError",
    "get_plan",
    "host_init",
    "parse_bytes",
    "plot_memory",
    "set_grad_accumulation",
]
