"""Sequence parallelism's pieces that need no process group: the config key and its refusals,
the batch arithmetic (DeepSpeed's), the reduction dtype, grouped-query head repeats, label
shifting, and the `zerodp.sequence` import contract."""

from __future__ import annotations

import math

import pytest
import torch

from zerodp.config import load_config
from zerodp.errors import ConfigError, UsageError
from zerodp.precision import precision_policy
from zerodp.sequence import count_targets, shift_labels
from zerodp.sequence.attention import key_value_repeats


def config(**top: object) -> dict[str, object]:
    return {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2, **top}


def test_the_batch_sizes_count_the_data_ranks_as_deepspeed_does() -> None:
    """DeepSpeed 0.19.8's config divides the world size by sequence_parallel_size before its
    batch arithmetic (`DeepSpeedConfig.__init__`): train_batch_size = micro x gas x world / S."""
    resolved = load_config({**config(), "gradient_accumulation_steps": 3}, world_size=8)
    assert resolved.train_batch_size == 2 * 3 * 4
    auto = load_config(
        {**config(), "train_batch_size": "auto", "gradient_accumulation_steps": 2}, world_size=8
    )
    assert auto.train_batch_size == 2 * 2 * 4
    with pytest.raises(ConfigError, match=r"data-parallel size 4 \(world size 8 / sequence_"):
        load_config({**config(), "train_batch_size": 12}, world_size=8)
    with pytest.raises(ConfigError, match="sequence_parallel_size 3 x tensor_parallel"):
        load_config(config(sequence_parallel_size=3), world_size=8)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {"zero_optimization": {"stage": 2, "mics_shard_size": 2}},
            "mics_shard_size 2: zerodp does not combine sequence parallelism with shard groups",
        ),
        (
            {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
            "set zero_optimization.zero_hpz_partition_size to 1",
        ),
        ({"compile": {"enabled": True}}, "set compile.enabled to false"),
        ({"eigenvalue": {"enabled": True}}, "set eigenvalue.enabled to false"),
    ],
)
def test_what_does_not_compose_yet_is_refused_naming_the_pair(
    extra: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 with") as caught:
        load_config(config(**extra), world_size=4)
    assert named in str(caught.value)
    load_config({**config(**extra), "sequence_parallel_size": 1}, world_size=4)  # fine alone


def test_seq_parallel_communication_data_type_replaces_communication_data_type() -> None:
    bf16 = {"bf16": {"enabled": True}, "communication_data_type": "bf16"}
    assert precision_policy(load_config(config(**bf16), world_size=2)).comm_dtype == torch.float32
    chosen = config(**bf16, seq_parallel_communication_data_type="bf16")
    assert precision_policy(load_config(chosen, world_size=2)).comm_dtype == torch.bfloat16
    plain = {**config(**bf16), "sequence_parallel_size": 1}
    assert precision_policy(load_config(plain, world_size=2)).comm_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(4, 4, 2), (4, 2, 2), (4, 2, 4), (8, 1, 4), (12, 4, 6), (12, 3, 4), (16, 2, 8)],
)
def test_key_value_heads_are_repeated_so_each_rank_gets_the_ones_its_query_heads_use(
    heads: int, kv_heads: int, size: int
) -> None:
    """After the repeat, rank s's query heads [s H/S, (s+1) H/S) use exactly the key/value
    heads it receives, as head h uses key/value head h // (H / H_kv) before."""
    repeats = key_value_repeats(heads, kv_heads, size)
    kept = kv_heads * repeats
    assert kept % size == 0 and heads % kept == 0
    assert repeats == (1 if kv_heads % size == 0 else size // math.gcd(kv_heads, size))
    q_per_rank, kv_per_rank = heads // size, kept // size
    for rank in range(size):
        for h in range(rank * q_per_rank, (rank + 1) * q_per_rank):
            repeated = h // (heads // kept)  # its key/value head after the repeat
            assert rank * kv_per_rank <= repeated < (rank + 1) * kv_per_rank
            assert repeated // repeats == h // (heads // kv_heads)  # the same original head


def test_heads_that_do_not_split_are_refused() -> None:
    with pytest.raises(UsageError, match="does not divide the model's 6 attention heads"):
        key_value_repeats(6, 2, 4)


def test_labels_are_shifted_before_the_split_and_targets_counted_once() -> None:
    labels = torch.tensor([[5, 6, -100, 8], [-100, -100, 3, 4]])
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[6, -100, 8, -100], [-100, 3, 4, -100]]
    assert int(count_targets(shifted)) == 4


def test_lightnings_strategy_refuses_sequence_and_expert_parallelism() -> None:
    """Lightning's loaders shard by process: a sequence group would get different batches."""
    pytest.importorskip("lightning")
    from zerodp.integrations.lightning import ZeroDPStrategy

    with pytest.raises(ConfigError, match="use ZeroDPTrainer or a plain loop"):
        ZeroDPStrategy({"sequence_parallel_size": 2})
    with pytest.raises(ConfigError, match="expert parallelism"):
        ZeroDPStrategy({"expert_parallel": {"enabled": True, "autoep_size": 2}})
    ZeroDPStrategy({"expert_parallel": {"enabled": False, "autoep_size": 2}})


def test_the_integrations_refuse_a_size_that_is_not_a_positive_integer() -> None:
    """Read before the config is parsed (to size loaders), a bad size is an error naming
    its key, not a size of 1."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from zerodp.integrations.lightning import ZeroDPStrategy
    from zerodp.integrations.trainer_data import trainer_dims
    from zerodp.integrations.trainer_sequence import sequence_size_of

    with pytest.raises(ConfigError, match="'sequence_parallel_size': got 0"):
        ZeroDPStrategy({"sequence_parallel_size": 0})
    with pytest.raises(ConfigError, match=r"'tensor_parallel\.autotp_size': got '2'"):
        trainer_dims({"tensor_parallel": {"autotp_size": "2"}}, 2, 0)
    with pytest.raises(ConfigError, match="'sequence_parallel_size': got True"):
        sequence_size_of({"sequence_parallel_size": True})
    assert sequence_size_of({}) == 1
    assert trainer_dims({"tensor_parallel": {"autotp_size": 2.0}}, 2, 0).tensor_size == 2
