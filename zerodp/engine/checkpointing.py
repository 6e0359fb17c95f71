"""The engine's checkpoint methods: `save_checkpoint`, `wait_for_checkpoint` and
`load_checkpoint` on a `CheckpointSubject`, the narrow view of the engine that
`zerodp.checkpoint_io` sees, written by the config's writer (`checkpoint_writer_for`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zerodp.backward.step_gate import StepGate
from zerodp.checkpoint_io import (
    CheckpointSubject,
    LoadOptions,
    LoadReport,
    load_any_checkpoint,
)
from zerodp.checkpoint_io.stateful import OptimizerSettings, SchedulerState
from zerodp.checkpoint_io.writers import CheckpointWriter, writer_for
from zerodp.comm import Comm
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.uneven_inputs import Activity
from zerodp.comm.process_group import comms_timeout
from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.engine.data_loader import ZeroDataLoader
from zerodp.expert_parallel import ExpertSplit
from zerodp.group_state import GroupIndex
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy
from zerodp.precision import PrecisionPolicy
from zerodp.tensor_parallel import TensorParallelism
from zerodp.train_state import TrainState

# How long a decoupled save's background waits for the other ranks' files when no
# comms_timeout_s is set: gloo's default collective timeout.
_DEFAULT_WRITE_DEADLINE_S = 1800.0


def checkpoint_writer_for(config: ZeroDPConfig) -> CheckpointWriter:
    """The writer `checkpoint.writer.decoupled` asks for; its background waits for the other
    ranks as long as a collective may (comms_timeout_s)."""
    timeout = comms_timeout(config.comms_timeout_s)
    deadline_s = _DEFAULT_WRITE_DEADLINE_S if timeout is None else timeout.total_seconds()
    return writer_for(config.checkpoint.writer.decoupled, deadline_s)


class CheckpointMethods:
    """DeepSpeed's checkpoint calls, delegating to `zerodp.checkpoint_io`."""

    # Provided by ZeroEngine.
    comm: Comm
    comms: GroupComms
    module: nn.Module
    groups: GroupIndex
    optimizer: ZeroOptimizer
    strategy: StageStrategy
    precision: PrecisionPolicy
    train_state: TrainState
    lr_scheduler: Any
    training_dataloader: ZeroDataLoader | None
    gate: StepGate
    tensor_parallel: TensorParallelism | None
    expert_parallel: ExpertSplit | None

    config: ZeroDPConfig
    last_load_report: LoadReport | None  # what the last load_checkpoint restored
    checkpoint_writer: CheckpointWriter  # synchronous, or decoupled (checkpoint.writer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError  # ZeroEngine's

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: str | None = None,
        client_state: Any = None,
        *,
        random_states: bool = True,
    ) -> str:
        """Save everything needed to resume, sharded, with torch.distributed.checkpoint.

        A collective: every rank calls it. Written under a temporary name and made
        visible (renamed, then `latest` updated) only once every rank has finished.
        Returns the checkpoint's path. See zerodp.checkpoint_io for the format.
        `random_states=False` leaves out the random generator states (when they are not
        the run's, as in `zerodp convert`); loading it then leaves the generators as
        they are, and says so.

        With `"checkpoint": {"writer": {"decoupled": true}}` it returns once the state
        is copied to host memory and the files are written while training goes on;
        `latest` moves once every rank's files are durable. It first waits for the
        previous save and raises that save's error, if it failed (docs/checkpoints.md).
        """
        with agreement().doing(Activity.SAVING):  # [Note: agreeing before a collective]
            path = self.checkpoint_writer.save(
                self._checkpoint_subject(), save_dir, tag, client_state, random_states
            )
        return str(path)

    def wait_for_checkpoint(self) -> str | None:
        """Wait until the last decoupled save is committed; its path (None: there is none,
        or it failed and its error was raised before).

        A collective: every rank calls it. If the save failed, every rank raises the same
        `CheckpointError`, naming the rank and the file; 'latest' then still names the
        checkpoint before it. With the synchronous writer there is never anything to
        wait for.
        """
        # Its own activity: a save begins with the same wait, and must not pass for it
        # ([Note: agreeing before a collective]).
        with agreement().doing(Activity.WAITING_FOR_SAVE):
            path = self.checkpoint_writer.wait(self.comm)
        return None if path is None else str(path)

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        verify_checksums: bool = True,
    ) -> tuple[str | None, Any]:
        """Load a zerodp or DeepSpeed ZeRO checkpoint saved at any stage and world size.

        Returns (path, client_state). Everything is checked (on every rank, agreed)
        before anything is changed, including every file's checksum (`verify_checksums=
        False` skips that, for trusted storage). With no tag and no `latest` file in
        `load_dir`, nothing is loaded and (None, None) is returned, as in DeepSpeed.
        What was restored and what not is logged and kept in `last_load_report`.
        """
        with agreement().doing(Activity.LOADING):  # [Note: agreeing before a collective]
            self.checkpoint_writer.wait(self.comm)  # a save still being written comes first
            options = LoadOptions(
                tag=tag,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
                verify_checksums=verify_checksums,
                prefer_universal=self.config.checkpoint.load_universal,
            )
            path, client, self.last_load_report = load_any_checkpoint(
                self._checkpoint_subject(), load_dir, options
            )
        self.gate.on_load()
        return path, client

    def _checkpoint_subject(self) -> CheckpointSubject:
        def after_load() -> None:
            self.optimizer.place_offloaded_state()
            self.optimizer.sync_params_from_owned()
            self.zero_grad()

        return CheckpointSubject(
            comm=self.comm,
            module=self.module,
            groups=self.groups,
            optimizer=self.optimizer.inner,
            zero_stage=self.strategy.stage,
            param_dtype=self.precision.param_dtype,
            counters=self.train_state,
            optimizer_settings=OptimizerSettings(self.optimizer.inner),
            loss_scaler=self.optimizer.loss_scaler,
            lr_scheduler=None if self.lr_scheduler is None else SchedulerState(self.lr_scheduler),
            dataloader=self.training_dataloader,
            check_idle=lambda: self.gate.check_idle("a checkpoint save or load"),
            after_load=after_load,
            accumulation_steps=self.config.batch_sizes.gradient_accumulation_steps,
            local_accumulation=self.strategy.reduction.defer_to_boundary,
            loss_scale=lambda: self.optimizer.loss_scaler.scale,
            gradients_held=self.gate.gradients_held,
            gradients_loaded=self.gate.on_gradients_loaded,
            before_save=self.optimizer.adopt_replaced_params,
            whole_tensors=self.optimizer.torch_optimizers.tensorwise,
            dims=self.comms.dims,
            tensor_slices=(
                {}
                if self.tensor_parallel is None
                else {n: s.dim for n, s in self.tensor_parallel.split.names(self.module).items()}
            ),
            expert_shapes=(
                {}
                if self.expert_parallel is None
                else {n: r.global_shape for n, r in self.expert_parallel.tensors.items()}
            ),
        )
