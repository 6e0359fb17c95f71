"""`ZeroDPTrainer`'s checkpoints and saved model, written and read through the engine.

A Trainer checkpoint (`checkpoint-N`) holds the engine's sharded checkpoint
(model, optimizer, scheduler, loss scale, counters) beside the Trainer's own
trainer_state.json and RNG files; resuming loads it in `_prepare_for_training`.
`save_model` writes what `from_pretrained` reads: the full weights gathered
from the shards (a PEFT model: its adapter's only), written by rank 0. See
[Note: what ZeroDPTrainer takes over] in `zerodp.integrations.transformers`.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import Trainer

import zerodp
from zerodp.integrations.post_training import adapter_state_dict, is_peft_model

logger = logging.getLogger("zerodp")


class TrainerSaving(Trainer):
    """The Trainer's saving and loading, replaced by the engine's."""

    # Provided by ZeroDPTrainer.
    engine: zerodp.ZeroEngine | None

    def _require_engine(self) -> zerodp.ZeroEngine:
        raise NotImplementedError  # ZeroDPTrainer's

    def _module(self) -> nn.Module:
        raise NotImplementedError  # ZeroDPTrainer's

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's sharded checkpoint (model, optimizer, scheduler, counters)."""
        self._require_engine().save_checkpoint(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        """The fp16 loss scale travels in the engine's checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Weights are restored with the engine's checkpoint in `_prepare_for_training`."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restored with the engine's checkpoint."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restored with the engine's checkpoint."""

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s", best)
        self._require_engine().load_checkpoint(best, load_module_only=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model for `from_pretrained`: config.json and safetensors weights.

        A collective: every rank calls it (the Trainer does, at checkpoints).
        Before `train()` built the engine, the Trainer's own saving applies.
        """
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        self._write_hf_model(output_dir or str(self.args.output_dir))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_hf_model(self, output_dir: str) -> None:
        """Gather the full weights (group by group) and let rank 0 `save_pretrained` them.

        HF key names, tied weights written once (save_pretrained drops the tied
        duplicates), the training dtype. Rank 0 holds the whole model once; a
        streaming writer can replace this one function. A PEFT model gathers
        only its adapter's tensors, and `PeftModel.save_pretrained` writes
        adapter_config.json and adapter_model.safetensors from them.
        """
        engine = self._require_engine()
        rank0_only = not self.args.save_on_each_node
        model = self._module()
        if is_peft_model(model):
            state_dict = adapter_state_dict(model, keep=not rank0_only or engine.global_rank == 0)
        else:
            state_dict = engine.state_dict(rank0_only=rank0_only)
        self._save(output_dir, state_dict=state_dict)  # tied names share one tensor
