"""ZeroDPTrainer refuses what it cannot honour, with an error naming the fix.

Every refusal here happens before the engine (and a process group) exists,
so these run in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import TokenDataset, build_llama
from zerodp.errors import ConfigError, UsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def trainer(tmp_path: Path, config: Any = None, **kwargs: Any) -> Any:
    from zerodp.integrations.transformers import ZeroDPTrainer

    optimizers = kwargs.pop("optimizers", (None, None))
    model = kwargs.pop("model", None) or build_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )
    return ZeroDPTrainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(8),
        eval_dataset=TokenDataset(4),
        optimizers=optimizers,
        zerodp_config=config if config is not None else {"zero_optimization": {"stage": 2}},
    )


def test_the_config_is_required(tmp_path: Path) -> None:
    from zerodp.integrations.transformers import ZeroDPTrainer

    with pytest.raises(ConfigError, match="needs zerodp_config="):
        ZeroDPTrainer(model=build_llama(), args=transformers.TrainingArguments(str(tmp_path)))
    with pytest.raises(ConfigError, match="cannot read zerodp_config"):
        trainer(tmp_path, config=str(tmp_path / "missing.json"))


def test_arguments_that_would_rebuild_or_rewrap_the_model_are_refused(tmp_path: Path) -> None:
    from zerodp.integrations.transformers import ZeroDPTrainer

    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        trainer(tmp_path, auto_find_batch_size=True)
    # Set after the arguments are built: TrainingArguments would start DeepSpeed or FSDP
    # set-up itself, which is what the refusal is there to prevent.
    for name, value, fix in (
        ("deepspeed", "ds_config.json", "pass that config as ZeroDPTrainer(zerodp_config=...)"),
        ("fsdp", "full_shard", "zerodp shards the model itself"),
    ):
        args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
        setattr(args, name, value)
        with pytest.raises(ConfigError, match=f"cannot use TrainingArguments {name}=") as error:
            ZeroDPTrainer(model=build_llama(), args=args, zerodp_config={})
        assert fix in str(error.value), error.value


def test_a_process_that_sees_several_gpus_is_refused(tmp_path: Path) -> None:
    """The Trainer would wrap the model in nn.DataParallel: one process per GPU instead."""
    from zerodp.integrations.transformers import ZeroDPTrainer

    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    assert args.n_gpu == 0  # the devices are set up (and n_gpu cached) by this read
    args._n_gpu = 2  # what TrainingArguments records on a machine with two visible GPUs
    with pytest.raises(UsageError, match="sees 2 GPUs") as error:
        ZeroDPTrainer(model=build_llama(), args=args, zerodp_config={})
    assert "nn.DataParallel" in str(error.value) and "torchrun" in str(error.value)


def test_torch_compile_is_said_to_have_no_effect(tmp_path: Path) -> None:
    from zerodp.errors import ConfigWarning

    with pytest.warns(ConfigWarning, match="torch_compile=True\\) has no effect"):
        trainer(tmp_path, torch_compile=True)


def test_refusals_at_train(tmp_path: Path) -> None:
    cases = [
        (
            {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
            None,
            "steps on an evaluation metric",
        ),
        (
            {"lr_scheduler_type": "greedy", "eval_strategy": "steps"},
            None,
            "'greedy' steps on an evaluation metric",
        ),
        ({"optim": "lomo"}, None, "'lomo' updates the weights inside backward.*adamw_torch"),
        ({"optim": "adalomo"}, None, "'adalomo' updates the weights inside backward"),
        (
            {},
            {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}},
            "'train_micro_batch_size_per_gpu' is 8, but TrainingArguments",
        ),
    ]
    for kwargs, config, message in cases:
        with pytest.raises(ConfigError, match=message):
            trainer(tmp_path, config=config, **kwargs).train()


def test_an_optimizer_passed_twice_is_refused(tmp_path: Path) -> None:
    model = build_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    with pytest.raises(ConfigError, match="'optimizer' block and the Trainer was given"):
        trainer(
            tmp_path, config=config, model=model, optimizers=(optimizer, None), learning_rate=1e-3
        ).train()


def test_an_optimizer_factory_that_builds_its_own_groups_is_refused(tmp_path: Path) -> None:
    """What `optim` gives for GaLore and APOLLO (their packages are not installed here): a
    factory whose kwargs carry the parameter groups or the model, or a class that is not a
    torch optimizer. zerodp lays out the groups itself, so it cannot take one of those."""
    from zerodp.integrations.transformers import ZeroDPTrainer

    def not_an_optimizer_class(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **kwargs)

    model = build_llama()
    factories = [
        (torch.optim.AdamW, {"params": [{"params": list(model.parameters())}], "lr": 1e-3}),
        (torch.optim.AdamW, {"model": model, "lr": 1e-3}),
        (not_an_optimizer_class, {"lr": 1e-3}),
    ]
    for factory in factories:
        args = transformers.TrainingArguments(
            str(tmp_path), max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True
        )
        built = ZeroDPTrainer(
            model=model,
            args=args,
            train_dataset=TokenDataset(8),
            optimizer_cls_and_kwargs=factory,
            zerodp_config={"zero_optimization": {"stage": 1}},
        )
        with pytest.raises(ConfigError, match="builds its own parameter groups") as error:
            built.train()
        assert "an 'optimizer' block in zerodp_config" in str(error.value)


def test_the_optimizer_is_zerodps_to_build(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="builds its optimizer inside zerodp at train"):
        trainer(tmp_path).create_optimizer()


# -- with_zerodp: any Trainer subclass ----------------------------------------------------------


def test_with_zerodp_makes_one_class_per_trainer_class_between_it_and_trainer() -> None:
    from zerodp.integrations.transformers import ZeroDPTrainer, with_zerodp

    class LoggingTrainer(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return super().training_step(*args, **kwargs)

    assert with_zerodp(transformers.Trainer) is ZeroDPTrainer
    made = with_zerodp(LoggingTrainer)
    assert made is with_zerodp(LoggingTrainer) and with_zerodp(made) is made
    assert made.__name__ == "ZeroDPLoggingTrainer"
    mro = made.__mro__
    # The subclass's overrides run first and reach zerodp's, then the Trainer's, via super().
    assert mro.index(LoggingTrainer) < mro.index(ZeroDPTrainer) < mro.index(transformers.Trainer)
    with pytest.raises(TypeError, match=r"takes a transformers\.Trainer subclass"):
        with_zerodp(torch.nn.Module)  # type: ignore[arg-type]


def test_with_zerodp_refuses_an_override_that_would_bypass_the_engine() -> None:
    from zerodp.integrations.transformers import with_zerodp

    class OwnStep(transformers.Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = model(**inputs).loss
            loss.backward()  # a DDP-style step: zerodp's backward would never run
            return loss.detach()

    with pytest.raises(TypeError, match=r"OwnStep.training_step replaces .* without calling super"):
        with_zerodp(OwnStep)


def test_a_made_class_takes_zerodp_config_and_refuses_deepspeed(tmp_path: Path) -> None:
    from zerodp.integrations.transformers import with_zerodp

    class Custom(transformers.Trainer):
        def __init__(self, model: Any, extra: int, args: Any, **kwargs: Any) -> None:
            self.extra = extra
            super().__init__(model=model, args=args, **kwargs)

    made = with_zerodp(Custom)
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    built = made(build_llama(), 7, args, zerodp_config={"zero_optimization": {"stage": 1}})
    assert built.extra == 7 and built.zerodp_config == {"zero_optimization": {"stage": 1}}
    with pytest.raises(ConfigError, match="ZeroDPCustom needs zerodp_config="):
        made(build_llama(), 7, args)
    ds_args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    ds_args.deepspeed = "ds_config.json"  # checked before the Trainer would start DeepSpeed
    with pytest.raises(ConfigError, match="cannot use TrainingArguments deepspeed="):
        made(build_llama(), 7, ds_args, zerodp_config={"zero_optimization": {"stage": 1}})


def test_trl_options_without_a_zerodp_path_are_refused() -> None:
    from types import SimpleNamespace

    from zerodp.integrations.post_training import refuse_unsupported_post_training

    stage3 = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match="sync_ref_model=True is not supported at"):
        refuse_unsupported_post_training(SimpleNamespace(sync_ref_model=True), stage3)
    refuse_unsupported_post_training(
        SimpleNamespace(sync_ref_model=True), {"zero_optimization": {"stage": 1}}
    )
    refuse_unsupported_post_training(SimpleNamespace(sync_ref_model=False), stage3)


def test_accelerates_own_sequence_or_context_parallelism_is_refused_with_zerodps_key(
    tmp_path: Path,
) -> None:
    """Accelerate's ParallelismConfig would split the batch a second time (TRL and the Trainer
    route `sp_size` to DeepSpeed's Ulysses): refused, naming zerodp's key."""
    from accelerate.parallelism_config import ParallelismConfig

    from zerodp.integrations.transformers import ZeroDPTrainer

    for config in (ParallelismConfig(sp_size=2), ParallelismConfig(cp_size=2)):
        args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
        args.parallelism_config = config  # set after: the arguments would check the world size
        with pytest.raises(ConfigError, match="Accelerate's ParallelismConfig") as error:
            ZeroDPTrainer(model=build_llama(), args=args, zerodp_config={})
        assert 'set "sequence_parallel_size" in zerodp_config' in str(error.value), error.value
