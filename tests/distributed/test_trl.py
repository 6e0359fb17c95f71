"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer on zerodp (`with_zerodp`) at world size 2.

Each is compared with the same TRL trainer run in the test process on the
global batch (per-device batch x 2, no DDP), whose accelerate-prepared
sampler visits the samples in the same order, after 3 optimizer steps with
accumulation 2 and clipping at 0.5: the largest weight difference is the
order of the additions only (fp32, bound 1e-5 as in test_hf_trainer).

- SFT: full fine-tuning on fixed-length rows, stages 1 and 3.
- DPO: stage 1 with a reference model (a plain replicated model, as TRL's
  `prepare_deepspeed` keeps it below stage 3); stage 3 with a reference
  model, which is sharded by a frozen (inference) engine: its model-state
  bytes are 4 per parameter over the ranks (plus the few parameters kept
  whole), no gradient or optimizer state, its sharded parameters released
  after training; stage 3 with LoRA (the reference is the frozen copy of the
  initial adapter, "ref", that TRL adds to a PEFT policy); stage 3 with
  `precompute_ref_log_probs=True` and no reference model (TRL runs the
  policy before `train()` builds the engine).
- GRPO: stages 1 and 3, generation with HF `generate` (no vLLM). Sampling is
  made reproducible across process layouts without losing randomness:
  completion k of a prompt is sampled by the Gumbel-max trick with noise
  seeded by (k, the tokens so far) (`tests/trl_fixtures.py`), so one process
  on the global batch draws the same completions as the two ranks. At stage
  3 every rollout's `generate` runs inside `engine.gathered_for_generation()`:
  the all-gathers during a rollout are exactly one gather of every sharded
  group; with `ds3_gather_for_generation=False` the per-module hooks gather
  the model again for every token (more than `max_completion_length` times).

The single-process reference of cases that differ only in zerodp's settings
(stage, `ds3_gather_for_generation`) is run once.

Run with `-s` to see the table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import SEQ_LEN, build_llama, detached, max_abs_difference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

WORLD = 2
MICRO = 2
GAS = 2
STEPS = 3
BOUND = 1e-5
NUM_GENERATIONS = 2
COMPLETION_LENGTH = 6
# TRL arguments that only change what zerodp does (the single-process reference is the same).
ZERODP_ONLY = frozenset({"ds3_gather_for_generation"})


@dataclass(frozen=True)
class Case:
    name: str
    trainer: str  # "sft", "dpo" or "grpo"
    stage: int
    lora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reference_key(self) -> tuple[Any, ...]:
        kept = sorted((k, v) for k, v in self.extra.items() if k not in ZERODP_ONLY)
        return (self.trainer, self.lora, tuple(kept))

    @property
    def separate_reference(self) -> bool:
        return self.trainer == "dpo" and not self.lora and not self.extra

    @property
    def zerodp_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = "auto"  # the matrices are sharded
        return {"zero_optimization": zero}


CASES = [
    Case("SFT, stage 1", "sft", 1),
    Case("SFT, stage 3", "sft", 3),
    Case("DPO, stage 1, reference model", "dpo", 1),
    Case("DPO, stage 3, reference model (frozen engine)", "dpo", 3),
    Case("DPO, stage 3, LoRA (reference: a frozen copy of the adapter)", "dpo", 3, lora=True),
    Case(
        "DPO, stage 3, precompute_ref_log_probs",
        "dpo",
        3,
        extra={"precompute_ref_log_probs": True},
    ),
    Case("GRPO, stage 1", "grpo", 1),
    Case("GRPO, stage 3", "grpo", 3),
    Case(
        "GRPO, stage 3, ds3_gather_for_generation=False",
        "grpo",
        3,
        extra={"ds3_gather_for_generation": False},
    ),
]


def common_args(output_dir: str, per_device: int) -> dict[str, Any]:
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "bf16": False,
        "seed": 0,
    }


def lora(model: torch.nn.Module) -> Any:
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def precomputes(case: Case) -> bool:
    return bool(case.extra.get("precompute_ref_log_probs"))


def save_pairs(output_dir: str) -> None:
    """The DPO pairs written as a dataset on disk (see `build_trainer`)."""
    from tests import trl_fixtures as fx

    fx.dpo_dataset(64).save_to_disk(os.path.join(output_dir, "pairs"))


def build_trainer(case: Case, output_dir: str, per_device: int, trainer_class: Any) -> Any:
    """The case's TRL trainer: `trainer_class` is TRL's class or `with_zerodp` of it.

    With `precompute_ref_log_probs`, the pairs are loaded from `output_dir/pairs`
    (`save_pairs`): TRL's rank 0 writes the log-probs as a cache file next to the
    dataset's files, which the other ranks read, and an in-memory dataset's cache
    goes to a temporary directory of each process (any multi-process run, DDP too).
    """
    from tests import trl_fixtures as fx

    args = common_args(output_dir, per_device)
    from zerodp.integrations.transformers import ZeroDPTrainer

    on_zerodp = issubclass(trainer_class, ZeroDPTrainer)
    zerodp_kwargs = {"zerodp_config": case.zerodp_config} if on_zerodp else {}
    tokenizer = fx.build_tokenizer()
    if case.trainer == "sft":
        config = trl.SFTConfig(**args, max_length=SEQ_LEN, packing=False)
        return trainer_class(
            model=build_llama(),
            args=config,
            train_dataset=fx.sft_dataset(64),
            processing_class=tokenizer,
            **zerodp_kwargs,
        )
    if case.trainer == "dpo":
        config = trl.DPOConfig(**args, **case.extra, max_length=SEQ_LEN, beta=0.1)
        model = lora(build_llama()) if case.lora else build_llama()
        ref_model = build_llama() if case.separate_reference else None
        return trainer_class(
            model=model,
            ref_model=ref_model,
            args=config,
            train_dataset=(
                datasets.load_from_disk(os.path.join(output_dir, "pairs"))
                if precomputes(case)
                else fx.dpo_dataset(64)
            ),
            processing_class=tokenizer,
            **zerodp_kwargs,
        )
    config = trl.GRPOConfig(
        **args,
        **case.extra,
        num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_LENGTH,
        beta=0.0,
        generation_kwargs={"do_sample": False},  # the Gumbel noise samples (tests/trl_fixtures)
    )
    return trainer_class(
        model=fx.build_gumbel_llama(NUM_GENERATIONS),
        reward_funcs=fx.low_ids_reward,
        args=config,
        train_dataset=fx.grpo_dataset(64),
        processing_class=tokenizer,
        **zerodp_kwargs,
    )


TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer"}


# -- on the 2 ranks ------------------------------------------------------------------------


def count_rollout_gathers(trainer: Any) -> list[tuple[int, int]]:
    """(all-gather bytes, calls) of the training engine during each GRPO rollout."""
    from zerodp.comm import CollectiveKind

    rollouts: list[tuple[int, int]] = []
    generate_single_turn = trainer._generate_single_turn

    def counted(*args: Any, **kwargs: Any) -> Any:
        stats = trainer.engine.comm.stats
        before = stats.bytes[CollectiveKind.ALL_GATHER], stats.calls[CollectiveKind.ALL_GATHER]
        result = generate_single_turn(*args, **kwargs)
        after = stats.bytes[CollectiveKind.ALL_GATHER], stats.calls[CollectiveKind.ALL_GATHER]
        rollouts.append((after[0] - before[0], after[1] - before[1]))
        return result

    trainer._generate_single_turn = counted
    return rollouts


def sharded_bytes(engine: Any) -> tuple[int, int]:
    """(bytes of every sharded group gathered once, the number of sharded groups)."""
    flats = [s.flat for s in engine.groups if not s.persistent]
    return sum(f.padded_numel * f.full.element_size() for f in flats), len(flats)


def frozen_reference_state(trainer: Any) -> dict[str, Any]:
    """The reference model's frozen engine: its bytes, and which parameters are sharded."""
    import zerodp

    (engine,) = trainer.frozen_engines
    ref = trainer.ref_model
    assert engine.module is ref and engine.mode is zerodp.EngineMode.INFERENCE
    assert not any(p.requires_grad for p in ref.parameters())
    statuses = [(engine.param_status(p).name, p.numel()) for p in ref.parameters()]
    held = engine.model_state_bytes()
    return {
        "released": sum(n for status, n in statuses if status == "NOT_AVAILABLE"),
        "whole": sum(n for status, n in statuses if status != "NOT_AVAILABLE"),
        "num_params": len(statuses),
        "bytes": (held.params, held.grads, held.optimizer),
        "element_size": next(ref.parameters()).element_size(),
    }


def generate_after_training(trainer: Any) -> None:
    """The trained policy's `generate` (routed if so), and inside a block the caller opened.

    Both give the tokens of a plain model loaded with the engine's weights; the
    second call does not enter the context again (it does not nest).
    """
    import torch.distributed as dist

    from tests import trl_fixtures as fx

    engine = trainer.engine
    plain = fx.build_gumbel_llama(NUM_GENERATIONS)
    plain.load_state_dict(engine.state_dict())
    prompts = torch.tensor([[3 + dist.get_rank(), 40, 7, 11], [60, 5, 9 + dist.get_rank(), 4]])
    kwargs = {
        "attention_mask": torch.ones_like(prompts),
        "max_new_tokens": COMPLETION_LENGTH,
        "do_sample": False,
        "pad_token_id": 2,
    }
    expected = plain.generate(prompts, **kwargs)
    routed = trainer.model.generate(prompts, **kwargs)
    with engine.gathered_for_generation():
        inside = trainer.model.generate(prompts, **kwargs)
    assert torch.equal(routed, expected) and torch.equal(inside, expected)


def trl_cases(workdir: str, names: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from zerodp.integrations.transformers import with_zerodp
    from zerodp.utils import safe_get_full_fp32_param

    results: dict[str, Any] = {}
    for case in [c for c in CASES if c.name in names]:
        dist.barrier()
        trainer_class = with_zerodp(getattr(trl, TRAINERS[case.trainer]))
        out = os.path.join(workdir, f"{case.trainer}-{case.stage}-{CASES.index(case)}")
        if precomputes(case):
            if dist.get_rank() == 0:
                save_pairs(out)
            dist.barrier()
        trainer = build_trainer(case, out, MICRO, trainer_class)
        rollouts = count_rollout_gathers(trainer) if case.trainer == "grpo" else []
        plain_generate = vars(trainer.model).get("generate")
        trainer.train()
        engine = trainer.engine
        assert engine is not None and engine.global_steps == STEPS, case.name
        assert trainer.model_wrapped is trainer.model
        params = {
            n: safe_get_full_fp32_param(p).float().cpu()
            for n, p in trainer.model.named_parameters()
            if p.requires_grad
        }
        result = {
            "params": params,
            "sharded": len(engine.params.sharded_states),
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "frozen_engines": len(trainer.frozen_engines),
            "rollouts": rollouts,
            "model_once": sharded_bytes(engine),
        }
        if case.separate_reference and case.stage == 3:
            result["reference"] = frozen_reference_state(trainer)
        if case.trainer == "grpo" and case.stage == 3:
            generate_after_training(trainer)
        trainer.destroy_engines()
        # The policy's generate is its own again (the fixture's function for GRPO).
        assert vars(trainer.model).get("generate") is plain_generate, case.name
        results[case.name] = result if dist.get_rank() == 0 else {}
    return results


# -- the test -------------------------------------------------------------------------------


def initial_trainable(case: Case) -> dict[str, torch.Tensor]:
    model = lora(build_llama()) if case.lora else build_llama()
    return detached((n, p) for n, p in model.named_parameters() if p.requires_grad)


def single_process(case: Case, workdir: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    trainer_class = getattr(trl, TRAINERS[case.trainer])
    out = workdir / f"single-{CASES.index(case)}"  # its own pairs: none of the ranks' cache
    if precomputes(case):
        save_pairs(str(out))
    trainer = build_trainer(case, str(out), MICRO * WORLD, trainer_class)
    trainer.train()
    assert trainer.accelerator.num_processes == 1
    params = detached((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return params, losses


def check_reference_sharded(name: str, reference: dict[str, Any]) -> float:
    """The frozen reference at stage 3: bytes/param/N of its model states, returned for the table.

    Sharded parameters hold 1/N of their bytes per rank (plus at most one element of
    padding per parameter and rank), the ones below the persistence threshold whole.
    """
    size = reference["element_size"]
    total = reference["released"] + reference["whole"]
    assert reference["released"] > 0.9 * total, (name, reference)  # the matrices are sharded
    params, grads, optimizer = reference["bytes"]
    ideal = size * (reference["released"] // WORLD + reference["whole"])
    slack = size * WORLD * reference["num_params"]
    assert ideal <= params <= ideal + slack, (name, params, ideal, slack)
    assert grads == 0 and optimizer == 0, (name, grads, optimizer)
    return params / (total / WORLD)


def check_rollouts(case: Case, result: dict[str, Any]) -> str:
    """GRPO at stage 3: the all-gathers of each rollout; returns the table's note."""
    rollouts, (model_bytes, groups) = result["rollouts"], result["model_once"]
    assert len(rollouts) == STEPS, (case.name, rollouts)  # one rollout per optimizer step
    if case.extra.get("ds3_gather_for_generation", True):
        # Gathered once on entry, no per-module gather inside.
        assert all(r == (model_bytes, groups) for r in rollouts), (case.name, rollouts, groups)
        return "rollout: model gathered 1x"
    # The hooks gather every sharded group for each forward: one per new token.
    assert all(r[0] >= COMPLETION_LENGTH * model_bytes for r in rollouts), (case.name, rollouts)
    times = min(r[0] for r in rollouts) / model_bytes
    return f"rollout: model gathered {times:.0f}x"


def test_trl_trainers_on_zerodp_match_single_process_trl(pools, tmp_path: Path) -> None:
    names = [case.name for case in CASES]
    got = pools(WORLD).run(trl_cases, str(tmp_path), names, timeout_s=400)[0]
    table = ["", "| trainer | steps | max weight diff | where | notes |", "|---|---|---|---|---|"]
    references: dict[tuple[Any, ...], tuple[dict[str, torch.Tensor], list[float]]] = {}
    for case in CASES:
        result = got[case.name]
        if case.reference_key not in references:
            references[case.reference_key] = single_process(case, tmp_path)
        expected, losses = references[case.reference_key]
        diff, where = max_abs_difference(result["params"], expected)
        notes = ""
        if case.separate_reference and case.stage == 3:
            assert result["frozen_engines"] == 1, case.name
            per_param = check_reference_sharded(case.name, result["reference"])
            notes = f"reference: frozen engine, {per_param:.2f} bytes/param/N"
        else:
            assert result["frozen_engines"] == 0, case.name
        if case.trainer == "grpo" and case.stage == 3:
            notes = check_rollouts(case, result)
        table.append(f"| {case.name} | {STEPS} | {diff:.2e} | {where} | {notes} |")
        print(table[-1])
        assert diff <= BOUND, (case.name, diff, where)
        # GRPO's loss is ~1e-8 (advantages sum to zero per group), hence the absolute term.
        assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), case.name
        moved, _ = max_abs_difference(expected, initial_trainable(case))
        assert moved > 100 * BOUND, (case.name, "the weights hardly moved", moved)
        assert (result["sharded"] > 0) == (case.stage == 3), case.name
    print("\n".join(table))


def dpo_example(workdir: str) -> list[str]:
    from examples import dpo_lora

    dpo_lora.main(["--steps", "2", "--pairs", "64", "--batch-size", "4", "--output-dir", workdir])
    return sorted(os.listdir(os.path.join(workdir, "adapter")))


def test_dpo_lora_example_runs(pools, tmp_path: Path) -> None:
    """examples/dpo_lora.py, 2 steps: it trains, saves PEFT's files and reloads them."""
    files = pools(WORLD).run(dpo_example, str(tmp_path))[0]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), files
