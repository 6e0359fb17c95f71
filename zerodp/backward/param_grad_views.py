"""Stage 0 shows the kept gradients as `param.grad`, as DDP does.

Outside a graph task each parameter's `.grad` is a view of its place in the
kept gradient, so code written for DDP (reading, clipping or zeroing
`param.grad` by hand) works unchanged. Before the next task starts, whatever
the user did to those tensors is taken back into the kept gradient: a
replaced tensor is copied in, a `.grad` set to None zeroes its region, and
`param.grad` goes back to None so that autograd accumulates the task's
contribution afresh (see [Note: gradient reduction]).
"""

from __future__ import annotations

from zerodp.group_state import GradSync, GroupState


class ParamGradView:
    """The `param.grad` views of one engine's kept gradients (stage 0 only)."""

    def __init__(self, states: list[GroupState]) -> None:
        self.states = states
        self.exposed = False

    def show(self) -> None:
        """Point every `param.grad` at the kept gradient (when the dtypes agree)."""
        kept = [s.grads for s in self.states]
        if any(k is None or k.storage.dtype != k.flat.dtype for k in kept):
            return
        for state in self.states:
            storage = state.grads.storage  # type: ignore[union-attr]
            for position, param in enumerate(state.params):
                start, end = state.flat.slot_of(position)
                param.grad = storage[start:end].view_as(param)
        self.exposed = True

    def reclaim(self, zeroed_sync: GradSync) -> None:
        """Take in what the user did to the shown `.grad`s; every `.grad` is None afterwards.

        A group whose `.grad`s were all set to None starts over with `zeroed_sync`
        (its kept gradient is zero, as after `zero_grad()`).
        """
        if not self.exposed:
            return
        for state in self.states:
            kept = state.grads
            if kept is None:  # pragma: no cover - only trainable groups are shown
                continue
            all_none = True
            for position, param in enumerate(state.params):
                start, end = state.flat.slot_of(position)
                region = kept.storage[start:end]
                user_grad = param.grad
                if user_grad is None:
                    region.zero_()
                else:
                    all_none = False
                    if user_grad.data_ptr() != region.data_ptr():
                        region.copy_(user_grad.detach().reshape(-1))
                param.grad = None
            if all_none:
                kept.sync = zeroed_sync
        self.exposed = False
