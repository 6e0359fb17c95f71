"""Tensor parallelism without processes: the config block, the batch arithmetic, a model's plan
read and matched, and every check `plan_split` makes before anything changes."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from tests.hf_models import build_llama
from tests.tp_reference import USER_PLAN, block_net
from zerodp.config import load_config
from zerodp.errors import ConfigError
from zerodp.tensor_parallel import PlanSource, Style, matches, plan_split, read_plan


def load(world: int = 4, **config: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 2, **config}, world_size=world)


# -- the config block -----------------------------------------------------------------------


def test_batches_count_the_data_ranks() -> None:
    config = load(tensor_parallel={"autotp_size": 2}, gradient_accumulation_steps=3)
    assert config.train_batch_size == 2 * 3 * 2  # 4 ranks are 2 data ranks of 2
    with pytest.raises(ConfigError, match=re.escape("x data-parallel size 2 (world size 4 / ")):
        load(tensor_parallel={"autotp_size": 2}, train_batch_size=8, gradient_accumulation_steps=1)
    with pytest.raises(ConfigError, match="autotp_size 3 = 3 does not divide the world size 4"):
        load(tensor_parallel={"autotp_size": 3})


def test_deepspeeds_keys_are_honoured_or_refused_by_name() -> None:
    config = load(
        tensor_parallel={
            "autotp_size": 2,
            "tp": {"tp_size": 2, "tp_grain_size": 1},
            "dtype": "bf16",
        },
        bf16={"enabled": True},
    )
    assert config.tensor_parallel.size == 2 and config.tensor_parallel.dtype == "bf16"
    # DeepSpeed's field name beside its alias `tp`.
    named = load(tensor_parallel={"autotp_size": 2, "tensor_parallel": {"tp_size": 2}})
    assert named.tensor_parallel.tp.tp_size == 2
    refused = {
        "partition_config": {"layer_specs": []},
        "preset_model": "llama",
        "injection_policy_tuple": [1],
        "replace_with_kernel_inject": True,
        "vocab_parallel_lm_head": True,
        "vocab_parallel_ce_backend": "liger",
    }
    for key, value in refused.items():
        expected = f"zerodp does not implement .*'tensor_parallel\\.{key}'"
        with pytest.raises(ConfigError, match=expected):
            load(tensor_parallel={"autotp_size": 2, key: value})
    with pytest.raises(
        ConfigError, match=re.escape("'tensor_parallel.tp.tp_size': got 4, which differs")
    ):
        load(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 4}})
    with pytest.raises(
        ConfigError, match=re.escape("'tensor_parallel.dtype': got 'fp16', but the model")
    ):
        load(tensor_parallel={"autotp_size": 2, "dtype": "half"})
    with pytest.raises(ConfigError, match=re.escape("tensor_parallel.plan")):
        load(tensor_parallel={"autotp_size": 2, "plan": {"fc1": "diagonal"}})
    with pytest.warns(UserWarning, match=re.escape("tensor_parallel.tp_overlap_comm = true:")):
        load(tensor_parallel={"autotp_size": 2, "tp_overlap_comm": True})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"zero_optimization": {"stage": 2, "mics_shard_size": 2}}, "mics_shard_size 2"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "hpz_partition"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            "offload_param.device 'cpu'",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "offload_optimizer.device 'cpu'",
        ),
        ({"compile": {"enabled": True}}, "compile.enabled"),
        ({"eigenvalue": {"enabled": True}}, "eigenvalue.enabled"),
    ],
)
def test_what_does_not_compose_is_refused_naming_the_pair(config: dict, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tensor_parallel={"autotp_size": 2}, **config)
    assert "tensor_parallel.autotp_size 2 with" in str(info.value) and named in str(info.value)


# -- plans ----------------------------------------------------------------------------------


def test_a_llama_is_split_by_its_own_plan() -> None:
    model = build_llama()
    plan = read_plan(model, None)
    assert plan.source is PlanSource.MODEL
    assert plan.entries["lm_head"] is Style.COLWISE_GATHER_OUTPUT
    assert plan.entries["model.embed_tokens"] is Style.EMBEDDING_ROWWISE
    assert plan.entries["model.layers.*.self_attn.q_proj"] is Style.COLWISE
    assert plan.entries["model.layers.*.mlp.down_proj"] is Style.ROWWISE
    planned = plan_split(model, plan, 2)
    styles = {t.name: t.style for t in planned.targets}
    assert len(styles) == 2 + 7 * 2  # lm_head, the embeddings, seven Linears per layer
    dims = {name: dim for dim, name in planned.splits.values()}
    # The tied lm_head and embeddings share one weight, split once along the vocabulary.
    assert dims["model.embed_tokens.weight"] == 0 and "lm_head.weight" not in dims
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.1.mlp.up_proj.weight"] == 0


def test_patterns_name_one_part_per_star() -> None:
    assert matches("layers.*.mlp.fc1", "layers.3.mlp.fc1")
    assert not matches("layers.*.mlp.fc1", "layers.3.4.mlp.fc1")
    assert not matches("layers.*", "layers.3.mlp")


def test_grouped_query_attention_with_fewer_kv_heads_than_t_is_refused() -> None:
    model = build_llama()  # 4 heads, 2 key/value heads
    with pytest.raises(ConfigError) as info:
        plan_split(model, read_plan(model, None), 4)
    message = str(info.value)
    assert "2 key/value heads, fewer than autotp_size 4" in message
    assert "use an autotp_size that divides 2" in message


def test_sizes_that_do_not_divide_are_refused() -> None:
    model = build_llama()
    with pytest.raises(ConfigError, match="'lm_head' has 96 output features, not divisible by 5"):
        plan_split(model, read_plan(model, None), 5)


def test_a_model_without_a_plan_needs_one() -> None:
    with pytest.raises(ConfigError, match="BlockNet has no tensor-parallel plan of its own"):
        read_plan(block_net(), None)
    model = block_net()
    planned = plan_split(model, read_plan(model, USER_PLAN), 2)
    assert [t.name for t in planned.targets] == [
        "blocks.0.fc1",
        "blocks.0.fc2",
        "blocks.1.fc1",
        "blocks.1.fc2",
    ]
    split = {name for _, name in planned.splits.values()}
    assert "blocks.0.fc1.bias" in split and "blocks.0.fc2.bias" not in split


def test_a_users_plan_is_checked_against_the_model() -> None:
    model = block_net()
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.fc3' match no module of BlockNet"):
        plan_split(model, read_plan(model, {"blocks.*.fc3": "colwise"}), 2)
    with pytest.raises(
        ConfigError, match=re.escape("'blocks.0.norm' is 'colwise' but a LayerNorm")
    ):
        plan_split(model, read_plan(model, {"blocks.*.norm": "colwise"}), 2)
    with pytest.raises(ConfigError, match=re.escape("names module 'blocks.0.fc1' twice")):
        read_plan(model, {"blocks.*.fc1": "colwise", "blocks.0.*": "rowwise"}).style_of(
            "blocks.0.fc1"
        )


def test_a_style_zerodp_lacks_is_refused_by_module() -> None:
    model = build_llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.input_layernorm": "sequence_parallel"}
    with pytest.raises(ConfigError) as info:
        plan_split(model, read_plan(model, None), 2)
    assert "'model.layers.0.input_layernorm' is 'sequence_parallel'" in str(info.value)


def test_a_tied_weight_split_on_one_side_only_is_refused() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    with pytest.raises(ConfigError, match=re.escape("'head.weight' is shared with 'embed.weight'")):
        plan_split(model, read_plan(model, {"head": "colwise_gather_output"}), 2)
    planned = plan_split(
        model, read_plan(model, {"head": "colwise_gather_output", "embed": "embedding_rowwise"}), 2
    )
    assert len(planned.splits) == 1  # one weight, split once
    assert torch.equal(model.embed.weight, model.head.weight)  # nothing changed by planning


_FAMILY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


@pytest.mark.parametrize(
    ("family", "outcome"),
    [
        ("Mistral", "split"),
        ("Qwen2", "split"),
        ("Olmo", "split"),
        ("Qwen3", "'model.layers.0.self_attn.q_norm' is 'replicated_with_grad_allreduce'"),
        ("Gemma2", "a Gemma2TextScaledWordEmbedding, not an nn.Embedding"),
    ],
)
def test_other_families_plans_are_read_or_refused_by_module(family: str, outcome: str) -> None:
    """The plans of the pinned transformers' decoder families: split as Llama's, or refused
    naming the module whose style zerodp lacks (planning only; Llama is trained in
    tests/distributed/test_tensor_parallel.py)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**_FAMILY, head_dim=8)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    if outcome == "split":
        planned = plan_split(model, read_plan(model, None), 2)
        styles = {t.style for t in planned.targets}
        assert styles == {
            Style.COLWISE,
            Style.ROWWISE,
            Style.COLWISE_GATHER_OUTPUT,
            Style.EMBEDDING_ROWWISE,
        }
        return
    with pytest.raises(ConfigError) as info:
        plan_split(model, read_plan(model, None), 2)
    assert outcome in str(info.value)


@pytest.mark.parametrize("name", ["gpt2", "bert", "roberta", "t5", "bart", "vit", "whisper"])
def test_families_without_a_plan_need_one(name: str) -> None:
    from tests.hf_architectures import BUILDERS

    model = BUILDERS[name]()
    with pytest.raises(ConfigError, match="has no tensor-parallel plan of its own"):
        read_plan(model, None)


def test_a_models_own_plan_that_matches_none_of_its_modules_is_an_error() -> None:
    """Not a model left whole on every rank without a word: its plan names other modules
    (here: the Llama's plan under a wrapper that prefixes every name)."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build_llama()
            self._tp_plan = read_plan(self.inner, None).entries  # the inner model's names

    model = Wrapped()
    plan = read_plan(model, {p: s.value for p, s in model._tp_plan.items()})
    assert plan.source is PlanSource.CONFIG  # a config plan: each unmatched pattern named
    own = read_plan(model, None)
    assert own.source is PlanSource.MODEL
    with pytest.raises(ConfigError, match="matches none of its modules"):
        plan_split(model, own, 2)
    # The same plan, its names as the wrapper has them, splits.
    rooted = {f"inner.{p}": s.value for p, s in model._tp_plan.items()}
    assert plan_split(model, read_plan(model, rooted), 2).targets
