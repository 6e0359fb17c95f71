"""`engine.gathered_for_generation()`: many forward passes on a stage 3 model, gathered once.

[Note: generation at stage 3]
`model.generate` runs one forward per token. At stage 3 each of those forwards
gathers and releases every module's parameters through the module hooks: for
T tokens, T all-gathers of the whole model, and Python hooks on every module
call. Inside this context:

- every sharded group is gathered once, on entry (all gathers in flight at
  once), and held until the exit releases it; with `layer_by_layer=True` only
  the groups outside the blocks are, and blocks stream through (see
  `zerodp.posttrain.layer_stream`);
- the stage 3 module hooks are taken out of their modules (`DetachedHooks`), so
  a module call takes `nn.Module.__call__`'s fast path; they are put back at
  their old places on exit;
- gradients are off (`torch.no_grad()`), and a forward with gradients turned on
  again is refused: without the hooks nothing would gather its parameters for
  the backward after the exit has released them.

On exit every group is where it was on entry (gathered if it was, else
released), so a training step before and after sees the engine exactly as if no
generation had run; but the groups a forward kept gathered for its backward are
released on entry, on every rank, since a rank that dropped that forward's
output has let them go already ([Note: kept for the backward's head] in
`zerodp.stage3.forward_graphs`): the backward gathers them again. At stages
0-2 nothing is gathered and no hook is removed; the same gradient rule
applies, so code behaves alike at every stage. Entering is a collective at
stage 3: every rank enters, and runs the same forwards inside.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError
from zerodp.group_state import GroupIndex, ParamStatus
from zerodp.posttrain.holding import ParamRuntime, gatherer_of
from zerodp.posttrain.layer_stream import BlockStream, check_blocks, find_blocks
from zerodp.torch_internals import DetachedHooks

WHAT = "gathered_for_generation()"


class GenerationPhase(enum.Enum):
    OUTSIDE = "outside"
    INSIDE = "inside"


@dataclass
class GenerationReport:
    """What the context gathered, filled in on exit (`with ... as report:`).

    `peak_gathered_bytes`: the most bytes of sharded groups gathered at once inside
    (stage 3; 0 at stages 0-2), counted in the model's dtype.
    """

    peak_gathered_numel: int = 0
    peak_gathered_bytes: int = 0


def _refuse_grad(module: nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        raise UsageError(
            f"a forward with gradients enabled inside engine.{WHAT}: there parameters "
            "are gathered once and the stage 3 hooks are off, so nothing would gather them "
            "for its backward; run forwards that need gradients outside the context (it "
            "turns gradients off itself; do not turn them back on inside)"
        )


class GenerationGather:
    """The context behind `engine.gathered_for_generation()` (one per engine)."""

    def __init__(
        self,
        root: nn.Module,
        runtime: ParamRuntime,
        index: GroupIndex,
        check_ready: Callable[[str], None],
    ) -> None:
        self.root = root
        self.runtime = runtime
        self.index = index
        self.check_ready = check_ready  # outside backward, parameters on the device
        self.phase = GenerationPhase.OUTSIDE

    @property
    def is_open(self) -> bool:
        """Whether a `gathered_for_generation()` block is running (entering again would raise)."""
        return self.phase is GenerationPhase.INSIDE

    @contextlib.contextmanager
    def gathered(
        self,
        layer_by_layer: bool = False,
        blocks: list[nn.Module] | None = None,
        prefetch_blocks: int = 1,
    ) -> Iterator[GenerationReport]:
        self.check_ready(WHAT)
        if self.phase is GenerationPhase.INSIDE:
            raise UsageError(f"engine.{WHAT} is open already; leave it before entering again")
        if blocks is not None and not layer_by_layer:
            raise UsageError(f"engine.{WHAT}: blocks= goes with layer_by_layer=True")
        if layer_by_layer:
            blocks = list(blocks) if blocks is not None else find_blocks(self.root)
            check_blocks(self.root, blocks, prefetch_blocks)
        report = GenerationReport()
        gatherer = gatherer_of(self.runtime)
        with contextlib.ExitStack() as stack:
            self.phase = GenerationPhase.INSIDE
            stack.callback(setattr, self, "phase", GenerationPhase.OUTSIDE)
            if gatherer is not None:
                earlier_peak = gatherer.peak_live_numel
                gatherer.reset_peak()
                stack.callback(self._report, report, earlier_peak)
                states = gatherer.states
                # What a forward kept for its backward is released first, so every rank
                # gathers the same groups ([Note: kept for the backward's head]); the
                # backward gathers it again. Gathered on entry stays gathered on exit.
                gatherer.release_kept()
                kept = [
                    s for s in states if s.sharded_gather.status is not ParamStatus.NOT_AVAILABLE
                ]
                gatherer.hold_all(kept)
                stack.callback(gatherer.unhold_all, kept, False)
                if layer_by_layer and blocks is not None:
                    stream = BlockStream(gatherer, self.index, blocks, prefetch_blocks)
                    stream.open()
                    stack.callback(stream.close)
                else:
                    gatherer.hold_all(states)
                    stack.callback(gatherer.unhold_all, states)
            detached = DetachedHooks(self.runtime.module_hooks)
            stack.callback(detached.restore)
            stack.callback(self.root.register_forward_pre_hook(_refuse_grad, prepend=True).remove)
            stack.enter_context(torch.no_grad())
            yield report

    def _report(self, report: GenerationReport, earlier_peak: int) -> None:
        gatherer = gatherer_of(self.runtime)
        if gatherer is None:
            return
        peak = gatherer.peak_live_numel
        report.peak_gathered_numel = peak
        itemsize = max((s.flat.full.element_size() for s in gatherer.states), default=0)
        report.peak_gathered_bytes = peak * itemsize
        gatherer.peak_live_numel = max(peak, earlier_peak)
