"""Training on uneven inputs: `with engine.join():`, DDP's `Join` for a ZeRO engine.

[Note: joining uneven inputs]
A rank that runs out of batches leaves its training loop while the others go
on; every collective they issue then waits for it. Inside `engine.join()` (or
torch's `Join([engine])`) the ranks still training announce each round (one
forward, its backward, its `step()`) with a one-element all-reduce at the
start of the forward; a rank that has left its loop answers in the join
context's exit and then shadows the round: it runs the forward again on its
last inputs, a backward that sends zeros as its gradients, and `step()`. So it
issues exactly the collectives the others issue (stage 3's gathers, the
reductions, the step's norm and all-gather), and it steps the optimizer state
it owns: a ZeRO rank cannot simply sit out, because a shard of every update is
its own. When every rank has joined, the context ends on all of them.

Each rank's gradient in a round is averaged as DDP averages it: over the
initial world size (`divide_by_initial_world_size=True`, the default: the
ranks that ran out add zeros), or over the ranks still training (`False`:
the reductions scale by world size / ranks training, from the round's
all-reduce).

A round must be one forward, one backward and one `step()` per micro-batch (the
DeepSpeed contract); the shadow forward must take the path the others take
(the same modules at stage 3), as for any ZeRO-3 collective. Outside a join
context none of this runs (the check is one attribute read per forward).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from zerodp._tree import grad_tensors_in
from zerodp.backward.reducer import GradientReducer
from zerodp.comm import Comm
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.uneven_inputs import Activity
from zerodp.comm.join_protocol import (
    CallbackJoinHook,
    Join,
    Joinable,
    disabled_join_config,
    join_enabled,
    notify_join,
)
from zerodp.comm.subgroups import GroupComms
from zerodp.errors import UsageError
from zerodp.parallel.composition import Feature, refusal_for


class JoinPhase(enum.Enum):
    """What this rank does inside a join context."""

    TRAINING = "training"  # its own batches; each forward announces a round
    SHADOWING = "shadowing"  # out of batches: repeating the others' rounds


class JoinMethods(Joinable):
    """The engine as a joinable (see [Note: joining uneven inputs])."""

    # Provided by ZeroEngine.
    comm: Comm
    comms: GroupComms
    device: torch.device
    reducer: GradientReducer
    tensor_parallel: Any  # None without tensor parallelism

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError  # ZeroEngine's

    def step(self) -> None:
        raise NotImplementedError  # ZeroEngine's

    def _init_join(self) -> None:
        self._join_config = disabled_join_config()
        self._join_phase = JoinPhase.TRAINING
        self._join_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._join_divide_by_initial_world_size = True

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context in which ranks may run out of batches at different times.

        `with engine.join(): for batch in my_batches: ...` — a rank that runs out
        repeats the others' rounds, contributing zero gradients, until every rank has
        run out; see [Note: joining uneven inputs]. The same as torch's
        `Join([engine], ...)`, with DDP's arguments and defaults.
        """
        self._refuse_join_with_shared_batches()
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    # -- torch's joinable protocol ---------------------------------------------------

    def join_hook(self, **kwargs: Any) -> CallbackJoinHook:
        """What this rank does once out of batches (called by torch's `Join`, on entering).

        Entering is an activity the ranks agree on ([Note: agreeing before a collective]):
        a join on some ranks only would pair its all-reduces with the others' training
        collectives, so it is an `UnevenInputsError` on every rank here, at once."""
        agreement().agree_now(self.comm, Activity.JOINING, "entering engine.join()")
        self._refuse_join_with_shared_batches()
        self._join_divide_by_initial_world_size = bool(
            kwargs.get("divide_by_initial_world_size", True)
        )
        return CallbackJoinHook(main=self._shadow_round, post=self._end_join)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.comm.group

    def _refuse_join_with_shared_batches(self) -> None:
        """A shadow round of a tensor or sequence group would need every rank of the group
        to run out at once ([Note: composition table]). Every rank calls join, so every
        rank raises."""
        message = refusal_for(Feature.JOIN, self.comms.dims)
        if message is not None:
            raise UsageError(message)

    # -- rounds ------------------------------------------------------------------------

    def _announce_round(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward starts: inside a join context, tell the ranks that ran out (one
        all-reduce) and keep the inputs a shadow round would repeat."""
        if self._join_phase is JoinPhase.SHADOWING or not join_enabled(self):
            return
        training = notify_join(self)
        self._join_inputs = (args, kwargs)
        if training and not self._join_divide_by_initial_world_size:
            # Average over the ranks still training, not over all D.
            self.reducer.rank_scale = self.comms.dims.joined_gradient_scale(training)

    def _shadow_round(self) -> None:
        if self._join_inputs is None:
            raise UsageError(
                f"rank {self.comm.rank} ran out of batches inside engine.join() before its "
                "first forward there, so it has no inputs to repeat the other ranks' rounds "
                "with; give every rank at least one batch inside the join context"
            )
        args, kwargs = self._join_inputs
        self.reducer.rank_scale = 1.0  # zeros: any scale would do
        self._join_phase = JoinPhase.SHADOWING
        try:
            outputs = grad_tensors_in(self(*args, **kwargs))
            if outputs:
                torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
            self.step()
        finally:
            self._join_phase = JoinPhase.TRAINING

    def _end_join(self, is_last_joiner: bool) -> None:
        self._join_inputs = None
        self.reducer.rank_scale = 1.0
