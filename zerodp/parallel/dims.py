"""The parallel dimensions of a run and every rule that depends on them, in one place.

[Note: parallel dimensions]
The N ranks of a run form a mesh of four dimensions, outermost first (expert
parallelism subdivides the shard dimension, below):

    replica (R)  x  shard (Z)  x  sequence (S)  x  tensor (T)  =  N

rank = ((r * Z + z) * S + s) * T + t. Inner dimensions hold consecutive ranks,
so the traffic that runs most often (a tensor-parallel layer's all-reduce, a
sequence-parallel attention's all-to-alls) stays inside a node. Z counts the
data ranks inside one shard group; the shard group itself is Z x S ranks.

- tensor group (same r, z, s; T ranks): each holds 1/T of every split weight.
- sequence group (same r, z, t; S ranks): same parameters, disjoint tokens of
  the same sequences; their gradients are parts of one sum.
- shard group (same r, t; Z x S ranks): what ZeRO shards over. Sequence ranks
  hold the same parameters, so they shard them too (as DeepSpeed, Megatron and
  torchtitan do): memory is the ZeRO figure for Z x S ranks.
- replica group (same z, s, t; R ranks): shard groups that copy each other
  (`mics_shard_size`, see [Note: shard groups] in `zerodp.comm.topology`).
- secondary group (hpZ, H consecutive places of a shard group).
- slice group (same t; R x Z x S ranks): the ranks that hold the same parameter
  values, the same tensor-parallel slices (every rank when T = 1).
- expert (EP) group: E consecutive places of a shard group (place k = z x S + s;
  EP rank k mod E). Its ranks read different tokens (data and sequence ranks)
  and hold different E-ths of every MoE layer's experts; tokens travel between
  them. E divides Z x S, so E x S can be the same ranks (a sequence group that
  is also an EP group).
- expert-data group (same r, t, k mod E; Z x S / E ranks): the ranks holding
  the same experts; ZeRO shards the experts over it, and stage 3 gathers them
  there only.
- data ranks: D = R x Z. Ranks with the same data index (r * Z + z) are handed
  the same samples: a sequence group splits them, a tensor group shares them.

The rules, written here only:
1. Reduction: a gradient is summed over the sequence ranks and averaged over
   the D data ranks (micro-batches are averaged by the loss's 1/accumulation
   factor). A sum over a shard group covers Z data ranks and S sequence ranks,
   so it is divided by Z; a sum over a replica group by R. An expert's gradient,
   summed over its expert-data group, holds the contributions of every token
   that reached it from every rank (the all-to-all's backward brought them),
   so it is divided by Z too: not by E, not by the expert-data group's size.
2. Norm: each gradient element is counted once. Shards of one shard group are
   disjoint (stages 1-3), so their squares are summed over it; replicas hold
   copies and are not. A tensor-parallel slice is disjoint across its tensor
   group; a weight the plan leaves whole is a copy there. Experts are disjoint
   across the EP group; whole experts (stage 0) are copies over the expert-data
   group, their shards (stages 1-3) disjoint, so over the shard group.
3. Data: which samples a rank reads (`data_index` of `data_size`).
4. Values: the ranks of a slice group hold the same parameter values, so a
   model's values are taken from the first rank of each slice group
   (`same_values_label`); a tensor-parallel or expert-parallel model is made
   whole and equal on every rank before it is split, so the slices are those
   of one model.
5. Tokens: a sequence of L tokens is padded to S x ceil(L / S) and split into S
   equal, consecutive slices; sequence rank s holds slice s (`sequence_slice`).
   The batch sizes of the config count data ranks, not sequence or tensor ranks
   (`data_parallel_size`), as DeepSpeed's do.
6. Reported values: a per-batch value a rank reports (its loss) is the same on every
   rank of its sequence and tensor group (`ranks_per_batch` = S x T); its mean over
   the data ranks is its sum over the world divided by D x S x T
   (`reported_value_divisor`).
7. Checkpoints: a checkpoint records these sizes (`to_record`), and a load asks the
   saved dims how saved parts combine (`window_sum_sources`: a window's local sums,
   summed over sequence ranks and averaged over data ranks).
8. Tensor slices: a split weight is cut into T equal consecutive ranges of its split
   dimension, tensor rank t holding range t (`tensor_slices`); a checkpoint saved at T
   and loaded at T' asks the saved dims for the saved parts and its own for its slice
   (`zerodp.parallel.tensor_slices`: which saved rows make up a piece of another cut).
9. Expert slices: an MoE layer's experts are cut into E equal consecutive ranges, EP
   rank k holding range k (`expert_slice`, `zerodp.parallel.expert_slices`).

Which features compose with which dimension is the table beside this module
(`zerodp.parallel.composition`), not a rule scattered over the code.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.errors import ConfigError
from zerodp.parallel.expert_slices import held_experts
from zerodp.parallel.saved_layouts import SavedLayoutRules
from zerodp.parallel.sequence_slice import SequenceSlice
from zerodp.parallel.sizes import size_problems

WORLD = "world"
SHARD = "shard"
REPLICA = "replica"
SECONDARY = "secondary"
SEQUENCE = "sequence"
TENSOR = "tensor"
SLICE = "slice"
EXPERT = "expert"
EXPERT_DATA = "expert_data"

# The kinds with process groups of their own.
LABELS = (SHARD, REPLICA, SECONDARY, SEQUENCE, TENSOR, SLICE, EXPERT, EXPERT_DATA)
KINDS = (WORLD, *LABELS)


@dataclass(frozen=True)
class ParallelDims(SavedLayoutRules):
    """The mesh of one run, seen from `rank`. Pure arithmetic: every rank computes the same.

    `shard_group_size` is the size of a shard group (Z x S ranks; `world_size / tensor_size`
    when sharding over every data and sequence rank), `secondary_size` hpZ's H (1: none),
    `sequence_size` S, `tensor_size` T. Build with `ParallelDims.build`, which checks the
    sizes; the constructor trusts them.
    """

    world_size: int
    rank: int
    shard_group_size: int
    secondary_size: int = 1
    sequence_size: int = 1
    tensor_size: int = 1
    expert_size: int = 1

    @classmethod
    def build(
        cls,
        world_size: int,
        rank: int,
        *,
        shard_group_size: int = -1,
        secondary_size: int = 1,
        sequence_size: int = 1,
        tensor_size: int = 1,
        expert_size: int = 1,
    ) -> ParallelDims:
        """The dims for these sizes (`shard_group_size` <= 0: a shard group of every data and
        sequence rank; else the config's `mics_shard_size`, which counts Z x S ranks).

        Raises `ConfigError` naming the fix when the sizes do not divide the world.
        """
        problems = size_problems(
            world_size, shard_group_size, sequence_size, tensor_size, expert_size
        )
        if problems:
            raise ConfigError("; ".join(problems))
        per_slice = world_size // tensor_size
        shard = per_slice if shard_group_size <= 0 else shard_group_size
        return cls(world_size, rank, shard, secondary_size, sequence_size, tensor_size, expert_size)

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """R: shard groups that copy each other."""
        return self.world_size // (self.shard_group_size * self.tensor_size)

    @property
    def data_size(self) -> int:
        """D: ranks that read different samples (the data-parallel degree)."""
        return self.num_replicas * self.shard_data_size

    @property
    def shard_data_size(self) -> int:
        """Z: data ranks inside one shard group."""
        return self.shard_group_size // self.sequence_size

    @property
    def hybrid(self) -> bool:
        """Whether shard groups replicate each other (R > 1)."""
        return self.num_replicas > 1

    @property
    def keeps_secondary(self) -> bool:
        """Whether hpZ keeps a secondary shard (H > 1 and smaller than the shard group)."""
        return 1 < self.secondary_size < self.shard_group_size

    @property
    def ranks_per_batch(self) -> int:
        """S x T: the ranks that compute on one batch (a sequence group splits its tokens, a
        tensor group shares it); the world is D x `ranks_per_batch`."""
        return self.sequence_size * self.tensor_size

    @property
    def is_flat(self) -> bool:
        """Whether one group of every rank shards everything and nothing else splits: the
        run needs no process group beyond the world."""
        return (
            self.shard_group_size == self.world_size
            and self.secondary_size <= 1
            and self.ranks_per_batch == self.expert_size == 1
        )

    @property
    def shard_span(self) -> int:
        """The consecutive ranks one shard group spreads over (its Z x S places, each with
        its T tensor ranks inside): what must fit the nodes."""
        return self.shard_group_size * self.tensor_size

    @property
    def splits_experts(self) -> bool:
        return self.expert_size > 1

    @property
    def expert_data_size(self) -> int:
        """The ranks of a shard group holding the same experts (Z x S / E)."""
        return self.shard_group_size // self.expert_size

    @property
    def splits_sequences(self) -> bool:
        return self.sequence_size > 1

    @property
    def splits_tensors(self) -> bool:
        return self.tensor_size > 1

    # -- this rank's place ---------------------------------------------------------------

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_size

    @property
    def sequence_rank(self) -> int:
        return (self.rank // self.tensor_size) % self.sequence_size

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group (the shard it holds)."""
        return (self.rank // self.tensor_size) % self.shard_group_size

    @property
    def expert_rank(self) -> int:
        """Which E-th of every MoE layer's experts this rank holds (its place in its EP group)."""
        return self.shard_rank % self.expert_size

    @property
    def expert_data_rank(self) -> int:
        """This rank's place in its expert-data group (the shard of its experts it holds)."""
        return self.shard_rank // self.expert_size

    @property
    def replica_index(self) -> int:
        """Which shard group (of the R copies) this rank is in."""
        return self.rank // (self.tensor_size * self.shard_group_size)

    @property
    def data_index(self) -> int:
        """Which samples this rank reads: the same for a whole sequence and tensor group."""
        return self.replica_index * self.shard_data_size + self.shard_rank // self.sequence_size

    def sequence_slice(self, length: int) -> SequenceSlice:
        """The tokens of a `length`-token sequence this rank holds (rule 5)."""
        return SequenceSlice.of(length, self.sequence_size, self.sequence_rank)

    def expert_slice(self, num_experts: int) -> range:
        """The experts of an MoE layer of `num_experts` this rank holds (rule 9)."""
        return held_experts(num_experts, self.expert_size, self.expert_rank)

    # -- groups --------------------------------------------------------------------------

    def _rank_at(self, replica: int, shard_place: int, tensor: int) -> int:
        return (replica * self.shard_group_size + shard_place) * self.tensor_size + tensor

    def shard_groups(self) -> list[list[int]]:
        return [
            [self._rank_at(r, k, t) for k in range(self.shard_group_size)]
            for r in range(self.num_replicas)
            for t in range(self.tensor_size)
        ]

    def replica_groups(self) -> list[list[int]]:
        return [
            [self._rank_at(r, k, t) for r in range(self.num_replicas)]
            for k in range(self.shard_group_size)
            for t in range(self.tensor_size)
        ]

    def secondary_groups(self) -> list[list[int]]:
        h = self.secondary_size
        return [
            [self._rank_at(r, block * h + j, t) for j in range(h)]
            for r in range(self.num_replicas)
            for block in range(self.shard_group_size // h)
            for t in range(self.tensor_size)
        ]

    def sequence_groups(self) -> list[list[int]]:
        s = self.sequence_size
        return [
            [self._rank_at(r, z * s + j, t) for j in range(s)]
            for r in range(self.num_replicas)
            for z in range(self.shard_data_size)
            for t in range(self.tensor_size)
        ]

    def expert_groups(self) -> list[list[int]]:
        """E consecutive places of a shard group: the ranks that hold different experts and
        exchange tokens (an EP group)."""
        e = self.expert_size
        return [
            [self._rank_at(r, j * e + i, t) for i in range(e)]
            for r in range(self.num_replicas)
            for j in range(self.shard_group_size // e)
            for t in range(self.tensor_size)
        ]

    def expert_data_groups(self) -> list[list[int]]:
        """The places of a shard group with the same expert rank: they hold the same experts,
        which ZeRO shards over them (an expert-data group)."""
        e = self.expert_size
        return [
            [self._rank_at(r, j * e + i, t) for j in range(self.shard_group_size // e)]
            for r in range(self.num_replicas)
            for i in range(e)
            for t in range(self.tensor_size)
        ]

    def tensor_groups(self) -> list[list[int]]:
        t = self.tensor_size
        return [list(range(start, start + t)) for start in range(0, self.world_size, t)]

    def slice_groups(self) -> list[list[int]]:
        """The ranks with the same tensor rank: they hold the same parameter values."""
        return [list(range(t, self.world_size, self.tensor_size)) for t in range(self.tensor_size)]

    def shard_group_ranks(self, replica: int, tensor: int) -> list[int]:
        """The world ranks of the shard group of replica `replica` and tensor rank `tensor`,
        in shard order (place k of the group holds shard k)."""
        return [self._rank_at(replica, k, tensor) for k in range(self.shard_group_size)]

    def expert_data_group_ranks(self, replica: int, tensor: int, expert: int) -> list[int]:
        """The world ranks of the expert-data group of replica `replica`, tensor rank `tensor`
        and EP rank `expert`, in shard order (place k of the group holds shard k of those
        experts)."""
        e = self.expert_size
        return [
            self._rank_at(replica, j * e + expert, tensor)
            for j in range(self.shard_group_size // e)
        ]

    def groups_of(self, label: str) -> list[list[int]]:
        """Every group of kind `label` (a partition of the ranks)."""
        builders = {
            WORLD: lambda: [list(range(self.world_size))],
            SHARD: self.shard_groups,
            REPLICA: self.replica_groups,
            SECONDARY: self.secondary_groups,
            SEQUENCE: self.sequence_groups,
            TENSOR: self.tensor_groups,
            SLICE: self.slice_groups,
            EXPERT: self.expert_groups,
            EXPERT_DATA: self.expert_data_groups,
        }
        if label not in builders:
            raise ValueError(f"no kind of group is called {label!r}; the kinds: {KINDS}")
        return builders[label]()

    def own_group(self, label: str) -> list[int]:
        """The ranks of this rank's group of kind `label` ("world": every rank)."""
        return next(g for g in self.groups_of(label) if self.rank in g)

    def group_size(self, label: str) -> int:
        sizes = {
            WORLD: self.world_size,
            SHARD: self.shard_group_size,
            REPLICA: self.num_replicas,
            SECONDARY: self.secondary_size,
            SEQUENCE: self.sequence_size,
            TENSOR: self.tensor_size,
            SLICE: self.world_size // self.tensor_size,
            EXPERT: self.expert_size,
            EXPERT_DATA: self.expert_data_size,
        }
        if label not in sizes:
            raise ValueError(f"no kind of group is called {label!r}; the kinds: {KINDS}")
        return sizes[label]

    def needs_group(self, label: str) -> bool:
        """Whether `label`'s groups need process groups of their own (not the world's).

        A shard group smaller than the world always does, even of one rank (tensor
        parallelism over every rank): its reductions must not reach the other ranks.
        """
        if label == SECONDARY:
            return self.keeps_secondary
        if label == SHARD:
            return self.shard_group_size < self.world_size
        if label == EXPERT_DATA:  # its reductions must not reach the other experts' holders
            return self.splits_experts
        return 1 < self.group_size(label) < self.world_size

    def same_values_label(self) -> str:
        """The kind of group whose ranks hold the same parameter values (rule 4 of
        [Note: parallel dimensions]): the world, or with tensor parallelism the slice group."""
        return SLICE if self.splits_tensors else WORLD

    # -- the rules -----------------------------------------------------------------------

    def gradient_divisor(self, label: str) -> int:
        """What a gradient summed over this rank's group of kind `label` is divided by.

        Rule 1 of [Note: parallel dimensions]: over a shard group, its data ranks (the
        sequence ranks' parts add up to one gradient); over a replica group, the replicas;
        over the ranks holding the same values (the world without tensor parallelism, the
        slice group with it), every data rank.
        """
        if label in (SHARD, EXPERT_DATA):
            return self.shard_data_size
        if label == REPLICA:
            return self.num_replicas
        if label == SLICE or (label == WORLD and not self.splits_tensors):
            return self.data_size
        if label == WORLD:
            raise ValueError(
                "a gradient summed over the world would add different tensor-parallel slices; "
                "sum over the slice group"
            )
        raise ValueError(f"gradients are not reduced over {label!r} groups")

    def joined_gradient_scale(self, training_ranks: int) -> float:
        """Rule 1 inside `engine.join()`, where ranks that ran out contribute zeros: what the
        gradient averaged over all D data ranks is multiplied by to be the mean over the
        `training_ranks` still training (join runs only where every rank is a data rank)."""
        if not 0 < training_ranks <= self.data_size:
            raise ValueError(f"{training_ranks} training ranks of {self.data_size} data ranks")
        return self.data_size / training_ranks

    def reported_value_divisor(self) -> int:
        """What a per-batch value (a loss) summed over the world is divided by for its mean
        over the data ranks (rule 6): every rank of a sequence and tensor group reports its
        batch's value alike, so each batch is counted `ranks_per_batch` times."""
        return self.data_size * self.ranks_per_batch

    def norm_sum_groups(
        self, *, sharded: bool, tensor_split: bool = False, expert: bool = False
    ) -> tuple[str, ...]:
        """The groups a squared gradient norm is summed over so that each element counts once.

        Rule 2 of [Note: parallel dimensions]. `sharded`: the rank holds a shard of each
        gradient (stages 1-3), else the whole of it (stage 0); `tensor_split`: the
        gradients are of tensor-parallel slices; `expert`: of expert slices. An expert's
        shards are disjoint over its expert-data group and the experts over the EP group,
        which together are the shard group; whole experts (stage 0) are copies over the
        expert-data group and disjoint over the EP group.
        """
        groups = []
        if sharded and self.shard_group_size > 1:
            groups.append(SHARD)
        elif expert and not sharded and self.splits_experts:
            groups.append(EXPERT)
        if tensor_split and self.tensor_size > 1:
            groups.append(TENSOR)
        return tuple(groups)
