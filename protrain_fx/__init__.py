"""protrain-fx: ProTrain (arXiv 2406.08334) as a torch.compile backend.

    model = torch.compile(model, backend="protrain", options={...})
    print(protrain_fx.get_plan(model).summary())

Importing this package is optional: the ``torch_dynamo_backends`` entry point registers the backend.
"""

from protrain_fx._version import __version__
from protrain_fx.config import configure
from protrain_fx.errors import OptionsError, ProtrainError
from protrain_fx.options import Options, parse_bytes
from protrain_fx.plan.plan import BlockPlan, ChunkPlan, Plan, get_plan
from protrain_fx.report.memory_plot import plot_memory
from protrain_fx.runtime.hybrid_optim import set_grad_accumulation
from protrain_fx.runtime.param_values import host_init

__all__ = [
    "__version__",
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
