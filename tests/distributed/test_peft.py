"""PEFT LoRA on zerodp at world size 2, against PEFT trained by the plain Trainer in one process.

The model is the tiny Llama of `tests/hf_models.py` with LoRA adapters on
the attention and MLP projections, added by `peft.get_peft_model` before the
engine exists, as PEFT users do: on a plain model (stages 1, 2, 3), on a
model built sharded under `zerodp.zero.Init` (stage 3), and on a model an
engine already manages (refused at the next forward, then trained by a new
engine after `destroy()`). `ZeroDPTrainer`
trains it on 2 ranks (micro batch 2, accumulation 2, clipping at 0.5); the
reference is the plain `transformers.Trainer` on the same PEFT model in one
process with the global batch (micro batch 4), whose accelerate-prepared
sampler visits the samples in the same order. After 3 steps:

- the adapters equal the reference's (fp32: the order of the additions only,
  bound 1e-5, as in test_hf_trainer);
- every base weight is bitwise its initial value (only the adapters train);
- `save_model` writes PEFT's files (adapter_config.json and
  adapter_model.safetensors, adapter tensors only), and
  `PeftModel.from_pretrained` on a fresh base model gives the trained
  adapters bitwise and the same logits.

Run with `-s` to see the table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import TokenDataset, build_llama, detached, max_abs_difference, probe_tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORLD = 2
MICRO = 2
GAS = 2
STEPS = 3
LR = 1e-2
BOUND = 1e-5
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
OPTIMIZER = {"type": "AdamW", "params": {"lr": LR}}

PLAIN, ZERO_INIT, AFTER_INITIALIZE = "plain", "zero.Init", "after initialize"
# name -> (zero_optimization block, how the base model and the adapters come to be)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "stage 1": ({"stage": 1}, PLAIN),
    "stage 2": ({"stage": 2}, PLAIN),
    # "auto" (10 x hidden size): the base matrices are sharded, the small adapters kept whole.
    "stage 3": ({"stage": 3, "stage3_param_persistence_threshold": "auto"}, PLAIN),
    # Threshold 0: the adapters, added after the base was built sharded, are sharded too.
    "stage 3, zero.Init": ({"stage": 3, "stage3_param_persistence_threshold": 0}, ZERO_INIT),
    # Adapters added to a model an engine already manages: its next forward refuses them (the
    # engine would not step them); engine.destroy() and a new engine train them.
    "stage 3, adapters after initialize": (
        {"stage": 3, "stage3_param_persistence_threshold": "auto"},
        AFTER_INITIALIZE,
    ),
}


def lora_model(base: torch.nn.Module) -> Any:
    torch.manual_seed(1)  # LoRA's A matrices are drawn from the global generator
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(base, config)


def training_args(output_dir: str, per_device: int) -> Any:
    return transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )


# -- on the 2 ranks ------------------------------------------------------------------------


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from zerodp.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).float().cpu() for n, p in model.named_parameters()}


def train_case(name: str, workdir: str) -> dict[str, Any]:
    import torch.distributed as dist

    import zerodp
    from zerodp.integrations.transformers import ZeroDPTrainer

    zero, how = CASES[name]
    config = {"zero_optimization": dict(zero)}
    if how == ZERO_INIT:
        with zerodp.zero.Init(config={**config, "train_micro_batch_size_per_gpu": MICRO}):
            base = build_llama()
    else:
        base = build_llama()
    if how == AFTER_INITIALIZE:
        first, _, _, _ = zerodp.initialize(
            model=base,
            config={**config, "train_micro_batch_size_per_gpu": MICRO, "optimizer": OPTIMIZER},
        )
        model = lora_model(base)
        with pytest.raises(zerodp.UsageError, match=r"before zerodp.initialize"):
            model(input_ids=probe_tokens())
        first.destroy()
    else:
        model = lora_model(base)
    initial_base = {
        n: zerodp.utils.safe_get_full_fp32_param(p).clone()
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    trainer = ZeroDPTrainer(
        model=model,
        args=training_args(os.path.join(workdir, "run"), MICRO),
        train_dataset=TokenDataset(),
        zerodp_config=config,
    )
    trainer.train()
    engine = trainer.engine
    assert engine is not None and engine.global_steps == STEPS
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    stepped = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    params = full_params(model)
    base_changed = [n for n, value in initial_base.items() if not torch.equal(value, params[n])]
    out = os.path.join(workdir, "saved")
    trainer.save_model(out)
    model.eval()
    with torch.no_grad():  # a collective at stage 3
        logits = model(input_ids=probe_tokens()).logits.float()
    result = {
        "adapters": {n: params[n] for n in sorted(trainable)},
        "base_changed": base_changed,
        "num_stepped": int(torch.tensor(stepped).item()),
        "num_sharded": len(engine.params.sharded_states),
        "adapters_sharded": any(
            zerodp.zero.param_status(p) != zerodp.zero.ParamStatus.AVAILABLE
            for n, p in model.named_parameters()
            if n in trainable
        ),
        "logits": logits,
        "saved": out,
    }
    dist.barrier()
    if dist.get_rank() == 0:
        result["files"] = sorted(os.listdir(out))
        result["reloaded"] = reload_adapter(out)
    trainer.destroy_engines()
    return result if dist.get_rank() == 0 else {"num_stepped": result["num_stepped"]}


def reload_adapter(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    loaded = peft.PeftModel.from_pretrained(build_llama(), path).eval()
    with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as handle:
        keys = sorted(handle.keys())
    with torch.no_grad():
        logits = loaded(input_ids=probe_tokens()).logits.float()
    trainable = {n: p.detach().clone() for n, p in loaded.named_parameters() if "lora_" in n}
    return {"adapters": trainable, "keys": keys, "logits": logits}


def peft_cases(workdir: str) -> dict[str, Any]:
    import torch.distributed as dist

    results = {}
    for name in CASES:
        where = os.path.join(workdir, name.replace(" ", "_").replace(",", "").replace(".", ""))
        os.makedirs(where, exist_ok=True)
        dist.barrier()
        results[name] = train_case(name, where)
    return results


# -- the single-process reference ----------------------------------------------------------


def plain_peft_run(workdir: Path) -> dict[str, torch.Tensor]:
    model = lora_model(build_llama())
    trainer = transformers.Trainer(
        model=model,
        args=training_args(str(workdir / "plain"), MICRO * WORLD),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    assert trainer.accelerator.num_processes == 1
    return detached((n, p) for n, p in model.named_parameters() if p.requires_grad)


def test_lora_trains_only_the_adapters_exactly_as_single_process_peft(
    pools, tmp_path: Path
) -> None:
    got = pools(WORLD).run(peft_cases, str(tmp_path), timeout_s=300)
    expected = plain_peft_run(tmp_path)
    num_adapter = sum(t.numel() for t in expected.values())
    table = ["", "| case | steps | max adapter diff | where | reloaded |", "|---|---|---|---|---|"]
    for name in CASES:
        result = got[0][name]
        diff, where = max_abs_difference(result["adapters"], expected)
        assert diff <= BOUND, (name, diff, where)
        # Every rank's optimizer holds its shard of the adapters and nothing else.
        stepped = [rank[name]["num_stepped"] for rank in got]
        assert sum(stepped) >= num_adapter and max(stepped) < num_adapter, (name, stepped)
        assert result["base_changed"] == [], (name, result["base_changed"])
        if "stage 3" in name:
            assert result["num_sharded"] > 0, name
        assert result["adapters_sharded"] == (CASES[name][1] == ZERO_INIT), name
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["files"])
        assert not any(f.startswith("model") for f in result["files"]), result["files"]
        reloaded = result["reloaded"]
        assert all("lora_" in key for key in reloaded["keys"]), reloaded["keys"]
        assert len(reloaded["keys"]) == len(expected), reloaded["keys"]
        saved_diff, _ = max_abs_difference(
            {n.replace(".default", ""): t for n, t in reloaded["adapters"].items()},
            {n.replace(".default", ""): t for n, t in result["adapters"].items()},
        )
        assert saved_diff == 0.0, (name, saved_diff)
        logits_diff = (reloaded["logits"] - result["logits"]).abs().max().item()
        assert logits_diff == 0.0, (name, logits_diff)
        table.append(
            f"| {name} | {STEPS} | {diff:.2e} | {where} | adapters {saved_diff:.0e}, "
            f"logits {logits_diff:.0e} |"
        )
    print("\n".join(table))
