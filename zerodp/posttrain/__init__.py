"""Post-training on an engine: inference engines, generation, weight streaming, state offload.

A post-training loop (RLHF, DPO, GRPO) does more than forward, backward and
step: it keeps a frozen reference model next to the policy, generates between
steps, pushes updated weights to a generation server, and moves training
state off the accelerator while it generates. Each of those is one module here;
the engine's methods (`PostTrainingMethods`) only delegate:

- `mode`: training or inference, decided once (see below);
- `generation`: `engine.gathered_for_generation()` ([Note: generation at stage 3]);
- `layer_stream`: its layer-by-layer variant;
- `weights`: `engine.full_parameters()` ([Note: weight streaming]), with
  `peft_merge` for LoRA adapters merged on the way out;
- `state_offload`: `engine.offload_states()` / `reload_states()` ([Note: state offload]);
- `holding`: holding stage 3 groups for a while and restoring their state.

[Note: inference engine]
`zerodp.initialize(model=ref, config=...)` with nothing to train (no parameter
requires grad, or no optimizer passed and none in the config) builds an
inference engine. Its parameters are laid out as the stage says and cast as the
config says (bf16: 2 bytes per parameter): sharded at stage 3 (2/N bytes per
parameter per rank), whole on every rank at stages 0-2 (a frozen model has no
gradients or optimizer state for stages 1 and 2 to shard). It keeps no
gradient and no optimizer state; `engine.backward()` and `step()` raise, naming
the fix; `initialize` returns None for the optimizer and the scheduler. A
backward through its output still reaches the inputs (a frozen model inside
another model's loss). Parameters that required grad on an engine built without
an optimizer are frozen by it, and unfrozen by `engine.destroy()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.backward.step_gate import StepGate
from zerodp.group_state import GroupIndex
from zerodp.posttrain.generation import GenerationGather, GenerationReport
from zerodp.posttrain.holding import ParamRuntime
from zerodp.posttrain.mode import (
    EngineMode,
    FrozenByEngine,
    InferenceOptimizer,
    ModeDecision,
    decide_mode,
    refusal_message,
)
from zerodp.posttrain.state_offload import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    StateOffload,
)
from zerodp.posttrain.weights import DEFAULT_BUCKET_BYTES, FullParameterStream, StreamReport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EngineMode",
    "FrozenByEngine",
    "FullParameterStream",
    "GenerationReport",
    "InferenceOptimizer",
    "ModeDecision",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "PostTraining",
    "StreamReport",
    "build_post_training",
    "decide_mode",
]

# What an inference engine refuses (the step gate asks before each).
_TRAINING_CALLS = frozenset({"engine.backward()", "engine.scale()", "step()"})


@dataclass
class PostTraining:
    """An engine's post-training parts; `ZeroEngine` holds one and its methods delegate."""

    decision: ModeDecision
    generation: GenerationGather
    offload: StateOffload
    # Outside backward, parameters on the device (generation, weight streaming).
    check_ready: Callable[[str], None]


def build_post_training(
    *,
    module: nn.Module,
    decision: ModeDecision,
    runtime: ParamRuntime,
    groups: GroupIndex,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    gate: StepGate,
) -> PostTraining:
    """Wire the parts; the refusals (inference mode, offloaded states) go to the step gate."""
    offload = StateOffload(
        module=module,
        groups=groups,
        optimizer=optimizer,
        device=device,
        release_gathered=runtime.release_all,
        check_outside_backward=gate.check_outside_backward,
    )
    if not decision.trains:
        gate.add_refusal(_inference_refusal(decision))
    gate.add_refusal(offload.refusal)

    def check_ready(what: str) -> None:
        gate.check_outside_backward(what)
        offload.check(what)

    generation = GenerationGather(module, runtime, groups, check_ready)
    return PostTraining(
        decision=decision, generation=generation, offload=offload, check_ready=check_ready
    )


def _inference_refusal(decision: ModeDecision) -> Callable[[str], str | None]:
    def refuse(what: str) -> str | None:
        return refusal_message(decision, what) if what in _TRAINING_CALLS else None

    return refuse
