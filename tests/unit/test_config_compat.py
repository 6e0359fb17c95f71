"""DeepSpeed compatibility, one class of key at a time.

no effect -> accepted, named in the one warning (louder when the value asks for more);
alias -> the same resolved config as the canonical key; not implemented -> "zerodp does
not implement ..." with what to do; typo -> "did you mean".
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

from zerodp.config import OptimizerConfig, ZeroDPConfig, load_config
from zerodp.errors import ConfigError, ConfigWarning
from zerodp.precision.loss_scaler import LossScaler


def load(world_size: int = 1, rank: int = 0, **config: Any) -> ZeroDPConfig:
    return load_config({"train_batch_size": 8 * world_size, **config}, world_size, rank=rank)


def raises(*parts: str) -> Any:
    return pytest.raises(ConfigError, match=".*".join(re.escape(p) for p in parts))


def warning_of(**config: Any) -> str:
    """The one ConfigWarning loading `config` emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(**config)
    found = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(found) == 1, found
    return found[0]


# --- no effect --------------------------------------------------------------------------


def test_no_effect_keys_are_named_with_the_reason() -> None:
    text = warning_of(
        wall_clock_breakdown=False,
        zero_allow_untested_optimizer=True,
        zero_optimization={"stage": 2, "reduce_scatter": True, "sub_group_size": 1e9},
    )
    assert text.startswith("zerodp: 4 DeepSpeed config keys have no effect here")
    assert "wall_clock_breakdown: zerodp has no phase timers" in text
    assert "zero_allow_untested_optimizer: zerodp needs no untested-optimizer opt-in" in text
    assert "zero_optimization.reduce_scatter: zerodp always reduce-scatters" in text
    assert "zero_optimization.sub_group_size: " in text


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"prescale_gradients": True}, "prescale_gradients = true: zerodp does not scale"),
        ({"wall_clock_breakdown": True}, "wall_clock_breakdown = true: zerodp does not time"),
        (
            {"zero_optimization": {"allgather_partitions": False}},
            "zero_optimization.allgather_partitions = false: zerodp has no broadcast",
        ),
        (
            {"zero_optimization": {"reduce_scatter": False}},
            "zero_optimization.reduce_scatter = false: zerodp has no all-reduce variant",
        ),
        ({"gradient_predivide_factor": 8}, "gradient_predivide_factor = 8: zerodp does not"),
        ({"fp16": {"auto_cast": False}}, "fp16.auto_cast = false: zerodp casts floating inputs"),
        ({"flops_profiler": {"enabled": True}}, "use torch.profiler.profile(with_flops=True)"),
    ],
)
def test_a_value_asking_for_something_else_says_so(config: dict[str, Any], said: str) -> None:
    assert said in warning_of(**config)


def test_values_that_differ_come_first() -> None:
    text = warning_of(dump_state=False, prescale_gradients=True)
    lines = text.splitlines()
    assert lines[1].startswith("  - prescale_gradients = true")
    assert lines[2].startswith("  - dump_state: ")


def test_the_keys_accepted_silently_before_are_now_named() -> None:
    text = warning_of(
        zero_optimization={
            "allgather_bucket_size": 2e8,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        eigenvalue={"verbose": True},
    )
    for key in (
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.contiguous_gradients",
        "eigenvalue.verbose",
    ):
        assert key in text
    assert "stage3_gather_16bit" not in text  # honoured by save_16bit_model, later


def test_same_reason_shares_a_line() -> None:
    text = warning_of(bf16={"enabled": True, "loss_scale": 0, "hysteresis": 2})
    assert "  - bf16.loss_scale, bf16.hysteresis: bf16 needs no loss scaling" in text


def test_one_warning_and_only_on_rank_0() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(rank=1, wall_clock_breakdown=False, dump_state=False)
        load(world_size=1)
    assert [w for w in caught if issubclass(w.category, ConfigWarning)] == []


def test_no_effect_keys_are_type_checked() -> None:
    with raises("config key 'wall_clock_breakdown': got 'no'; allowed: true or false"):
        load(wall_clock_breakdown="no")
    with raises("config key 'zero_optimization.sub_group_size': got 1.5; allowed: an integer"):
        load(zero_optimization={"sub_group_size": 1.5})


def test_no_effect_blocks_check_their_keys() -> None:
    with raises("unknown config key 'flops_profiler.enabeld'; did you mean 'enabled'?"):
        load(flops_profiler={"enabeld": True})
    with raises("config key 'comms_logger.prof_ops': got 'all'; allowed: a JSON list"):
        load(comms_logger={"prof_ops": "all"})


def test_checkpoint_section_keys_are_checked() -> None:
    with raises("unknown config key 'checkpoint.tag_validaton'; did you mean 'tag_validation'?"):
        load(checkpoint={"tag_validaton": "Warn"})
    text = warning_of(
        checkpoint={"tag_validation": "Ignore", "writer": {"type": "FAST", "io_buffer_size": 1e6}}
    )
    assert "checkpoint.tag_validation: zerodp does not compare checkpoint tags" in text
    assert "checkpoint.writer.type: zerodp writes with torch.distributed.checkpoint" in text
    assert "checkpoint.writer.io_buffer_size: a setting of DeepSpeed's fast checkpoint" in text
    with raises("unknown config key 'checkpoint.writer.decoupeld'; did you mean 'decoupled'?"):
        load(checkpoint={"writer": {"decoupeld": True}})
    with raises("zerodp does not implement DeepSpeed's mock checkpoint writer"):
        load(checkpoint={"writer": {"type": "mock"}})
    with raises("config key 'checkpoint.writer.decoupled': got 'yes'; allowed: true or false"):
        load(checkpoint={"writer": {"decoupled": "yes"}})


def test_checkpoint_section_is_read() -> None:
    default = load()
    assert not default.checkpoint.writer.decoupled and not default.checkpoint.load_universal
    config = load(checkpoint={"writer": {"decoupled": True}, "load_universal": True})
    assert config.checkpoint.writer.decoupled and config.checkpoint.load_universal
    assert not load(checkpoint={"writer": None}).checkpoint.writer.decoupled  # DeepSpeed's null


def test_auto_on_a_key_without_effect_is_accepted() -> None:
    assert "sub_group_size" in warning_of(zero_optimization={"sub_group_size": "auto"})


# --- aliases -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ({"bfloat16": {"enabled": True}}, {"bf16": {"enabled": True}}),
        (
            {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
            {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}},
        ),
        (
            {"zero_optimization": {"prefetch_bucket_size": 1000, "max_live_parameters": 7}},
            {
                "zero_optimization": {
                    "stage3_prefetch_bucket_size": 1000,
                    "stage3_max_live_parameters": 7,
                }
            },
        ),
        (
            {"zero_optimization": {"param_persistence_threshold": 5, "max_reuse_distance": 3}},
            {
                "zero_optimization": {
                    "stage3_param_persistence_threshold": 5,
                    "stage3_max_reuse_distance": 3,
                }
            },
        ),
        ({"zero_optimization": True}, {"zero_optimization": {"stage": 1}}),
        ({"zero_optimization": {"cpu_offload": False}}, {}),
        ({"fp32_allreduce": True}, {"communication_data_type": "fp32"}),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            {"optimizer": {"type": "Adam"}, "gradient_clipping": 1.0},
        ),
        (
            {"optimizer": {"type": "DeepSpeedCPUAdam", "params": {"adamw_mode": False}}},
            {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
        ),
        ({"optimizer": {"type": "FusedAdam"}}, {"optimizer": {"type": "Adam"}}),
        ({"optimizer": {"type": "cpuadam"}}, {"optimizer": {"type": "Adam"}}),
    ],
)
def test_alias_resolves_like_the_canonical_key(alias: dict, canonical: dict) -> None:
    assert load(**alias) == load(**canonical)


def test_alias_and_canonical_key_with_different_values() -> None:
    with raises("config keys 'bfloat16' (an older name) and 'bf16' are both set", "keep only"):
        load(bfloat16={"enabled": True}, bf16={"enabled": False})


def test_cpu_offload_true_is_optimizer_offload() -> None:
    cfg = load(zero_optimization={"stage": 2, "cpu_offload": True})
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_offload_needs_a_stage_that_shards_and_nvme_needs_a_path() -> None:
    with raises("parameter offload needs the sharded parameters of stage 3"):
        load(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    with raises("optimizer offload moves each rank's shard"):
        load(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}})
    with raises("nvme_path' is missing"):
        load(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})


def test_cpu_offload_use_pin_memory_reaches_the_offload_section() -> None:
    cfg = load(
        zero_optimization={"offload_param": {"device": "none"}, "cpu_offload_use_pin_memory": False}
    )
    assert cfg.zero_optimization.offload_param is not None
    assert cfg.zero_optimization.offload_param.pin_memory is False


def test_fp16_consecutive_hysteresis_is_honoured() -> None:
    cfg = load(fp16={"enabled": True, "consecutive_hysteresis": True})
    assert cfg.fp16.consecutive_hysteresis is True
    for consecutive, expected in ((True, 2**16), (False, 2**15)):
        scaler = LossScaler(
            scale=2**16, dynamic=True, hysteresis=2, consecutive_hysteresis=consecutive
        )
        for overflow in (True, False, True):
            scaler.update(overflow)
        assert scaler.scale == expected


def test_bias_correction_picks_torch_s_adam_or_the_uncorrected_one() -> None:
    corrected = load(optimizer={"type": "Adam", "params": {"bias_correction": True}})
    assert corrected.optimizer.torch_kwargs()[0] == "AdamW"
    for kind, decoupled in (("Adam", False), ("Adam", True), ("AdamW", True)):
        params = {"bias_correction": False, "adam_w_mode": decoupled, "lr": 0.1}
        name, kwargs = load(optimizer={"type": kind, "params": params}).optimizer.torch_kwargs()
        assert name == "UncorrectedAdam" and kwargs["adam_w_mode"] is decoupled, kwargs
        assert kwargs["lr"] == 0.1
    with pytest.raises(ConfigError, match=r"no optimizer\.params\.amsgrad variant"):
        load(optimizer={"type": "Adam", "params": {"bias_correction": False, "amsgrad": True}})


# --- not implemented --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        ({"hybrid_engine": {"enabled": True}}, "the Hybrid Engine"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "ZeRO++ quantized weights"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, "ZeRO++ quantized gradients"),
        ({"pipeline": {"stages": "auto"}}, "pipeline parallelism"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse attention kernels"),
        (
            {"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": True}}}},
            "the compression library",
        ),
        ({"data_efficiency": {"enabled": True}}, "the Data Efficiency library"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum learning"),
        ({"autotuning": {"enabled": True}}, "the autotuner"),
        ({"elasticity": {"enabled": True}}, "elastic batch sizes"),
        ({"nebula": {"enabled": True}}, "the Nebula checkpoint service"),
        ({"checkpoint": {"use_node_local_storage": True}}, "node-local checkpoint storage"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, "NVIDIA Apex AMP"),
        ({"tensor_parallel": {"autotp_size": 1, "preset_model": "llama"}}, "DeepSpeed's AutoTP"),
        ({"wandb": {"enabled": True}}, "the WandB monitor"),
        ({"gradient_allreduce_op": "sum"}, "un-averaged (sum) gradient reduction"),
        ({"optimizer": {"type": "OneBitLamb"}}, "1-bit LAMB"),
        ({"optimizer": {"type": "OneBitAdam"}}, "1-bit Adam"),
        ({"optimizer": {"type": "NAdam"}}, "torch.optim.NAdam from the config"),
        ({"optimizer": {"type": "LBFGS"}}, "L-BFGS"),
        ({"optimizer": {"type": "SparseAdam"}}, "SparseAdam"),
        ({"scheduler": {"type": "OneCycle"}}, "DeepSpeed's OneCycle scheduler"),
    ],
)
def test_not_implemented_names_the_feature_and_what_to_do(
    config: dict[str, Any], feature: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(**config)
    message = str(info.value)
    assert message.startswith(f"zerodp does not implement {feature}")
    assert "; " in message.split(")", 1)[-1]  # ...; <what to do>
    assert "unknown config key" not in message and "did you mean" not in message


@pytest.mark.parametrize(
    ("config", "listed"),
    [
        ({"hybrid_engine": {"enabled": False, "max_out_tokens": 512}}, "hybrid_engine: off"),
        ({"autotuning": {"enabled": False}}, "autotuning: off"),
        ({"zero_optimization": {"zero_quantized_weights": False}}, "zero_quantized_weights: off"),
        ({"tensor_parallel": {"tp_overlap_comm": False}}, "tensor_parallel.tp_overlap_comm: "),
        ({"compression_training": {"layer_reduction": {"enabled": False}}}, "compression"),
    ],
)
def test_a_disabled_feature_is_accepted_and_listed(config: dict[str, Any], listed: str) -> None:
    assert listed in warning_of(**config)


def test_offload_device_none_is_accepted_with_its_keys_validated() -> None:
    with pytest.warns(ConfigWarning, match=r"offload_param\.buffer_count: a tuning"):
        cfg = load(
            zero_optimization={
                "offload_optimizer": {"device": "none", "pin_memory": True, "ratio": 0.3},
                "offload_param": {"device": "none", "nvme_path": "/nvme", "buffer_count": 5},
            }
        )
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.3
    with raises("'zero_optimization.offload_optimizer.ratio': got 2; allowed: a number in [0, 1]"):
        load(zero_optimization={"offload_optimizer": {"device": "none", "ratio": 2}})
    with raises("'zero_optimization.offload_param.device': got 'gpu'; allowed: 'none', 'cpu'"):
        load(zero_optimization={"offload_param": {"device": "gpu"}})
    with raises("unknown config key 'zero_optimization.offload_param.pin_memroy'; did you mean"):
        load(zero_optimization={"offload_param": {"pin_memroy": True}})


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load(
            hybrid_engine={"enabled": True},
            zero_optimization={"zero_quantized_weights": True},
            gradient_clipping="auto",
            prescale_gradients="yes",
        )
    lines = str(info.value).splitlines()
    assert len(lines) == 4
    assert sum(line.startswith("zerodp does not implement") for line in lines) == 2


# --- typos --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hybrid_engin": {}}, "unknown config key 'hybrid_engin'; did you mean 'hybrid_engine'?"),
        (
            {"zero_optimization": {"reduce_scater": True}},
            "unknown config key 'zero_optimization.reduce_scater'; did you mean 'reduce_scatter'?",
        ),
        (
            {"zero_optimization": {"stage3_gather_fp16_weights_on_model_sav": True}},
            "did you mean 'stage3_gather_fp16_weights_on_model_save'?",
        ),
        ({"wall_clock_breakdwn": False}, "did you mean 'wall_clock_breakdown'?"),
        (
            {"optimizer": {"type": "Adam", "params": {"torch_adm": True}}},
            "did you mean 'torch_adam'?",
        ),
    ],
)
def test_typos_keep_did_you_mean(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(**config)
    assert message in str(info.value)
    assert "does not implement" not in str(info.value)


# --- optimizers --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Adagrad", "Adamax", "RMSprop", "Adam", "AdamW", "SGD"])
def test_every_config_optimizer_builds_in_torch(kind: str) -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    name, kwargs = OptimizerConfig.from_dict({"type": kind}).torch_kwargs()
    optimizer = getattr(torch.optim, name)([param], **kwargs)
    param.grad = torch.ones(3)
    optimizer.step()
    assert type(optimizer).__name__ == ("AdamW" if kind == "Adam" else kind)


def test_torch_implementation_switches_pass_through() -> None:
    opt = OptimizerConfig.from_dict({"type": "AdamW", "params": {"foreach": False}})
    assert opt.torch_kwargs()[1]["foreach"] is False and "fused" not in opt.torch_kwargs()[1]
    with raises("'optimizer.params.foreach' and 'optimizer.params.fused' are both true"):
        load(optimizer={"type": "AdamW", "params": {"foreach": True, "fused": True}})
    with raises("unknown config key 'optimizer.params.fused'"):
        load(optimizer={"type": "RMSprop", "params": {"fused": True}})


def test_monitor_output_path_null_is_the_default() -> None:
    assert load(tensorboard={"enabled": False, "output_path": None}).tensorboard.output_path == ""
