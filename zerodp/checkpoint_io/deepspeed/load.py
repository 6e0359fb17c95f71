"""`load_deepspeed_checkpoint`: a DeepSpeed ZeRO checkpoint into an engine, at any world size.

Like zerodp's own load, it checks everything it can before it changes
anything, on every rank, and agrees on the verdict before the first
collective: the files and their structure, the model (names and shapes),
the optimizer (Adam state, the same param groups), the scheduler and the
loss scaler. Then each rank copies the parts of the fp32 masters and Adam
moments it owns straight from the DeepSpeed files that hold them (memory-
mapped: only the pages a rank copies from are read), the engine refreshes
its model from the masters, and the counters, scheduler, loss scaler and
optimizer settings follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerodp.checkpoint_io.deepspeed import destinations, training_state
from zerodp.checkpoint_io.deepspeed.files import DeepSpeedFiles, DeepSpeedFormat
from zerodp.checkpoint_io.deepspeed.records import ModelStates, read_model_states
from zerodp.checkpoint_io.deepspeed.sources import Source, frozen_value, open_source
from zerodp.checkpoint_io.load_options import LoadOptions
from zerodp.checkpoint_io.report import LoadReport
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError, ZeroDPError


def load_deepspeed_checkpoint(
    subject: CheckpointSubject, files: DeepSpeedFiles, options: LoadOptions
) -> tuple[str, dict[str, Any], LoadReport]:
    """Returns (checkpoint folder, the run's client_state, what was and was not restored).

    `files` were found with `options.tag`; DeepSpeed's format has no checksums, so
    `options.verify_checksums` has nothing to check here.
    """
    comm = subject.comm
    error: BaseException | None = None
    plan: _Plan | None = None
    try:
        subject.check_idle()
        plan = _plan(subject, files, options)
    except Exception as caught:
        error = caught if isinstance(caught, ZeroDPError) else _unexpected(caught, files)
    comm.raise_if_any_failed(error)  # nothing has been changed yet, on any rank
    if plan is None:  # pragma: no cover - set on every rank when none failed
        raise RuntimeError("internal error: no load plan")

    error = None
    try:
        plan.read_tensors(subject)
    except Exception as caught:
        error = CheckpointError(
            f"reading DeepSpeed checkpoint '{files.folder}' failed ({caught}); the engine's "
            "weights and optimizer state are partly loaded: load a checkpoint again, or rebuild "
            "the engine"
        )
    comm.raise_if_any_failed(error)
    subject.after_load()
    plan.state.apply(subject)
    plan.report.announce(comm.rank)
    return str(files.folder), plan.model.client_state, plan.report


@dataclass
class _Plan:
    """Everything checked and planned; `read_tensors` is the first step that changes state."""

    model: ModelStates
    source: Source
    params: destinations.ParamDestinations
    state: training_state.TrainingState
    report: LoadReport
    models_of_ranks: list[ModelStates]

    def read_tensors(self, subject: CheckpointSubject) -> None:
        self.params.attach(subject.optimizer)
        self.source.fill(self.params.wanted)
        destinations.write_steps(subject, self.params)
        for whole in self.params.whole:
            if whole.wanted is not None:
                whole.write(whole.wanted.destinations["fp32"].reshape(whole.shape))
            else:
                whole.write(frozen_value(self.models_of_ranks, whole.name, whole.shape))
        buffers = dict(subject.module.named_buffers())
        for name in self.model.buffer_names:
            buffers[name].copy_(self.model.module[name])


def _plan(subject: CheckpointSubject, files: DeepSpeedFiles, options: LoadOptions) -> _Plan:
    with_optimizer = options.with_optimizer
    model = read_model_states(files.model_files[0])
    source = open_source(files, model)
    if with_optimizer:
        destinations.check_optimizer_kind(subject.optimizer)
    params = destinations.plan_destinations(subject, model, with_optimizer)
    models_of_ranks = [model]
    if any(w.wanted is None for w in params.whole) and len(files.model_files) > 1:
        models_of_ranks += [read_model_states(path) for path in files.model_files[1:]]
    for whole in params.whole:
        if whole.wanted is None:
            frozen_value(models_of_ranks, whole.name, whole.shape)  # there, and the right size
    source.check(params.wanted)
    _check_buffers(subject, model)
    if with_optimizer:
        destinations.plan_steps(subject, params, source.optimizer.steps)
    state = training_state.plan_training_state(
        subject,
        model,
        source.optimizer,
        _group_names(subject, params.names),
        options,
    )
    report = LoadReport(_describe(files, model))
    report.restored.append(
        "fp32 master weights of every trained parameter"
        + (", Adam moments (exp_avg, exp_avg_sq) and step counts" if with_optimizer else "")
    )
    if any(w.wanted is None for w in params.whole):
        report.restored.append("frozen parameters, from the module's saved weights")
    if model.buffer_names:
        report.restored.append(f"buffers {model.buffer_names}")
    if not with_optimizer:
        report.not_restored.append("optimizer state (load_optimizer_states=False)")
    report.restored += state.restored
    report.not_restored += state.not_restored
    if model.client_state:
        report.restored.append(f"client_state keys {sorted(model.client_state)}")
    return _Plan(model, source, params, state, report, models_of_ranks)


def _check_buffers(subject: CheckpointSubject, model: ModelStates) -> None:
    buffers = dict(subject.module.named_buffers())
    for name in model.buffer_names:
        saved = model.module.get(name)
        live = buffers.get(name)
        if live is None or saved is None or tuple(saved.shape) != tuple(live.shape):
            raise CheckpointError(
                f"buffer '{name}' of the DeepSpeed checkpoint "
                f"{'is not in this model' if live is None else 'does not fit this model'}; "
                "build the model the checkpoint was saved from"
            )


def _group_names(subject: CheckpointSubject, names: dict[str, str]) -> list[list[str]]:
    """DeepSpeed's names of the trained parameters of each of this optimizer's param groups."""
    groups: list[list[str]] = [[] for _ in subject.optimizer.param_groups]
    for state in subject.groups.trainable:
        index = state.flat.param_group_index
        if state.optim is not None and 0 <= index < len(groups):
            groups[index] += [names[n] for n in state.names]
    return groups


def _describe(files: DeepSpeedFiles, model: ModelStates) -> str:
    kind = "universal checkpoint" if files.format is DeepSpeedFormat.UNIVERSAL else "checkpoint"
    layout = "" if files.format is DeepSpeedFormat.UNIVERSAL else f"{files.format.value} "
    return (
        f"DeepSpeed {layout}{kind} '{files.folder}' (saved by {model.dp_world_size} ranks, "
        f"DeepSpeed {model.ds_version})"
    )


def _unexpected(error: BaseException, files: DeepSpeedFiles) -> CheckpointError:
    return CheckpointError(
        f"DeepSpeed checkpoint '{files.folder}' could not be checked ({type(error).__name__}: "
        f"{error}); it is damaged or written in a layout zerodp does not know"
    )
