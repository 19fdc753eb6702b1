"""A Hugging Face ``Trainer`` with ``callbacks=[ProtrainCallback(...)]`` trains exactly like the
plain Trainer (issue 26; protrain_fx/integrations/transformers.py).

Every test trains a small randomly initialised ``LlamaForCausalLM`` (width 64, 2 layers, vocab 256,
its own loss through ``labels=``) twice from the same init on the same data, CPU, fp32, AdamW lr
1e-2 (one wrong step is far above the tolerances): with the plain Trainer and with ProtrainCallback,
with chunks really offloaded to the host (asserted from the plan). It checks the per-step losses
within 1e-5 relative, every ``state_dict()`` entry within 1e-3 absolute, and that training moved the
parameters (> 1e-4). Most tests use the eager compiler and every chunk on the host
(``n_persist=0``); one uses Inductor and one the automatic plan under a memory budget. Settings
protrain cannot train with must raise a ProtrainError.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hf_models import hf_llama, largest_param_bytes

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import protrain_fx  # noqa: E402
from protrain_fx.errors import OptionsError, ProtrainError
from protrain_fx.integrations.transformers import ProtrainCallback  # noqa: E402
from protrain_fx.runtime.hybrid_optim import handle_of
from protrain_fx.testing import stores_of

LR = 1e-2
LOSS_REL, PARAM_ABS, MIN_UPDATE = 1e-5, 1e-3, 1e-4
VOCAB, SEQ, BATCH = 256, 16, 2


# ---------------------------------------------------------------------------------------- helpers
def tiny_llama():
    return hf_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)


class Tokens(torch.utils.data.Dataset):
    """``n`` random rows of ``SEQ`` tokens; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(transformers.Trainer):
    """The plain Trainer, recording the loss of every training step (unrounded, unlike the logs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def training_args(out, **overrides):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        max_steps=3,
        learning_rate=LR,
        weight_decay=0.1,
        optim="adamw_torch",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def offload_all(model, compiler="eager"):
    """Every chunk on the host (chunk_size: the largest parameter, rounded up)."""
    chunk = -(-largest_param_bytes(model) // 1000) * 1000
    return {"compiler": compiler, "n_persist": 0, "chunk_size": chunk}


def train(model, out, *, protrain=None, data=None, trainer_kw=None, train_kw=None, **args_kw):
    """Train ``model`` with a (Recording) Trainer; ``protrain``: ProtrainCallback's options, or None
    for the plain Trainer. Returns the trainer."""
    trainer_kw = dict(trainer_kw or {})
    callbacks = list(trainer_kw.pop("callbacks", []))
    if protrain is not None:
        torch._dynamo.reset()
        callbacks.append(ProtrainCallback(**protrain))
    trainer = Recording(
        model=model,
        args=training_args(out, **args_kw),
        train_dataset=data or Tokens(12),
        callbacks=callbacks,
        **trainer_kw,
    )
    trainer.train(**(train_kw or {}))
    return trainer


def sd_diff(a, b, keys=None):
    return max(
        (a[k].detach().double() - b[k].detach().double()).abs().max().item() for k in (keys or b)
    )


def rel_err(xs, ys):
    assert len(xs) == len(ys) > 0, (xs, ys)
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(xs, ys))


def host_chunks(model) -> int:
    placements = [c["placement"] for c in protrain_fx.get_plan(model).to_dict()["chunks"]]
    assert "host" in placements, f"no chunk was offloaded: {placements}"
    return placements.count("host")


def check(base, ref, mine, ref_losses, losses, what=""):
    """Losses and every state_dict() entry of ``mine`` against ``ref``, and that ``mine`` has chunks
    on the host; returns (loss rel, param abs)."""
    host = host_chunks(mine)
    loss_rel = rel_err(losses, ref_losses)
    base_sd, ref_sd, mine_sd = base.state_dict(), ref.state_dict(), mine.state_dict()
    assert set(mine_sd) == set(ref_sd)
    update = sd_diff(ref_sd, base_sd)
    param_abs = sd_diff(mine_sd, ref_sd)
    print(
        f"\n[{what}] loss rel {loss_rel:.3g}, param abs {param_abs:.3g}, update {update:.3g}, "
        f"{host} chunks on the host, losses {losses}"
    )
    assert loss_rel <= LOSS_REL, (losses, ref_losses)
    assert update > MIN_UPDATE, f"plain training did not move the parameters ({update})"
    assert param_abs <= PARAM_ABS, f"parameters differ from the plain Trainer's by {param_abs:.3g}"
    return loss_rel, param_abs


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# -------------------------------------------------------------------------------- training habits
def test_gradient_accumulation_automatic_plan(tmp_path):
    """gradient_accumulation_steps=2 (declared to protrain by the callback), no clipping, under the
    automatic plan: a memory budget below the model's states makes it offload."""
    base = tiny_llama()
    options = {"compiler": "eager", "memory_budget": 600_000}
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=0.0, data=Tokens(12))
    ref = train(copy.deepcopy(base), tmp_path / "ref", **kw)
    mine = copy.deepcopy(base)
    trainer = train(mine, tmp_path / "mine", protrain=options, **kw)
    assert len(trainer.losses) == 6 and trainer.state.global_step == 3
    assert protrain_fx.get_plan(mine).predicted is not None, "the automatic plan did not run"
    assert getattr(trainer.optimizer.optimizer, "_protrain_micro_steps", None) == 2
    check(base, ref.model, mine, ref.losses, trainer.losses, "accumulation, automatic plan")


def test_max_grad_norm_clipping_and_evaluation(tmp_path):
    """max_grad_norm=0.5 (below every step's norm: clipping changes each step), then evaluate()."""
    base = tiny_llama()
    kw = dict(max_grad_norm=0.5, trainer_kw={"eval_dataset": Tokens(4, seed=1)})
    ref = train(copy.deepcopy(base), tmp_path / "ref", **kw)
    mine = copy.deepcopy(base)
    trainer = train(mine, tmp_path / "mine", protrain=offload_all(base), **kw)
    check(base, ref.model, mine, ref.losses, trainer.losses, "clipping")
    ref_norms, norms = logged(ref, "grad_norm"), logged(trainer, "grad_norm")
    assert min(ref_norms) > 0.5, ref_norms
    assert rel_err(norms, ref_norms) <= 1e-5, (norms, ref_norms)
    ref_eval, mine_eval = ref.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]
    print(f"eval loss rel {abs(mine_eval - ref_eval) / ref_eval:.3g}")
    assert abs(mine_eval - ref_eval) <= LOSS_REL * ref_eval, (mine_eval, ref_eval)


def test_lr_schedule_with_warmup(tmp_path):
    """A cosine schedule with 2 warmup steps over 4: the LR of each step (as the Trainer logs it)
    rises from 0, then falls."""
    base = tiny_llama()
    kw = dict(lr_scheduler_type="cosine", warmup_steps=2, max_steps=4, data=Tokens(8))
    ref = train(copy.deepcopy(base), tmp_path / "ref", **kw)
    mine = copy.deepcopy(base)
    trainer = train(mine, tmp_path / "mine", protrain=offload_all(base), **kw)
    check(base, ref.model, mine, ref.losses, trainer.losses, "warmup")
    lrs = logged(trainer, "learning_rate")
    assert lrs == logged(ref, "learning_rate")
    assert lrs[0] < lrs[1] < lrs[2] > lrs[3], lrs


def test_user_adam_and_scheduler_are_respected(tmp_path):
    """Trainer(optimizers=(torch.optim.Adam, LambdaLR)): protrain takes over that very optimizer."""
    base = tiny_llama()

    def optimizers(model):
        opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    ref_model, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref = train(ref_model, tmp_path / "ref", trainer_kw={"optimizers": optimizers(ref_model)})
    opt, sched = optimizers(mine)
    trainer = train(
        mine, tmp_path / "mine", protrain=offload_all(base), trainer_kw={"optimizers": (opt, sched)}
    )
    assert handle_of(opt) is not None, "protrain did not take over the Trainer's optimizer"
    assert trainer.lr_scheduler is sched and sched.last_epoch == 3
    check(base, ref.model, mine, ref.losses, trainer.losses, "user Adam")


class StopAt(transformers.TrainerCallback):
    """Stop training after step ``n`` (an interrupted run) and keep copies of the model's and the
    optimizer's state at that step."""

    def __init__(self, n: int, stop: bool):
        self.n, self.stop, self.model_sd, self.opt_sd = n, stop, None, None

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.n:
            self.model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.opt_sd = copy.deepcopy(optimizer.state_dict())
            control.should_training_stop = self.stop


def test_checkpoint_save_and_resume(tmp_path):
    """Train 2 of 4 steps, saving a checkpoint at step 2 (save_steps=2); a new Trainer resumes from
    it and trains steps 3-4. The checkpoint holds the plain run's model and optimizer at step 2, and
    the resumed run ends where an uninterrupted plain run of 4 steps does."""
    base = tiny_llama()
    kw = dict(max_steps=4, data=Tokens(8), lr_scheduler_type="linear", warmup_steps=1)
    snap = StopAt(2, stop=False)
    ref = train(copy.deepcopy(base), tmp_path / "ref", trainer_kw={"callbacks": [snap]}, **kw)

    first = copy.deepcopy(base)
    t1 = train(
        first,
        tmp_path / "mine",
        protrain=offload_all(base),
        save_strategy="steps",
        save_steps=2,
        trainer_kw={"callbacks": [StopAt(2, stop=True)]},
        **kw,
    )
    assert t1.state.global_step == 2 and len(t1.losses) == 2
    host_chunks(first)
    ckpt = tmp_path / "mine" / "checkpoint-2"
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))  # the tied lm_head.weight is saved once
    assert set(saved) <= set(snap.model_sd) <= set(saved) | {"lm_head.weight"}
    ckpt_abs = sd_diff(saved, snap.model_sd, list(saved))
    saved_opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    ref_state, mine_state = snap.opt_sd["state"], saved_opt["state"]
    assert set(mine_state) == set(ref_state)
    moments_abs = max(
        (mine_state[i][k].double() - ref_state[i][k].double()).abs().max().item()
        for i in ref_state
        for k in ("exp_avg", "exp_avg_sq")
    )
    print(f"\n[checkpoint-2] params abs {ckpt_abs:.3g}, moments abs {moments_abs:.3g}")
    assert ckpt_abs <= PARAM_ABS and moments_abs <= PARAM_ABS
    lrs = [[g["lr"] for g in sd["param_groups"]] for sd in (saved_opt, snap.opt_sd)]
    assert lrs[0] == lrs[1], lrs

    resumed = copy.deepcopy(base)  # the init, overwritten by the checkpoint
    t2 = train(
        resumed,
        tmp_path / "mine",
        protrain=offload_all(base),
        save_strategy="no",
        save_steps=2,
        train_kw={"resume_from_checkpoint": str(ckpt)},
        **kw,
    )
    assert t2.state.global_step == 4 and len(t2.losses) == 2
    check(base, ref.model, resumed, ref.losses, t1.losses + t2.losses, "resume")


def lora(model):
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    return peft.get_peft_model(model, config)


def test_peft_lora_adapters_only(tmp_path):
    """LoRA through peft: the Trainer's optimizer holds only the adapters; the frozen base weights
    (on the host) stay bit-identical to the init."""
    pytest.importorskip("peft")
    base = lora(tiny_llama())
    ref = train(copy.deepcopy(base), tmp_path / "ref")
    mine = copy.deepcopy(base)
    trainer = train(mine, tmp_path / "mine", protrain=offload_all(base))
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in mine.named_parameters() if id(p) in trained]
    assert names and all("lora_" in n for n in names), names
    check(base, ref.model, mine, ref.losses, trainer.losses, "lora")
    base_sd, mine_sd = base.state_dict(), mine.state_dict()
    frozen = [k for k in base_sd if "lora_" not in k]
    assert frozen and sd_diff(mine_sd, base_sd, frozen) == 0.0
    assert sd_diff(mine_sd, base_sd, [k for k in base_sd if "lora_" in k]) > MIN_UPDATE


def test_peft_lora_with_gradient_checkpointing(tmp_path):
    """LoRA fine-tuning as peft's guides write it, with gradient_checkpointing=True (the Trainer
    then also makes the embeddings' output require grad for the frozen base): the callback turns
    Hugging Face's checkpointing off, the frozen layers are offloaded chunks in protrain's plan, and
    the results are the plain Trainer's with its checkpointing on."""
    pytest.importorskip("peft")
    base = lora(tiny_llama())
    ref = train(copy.deepcopy(base), tmp_path / "ref", gradient_checkpointing=True)
    mine = copy.deepcopy(base)
    trainer = train(
        mine, tmp_path / "mine", protrain=offload_all(base), gradient_checkpointing=True
    )
    assert not any(getattr(m, "gradient_checkpointing", False) for m in mine.modules())
    assert any(
        "layers." in e.fqn and e.chunk in s.offloaded_chunks
        for s in stores_of(mine)
        for e in s.entries
    )
    check(base, ref.model, mine, ref.losses, trainer.losses, "lora + checkpointing")
    base_sd, mine_sd = base.state_dict(), mine.state_dict()
    frozen = [k for k in base_sd if "lora_" not in k]
    assert sd_diff(mine_sd, base_sd, frozen) == 0.0


def test_gradient_checkpointing(tmp_path, caplog):
    """gradient_checkpointing=True: protrain's per-block plan replaces Hugging Face's recompute
    inside the blocks: the callback turns it off (one log line says so), and the decoder layers are
    in protrain's plan (their parameters in its chunks, offloaded)."""
    base = tiny_llama()
    ref = train(copy.deepcopy(base), tmp_path / "ref", gradient_checkpointing=True)
    assert ref.model.is_activation_checkpointing
    mine = copy.deepcopy(base)
    name = "protrain_fx.integrations.transformers"
    with caplog.at_level(logging.INFO, logger=name):
        trainer = train(
            mine, tmp_path / "mine", protrain=offload_all(base), gradient_checkpointing=True
        )
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == name and "checkpointing" in r.getMessage()
    ]
    assert len(lines) == 1 and "replaces" in lines[0], lines
    assert not mine.is_activation_checkpointing
    plan = protrain_fx.get_plan(mine)
    assert len(plan.blocks) == mine.config.num_hidden_layers, plan.summary()
    assert any(
        ".layers." in e.fqn and e.chunk in s.offloaded_chunks
        for s in stores_of(mine)
        for e in s.entries
    )
    check(base, ref.model, mine, ref.losses, trainer.losses, "gradient checkpointing")


def test_inductor_with_trainer_defaults(tmp_path):
    """The default compiler (Inductor) with the Trainer's defaults: fused AdamW (the default optim
    with torch >= 2.8), no weight decay, linear decay, max_grad_norm=1.0."""
    base = tiny_llama()
    kw = dict(optim="adamw_torch_fused", weight_decay=0.0, data=Tokens(8))
    ref = train(copy.deepcopy(base), tmp_path / "ref", **kw)
    mine = copy.deepcopy(base)
    trainer = train(mine, tmp_path / "mine", protrain=offload_all(base, compiler="inductor"), **kw)
    check(base, ref.model, mine, ref.losses, trainer.losses, "inductor")


# --------------------------------------------------------------------------------------- refusals
def test_optimizer_protrain_cannot_take_over_is_refused(tmp_path):
    model = tiny_llama()
    with pytest.raises(ProtrainError, match="optim='adamw_torch'"):
        Recording(
            model=model,
            args=training_args(tmp_path, optim="sgd"),
            train_dataset=Tokens(4),
            callbacks=[ProtrainCallback()],
        )
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = Recording(
        model=model,
        args=training_args(tmp_path),
        train_dataset=Tokens(4),
        callbacks=[ProtrainCallback()],
        optimizers=(sgd, None),
    )
    with pytest.raises(ProtrainError, match=r"is SGD; use TrainingArguments\(optim='adamw_torch'"):
        trainer.train()
    assert getattr(model, "_compiled_call_impl", None) is None and trainer.losses == []


def test_options_are_validated_when_the_callback_is_made():
    model = tiny_llama()
    with pytest.raises(ProtrainError, match="leave out 'optimizer'"):
        ProtrainCallback(optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(OptionsError, match="unknown protrain option"):
        ProtrainCallback(memory_budjet="1GiB")
    with pytest.raises(OptionsError, match="n_persist"):
        ProtrainCallback(n_persist=-1)


def test_torch_compile_argument_and_compiled_models_are_refused(tmp_path):
    model = tiny_llama()
    with pytest.raises(ProtrainError, match="leave TrainingArguments\\(torch_compile"):
        Recording(
            model=model,
            args=training_args(tmp_path, torch_compile=True),
            train_dataset=Tokens(4),
            callbacks=[ProtrainCallback()],
        )
    model.compile(backend="eager")
    trainer = Recording(
        model=model,
        args=training_args(tmp_path),
        train_dataset=Tokens(4),
        callbacks=[ProtrainCallback()],
    )
    with pytest.raises(ProtrainError, match="already compiled"):
        trainer.train()


def test_accelerate_still_refuses_a_custom_backend(tmp_path):
    """The module docstring's reason for compiling in the callback: accelerate takes only its own
    backend names. Once this passes through, TrainingArguments(torch_compile_backend=...) may be a
    route (it would still need the optimizer in the options)."""
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        Recording(
            model=tiny_llama(),
            train_dataset=Tokens(4),
            args=training_args(tmp_path, torch_compile_backend="protrain"),
        )
