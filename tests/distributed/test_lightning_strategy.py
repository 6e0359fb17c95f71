"""ZeroDPStrategy on 2 ranks against Lightning's own single-device run on the same batches.

On 2 ranks Lightning puts a shuffling DistributedSampler (seed 0) under the
train loader, which gives rank r every second sample of one permutation; the
single-device run gets a DistributedSampler with one replica and the same seed,
so its step k with twice the batch sees exactly the 4 samples the two ranks see
together. Both runs
accumulate 2 batches, clip at 0.5 by the global norm and step a per-step
LambdaLR from configure_optimizers; fp32, so the bound is round-off (1e-5,
1% of one AdamW step).

Resume: a fit saved at the end of epoch 1 (an engine checkpoint directory
written by ModelCheckpoint) and resumed by a new module and Trainer ends
bitwise equal to the uninterrupted fit: the engine restores the fp32 shards
and optimizer state exactly, Lightning its loops and the scheduler, and the
second epoch's data order does not depend on the first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import TokenDataset, build_llama, detached, max_abs_difference

pl = pytest.importorskip("lightning.pytorch")

WORLD = 2
MICRO = 2
GAS = 2
EPOCHS = 2
NUM_SAMPLES = 32  # 8 micro-batches per rank and epoch: 4 optimizer steps per epoch
LR = 1e-3
CLIP = 0.5
BOUND = 1e-5


class LlamaModule(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = build_llama(seed)
        # The engine's own hooks sit on this module's forward: count that they would run.
        self.forward_calls = 0
        self.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forward_calls += 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        total = EPOCHS * NUM_SAMPLES // (MICRO * GAS * WORLD)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class GradNorms(pl.Callback):
    """The gradient norm of every optimizer step, before clipping.

    AdamW hardly sees a constant factor on the gradients, so the weights alone
    would not show a wrong loss scale; the norms do. The reference's are computed
    from the parameters' gradients before Lightning clips them; zerodp's are the
    engine's, read after its step.
    """

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if getattr(trainer.strategy, "engine", None) is None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            self.norms.append(torch.nn.utils.get_total_norm(grads).item())

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and trainer.global_step > len(self.norms):
            self.norms.append(engine.get_global_grad_norm())


def fit(strategy: Any, devices: int, batch_size: int, **kwargs: Any) -> LlamaModule:
    ckpt_path = kwargs.pop("ckpt_path", None)
    module = LlamaModule(seed=kwargs.pop("seed", 0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=GAS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    dataset = TokenDataset(NUM_SAMPLES)
    sampler = None
    if devices == 1:  # the permutation Lightning's DistributedSampler uses on 2 ranks
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    assert trainer.global_step == EPOCHS * NUM_SAMPLES // (MICRO * GAS * WORLD)
    return module


def lightning_cases(workdir: str, stages: list[int]) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zerodp.integrations.lightning import ZeroDPStrategy

    results: dict[str, Any] = {}
    for stage in stages:
        config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        checkpoints = os.path.join(workdir, f"stage{stage}")
        saver = ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1)
        norms = GradNorms()
        module = fit(ZeroDPStrategy(config), WORLD, MICRO, callbacks=[saver, norms])
        assert module.forward_calls == EPOCHS * NUM_SAMPLES // (MICRO * WORLD)  # every step
        # After fit the engine is gone and every rank holds the plain, trained model.
        results[f"stage {stage}"] = detached(module.model.named_parameters())
        results[f"norms {stage}"] = norms.norms
        if stage == 3:
            first_epoch = os.path.join(checkpoints, "epoch=0-step=4.ckpt")
            assert os.path.isfile(os.path.join(first_epoch, "latest")), os.listdir(checkpoints)
            resumed = fit(
                ZeroDPStrategy(config),
                WORLD,
                MICRO,
                seed=1,  # other initial weights: the checkpoint must replace them
                ckpt_path=first_epoch,
                enable_checkpointing=False,
            )
            results["resumed"] = detached(resumed.model.named_parameters())
    return results if dist.get_rank() == 0 else {}


def test_zerodp_strategy_matches_single_device_lightning(pools, tmp_path: Path) -> None:
    stages = [1, 2, 3]
    got = pools(WORLD).run(lightning_cases, str(tmp_path), stages, timeout_s=240)[0]
    norms = GradNorms()
    reference = fit("auto", 1, MICRO * WORLD, enable_checkpointing=False, callbacks=[norms])
    expected = detached(reference.model.named_parameters())
    lines = ["", "| Lightning | max weight diff after 8 steps | where |", "|---|---|---|"]
    for stage in stages:
        diff, where = max_abs_difference(got[f"stage {stage}"], expected)
        lines.append(f"| stage {stage} | {diff:.2e} | {where} |")
        assert diff <= BOUND, (stage, diff, where)
        assert got[f"norms {stage}"] == pytest.approx(norms.norms, rel=1e-5), stage
    resumed, _ = max_abs_difference(got["resumed"], got["stage 3"])
    lines.append(f"| stage 3 resumed after epoch 1 vs uninterrupted | {resumed:.2e} | |")
    print("\n".join(lines))
    assert resumed == 0.0


def refusals() -> list[str]:
    from zerodp.integrations.lightning import ZeroDPStrategy

    class Manual(LlamaModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    stage2 = {"zero_optimization": {"stage": 2}}
    with_optimizer = {**stage2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    messages = []
    for module, kwargs, config in (
        (Manual(), {}, stage2),
        (LlamaModule(), {"gradient_clip_algorithm": "value", "gradient_clip_val": 1.0}, stage2),
        (LlamaModule(), {"precision": "bf16-mixed"}, stage2),
        (LlamaModule(), {}, with_optimizer),
        (
            LlamaModule(),
            {"accumulate_grad_batches": 2},
            {**stage2, "gradient_accumulation_steps": 4},
        ),
    ):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=ZeroDPStrategy(config),
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            **kwargs,
        )
        loader = torch.utils.data.DataLoader(TokenDataset(8), batch_size=MICRO)
        try:
            trainer.fit(module, loader)
        except Exception as error:
            messages.append(str(error))
        else:
            messages.append("")
    return messages


def test_zerodp_strategy_refuses_what_it_does_not_do(pools) -> None:
    messages = pools(WORLD).run(refusals)[0]
    assert "manual optimization" in messages[0]
    assert "gradient_clip_algorithm='value'" in messages[1]
    assert "precision plugin" in messages[2]
    assert "'optimizer' block and configure_optimizers returned an optimizer" in messages[3]
    assert (
        "'gradient_accumulation_steps' is 4, but Trainer(accumulate_grad_batches) is 2"
        in messages[4]
    )
