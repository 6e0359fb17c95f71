"""A real third-party model at stage 3: HuggingFace GPT-2 against the data-parallel reference.

zerodp's own test models are written with zerodp in mind; `GPT2LMHeadModel`
is not. It ties its input and output embeddings through `transformers`' own
machinery, keeps Conv1D weights transposed, reads parameters inside nested
submodules and computes its loss inside `forward`, so it checks that
gathering on use, releasing after use and the reduction of sharded gradients
hold up on code zerodp was not shaped around.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import assert_all_released
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_grads_match, assert_params_match
from zerodp.zero import ParamStatus, is_persistent, param_status

VOCAB = 512
SEQ_LEN = 16
BATCH = 2
LR = 1e-2
WEIGHT_DECAY = 0.01
# Elements of wpe (64 positions x 64): below it the embeddings, attention and MLP weights
# are sharded while position embeddings, biases and LayerNorms stay whole on every rank.
MIXED_THRESHOLD = 5_000


def build_gpt2() -> GPT2LMHeadModel:
    """A tiny random GPT-2 without dropout, so zerodp and the reference compute the same thing."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tokens_for(step: int) -> torch.Tensor:
    """Different tokens on every rank and step, so the gradient average matters."""
    generator = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """GPT-2's own causal-LM loss (it shifts the labels inside forward)."""
    return model(input_ids=tokens, labels=tokens).loss


def assert_tied(model: GPT2LMHeadModel, where: str) -> None:
    assert model.lm_head.weight is model.transformer.wte.weight, f"{where}: embeddings untied"


def assert_released(model: torch.nn.Module, where: str) -> None:
    """After step() no sharded parameter may stay gathered, nothing is left in flight, and
    every persistent parameter is available (`tests.lockstep.assert_all_released`)."""
    for name, param in model.named_parameters():
        if not is_persistent(param):
            status = param_status(param)
            assert status is ParamStatus.NOT_AVAILABLE, f"{where}: {name} is {status}"
    assert_all_released(model, 3, where)


def gpt2_parity(threshold: int, steps: int) -> int:
    """Train zerodp and the reference side by side; return how many parameters were sharded."""
    model = build_gpt2()
    reference = ReferenceDP(
        copy.deepcopy(model),
        lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
    )
    config = zerodp_config(
        3,
        micro_batch=BATCH,
        optimizer=optimizer_config("AdamW", lr=LR, weight_decay=WEIGHT_DECAY),
        persistence_threshold=threshold,
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    assert_tied(model, "after initialize")
    for step in range(steps):
        where = f"GPT-2, threshold {threshold}, step {step}"
        tokens = tokens_for(step)
        engine.backward(lm_loss(engine, tokens))
        reference.run_backward(lambda t=tokens: lm_loss(reference.model, t).backward())
        assert_grads_match(model, reference, where)
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_tied(model, where)
        assert_released(model, where)
        assert_params_match(model, reference, f"{where}, after step")
    sharded = sum(not is_persistent(p) for p in model.parameters())
    engine.destroy()
    return sharded


@pytest.mark.parametrize(
    "threshold", [0, MIXED_THRESHOLD], ids=["all_sharded", "small_params_persist"]
)
def test_hf_gpt2_matches_reference_at_stage3(pools, threshold: int) -> None:
    sharded = pools(2).run(gpt2_parity, threshold, 3)
    total = len(list(build_gpt2().parameters()))
    if threshold == 0:
        assert sharded == [total, total]
    else:
        assert 0 < sharded[0] < total, sharded
