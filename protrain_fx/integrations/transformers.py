"""protrain for Hugging Face's ``Trainer``: one callback.

    from protrain_fx.integrations.transformers import ProtrainCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ProtrainCallback()])

``ProtrainCallback(**options)`` takes protrain's options (``memory_budget="24GiB"``, ``compiler``,
``n_persist``, ...; see the README) except ``optimizer``: offloading chunks needs the optimizer
object (protrain steps offloaded chunks on the CPU itself), and that is the one the Trainer builds
inside ``train()``. accelerate, which compiles the model for
``TrainingArguments(torch_compile=True)``, has no route for a custom backend:
``TorchDynamoPlugin.__post_init__`` converts the name with ``DynamoBackend(backend.upper())``, an
enum of accelerate's own backends ("'PROTRAIN' is not a valid DynamoBackend"), and it could not hand
the backend the optimizer anyway. So the callback compiles the model itself, in place
(``model.compile(backend="protrain", options=...)``: the same module object, ``forward`` signature
and ``state_dict`` keys, so the Trainer's column removal, ``ModelOutput`` handling, checkpoints and
``save_model`` see the model they expect; no ``remove_unused_columns=False``), at
``on_train_begin``: the moment the Trainer has built its optimizer (the one ``optimizers=`` passed,
else the one ``TrainingArguments.optim`` names), wrapped it for accelerate, made the LR scheduler
and, when resuming, loaded the checkpoint's model and optimizer states. A callback rather than a
``Trainer`` subclass because it composes with any ``Trainer`` subclass (TRL's ``SFTTrainer``, a
project's own) and needs no copy of the Trainer's optimizer logic. Gradient accumulation (declared
to protrain up front), clipping, LR schedules, checkpoints and resuming need nothing more: protrain
keeps them exact (README, "What protrain guarantees"). What protrain cannot train with raises a
``ProtrainError`` saying what to do, at ``Trainer(...)`` when the arguments show it, else at
``train()``.

Notes. The Trainer (transformers 5.x) computes the gradient norm every step through
``clip_grad_norm_``, with ``max_norm=inf`` when ``max_grad_norm`` is 0; that multiplies every
gradient by exactly 1, which protrain recognises as no write, so offloaded chunks keep stepping
inside backward. A norm that really clips (``max_grad_norm`` above the norm) writes the gradients:
protrain then steps offloaded chunks at ``optimizer.step()`` (exact; on a GPU that step no longer
overlaps backward).
With ``gradient_checkpointing=True`` protrain's per-block plan (keep, swap or recompute, chosen to
fit the memory budget) replaces Hugging Face's recompute inside the transformer blocks: the callback
turns Hugging Face's off before compiling (torch.compile cannot trace the layers transformers 5.25
checkpoints, which would then run eagerly, outside the plan) and logs one line saying so.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from protrain_fx import Options, ProtrainError, set_grad_accumulation

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the module is about transformers
    raise ImportError(
        "protrain_fx.integrations.transformers needs transformers and accelerate "
        "(pip install transformers accelerate)"
    ) from e

__all__ = ["SUPPORTED_OPTIM", "ProtrainCallback"]

logger = logging.getLogger(__name__)

#: ``TrainingArguments.optim`` values whose optimizer protrain can take over (torch.optim.AdamW).
SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused")
_OPTIMIZER_TYPES = (torch.optim.AdamW, torch.optim.Adam)


class ProtrainCallback(TrainerCallback):
    """Compile the Trainer's model in place with ``backend="protrain"`` and the Trainer's optimizer.

    ``options`` are protrain's, validated here (an unknown key or a bad value: ``OptionsError``).
    """

    def __init__(self, **options: Any):
        if "optimizer" in options:
            raise ProtrainError(
                "ProtrainCallback: leave out 'optimizer': protrain takes over the optimizer the "
                "Trainer builds (pass yours as Trainer(optimizers=(opt, scheduler)))"
            )
        Options.from_dict(options)
        self.options = dict(options)
        self._compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ref(opt)

    def on_init_end(self, args, state, control, optimizer=None, **kwargs):
        _check_args(args, optimizer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        _check_args(args, optimizer)
        if model is None or optimizer is None:
            raise ProtrainError(
                "ProtrainCallback: the Trainer handed on_train_begin no model or "
                "no optimizer; compiling with protrain needs both"
            )
        opt = _unwrap(optimizer)
        if type(opt) not in _OPTIMIZER_TYPES:
            raise ProtrainError(
                f"ProtrainCallback: protrain takes over torch.optim.AdamW or torch.optim.Adam "
                f"only, the Trainer's optimizer is {type(opt).__name__}; use "
                f"TrainingArguments(optim='adamw_torch') (or 'adamw_torch_fused'), or pass "
                f"Trainer(optimizers=(torch.optim.AdamW(...), scheduler))"
            )
        done = self._compiled.get(model)
        if done is not None and done() is opt:
            return  # train() again with the same optimizer: compiled for it already
        if getattr(model, "_compiled_call_impl", None) is not None:
            raise ProtrainError(
                f"ProtrainCallback: the {type(model).__name__} is already compiled "
                f"(model.compile(), or an earlier train() with another optimizer); pass the model "
                f"uncompiled, and ProtrainCallback compiles it with protrain and the Trainer's "
                f"optimizer"
            )
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            _checkpointing_off(model)
            logger.warning(
                "ProtrainCallback: gradient checkpointing is on; protrain's per-block plan (keep, "
                "swap or recompute each block, chosen to fit the memory budget) replaces Hugging "
                "Face's recompute inside the transformer blocks, so the callback turned it off "
                "(torch.compile cannot trace layers checkpointed by transformers >= 5.25; "
                "ProtrainCallback(n_checkpoint=N) makes N blocks recompute)"
            )
        set_grad_accumulation(opt, int(args.gradient_accumulation_steps))
        model.compile(backend="protrain", options={**self.options, "optimizer": opt})
        self._compiled[model] = weakref.ref(opt)
        logger.info(
            "ProtrainCallback: compiled the %s in place with backend='protrain' and the "
            "Trainer's %s (options %s)",
            type(model).__name__,
            type(opt).__name__,
            self.options,
        )


def _checkpointing_off(model: torch.nn.Module) -> None:
    """Turn the model's own activation checkpointing off (its method, else each module's flag)."""
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        disable = getattr(model, name, None)
        if callable(disable):
            disable()
            break
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer under accelerate's ``AcceleratedOptimizer`` (and any such wrapper)."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def _check_args(args, optimizer) -> None:
    """Refuse TrainingArguments that protrain cannot train with, naming what to do instead."""
    if getattr(args, "torch_compile", False):
        raise ProtrainError(
            "ProtrainCallback compiles the model with protrain itself: leave TrainingArguments("
            "torch_compile, torch_compile_backend, torch_compile_mode) unset (accelerate would "
            "compile it a second time, and takes only its own backend names)"
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ProtrainError(
            "ProtrainCallback: protrain offloads and shards model states itself; "
            "leave out TrainingArguments(deepspeed=..., fsdp=...)"
        )
    world = int(getattr(args, "world_size", 1))
    if world > 1:
        raise ProtrainError(
            f"ProtrainCallback runs in one process (world_size is {world}): accelerate would wrap "
            f"the model in DistributedDataParallel, and protrain averages gradients and shards "
            f"offloaded chunks itself under torch.distributed; for data parallelism use protrain "
            f"directly under torchrun (examples/train.py)"
        )
    optim = getattr(args.optim, "value", args.optim)
    if optimizer is None and optim not in SUPPORTED_OPTIM:
        raise ProtrainError(
            f"ProtrainCallback: TrainingArguments(optim={optim!r}) is not an optimizer protrain "
            f"can take over; use optim='adamw_torch' or 'adamw_torch_fused' (torch.optim.AdamW), "
            f"or pass Trainer(optimizers=(torch.optim.AdamW(...) or torch.optim.Adam(...), "
            f"scheduler))"
        )
