"""zerodp behind the training loops people already use: HF Trainer, Lightning, Accelerate.

None of those tools has a plug-in point for an outside ZeRO engine, so the
integrations live here and use only zerodp's public surface
(`zerodp.initialize`, the engine's methods, `zerodp.config`). Nothing else in
zerodp imports this package (an import-linter contract), and each module
imports its tool lazily, so `import zerodp` never needs transformers or
lightning:

- `zerodp.integrations.transformers`: `ZeroDPTrainer`, a `transformers.Trainer`
  whose backward, step, clipping, accumulation, LR schedule, checkpoints and
  `save_model` go through the engine; `with_zerodp(cls)` does the same for any
  Trainer subclass (TRL's `SFTTrainer`, `DPOTrainer`, `GRPOTrainer`), with
  `post_training` for their reference models, generation and PEFT adapters
  (`pip install zerodp[trl]`); `trainer_config` fills a DeepSpeed-style
  config's "auto" values from `TrainingArguments`; `trainer_optimizers` and
  `trainer_saving` hold what `ZeroDPTrainer` takes over from the Trainer's
  optimizer set-up and its saving.
- `zerodp.integrations.lightning`: `ZeroDPStrategy`, a Lightning strategy
  (`pip install zerodp[lightning]`).
- Accelerate: a recipe, not a module (docs/integrations.md): Accelerate
  prepares the data loader, zerodp owns model, optimizer and backward.

See docs/integrations.md.
"""
