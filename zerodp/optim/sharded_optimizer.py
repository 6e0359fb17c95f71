"""The optimizer users get back: torch optimizers stepping this rank's owned ranges.

One step: make sure every gradient is reduced, point each optimizer
parameter's `.grad` at its averaged kept gradient, clip by the global norm
(over all ranks' shards), run the torch optimizers (elementwise ones on the
owned ranges, those that read whole tensors through the tensor-wise step:
[Note: tensor-wise step]), write optimizer copies back into the model, then
make the parameters whole again where the stage keeps them whole (the
parameter runtime's `publish_after_step`). For fp32 models there is no
optimizer copy: the optimizer parameters alias the model's own flat buffers
(see [Note: zerodp tensors]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.backward import autograd_api
from zerodp.backward.reducer import GradientReducer
from zerodp.backward.step_gate import StepGate
from zerodp.comm import Comm
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.uneven_inputs import Activity
from zerodp.group_state import GroupState
from zerodp.optim.grad_norm import (
    NormReduction,
    clip_by_global_norm,
    scale_grads,
    squared_grad_norm,
)
from zerodp.optim.offloaded_step import OffloadedSteps, synchronize_device
from zerodp.optim.torch_optimizers import TorchOptimizers
from zerodp.partition import Slicing
from zerodp.precision.loss_scaler import LossScaler
from zerodp.torch_internals import init_optimizer_hook_dicts, mark_optimizer_stepped
from zerodp.train_state import TrainState


class ParamPublisher(Protocol):
    """The parameter runtime, as the optimizer sees it."""

    def publish_after_step(self) -> None:
        """Make the model's full parameters match the updated owned ranges."""
        ...


class ZeroOptimizer(torch.optim.Optimizer):
    """Shares `param_groups` and `state` with the inner optimizer (so LR schedulers work).

    `Optimizer.__init__` is not called: this object has no parameters of its
    own, only the inner optimizer's groups (the one torch optimizer, or an
    `OptimizerChain` over several), which hold what its members step.
    """

    def __init__(
        self,
        torch_optimizers: TorchOptimizers,
        *,
        reducer: GradientReducer,
        norms: Mapping[Slicing, NormReduction],
        states: list[GroupState],
        params: ParamPublisher,
        model_params: list[nn.Parameter],
        gradient_clipping: float,
        gate: StepGate,
        train_state: TrainState,
        comm: Comm,
        loss_scaler: LossScaler | None = None,
        offload: OffloadedSteps | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.torch_optimizers = torch_optimizers
        self.inner = torch_optimizers.inner
        self.defaults = torch_optimizers.inner.defaults
        self._reducer = reducer
        # Slices are disjoint across their tensor or EP group, whole tensors copies: each
        # kind's squares are summed over its own groups, then added.
        self._norms = norms
        self._states = states
        self._params = params
        self._model_params = model_params
        self.gradient_clipping = gradient_clipping
        self._gate = gate
        self._train_state = train_state
        self._comm = comm  # the world's, for the agreement before a step
        self.loss_scaler = loss_scaler or LossScaler.none()
        self._offload = offload
        self._device = device
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        init_optimizer_hook_dicts(self)

    # -- shared with the inner optimizer -----------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.scale

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for `loss_scale`."""
        return self.loss_scaler.scale

    def needs_scaler(self) -> bool:
        """Whether losses must go through `engine.scale()` / `engine.backward()` (fp16)."""
        return self.loss_scaler.checks_overflow

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because fp16 gradients overflowed."""
        return self._train_state.skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (`zerodp.checkpoint_io` saves it all)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "zerodp lays out parameters once, at zerodp.initialize; pass every param group "
            "there (model_parameters=[...]) instead of adding one later"
        )

    # -- stepping --------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient zerodp keeps (the same as `engine.zero_grad()`)."""
        self._gate.zero_grad()

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Check that a step may be taken now, then take it (see `apply_step`)."""
        if closure is not None:
            raise ValueError("zerodp's optimizer does not take a closure; run backward first")
        self._gate.check_can_step()
        self.apply_step()

    @torch.no_grad()
    def apply_step(self) -> None:
        """One optimizer step on the averaged gradients; the caller has checked it may run."""
        # Every rank steps now, or none changes anything ([Note: agreeing before a collective]).
        agreement().agree_now(self._comm, Activity.STEP, "the optimizer step")
        self.adopt_replaced_params()
        if self._reducer.any_local:
            self._reducer.reduce_local()
        if self._offload is not None:
            self._offload.fetch_grads(self._states)
        grads = []
        kinds = []  # which kind of flat group each of `grads` is of
        for state in self._states:
            param, kept = state.optim, state.grads
            if param is None or kept is None:  # pragma: no cover - trainable groups have both
                raise RuntimeError(f"internal error: {state} is trainable but incomplete")
            param.param.grad = param.grad_for_optimizer(kept.owned())
            grads.append(param.param.grad)
            kinds.append(state.flat.slicing)
        scaler = self.loss_scaler
        if scaler.scale != 1.0 and grads:
            scale_grads(grads, 1.0 / scaler.scale)
        norm = self._global_norm(grads, kinds)
        self.last_grad_norm = norm
        self.last_step_skipped = False
        if scaler.checks_overflow:
            # The norm is global (summed over every rank's shard): every rank decides alike.
            overflow = not bool(torch.isfinite(norm).item())
            scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self._train_state.skipped_steps += 1
                self._drop_grads()
                return
        elif self._skip_non_finite(norm):  # fp32/bf16: the config's on_non_finite policy
            self.last_step_skipped = True
            self._drop_grads()
            return
        clip_by_global_norm(grads, norm, self.gradient_clipping)
        for member in self.torch_optimizers.elementwise:
            if self._offload is not None:
                self._offload.step(member.optimizer, member.states)
            else:
                member.optimizer.step()
        whole = self.torch_optimizers.tensorwise
        if whole is not None:
            whole.step(self.torch_optimizers.tensorwise_optimizers)
        mark_optimizer_stepped(self)
        self._drop_grads()
        self.sync_params_from_owned()

    def _global_norm(self, grads: list[torch.Tensor], kinds: list[Slicing]) -> torch.Tensor:
        """The norm over every element once (rule 2 of [Note: parallel dimensions]). Whole
        tensors' squares are reduced even when this rank has none: every rank joins the
        same collectives."""
        total = squared_grad_norm(
            [g for g, k in zip(grads, kinds, strict=True) if k is Slicing.WHOLE],
            self._norms[Slicing.WHOLE],
            device=self._device,
        )
        for kind in (Slicing.TENSOR, Slicing.EXPERT):
            of_kind = [g for g, k in zip(grads, kinds, strict=True) if k is kind]
            if of_kind:
                total = total + squared_grad_norm(of_kind, self._norms[kind], device=self._device)
        return total.sqrt()

    def adopt_replaced_params(self) -> None:
        """Keep values written by `param.data = t` since the last step (see
        `FlatGroup.adopt_replaced`): otherwise the step would update the group's buffer
        while the parameter kept showing `t`, and it would never train again.

        Groups whose full buffer is always there only; a stage 3 group drops such a
        write when it is released, as it drops any write outside GatheredParameters.
        """
        for state in self._states:
            if state.gather is None and state.flat.adopt_replaced() and state.optim is not None:
                state.optim.refresh_from_model()

    def _skip_non_finite(self, norm: torch.Tensor) -> bool:
        try:
            return self._gate.skip_non_finite(norm, self._train_state.global_steps)
        except BaseException:  # raised before anything changed; leave no .grad behind
            self._drop_grads()
            raise

    @torch.no_grad()
    def sync_params_from_owned(self) -> None:
        """Make the model's parameters match the owned ranges (after a step or a load)."""
        for state in self._states:
            if state.optim is not None:
                state.optim.copy_to_model()
        if self._offload is not None:
            synchronize_device()  # the copies from the host's buffers are done before reuse
        self._params.publish_after_step()
        autograd_api.increment_version(self._model_params)

    def place_offloaded_state(self) -> None:
        """After a checkpoint load: optimizer state of NVMe-offloaded groups goes to its files."""
        if self._offload is not None:
            self._offload.place_all_state(self.inner, self._states)

    def _drop_grads(self) -> None:
        for state in self._states:
            if state.optim is not None:
                state.optim.param.grad = None
