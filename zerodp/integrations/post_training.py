"""What post-training trainers (TRL's, PEFT users') need from zerodp beyond the training step.

TRL and PEFT call DeepSpeed-specific paths when they detect DeepSpeed; under
zerodp they see a plain `Trainer` with no DeepSpeed plugin, so each of those
paths needs a zerodp equivalent that comes in through a seam the Trainer
already has (docs/post-training.md, "TRL's trainers on zerodp", has the whole table):

- A frozen model next to the policy (DPO's reference, GRPO's reference and
  reward models): TRL hands it to `accelerator.prepare_model(m,
  evaluation_mode=True)` unless DeepSpeed is on, where `prepare_deepspeed`
  builds an inference engine at stage 3 (and a plain model below it).
  `prepare_frozen_model` does the same with zerodp's frozen engine.
- Generation: TRL's `unwrap_model_for_generation` gathers every parameter
  and takes the stage 3 hooks off around `generate` under DeepSpeed, and
  yields the model untouched otherwise. At stage 3 `GenerationRoute` makes
  the policy's own `generate` enter `engine.gathered_for_generation()`, so
  every caller (GRPO's and RLOO's rollouts, a callback, the user) generates
  with the model gathered once per call instead of once per token.
- PEFT adapters: the engine trains only what requires a gradient, so a
  `PeftModel` needs nothing at the step; saving gathers only the adapter's
  tensors (`adapter_state_dict`), where the full state dict would gather the
  whole base model on rank 0 to keep a few LoRA matrices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

import zerodp
from zerodp.errors import ConfigError
from zerodp.zero import GatheredParameters

# Config blocks that only a model with an optimizer uses; a frozen engine is built without them.
_TRAINING_ONLY = ("optimizer", "scheduler", "gradient_clipping")


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a `peft.PeftModel` (False when PEFT is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def frozen_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The training config (its "auto" values filled) without what needs an optimizer.

    The stage, the precision blocks, bucket and persistence settings and the
    batch keys stay, so the frozen model is sharded and cast as the policy is.
    """
    frozen = {key: value for key, value in config.items() if key not in _TRAINING_ONLY}
    zero = dict(frozen.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    frozen["zero_optimization"] = zero
    return frozen


def prepare_frozen_model(model: nn.Module, config: dict[str, Any]) -> zerodp.ZeroEngine | None:
    """A frozen engine on `model` when `config` is at stage 3, else None (the caller places it).

    As TRL's `prepare_deepspeed`: below stage 3 every rank keeps the whole
    frozen model, at stage 3 it is sharded like the policy. With no
    optimizer in its config the engine is an inference engine: it freezes
    the parameters (TRL runs the reference under `no_grad`) and holds no
    gradient or optimizer state.
    """
    if _stage(config) != 3:
        return None
    engine, _, _, _ = zerodp.initialize(model=model, config=frozen_model_config(config))
    engine.eval()
    return engine


class GenerationRoute:
    """`model.generate` run inside `engine.gathered_for_generation()`, until `remove()`.

    Installed as an instance attribute over whatever `model.generate` was (the
    class's method, or a function the user set on the instance), so every
    caller goes through it without knowing about zerodp. A call made inside
    a `gathered_for_generation()` block the caller opened runs as it is (the
    context does not nest). `remove()` puts back what was there, unless
    someone has replaced the wrapper since, whose function then stays. A
    `copy.deepcopy` of the model taken while the route is on keeps calling
    the original's `generate` (functions are copied by reference): copy it
    before `train()` or after `destroy_engines()`. Only `generate` is routed:
    `generate_batch` (TRL's `use_transformers_continuous_batching`) gathers
    module by module through the hooks.
    """

    def __init__(self, model: nn.Module, engine: zerodp.ZeroEngine) -> None:
        self.model = model
        self._own = vars(model).get("generate")  # a function set on the instance, if any
        inner = cast(Callable[..., Any], model.generate)

        @functools.wraps(inner)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if engine.generation_block_open:
                return inner(*args, **kwargs)
            with engine.gathered_for_generation():
                return inner(*args, **kwargs)

        self.wrapper = generate
        vars(model)["generate"] = generate  # an instance attribute, over the class's method

    def remove(self) -> None:
        if vars(self.model).get("generate") is not self.wrapper:
            return  # replaced since: leave the newer function in place
        if self._own is not None:
            vars(self.model)["generate"] = self._own
        else:
            del vars(self.model)["generate"]


def route_generation(
    model: nn.Module, engine: zerodp.ZeroEngine, args: Any
) -> GenerationRoute | None:
    """A `GenerationRoute` on `model` at stage 3, else None (nothing to gather).

    None too when the TRL config says `ds3_gather_for_generation=False`: there
    TRL generates without gathering under DeepSpeed, so that only the running
    (and prefetched) modules are whole; zerodp's per-module hooks do the same.
    """
    if engine.zero_optimization_stage() != 3 or not callable(getattr(model, "generate", None)):
        return None
    if not getattr(args, "ds3_gather_for_generation", True):
        return None
    return GenerationRoute(model, engine)


class PostTrainingParts:
    """What a trainer builds next to its training engine: frozen engines, the generation route."""

    def __init__(self) -> None:
        self.frozen_engines: list[zerodp.ZeroEngine] = []
        self.route: GenerationRoute | None = None

    def prepare_frozen(self, model: nn.Module, config: dict[str, Any]) -> bool:
        """Shard `model` on a frozen engine at stage 3 (True), or leave it to the caller."""
        engine = prepare_frozen_model(model, config)
        if engine is None:
            return False
        self.frozen_engines.append(engine)
        return True

    def route_generation(self, model: nn.Module, engine: zerodp.ZeroEngine, args: Any) -> None:
        self.unroute_generation()
        self.route = route_generation(model, engine, args)

    def unroute_generation(self) -> None:
        if self.route is not None:
            self.route.remove()
            self.route = None

    def destroy(self) -> None:
        """Take the route off and destroy the frozen engines (their models stay, unsharded)."""
        self.unroute_generation()
        for engine in self.frozen_engines:
            engine.destroy()
        self.frozen_engines = []


def refuse_unsupported_post_training(args: Any, config: dict[str, Any]) -> None:
    """TRL options whose DeepSpeed path has no zerodp equivalent yet, refused before training.

    `sync_ref_model=True` (TR-DPO) mixes the policy into the reference with
    `param.data` arithmetic, which at stage 3 would read and write shards.
    """
    if getattr(args, "sync_ref_model", False) and _stage(config) == 3:
        raise ConfigError(
            "sync_ref_model=True is not supported at zero_optimization.stage 3 (the reference "
            "update would read and write parameter shards); use stage 1 or 2, or "
            "sync_ref_model=False"
        )


def _stage(config: dict[str, Any]) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def adapter_state_dict(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The full tensors `PeftModel.save_pretrained` writes, under the PeftModel's own keys.

    A collective at stage 3: every rank gathers the adapter's groups; only
    ranks with `keep` return copies (the others an empty dict). PEFT decides
    which keys belong to the adapter (LoRA matrices, `modules_to_save`,
    embeddings when it saves them); it is asked on the model's un-gathered
    state dict and answers with the same tensor objects, which are then
    gathered and copied. Should a PEFT version answer with new tensors, the
    whole model's state dict is gathered instead (right, only heavier).
    """
    from peft.utils import get_peft_model_state_dict

    held = model.state_dict(keep_vars=True)
    chosen: dict[int, torch.Tensor] = {}
    for adapter in getattr(model, "peft_config", {"default": None}):
        picked = get_peft_model_state_dict(model, state_dict=held, adapter_name=adapter)
        chosen.update({id(value): value for value in picked.values()})
    keys = [key for key, value in held.items() if id(value) in chosen]
    if len(set(map(id, (held[key] for key in keys)))) != len(chosen):
        return zerodp.zero.full_state_dict(model, rank0_only=not keep)
    params = [held[key] for key in keys if isinstance(held[key], nn.Parameter)]
    with GatheredParameters(params):
        if not keep:
            return {}
        return {key: held[key].detach().cpu().clone() for key in keys}
