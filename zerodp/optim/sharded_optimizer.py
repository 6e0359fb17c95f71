"""The optimizer users get back: a torch optimizer stepping this rank's shards.

One step: make sure every gradient is reduced, point each shard parameter's
`.grad` at its averaged gradient, clip by the global norm (over all ranks'
shards), run the inner torch optimizer on the shards, then make the
parameters whole again where the stage keeps them whole (an all-gather of
the updated shards). For fp32 models there is no separate master copy: the
shards the optimizer steps are views of the parameters' own flat buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodp.backward import autograd_api
from zerodp.backward.reducer import GradientReducer, GroupGradients
from zerodp.comm import Comm
from zerodp.optim.grad_norm import clip_by_global_norm, global_grad_norm
from zerodp.partition import FlatGroup
from zerodp.precision.loss_scaler import LossScaler
from zerodp.precision.master import MasterWeights


class ZeroOptimizer(torch.optim.Optimizer):
    """Shares `param_groups` and `state` with the inner optimizer (so LR schedulers work).

    `Optimizer.__init__` is not called: this object has no parameters of its
    own, only the inner optimizer's groups, which hold the shard parameters.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        reducer: GradientReducer,
        comm: Comm,
        shards: list[tuple[GroupGradients, nn.Parameter]],
        sharded_grads: bool,
        resident_groups: Callable[[], list[FlatGroup]],
        model_params: list[nn.Parameter],
        gradient_clipping: float,
        before_step: Callable[[], None],
        on_zero_grad: Callable[[], None],
        loss_scaler: LossScaler | None = None,
        masters: MasterWeights | None = None,
    ) -> None:
        self.inner = inner
        self.defaults = inner.defaults
        self._reducer = reducer
        self._comm = comm
        self._shards = shards
        self._sharded_grads = sharded_grads
        self._resident_groups = resident_groups
        self._model_params = model_params
        self.gradient_clipping = gradient_clipping
        self._before_step = before_step
        self._on_zero_grad = on_zero_grad
        self.loss_scaler = loss_scaler or LossScaler.none()
        self._masters = masters
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (zerodp.checkpoint saves whole checkpoints)."""
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
        self._on_zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("zerodp's optimizer does not take a closure; run backward first")
        self._before_step()
        if self._reducer.any_local:
            self._reducer.reduce_local()
        grads = []
        for group_grads, shard in self._shards:
            grad = self._reducer.owned_grad(group_grads)
            shard.grad = grad if grad.dtype == shard.dtype else grad.to(shard.dtype)
            grads.append(shard.grad)
        scaler = self.loss_scaler
        if scaler.scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / scaler.scale)
        norm = global_grad_norm(grads, self._comm, sharded=self._sharded_grads)
        self.last_grad_norm = norm
        self.last_step_skipped = False
        if scaler.checks_overflow:
            # The norm is global (summed over every rank's shard): every rank decides alike.
            overflow = not bool(torch.isfinite(norm).item())
            scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self.skipped_steps += 1
                self._drop_shard_grads()
                return
        clip_by_global_norm(grads, norm, self.gradient_clipping)
        self.inner.step()
        self._drop_shard_grads()
        if self._masters is not None:
            self._masters.copy_to_model()
        self._publish()
        autograd_api.increment_version(self._model_params)

    @torch.no_grad()
    def sync_params_from_owned(self) -> None:
        """Make the model's parameters match the owned ranges (after loading a checkpoint)."""
        if self._masters is not None:
            self._masters.copy_to_model()
        self._publish()
        autograd_api.increment_version(self._model_params)

    def _drop_shard_grads(self) -> None:
        for _, shard in self._shards:
            shard.grad = None

    def _publish(self) -> None:
        """Make resident full parameters match the updated shards (one all-gather each)."""
        handles = [
            self._comm.all_gather(group.full, group.shard, async_op=True)
            for group in self._resident_groups()
        ]
        for handle in handles:
            handle.wait()
