"""Whether the sizes of the parallel dimensions fit the world, each problem naming its fix.

Asked by `ParallelDims.build` and by the config's batch arithmetic before any process group
exists (see [Note: parallel dimensions] in `zerodp.parallel.dims`).
"""

from __future__ import annotations

from zerodp.errors import ConfigError


def data_parallel_size(world_size: int, sequence_size: int = 1, tensor_size: int = 1) -> int:
    """D: the ranks that read different samples, which the config's batch sizes count.

    Raises `ConfigError` naming the fix when the sequence and tensor sizes do not divide
    the world (rule 5 of [Note: parallel dimensions]).
    """
    problems = size_problems(world_size, -1, sequence_size, tensor_size)
    if problems:
        raise ConfigError("; ".join(problems))
    return world_size // (sequence_size * tensor_size)


def size_problems(
    world_size: int,
    shard_group_size: int,
    sequence_size: int,
    tensor_size: int,
    expert_size: int = 1,
) -> list[str]:
    """What is wrong with these sizes (each message names the fix); empty when they fit."""
    problems = []
    for name, size in (
        ("sequence_parallel_size", sequence_size),
        ("tensor_parallel.autotp_size", tensor_size),
        ("expert_parallel.autoep_size", expert_size),
    ):
        if size < 1:
            problems.append(f"{name} must be at least 1, got {size}")
    if problems:
        return problems
    inner = sequence_size * tensor_size
    if world_size % inner != 0:
        problems.append(
            f"sequence_parallel_size {sequence_size} x tensor_parallel.autotp_size "
            f"{tensor_size} = {inner} does not divide the world size {world_size}: launch a "
            f"multiple of {inner} ranks, or choose sizes whose product divides {world_size}"
        )
        return problems
    per_slice = world_size // tensor_size
    if shard_group_size > 0:
        if per_slice % shard_group_size != 0:
            ranks = (
                f"the world size {world_size}"
                if tensor_size == 1
                else f"the {per_slice} ranks that shard each tensor-parallel slice"
            )
            problems.append(
                f"zero_optimization.mics_shard_size {shard_group_size} does not divide {ranks}: "
                f"set it to a divisor of {per_slice} (e.g. the ranks per node), or to -1 to "
                "shard over all of them"
            )
        elif shard_group_size % sequence_size != 0:
            problems.append(
                f"zero_optimization.mics_shard_size {shard_group_size} splits a sequence group of "
                f"{sequence_size} ranks: set it to a multiple of sequence_parallel_size"
            )
    if problems:
        return problems
    reading = per_slice if shard_group_size <= 0 else shard_group_size
    if reading % expert_size != 0:
        where = " of a shard group" if shard_group_size > 0 else ""
        problems.append(
            f"expert_parallel.autoep_size {expert_size} does not divide the {reading} ranks "
            f"that read different tokens (data x sequence ranks{where}): set autoep_size to a "
            f"divisor of {reading}"
        )
    return problems
