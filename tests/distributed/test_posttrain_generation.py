"""Post-training at world size 2: the frozen (inference) engine, and generation at stage 3.

- A frozen model (no optimizer, or no trainable parameter) becomes an inference engine:
  its logits equal the plain model's, its bytes are the formula's (bf16, sharded at stage
  3: 2 bytes per parameter over the ranks; whole at stages 1-2), it keeps no gradient or
  optimizer state, and backward and step raise naming the fix.
- `model.generate` (HF, greedy) gives the plain model's tokens at stage 3 with
  `gathered_for_generation()`, with its layer-by-layer variant, and without it; after the
  context every parameter's status is what it was, no module hook moved, and a policy
  that generates between steps, or between a forward and its backward (the groups kept
  for that backward are released on entry and gathered again by it), trains exactly as
  one that does not.

Every rank prompts with different tokens; the reference is the same model run plainly in
the test (one process per rank, no communication needed for a forward).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.hf_models import VOCAB, build_llama
from zerodp.monitor.memory import ModelStateBytes

NEW_TOKENS = 6


def build_deep_llama() -> LlamaForCausalLM:
    """`tests.hf_models.build_llama` with 4 layers: layer by layer then gathers less than all."""
    torch.manual_seed(0)
    config = build_llama().config
    config.num_hidden_layers = 4
    return LlamaForCausalLM(config)


def _prompts(batch: int = 2, length: int = 5, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(31 * dist.get_rank() + salt)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def _generate(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=2,
    )


def _statuses(engine: zerodp.ZeroEngine) -> list[str]:
    return [engine.param_status(p).name for p in engine.module.parameters()]


def _hook_ids(model: torch.nn.Module) -> list[tuple[list[int], list[int]]]:
    return [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()]


# -- the inference engine ----------------------------------------------------------------


def _param_bytes_formula(model: torch.nn.Module, stage: int, world: int) -> tuple[int, int]:
    """(ideal bf16 bytes per rank, slack for padding: at most one element per group per rank)."""
    numel = sum(p.numel() for p in model.parameters())
    if stage < 3:
        return 2 * numel, 0
    return 2 * numel // world, 2 * world * len(list(model.parameters()))


def _training_refusals(engine: zerodp.ZeroEngine, prompts: torch.Tensor) -> list[str]:
    errors = []
    for call in (
        lambda: engine.backward(engine(prompts).logits.float().mean()),
        engine.step,
    ):
        try:
            call()
        except zerodp.UsageError as error:
            errors.append(str(error))
    return errors


def inference_engine_cases() -> dict[str, object]:
    world = dist.get_world_size()
    results: dict[str, object] = {}
    prompts = _prompts(length=8)
    for stage, how in [
        (3, "no_optimizer"),
        (3, "all_frozen"),
        (1, "no_optimizer"),
        (2, "all_frozen"),
    ]:
        plain = build_llama().to(torch.bfloat16)
        model = build_llama()
        optimizer = None
        if how == "all_frozen":
            model.requires_grad_(False)
            optimizer = optimizer_config("AdamW", lr=1e-3)  # named, but nothing to train
        config = zerodp_config(
            stage, micro_batch=2, optimizer=optimizer, dtype="bf16", persistence_threshold=0
        )
        # A scheduler block is not built (nothing steps): initialize returns None for it.
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 8}}
        engine, returned_optimizer, _, scheduler = zerodp.initialize(model=model, config=config)
        where = f"stage {stage}, {how}"
        assert engine.lr_scheduler is None, where
        assert engine.mode is zerodp.EngineMode.INFERENCE, where
        assert returned_optimizer is None and scheduler is None, where
        assert not any(p.requires_grad for p in model.parameters()), where
        with torch.no_grad():
            logits = engine(prompts).logits
            expected = plain(prompts).logits
        assert torch.equal(logits, expected), f"{where}: logits differ"
        held: ModelStateBytes = engine.model_state_bytes()
        ideal, slack = _param_bytes_formula(plain, stage, world)
        assert ideal <= held.params <= ideal + slack, (where, held, ideal, slack)
        assert held.grads == 0 and held.optimizer == 0, (where, held)
        errors = _training_refusals(engine, prompts)
        assert len(errors) == 2, (where, errors)
        assert all("inference engine" in e and "optimizer" in e for e in errors), errors
        results[where] = (held.params, ideal)
        engine.destroy()
        if how == "no_optimizer":  # the engine froze them; destroy() gives them back
            assert all(p.requires_grad for p in model.parameters()), where
    return results


def test_frozen_model_is_an_inference_engine(pools) -> None:
    results = pools(2).run(inference_engine_cases)
    assert results[0] == results[1]


def gradient_through_frozen_engine() -> None:
    """A frozen stage 3 model inside another loss: its input gets the plain model's gradient."""
    plain = build_llama()
    engine, *_ = zerodp.initialize(
        model=build_llama(), config=zerodp_config(3, micro_batch=2, persistence_threshold=0)
    )
    embeds = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours = embeds.clone().requires_grad_(True)
    theirs = embeds.clone().requires_grad_(True)
    engine(inputs_embeds=ours).logits.square().mean().backward()
    plain(inputs_embeds=theirs).logits.square().mean().backward()
    assert ours.grad is not None and theirs.grad is not None
    assert torch.equal(ours.grad, theirs.grad)
    assert all(p.grad is None for p in engine.module.parameters())
    engine.destroy()


def test_backward_through_a_frozen_engine_reaches_its_inputs(pools) -> None:
    pools(2).run(gradient_through_frozen_engine)


# -- generation --------------------------------------------------------------------------


def generation_cases(stage: int) -> dict[str, int]:
    """Tokens against the plain model for each way of generating; state after each."""
    plain = build_deep_llama()
    engine, *_ = zerodp.initialize(
        model=build_deep_llama(),
        config=zerodp_config(stage, micro_batch=2, persistence_threshold=0),
    )
    model = engine.module
    prompts = _prompts()
    expected = _generate(plain, prompts)
    total = sum(p.numel() for p in model.parameters())
    peaks: dict[str, int] = {}
    statuses, hooks = _statuses(engine), _hook_ids(model)
    contexts = {  # name -> the context's arguments (None: plain generate, no context)
        "plain": None,
        "gathered": {},
        "layer_by_layer": {"layer_by_layer": True},
        "one_layer_at_a_time": {
            "layer_by_layer": True,
            "blocks": list(model.model.layers),
            "prefetch_blocks": 0,
        },
    }
    for mode, arguments in contexts.items():
        if arguments is None:
            tokens = _generate(model, prompts)
        else:
            with engine.gathered_for_generation(**arguments) as report:
                if stage == 3 and mode == "gathered":  # no hook left on any module but the root
                    inner = [m for m in model.modules() if m is not model]
                    assert not any(m._forward_pre_hooks or m._forward_hooks for m in inner)
                tokens = _generate(model, prompts)
            peaks[mode] = report.peak_gathered_numel
        assert torch.equal(tokens, expected), f"stage {stage}, {mode}: tokens differ"
        assert _statuses(engine) == statuses, f"stage {stage}, {mode}: status changed"
        assert _hook_ids(model) == hooks, f"stage {stage}, {mode}: hooks moved"
    if stage == 3:
        layers = model.model.layers
        block = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        rest = total - sum(p.numel() for p in layers.parameters())
        padding = 2 * len(list(model.parameters()))  # at most one element per group and rank
        assert peaks["gathered"] >= total, peaks
        # The rest of the model and two blocks at most (one running, one prefetched) ...
        assert peaks["layer_by_layer"] <= rest + 2 * block + padding, (peaks, rest, block)
        assert peaks["layer_by_layer"] < total, (peaks, total)
        # ... or one, without prefetch.
        assert peaks["one_layer_at_a_time"] <= rest + block + padding, (peaks, rest, block)
    else:
        assert set(peaks.values()) == {0}, peaks
    engine.destroy()
    return peaks


@pytest.mark.parametrize("stage", [1, 3])
def test_generate_tokens_equal_the_plain_model(pools, stage: int) -> None:
    pools(2).run(generation_cases, stage)


def _generate_checked(engine: zerodp.ZeroEngine, salt: int) -> int:
    """Generate inside the context; afterwards nothing is gathered: what a forward kept for
    its backward is released on entry, on every rank alike, and nothing else was gathered.
    Returns how many were gathered before."""
    before = _statuses(engine)
    with engine.gathered_for_generation():
        _generate(engine.module, _prompts(salt=salt))
    assert set(_statuses(engine)) == {"NOT_AVAILABLE"}, _statuses(engine)
    return before.count("AVAILABLE")


def _train_steps(generate_between: bool, steps: int = 3) -> list[torch.Tensor]:
    """Train at stage 3; optionally generate after each forward (before its backward, while
    the forward keeps groups gathered for it: the context releases them, the backward
    gathers them again) and after each step."""
    model = build_llama()
    config = zerodp_config(
        3, micro_batch=2, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
    )
    engine, *_ = zerodp.initialize(model=model, config=config)
    kept = 0
    for step in range(steps):
        ids = _prompts(length=8, salt=100 + step)
        loss = engine(input_ids=ids, labels=ids).loss
        if generate_between:
            kept += _generate_checked(engine, salt=step)
        engine.backward(loss)
        engine.step()
        if generate_between:
            _generate_checked(engine, salt=step)
    if generate_between:
        assert kept > 0, "no group was kept for a backward: their release was not exercised"
    weights = [t.clone() for t in engine.state_dict().values()]
    engine.destroy()
    return weights


def policy_generates_between_steps() -> None:
    quiet = _train_steps(generate_between=False)
    busy = _train_steps(generate_between=True)
    for a, b in zip(quiet, busy, strict=True):
        assert torch.equal(a, b), "generation between steps changed training"


def test_policy_generating_between_steps_trains_exactly(pools) -> None:
    pools(2).run(policy_generates_between_steps)


def _forward_with_grad(model: torch.nn.Module) -> None:
    with torch.enable_grad():
        model(_prompts())


def _enter_twice(engine: zerodp.ZeroEngine) -> None:
    with engine.gathered_for_generation():
        pass


def generation_misuse() -> list[str]:
    engine, *_ = zerodp.initialize(
        model=build_llama(), config=zerodp_config(3, micro_batch=2, persistence_threshold=0)
    )
    before = _statuses(engine)
    layer = engine.module.model.layers[0]
    hooks = _hook_ids(layer)[0]
    calls: list[int] = []
    messages = []
    assert not engine.generation_block_open
    with engine.gathered_for_generation():
        assert engine.generation_block_open
        for call in (lambda: _forward_with_grad(engine.module), lambda: _enter_twice(engine)):
            try:
                call()
            except zerodp.UsageError as error:
                messages.append(str(error))
        # A hook registered inside stays; the stage 3 hooks come back around it.
        mine = layer.register_forward_hook(lambda *_: calls.append(1))
    assert _statuses(engine) == before
    pre, post = _hook_ids(layer)[0]
    assert (pre, post) == (hooks[0], [*hooks[1], mine.id]), (hooks, pre, post)
    with torch.no_grad():
        engine(_prompts())
    assert calls == [1]
    mine.remove()
    with pytest.raises(KeyError), engine.gathered_for_generation():
        raise KeyError("user code failed inside")
    assert _statuses(engine) == before and not engine.generation_block_open
    assert torch.is_grad_enabled()
    engine.destroy()
    return messages


def test_generation_context_refuses_misuse_and_restores_on_error(pools) -> None:
    messages = pools(2).run(generation_misuse)[0]
    assert len(messages) == 2, messages
    assert "gradients enabled" in messages[0]
    assert "open already" in messages[1]
