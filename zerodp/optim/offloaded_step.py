"""How the optimizer steps offloaded groups (see docs/offload.md).

- Gradients cross to the host first: every offloaded group's copy is started
  without waiting, then one device synchronisation, then each is upcast on
  the host (`OptimizerParam.start_grad_transfer` / `grad_for_optimizer`).
- Host groups are stepped by the torch optimizer with the device groups, in
  one `step()` (torch groups its kernels by device; the host uses torch's
  own CPU kernels, fused AdamW where the config does not choose).
- File groups (NVMe) are stepped one group at a time, so that only one
  group's optimizer state is in memory: the next group's files are read
  ahead while this one steps, and this one's are written behind after. The
  state a torch optimizer creates at its first step (or a checkpoint load
  plans) is moved into files right away.
"""

from __future__ import annotations

import torch

from zerodp.group_state import GroupState
from zerodp.offload import OffloadPolicy, OffloadStorage, Placement


def synchronize_device() -> None:
    """Wait for the device's queued copies (a no-op on a CPU-only machine)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        accelerator.synchronize()


class OffloadedSteps:
    """The offload parts of one optimizer step, for the groups whose optimizer is on the host."""

    def __init__(self, policy: OffloadPolicy, storage: OffloadStorage) -> None:
        self.policy = policy
        self.storage = storage

    @property
    def in_files(self) -> bool:
        return self.policy.optimizer is Placement.FILE

    def fetch_grads(self, states: list[GroupState]) -> None:
        """Start every offloaded group's gradient copy to the host, then wait for all of them."""
        offloaded = [s for s in states if s.optim is not None and s.optim.offloaded]
        for state in offloaded:
            if state.grads is not None and state.optim is not None:
                state.optim.start_grad_transfer(state.grads.owned())
        if offloaded:
            synchronize_device()

    def step(self, inner: torch.optim.Optimizer, states: list[GroupState]) -> None:
        """`inner.step()`, with file groups stepped one by one (see the module docstring)."""
        files = [s for s in states if self.in_files and s.optim is not None and s.optim.offloaded]
        if not files:
            inner.step()
            return
        grads: dict[GroupState, torch.Tensor | None] = {}
        for state in files:
            param = state.optim.param  # type: ignore[union-attr]
            grads[state], param.grad = param.grad, None
        params = [p for group in inner.param_groups for p in group["params"]]
        if any(p.grad is not None for p in params):
            inner.step()  # the device and host groups, together
        self.storage.prefetch(self._tensors_of(inner, files[0]))
        for index, state in enumerate(files):
            if index + 1 < len(files):
                self.storage.prefetch(self._tensors_of(inner, files[index + 1]))
            param = state.optim.param  # type: ignore[union-attr]
            param.grad = grads[state]
            inner.step()
            param.grad = None
            self.place_state(inner, state)
            self.storage.write_behind(self._tensors_of(inner, state))
        self.storage.wait()

    def place_state(self, inner: torch.optim.Optimizer, state: GroupState) -> None:
        """Move the group's per-element optimizer state into files (NVMe offload only)."""
        if not self.in_files or state.optim is None or not state.optim.offloaded:
            return
        param = state.optim.param
        slots = inner.state.get(param)
        if not slots:
            return
        root = self.policy.optimizer_path
        if root is None:  # pragma: no cover - the config requires nvme_path with nvme
            raise RuntimeError("internal error: NVMe offload without a path")
        for key, value in list(slots.items()):
            if (
                isinstance(value, torch.Tensor)
                and value.numel() == param.numel()
                and not self.storage.is_file_backed(value)
            ):
                slots[key] = self.storage.file_copy(root, f"group{state.order}.{key}", value)

    def place_all_state(self, inner: torch.optim.Optimizer, states: list[GroupState]) -> None:
        for state in states:
            self.place_state(inner, state)

    @staticmethod
    def _tensors_of(inner: torch.optim.Optimizer, state: GroupState) -> list[torch.Tensor]:
        optim = state.optim
        if optim is None or optim.copy is None:
            return []
        slots = inner.state.get(optim.param, {})
        return [optim.copy, *(v for v in slots.values() if isinstance(v, torch.Tensor))]
