"""Tensor parallelism composed with ZeRO, exact: a tiny Llama split by its own plan (T=2).

Every training case runs the engine beside the one-process reference computed in the
worker (`tests.tp_reference`: the whole model, every data rank's batch, torch's AdamW) and
compares weights, every loss and every step's global gradient norm (fp32: 1e-5), and after
every step checks that the parameters the plan leaves whole are bitwise equal across the
tensor group. World 2 is T=2 x D=1 at stages 0-3 and each backward pattern, with AdamW,
and with SGD at stages 0-3 also every step's gradients; world 4 is T=2 x D=2 at stages 1-3
with accumulation 2 (one pool, four cases, one of them SGD, a checkpoint, and the memory
of model states against ZeRO's bytes per element, 16 P / (T x D) at stage 3). bf16 and
fp16 are compared with their own recipe written out in one process. The
checkpoint saved at (T=2, D=2) loads at (T=2, D=1) and, whole, at (T=1, D=2). The HF Trainer
with T=2 matches its own one-process run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.hf_models import HIDDEN, TokenDataset, build_llama, probe_tokens
from tests.tp_reference import (
    LR,
    MICRO,
    TENSOR,
    USER_PLAN,
    batch_for,
    block_batch,
    block_loss,
    block_net,
    block_reference,
    compare,
    half_reference_run,
    max_difference,
    prepared_model,
    reference_run,
    relative_update_error,
    slices,
    tp_config,
    train_engine,
)
from zerodp.checkpoint_io.consolidate import full_state_dict_from_checkpoint
from zerodp.errors import ConfigError, UsageError
from zerodp.testing import WorkerPool

FP32_BOUND = 1e-5
STEPS = 3


def data_index() -> int:
    return dist.get_rank() // TENSOR


def data_size() -> int:
    return dist.get_world_size() // TENSOR


def local_q_proj(engine: Any) -> tuple[tuple[int, ...], torch.Tensor]:
    """This rank's q_proj slice of layer 0: its shape and value (gathered at stage 3)."""
    weight = engine.module.model.layers[0].self_attn.q_proj.weight
    with zerodp.zero.GatheredParameters([weight]):
        return tuple(weight.shape), weight.detach().clone()


def check_q_proj_is_a_slice(engine: Any, reference: torch.nn.Module) -> None:
    """Each rank holds 1/T of q_proj's output features: its rows of the whole weight."""
    shape, value = local_q_proj(engine)
    whole = reference.model.layers[0].self_attn.q_proj.weight.detach()
    assert shape == (whole.shape[0] // TENSOR, HIDDEN), shape
    rank = dist.get_rank() % TENSOR
    assert torch.equal(value, whole.chunk(TENSOR, dim=0)[rank])


def train_case(
    stage: int, *, gas: int = 1, pattern: str = "plain", clip: float = 0.0, memory: bool = False
) -> dict:
    config = tp_config(stage, gas=gas, clip=clip)
    engine, _, _, _ = zerodp.initialize(model=prepared_model(pattern), config=config)
    check_q_proj_is_a_slice(engine, build_llama())
    world = dist.get_world_size()
    assert (engine.dp_world_size, engine.mp_world_size) == (world // TENSOR, TENSOR)
    tensor_rank = dist.get_rank() % TENSOR
    assert engine.get_data_parallel_rank() == engine.data_parallel_rank == data_index()
    assert engine.get_model_parallel_rank() == engine.get_tensor_parallel_rank() == tensor_rank
    trace, compared = train_engine(engine, STEPS, gas, data_index(), pattern=pattern)
    measured = model_state_formula(engine, stage) if memory else None
    weights = engine.state_dict()
    engine.destroy()
    reference, expected = reference_run(STEPS, gas, data_size(), pattern=pattern, clip=clip)
    where = f"stage {stage}, gas {gas}, {pattern}, clip {clip}"
    diffs = compare(trace, weights, reference, expected, FP32_BOUND, where)
    return {**diffs, "compared": compared, "memory": measured}


# -- world 2: T=2 x D=1 ---------------------------------------------------------------------

TWO_RANK_CASES = [
    (0, "plain", 0.5),
    (1, "plain", 0.0),
    (2, "plain", 0.5),
    (3, "plain", 0.0),
    (1, "retain", 0.0),
    (3, "retain", 0.5),
    (2, "double", 0.0),
    (3, "double", 0.0),
    (0, "checkpoint", 0.0),
    (3, "checkpoint", 0.5),
]


def two_rank_cases() -> dict[str, dict]:
    return {
        f"stage {stage} {pattern} clip {clip}": train_case(
            stage, pattern=pattern, clip=clip, memory=pattern == "plain"
        )
        for stage, pattern, clip in TWO_RANK_CASES
    }


def test_two_ranks_match_one_process_at_every_stage_and_backward_pattern(pools) -> None:
    results = pools(2).run(two_rank_cases, timeout_s=600)
    for case, result in results[0].items():
        assert result["compared"] > 0, case  # the norms (and a few small groups) stayed whole
        memory = result["memory"]
        if memory is not None:  # each stage's bytes per element, a split weight's over T
            most = memory["expected"] + memory["padding"] + memory["counters"]
            assert memory["expected"] <= memory["measured"] <= most, (case, memory)


def half_precision_case(stage: int, dtype: str) -> dict[str, float]:
    """bf16 / fp16 with fp32 masters against the same recipe in one process
    (`half_reference_run`): how far the update is off, as a fraction of it."""
    config = tp_config(stage, dtype=dtype)
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=config)
    trace, _ = train_engine(engine, STEPS, 1, data_index())
    split = engine.tensor_parallel.split.names(engine.module)
    masters = {
        name: zerodp.utils.safe_get_full_fp32_param(param).clone()
        for name, param in engine.module.named_parameters()
    }
    engine.destroy()
    reference, expected = half_reference_run(STEPS, data_size(), dtype)
    # The masters are this rank's slices: compared with the same slices of the reference.
    rank = dist.get_rank() % TENSOR
    whole = dict(reference.named_parameters())
    start = dict(build_llama().named_parameters())
    update = relative_update_error(masters, slices(whole, split, rank), slices(start, split, rank))
    losses = max(abs(v - expected.losses[k]) for k, v in trace.losses.items())
    return {"update": update, "losses": losses, "skipped": engine.skipped_steps}


@pytest.mark.parametrize(("stage", "dtype"), [(2, "bf16"), (3, "bf16"), (3, "fp16")])
def test_half_precision_trains_as_the_same_recipe_in_one_process(
    pools, stage: int, dtype: str
) -> None:
    for result in pools(2).run(half_precision_case, stage, dtype):
        # AdamW moves an element by about lr per step whatever its gradient's size, so a
        # rounding that flips a small gradient's sign moves that element 2 lr the other
        # way: the largest elementwise difference cannot tell a trained model from one
        # that never stepped (both within 2 lr x steps). The update as a whole can: the
        # slicing's own rounding leaves it a few hundredths of its size off the one-process
        # recipe; an engine that never steps is off by all of it (1.0).
        assert result["update"] <= 0.15, result
        assert result["losses"] <= 0.05, result
        assert result["skipped"] == 0, result


def user_plan_case(stage: int) -> float:
    """A model without a plan of its own, split by `tensor_parallel.plan`."""
    config = tp_config(stage, plan=USER_PLAN)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = zerodp.initialize(model=block_net(), config=config)
    fc1, fc2 = engine.module.blocks[0].fc1, engine.module.blocks[0].fc2
    assert (fc1.out_features, fc2.in_features, fc2.out_features) == (16, 16, 8)
    assert engine.module.blocks[0].num_heads == 4 // TENSOR  # the local head count
    for step in range(STEPS):
        engine.backward(block_loss(engine, block_batch(step, data_index())))
        engine.step()
        engine.tensor_parallel.replica_check.check(f"after step {step}")
    weights = engine.state_dict()
    engine.destroy()
    reference = block_reference(STEPS, data_size())
    return max_difference(weights, dict(reference.state_dict()))


def test_a_model_split_by_the_users_plan_matches_one_process(pools) -> None:
    for stage in (1, 3):
        assert pools(2).run(user_plan_case, stage)[0] <= FP32_BOUND


# SGD steps by the gradient itself, so its weights show a uniform scale error in the
# gradient that AdamW's normalisation hides; each step's gradients are compared too.
# (stage, accumulation, clipping)
SGD_CASES = [(0, 1, 0.0), (1, 2, 0.0), (2, 1, 0.5), (3, 2, 0.5)]


def sgd_case(stage: int, gas: int, clip: float) -> dict[str, float]:
    """Every step's gradients (this rank's slices) before the step, the weights, losses and
    norms after it, against the one-process run with torch's SGD (fp32: 1e-5)."""
    config = tp_config(stage, gas=gas, clip=clip, optimizer="SGD")
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=config)
    trace, _ = train_engine(engine, STEPS, gas, data_index(), record_grads=True)
    split = engine.tensor_parallel.split.names(engine.module)
    weights = engine.state_dict()
    engine.destroy()
    reference, expected = reference_run(
        STEPS, gas, data_size(), clip=clip, optimizer="SGD", record_grads=True
    )
    where = f"SGD, stage {stage}, gas {gas}, clip {clip}"
    diffs = compare(trace, weights, reference, expected, FP32_BOUND, where)
    rank = dist.get_rank() % TENSOR
    grads = 0.0
    for step, (mine, whole) in enumerate(zip(trace.grads, expected.grads, strict=True)):
        theirs = slices(whole, split, rank)
        if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
            raise AssertionError(f"{where}, step {step}: the gradients' names or shapes differ")
        grads = max(grads, max_difference(mine, theirs))
    if not grads <= FP32_BOUND:
        raise AssertionError(f"{where}: gradients differ by {grads:.3g} > {FP32_BOUND:g}")
    return {**diffs, "grads": grads, "steps": len(trace.grads)}


def sgd_cases() -> dict[str, dict[str, float]]:
    return {f"stage {s}, gas {g}, clip {c}": sgd_case(s, g, c) for s, g, c in SGD_CASES}


def test_sgd_gradients_and_weights_match_one_process_at_every_stage(pools) -> None:
    for result in pools(2).run(sgd_cases, timeout_s=600):
        for case, diffs in result.items():
            assert diffs["steps"] == STEPS, case
            for what in ("grads", "weights", "losses", "norms"):
                assert diffs[what] <= FP32_BOUND, (case, what, diffs)


# -- refusals and checks, on every rank ------------------------------------------------------


def misuse_cases() -> dict[str, str]:
    out: dict[str, str] = {}
    # A user's own batches that differ across a tensor group: refused at the first forward.
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=tp_config(1))
    wrong = batch_for(0, 0, dist.get_rank())
    with pytest.raises(UsageError) as info:
        engine(input_ids=wrong["input_ids"], labels=wrong["labels"])
    out["batch"] = str(info.value)
    with pytest.raises(UsageError) as info:
        engine.join()
    out["join"] = str(info.value)
    engine.destroy()
    # A whole-tensor optimizer would read slices.
    model = build_llama()
    config = tp_config(2)
    del config["optimizer"]
    adafactor = torch.optim.Adafactor(model.parameters())
    with pytest.raises(ConfigError) as info:
        zerodp.initialize(model=model, config=config, optimizer=adafactor)
    out["tensorwise"] = str(info.value)
    # A tied lm_head split while the embeddings it shares its weight with stay whole.
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"}
    with pytest.raises(ConfigError) as info:
        zerodp.initialize(model=build_llama(), config=tp_config(1, plan=plan))
    out["tied"] = str(info.value)
    # A model built sharded by zero.Init (its shards are of whole weights).
    config = tp_config(3)
    with zerodp.zero.Init(config=config):
        model = build_llama()
    with pytest.raises(ConfigError) as info:
        zerodp.initialize(model=model, config=config)
    out["init"] = str(info.value)
    return out


def test_misuse_is_refused_on_every_rank(pools) -> None:
    results = pools(2).run(misuse_cases)
    for result in results:
        assert "tensor-parallel group [0, 1] got different inputs" in result["batch"]
        assert "input_ids, labels differ" in result["batch"]
        assert "tensor_parallel.autotp_size 2 with engine.join(): zerodp does not" in result["join"]
        assert "with optimizers that read whole tensors" in result["tensorwise"]
        assert "'lm_head.weight' is shared with 'model.embed_tokens.weight'" in result["tied"]
        assert "with a model built under zero.Init" in result["init"]
    assert results[0] == results[1]


# -- world 4: T=2 x D=2 ----------------------------------------------------------------------


# Bytes per element of model state with fp32 AdamW over D data ranks (ZeRO's accounting:
# parameters, gradients, AdamW's two moments), by stage.
BYTES_PER_ELEMENT = {
    0: lambda d: 16,
    1: lambda d: 4 + 4 + 8 / d,
    2: lambda d: 4 + 12 / d,
    3: lambda d: 16 / d,
}


def model_state_formula(engine: Any, stage: int) -> dict[str, float]:
    """ZeRO's bytes for each rank's elements: a split weight's slice (1/T of it) over D data
    ranks, a whole parameter over D; against what the engine holds. The headline is
    16 P / (T x D) at stage 3."""
    split = engine.tensor_parallel.split
    whole_model = build_llama()
    split_names = set(split.names(engine.module))
    p_split = sum(p.numel() for n, p in whole_model.named_parameters() if n in split_names)
    p_whole = sum(p.numel() for n, p in whole_model.named_parameters() if n not in split_names)
    data = dist.get_world_size() // TENSOR
    per_element = BYTES_PER_ELEMENT[stage](data)
    padding = sum(s.flat.padded_numel - s.flat.layout.numel for s in engine.groups)
    # AdamW's step counters: one 0-d tensor per optimizer parameter.
    counters = [v for st in engine.optimizer.state.values() for v in st.values()]
    return {
        "measured": engine.model_state_bytes().total,
        "expected": per_element * (p_split / TENSOR + p_whole),
        "padding": 16 * padding,
        "counters": sum(v.element_size() for v in counters if torch.is_tensor(v) and v.dim() == 0),
        "headline": 16 * (p_split + p_whole) / (TENSOR * data),
    }


def four_rank_cases(workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["stage 1, gas 2"] = train_case(1, gas=2, memory=True)
    out["stage 2, gas 2"] = train_case(2, gas=2, memory=True)
    out["SGD, stage 3, gas 2"] = sgd_case(3, 2, 0.5)
    # Stage 3 with accumulation 2 and clipping; then a checkpoint, and one more step.
    config = tp_config(3, gas=2, clip=0.5, **{"verify_replicated": True})
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=config)
    trace, _ = train_engine(engine, STEPS, 2, data_index())
    out["memory"] = {
        1: out["stage 1, gas 2"]["memory"],
        2: out["stage 2, gas 2"]["memory"],
        3: model_state_formula(engine, 3),
    }
    reference, expected = reference_run(STEPS, 2, data_size(), clip=0.5)
    out["stage 3, gas 2"] = compare(
        trace, engine.state_dict(), reference, expected, FP32_BOUND, "stage 3, gas 2"
    )
    engine.save_checkpoint(workdir, tag="tp")
    out["saved"] = engine.state_dict(rank0_only=True)
    # One more step on the next global batch, to compare a resumed run with.
    for micro in range(2):
        batch = batch_for(STEPS, micro, data_index())
        engine.backward(engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
        engine.step()
    out["continued"] = engine.state_dict(rank0_only=True)
    engine.destroy()
    # The engine's own loader: a tensor group reads the same samples, data ranks others.
    engine, _, loader, _ = zerodp.initialize(
        model=build_llama(), config=tp_config(1), training_data=TokenDataset()
    )
    first = next(iter(loader))["input_ids"]
    everyone = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, first)
    out["loader"] = [[torch.equal(a, b) for b in everyone] for a in everyone]
    engine.destroy()
    return out if dist.get_rank() == 0 else {"memory": out["memory"]}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("tensor_parallel")
    pool = WorkerPool(4)
    try:
        results = pool.run(four_rank_cases, str(workdir), timeout_s=600)
    finally:
        pool.close()
    return {"results": results, "workdir": workdir}


def test_four_ranks_match_one_process_with_accumulation(four_ranks) -> None:
    first = four_ranks["results"][0]
    for case in ("stage 1, gas 2", "stage 2, gas 2", "stage 3, gas 2", "SGD, stage 3, gas 2"):
        assert first[case]["weights"] <= FP32_BOUND, (case, first[case])
    assert first["SGD, stage 3, gas 2"]["grads"] <= FP32_BOUND


def test_the_engines_loader_gives_a_tensor_group_the_same_batches(four_ranks) -> None:
    same = four_ranks["results"][0]["loader"]
    assert same == [
        [True, True, False, False],
        [True, True, False, False],
        [False, False, True, True],
        [False, False, True, True],
    ]


def test_model_states_per_rank_follow_the_formula(four_ranks) -> None:
    for result in four_ranks["results"]:
        for stage, memory in result["memory"].items():
            most = memory["expected"] + memory["padding"] + memory["counters"]
            assert memory["expected"] <= memory["measured"] <= most, (stage, memory)
        # Within 5% of 16 P / (T x D) at stage 3: the norms are whole, sharded over D only.
        assert result["memory"][3]["measured"] <= 1.05 * result["memory"][3]["headline"]


# -- checkpoints and export, at (T=2, D=1) --------------------------------------------------


def resume_at_one_data_rank(workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    config = tp_config(1, gas=2, clip=0.5)
    engine, _, _, _ = zerodp.initialize(model=build_llama(seed=1), config=config)
    engine.load_checkpoint(workdir, tag="tp")
    out["loaded"] = engine.state_dict()
    # The same global batch as the 4 ranks' next step: both data ranks' samples on each.
    for micro in range(2):
        batches = [batch_for(STEPS, micro, d) for d in range(2)]
        ids = torch.cat([b["input_ids"] for b in batches])
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    out["continued"] = engine.state_dict()
    # Export: whole tensors under the HF names, loadable with from_pretrained.
    save_dir = os.path.join(workdir, "export")
    assert engine.save_16bit_model(save_dir, "model.safetensors")
    streamed = dict(engine.full_parameters(bucket_bytes=4096))
    engine.module.eval()
    with torch.no_grad():
        out["logits"] = engine(input_ids=probe_tokens()).logits
    engine.destroy()
    if dist.get_rank() == 0:
        build_llama().config.save_pretrained(save_dir)
    dist.barrier()
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(save_dir).eval()
    with torch.no_grad():
        out["loaded_logits"] = loaded(input_ids=probe_tokens()).logits
    out["from_pretrained"] = max_difference(loaded.state_dict(), out["continued"])
    out["streamed"] = max_difference(
        streamed, {k: v for k, v in out["continued"].items() if k in streamed}
    )
    # Whole weights in: each rank keeps its slices (stage 3: its shards of them).
    engine, _, _, _ = zerodp.initialize(model=build_llama(seed=2), config=tp_config(3))
    engine.load_state_dict(os.path.join(save_dir, "model.safetensors"))
    out["load_state_dict"] = max_difference(engine.state_dict(), out["continued"])
    engine.destroy()
    # Another T (here 1: D = 2) loads the slices as the whole weights they were cut from
    # (tests/distributed/test_checkpoint_layouts.py trains on across layouts).
    engine, _, _, _ = zerodp.initialize(
        model=build_llama(), config={**tp_config(1, gas=2), "tensor_parallel": {"autotp_size": 1}}
    )
    engine.load_checkpoint(workdir, tag="tp")
    out["other_t"] = engine.state_dict()
    engine.destroy()
    return out


def test_a_checkpoint_loads_at_another_data_parallel_size(pools, four_ranks) -> None:
    saved = four_ranks["results"][0]
    workdir = str(four_ranks["workdir"])
    got = pools(2).run(resume_at_one_data_rank, workdir)
    for result in got:
        assert max_difference(result["loaded"], saved["saved"]) == 0.0
        # Optimizer state and counters resumed: the next step as the 4 ranks took it.
        assert max_difference(result["continued"], saved["continued"]) <= FP32_BOUND
        assert result["from_pretrained"] == 0.0 and result["streamed"] == 0.0
        assert (result["logits"] - result["loaded_logits"]).abs().max().item() <= FP32_BOUND
        assert max_difference(result["other_t"], saved["saved"]) == 0.0
        assert result["load_state_dict"] == 0.0
    consolidated = full_state_dict_from_checkpoint(workdir, tag="tp")
    assert max_difference(consolidated, saved["saved"]) == 0.0


def test_replicated_parameter_check_catches_a_drift(pools) -> None:
    pools(2).run(drift_is_caught)


def drift_is_caught() -> None:
    config = tp_config(2, verify_replicated=True)
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=config)
    norm = engine.module.model.norm.weight
    if dist.get_rank() == 1:
        with torch.no_grad():
            norm.add_(1e-3)  # a replica that drifts on one rank of the tensor group
    batch = batch_for(0, 0, 0)
    engine.backward(engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
    with pytest.raises(zerodp.DivergenceError, match=r"model\.norm\.weight"):
        engine.step()
    engine.destroy()


# -- the HF Trainer with T=2 ----------------------------------------------------------------

TRAINER_STEPS = 3


def trainer_args(output_dir: str) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=2,
        max_steps=TRAINER_STEPS,
        learning_rate=LR,
        weight_decay=0.1,
        max_grad_norm=0.5,
        activation_checkpointing=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )


def step_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if "loss" in e and "train_loss" not in e]


def tensor_parallel_trainer(workdir: str) -> dict[str, Any]:
    """ZeroDPTrainer at T=2 x D=1, stage 3: both ranks read every batch (one data rank)."""
    from transformers import LlamaForCausalLM

    from zerodp.integrations.transformers import ZeroDPTrainer

    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        "tensor_parallel": {"autotp_size": TENSOR},
    }
    trainer = ZeroDPTrainer(
        model=build_llama(),
        args=trainer_args(os.path.join(workdir, "run")),
        train_dataset=TokenDataset(),
        zerodp_config=config,
    )
    trainer.train()
    assert trainer.engine.tensor_parallel is not None
    assert trainer.get_tp_size() == TENSOR
    out: dict[str, Any] = {
        "params": trainer.engine.state_dict(),
        "logs": step_logs(trainer.state.log_history),
        "train_batch_size": trainer.engine.train_batch_size(),
    }
    saved = os.path.join(workdir, "saved")
    trainer.save_model(saved)
    trainer.engine.destroy()
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(saved)
    out["saved"] = max_difference(loaded.state_dict(), out["params"])
    return out


def test_the_hf_trainer_with_tensor_parallelism_matches_its_one_process_run(
    pools, tmp_path: Path
) -> None:
    from transformers import Trainer

    got = pools(2).run(tensor_parallel_trainer, str(tmp_path))
    plain = Trainer(
        model=build_llama(),
        args=trainer_args(str(tmp_path / "plain")),
        train_dataset=TokenDataset(),
    )
    plain.train()
    expected = {k: v.detach() for k, v in plain.model.state_dict().items()}
    theirs = step_logs(plain.state.log_history)
    for result in got:
        assert result["train_batch_size"] == MICRO * 2  # micro x accumulation x 1 data rank
        assert max_difference(result["params"], expected) <= FP32_BOUND
        assert result["saved"] == 0.0
        mine = result["logs"]
        assert [e["step"] for e in mine] == [e["step"] for e in theirs] == [1, 2, 3]
        for a, b in zip(mine, theirs, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
