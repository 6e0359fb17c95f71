"""The bytes one stage 3 training step moves, per group, with shard groups and hpZ (closed form).

Counted as zerodp's `Comm` counts them (the bytes of the full tensor a collective works on:
an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), for a model
whose parameters are all sharded, prefetch off and nothing kept between passes, so that
each parameter is gathered once per forward and once per backward:

P = padded elements of the sharded groups, b = bytes per element, A = micro-batches per
step, N = world size, S = shard group size (N without shard groups), H = hpZ group size.

| group | collective | bytes per step |
|---|---|---|
| shard group (the world if S = N) | all-gather, forward and backward (no hpZ) | 2 A P b |
| shard group | all-gather, first forward only (hpZ, H < S) | P b |
| hpZ group | all-gather, every other pass (hpZ) | (2A - 1) P b |
| shard group | reduce-scatter of each micro-batch's gradient | A P b |
| replica group (S < N) | all-reduce of the 1/S shard, once per step | P b / S |
| shard group | all-reduce of the squared gradient norm | 4 |

A group crosses nodes (L ranks per node) when it has ranks on two nodes: the world and the
replica groups when N > L, a shard group when S > L; an hpZ group never (H divides L). So
with shard groups inside a node, the bytes across nodes per step are P b / S whatever A is;
flat stage 3 sends 3 A P b across; hpZ sends (1 + A) P b across.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NORM_BYTES = 4  # the fp32 squared norm, all-reduced in the shard group


@dataclass(frozen=True)
class StepBytes:
    """Bytes per (group label, collective kind); labels as zerodp's `Comm` names them."""

    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    world_size: int = 1
    shard_size: int = 1

    def by_group(self) -> dict[str, dict[str, int]]:
        return {label: dict(kinds) for label, kinds in self.groups.items() if kinds}

    def crosses_nodes(self, label: str, node_size: int) -> bool:
        if label in ("world", "replica"):
            return self.world_size > node_size
        if label == "shard":
            return self.shard_size > node_size
        return False

    def across_nodes(self, node_size: int) -> int:
        return sum(
            sum(kinds.values())
            for label, kinds in self.groups.items()
            if self.crosses_nodes(label, node_size)
        )

    def within_nodes(self, node_size: int) -> int:
        total = sum(sum(kinds.values()) for kinds in self.groups.values())
        return total - self.across_nodes(node_size)


def stage3_step_bytes(
    *,
    numel: int,
    element_size: int,
    micro_batches: int,
    world_size: int,
    shard_size: int = -1,
    secondary_size: int = 1,
) -> StepBytes:
    """The table in the module docstring; `shard_size` -1 shards over all ranks."""
    shard = world_size if shard_size <= 0 else shard_size
    primary = "world" if shard == world_size else "shard"
    full = numel * element_size
    a = micro_batches
    keeps_secondary = 1 < secondary_size < shard
    groups: dict[str, dict[str, int]] = {primary: {}}
    groups[primary]["all_gather"] = full if keeps_secondary else 2 * a * full
    groups[primary]["reduce_scatter"] = a * full
    groups[primary]["all_reduce"] = NORM_BYTES
    if keeps_secondary:
        groups["secondary"] = {"all_gather": (2 * a - 1) * full}
    if shard < world_size:
        groups["replica"] = {"all_reduce": full // shard}
    return StepBytes(groups, world_size, shard)
