"""The owner side of the tensor-wise step: whole-tensor parameters, assembled, stepped, returned.

See [Note: tensor-wise step] in `zerodp.optim.tensorwise`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.group_state import GroupState
from zerodp.optim.tensorwise.exchange import FragmentExchange
from zerodp.optim.tensorwise.ownership import ALL_RANKS, Fragment, TensorPlan, TensorTask


class TensorwiseStep:
    """The whole-tensor parameters this rank's tensor-wise optimizers hold, and their step.

    A tensor this rank owns that lies inside its owned range is a view of that
    range (its gradient, a view of the owned gradient): the optimizer steps it
    in place and nothing is copied. A tensor assembled from other ranks'
    fragments has a buffer of its own, kept across steps so that the torch
    optimizer's state stays keyed to one parameter object.
    """

    def __init__(
        self, plan: TensorPlan, states: list[GroupState], comm: Comm, device: torch.device
    ) -> None:
        self.plan = plan
        self.rank = comm.rank
        self._states = {state.order: state for state in states}
        self.exchange = FragmentExchange(plan, comm.rank, comm, device)
        self.params: dict[int, nn.Parameter] = {}  # plan task index -> the whole tensor
        dtypes = set()
        for index, task in enumerate(plan.tasks):
            stepped = self._optimizer_param(task.group)
            dtypes.add(stepped.dtype)
            if not task.owned_by(self.rank):
                continue
            if task.is_local(self.rank):
                offset = task.fragments[0].offset
                data = stepped.data[offset : offset + task.numel].view(task.step_shape)
            else:
                data = torch.zeros(task.step_shape, dtype=stepped.dtype, device=stepped.device)
            self.params[index] = nn.Parameter(data, requires_grad=True)
        # One exchange dtype for every group: promotion between float types is exact.
        self.dtype = _promoted(dtypes)
        self.names = {task.name for task in plan.tasks}

    # -- what the optimizers, checkpoints and accessors see --------------------------------

    def param_groups(self, num_groups: int) -> list[list[nn.Parameter]]:
        """The whole-tensor parameters this rank steps, by optimizer param group."""
        groups: list[list[nn.Parameter]] = [[] for _ in range(num_groups)]
        for index, param in self.params.items():
            state = self._states[self.plan.tasks[index].group]
            groups[state.flat.param_group_index].append(param)
        return groups

    def owned_params(self) -> dict[str, nn.Parameter]:
        """The whole-tensor parameters this rank steps, by model parameter name."""
        return {self.plan.tasks[index].name: param for index, param in self.params.items()}

    def elsewhere(self) -> set[str]:
        """Names of tensors only other ranks step (their optimizer state is held there)."""
        return {t.name for t in self.plan.tasks if not t.owned_by(self.rank)}

    def task_and_param(
        self, group: int, position: int
    ) -> tuple[TensorTask, nn.Parameter | None] | None:
        for index, task in enumerate(self.plan.tasks):
            if (task.group, task.position) == (group, position):
                return task, self.params.get(index)
        return None

    def owner_of(self, task: TensorTask) -> int:
        return self.rank if task.owner == ALL_RANKS else task.owner

    # -- one step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Assemble each owned tensor's gradient (and value), step, send the values back.

        Every optimizer parameter of the tensor-wise groups holds its owned range's
        averaged, clipped gradient as `.grad` (ZeroOptimizer.apply_step) when this runs.
        """
        received = (
            self.exchange.to_owners(self._grad_of, self._value_of, self.dtype)
            if self.exchange.active
            else {}
        )
        for index, param in self.params.items():
            param.grad = self._assemble(index, param, received)
        for optimizer in optimizers:
            optimizer.step()
        for index, param in self.params.items():
            task = self.plan.tasks[index]
            mine = task.fragment_of(self.rank)
            if not task.is_local(self.rank) and mine is not None:
                self._write(task, mine, param.data.view(-1)[mine.start : mine.end])
            param.grad = None
        if self.exchange.active:
            self.exchange.to_holders(
                lambda index: self.params[index].data.view(-1), self._write, self.dtype
            )

    def _assemble(
        self,
        index: int,
        param: nn.Parameter,
        received: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]],
    ) -> torch.Tensor:
        """The whole gradient of task `index`; an assembled tensor's value is filled too."""
        task = self.plan.tasks[index]
        if task.is_local(self.rank):
            offset = task.fragments[0].offset
            return self._grad_of(task.group)[offset : offset + task.numel].view(task.step_shape)
        grad = torch.empty_like(param)
        flat_grad, flat_value = grad.view(-1), param.data.view(-1)
        if not task.values_travel:  # every rank's full buffer holds the values
            start, end = self._states[task.group].flat.slot_of(task.position)
            flat_value.copy_(self._states[task.group].flat.full[start:end])
        for fragment in task.fragments:
            if fragment.rank == self.rank:
                grad_piece = self._piece(self._grad_of(task.group), fragment)
                value_piece: torch.Tensor | None = self._piece(self._value_of(task.group), fragment)
            else:
                grad_piece, value_piece = received[(index, fragment.rank)]
            flat_grad[fragment.start : fragment.end].copy_(grad_piece)
            if task.values_travel and value_piece is not None:
                flat_value[fragment.start : fragment.end].copy_(value_piece)
        return grad

    def _write(self, task: TensorTask, fragment: Fragment, values: torch.Tensor) -> None:
        """Stepped values of `fragment` into this rank's owned range."""
        self._piece(self._value_of(task.group), fragment).copy_(values)

    @staticmethod
    def _piece(flat: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        return flat[fragment.offset : fragment.offset + fragment.numel]

    def _optimizer_param(self, group: int) -> nn.Parameter:
        optim = self._states[group].optim
        if optim is None:  # pragma: no cover - the plan holds trainable groups only
            raise RuntimeError(f"internal error: group {group} has no optimizer parameter")
        return optim.param

    def _grad_of(self, group: int) -> torch.Tensor:
        grad = self._optimizer_param(group).grad
        if grad is None:  # pragma: no cover - apply_step sets every gradient first
            raise RuntimeError(f"internal error: group {group} has no gradient at the step")
        return grad

    def _value_of(self, group: int) -> torch.Tensor:
        return self._optimizer_param(group).data

    def __iter__(self) -> Iterator[tuple[TensorTask, nn.Parameter]]:
        for index, param in self.params.items():
            yield self.plan.tasks[index], param


def _promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result
