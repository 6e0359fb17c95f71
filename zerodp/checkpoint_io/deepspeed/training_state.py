"""Counters, LR scheduler, loss scaler and optimizer settings of a DeepSpeed run, for this engine.

Each piece is translated and checked first (`plan_training_state`) and
applied after the tensors are in (`TrainingState.apply`). What cannot be
carried over is said in the report, never silently dropped:

- counters: DeepSpeed saves global steps, samples and skipped steps; the
  micro-step count is not saved, so it restarts at the start of an
  accumulation window (`global_steps * gradient_accumulation_steps`);
- LR scheduler: DeepSpeed's WarmupLR/WarmupDecayLR/WarmupCosineLR state is
  `{"last_batch_iteration": k}`, which zerodp's schedulers of the same
  names take as it is (they follow DeepSpeed's values step for step); a
  torch scheduler the run passed in saved torch's own state dict;
- loss scaler: DeepSpeed's dynamic scaler (scale, hysteresis, iterations
  since the last overflow) maps onto zerodp's field by field;
- optimizer settings: each param group's lr, betas, eps and weight decay
  are DeepSpeed's saved ones, as DeepSpeed's own load would make them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerodp.checkpoint_io.deepspeed.records import ModelStates
from zerodp.checkpoint_io.deepspeed.sources import SharedOptimizerState
from zerodp.checkpoint_io.deepspeed.unpickle import DynamicLossScalerRecord
from zerodp.checkpoint_io.load_options import LoadOptions
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


@dataclass
class TrainingState:
    """The non-tensor state to apply, and the report's lines about it."""

    counters: dict[str, int] | None = None
    scheduler: Any = None  # the state dict for the engine's scheduler
    loss_scaler: dict[str, Any] | None = None
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)

    def apply(self, subject: CheckpointSubject) -> None:
        if self.counters is not None:
            subject.counters.load_state_dict(self.counters)
        if self.loss_scaler is not None:
            subject.loss_scaler.load_state_dict(self.loss_scaler)
        scheduler = _scheduler(subject)
        if self.scheduler is not None and scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
        for group, values in zip(
            subject.optimizer.param_groups, self.hyperparameters, strict=False
        ):
            group.update(values)


def _scheduler(subject: CheckpointSubject) -> Any:
    return getattr(subject.lr_scheduler, "scheduler", subject.lr_scheduler)


def plan_training_state(
    subject: CheckpointSubject,
    model: ModelStates,
    optimizer: SharedOptimizerState,
    group_names: list[list[str]],
    options: LoadOptions,
) -> TrainingState:
    """What to apply; `group_names[k]`: DeepSpeed's names of this engine's param group k."""
    plan = TrainingState()
    if options.load_module_only:
        plan.not_restored.append("counters, LR scheduler, loss scaler (load_module_only=True)")
        return plan
    steps = model.global_steps
    samples = model.global_samples
    plan.counters = {
        "global_steps": steps,
        "micro_steps": steps * subject.accumulation_steps,
        "global_samples": samples if samples is not None else 0,
        "skipped_steps": model.skipped_steps,
    }
    plan.restored.append(
        f"counters: global_steps {steps}, global_samples {samples}, skipped_steps "
        f"{model.skipped_steps} (micro_steps set to global_steps x gradient_accumulation_steps: "
        "DeepSpeed does not save it)"
    )
    if options.load_lr_scheduler_states:
        _plan_scheduler(subject, model, plan)
    else:
        plan.not_restored.append("LR scheduler (load_lr_scheduler_states=False)")
    if options.with_optimizer:
        _plan_hyperparameters(subject, optimizer, group_names, plan)
        _plan_loss_scaler(subject, optimizer, plan)
        _compare_weight_decay(subject, model, plan)
    if model.data_sampler is not None:
        plan.not_restored.append("DeepSpeed's curriculum data sampler (zerodp has none)")
    plan.not_restored.append("random generator states (DeepSpeed does not save them)")
    return plan


def _plan_scheduler(subject: CheckpointSubject, model: ModelStates, plan: TrainingState) -> None:
    saved = model.lr_scheduler
    scheduler = _scheduler(subject)
    if saved is None:
        if scheduler is not None:
            plan.not_restored.append("LR scheduler (the DeepSpeed run had none)")
        return
    if scheduler is None:
        plan.not_restored.append(f"LR scheduler state {saved!r} (this engine has no scheduler)")
        return
    if isinstance(saved, dict) and set(saved) == {"last_batch_iteration"}:
        if not hasattr(scheduler, "last_batch_iteration"):
            raise CheckpointError(
                f"the DeepSpeed run's scheduler saved {saved}, which {type(scheduler).__name__} "
                "cannot take; configure the same DeepSpeed schedule (WarmupLR, WarmupDecayLR or "
                "WarmupCosineLR), or pass load_lr_scheduler_states=False"
            )
        iteration = saved["last_batch_iteration"]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
            raise CheckpointError(f"the saved scheduler's last_batch_iteration is {iteration!r}")
        plan.scheduler = dict(saved)
        plan.restored.append(f"LR scheduler: last_batch_iteration {iteration}")
        return
    current = scheduler.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(current):
        keys = sorted(saved) if isinstance(saved, dict) else saved
        raise CheckpointError(
            f"the DeepSpeed run's scheduler state has keys {keys!r}, "
            f"this engine's {type(scheduler).__name__} {sorted(current)}; use the scheduler the "
            "run used, or pass load_lr_scheduler_states=False"
        )
    plan.scheduler = saved
    plan.restored.append(f"LR scheduler: {type(scheduler).__name__} state dict")


def _plan_hyperparameters(
    subject: CheckpointSubject,
    optimizer: SharedOptimizerState,
    group_names: list[list[str]],
    plan: TrainingState,
) -> None:
    saved_members = optimizer.group_members
    if len(saved_members) != len(group_names) or any(
        set(a) != set(b) for a, b in zip(saved_members, group_names, strict=False)
    ):
        raise CheckpointError(
            f"the DeepSpeed run's optimizer param groups hold {[sorted(g) for g in saved_members]}"
            f", this engine's {[sorted(g) for g in group_names]}; build the engine with the same "
            "param groups (model_parameters=[...]), or pass load_optimizer_states=False"
        )
    groups = optimizer.param_groups
    if groups is None:
        plan.not_restored.append(
            "optimizer settings (an elastic checkpoint does not save them; the config's are used)"
        )
        return
    changes = []
    for index, (saved, live) in enumerate(zip(groups, subject.optimizer.param_groups, strict=True)):
        if saved.get("bias_correction", True) is False:
            raise CheckpointError(
                f"the DeepSpeed run's param group {index} had bias_correction off, which torch's "
                "Adam cannot do; pass load_optimizer_states=False"
            )
        values = {}
        for key in HYPERPARAMETERS:
            if key in saved and key in live:
                value = tuple(saved[key]) if key == "betas" else saved[key]
                values[key] = value
                if key != "lr" and _differs(value, live[key]):
                    changes.append(f"group {index} {key} {live[key]} -> {value}")
        plan.hyperparameters.append(values)
    plan.restored.append(
        "optimizer settings per param group (lr, betas, eps, weight_decay)"
        + (
            f"; these differ from this engine's and take the saved values: {changes}"
            if changes
            else ""
        )
    )


def _compare_weight_decay(
    subject: CheckpointSubject, model: ModelStates, plan: TrainingState
) -> None:
    """DeepSpeed's "Adam" decouples weight decay unless `adam_w_mode` is false; say so when
    this engine's Adam does otherwise (its moments load, but its steps would differ)."""
    block = model.ds_config.get("optimizer")
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        return
    params = block.get("params")
    params = params if isinstance(params, dict) else {}
    kind = block["type"].lower()
    deepspeed_decoupled = kind == "adamw" or bool(params.get("adam_w_mode", True))
    optimizer = subject.optimizer
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay") for g in optimizer.param_groups
    )
    decays = any(g.get("weight_decay", 0) for g in optimizer.param_groups)
    if decays and decoupled != deepspeed_decoupled:
        plan.not_restored.append(
            f"the optimizer's kind: the DeepSpeed run's {block['type']} "
            f"{'decoupled' if deepspeed_decoupled else 'added'} weight decay, this engine's "
            f"{type(optimizer).__name__} {'decouples' if decoupled else 'adds'} it, so the "
            "continuation differs; configure the same kind"
        )


def _differs(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        b = b.tolist()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return list(a) != list(b)
    return a != b


def _plan_loss_scaler(
    subject: CheckpointSubject, optimizer: SharedOptimizerState, plan: TrainingState
) -> None:
    saved = optimizer.loss_scaler
    current = subject.loss_scaler.state_dict()
    uses_scaling = bool(current.get("dynamic")) or current.get("scale", 1.0) != 1.0
    if saved is None:
        if uses_scaling:
            plan.not_restored.append(
                "loss scale (the DeepSpeed run kept none; the config's is used)"
            )
        return
    scale = saved.get("cur_scale")
    dynamic = isinstance(saved, DynamicLossScalerRecord)
    if uses_scaling and not dynamic and scale in (1, 1.0):
        plan.not_restored.append("loss scale (the DeepSpeed run did not scale losses)")
        return
    if not uses_scaling:
        if dynamic or scale not in (None, 1, 1.0):
            plan.not_restored.append(
                f"loss scale {scale} (this engine does not scale losses: it is not fp16)"
            )
        return
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise CheckpointError(f"the checkpoint's loss scale is {scale!r}, not a positive number")
    state = dict(current, scale=float(scale))
    if dynamic and current.get("dynamic"):
        iteration = saved.get("cur_iter")
        last_overflow = saved.get("last_overflow_iter")
        hysteresis = saved.get("cur_hysteresis")
        if not all(isinstance(v, int) for v in (iteration, last_overflow, hysteresis)):
            raise CheckpointError(f"the checkpoint's dynamic loss scaler is incomplete: {saved}")
        state["clean_steps"] = max(0, iteration - last_overflow - 1)
        state["hysteresis_left"] = hysteresis
        plan.restored.append(
            f"loss scaler: scale {scale}, {state['clean_steps']} steps since the last overflow, "
            f"hysteresis {hysteresis}"
        )
    else:
        plan.restored.append(f"loss scale {scale}")
    plan.loss_scaler = state
