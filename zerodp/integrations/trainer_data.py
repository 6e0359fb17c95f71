"""The Trainer's data when ranks share a batch: every rank of a tensor or sequence group gets it.

With `tensor_parallel.autotp_size` T > 1 or `sequence_parallel_size` S > 1, the
T x S ranks of a tensor-by-sequence block compute on the same samples, so the
Trainer's data loaders (prepared by Accelerate) are split over the
world / (T x S) data ranks, each rank reading the part of its data index
(`ParallelDims.data_index`, the rule the engine's own loader follows), and the
Trainer's batch accounting (`get_tp_size()`: the total batch size, the token
count a loss is normalised by) counts T x S ranks per batch.
"""

from __future__ import annotations

from typing import Any

from zerodp.config.fields import parallel_size
from zerodp.integrations.trainer_config import read_config
from zerodp.parallel import ParallelDims


def trainer_dims(
    zerodp_config: Any, world_size: int, rank: int, sequence_size: int = 1
) -> ParallelDims:
    """The dims the engine will have, from the config's `tensor_parallel.autotp_size` and
    `sequence_size`, read before the engine exists (the Trainer prepares its loaders first).

    Sizes that do not fit the world raise `ConfigError` naming the fix here, on every rank
    alike, rather than training on loaders split some other way.
    """
    block = read_config(zerodp_config).get("tensor_parallel")
    size = block.get("autotp_size") if isinstance(block, dict) else None
    tensor = parallel_size(size, "tensor_parallel.autotp_size")
    return ParallelDims.build(world_size, rank, sequence_size=sequence_size, tensor_size=tensor)


def route_data_loaders(accelerator: Any, ranks: ParallelDims) -> None:
    """Make `accelerator.prepare_data_loader` split data over the data ranks, not the world.

    The same call Accelerate makes (its own settings), with the data ranks' count and this
    rank's data index; a no-op when every rank reads its own batches.
    """
    if ranks.ranks_per_batch == 1:
        return
    from accelerate.data_loader import prepare_data_loader

    original = accelerator.prepare_data_loader

    def prepare(
        data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = accelerator.device_placement
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=ranks.data_size,
            process_index=ranks.data_index,
            split_batches=accelerator.split_batches,
            put_on_device=device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare
