"""The engine's post-training methods, each a thin view of `zerodp.posttrain`'s parts.

`ZeroEngine` inherits these, as it inherits DeepSpeed's other methods from
`zerodp.engine.deepspeed_methods`, so that `engine/facade.py` stays the facade of the training loop.
"""

from __future__ import annotations

from collections.abc import Container
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.comm.subgroups import GroupComms
from zerodp.errors import UsageError
from zerodp.expert_parallel import ExpertSplit
from zerodp.group_state import GroupIndex
from zerodp.parallel.composition import Feature, refusal_for
from zerodp.posttrain import PostTraining
from zerodp.posttrain.generation import GenerationReport
from zerodp.posttrain.holding import ParamRuntime, gatherer_of
from zerodp.posttrain.mode import EngineMode
from zerodp.posttrain.state_offload import OffloadDeviceEnum
from zerodp.posttrain.weights import DEFAULT_BUCKET_BYTES, FullParameterStream
from zerodp.tensor_parallel import TensorParallelism


class PostTrainingMethods:
    """Inference mode, generation at stage 3, weight streaming and state offload."""

    # Provided by ZeroEngine.
    module: nn.Module
    comm: Comm
    comms: GroupComms
    groups: GroupIndex
    params: ParamRuntime
    device: torch.device
    posttrain: PostTraining
    tensor_parallel: TensorParallelism | None
    expert_parallel: ExpertSplit | None

    @property
    def mode(self) -> EngineMode:
        """TRAINING, or INFERENCE for an engine with nothing to train ([Note: inference engine])."""
        return self.posttrain.decision.mode

    def gathered_for_generation(
        self,
        layer_by_layer: bool = False,
        *,
        blocks: list[nn.Module] | None = None,
        prefetch_blocks: int = 1,
    ) -> AbstractContextManager[GenerationReport]:
        """A block in which `model.generate` (or any loop of forwards) runs gathered once.

        At stage 3 every sharded parameter is gathered on entry, the per-module hooks
        are off inside, and on exit everything is as it was; see [Note: generation at
        stage 3]. With `layer_by_layer=True`, only the parts outside `blocks` (by
        default the members of the model's longest `nn.ModuleList`: a decoder's layers)
        stay gathered, and each block is gathered as it runs, the next
        `prefetch_blocks` ahead. Gradients are off inside. At stages 0-2 nothing needs
        gathering. A collective: every rank enters. Yields a `GenerationReport`
        (filled in on exit: the most bytes gathered at once).
        """
        return self.posttrain.generation.gathered(
            layer_by_layer, blocks=blocks, prefetch_blocks=prefetch_blocks
        )

    @property
    def generation_block_open(self) -> bool:
        """Whether a `gathered_for_generation()` block is running (it does not nest)."""
        return self.posttrain.generation.is_open

    def full_parameters(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        *,
        merge_adapters: bool = False,
    ) -> FullParameterStream:
        """(name, full tensor) for every tensor of the model's state dict, in buckets.

        Names are `module.state_dict()`'s (a tied tensor once); values equal
        `engine.state_dict()`'s, cast to `dtype` when given. At most `bucket_bytes` are
        assembled at a time (a larger tensor alone), straight from the shards: no
        parameter is gathered. With `merge_adapters=True`, PEFT LoRA adapters are merged
        and the names are those of `merge_and_unload()`'s model. Iterate it for pairs,
        or call `.buckets()` for one list per bucket; `.report` counts what was sent. A
        collective: every rank iterates it to the end. See [Note: weight streaming].
        """
        self.posttrain.check_ready("full_parameters()")
        refused = refusal_for(Feature.MERGED_ADAPTERS, self.comms.dims) if merge_adapters else None
        if refused is not None:  # every rank asks alike: the dims and the argument are shared
            raise UsageError(refused)
        return FullParameterStream(
            self.module,
            self.groups,
            self.comms.shard,  # the shards' group: each part comes from the rank holding it
            gatherer_of(self.params),
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            merge_adapters=merge_adapters,
            device=self.device,
            slices=[
                record
                for record in (
                    None if self.tensor_parallel is None else self.tensor_parallel.split,
                    self.expert_parallel,
                )
                if record is not None
            ],
        )

    def offload_states(
        self,
        include: Container[Any] | None = None,
        device: Any = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move model states to the host (DeepSpeed's names; all of them by default).

        `include`: any of `OffloadStateTypeEnum` (or their names): `lp_params`,
        `hp_params`, `optim_states`, `lp_grads`, `contiguous_grad_buffer`. Until
        `reload_states()`, what needs them on the device is refused; see [Note: state
        offload]. `engine.model_state_bytes()` counts them as host bytes.
        """
        self.posttrain.offload.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back to the device, bitwise as it was."""
        self.posttrain.offload.reload(non_blocking)
